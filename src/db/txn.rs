//! The transaction rules, written once for both engines against
//! [`Store`]: how a batch is applied in one transaction and what each
//! caller's reply is.
//!
//! A batch of increments and checks without idempotency keys is applied
//! set-based, a few statements for the whole batch; any other batch (and
//! one whose set-based result could differ, an overflowing counter, or a
//! row held elsewhere) runs command by command, each in a savepoint of its
//! own, in one lock order, so that one refused command does not take the
//! rest of its batch down and two processes cannot deadlock on the same
//! rows. A keyed command claims its key in the same savepoint.

use jiff::Timestamp;

use super::{
    Error, budgets,
    command::{Command, Outcome, Queued, Reply},
    counters, keys,
    store::Store,
};
use crate::meter::{IdempotencyKey, Refusal};

/// A batch applied: one reply per command, in queue order, and whether the
/// transaction holding them committed.
pub(super) struct Applied {
    pub replies: Vec<Reply>,
    pub commit: Result<(), Error>,
}

impl Applied {
    /// Nothing ran: every caller gets `e`.
    pub fn none(e: Error) -> Self {
        Applied {
            replies: Vec::new(),
            commit: Err(e),
        }
    }
}

/// Applies a batch in one transaction: set-based when it can be, else one
/// command at a time. Keyed commands claim and store their key one by one.
pub(super) async fn apply_batch(conn: &mut impl Store, batch: &[Queued]) -> Applied {
    let keyed = batch.iter().any(|q| q.key.is_some());
    if !keyed && let Some(applied) = apply_set_based(conn, batch).await {
        return applied;
    }
    apply_one_by_one(conn, batch).await
}

