-- tally on PostgreSQL: the same tables as on SQLite, shared by every tally
-- process. Names, days and visitors are text compared byte for byte
-- (days are ISO dates, YYYY-MM-DD, so text order is date order).

-- Counters: one row per name. `bigint` arithmetic that leaves the 64-bit
-- integers is an error (SQLSTATE 22003), never a wrap.
CREATE TABLE counters (
    name  TEXT   NOT NULL PRIMARY KEY,
    value BIGINT NOT NULL
);

-- Budget configuration, written only through the admin API.
CREATE TABLE budgets (
    name           TEXT   NOT NULL PRIMARY KEY,
    visitor_limit  BIGINT NOT NULL CHECK (visitor_limit BETWEEN 0 AND 4294967295),
    global_limit   BIGINT NOT NULL CHECK (global_limit BETWEEN 0 AND 4294967295),
    retention_days BIGINT NOT NULL CHECK (retention_days BETWEEN 1 AND 3650),
    timezone       TEXT   NOT NULL,
    updated_at     TEXT   NOT NULL
);

-- Per-day totals of a budget. Its row is also the day's lock: every
-- transaction that reads or writes a day's usage locks this row first.
CREATE TABLE budget_global_usage (
    budget TEXT   NOT NULL,
    day    TEXT   NOT NULL,
    calls  BIGINT NOT NULL,
    PRIMARY KEY (budget, day)
);

-- Per-day, per-visitor calls of a budget.
CREATE TABLE budget_visitor_usage (
    budget  TEXT   NOT NULL,
    day     TEXT   NOT NULL,
    visitor TEXT   NOT NULL,
    calls   BIGINT NOT NULL,
    PRIMARY KEY (budget, day, visitor)
);

-- Idempotency keys: what a keyed write answered. The primary key is what
-- makes a retry on another tally process wait for the first try and
-- replay its answer.
CREATE TABLE idempotency_keys (
    key         TEXT   NOT NULL PRIMARY KEY,
    fingerprint TEXT   NOT NULL,
    result      TEXT   NOT NULL,
    created_at  BIGINT NOT NULL
);

CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
