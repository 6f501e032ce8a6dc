//! The SQLite engine: one file, written by this process alone.
//!
//! - `open`: the one writable connection (WAL, the chosen `synchronous`,
//!   migrations) and the pool of read-only ones.
//! - `store`: the writer's statements (`Store` for its one connection).
//!   Lists go in as one JSON parameter read by `json_each`, so a batch of
//!   any size is one statement, one round trip to the connection's
//!   thread. There is one writable connection in the process and its
//!   transactions are `BEGIN IMMEDIATE`: nothing else can write between
//!   two statements, so `Store::lock_days` has nothing to do, and this
//!   process's clock is the only one.
//! - `writer`: the `Engine` the writer loop drives: the connection, the
//!   files it must still find (`files`), the final checkpoint.
//! - `readers`: the read-only pool behind `Reads`.
//! - `replicated`: under Litestream, what keeps a start that finds no
//!   database of tally's from replacing a replicated one with an empty one:
//!   the mark a database served leaves beside it, and the question to the
//!   replica before a database is created.
//! - `space`: what the database's directory uses on disk, measured on a
//!   task of its own, and the storage limit the writer checks before each
//!   batch.
//!
//! Errors: a full disk is told apart here ([`error`]).

use std::sync::Arc;

use super::Error;

mod files;
mod open;
mod readers;
mod replicated;
pub mod restores;
mod space;
mod stat;
pub(super) mod store;
mod writer;

pub use open::open;
pub use replicated::ask_before_creating;

/// The directory holding the database file `db` (`.` for a bare file
/// name): where its WAL, its restores' working files and its markers go,
/// and what the kubelet (or `du`) measures.
pub fn data_dir(db: &std::path::Path) -> &std::path::Path {
    match db.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => std::path::Path::new("."),
    }
}
#[cfg(test)]
pub(super) use open::open_readers;
pub(super) use readers::SqliteReaders;
pub(super) use writer::SqliteWriter;

/// SQLite's primary result code for a full disk (`SQLITE_FULL`). SQLite
/// reports every failed `write()` with `ENOSPC` this way.
const SQLITE_FULL: i32 = 13;

/// What a SQLite error means: a full disk is told apart (nothing was
/// written, and the same write succeeds once space is freed); the rest is
/// [`Error::from_sqlx`]'s.
pub(super) fn error(e: sqlx::Error) -> Error {
    match is_storage_full(&e) {
        true => Error::StorageFull(Arc::new(e)),
        false => Error::from_sqlx(e),
    }
}

/// Whether `e` says the disk is full. SQLite hands out extended result
/// codes, whose low byte is the primary code. An fsync or truncate that
/// fails with `ENOSPC` is an `SQLITE_IOERR_*` carrying no errno through
/// sqlx, so it stays an [`Error::Database`]: it cannot be told from a
/// failing disk.
fn is_storage_full(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|c| c & 0xff == SQLITE_FULL),
        sqlx::Error::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
        ),
        _ => false,
    }
}
