//! Black-box tests of tally over HTTP: the real router on port 0 with a
//! fresh database per test, and the real binary where process behaviour
//! (signals, exit codes) is the point.

mod bad_input;
mod budgets;
mod clients;
mod contention;
mod counters;
mod failover;
mod group_commit;
mod helpers;
mod hostile_connections;
mod idempotency;
mod input_contract;
mod lifecycle;
#[path = "../common/loopback.rs"]
mod loopback;
mod observability;
mod openapi;
mod pg_operations;
#[path = "../common/postgres.rs"]
mod postgres;
mod replica_env;
mod replication;
mod scale_out;
mod storage_faults;
mod writer;
