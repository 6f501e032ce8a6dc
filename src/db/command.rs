//! What the writer runs: commands as plain data, and the one reply type
//! every command answers with.

use std::{fmt, sync::Arc};

use tokio::sync::oneshot;

use super::Error;
use crate::meter::{Budget, BudgetSpec, Day, Decision, IdempotencyKey, Name, VisitorId};

/// A write, as the writer receives it: what to do, and where its answer
/// goes. Each kind carries a [`Reply`] of exactly its own result, as in
/// tokio's tutorial on channels: a reply of another kind cannot be
/// written.
#[derive(Debug)]
pub enum Command {
    Increment {
        name: Name,
        by: i64,
        /// The counter's new value.
        reply: Reply<i64>,
    },
    PutBudget {
        name: Name,
        spec: BudgetSpec,
        reply: Reply<Stored>,
    },
    /// One call against a budget, on `day` or the budget's today.
    Check {
        budget: Name,
        visitor: VisitorId,
        day: Option<Day>,
        reply: Reply<Decision>,
    },
    /// Clears one day's usage (the budget's today when `day` is `None`):
    /// one visitor's calls, or all of the day's.
    Reset {
        budget: Name,
        day: Option<Day>,
        visitor: Option<VisitorId>,
        reply: Reply<Cleared>,
    },
    /// Deletes a budget, its configuration and every day of its usage, in
    /// one transaction.
    DeleteBudget { name: Name, reply: Reply<Deleted> },
    /// Deletes a counter: a later increment starts again from 0.
    DeleteCounter { name: Name, reply: Reply<Deleted> },
}

/// What a delete answers: that the row was there and is gone; of a
/// budget, how many of its usage rows the delete's own transaction took
/// (the writer deletes the rest), counted once it commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    pub usage_rows: u64,
}

/// What a `PUT` of a budget answers: the budget as stored, and how many
/// usage rows of days it no longer keeps its own transaction deleted,
/// counted once it commits.
#[derive(Debug, Clone)]
pub struct Stored {
    pub budget: Budget,
    pub pruned_rows: u64,
}

/// What a reset did: the day it cleared and how many usage rows it deleted.
#[derive(Debug, Clone, Copy)]
pub struct Cleared {
    pub day: Day,
    pub deleted_rows: u64,
}

/// The answer a caller waits for: its command's own result, and whether it
/// is the one stored for the command's idempotency key (nothing new was
/// written).
#[derive(Debug)]
pub struct Answer<T> {
    pub result: Result<T, Error>,
    pub replayed: bool,
}

/// Where one command's answer goes, and that answer once its batch has it.
/// The batch sets it ([`Reply::set`]); the writer sends it only after the
/// transaction's COMMIT ([`Reply::send`]).
#[derive(Debug)]
pub struct Reply<T> {
    tx: Option<oneshot::Sender<Answer<T>>>,
    result: Option<Result<T, Error>>,
    replayed: bool,
    /// The result was decided without running the command ([`Reply::refuse`]):
    /// it stands whatever becomes of the batch's transaction.
    refused: bool,
}

/// What became of an answer the writer sent.
pub enum Sent {
    Heard,
    /// The caller had gone. `committed`: its write landed all the same;
    /// `what`: its value or its error, for the log line.
    Unheard {
        committed: bool,
        what: String,
    },
}

impl<T: fmt::Debug> Reply<T> {
    /// A reply, and the end its caller waits on.
    pub fn new() -> (Self, oneshot::Receiver<Answer<T>>) {
        let (tx, rx) = oneshot::channel();
        let reply = Reply {
            tx: Some(tx),
            result: None,
            replayed: false,
            refused: false,
        };
        (reply, rx)
    }

    /// The command's result in this batch, replacing one an earlier run of
    /// the batch set.
    pub fn set(&mut self, result: Result<T, Error>) {
        self.result = Some(result);
        self.replayed = false;
        self.refused = false;
    }

