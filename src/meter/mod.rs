//! The domain: counters and budgets. Types that parse client input once
//! (names, visitors, days, idempotency keys, budget configurations), the
//! one rule that decides a budget check, and what a client can be refused
//! for. Pure: nothing here touches the database, the queue or HTTP.

mod rules;
mod types;

pub use rules::{Counts, Step, decide};
pub use types::{
    Budget, BudgetSpec, Day, Decision, IdempotencyKey, InvalidInput, KeptDays, Name, Reason, Usage,
    VisitorId, load_timezone, replayed_timezone,
};

/// Why a command was refused: what a client can cause. A refused command
/// changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("budget `{0}` does not exist")]
    UnknownBudget(Name),
    #[error("counter `{0}` does not exist")]
    UnknownCounter(Name),
    #[error("counter `{0}` would exceed the largest 64-bit integer; it was not changed")]
    Overflow(Name),
    /// The idempotency key was first used for another request.
    #[error(
        "this Idempotency-Key was first used for a different request; \
         use a new key for a new request"
    )]
    KeyReused,
    /// A day the budget does not keep (see [`Budget::day`]).
    #[error(
        "budget `{budget}` keeps the days {} to {} (today in {timezone} and the \
         {retention_days} days before it); {day} is not one of them",
        kept.oldest, kept.today
    )]
    DayOutsideWindow {
        budget: Name,
        day: Day,
        kept: KeptDays,
        timezone: String,
        retention_days: u32,
    },
}

impl Refusal {
    /// A stable name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::UnknownBudget(_) => "unknown_budget",
            Refusal::UnknownCounter(_) => "unknown_counter",
            Refusal::Overflow(_) => "overflow",
            Refusal::KeyReused => "key_reused",
            Refusal::DayOutsideWindow { .. } => "day_outside_window",
        }
    }
}
