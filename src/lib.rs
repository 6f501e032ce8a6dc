//! tally: atomic counters and daily budgets over HTTP, on one SQLite file
//! (the default) or on PostgreSQL shared by any number of tally processes.
//!
//! # Layout
//!
//! - [`config`]: the one settings struct (flags with environment fallbacks).
//! - [`app`]: builds the service (database, writer, listener) and owns the
//!   shutdown order: HTTP first, then the write queue, then the database.
//! - [`db`]: the storage boundary, and the only module with SQL, for both
//!   engines. A cloneable [`db::Handle`] whose methods are the whole storage
//!   API (reads on a pool of their own, writes as plain commands on a
//!   bounded queue), and the [`db::Writer`], the process's only holder of a
//!   writable connection, which commits queued commands in batches and
//!   replies only after the commit.
//!   `db::contention` is the lab behind `tally contention`, showing why
//!   writes go through one queue.
//! - [`meter`]: the domain, pure: names, visitors, days, idempotency keys,
//!   budgets, and the one rule that decides a budget check.
//! - [`http`]: the router, one module per resource, the problem+json
//!   error type, and what a request head may be (`http::limits`).
//! - [`server`]: the transport: the HTTP/1.1 serve loop with its limits
//!   (header and body timeouts, bounded buffers, a cap on open
//!   connections) and a shutdown that closes idle connections at once. It
//!   knows nothing of what a request means.
//! - [`fds`]: the open-files limit, and the connection cap fitted under
//!   it with room for the open database's descriptors.
//! - [`replica`]: Litestream's control socket: the startup gate that waits
//!   until the replica holds what the database holds, and the watch that
//!   exports how far the replica is behind.
//! - [`prometheus`]: Prometheus metrics: the recorder, every metric's
//!   meaning, and what is sampled at scrape time. (Per-request ids and
//!   metrics by route are `http::instrument`.)
//! - [`restore`]: `tally restore-to`, a restore to a point in time from
//!   Litestream's replica that acts once, not at every start.
//! - [`telemetry`]: structured logs.
//! - `testing`: helpers shared by tally's own tests, built for them alone
//!   (the `test-hooks` feature).
//!
//! Data flows one way: handler -> command -> writer -> reply. A handler never
//! sees SQL; the writer never sees HTTP.

#![forbid(unsafe_code)]

pub mod app;
pub mod config;
pub mod db;
mod fds;
mod http;
mod meter;
mod prometheus;
mod replica;
pub mod restore;
pub mod server;
pub mod telemetry;
#[cfg(any(test, feature = "test-hooks"))]
pub mod testing;

pub use app::Application;
pub use config::{Settings, Storage};
