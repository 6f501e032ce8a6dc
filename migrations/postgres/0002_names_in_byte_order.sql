-- Names, days, visitors and keys compare and sort byte by byte, as Rust
-- orders strings, whatever collation the database was created with. Every
-- tally process takes its row locks in that one order: a database whose
-- default collation is not byte order (en_US.UTF-8, ICU en-US: the default
-- of many managed services) would otherwise sort `a` before `B` in SQL and
-- after it in Rust, and two processes would deadlock on them.
ALTER TABLE counters ALTER COLUMN name TYPE TEXT COLLATE "C";
ALTER TABLE budgets ALTER COLUMN name TYPE TEXT COLLATE "C";
ALTER TABLE budget_global_usage
    ALTER COLUMN budget TYPE TEXT COLLATE "C",
    ALTER COLUMN day TYPE TEXT COLLATE "C";
ALTER TABLE budget_visitor_usage
    ALTER COLUMN budget TYPE TEXT COLLATE "C",
    ALTER COLUMN day TYPE TEXT COLLATE "C",
    ALTER COLUMN visitor TYPE TEXT COLLATE "C";
ALTER TABLE idempotency_keys ALTER COLUMN key TYPE TEXT COLLATE "C";
