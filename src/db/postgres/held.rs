//! Rows another transaction holds past the lock timeout (an operator's
//! `SELECT ... FOR UPDATE` left open, say), remembered between batches.
//!
//! The writer has one connection and applies one batch at a time, so a
//! batch that waits for a held row holds up every write behind it. Once a
//! command has waited for a row and been answered row-busy, later commands
//! on that row do not wait again: they are answered row-busy with their
//! batch, except that every [`PROBE_EVERY`] a batch tries a few such rows
//! again, briefly, in a transaction of its own after the rest of the batch
//! has committed (`txn::Pass::Probe`). The first command to get the row
//! forgets it. While any row is remembered, batches wait for no row long
//! (`txn::Pass::Wary`: 250 ms), so meeting one more costs no lock timeout.
//! Without
//! this, a client retrying a write to a held row put a lock timeout into
//! nearly every batch, and every other write of the process waited that
//! long.

use std::{collections::HashMap, time::Duration};

use tokio::time::Instant;

use super::{Error, Queued};
use crate::db::command::Command;
use crate::db::{HeldRow, txn::lock_key};

/// How often a row found held is tried again, and how often a batch tries
/// any.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// The most held rows one batch tries again: each try can wait the
/// brief lock timeout, with the whole writer waiting.
pub const PROBES_PER_BATCH: usize = 2;

/// The most rows remembered; past it the one tried longest ago is
/// forgotten.
const MOST_ROWS: usize = 4096;

/// A row no command has asked for this long, while no row at all has been
/// found held, is forgotten: whether it is still held is unknown. While
/// rows are still found held (an operator's lock on many rows, some of them
/// asked for seldom), none is forgotten for time: forgetting a row asked
/// for less often than this, then finding it held again, cost its batch a
/// wait at every ask.
pub const FORGET_AFTER: Duration = Duration::from_secs(10);

/// The rows found held, each with when it was last tried and the error
/// that try gave (what the commands refused without a try are answered).
pub struct HeldRows {
    rows: HashMap<String, Held>,
    /// Idempotency keys found claimed by another transaction, with when:
    /// not rows of counts, so no command is answered without a try for
    /// them, but while one is held batches are wary, so that each retry
    /// of it costs its batch the brief lock timeouts, not the whole one.
    keys: HashMap<String, Instant>,
    /// When a row was last found held (a wait, or a try, answered
    /// row-busy): rows are forgotten for time only [`FORGET_AFTER`] later.
    found_held: Option<Instant>,
    /// When a batch may next try rows.
    next_probes: Option<Instant>,
    /// When a batch may next try a row not tried for [`FORGET_AFTER`],
    /// between the batches that try rows.
    next_long_untried: Option<Instant>,
    /// How many `tally_rows_held` shows.
    shown: usize,
}

impl Default for HeldRows {
    fn default() -> Self {
        metrics::gauge!("tally_rows_held").set(0.0);
        HeldRows {
            rows: HashMap::new(),
            keys: HashMap::new(),
            found_held: None,
            next_probes: None,
            next_long_untried: None,
            shown: 0,
        }
    }
}

struct Held {
    tried: Instant,
    /// When a command last waited for it (tried or refused).
    asked: Instant,
    error: Error,
}

/// Where [`HeldRows::split`] put a batch's commands: the first `normal`
/// are applied as usual, the next `probes` try a held row, and the rest
/// were answered row-busy.
#[derive(Debug, PartialEq, Eq)]
pub struct Split {
    pub normal: usize,
    pub probes: usize,
}

impl HeldRows {
    /// Whether rows are known to be held: then no command waits for a row
    /// the whole lock timeout.
    pub fn wary(&self) -> bool {
        !self.rows.is_empty() || !self.keys.is_empty()
    }

