//! What an engine must do inside the writer's transaction: every statement
//! a command needs, as one trait implemented for a SQLite and for a
//! PostgreSQL connection (`sqlite.rs`, `postgres.rs`). The rules built on
//! them (queue order, the budget decision, idempotency, savepoints) are
//! written once, in `counters`, `budgets`, `keys` and `writer`.
//!
//! The contract a store keeps: every method runs inside the transaction the
//! writer opened with [`Store::BEGIN`]; a method that fails leaves that
//! transaction to the writer, who rolls back to the command's savepoint or
//! the whole batch; and whatever another process could write between two
//! statements of a transaction is locked first ([`Store::lock_days`]).

use super::Error;
use crate::meter::BudgetSpec;

/// The budgets that do not exist but have usage stored
/// ([`Store::orphaned_usage`]), the same statement on both engines: one
/// probe of the primary key per budget with usage (the next name after
/// the last), not a scan of every row.
/// The clock's hold, the same on both engines.
pub(super) const CLOCK_HOLD: &str =
    "SELECT stepped_to_us, expected_us, until_us FROM clock_hold WHERE id = 1";

/// Keeps a hold ([`Store::keep_clock_hold`]): `$1` to `$3` its times in
/// microseconds. The same on both engines (SQLite takes `$1` as a
/// parameter named so, bound in order).
pub(super) const KEEP_CLOCK_HOLD: &str =
    "INSERT INTO clock_hold (id, stepped_to_us, expected_us, until_us) VALUES (1, $1, $2, $3)
     ON CONFLICT (id) DO UPDATE SET stepped_to_us = excluded.stepped_to_us,
       expected_us = excluded.expected_us, until_us = excluded.until_us";

/// Keeps a hold's early end in place of the hold it ends (`$4`, its
/// `stepped_to`), and of no other.
pub(super) const END_CLOCK_HOLD: &str =
    "UPDATE clock_hold SET stepped_to_us = $1, expected_us = $2, until_us = $3
     WHERE id = 1 AND stepped_to_us = $4";

/// The hold's three times, in microseconds, as kept: `None` if one is past
/// what a timestamp holds (a row written by hand).
pub(super) fn kept_hold(
    (stepped_to, expected, until): (i64, i64, i64),
) -> Option<super::clock::KeptHold> {
    let t = |us| jiff::Timestamp::from_microsecond(us).ok();
    Some(super::clock::KeptHold {
        stepped_to: t(stepped_to)?,
        expected: t(expected)?,
        until: t(until)?,
        ends: None,
    })
}

pub(super) const ORPHANED_USAGE: &str = "WITH RECURSIVE n (name) AS (
         SELECT min(budget) FROM budget_visitor_usage
         UNION ALL
         SELECT (SELECT min(budget) FROM budget_visitor_usage WHERE budget > n.name)
         FROM n WHERE n.name IS NOT NULL
     )
     SELECT name FROM n
     WHERE name IS NOT NULL AND NOT EXISTS (SELECT 1 FROM budgets b WHERE b.name = n.name)
     UNION
     SELECT budget FROM budget_global_usage g
     WHERE NOT EXISTS (SELECT 1 FROM budgets b WHERE b.name = g.budget)";

/// A budget as stored.
#[derive(Debug, sqlx::FromRow)]
pub struct BudgetRow {
    pub name: String,
    pub visitor_limit: i64,
    pub global_limit: i64,
    pub retention_days: i64,
    /// The IANA name of the budget's time zone.
    pub timezone: String,
}

/// A usage row: a visitor's calls on a day, or (`visitor` is `None`) the
/// day's global calls.
#[derive(Debug, sqlx::FromRow)]
pub struct UsageRow {
    pub budget: String,
    pub day: String,
    pub visitor: Option<String>,
    pub calls: i64,
}

/// What was stored for an idempotency key: the command's fingerprint and
/// its answer as the key keeps it (`keys::Kept`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StoredKey {
    pub fingerprint: String,
    pub result: String,
}

pub(super) trait Store {
    /// Opens the writer's transaction.
    const BEGIN: &'static str;

    /// Opens a transaction for a batch applied set-based: one whose
    /// statements each touch many rows. It may wait for a row lock for
    /// less than [`Self::BEGIN`]'s would: a batch held up by one row
    /// locked elsewhere is run again command by command, where only the
    /// commands on that row wait for it.
    const BEGIN_SET_BASED: &'static str = Self::BEGIN;

    /// Shortens, for the rest of the transaction, how long a statement
    /// waits for a row lock, once a command has waited the whole lock
    /// timeout: see `txn::one_by_one`. `None` where nothing waits
    /// for a row (SQLite's one writer).
    const AFTER_BUSY: Option<&'static str> = None;

