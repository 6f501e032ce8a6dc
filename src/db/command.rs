//! The commands a handler can ask the writer to run, each with its own typed
//! reply channel.

use std::{
    fmt,
    sync::{Arc, atomic::AtomicBool},
};

use tokio::sync::oneshot;

use crate::meter::{
    Budget, BudgetSpec, Day, Decision, IdempotencyKey, MeterError, Name, ResetScope, VisitorId,
};

/// Every `result` label `tally_write_commands_total` can carry, per command
/// kind ([`Op::kind`]): `ok`, the refusals a command can meet
/// ([`MeterError::kind`]), and `not_committed` for a batch whose COMMIT
/// failed for another reason than the storage's. Exported at 0 from the
/// start so that a first failure is an increase an alert can see.
pub const WRITE_RESULTS: &[(&str, &[&str])] = &[
    (
        "increment",
        &[
            "ok",
            "overflow",
            "key_reused",
            "storage_full",
            "storage_lost",
            "database_error",
            "not_committed",
        ],
    ),
    (
        "put_budget",
        &[
            "ok",
            "storage_full",
            "storage_lost",
            "database_error",
            "not_committed",
        ],
    ),
    (
        "check",
        &[
            "ok",
            "unknown_budget",
            "key_reused",
            "storage_full",
            "storage_lost",
            "database_error",
            "not_committed",
        ],
    ),
    (
        "reset",
        &[
            "ok",
            "unknown_budget",
            "storage_full",
            "storage_lost",
            "database_error",
            "not_committed",
        ],
    ),
];

/// What a command answers: its result, or why it did not apply.
pub type Reply<T> = oneshot::Sender<Result<T, MeterError>>;

/// One queued write with the channel its caller waits on.
pub struct Envelope {
    pub op: Op,
    /// The HTTP request that queued it, for the writer's log lines.
    pub request_id: Option<std::sync::Arc<str>>,
    /// The client's idempotency key, when it sent one.
    pub key: Option<Keyed>,
}

/// An idempotency key riding with its command.
pub struct Keyed {
    pub key: IdempotencyKey,
    /// Set by the writer, before it replies, when the answer is the one
    /// stored for the key rather than a new write.
    pub replayed: Arc<AtomicBool>,
}

impl Op {
    /// What the command does, to tell a retry from another request that
    /// reuses its key.
    pub fn fingerprint(&self) -> String {
        match self {
            Op::Increment { name, by, .. } => format!("increment {name} {by}"),
            Op::Check {
                budget,
                visitor,
                day,
                ..
            } => match day {
                Some(d) => format!("check {budget} {d} {visitor}"),
                None => format!("check {budget} today {visitor}"),
            },
            Op::PutBudget { name, .. } => format!("put_budget {name}"),
            Op::Reset { budget, .. } => format!("reset {budget}"),
        }
    }
}

pub enum Op {
    Increment {
        name: Name,
        by: i64,
        reply: Reply<i64>,
    },
    PutBudget {
        name: Name,
        spec: BudgetSpec,
        reply: Reply<Budget>,
    },
    Check {
        budget: Name,
        visitor: VisitorId,
        day: Option<Day>,
        reply: Reply<Decision>,
    },
    Reset {
        budget: Name,
        scope: ResetScope,
        reply: Reply<u64>,
    },
}

impl Op {
    /// A stable name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Increment { .. } => "increment",
            Op::PutBudget { .. } => "put_budget",
            Op::Check { .. } => "check",
            Op::Reset { .. } => "reset",
        }
    }
}

/// What a command was applied to, for the log line written when its caller
/// has gone: enough to answer "did my write land?".
pub enum Target {
    Counter(Name),
    Budget(Name),
    Check { budget: Name, visitor: VisitorId },
    Reset { budget: Name, scope: ResetScope },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Counter(n) => write!(f, "counter={n}"),
            Target::Budget(n) => write!(f, "budget={n}"),
            Target::Check { budget, visitor } => write!(f, "budget={budget} visitor={visitor:?}"),
            Target::Reset { budget, scope } => match &scope.visitor {
                Some(v) => write!(f, "budget={budget} day={} visitor={v:?}", scope.day),
                None => write!(f, "budget={budget} day={}", scope.day),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{path::Path, sync::Arc};

    use super::*;

    /// The label list names real results only: a typo would export a
    /// series at 0 forever while the real one stays absent.
    #[test]
    fn write_results_are_real_results() {
        let name = Name::parse("n").unwrap();
        let db = || Arc::new(sqlx::Error::PoolClosed);
        let kinds: Vec<&str> = [
            MeterError::UnknownBudget(name.clone()),
            MeterError::Overflow(name),
            MeterError::KeyReused,
            MeterError::StorageFull(db()),
            MeterError::StorageLost {
                path: Arc::from(Path::new("x")),
            },
            MeterError::Database(db()),
        ]
        .iter()
        .map(MeterError::kind)
        .chain(["ok", "not_committed"])
        .collect();
        let commands: Vec<&str> = WRITE_RESULTS.iter().map(|(c, _)| *c).collect();
        assert_eq!(commands, ["increment", "put_budget", "check", "reset"]);
        for (command, results) in WRITE_RESULTS {
            for r in *results {
                assert!(kinds.contains(r), "{command}: {r}");
            }
        }
    }
}
