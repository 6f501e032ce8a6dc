//! Black-box tests of tally over HTTP: the real router on port 0 with a
//! fresh database per test, and the real binary where process behaviour
//! (signals, exit codes) is the point.
//!
//! Where a test lives says which engine it needs. The modules at the top
//! run on either: `scripts/test` runs the whole suite on SQLite, then again
//! with `TALLY_TEST_ENGINE=postgres`. A test that is SQLite's own goes in
//! `on_sqlite/`, one that chooses PostgreSQL itself in `on_postgres/`; the
//! PostgreSQL pass skips both (`--skip on_sqlite:: --skip on_postgres::`).

mod budgets;
mod clients;
mod counters;
mod deletes;
mod forwarding;
mod helpers;
mod hostile_connections;
mod idempotency;
mod input_contract;
mod lifecycle;
mod lists;
#[path = "../common/loopback.rs"]
mod loopback;
mod observability;
mod on_postgres;
mod on_sqlite;
mod openapi;
#[path = "../common/postgres.rs"]
mod postgres;
#[path = "../common/replica.rs"]
mod replica;
mod writer;
