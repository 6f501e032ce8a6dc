//! Budgets: configuration, daily usage, checks and resets. A check locks
//! the days it counts on ([`Store::lock_days`]), reads the rows it touches,
//! decides in memory with [`meter::decide`] in queue order, and writes the
//! final rows back, so a batch of checks costs a few statements, not a few
//! per check.

use std::collections::HashMap;

use jiff::Timestamp;

use super::{
    Error, clock,
    command::{Deleted, Stored},
    store::{BudgetRow, Store, in_transaction},
};
use crate::{
    meter::{self, Budget, BudgetSpec, Counts, Day, Decision, Name, Refusal, Step, VisitorId},
    telemetry::Throttle,
};

/// Creates or replaces a budget's configuration. Usage on the days the
/// budget keeps under it (today in its time zone, and `retention_days`
/// before it, at `now`) is kept; usage outside them is deleted: days
/// before a shortened retention (a share at a time, as a prune's), and,
/// at once, days after today that moving the time
/// zone west leaves (they would otherwise count against a day that has not
/// begun, and no client could read or reset them). Nor does a new window
/// bring back a day the old one had left: such a day may still be stored
/// (a budget's usage is pruned by the day's first call), and a longer
/// retention or a time zone moved west would otherwise show its old counts
/// or none, by whether a call had come since. What a day holds never
/// depends on whether a prune has run since.
pub async fn put(
    conn: &mut impl Store,
    name: &Name,
    spec: &BudgetSpec,
    now: Timestamp,
) -> Result<Stored, Error> {
    let replaced = conn.lock_budget(name.as_str()).await?;
    // By the clock as it reads once the row is held: on PostgreSQL `now`
    // is when the transaction began, and the row may have been waited for
    // past a midnight, while checks on another process counted on the new
    // day and pruned by it. Reckoned from `now`, a longer window would
    // bring back, part pruned, the day those prunes had begun on.
    let now = conn
        .clock_if_now_lags()
        .await?
        .map_or(now, |at| at.max(now));
    // Days before the window counted from a time no step of the clock has
    // moved on, days after it from one no step has moved back.
    let trusted = clock::trusted(now);
    let mut pruned_rows = 0;
    // Created (again): first what a deleted budget of the name may have
    // left (see [`delete`]), before the budget exists for any check, if
    // that is a share at most, as a delete's. If more is left, the writer
    // (which notes the refusal) deletes it, and the same `PUT` succeeds
    // then; the refusal deletes nothing, only to have it taken back.
    if replaced.is_none() {
        let more = (conn.nth_visitor_row(name.as_str(), AFTER_EVERY_DAY, None, PRUNE_SHARE))
            .await?
            .is_some();
        if more {
            return Err(Error::Purging(name.clone()));
        }
        pruned_rows += purge(conn, name.as_str(), None).await?.0;
    }
    conn.put_budget(name.as_str(), spec).await?;
    // A stored budget tally cannot read (its time zone gone from the
    // database built in) is being replaced: only the new window counts.
    let old = replaced
        .and_then(|row| from_row(row).ok())
        .map(|old| (old.spec.kept_days(trusted.earliest), old.spec.timezone_name));
    let kept = spec.kept_days(trusted.earliest);
    // The days a longer window (or a time zone moved west) brings back,
    // before the old window's oldest: whatever the prunes had not reached
    // of them yet goes at once, so that they read empty. Usually nothing
    // is stored there: the prunes keep up.
    let old_oldest = old.as_ref().map_or(kept.oldest, |(old, _)| old.oldest);
    if kept.oldest < old_oldest {
        let (from, before) = (kept.oldest.to_string(), old_oldest.to_string());
        pruned_rows += conn.delete_days(name.as_str(), &from, &before).await?;
    }
    // The days before the new window (a shorter one leaves some): no
    // answer reads them; as a prune's, a share now and the rest by the
    // writer ([`prune_more`]), which notes every `PUT`, and counted back
    // as a prune's, so that a `PUT` made again just after midnight by a
    // clock a little fast deletes no day that clock set right brings back.
    let cutoff = spec.kept_days(trusted.prune_from()).oldest.to_string();
    pruned_rows += delete_share(
        conn,
        name.as_str(),
        &cutoff,
        Some(PRUNE_SHARE),
        false,
        &mut None,
    )
    .await?
    .0;
    // Only when the time zone changed (under the same zone, a day after
    // today is one just begun: `now` may be a moment behind the checks),
    // by the clock as it read once the row was locked. A day after the new
    // zone's today at that moment has not begun in it.
    if old.is_none_or(|(old, zone)| zone != spec.timezone_name || old.today > kept.today) {
        let today = spec.kept_days(trusted.latest.max(now)).today;
        pruned_rows += conn.prune_after(name.as_str(), &today.to_string()).await?;
    }
    Ok(Stored {
        budget: Budget {
            name: name.clone(),
            spec: spec.clone(),
        },
        pruned_rows,
    })
}

