-- Counters: one row per name. STRICT so that an integer overflow in
-- `value + by` (which SQLite would silently turn into a REAL) is an error.
CREATE TABLE counters (
    name  TEXT    NOT NULL PRIMARY KEY,
    value INTEGER NOT NULL
) STRICT, WITHOUT ROWID;

-- Budget configuration, written only through the admin API.
CREATE TABLE budgets (
    name           TEXT    NOT NULL PRIMARY KEY,
    visitor_limit  INTEGER NOT NULL CHECK (visitor_limit >= 0),
    global_limit   INTEGER NOT NULL CHECK (global_limit >= 0),
    retention_days INTEGER NOT NULL CHECK (retention_days BETWEEN 1 AND 3650),
    timezone       TEXT    NOT NULL,
    updated_at     TEXT    NOT NULL
) STRICT, WITHOUT ROWID;

-- Per-day totals of a budget. A table of its own, so that no visitor id
-- (not even one spelled `*`) can ever address the global row.
CREATE TABLE budget_global_usage (
    budget TEXT    NOT NULL,
    day    TEXT    NOT NULL,
    calls  INTEGER NOT NULL,
    PRIMARY KEY (budget, day)
) STRICT, WITHOUT ROWID;

-- Per-day, per-visitor calls of a budget.
CREATE TABLE budget_visitor_usage (
    budget  TEXT    NOT NULL,
    day     TEXT    NOT NULL,
    visitor TEXT    NOT NULL,
    calls   INTEGER NOT NULL,
    PRIMARY KEY (budget, day, visitor)
) STRICT, WITHOUT ROWID;
