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
