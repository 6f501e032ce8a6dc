//! Rows another transaction holds past the lock timeout (an operator's
//! `SELECT ... FOR UPDATE` left open, say), remembered between batches.
//!
//! The writer has one connection and applies one batch at a time, so a
//! batch that waits for a held row holds up every write behind it. Once a
//! command has waited the whole lock timeout for a row and been answered
//! row-busy, later commands on that row do not wait again: they are
//! answered row-busy at once, except that every [`PROBE_EVERY`] one batch
//! tries the row again, briefly and in a transaction of its own after the
//! rest of the batch has committed (`txn::apply_probes`). The first
//! command to get the row forgets it. Without this, a client retrying a
//! write to a held row put a lock timeout into nearly every batch, and
//! every other write of the process waited that long.

use std::{collections::HashMap, time::Duration};

use tokio::time::Instant;

use super::{Error, Queued};
use crate::db::command::Command;

/// How often a row found held is tried again.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// The most held rows one batch tries again: each try can wait the
/// probe's brief lock timeout.
pub const PROBES_PER_BATCH: usize = 4;

/// The most rows remembered; past it the one tried longest ago is
/// forgotten (its next command waits the lock timeout again).
const MOST_ROWS: usize = 4096;

/// A row no command has tried for this long is forgotten: nothing asks
/// for it, so whether it is still held is unknown (its next command waits
/// the lock timeout again, if it is).
pub const FORGET_AFTER: Duration = Duration::from_secs(10);

/// The rows found held, each with when it was last tried and the error
/// that try gave (what the commands refused at once are answered).
pub struct HeldRows {
    rows: HashMap<String, Held>,
    /// How many `tally_rows_held` shows.
    shown: usize,
}

impl Default for HeldRows {
    fn default() -> Self {
        metrics::gauge!("tally_rows_held").set(0.0);
        HeldRows {
            rows: HashMap::new(),
            shown: 0,
        }
    }
}

struct Held {
    tried: Instant,
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
    /// Sorts the batch into commands applied as usual, commands that try a
    /// held row again (the first command on each row tried), and commands
    /// answered row-busy now (set here). The sort is stable, and a row's
    /// commands after its try are answered, so the commands on each row
    /// keep their queue order.
    pub fn split(&mut self, batch: &mut [Queued], now: Instant) -> Split {
        if self.rows.is_empty() {
            return Split {
                normal: batch.len(),
                probes: 0,
            };
        }
        let mut probing: Vec<String> = Vec::new();
        for q in batch.iter_mut() {
            let Some((row, held)) = self.held(&q.command) else {
                continue;
            };
            if probing.len() < PROBES_PER_BATCH
                && !probing.contains(&row)
                && now >= held.tried + PROBE_EVERY
            {
                held.tried = now;
                probing.push(row);
            } else {
                q.command.fail(held.error.clone());
            }
        }
        // 0: as usual; 1: a try; 2: answered. A command left unanswered
        // on a held row is its row's try.
        batch.sort_by_cached_key(|q| match q.command.outcome() {
            Some(_) => 2u8,
            None if self.rows_of(&q.command).any(|r| self.rows.contains_key(&r)) => 1,
            None => 0,
        });
        let answered = batch
            .iter()
            .filter(|q| q.command.outcome().is_some())
            .count();
        Split {
            normal: batch.len() - answered - probing.len(),
            probes: probing.len(),
        }
    }