    /// Sorts the batch into commands applied as usual, commands that try a
    /// held row again (the first command on each row tried), and commands
    /// answered row-busy (set here). A keyed command is never answered
    /// without a try: a retry of a write that committed is answered from
    /// its key, which needs no row. The sort is stable, the commands on a
    /// row after its try are answered, and a row is tried only when no
    /// command applied as usual could be put out of its queue order by it
    /// (the budget's own commands, a keyed command on the same row).
    pub fn split(&mut self, batch: &mut [Queued], now: Instant) -> Split {
        if self.rows.is_empty() {
            return Split {
                normal: batch.len(),
                probes: 0,
            };
        }
        // The remembered row each command waits for; none for the commands
        // applied as usual.
        let remembered: Vec<Option<String>> = batch
            .iter()
            .map(|q| match q.key {
                Some(_) => None,
                None => self.remembered(&q.command),
            })
            .collect();
        let mut probing: Vec<(String, usize)> = Vec::new();
        // Between the batches that try rows, one row not tried for
        // `FORGET_AFTER` may be, one every `PROBE_EVERY`: while other rows
        // are still found held none is forgotten, and a row found held once,
        // long ago, and free since, was refused without a try at nearly
        // every ask (the batches that try rows taken by the rows asked for
        // most).
        let probes_due = self.next_probes.is_none_or(|t| now >= t);
        let (untried_for, most) = match probes_due {
            true => (PROBE_EVERY, PROBES_PER_BATCH),
            false => (FORGET_AFTER, 1),
        };
        if probes_due || self.next_long_untried.is_none_or(|t| now >= t) {
            // Due rows, each by its first command, tried longest ago first.
            let mut due: Vec<(Instant, String, usize)> = Vec::new();
            for (i, row) in remembered.iter().enumerate() {
                let Some(row) = row else { continue };
                let tried = self.rows[row].tried;
                if now >= tried + untried_for && !due.iter().any(|(_, r, _)| r == row) {
                    due.push((tried, row.clone(), i));
                }
            }
            due.sort_by_key(|(tried, _, _)| *tried);
            for (_, row, i) in due {
                if probing.len() == most {
                    break;
                }
                let out_of_order = remembered
                    .iter()
                    .zip(batch.iter())
                    .any(|(r, q)| r.is_none() && reorders(&batch[i].command, &q.command));
                if !out_of_order {
                    probing.push((row, i));
                }
            }
        }
        match (probing.is_empty(), probes_due) {
            (true, _) => {}
            (false, true) => self.next_probes = Some(now + PROBE_EVERY),
            (false, false) => self.next_long_untried = Some(now + PROBE_EVERY),
        }
        let mut answered = 0;
        for (i, (q, row)) in batch.iter_mut().zip(&remembered).enumerate() {
            let Some(held) = row.as_ref().and_then(|r| self.rows.get_mut(r)) else {
                continue;
            };
            held.asked = now;
            match probing
                .iter()
                .any(|(r, first)| Some(r) == row.as_ref() && *first == i)
            {
                true => held.tried = now,
                false => {
                    answered += 1;
                    q.command.refuse(held.error.clone());
                }
            }
        }
        // 0: as usual; 1: a try; 2: answered. Only a try is still
        // unanswered on a remembered row.
        let tries: Vec<&str> = probing.iter().map(|(r, _)| r.as_str()).collect();
        batch.sort_by_cached_key(|q| match q.command.outcome() {
            Some(_) => 2u8,
            None if q.key.is_none() && rows_of(&q.command).any(|r| tries.contains(&r.as_str())) => {
                1
            }
            None => 0,
        });
        Split {
            normal: batch.len() - answered - probing.len(),
            probes: probing.len(),
        }
    }

    /// Answers tries that were not made (the rest of their batch failed
    /// first) as their rows' refusals: they never ran.
    pub fn refuse_untried(&self, tries: &mut [Queued]) {
        for q in tries {
            let error = self
                .remembered(&q.command)
                .and_then(|row| self.rows.get(&row))
                .map(|held| held.error.clone());
            if let Some(error) = error {
                q.command.refuse(error);
            }
        }
    }

