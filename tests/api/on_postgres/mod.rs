//! Tests that choose PostgreSQL themselves, whatever `TALLY_TEST_ENGINE`
//! says: many tally processes on one database, servers the test starts,
//! stops, promotes or turns read-only, and the test command's server
//! (`TALLY_TEST_POSTGRES`) for a fresh database each. `scripts/test` runs
//! them in its first pass; its PostgreSQL pass skips this module
//! (`--skip on_postgres::`), as it would only run them a second time.
//!
//! A test that needs PostgreSQL, or more than one process on one database,
//! goes here; `scale_out` holds the helpers for starting and driving
//! several processes.

mod distance;
mod failover;
mod pg_operations;
mod scale_out;