    /// Answers the command with an error without running it: nothing of it
    /// is in the batch's transaction, so whatever becomes of that, its
    /// caller hears this error (one saying that nothing ran, so a retry is
    /// safe), not the batch's. A later [`Reply::set`] replaces it, if the
    /// command is run after all.
    pub fn refuse(&mut self, e: Error) {
        self.result = Some(Err(e));
        self.replayed = false;
        self.refused = true;
    }

    /// The result stored for the command's idempotency key.
    pub fn set_replayed(&mut self, result: Result<T, Error>) {
        self.result = Some(result);
        self.replayed = true;
        self.refused = false;
    }

    /// Whether the result set is the one stored for an idempotency key.
    pub fn is_replayed(&self) -> bool {
        self.replayed
    }

    /// Whether the command was answered without running ([`Reply::refuse`]).
    pub fn is_refused(&self) -> bool {
        self.refused
    }

    /// The result set so far: `Some(Ok(()))` or its error.
    pub fn outcome(&self) -> Option<Result<(), &Error>> {
        self.result.as_ref().map(|r| r.as_ref().map(|_| ()))
    }

    /// The result set so far, if it is a success.
    pub fn value(&self) -> Option<&T> {
        self.result.as_ref().and_then(|r| r.as_ref().ok())
    }

    /// The command's own error, if it has one yet.
    pub fn error(&self) -> Option<&Error> {
        self.result.as_ref().and_then(|r| r.as_ref().err())
    }

    /// Sends the answer: the commit's error if the batch did not commit,
    /// else the command's own result; a refusal ([`Reply::refuse`]) either
    /// way. Once only.
    pub fn send(&mut self, commit: &Result<(), Error>) -> Sent {
        let result = match (commit, self.result.take()) {
            (_, Some(Err(e))) if self.refused => Err(e),
            (Err(e), _) => Err(e.clone()),
            (Ok(()), Some(result)) => result,
            // Every command of a batch gets its result, by construction;
            // should one ever be missing, its caller hears an error rather
            // than nothing.
            (Ok(()), None) => Err(Error::Internal(
                "the batch produced no result for this command".into(),
            )),
        };
        let committed = commit.is_ok() && result.is_ok();
        let answer = Answer {
            result,
            replayed: self.replayed,
        };
        match self.tx.take().map(|tx| tx.send(answer)) {
            Some(Ok(())) => Sent::Heard,
            Some(Err(unheard)) => Sent::Unheard {
                committed,
                what: match unheard.result {
                    Ok(value) => format!("{:?}", Some(value)),
                    Err(e) => format!("{:?}", Some(e)),
                },
            },
            None => Sent::Unheard {
                committed,
                what: "(answered twice)".into(),
            },
        }
    }
}

/// What the writer does with a command's reply whatever the type of its
/// value ([`Command::reply`]): one dispatch over the commands, not one per
/// method.
trait AnyReply {
    fn is_replayed(&self) -> bool;
    fn is_refused(&self) -> bool;
    fn outcome(&self) -> Option<Result<(), &Error>>;
    fn fail(&mut self, e: Error);
    fn refuse(&mut self, e: Error);
    fn send(&mut self, commit: &Result<(), Error>) -> Sent;
}

impl<T: fmt::Debug> AnyReply for Reply<T> {
    fn is_replayed(&self) -> bool {
        Reply::is_replayed(self)
    }

    fn is_refused(&self) -> bool {
        Reply::is_refused(self)
    }

    fn outcome(&self) -> Option<Result<(), &Error>> {
        Reply::outcome(self)
    }

    fn fail(&mut self, e: Error) {
        self.set(Err(e))
    }

    fn refuse(&mut self, e: Error) {
        Reply::refuse(self, e)
    }

    fn send(&mut self, commit: &Result<(), Error>) -> Sent {
        Reply::send(self, commit)
    }
}

/// A command in the queue, with everything the writer needs to answer it.
pub struct Queued {
    pub command: Command,
    /// The client's idempotency key, when it sent one.
    pub key: Option<IdempotencyKey>,
    /// The request that queued it, for the writer's log lines.
    pub request_id: Option<Arc<str>>,
    /// When it was queued: `tally_write_wait_seconds` runs from here to
    /// its answer.
    pub queued_at: std::time::Instant,
}