    /// The first of a command's rows that is remembered as held.
    fn remembered(&self, command: &Command) -> Option<String> {
        rows_of(command).find(|r| self.rows.contains_key(r))
    }

    /// Learns from commands that ran (and committed): a row-busy answer
    /// remembers the row it waited for (a check's or a reset's budget day,
    /// when that was it), any other forgets the command's rows. A replay
    /// of an idempotency key touched no row and says nothing.
    pub fn learn(&mut self, ran: &[Queued], now: Instant) {
        for q in ran {
            // The error of a transaction that failed or never ran (the
            // server out of reach, a `COMMIT` cut off, a batch stopped
            // part-way) says nothing of the command's rows or key.
            if let Some(Err(
                Error::Unavailable(_)
                | Error::OutcomeUnknown
                | Error::Raced(_)
                | Error::StorageFull(_)
                | Error::StorageLost(_)
                | Error::Closed
                | Error::QueueFull { .. },
            )) = q.command.outcome()
            {
                continue;
            }
            // A key another transaction holds, not a row of counts: the
            // command's row may be free, and a keyed command is tried every
            // time anyway. Any other answer had the key.
            if let Some(key) = &q.key {
                match q.command.outcome() {
                    Some(Err(Error::Busy(_, HeldRow::Key))) => {
                        self.keys.insert(key.as_str().to_owned(), now);
                        continue;
                    }
                    Some(_) => {
                        self.keys.remove(key.as_str());
                    }
                    None => {}
                }
            }
            // A command with no key of its own, refused with a part of its
            // batch whose key claim waited (a lock on the keys' table): no
            // row of its was found held, and its next writes must be tried.
            if q.command.is_replayed()
                || matches!(q.command.outcome(), Some(Err(Error::Busy(_, HeldRow::Key))))
            {
                continue;
            }
            match q.command.outcome() {
                Some(Err(e @ Error::Busy(_, held))) => {
                    let row = match (&q.command, held) {
                        (
                            Command::Check { budget, .. } | Command::Reset { budget, .. },
                            HeldRow::Day,
                        ) => days_of(budget.as_str()),
                        (
                            Command::Check { budget, .. } | Command::Reset { budget, .. },
                            HeldRow::Budget,
                        ) => budget_of(budget.as_str()),
                        _ => q.command.held_row(),
                    };
                    let error = e.clone();
                    self.found_held = Some(now);
                    let held = Held {
                        tried: now,
                        asked: now,
                        error,
                    };
                    self.rows.insert(row, held);
                }
                Some(_) if !self.rows.is_empty() => {
                    for row in rows_of(&q.command) {
                        // A row had again: the others may be free too.
                        if self.rows.remove(&row).is_some() {
                            self.next_probes = None;
                        }
                    }
                }
                _ => {}
            }
        }
        let found_held = self.found_held;
        self.rows.retain(|_, h| {
            let since = found_held.map_or(h.asked, |f| f.max(h.asked));
            now.saturating_duration_since(since) < FORGET_AFTER
        });
        self.keys
            .retain(|_, at| now.saturating_duration_since(*at) < FORGET_AFTER);
        while self.keys.len() > MOST_ROWS
            && let Some(oldest) = self
                .keys
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(key, _)| key.clone())
        {
            self.keys.remove(&oldest);
        }
        while self.rows.len() > MOST_ROWS
            && let Some(oldest) = self
                .rows
                .iter()
                .min_by_key(|(_, h)| h.tried)
                .map(|(row, _)| row.clone())
        {
            self.rows.remove(&oldest);
        }
        if self.rows.len() != self.shown {
            self.shown = self.rows.len();
            metrics::gauge!("tally_rows_held").set(self.shown as f64);
        }
    }
}

/// The rows a command waits for, by the keys they are remembered by: its
/// own ([`Command::held_row`]), and for a check or a reset its budget's
/// days and its budget's row.
fn rows_of(command: &Command) -> impl Iterator<Item = String> + '_ {
    let budget = match command {
        Command::Check { budget, .. } | Command::Reset { budget, .. } => Some(budget.as_str()),
        _ => None,
    };
    let more = budget.map(|b| [days_of(b), budget_of(b)]);
    std::iter::once(command.held_row()).chain(more.into_iter().flatten())
}