/// Budgets as stored, by name.
pub fn from_rows(rows: Vec<BudgetRow>) -> Result<HashMap<String, Budget>, Error> {
    rows.into_iter()
        .map(|row| Ok((row.name.clone(), from_row(row)?)))
        .collect()
}

/// A budget as stored. A row tally cannot read back is its own
/// inconsistency, never the client's.
pub fn from_row(row: BudgetRow) -> Result<Budget, Error> {
    let name = row.name.clone();
    read_row(row).map_err(|what| Error::Internal(format!("stored budget `{name}`: {what}").into()))
}

/// A budget as stored, or what in its row tally cannot read back.
pub fn read_row(row: BudgetRow) -> Result<Budget, String> {
    let BudgetRow {
        name,
        visitor_limit,
        global_limit,
        retention_days,
        timezone: timezone_name,
    } = row;
    let timezone =
        meter::load_timezone(&timezone_name).map_err(|e| format!("bad time zone: {e}"))?;
    let limit = |n: i64| u32::try_from(n).map_err(|_| format!("{n} is no limit"));
    let retention = u32::try_from(retention_days)
        .ok()
        .filter(|d| (1..=BudgetSpec::MAX_RETENTION_DAYS).contains(d))
        .ok_or_else(|| format!("{retention_days} is no retention in days"))?;
    Ok(Budget {
        name: Name::parse(&name).map_err(|e| e.0)?,
        spec: BudgetSpec {
            visitor_limit: limit(visitor_limit)?,
            global_limit: limit(global_limit)?,
            retention_days: retention,
            timezone,
            timezone_name,
        },
    })
}

/// One budget from what was loaded for it, or [`Refusal::UnknownBudget`].
pub fn one(rows: Vec<BudgetRow>, name: &Name) -> Result<Budget, Error> {
    from_rows(rows)?
        .remove(name.as_str())
        .ok_or_else(|| Refusal::UnknownBudget(name.clone()).into())
}

/// One budget check of a batch.
#[derive(Clone, Copy)]
pub struct CheckItem<'a> {
    pub budget: &'a Name,
    pub visitor: &'a VisitorId,
    pub day: Option<Day>,
}

/// One budget check, inside the caller's transaction (or savepoint).
pub async fn check(
    conn: &mut impl Store,
    item: CheckItem<'_>,
    now: Timestamp,
) -> Result<Decision, Error> {
    let mut decisions = check_many(conn, &[item], now).await?;
    decisions
        .pop()
        .unwrap_or_else(|| Err(Error::Internal("a check produced no decision".into())))
}