/// Every `result` label `tally_write_commands_total` can carry, per command
/// kind ([`Command::kind`]): `ok`, the refusals a command can meet
/// ([`Error::kind`]), the storage's failures (a full disk, a lost file, a
/// database server out of reach, a row locked elsewhere past the lock
/// timeout, a COMMIT whose outcome is unknown), and
/// `not_committed` for a batch whose COMMIT failed for another reason.
/// Exported at 0 from the start so that a first failure is an increase an
/// alert can see.
#[rustfmt::skip]
pub const WRITE_RESULTS: &[(&str, &[&str])] = &[
    ("increment", &["ok", "overflow", "key_reused", FULL, LOST, DOWN, BUSY, UNKNOWN, DATABASE, NOT_COMMITTED]),
    ("put_budget", &["ok", "purging", FULL, LOST, DOWN, BUSY, UNKNOWN, DATABASE, NOT_COMMITTED]),
    ("check", &["ok", "unknown_budget", "day_outside_window", "key_reused", FULL, LOST, DOWN, BUSY, UNKNOWN, DATABASE, NOT_COMMITTED]),
    ("reset", &["ok", "unknown_budget", "day_outside_window", "key_reused", FULL, LOST, DOWN, BUSY, UNKNOWN, DATABASE, NOT_COMMITTED]),
    ("delete_budget", &["ok", "unknown_budget", "key_reused", FULL, LOST, DOWN, BUSY, UNKNOWN, DATABASE, NOT_COMMITTED]),
    ("delete_counter", &["ok", "unknown_counter", "key_reused", FULL, LOST, DOWN, BUSY, UNKNOWN, DATABASE, NOT_COMMITTED]),
];

const FULL: &str = "storage_full";
const LOST: &str = "storage_lost";
const DOWN: &str = "unavailable";
const BUSY: &str = "busy";
const UNKNOWN: &str = "outcome_unknown";
const DATABASE: &str = "database_error";
pub const NOT_COMMITTED: &str = "not_committed";