    /// The rows a command waits for, by the keys they are remembered by:
    /// its own ([`Command::held_row`]), and for a check its budget's days
    /// too.
    fn rows_of<'a>(&self, command: &'a Command) -> impl Iterator<Item = String> + 'a {
        let days = match command {
            Command::Check { budget, .. } => Some(days_of(budget.as_str())),
            _ => None,
        };
        std::iter::once(command.held_row()).chain(days)
    }

    /// The first of a command's rows found held, and what is known of it.
    fn held(&mut self, command: &Command) -> Option<(String, &mut Held)> {
        let row = self.rows_of(command).find(|r| self.rows.contains_key(r))?;
        let held = self.rows.get_mut(&row)?;
        Some((row, held))
    }

    /// Learns from commands that ran (and committed): a row-busy answer
    /// remembers its row, a success forgets it. When two checks of one
    /// budget or more found their rows held and none of its checks got
    /// its rows, what is held is the budget's day (or its own row): every
    /// check of that budget is then answered, and tried, as one row.
    pub fn learn(&mut self, ran: &[Queued], now: Instant) {
        let mut checked: Vec<Checked> = Vec::new();
        for q in ran {
            match q.command.outcome() {
                Some(Err(e @ Error::Busy(_))) => {
                    self.rows.insert(
                        q.command.held_row(),
                        Held {
                            tried: now,
                            error: e.clone(),
                        },
                    );
                }
                Some(Ok(())) if !self.rows.is_empty() => {
                    for row in self.rows_of(&q.command).collect::<Vec<_>>() {
                        self.rows.remove(&row);
                    }
                }
                _ => {}
            }
            if let Command::Check { budget, .. } = &q.command {
                let i = match checked.iter().position(|c| c.budget == budget.as_str()) {
                    Some(i) => i,
                    None => {
                        checked.push(Checked {
                            budget: budget.as_str(),
                            busy: 0,
                            through: false,
                            error: None,
                        });
                        checked.len() - 1
                    }
                };
                match q.command.outcome() {
                    Some(Err(e @ Error::Busy(_))) => {
                        checked[i].busy += 1;
                        checked[i].error = Some(e);
                    }
                    Some(Ok(())) => checked[i].through = true,
                    _ => {}
                }
            }
        }
        for c in checked {
            if c.busy >= 2
                && !c.through
                && let Some(e) = c.error
            {
                self.rows.insert(
                    days_of(c.budget),
                    Held {
                        tried: now,
                        error: e.clone(),
                    },
                );
            }
        }
        self.rows
            .retain(|_, h| now.saturating_duration_since(h.tried) < FORGET_AFTER);
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

/// What one batch's checks of one budget met ([`HeldRows::learn`]).
struct Checked<'a> {
    budget: &'a str,
    /// How many were answered row-busy, and the last such error.
    busy: usize,
    error: Option<&'a Error>,
    /// Whether one got its rows.
    through: bool,
}