/// Why each check could not be counted whatever else holds: it names an
/// unknown budget, or a day its budget does not keep; `None` for one that
/// names a budget and a day it could count on. Reads only, one statement
/// for them all: a check refused for another reason first (past the
/// storage limit, say) still hears its own `404` or `422`, not a
/// retryable refusal that no retry could get past.
pub async fn refusals(
    conn: &mut impl Store,
    items: &[CheckItem<'_>],
    now: Timestamp,
) -> Result<Vec<Option<Error>>, Error> {
    let budgets = named_budgets(conn, items).await?;
    Ok(items
        .iter()
        .map(|i| day_of(&budgets, i, now).err())
        .collect())
}

/// The budgets `items` name that exist, by name, in one statement.
async fn named_budgets(
    conn: &mut impl Store,
    items: &[CheckItem<'_>],
) -> Result<HashMap<String, Budget>, Error> {
    let mut names: Vec<&str> = items.iter().map(|i| i.budget.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    from_rows(conn.load_budgets(&names).await.map_err(Error::at_budget)?)
}

/// The budget a check names and the day it counts on ([`Budget::day`]), or
/// why it counts on none: an unknown budget, a day the budget does not keep.
fn day_of<'b>(
    budgets: &'b HashMap<String, Budget>,
    item: &CheckItem<'_>,
    now: Timestamp,
) -> Result<(&'b Budget, Day), Error> {
    let b = budgets
        .get(item.budget.as_str())
        .ok_or_else(|| Refusal::UnknownBudget(item.budget.clone()))?;
    Ok((b, b.day(item.day, now)?))
}

/// Most visitors' rows one prune deletes: a day of a million visitors is
/// pruned in shares, the first in the batch whose call began the day, the
/// rest by the writer after its next batches ([`prune_more`]), so that no
/// batch waits seconds on it (or, on PostgreSQL, runs past its statement
/// timeout and fails, again at every call of the day). A check whose
/// `pruned_rows` reaches it tells the writer that more may be left.
pub const PRUNE_SHARE: u64 = 10_000;

/// Prunes the next share ([`PRUNE_SHARE`]) of a budget's usage older than
/// its retention, in a transaction of its own that holds the budget's row
/// (so that its window cannot change meanwhile); returns the rows deleted
/// and whether more may be left. Counted back, as a check's prune is, from
/// a time no step of the clock has moved on. Of a budget that does not
/// exist (deleted), the next share of all its usage. `after` is where the
/// share before it ended (see [`Store::nth_visitor_row`]), moved on if
/// this one commits.
pub async fn prune_more<S: Store>(
    conn: &mut S,
    name: &str,
    after: &mut Option<RowKey>,
) -> Result<(u64, bool), Error> {
    let mut next = after.clone();
    let pruned = in_transaction(conn, S::BEGIN_SET_BASED, async |conn| {
        let now = conn.now().await?;
        let Some(budget) = from_rows(conn.load_budgets(&[name]).await?)?.remove(name) else {
            return delete_share(
                conn,
                name,
                AFTER_EVERY_DAY,
                Some(PRUNE_SHARE),
                true,
                &mut next,
            )
            .await;
        };
        let cutoff = budget
            .spec
            .kept_days(clock::trusted(now).prune_from())
            .oldest;
        let cutoff = cutoff.to_string();
        delete_share(conn, name, &cutoff, Some(PRUNE_SHARE), false, &mut next).await
    })
    .await?;
    *after = next;
    Ok(pruned)
}

/// Runs the checks in order, as if each ran alone at its place in the
/// queue: each decided by [`meter::decide`] from the counts the checks
/// before it left. A check naming an unknown budget or a day its budget
/// does not keep ([`Budget::day`]) is refused and counts nothing.
///
/// The first call of a day that reaches the global counter (or, while
/// none has, a visitor's first: see [`meter::Step::first_of_day`]) prunes
/// its budget's usage older than retention, once a batch, counted back from the budget's
/// real today, never from a day a client named. Every day a check counts
/// on is one its budget keeps, so no prune can delete a row the batch
/// writes, and pruning before the write-back is the same as pruning in
/// queue order.
pub async fn check_many(
    conn: &mut impl Store,
    items: &[CheckItem<'_>],
    now: Timestamp,
) -> Result<Vec<Result<Decision, Error>>, Error> {
    let budgets = named_budgets(conn, items).await?;
    // Each check's day written out once: the text keys the usage rows it
    // reads and writes.
    let days: Vec<Result<(&Budget, Day, String), Error>> = items
        .iter()
        .map(|i| day_of(&budgets, i, now).map(|(b, day)| (b, day, day.to_string())))
        .collect();

    let mut usage = DayUsage::read(conn, items, &days).await?;
    // On PostgreSQL `now` is when the transaction began, and the days'
    // locks may have been waited for past a midnight (by more than
    // `clock::UNSEEN`), while another process's first call of the new day
    // pruned by it: a day judged kept
    // by `now` may be one that prune deleted, and counting on it would
    // bring it back empty (a visitor at its limit allowed again). Judged
    // again by the clock as it reads now the days are held, a check whose
    // day is another runs again, with its batch, in a new transaction. (A
    // batch whose every check was refused holds no day, and asks nothing.)
    let later = match days.iter().any(Result::is_ok) {
        true => conn.clock_if_now_lags().await?,
        false => None,
    };
    if let Some(later) = later {
        let later = later.max(now);
        let moved = items.iter().zip(&days).any(|(item, day)| match day {
            Ok((_, was, _)) => !matches!(day_of(&budgets, item, later), Ok((_, is)) if is == *was),
            Err(_) => false,
        });
        if moved {
            return Err(Error::Raced(std::sync::Arc::new(sqlx::Error::Protocol(
                "a day the batch counts on changed while it waited for the days' locks".into(),
            ))));
        }
    }
    // Counted back from a time no step of the clock has moved on, less an
    // error no step is seen in ([`clock::Trusted::prune_from`]).
    let prune_from = clock::trusted(now).prune_from();
    let mut decisions = Vec::with_capacity(items.len());
    let mut prunes: Vec<(usize, Day)> = Vec::new();
    for (i, (item, day)) in items.iter().zip(days).enumerate() {
        let (budget, day, text) = match day {
            Ok(d) => d,
            Err(e) => {
                decisions.push(Err(e));
                continue;
            }
        };
        let step = usage.step(item, text, budget);
        // Once per budget and batch: in a budget whose visitor limit is 0
        // every new visitor's call is a first of the day.
        if step.first_of_day && !prunes.iter().any(|(j, _)| items[*j].budget == item.budget) {
            prunes.push((i, budget.spec.kept_days(prune_from).oldest));
        }
        decisions.push(Ok(Decision::new(budget, day, step, now)));
    }
    if usage.is_empty() {
        return Ok(decisions);
    }
    for (i, cutoff) in prunes {
        let (budget, cutoff) = (items[i].budget.as_str(), cutoff.to_string());
        let (pruned, _) =
            delete_share(conn, budget, &cutoff, Some(PRUNE_SHARE), false, &mut None).await?;
        if let Some(Ok(d)) = decisions.get_mut(i) {
            d.pruned_rows = pruned;
        }
    }
    usage.write(conn).await?;
    Ok(decisions)
}

/// Logs a usage count below 0 found by a check (one line every 10 s at
/// most).
/// The visitor's id is not named: no log line names a visitor (an id may
/// be an e-mail address); the row is found by its count.
fn told_negative(budget: &str, day: &str, visitor: Option<&str>, calls: i64) {
    static NEGATIVE: Throttle = Throttle::new(std::time::Duration::from_secs(10));
    if let Some(held_back) = NEGATIVE.admit() {
        tracing::warn!(
            budget,
            day,
            row = if visitor.is_some() {
                "a visitor's"
            } else {
                "the day's global count"
            },
            calls,
            held_back,
            "a stored usage count below 0 (edited by hand?) is counted from 0; the check writes it back (one line every 10 s at most; held_back: like lines not written since the last)"
        );
    }
}

/// The usage rows a batch of checks touches: read once, counted in memory,
/// written back once.
struct DayUsage {
    /// (budget, day, visitor) -> calls
    visitors: HashMap<(String, String, String), i64>,
    /// (budget, day) -> calls
    globals: HashMap<(String, String), i64>,
    /// Global rows read below 0 and counted from 0: written back even if
    /// no check of the batch reached them.
    mended: Vec<(String, String)>,
}

impl DayUsage {
    /// Locks the days the checks count on, then reads their rows.
    async fn read(
        conn: &mut impl Store,
        items: &[CheckItem<'_>],
        days: &[Result<(&Budget, Day, String), Error>],
    ) -> Result<Self, Error> {
        let mut usage = DayUsage {
            visitors: HashMap::new(),
            globals: HashMap::new(),
            mended: Vec::new(),
        };
        let visitor_keys: Vec<(&str, &str, &str)> = items
            .iter()
            .zip(days)
            .filter_map(|(item, day)| {
                let (_, _, day) = day.as_ref().ok()?;
                Some((item.budget.as_str(), day.as_str(), item.visitor.as_str()))
            })
            .collect();
        if visitor_keys.is_empty() {
            return Ok(usage);
        }
        let mut global_keys: Vec<(&str, &str)> =
            visitor_keys.iter().map(|(b, d, _)| (*b, *d)).collect();
        // In one order everywhere: two processes locking the same days
        // cannot deadlock.
        global_keys.sort_unstable();
        global_keys.dedup();
        conn.lock_days(&global_keys).await.map_err(Error::at_day)?;
        for row in conn.read_usage(&visitor_keys, &global_keys).await? {
            // A count below 0 is none a check leaves (a row edited by hand:
            // calls "taken back"): counted from as it stands, it would let
            // that many calls through unseen, and a global row at -1 every
            // call of the day (its 0 after a call is never written back).
            // Counted from 0, the day's next check writes the row right.
            let calls = match row.calls {
                n if n < 0 => {
                    told_negative(&row.budget, &row.day, row.visitor.as_deref(), n);
                    if row.visitor.is_none() {
                        usage.mended.push((row.budget.clone(), row.day.clone()));
                    }
                    0
                }
                n => n,
            };
            match row.visitor {
                Some(v) => usage.visitors.insert((row.budget, row.day, v), calls),
                None => usage.globals.insert((row.budget, row.day), calls),
            };
        }
        Ok(usage)
    }

    fn is_empty(&self) -> bool {
        self.visitors.is_empty() && self.globals.is_empty()
    }

    /// Decides a check on `day` from the counts it sees, and keeps the
    /// counts it leaves for the checks after it.
    fn step(&mut self, item: &CheckItem<'_>, day: String, budget: &Budget) -> Step {
        let (b, d) = (item.budget.as_str().to_owned(), day);
        let visitor = self
            .visitors
            .entry((b.clone(), d.clone(), item.visitor.as_str().to_owned()))
            .or_default();
        let global = self.globals.entry((b, d)).or_default();
        let step = meter::decide(
            budget.spec.visitor_limit,
            budget.spec.global_limit,
            Counts {
                visitor: *visitor,
                global: *global,
            },
        );
        (*visitor, *global) = (step.after.visitor, step.after.global);
        step
    }

    /// Both write-backs. A day whose checks were all denied by the visitor
    /// limit gets no global row (but one read below 0 is written back at
    /// 0).
    async fn write(self, conn: &mut impl Store) -> Result<(), Error> {
        let visitor_rows: Vec<_> = self
            .visitors
            .iter()
            .map(|((b, d, v), c)| (b.as_str(), d.as_str(), v.as_str(), *c))
            .collect();
        let global_rows: Vec<_> = self
            .globals
            .iter()
            .filter(|(key, c)| **c > 0 || self.mended.contains(key))
            .map(|((b, d), c)| (b.as_str(), d.as_str(), *c))
            .collect();
        conn.write_usage(&visitor_rows, &global_rows).await
    }
}

/// Clears one day's usage ([`Budget::day`]): one visitor's row, or the
/// whole day. Returns the day and the number of rows deleted.
pub async fn reset(
    conn: &mut impl Store,
    budget: &Name,
    day: Option<Day>,
    visitor: Option<&VisitorId>,
    now: Timestamp,
) -> Result<(Day, u64), Error> {
    // Its row exclusively, before the day: an operator's transaction may
    // replace or delete the budget next ([`Store::lock_budget`]).
    let row = conn
        .lock_budget(budget.as_str())
        .await
        .map_err(Error::at_budget)?;
    let day = one(Vec::from_iter(row), budget)?.day(day, now)?;
    let (b, d) = (budget.as_str(), day.to_string());
    conn.lock_days(&[(b, &d)]).await.map_err(Error::at_day)?;
    let deleted = conn
        .delete_usage(b, &d, visitor.map(VisitorId::as_str))
        .await?;
    Ok((day, deleted))
}

/// Deletes a budget and its usage, or refuses with
/// [`Refusal::UnknownBudget`] (and deletes nothing). A check of the same
/// budget earlier in the queue was counted, and its calls go with the
/// budget; one later in the queue finds no budget. The usage goes a share
/// at a time, as a prune's does ([`PRUNE_SHARE`]): the first here, the
/// rest by the writer after this batch ([`prune_more`]); a `PUT` that
/// creates the budget again first deletes what is left, or is refused
/// ([`Error::Purging`]) while more is left than a share.
pub async fn delete(conn: &mut impl Store, name: &Name) -> Result<Deleted, Error> {
    if !conn.delete_budget(name.as_str()).await? {
        return Err(Refusal::UnknownBudget(name.clone()).into());
    }
    let (usage_rows, _) = purge(conn, name.as_str(), Some(PRUNE_SHARE)).await?;
    Ok(Deleted { usage_rows })
}

/// Sorts after every day (days are written `YYYY-MM-DD`): "before" it is
/// every day.
const AFTER_EVERY_DAY: &str = "~";

/// Deletes the usage of a budget that does not exist (a deleted one's):
/// every global row and `share` visitors' rows at most, or all of them.
/// Whether the budget exists is judged by each statement itself, so that
/// on PostgreSQL a budget created meanwhile by another process keeps what
/// it has counted since: its `PUT` purged what was left before any check
/// could count ([`put`]), and what those checks write is not in the
/// statements' snapshot. Returns the rows deleted and whether more may be
/// left.
pub async fn purge(
    conn: &mut impl Store,
    name: &str,
    share: Option<u64>,
) -> Result<(u64, bool), Error> {
    delete_share(conn, name, AFTER_EVERY_DAY, share, true, &mut None).await
}

/// A visitors' row's key within a budget: its day and its visitor.
pub type RowKey = (String, String);

/// Deletes a budget's usage on days before `before`: every global row and
/// `share` visitors' rows at most (the first in key order, a range of the
/// primary key however many there are), or all of them. With
/// `only_if_gone`, only while the budget does not exist ([`purge`]).
/// From just after the row `after` (where the share before ended), which
/// is moved to where this one ends. Returns the rows deleted and whether
/// more may be left (a full share).
async fn delete_share(
    conn: &mut impl Store,
    budget: &str,
    before: &str,
    share: Option<u64>,
    only_if_gone: bool,
    after: &mut Option<RowKey>,
) -> Result<(u64, bool), Error> {
    let from = after.as_ref().map(|(d, v)| (d.as_str(), v.as_str()));
    let through = match share {
        Some(n) => conn
            .nth_visitor_row(budget, before, from, n.saturating_sub(1))
            .await?
            .map(|row| (row, n)),
        None => None,
    };
    // A share that did not find its last row is the rest.
    let last = (through.as_ref()).map(|((d, v), n)| ((d.as_str(), v.as_str()), *n));
    let visitors = conn
        .delete_visitor_usage(budget, before, from, last, only_if_gone)
        .await?;
    let globals = conn
        .delete_global_usage(budget, before, only_if_gone)
        .await?;
    let more = through.is_some() && visitors > 0;
    if let Some((row, _)) = through {
        *after = Some(row);
    }
    Ok((visitors + globals, more))
}