impl Command {
    /// What a check asks, for the budget rules ([`super::budgets`]); `None`
    /// for any other command.
    pub fn check_item(&self) -> Option<super::budgets::CheckItem<'_>> {
        match self {
            Command::Check {
                budget,
                visitor,
                day,
                ..
            } => Some(super::budgets::CheckItem {
                budget,
                visitor,
                day: *day,
            }),
            _ => None,
        }
    }

    /// The counter this command may change, if it is one that can, for
    /// [`super::committed::Committed::begin`].
    pub fn counter_changed(&self) -> Option<&str> {
        match self {
            Command::Increment { name, .. } | Command::DeleteCounter { name, .. } => {
                Some(name.as_str())
            }
            _ => None,
        }
    }

    /// The counter value this command committed, for
    /// [`super::committed::Committed::publish`]: an increment's new value,
    /// 0 for a deleted counter; nothing for a command replayed for an
    /// idempotency key (its answer is old, not the counter's value).
    pub fn committed_counter(&self) -> Option<(&str, i64)> {
        match self {
            Command::Increment { name, reply, .. } if !reply.is_replayed() => {
                reply.value().map(|&v| (name.as_str(), v))
            }
            // Gone, so read as 0, until an increment starts it again.
            Command::DeleteCounter { name, reply } if !reply.is_replayed() => {
                reply.value().map(|_| (name.as_str(), 0))
            }
            _ => None,
        }
    }

    /// A stable name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Increment { .. } => "increment",
            Command::PutBudget { .. } => "put_budget",
            Command::Check { .. } => "check",
            Command::Reset { .. } => "reset",
            Command::DeleteBudget { .. } => "delete_budget",
            Command::DeleteCounter { .. } => "delete_counter",
        }
    }

    /// Whether what it does depends on the time: the day a check counts
    /// on or a reset clears, and the days a budget keeps.
    pub fn goes_by_the_time(&self) -> bool {
        match self {
            Command::Check { .. } | Command::Reset { .. } | Command::PutBudget { .. } => true,
            Command::Increment { .. }
            | Command::DeleteBudget { .. }
            | Command::DeleteCounter { .. } => false,
        }
    }

    /// The row this command waits for when another transaction holds it,
    /// as a key: a counter's row, a visitor's usage of a budget (whatever
    /// the day), or a budget's own row for the admin's commands. Written
    /// with the budget's length first, so that no two rows share a key.
    pub(crate) fn held_row(&self) -> String {
        match self {
            Command::Increment { name, .. } | Command::DeleteCounter { name, .. } => {
                format!("c:{}", name.as_str())
            }
            Command::Check {
                budget, visitor, ..
            } => format!(
                "v:{}:{}{}",
                budget.as_str().len(),
                budget.as_str(),
                visitor.as_str()
            ),
            Command::PutBudget { name, .. }
            | Command::DeleteBudget { name, .. }
            | Command::Reset { budget: name, .. } => format!("b:{}", name.as_str()),
        }
    }

    /// Its reply, whatever the type of its value.
    fn reply(&self) -> &dyn AnyReply {
        match self {
            Command::Increment { reply, .. } => reply,
            Command::PutBudget { reply, .. } => reply,
            Command::Check { reply, .. } => reply,
            Command::Reset { reply, .. } => reply,
            Command::DeleteBudget { reply, .. } => reply,
            Command::DeleteCounter { reply, .. } => reply,
        }
    }

    fn reply_mut(&mut self) -> &mut dyn AnyReply {
        match self {
            Command::Increment { reply, .. } => reply,
            Command::PutBudget { reply, .. } => reply,
            Command::Check { reply, .. } => reply,
            Command::Reset { reply, .. } => reply,
            Command::DeleteBudget { reply, .. } => reply,
            Command::DeleteCounter { reply, .. } => reply,
        }
    }

    /// Whether its result is the one stored for its idempotency key.
    pub fn is_replayed(&self) -> bool {
        self.reply().is_replayed()
    }

    /// The command's result so far in its batch: `Some(Ok(()))` or its
    /// error, `None` before it ran.
    pub fn outcome(&self) -> Option<Result<(), &Error>> {
        self.reply().outcome()
    }

    /// Sets an error as the command's result.
    pub fn fail(&mut self, e: Error) {
        self.reply_mut().fail(e)
    }

    /// Whether it was answered without running ([`Reply::refuse`]).
    pub fn is_refused(&self) -> bool {
        self.reply().is_refused()
    }

    /// Answers the command with an error without running it
    /// ([`Reply::refuse`]).
    pub fn refuse(&mut self, e: Error) {
        self.reply_mut().refuse(e)
    }

    /// Sends the command's answer ([`Reply::send`]).
    pub fn send(&mut self, commit: &Result<(), Error>) -> Sent {
        self.reply_mut().send(commit)
    }

    /// What the command does, to tell a retry from another request that
    /// reuses its key. Stored with the key: the text must not change.
    pub fn fingerprint(&self) -> String {
        match self {
            Command::Increment { name, by, .. } => format!("increment {name} {by}"),
            Command::Check {
                budget,
                visitor,
                day: Some(d),
                ..
            } => format!("check {budget} {d} {visitor}"),
            Command::Check {
                budget,
                visitor,
                day: None,
                ..
            } => format!("check {budget} today {visitor}"),
            Command::PutBudget { name, .. } => format!("put_budget {name}"),
            // The day and the visitor: a reset of another day, or of one
            // visitor rather than all, is another request.
            Command::Reset {
                budget,
                day,
                visitor,
                ..
            } => {
                let day = day.map_or("today".to_owned(), |d| d.to_string());
                match visitor {
                    Some(v) => format!("reset {budget} {day} visitor {v}"),
                    None => format!("reset {budget} {day}"),
                }
            }
            Command::DeleteBudget { name, .. } => format!("delete_budget {name}"),
            Command::DeleteCounter { name, .. } => format!("delete_counter {name}"),
        }
    }
}

