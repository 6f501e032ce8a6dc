//! The domain: what a counter and a budget are, the rules of a budget check,
//! and the SQL that carries them out. Inputs are parsed once into types that
//! cannot hold a bad value; nothing here knows about HTTP or the queue.

mod batch;
pub mod idempotency;
mod sql;
mod types;

use std::sync::Arc;

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
    /// Shared, because one failed COMMIT is every caller's answer in a batch.
    #[error("database error: {0}")]
    Database(Arc<sqlx::Error>),
}

impl From<sqlx::Error> for MeterError {
    fn from(e: sqlx::Error) -> Self {
        MeterError::Database(Arc::new(e))
    }
}

impl MeterError {
    /// A stable name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            MeterError::UnknownBudget(_) => "unknown_budget",
            MeterError::Overflow(_) => "overflow",
            MeterError::KeyReused => "key_reused",
            MeterError::Database(_) => "database_error",
        }
    }

    /// A copy of this error for another caller.
    pub fn clone_shallow(&self) -> Self {
        match self {
            MeterError::UnknownBudget(n) => MeterError::UnknownBudget(n.clone()),
            MeterError::Overflow(n) => MeterError::Overflow(n.clone()),
            MeterError::KeyReused => MeterError::KeyReused,
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