    /// Opens a transaction whose statements wait for a row only as
    /// briefly as [`Self::AFTER_BUSY`] has them wait: to try again rows
    /// found held by another transaction a moment ago (`txn::Pass`).
    const BEGIN_PROBE: &'static str = Self::BEGIN;

    /// The time the transaction's rules go by (today, a day's window):
    /// the one clock every process writing the database shares.
    async fn now(&mut self) -> Result<jiff::Timestamp, Error>;

    /// The clock as it reads at this moment, where [`Self::now`] can be
    /// behind it: for a decision taken after waiting for a lock. On
    /// PostgreSQL `now` is when the transaction began, and a lock waited
    /// for since may have let other processes' transactions pass it;
    /// `None` on SQLite, whose one writer reads its clock for each batch
    /// and waits for no lock.
    async fn clock_if_now_lags(&mut self) -> Result<Option<jiff::Timestamp>, Error> {
        Ok(None)
    }

    /// A statement without parameters or rows (transaction control).
    async fn exec(&mut self, sql: &'static str) -> Result<(), Error>;

    /// Adds each `(name, total)` (names distinct), creating counters at 0,
    /// and returns every counter's new value; `None` if one would leave
    /// the 64-bit integers (the statement then changed nothing it keeps:
    /// the caller rolls back).
    async fn upsert_counters(
        &mut self,
        totals: &[(&str, i64)],
    ) -> Result<Option<Vec<(String, i64)>>, Error>;

    /// The same as a whole transaction: `begin` (how long it waits for a
    /// row: [`Self::BEGIN_SET_BASED`], or [`Self::BEGIN_PROBE`]), upsert,
    /// COMMIT. On overflow (`None`) nothing was committed and no
    /// transaction is left open; on an error the caller rolls back, since
    /// one may be.
    async fn upsert_counters_committed(
        &mut self,
        totals: &[(&str, i64)],
        begin: &'static str,
    ) -> Result<Option<Vec<(String, i64)>>, Error> {
        self.exec(begin).await?;
        match self.upsert_counters(totals).await? {
            Some(rows) => {
                self.exec("COMMIT").await.map_err(Error::at_commit)?;
                Ok(Some(rows))
            }
            None => {
                self.exec("ROLLBACK").await?;
                Ok(None)
            }
        }
    }

    /// Creates or replaces a budget's configuration. The caller has read
    /// the one it replaces with [`Self::lock_budget`] first: two `PUT`s of
    /// one budget wait for each other, where share locks upgraded to write
    /// would deadlock.
    async fn put_budget(&mut self, name: &str, spec: &BudgetSpec) -> Result<(), Error>;

    /// The named budgets that exist.
    async fn load_budgets(&mut self, names: &[&str]) -> Result<Vec<BudgetRow>, Error>;

    /// A budget, read to change what it holds (a reset of its usage, a
    /// replacement), if it exists. Where other processes write
    /// (PostgreSQL) its row is then the transaction's alone until it ends:
    /// a command after it on the same budget in the same transaction (an
    /// operator's `PUT` or delete after a reset) never has to upgrade a
    /// share lock to a write lock, which would deadlock with a check
    /// elsewhere that holds a share lock and waits for a day this
    /// transaction locked.
    async fn lock_budget(&mut self, name: &str) -> Result<Option<BudgetRow>, Error>;

    /// Makes every `(budget, day)` the transaction's own until it ends:
    /// whatever a check or reset of that day reads stays true until COMMIT,
    /// whichever process runs it. Every writer of a day's usage rows calls
    /// this first, so the global row's lock guards the visitor rows too.
    async fn lock_days(&mut self, days: &[(&str, &str)]) -> Result<(), Error>;

    /// The usage rows that exist among the given visitor and global keys.
    async fn read_usage(
        &mut self,
        visitors: &[(&str, &str, &str)],
        globals: &[(&str, &str)],
    ) -> Result<Vec<UsageRow>, Error>;

    /// Sets the calls of the given visitor and global rows.
    async fn write_usage(
        &mut self,
        visitors: &[(&str, &str, &str, i64)],
        globals: &[(&str, &str, i64)],
    ) -> Result<(), Error>;

    /// The day and visitor of the budget's visitors' row number `n`
    /// (from 0), in key order, among those on days before `before` (and
    /// after the row `after`, where an earlier share ended): where a share
    /// of [`Self::delete_visitor_usage`] ends. `None` if there are no more
    /// rows than `n`. An engine whose deleted rows leave nothing behind in
    /// the index (SQLite) may start at the first row all the same; one
    /// that keeps them until no snapshot can see them (PostgreSQL, with a
    /// long transaction open elsewhere) must not walk over them again.
    async fn nth_visitor_row(
        &mut self,
        budget: &str,
        before: &str,
        after: Option<(&str, &str)>,
        n: u64,
    ) -> Result<Option<(String, String)>, Error>;

    /// Deletes the budget's visitors' rows on days before `before` (and
    /// after the row `after`, as [`Self::nth_visitor_row`] has it), or
    /// only those up to the row `through` (a day and a visitor, in key
    /// order), the `rows`th: a range of the primary key. With
    /// `only_if_gone`, only while no budget of that name exists, as the
    /// statement itself sees the budgets (see [`super::budgets::purge`]).
    /// Returns the rows deleted.
    async fn delete_visitor_usage(
        &mut self,
        budget: &str,
        before: &str,
        after: Option<(&str, &str)>,
        through: Option<((&str, &str), u64)>,
        only_if_gone: bool,
    ) -> Result<u64, Error>;

    /// Deletes the budget's usage on the days from `from` to before
    /// `before`, all of it; returns the rows deleted.
    async fn delete_days(&mut self, budget: &str, from: &str, before: &str) -> Result<u64, Error>;

    /// Deletes the budget's global rows on days before `before` (one a
    /// day), with `only_if_gone` as [`Self::delete_visitor_usage`] has it.
    /// Returns the rows deleted.
    async fn delete_global_usage(
        &mut self,
        budget: &str,
        before: &str,
        only_if_gone: bool,
    ) -> Result<u64, Error>;

    /// Deletes a budget's usage on days after `after` (days a time zone
    /// moved west leaves ahead of today); returns the rows deleted.
    async fn prune_after(&mut self, budget: &str, after: &str) -> Result<u64, Error>;

    /// Deletes one day's usage of a budget, or one visitor's row of it;
    /// returns the rows deleted.
    async fn delete_usage(
        &mut self,
        budget: &str,
        day: &str,
        visitor: Option<&str>,
    ) -> Result<u64, Error>;

    /// Deletes a budget's row; whether it existed. Its usage is left to
    /// [`super::budgets::purge`], which deletes only a budget's that does
    /// not exist: on PostgreSQL the row's lock is thus taken before the
    /// days', in the order a check takes them.
    async fn delete_budget(&mut self, name: &str) -> Result<bool, Error>;

    /// The budgets that do not exist but have usage stored: a delete's
    /// purge that a restart cut short.
    async fn orphaned_usage(&mut self) -> Result<Vec<String>, Error>;

    /// The clock's hold the database keeps ([`super::clock::KeptHold`]),
    /// if a step was ever seen.
    async fn clock_hold(&mut self) -> Result<Option<super::clock::KeptHold>, Error>;

    /// Keeps `hold` in place of the one kept, in a transaction of its own;
    /// an early end ([`super::clock::KeptHold::ends`]) only in place of the
    /// hold it ends.
    async fn keep_clock_hold(&mut self, hold: &super::clock::KeptHold) -> Result<(), Error>;

    /// Deletes a counter; whether it existed.
    async fn delete_counter(&mut self, name: &str) -> Result<bool, Error>;

    /// What is stored for each `(key, fingerprint)` (keys distinct), in
    /// order, or `None`: then the key is this transaction's until it
    /// ends, and [`Self::remember_keys`] stores the answer. A concurrent
    /// transaction claiming the same key waits for this one and then sees
    /// its answer. Keys are claimed in byte order, the order every
    /// process takes them in. A key is stamped with the time of
    /// [`Self::now`]'s clock, in seconds since the epoch, or with
    /// `not_before` if that is later.
    async fn claim_keys(
        &mut self,
        keys: &[(&str, &str)],
        not_before: i64,
    ) -> Result<Vec<Option<StoredKey>>, Error>;

    /// Stores the answers `(key, answer)` for keys this transaction
    /// claimed.
    async fn remember_keys(&mut self, answers: &[(&str, String)]) -> Result<(), Error>;

    /// Deletes keys this transaction claimed and will store no answer for.
    async fn unclaim_keys(&mut self, keys: &[&str]) -> Result<(), Error>;

    /// Forgets keys stored before `cutoff`, in seconds since the epoch by
    /// [`Self::now`]'s clock (a share of them, if there are very many:
    /// [`super::keys::FORGET_SHARE`]); returns how many.
    async fn forget_keys_stored_before(&mut self, cutoff: i64) -> Result<u64, Error>;
}

/// `work` in a transaction of its own, opened with `begin`: committed if it
/// succeeds, rolled back if not.
pub(super) async fn in_transaction<S: Store, T>(
    conn: &mut S,
    begin: &'static str,
    work: impl AsyncFnOnce(&mut S) -> Result<T, Error>,
) -> Result<T, Error> {
    conn.exec(begin).await?;
    match work(conn).await {
        Ok(done) => {
            conn.exec("COMMIT").await?;
            Ok(done)
        }
        Err(e) => {
            let _ = conn.exec("ROLLBACK").await;
            Err(e)
        }
    }
}