/// What the command was applied to, for the log line written when its
/// caller has gone: enough to answer "did my write land?".
impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Increment { name, .. } => write!(f, "counter={name}"),
            Command::PutBudget { name, .. } | Command::DeleteBudget { name, .. } => {
                write!(f, "budget={name}")
            }
            Command::DeleteCounter { name, .. } => write!(f, "counter={name}"),
            // Never a visitor's id: it may be personal data, and the
            // request id ties the line to the client's request.
            Command::Check { budget, .. } => write!(f, "budget={budget}"),
            Command::Reset {
                budget,
                day,
                visitor,
                ..
            } => {
                let day = day.map_or("today".to_owned(), |d| d.to_string());
                let whose = if visitor.is_some() {
                    "one visitor"
                } else {
                    "all"
                };
                write!(f, "budget={budget} day={day} ({whose})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::Refusal;

    /// A refusal is what its caller hears whether the batch committed or
    /// not; a result the batch set is heard only if it committed; a
    /// refused command run after all hears its run's result.
    #[test]
    fn a_refusal_stands_whatever_the_batch_does() {
        let full = || Error::StorageFull(Arc::new(sqlx::Error::PoolClosed));
        let heard = |reply: &mut Reply<i64>,
                     rx: &mut oneshot::Receiver<Answer<i64>>,
                     commit: Result<(), Error>| {
            reply.send(&commit);
            rx.try_recv().expect("answered").result
        };
        for commit in [Ok(()), Err(Error::OutcomeUnknown)] {
            let (mut reply, mut rx) = Reply::new();
            reply.refuse(full());
            let result = heard(&mut reply, &mut rx, commit.clone());
            assert!(matches!(result, Err(Error::StorageFull(_))), "{result:?}");

            let (mut reply, mut rx) = Reply::new();
            reply.refuse(full());
            reply.set(Ok(7));
            let result = heard(&mut reply, &mut rx, commit.clone());
            match commit {
                Ok(()) => assert!(matches!(result, Ok(7)), "{result:?}"),
                Err(_) => assert!(matches!(result, Err(Error::OutcomeUnknown)), "{result:?}"),
            }
        }
        let (mut reply, mut rx) = Reply::new();
        reply.set(Err(full()));
        let result = heard(&mut reply, &mut rx, Err(Error::OutcomeUnknown));
        assert!(matches!(result, Err(Error::OutcomeUnknown)), "{result:?}");
    }

    /// The label list names real results only: a typo would export a
    /// series at 0 forever while the real one stays absent.
    #[test]
    fn write_results_are_real_results() {
        let name = Name::parse("n").unwrap();
        let day = Day::parse("2000-01-01").unwrap();
        let db = || Arc::new(sqlx::Error::PoolClosed);
        let budget = crate::meter::Budget {
            name: name.clone(),
            spec: BudgetSpec::new(1, 1, Some(1), None).unwrap(),
        };
        let outside = budget.day(Some(day), jiff::Timestamp::now()).unwrap_err();
        let kinds: Vec<&str> = [
            Refusal::UnknownBudget(name.clone()).into(),
            Refusal::UnknownCounter(name.clone()).into(),
            Error::Purging(name.clone()),
            Refusal::Overflow(name).into(),
            Refusal::KeyReused.into(),
            outside.into(),
            Error::StorageFull(db()),
            Error::StorageLost(Arc::from(std::path::Path::new("x"))),
            Error::Unavailable(db()),
            Error::Busy(db(), crate::db::HeldRow::Own),
            Error::OutcomeUnknown,
            Error::Database(db()),
        ]
        .iter()
        .map(Error::kind)
        .chain(["ok", NOT_COMMITTED])
        .collect();
        let commands: Vec<&str> = WRITE_RESULTS.iter().map(|(c, _)| *c).collect();
        assert_eq!(
            commands,
            [
                "increment",
                "put_budget",
                "check",
                "reset",
                "delete_budget",
                "delete_counter"
            ]
        );
        for (command, results) in WRITE_RESULTS {
            for r in *results {
                assert!(kinds.contains(r), "{command}: {r}");
            }
            // Every write but a budget's PUT stores its Idempotency-Key,
            // and so can find it reused.
            assert_eq!(
                results.contains(&"key_reused"),
                *command != "put_budget",
                "{command}"
            );
        }
    }
}