/// All increments of the batch in one statement, all checks in a
/// handful. Increments and checks touch disjoint tables, so running each
/// kind as a group keeps every caller's answer what it would be in queue
/// order. `None` (with nothing run, or the transaction rolled back) when
/// the batch must be applied one by one instead: it holds another kind
/// of command, a statement failed, or a counter would overflow. An error
/// that breaks the transaction ([`Error::breaks_transaction`]) is the
/// whole batch's answer.
async fn apply_set_based<S: Store>(conn: &mut S, batch: &[Queued]) -> Option<Applied> {
    let mut increments = Vec::new();
    let mut checks = Vec::new();
    for q in batch {
        match &q.command {
            Command::Increment { name, by } => increments.push((name, *by)),
            Command::Check {
                budget,
                visitor,
                day,
            } => checks.push(budgets::CheckItem {
                budget,
                visitor,
                day: *day,
            }),
            _ => return None,
        }
    }
    if checks.is_empty() {
        // The hottest batch, increments only: the whole transaction in
        // one round trip.
        let started = std::time::Instant::now();
        let applied = counters::increment_many_committed(conn, &increments).await;
        let (values, commit) = match applied {
            Ok(Some(values)) => (values, Ok(())),
            Ok(None) => return None,
            // One row held elsewhere: one by one, only its commands wait.
            Err(Error::Busy(_)) => {
                let _ = conn.exec("ROLLBACK").await;
                return None;
            }
            Err(e) => {
                let _ = conn.exec("ROLLBACK").await;
                (Vec::new(), Err(e))
            }
        };
        metrics::histogram!("tally_commit_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        let replies = in_queue_order(batch, values, Vec::new());
        return Some(Applied { replies, commit });
    }
    if let Err(e) = begin(conn, S::BEGIN_SET_BASED).await {
        return e.breaks_transaction().then(|| Applied::none(e));
    }
    let applied = async {
        let now = conn.now().await?;
        let values = match increments.is_empty() {
            true => Some(Vec::new()),
            false => counters::increment_many(conn, &increments).await?,
        };
        let Some(values) = values else {
            return Ok(None);
        };
        let decisions = budgets::check_many(conn, &checks, now).await?;
        Ok::<_, Error>(Some((values, decisions)))
    }
    .await;
    match applied {
        Ok(Some((values, decisions))) => Some(Applied {
            replies: in_queue_order(batch, values, decisions),
            commit: commit(conn).await,
        }),
        // Lost connection or lost race: the batch's, whichever way it runs.
        Err(e) if e.breaks_transaction() => {
            let _ = conn.exec("ROLLBACK").await;
            Some(Applied::none(e))
        }
        // An overflow, or a statement that failed: one by one tells which
        // command it was.
        _ => {
            let _ = conn.exec("ROLLBACK").await;
            None
        }
    }
}

/// The general path: one transaction, each command in its own
/// savepoint. If the transaction breaks (BEGIN fails, or a savepoint
/// cannot be rolled back because SQLite already rolled everything back,
/// as it does on some I/O errors), the commands after it do not run and
/// every caller gets the error.
async fn apply_one_by_one<S: Store>(conn: &mut S, batch: &[Queued]) -> Applied {
    let mut replies: Vec<Option<Reply>> =
        std::iter::repeat_with(|| None).take(batch.len()).collect();
    let mut broken = begin(conn, S::BEGIN).await.err();
    let began = broken.is_none();
    // Read once per batch, from the database's clock on PostgreSQL (a
    // round trip): only if a command of the batch goes by the time.
    let mut now = Timestamp::UNIX_EPOCH;
    if broken.is_none() && batch.iter().any(|q| q.command.goes_by_the_time()) {
        match conn.now().await {
            Ok(t) => now = t,
            Err(e) => broken = Some(e),
        }
    }
    // A row that a command of this batch found locked past the lock
    // timeout: the commands after it on the same row (they come next, in
    // lock order) are answered busy at once, not after a wait each.
    let mut busy: Option<(Error, LockKey)> = None;
    for i in lock_order(batch) {
        let q = &batch[i];
        let reply = if let Some(e) = &broken {
            Reply::new(Err(e.clone()))
        } else if let Some((e, _)) = busy.as_ref().filter(|(_, row)| *row == lock_key(q)) {
            Reply::new(Err(e.clone()))
        } else {
            let (reply, end) = apply_in_savepoint(conn, q, now).await;
            broken = end.err();
            if let Err(e @ Error::Busy(_)) = &reply.outcome {
                busy = Some((e.clone(), lock_key(q)));
            }
            reply
        };
        replies[i] = Some(reply);
    }
    let commit = match broken {
        Some(e) => {
            if began {
                let _ = conn.exec("ROLLBACK").await;
            }
            Err(e)
        }
        None => commit(conn).await,
    };
    let missing = || {
        Reply::new(Err(Error::Internal(
            "a command of the batch was never applied".into(),
        )))
    };
    let replies = replies
        .into_iter()
        .map(|r| r.unwrap_or_else(missing))
        .collect();
    Applied { replies, commit }
}

/// The order a batch is applied in: counters before budgets, each by name,
/// commands on one name in queue order (a stable sort). Commands on
/// different names touch different rows and commute, so every caller's
/// answer is one it could have had in queue order; and every tally process
/// takes its row locks in the same order, so two batches with the same
/// names cannot deadlock on them.
fn lock_order(batch: &[Queued]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by_key(|&i| lock_key(&batch[i]));
    order
}

/// What a command locks first, in the order [`lock_order`] sorts by:
/// counters (0) before budgets (1), then the name's bytes. Names compare
/// as Rust strings, byte by byte, as PostgreSQL's `C` collation does: the
/// order of the set-based statements too (`migrations/postgres`).
type LockKey<'a> = (u8, &'a str);

fn lock_key(q: &Queued) -> LockKey<'_> {
    match &q.command {
        Command::Increment { name, .. } => (0, name.as_str()),
        Command::PutBudget { name, .. } => (1, name.as_str()),
        Command::Check { budget, .. } | Command::Reset { budget, .. } => (1, budget.as_str()),
    }
}

/// Applies one command inside a savepoint. A command that fails is
/// rolled back to its savepoint and answers its own error; the others in
/// the batch are untouched. The second value is an error if the
/// savepoint could not be taken or ended: then the batch is broken.
async fn apply_in_savepoint(
    conn: &mut impl Store,
    q: &Queued,
    now: Timestamp,
) -> (Reply, Result<(), Error>) {
    if let Err(e) = conn.exec("SAVEPOINT cmd").await {
        return (Reply::new(Err(e.clone())), Err(e));
    }
    let reply = match &q.key {
        None => Reply::new(apply(conn, &q.command, now).await),
        Some(key) => apply_once(conn, &q.command, key, now).await,
    };
    // A lost connection, a deadlock or a serialization failure is the
    // whole transaction's, not this command's: the batch is retried or
    // failed as one.
    if let Err(e) = &reply.outcome
        && e.breaks_transaction()
    {
        let e = e.clone();
        return (reply, Err(e));
    }
    let end = match reply.outcome.is_ok() {
        true => conn.exec("RELEASE cmd").await,
        false => match conn.exec("ROLLBACK TO cmd").await {
            Ok(()) => conn.exec("RELEASE cmd").await,
            Err(e) => Err(e),
        },
    };
    (reply, end)
}

