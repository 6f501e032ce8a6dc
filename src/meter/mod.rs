//! The domain: what a counter and a budget are, the rules of a budget check,
//! and the SQL that carries them out. Inputs are parsed once into types that
//! cannot hold a bad value; nothing here knows about HTTP or the queue.

mod batch;
pub mod idempotency;
mod sql;
mod types;

use std::{path::Path, sync::Arc};

pub use batch::{CheckItem, check_many, increment_many, increment_many_committed};
pub use idempotency::IdempotencyKey;
pub use sql::{check, get_budget, increment, put_budget, read_counters, read_usage, reset};
pub use types::{
    Budget, BudgetSpec, Day, DayWindow, Decision, InvalidInput, Name, Reason, ResetScope, Usage,
    VisitorId,
};

/// What can go wrong while applying a command to the database.
#[derive(Debug, thiserror::Error)]
pub enum MeterError {
    #[error("budget `{0}` does not exist")]
    UnknownBudget(Name),
    #[error("counter `{0}` would overflow a 64-bit integer")]
    Overflow(Name),
    /// The idempotency key was first used for another request.
    #[error("this Idempotency-Key was already used for a different request")]
    KeyReused,
    /// The disk (or the database's size limit) is full: nothing was
    /// written, and the same write succeeds once space is freed. Not a bug,
    /// so it is told apart from [`Self::Database`].
    #[error("the disk is full: {0}")]
    StorageFull(Arc<sqlx::Error>),
    /// The database file, or its `-wal` or `-shm`, was deleted or replaced
    /// while tally had it open: whatever is written now goes to a file that
    /// no longer has a name and vanishes when tally exits.
    #[error("the database file {} was deleted or replaced while open", path.display())]
    StorageLost { path: Arc<Path> },
    /// Shared, because one failed COMMIT is every caller's answer in a batch.
    #[error("database error: {0}")]
    Database(Arc<sqlx::Error>),
}

impl From<sqlx::Error> for MeterError {
    fn from(e: sqlx::Error) -> Self {
        if is_storage_full(&e) {
            MeterError::StorageFull(Arc::new(e))
        } else {
            MeterError::Database(Arc::new(e))
        }
    }
}

/// SQLite's primary result code for a full disk (`SQLITE_FULL`). SQLite
/// reports every failed `write()` with `ENOSPC` this way.
const SQLITE_FULL: i32 = 13;

/// Whether `e` says the disk is full. SQLite hands out extended result
/// codes, whose low byte is the primary code. An fsync or truncate that
/// fails with `ENOSPC` is an `SQLITE_IOERR_*` carrying no errno through
/// sqlx, so it stays a [`MeterError::Database`]: it cannot be told from a
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

impl MeterError {
    /// A stable name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            MeterError::UnknownBudget(_) => "unknown_budget",
            MeterError::Overflow(_) => "overflow",
            MeterError::KeyReused => "key_reused",
            MeterError::StorageFull(_) => "storage_full",
            MeterError::StorageLost { .. } => "storage_lost",
            MeterError::Database(_) => "database_error",
        }
    }

    /// Whether the database failed, rather than the command being refused:
    /// a budget check fails closed on any of these.
    pub fn is_storage_failure(&self) -> bool {
        matches!(
            self,
            MeterError::StorageFull(_) | MeterError::StorageLost { .. } | MeterError::Database(_)
        )
    }

    /// A copy of this error for another caller.
    pub fn clone_shallow(&self) -> Self {
        match self {
            MeterError::UnknownBudget(n) => MeterError::UnknownBudget(n.clone()),
            MeterError::Overflow(n) => MeterError::Overflow(n.clone()),
            MeterError::KeyReused => MeterError::KeyReused,
            MeterError::StorageFull(e) => MeterError::StorageFull(Arc::clone(e)),
            MeterError::StorageLost { path } => MeterError::StorageLost {
                path: Arc::clone(path),
            },
            MeterError::Database(e) => MeterError::Database(Arc::clone(e)),
        }
    }
}

/// JSON text for a `json_each` parameter, written straight from `v` (no
/// intermediate `serde_json::Value` on the hot path). Maps with string keys
/// and sequences of strings and numbers cannot fail to serialize.
fn to_json<T: serde::Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_owned())
}