/// The key a budget's days are remembered by, when checks of it find them
/// held.
fn days_of(budget: &str) -> String {
    format!("d:{budget}")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        db::command::{Command, Reply},
        meter::{Name, VisitorId},
    };

    fn increment(name: &str) -> Queued {
        let (reply, _) = Reply::new();
        Queued {
            command: Command::Increment {
                name: Name::parse(name).unwrap(),
                by: 1,
                reply,
            },
            key: None,
            request_id: None,
        }
    }

    fn check(budget: &str, visitor: &str) -> Queued {
        let (reply, _) = Reply::new();
        Queued {
            command: Command::Check {
                budget: Name::parse(budget).unwrap(),
                visitor: VisitorId::parse(visitor).unwrap(),
                day: None,
                reply,
            },
            key: None,
            request_id: None,
        }
    }

    fn busy() -> Error {
        Error::Busy(Arc::new(sqlx::Error::PoolTimedOut))
    }

    fn set_ok(q: &mut Queued) {
        match &mut q.command {
            Command::Increment { reply, .. } => reply.set(Ok(1)),
            other => panic!("{other}"),
        }
    }

    /// A row found held is answered at once, tried again once per
    /// `PROBE_EVERY` (by its first command, after the rest of the batch;
    /// the others on it answered), and forgotten when a command gets it.
    #[test]
    fn a_held_row_is_answered_at_once_and_tried_again_now_and_then() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        let mut first = vec![
            increment("a"),
            increment("held"),
            increment("freed"),
            check("b", "v"),
        ];
        assert_eq!(
            held.split(&mut first, t0),
            Split {
                normal: 4,
                probes: 0
            }
        );
        set_ok(&mut first[0]);
        for q in &mut first[1..] {
            q.command.fail(busy());
        }
        held.learn(&first, t0);

        let batch = || {
            vec![
                increment("held"),
                increment("a"),
                check("b", "w"),
                increment("freed"),
                increment("held"),
                // The same visitor of another budget: another row.
                check("c", "v"),
                check("b", "v"),
            ]
        };
        let rows = |b: &[Queued]| b.iter().map(|q| q.command.held_row()).collect::<Vec<_>>();
        let mut soon = batch();
        let split = held.split(&mut soon, t0 + PROBE_EVERY / 2);
        assert_eq!(
            split,
            Split {
                normal: 3,
                probes: 0
            }
        );
        assert_eq!(rows(&soon[..3]), ["c:a", "v:1:bw", "v:1:cv"]);
        assert!(soon[..3].iter().all(|q| q.command.outcome().is_none()));
        assert!(
            soon[3..]
                .iter()
                .all(|q| matches!(q.command.outcome(), Some(Err(Error::Busy(_))))),
        );
        assert_eq!(rows(&soon[3..]), ["c:held", "c:freed", "c:held", "v:1:bv"]);

        // Past PROBE_EVERY each held row's first command tries it.
        let mut later = batch();
        let split = held.split(&mut later, t0 + PROBE_EVERY);
        assert_eq!(
            split,
            Split {
                normal: 3,
                probes: 3
            }
        );
        assert_eq!(rows(&later[3..6]), ["c:held", "c:freed", "v:1:bv"]);
        assert!(later[..6].iter().all(|q| q.command.outcome().is_none()));
        assert_eq!(rows(&later[6..]), ["c:held"]);
        assert!(later[6].command.outcome().is_some());
        // "held" still is; "freed" and the visitor's row were had.
        later[3].command.fail(busy());
        set_ok(&mut later[4]);
        later[5].command.fail(Error::Closed);
        held.learn(&later[3..6], t0 + PROBE_EVERY);

        // Tried just now: answered; "freed" is not held any more.
        let mut next = vec![increment("held"), increment("freed")];
        let split = held.split(&mut next, t0 + PROBE_EVERY + PROBE_EVERY / 2);
        assert_eq!(
            split,
            Split {
                normal: 1,
                probes: 0
            }
        );
        assert_eq!(next[0].command.held_row(), "c:freed");
    }

    /// Two checks of a budget refused row-busy and none through: the
    /// budget's day is what is held, and every check of it is answered
    /// (one tries it now and then), whatever its visitor.
    #[test]
    fn checks_of_a_held_day_are_answered_as_one_row() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        // One refused check is its visitor's row only.
        let mut one = vec![check("b", "v1"), check("c", "v1"), check("c", "v2")];
        held.split(&mut one, t0);
        one[0].command.fail(busy());
        one[1].command.fail(busy());
        one[2].command.fail(busy());
        held.learn(&one, t0);
        let mut next = vec![check("b", "v9"), check("c", "v9"), increment("a")];
        let split = held.split(&mut next, t0 + PROBE_EVERY / 2);
        assert_eq!(
            split,
            Split {
                normal: 2,
                probes: 0
            }
        );
        assert_eq!(next[2].command.held_row(), "v:1:cv9");
        // Then one check of "c" tries the day for all of them.
        let mut later = vec![check("c", "v7"), check("c", "v8"), check("c", "v1")];
        let split = held.split(&mut later, t0 + PROBE_EVERY);
        assert_eq!(
            split,
            Split {
                normal: 0,
                probes: 2
            }
        );
        assert_eq!(
            later
                .iter()
                .map(|q| q.command.held_row())
                .collect::<Vec<_>>(),
            ["v:1:cv7", "v:1:cv1", "v:1:cv8"]
        );
    }

    /// A row nothing asked for in `FORGET_AFTER` is forgotten.
    #[test]
    fn a_row_nothing_asks_for_is_forgotten() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        let mut first = vec![increment("quiet"), increment("asked")];
        held.split(&mut first, t0);
        for q in &mut first {
            q.command.fail(busy());
        }
        held.learn(&first, t0);
        // "asked" is tried now and then, and stays held.
        let mut t = t0;
        while t < t0 + FORGET_AFTER {
            t += PROBE_EVERY;
            let mut batch = vec![increment("asked")];
            assert_eq!(
                held.split(&mut batch, t),
                Split {
                    normal: 0,
                    probes: 1
                }
            );
            batch[0].command.fail(busy());
            held.learn(&batch, t);
        }
        let mut batch = vec![increment("quiet"), increment("asked")];
        let split = held.split(&mut batch, t + PROBE_EVERY / 2);
        assert_eq!(
            split,
            Split {
                normal: 1,
                probes: 0
            }
        );
        assert_eq!(batch[0].command.held_row(), "c:quiet");
        assert_eq!(held.rows.len(), 1);
    }

    /// At most `PROBES_PER_BATCH` rows are tried in one batch; the others
    /// are answered and tried in a later one.
    #[test]
    fn a_batch_tries_few_held_rows() {
        let mut held = HeldRows::default();
        let t0 = Instant::now();
        let rows = PROBES_PER_BATCH + 2;
        let mut first: Vec<Queued> = (0..rows).map(|i| increment(&format!("h{i}"))).collect();
        held.split(&mut first, t0);
        for q in &mut first {
            q.command.fail(busy());
        }
        held.learn(&first, t0);
        let mut batch: Vec<Queued> = (0..rows).map(|i| increment(&format!("h{i}"))).collect();
        let split = held.split(&mut batch, t0 + PROBE_EVERY);
        assert_eq!(
            split,
            Split {
                normal: 0,
                probes: PROBES_PER_BATCH
            }
        );
        // The rows not tried are the next batch's.
        let mut batch: Vec<Queued> = (0..rows).map(|i| increment(&format!("h{i}"))).collect();
        let split = held.split(&mut batch, t0 + PROBE_EVERY);
        assert_eq!(
            split,
            Split {
                normal: 0,
                probes: 2
            }
        );
    }
}
