//! Tests that are SQLite's own: they look at its files and WAL, run it
//! under Litestream, fill its disk, read or write rows behind the API in
//! SQLite's SQL, or start the binary on a file path. On PostgreSQL they
//! would fail or test nothing, so `scripts/test` runs them once, on SQLite,
//! and its PostgreSQL pass skips this module (`--skip on_sqlite::`).
//!
//! A test that needs SQLite goes here: a whole topic as a file of its own,
//! a single test in the file named after the module it would otherwise be
//! in (`on_sqlite::budgets` beside `budgets`), using that module's helpers.

mod budgets;
mod clock;
mod contention;
mod counters;
mod idempotency;
mod input_contract;
mod lifecycle;
mod point_in_time;
mod replica_env;
mod replication;
mod storage_faults;
mod storage_limit;