/// The key a budget's days are remembered by.
fn days_of(budget: &str) -> String {
    format!("d:{budget}")
}

/// The key a budget's own row is remembered by ([`Command::held_row`] of
/// its admin commands).
fn budget_of(budget: &str) -> String {
    format!("b:{budget}")
}

/// Whether `applied`, applied with the rest of its batch, could be put out
/// of queue order by a try of `tried` run after it: a command on the same
/// counter or budget, unless both are checks of different visitors (which
/// commute but for who meets a global limit first, among calls made at
/// once).
fn reorders(tried: &Command, applied: &Command) -> bool {
    if lock_key(tried) != lock_key(applied) {
        return false;
    }
    let both_checks =
        matches!(tried, Command::Check { .. }) && matches!(applied, Command::Check { .. });
    !both_checks || tried.held_row() == applied.held_row()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        db::command::Reply,
        meter::{IdempotencyKey, Name, VisitorId},
    };

    fn queued(command: Command) -> Queued {
        Queued {
            command,
            key: None,
            request_id: None,
            queued_at: std::time::Instant::now(),
        }
    }

    fn increment(name: &str) -> Queued {
        let (reply, _) = Reply::new();
        queued(Command::Increment {
            name: Name::parse(name).unwrap(),
            by: 1,
            reply,
        })
    }

    fn check(budget: &str, visitor: &str) -> Queued {
        let (reply, _) = Reply::new();
        queued(Command::Check {
            budget: Name::parse(budget).unwrap(),
            visitor: VisitorId::parse(visitor).unwrap(),
            day: None,
            reply,
        })
    }

    fn delete_budget(name: &str) -> Queued {
        let (reply, _) = Reply::new();
        queued(Command::DeleteBudget {
            name: Name::parse(name).unwrap(),
            reply,
        })
    }

    fn busy(at: HeldRow) -> Error {
        Error::Busy(Arc::new(sqlx::Error::PoolTimedOut), at)
    }

    fn set_ok(q: &mut Queued) {
        match &mut q.command {
            Command::Increment { reply, .. } => reply.set(Ok(1)),
            other => panic!("{other}"),
        }
    }

    fn rows(batch: &[Queued]) -> Vec<String> {
        batch.iter().map(|q| q.command.held_row()).collect()
    }

    /// Runs `batch` through `held` as if every command on a row in `busy`
    /// were refused, and every other one went through (increments only).
    fn learn_from(held: &mut HeldRows, mut batch: Vec<Queued>, at: HeldRow, now: Instant) {
        held.split(&mut batch, now);
        for q in &mut batch {
            q.command.fail(busy(at));
        }
        held.learn(&batch, now);
    }

    /// A command whose transaction failed or never ran (the server out of
    /// reach, a batch stopped part-way) says nothing of its row: a row
    /// found held stays remembered; one that got through forgets it.
    #[test]
    fn an_error_of_a_transaction_that_did_not_run_forgets_no_row() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        learn_from(&mut held, vec![increment("a")], HeldRow::Own, t0);
        let mut not_run = increment("a");
        not_run.command.fail(Error::unavailable(
            "an earlier transaction of the batch failed",
        ));
        held.learn(std::slice::from_ref(&not_run), t0);
        assert!(held.wary(), "the row is still taken for held");
        let mut got_it = increment("a");
        set_ok(&mut got_it);
        held.learn(std::slice::from_ref(&got_it), t0);
        assert!(!held.wary(), "a write that got the row forgets it");
    }

    /// A row found held is answered without a try, tried again once per
    /// `PROBE_EVERY` (by its first command, after the rest of the batch;
    /// the others on it answered), and forgotten when a command gets it.
    #[test]
    fn a_held_row_is_answered_and_tried_again_now_and_then() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        assert!(!held.wary());
        let mut first = vec![increment("a"), increment("held"), increment("freed")];
        assert_eq!(
            held.split(&mut first, t0),
            Split {
                normal: 3,
                probes: 0
            }
        );
        set_ok(&mut first[0]);
        first[1].command.fail(busy(HeldRow::Own));
        first[2].command.fail(busy(HeldRow::Own));
        held.learn(&first, t0);
        assert!(held.wary());

        let batch = || {
            vec![
                increment("held"),
                increment("a"),
                check("b", "w"),
                increment("freed"),
                increment("held"),
            ]
        };
        let mut soon = batch();
        let split = held.split(&mut soon, t0 + PROBE_EVERY / 2);
        assert_eq!(
            split,
            Split {
                normal: 2,
                probes: 0
            }
        );
        assert_eq!(
            rows(&soon),
            ["c:a", "v:1:bw", "c:held", "c:freed", "c:held"]
        );
        assert!(soon[..2].iter().all(|q| q.command.outcome().is_none()));
        assert!(
            soon[2..]
                .iter()
                .all(|q| matches!(q.command.outcome(), Some(Err(Error::Busy(..))))),
        );

        // Past PROBE_EVERY each held row's first command tries it.
        let mut later = batch();
        let split = held.split(&mut later, t0 + PROBE_EVERY);
        assert_eq!(
            split,
            Split {
                normal: 2,
                probes: 2
            }
        );
        assert_eq!(rows(&later[2..4]), ["c:held", "c:freed"]);
        assert!(later[..4].iter().all(|q| q.command.outcome().is_none()));
        assert!(later[4].command.outcome().is_some());
        // "held" still is; "freed" was had.
        later[2].command.fail(busy(HeldRow::Own));
        set_ok(&mut later[3]);
        held.learn(&later[2..4], t0 + PROBE_EVERY);

        // Tried just now: answered; "freed" is not held any more.
        let mut next = vec![increment("held"), increment("freed")];
        let split = held.split(&mut next, t0 + PROBE_EVERY * 3 / 2);
        assert_eq!(
            split,
            Split {
                normal: 1,
                probes: 0
            }
        );
        assert_eq!(next[0].command.held_row(), "c:freed");
    }

    /// A command without a key, refused with its batch's part because a
    /// key claim in it waited (an operator's lock on the keys' table), had
    /// no row of its found held: its counter is not remembered, and its
    /// next writes are tried.
    #[test]
    fn a_held_key_of_its_batch_is_not_an_unkeyed_commands_row() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        learn_from(&mut held, vec![increment("c")], HeldRow::Key, t0);
        assert_eq!(held.shown, 0);
        let mut next = vec![increment("c")];
        let split = held.split(&mut next, t0 + Duration::from_millis(1));
        assert_eq!(
            split,
            Split {
                normal: 1,
                probes: 0
            }
        );
        assert!(next[0].command.outcome().is_none());
    }

    /// A key found claimed by another transaction is not the command's row:
    /// the next writes to that counter are applied as usual, not answered
    /// row-busy without a try; but batches are wary while it is held, and
    /// no longer once a command has had the key.
    #[test]
    fn a_held_key_is_not_a_held_row() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        let keyed = |key: &str| {
            let mut q = increment("c");
            q.key = Some(crate::meter::IdempotencyKey::parse(key).unwrap());
            q
        };
        let mut found = vec![keyed("k")];
        found[0].command.fail(busy(HeldRow::Key));
        held.learn(&found, t0);
        assert!(held.wary());
        let mut next = vec![increment("c"), keyed("k")];
        let split = held.split(&mut next, t0 + Duration::from_millis(1));
        assert_eq!(
            split,
            Split {
                normal: 2,
                probes: 0
            }
        );
        assert!(next.iter().all(|q| q.command.outcome().is_none()));
        // Had: replayed, say.
        match &mut next[1].command {
            Command::Increment { reply, .. } => reply.set_replayed(Ok(1)),
            other => panic!("{other}"),
        }
        set_ok(&mut next[0]);
        held.learn(&next, t0 + Duration::from_millis(2));
        assert!(!held.wary());
        // Forgotten in time too.
        held.learn(&found, t0);
        held.learn(&[], t0 + FORGET_AFTER);
        assert!(!held.wary());
    }

    /// A batch tries at most `PROBES_PER_BATCH` rows, those tried longest
    /// ago first, and batches try rows at most once per `PROBE_EVERY`.
    #[test]
    fn few_rows_are_tried_the_oldest_first() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        let names = ["h0", "h1", "h2", "h3"];
        learn_from(
            &mut held,
            vec![increment("h3"), increment("h2")],
            HeldRow::Own,
            t0,
        );
        let t1 = t0 + Duration::from_millis(10);
        learn_from(
            &mut held,
            vec![increment("h1"), increment("h0")],
            HeldRow::Own,
            t1,
        );
        let t2 = t1 + PROBE_EVERY;
        let mut batch: Vec<Queued> = names.iter().map(|n| increment(n)).collect();
        assert_eq!(
            held.split(&mut batch, t2),
            Split {
                normal: 0,
                probes: 2
            }
        );
        assert_eq!(rows(&batch[..2]), ["c:h2", "c:h3"]);
        // Not again within PROBE_EVERY, whatever is due.
        let mut batch: Vec<Queued> = names.iter().map(|n| increment(n)).collect();
        let t3 = t2 + PROBE_EVERY / 2;
        assert_eq!(
            held.split(&mut batch, t3),
            Split {
                normal: 0,
                probes: 0
            }
        );
        let mut batch: Vec<Queued> = names.iter().map(|n| increment(n)).collect();
        let t4 = t2 + PROBE_EVERY;
        assert_eq!(
            held.split(&mut batch, t4),
            Split {
                normal: 0,
                probes: 2
            }
        );
        assert_eq!(rows(&batch[..2]), ["c:h0", "c:h1"]);
    }

    /// A check refused at its budget's day is remembered as the day: every
    /// check of that budget is then answered, whatever the visitor, and one
    /// tries the day for all. A check refused at its own row is that
    /// visitor's only, and a try of it does not stand for the day.
    #[test]
    fn a_held_day_is_every_check_of_its_budget() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        learn_from(
            &mut held,
            vec![check("b", "v1"), check("b", "v2")],
            HeldRow::Own,
            t0,
        );
        learn_from(&mut held, vec![check("c", "v1")], HeldRow::Day, t0);
        let mut next = vec![
            check("b", "v3"),
            check("c", "v9"),
            check("b", "v1"),
            check("c", "v8"),
        ];
        let split = held.split(&mut next, t0 + PROBE_EVERY / 2);
        assert_eq!(
            split,
            Split {
                normal: 1,
                probes: 0
            }
        );
        assert_eq!(rows(&next[..1]), ["v:1:bv3"]);
        // Held visitors' tries, refused again, do not make b's day held.
        let mut later = vec![check("b", "v1"), check("b", "v2"), check("b", "v3")];
        let t1 = t0 + PROBE_EVERY;
        assert_eq!(
            held.split(&mut later, t1),
            Split {
                normal: 1,
                probes: 2
            }
        );
        later[1].command.fail(busy(HeldRow::Own));
        later[2].command.fail(busy(HeldRow::Own));
        held.learn(&later[1..], t1);
        let mut next = vec![check("b", "v4")];
        assert_eq!(
            held.split(&mut next, t1),
            Split {
                normal: 1,
                probes: 0
            }
        );
    }

    /// A check refused at its budget's row (read `FOR SHARE`) is every
    /// check of that budget, and the budget's admin commands too.
    #[test]
    fn a_held_budget_row_is_every_check_of_it() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        learn_from(&mut held, vec![check("b", "v1")], HeldRow::Budget, t0);
        let mut next = vec![check("b", "v2"), delete_budget("b"), check("c", "v1")];
        let split = held.split(&mut next, t0 + PROBE_EVERY / 2);
        assert_eq!(
            split,
            Split {
                normal: 1,
                probes: 0
            }
        );
        assert_eq!(rows(&next[..1]), ["v:1:cv1"]);
    }

    /// A keyed command is never answered without a try (a replay needs no
    /// row), a replay forgets nothing, and a row is not tried apart from a
    /// command on the same budget or counter applied as usual.
    #[test]
    fn keys_and_queue_order_come_first() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        learn_from(
            &mut held,
            vec![increment("k"), check("b", "v")],
            HeldRow::Own,
            t0,
        );
        let t1 = t0 + PROBE_EVERY;
        let mut keyed = increment("k");
        keyed.key = Some(IdempotencyKey::parse("key-1").unwrap());
        let mut batch = vec![increment("k"), keyed, check("b", "v"), delete_budget("b")];
        // "k" has a keyed command applied as usual, "b" a delete: no try.
        assert_eq!(
            held.split(&mut batch, t1),
            Split {
                normal: 2,
                probes: 0
            }
        );
        assert!(batch[0].key.is_some());
        assert_eq!(rows(&batch[2..]), ["c:k", "v:1:bv"]);
        // A replay of the key: the row stays remembered (and is tried, now
        // that nothing else on it is applied as usual).
        if let Command::Increment { reply, .. } = &mut batch[0].command {
            reply.set_replayed(Ok(5));
        }
        held.learn(&batch[..1], t1);
        let mut next = vec![increment("k")];
        assert_eq!(
            held.split(&mut next, t1),
            Split {
                normal: 0,
                probes: 1
            }
        );
    }

    /// A row asked for is kept, tried or not: with many rows held, each is
    /// tried seldom, and forgetting it would cost its next batch a wait.
    #[test]
    fn a_row_asked_for_is_kept_though_seldom_tried() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        let names: Vec<String> = (0..100).map(|i| format!("h{i}")).collect();
        learn_from(
            &mut held,
            names.iter().map(|n| increment(n)).collect(),
            HeldRow::Own,
            t0,
        );
        let mut t = t0;
        while t < t0 + FORGET_AFTER * 2 {
            t += PROBE_EVERY;
            let mut batch: Vec<Queued> = names.iter().map(|n| increment(n)).collect();
            let split = held.split(&mut batch, t);
            assert_eq!(split.normal, 0, "a row was forgotten at {:?}", t - t0);
            for q in &mut batch[..split.probes] {
                q.command.fail(busy(HeldRow::Own));
            }
            held.learn(&batch[..split.probes], t);
        }
    }

    /// Many rows held, each asked for less often than `FORGET_AFTER`: as
    /// long as rows are still found held, none is forgotten, so each costs
    /// one wait, once. Forgotten for time before, the process kept about
    /// the rows asked for in the last 10 s (80 of 500, on three replicas
    /// under an operator's lock), and nearly every batch waited for a row
    /// it had forgotten. Once none is found held any more, they go.
    #[test]
    fn rows_asked_for_seldom_are_kept_while_rows_are_still_found_held() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        let names: Vec<String> = (0..500).map(|i| format!("h{i}")).collect();
        // One ask a batch, round the rows, a batch every 100 ms: each row
        // is asked for every 50 s. A row not remembered waits, and is
        // found held; a remembered one is refused, or now and then tried
        // and found held again.
        let mut t = t0;
        let mut waits = 0;
        for round in 0..2 {
            for name in &names {
                t += Duration::from_millis(100);
                let mut batch = vec![increment(name)];
                let split = held.split(&mut batch, t);
                if split.normal + split.probes == 1 {
                    if split.normal == 1 {
                        waits += 1;
                        assert_eq!(round, 0, "{name} was forgotten and waited again");
                    }
                    batch[0].command.fail(busy(HeldRow::Own));
                }
                // As the writer does: what ran, not what was refused.
                held.learn(&batch[..split.normal + split.probes], t);
            }
        }
        assert_eq!(waits, 500);
        assert_eq!(held.rows.len(), 500);
        // Released: tries get the rows asked for, and the rest, asked for
        // by nothing, go once no row has been found held for a while.
        for name in &names[..10] {
            t += PROBE_EVERY;
            let mut batch = vec![increment(name)];
            let split = held.split(&mut batch, t);
            if split.probes == 1 {
                set_ok(&mut batch[0]);
            }
            held.learn(&batch[..split.normal + split.probes], t);
        }
        assert!(held.rows.len() < 500);
        held.learn(&[], t + FORGET_AFTER);
        assert!(held.rows.is_empty());
        assert!(!held.wary());
    }

    /// Any answer but row-busy forgets the rows (an overflow, an unknown
    /// budget); a row nothing asks for in `FORGET_AFTER` is forgotten.
    #[test]
    fn rows_are_forgotten() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        learn_from(
            &mut held,
            vec![increment("over"), increment("quiet")],
            HeldRow::Own,
            t0,
        );
        let t1 = t0 + PROBE_EVERY;
        let mut batch = vec![increment("over")];
        assert_eq!(
            held.split(&mut batch, t1),
            Split {
                normal: 0,
                probes: 1
            }
        );
        batch[0].command.fail(Error::Internal("overflow".into()));
        held.learn(&batch, t1);
        assert!(!held.rows.contains_key("c:over"));
        let mut t = t1;
        while t < t0 + FORGET_AFTER {
            t += PROBE_EVERY;
            held.learn(&[], t);
        }
        assert!(!held.wary());
    }

    /// One row stays held (an operator's lock, asked for often, found held
    /// at every try); another was found held once and is free since. Asked
    /// for again a minute later, in a batch between those that try rows, it
    /// is tried, not refused: none is forgotten while a row is still found
    /// held, and before, it stayed refused, free, at nearly every ask.
    #[test]
    fn a_row_long_untried_is_tried_between_the_batches_that_try_rows() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        learn_from(
            &mut held,
            vec![increment("held"), increment("freed"), increment("freed2")],
            HeldRow::Own,
            t0,
        );
        // A minute of batches asking for "held" alone, one every 10 ms.
        let mut t = t0;
        loop {
            t += Duration::from_millis(10);
            let mut batch = vec![increment("held")];
            let split = held.split(&mut batch, t);
            let tried = split.probes == 1;
            if tried {
                batch[0].command.fail(busy(HeldRow::Own));
            }
            held.learn(&batch[..split.normal + split.probes], t);
            if tried && t >= t0 + Duration::from_secs(60) {
                break;
            }
        }
        assert_eq!(held.rows.len(), 3, "none forgotten while one is found held");
        // Right after a batch that tried "held": no batch may try rows yet.
        t += Duration::from_millis(10);
        let mut batch = vec![increment("freed"), increment("held")];
        let split = held.split(&mut batch, t);
        assert_eq!(
            split,
            Split {
                normal: 0,
                probes: 1
            },
            "freed is tried"
        );
        assert_eq!(rows(&batch[..1]), ["c:freed"]);
        set_ok(&mut batch[0]);
        held.learn(&batch[..1], t);
        assert_eq!(held.rows.len(), 2, "freed is forgotten once had");
        // That a row was had again lets the next batch try rows at once;
        // found held, it would not: one such try every `PROBE_EVERY`
        // (the batches that try rows kept away here).
        held.next_probes = Some(t + FORGET_AFTER);
        t += Duration::from_millis(10);
        let mut batch = vec![increment("freed2")];
        let split = held.split(&mut batch, t);
        assert_eq!(
            split,
            Split {
                normal: 0,
                probes: 0
            },
            "refused"
        );
        let mut batch = vec![increment("freed2")];
        let split = held.split(&mut batch, t + PROBE_EVERY);
        assert_eq!(
            split,
            Split {
                normal: 0,
                probes: 1
            }
        );
    }
}