/// Applies one command; `now` is the batch's time
/// ([`Command::goes_by_the_time`]).
async fn apply(conn: &mut impl Store, command: &Command, now: Timestamp) -> Result<Outcome, Error> {
    match command {
        Command::Increment { name, by } => counters::increment(conn, name, *by)
            .await
            .map(Outcome::Value),
        Command::PutBudget { name, spec } => {
            budgets::put(conn, name, spec).await.map(Outcome::Budget)
        }
        Command::Check {
            budget,
            visitor,
            day,
        } => {
            let item = budgets::CheckItem {
                budget,
                visitor,
                day: *day,
            };
            budgets::check(conn, item, now).await.map(Outcome::Decision)
        }
        Command::Reset {
            budget,
            day,
            visitor,
        } => budgets::reset(conn, budget, *day, visitor.as_ref(), now)
            .await
            .map(|(day, deleted_rows)| Outcome::Reset { day, deleted_rows }),
    }
}

/// Applies a keyed command once: if its key is known, answers what was
/// stored for it (or refuses a different command reusing the key);
/// otherwise applies the command and stores its outcome under the key, in
/// the same savepoint.
async fn apply_once(
    conn: &mut impl Store,
    command: &Command,
    key: &IdempotencyKey,
    now: Timestamp,
) -> Reply {
    let fingerprint = command.fingerprint();
    let outcome = match keys::claim(conn, key, &fingerprint).await {
        Err(e) => Err(e),
        Ok(Some(stored)) if stored.fingerprint != fingerprint => Err(Refusal::KeyReused.into()),
        Ok(Some(stored)) => {
            return Reply {
                outcome: keys::replay(command, &stored),
                replayed: true,
            };
        }
        Ok(None) => match apply(conn, command, now).await {
            Ok(outcome) => keys::remember(conn, key, &fingerprint, &outcome)
                .await
                .map(|()| outcome),
            Err(e) => Err(e),
        },
    };
    Reply::new(outcome)
}

/// Opens the batch's transaction with `begin` ([`Store::BEGIN`] or
/// [`Store::BEGIN_SET_BASED`]: SQLite's `BEGIN IMMEDIATE`, PostgreSQL's
/// `BEGIN`). If it fails, a transaction may have been
/// left open by a ROLLBACK that failed earlier; then every later BEGIN
/// would fail too, for good, so it is rolled back and BEGIN is tried once
/// more.
async fn begin<S: Store>(conn: &mut S, begin: &'static str) -> Result<(), Error> {
    match conn.exec(begin).await {
        Ok(()) => return Ok(()),
        // A lost connection stays lost: no second try on it.
        Err(e) if e.breaks_transaction() => return Err(e),
        Err(_) => {}
    }
    let _ = conn.exec("ROLLBACK").await;
    conn.exec(begin).await
}

/// COMMIT, timed: its fsync is most of what a durable write waits for.
/// A failed COMMIT may leave the transaction open, so it is rolled back. A
/// COMMIT whose connection was lost may have committed or not
/// ([`Error::at_commit`]).
async fn commit(conn: &mut impl Store) -> Result<(), Error> {
    let started = std::time::Instant::now();
    let r = conn.exec("COMMIT").await;
    metrics::histogram!("tally_commit_duration_seconds").record(started.elapsed().as_secs_f64());
    if r.is_err() {
        let _ = conn.exec("ROLLBACK").await;
    }
    r.map_err(Error::at_commit)
}

/// Pairs each command of a set-based batch, in queue order, with its
/// result: the next value for an increment, the next decision for a check.
fn in_queue_order(
    batch: &[Queued],
    values: Vec<i64>,
    decisions: Vec<Result<crate::meter::Decision, Error>>,
) -> Vec<Reply> {
    let mut values = values.into_iter();
    let mut decisions = decisions.into_iter();
    batch
        .iter()
        .map(|q| {
            let outcome = match q.command {
                Command::Increment { .. } => values.next().map(|v| Ok(Outcome::Value(v))),
                Command::Check { .. } => decisions.next().map(|d| d.map(Outcome::Decision)),
                _ => None,
            };
            // Results are produced per command, in order; if one were ever
            // missing, its caller gets an error rather than a wrong answer.
            Reply::new(outcome.unwrap_or_else(|| {
                Err(Error::Internal(
                    "the set-based batch produced no result for this command".into(),
                ))
            }))
        })
        .collect()
}
