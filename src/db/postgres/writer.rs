//! The PostgreSQL engine's writer: a connection opened when a batch needs
//! it and dropped when it breaks or reaches a server that takes no writes;
//! a batch that lost a race with another process runs again.

use tokio::time::Instant;

use super::{held::HeldRows, *};
use crate::db::{budgets, clock::KeptHold, store::in_transaction};

/// The writer's connection: opened when a batch needs one, dropped when it
/// breaks.
pub struct WriterConn {
    options: PgConnectOptions,
    conn: Option<PgConnection>,
    held: HeldRows,
    /// When the batch being applied must be done by, all its transactions
    /// together ([`Engine::begin_batch`]).
    deadline: Option<Instant>,
    /// How many more times the batch may be cut in halves around held rows
    /// ([`Self::run_dividing`]).
    cuts_left: u32,
    /// Transactions begun, counted for the tests.
    #[cfg(test)]
    transactions: u32,
    /// What stopped the batch: a transaction of it that could not reach
    /// the server, or whose `COMMIT`'s outcome is unknown. Its transactions
    /// after that one do not run ([`Error::not_run_after`]). Between
    /// batches, a step of the writer's own work that could not reach the
    /// server ([`Self::outside_batch`]): the steps after it do not run
    /// either, until the next batch or idle check.
    stopped: Option<Error>,
}

/// The most times one batch is cut in halves around held rows: enough to
/// find one held name among tens of thousands, or a few among hundreds.
/// Past it (a session holding every row a batch needs, say) what is left
/// runs command by command, as without halves, rather than costing
/// several transactions per held name.
const CUTS_PER_BATCH: u32 = 16;

impl Engine for WriterConn {
    const COMMITS_HERE: bool = false;
    const SPLITS_MIXED: bool = true;

    async fn apply(&mut self, batch: &mut [Queued]) -> Applied {
        WriterConn::apply(self, batch).await
    }

    /// One time limit for the whole batch, however many transactions it
    /// takes (an operator's commands among its writes, a held row found
    /// in halves, a race run again): each one's limit is what is left.
    fn begin_batch(&mut self, commands: usize) {
        self.deadline = Some(Instant::now() + batch_limit(commands));
        self.cuts_left = CUTS_PER_BATCH;
        self.stopped = None;
    }

    fn stopped(&self) -> Option<&Error> {
        self.stopped.as_ref()
    }

    /// A server's storage cannot be deleted underneath tally.
    fn check(&mut self) -> Result<(), Lost> {
        Ok(())
    }

    /// Rows found held are forgotten [`held::FORGET_AFTER`] after the last
    /// ask even when no batch follows, so that `tally_rows_held` does not
    /// go on showing a row no write would be refused for.
    fn idle(&mut self) {
        self.held.learn(&[], Instant::now());
        // Each idle check tries the server again, as each batch does.
        self.stopped = None;
    }

    async fn forget_expired_keys(&mut self, ttl: std::time::Duration) -> Result<u64, Error> {
        WriterConn::forget_expired_keys(self, ttl).await
    }

    async fn prune_more(
        &mut self,
        budget: &str,
        after: &mut Option<budgets::RowKey>,
    ) -> Result<(u64, bool), Error> {
        WriterConn::prune_more(self, budget, after).await
    }

    async fn orphaned_usage(&mut self) -> Result<Vec<String>, Error> {
        WriterConn::orphaned_usage(self).await
    }

    async fn now(&mut self) -> Result<jiff::Timestamp, Error> {
        WriterConn::now(self).await
    }

    /// Read waiting for a lock on the table briefly ([`Store::BEGIN_PROBE`]):
    /// one left open (an operator's `LOCK TABLE`) would otherwise hold up
    /// every write behind the read for the whole lock timeout, each time
    /// it is tried again (and so behind the write of a hold, below).
    async fn clock_hold(&mut self) -> Result<Option<KeptHold>, Error> {
        self.outside_batch(async |conn| {
            in_transaction(conn, PgConnection::BEGIN_PROBE, async |conn| {
                Store::clock_hold(conn).await
            })
            .await
        })
        .await
    }

    /// Waiting for a lock on the table briefly too; tried again after the
    /// next batch if it fails ([`StepWatch::keep_again`]).
    ///
    /// [`StepWatch::keep_again`]: crate::db::clock::StepWatch::keep_again
    async fn keep_clock_hold(&mut self, hold: &KeptHold) -> Result<(), Error> {
        self.outside_batch(async |conn| {
            in_transaction(conn, PgConnection::BEGIN_PROBE, async |conn| {
                Store::keep_clock_hold(conn, hold).await
            })
            .await
        })
        .await
    }

    async fn close(self) {
        WriterConn::close(self).await
    }
}

impl WriterConn {
    pub fn new(options: PgConnectOptions) -> Self {
        WriterConn {
            // Told apart from the readers in `pg_stat_activity`.
            options: options.application_name("tally-writer"),
            conn: None,
            held: HeldRows::default(),
            deadline: None,
            cuts_left: CUTS_PER_BATCH,
            #[cfg(test)]
            transactions: 0,
            stopped: None,
        }
    }

    async fn conn(&mut self) -> Result<&mut PgConnection, Error> {
        if self.conn.is_none() {
            self.conn = Some(connect(&self.options).await?);
            tracing::info!("writer connected to PostgreSQL");
        }
        self.conn
            .as_mut()
            .ok_or_else(|| Error::Internal("no writer connection".into()))
    }

    /// Applies a batch. Commands on rows found held by another transaction
    /// a moment ago do not wait for them again ([`HeldRows`]): they are
    /// answered row-busy with the batch, or, now and then, tried briefly in
    /// a transaction of their own once the rest has committed; and while
    /// any row is known held, no command waits for a row long.
    pub async fn apply(&mut self, batch: &mut [Queued]) -> Applied {
        let pass = match self.held.wary() {
            true => Pass::Wary,
            false => Pass::Batch,
        };
        let split = self.held.split(batch, Instant::now());
        let (normal, rest) = batch.split_at_mut(split.normal);
        let probes = &mut rest[..split.probes];
        if !normal.is_empty() {
            // The commands answered row-busy and the tries not made hear
            // that whatever the batch's error: none of them ran.
            if let Err(e) = self.run_dividing(normal, pass).await {
                self.held.refuse_untried(probes);
                return Err(e);
            }
            log_busy(normal);
            self.held.learn(normal, Instant::now());
            // Stopped part-way: no more of the batch runs.
            if self.stopped.is_some() {
                self.held.refuse_untried(probes);
                return Ok(());
            }
        }
        if !probes.is_empty() {
            match self.run(probes, Pass::Probe, OnHeld::OneByOne).await {
                Ok(()) => self.held.learn(probes, Instant::now()),
                // The rest of the batch committed: only the probes' callers
                // hear that theirs did not.
                Err(e) => {
                    for q in probes.iter_mut() {
                        q.command.fail(e.clone());
                    }
                    // Out of reach, the server stops the batch here too.
                    if e.not_run_after().is_some() {
                        self.stopped = Some(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Applies commands in one transaction, or, when a row one of them
    /// needs is found held by another transaction, in as many as it takes
    /// to find which: the batch is cut in two halves that share no name and
    /// no key ([`txn::halves`]), each applied the same way, until a part of
    /// one name (or of names tied by keys) is left, which runs command by
    /// command, its commands on the held row answered row-busy. A held row
    /// among `n` names costs about `2 log2(n)` set-based transactions, a
    /// few round trips each, where command by command the whole batch
    /// would cost several round trips a command: on a distant server, past
    /// its time limit for a batch of a few dozen, and every caller in it
    /// would hear `503`, batch after batch, for as long as the row is held.
    ///
    /// Each part commits on its own, and its callers hear its commit. Once
    /// a part could not reach the server (or its `COMMIT`'s outcome is
    /// unknown), the parts after it do not run, and their callers hear that
    /// nothing of theirs was done. `Err` means that nothing of the batch
    /// committed (or, for [`Error::OutcomeUnknown`], that it was one
    /// transaction).
    async fn run_dividing(&mut self, batch: &mut [Queued], pass: Pass) -> Applied {
        if let Some(not_run) = self.stopped.as_ref().and_then(Error::not_run_after) {
            return Err(not_run);
        }
        let groups = match self.cuts_left > 0 && batch.len() > 1 {
            true => txn::groups(batch),
            false => Vec::new(),
        };
        let divisible = txn::divisible(&groups);
        let on_held = match divisible {
            true => OnHeld::GiveBack,
            false => OnHeld::OneByOne,
        };
        let applied = self.run(batch, pass, on_held).await;
        if let Err(e) = &applied
            && e.not_run_after().is_some()
            && self.stopped.is_none()
        {
            self.stopped = Some(e.clone());
        }
        if !matches!(applied, Err(Error::Busy(..))) || !divisible {
            return applied;
        }
        self.cuts_left -= 1;
        let Some(at) = txn::halves(batch, &groups) else {
            return self.run(batch, pass, OnHeld::OneByOne).await;
        };
        let (first, second) = batch.split_at_mut(at);
        let halved = match pass {
            Pass::Batch => Pass::Halved,
            pass => pass,
        };
        let first_applied = Box::pin(self.run_dividing(first, halved)).await;
        // Out of reach: nothing of either half ran.
        if let Err(Error::Unavailable(_)) = first_applied {
            return first_applied;
        }
        // Once a command has waited for a held row, the rest of the batch
        // waits for one only briefly: a session holding many rows costs
        // the batch one lock timeout, not one each.
        let waited = first
            .iter()
            .any(|q| matches!(q.command.outcome(), Some(Err(Error::Busy(..)))));
        let pass = match waited {
            true => Pass::Hurried,
            false => halved,
        };
        let mut first_applied = Some(first_applied);
        for part in [first, second] {
            let applied = match first_applied.take() {
                Some(applied) => applied,
                None => Box::pin(self.run_dividing(part, pass)).await,
            };
            let Err(e) = applied else { continue };
            for q in part.iter_mut() {
                q.command.fail(e.clone());
            }
        }
        Ok(())
    }

    /// Applies commands in one transaction, running it again when it lost
    /// a race with another process.
    async fn run(&mut self, batch: &mut [Queued], pass: Pass, on_held: OnHeld) -> Applied {
        let mut attempt = 0;
        // A connection kept from an earlier batch may have died while idle
        // (a server restart, a proxy's or firewall's idle timeout): a batch
        // that finds it gone, before COMMIT, committed nothing and runs
        // once more on a new one.
        let mut stale = self.conn.is_some();
        // A table changed under the connection's prepared statements: the
        // batch, which nothing of committed, runs once more on a new one.
        let mut replanned = false;
        loop {
            let limit = match self.deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => batch_limit(batch.len()),
            };
            if limit.is_zero() {
                // Out of time before it began: nothing of it ran.
                return Err(timed_out(batch_limit(batch.len())));
            }
            #[cfg(test)]
            {
                self.transactions += 1;
            }
            // Connecting counts against the time too.
            let until = Instant::now() + limit;
            let conn = match tokio::time::timeout_at(until, self.conn()).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(timed_out(limit)),
            };
            let sent = Arc::new(AtomicBool::new(false));
            let applied =
                COMMIT_SENT.scope(Arc::clone(&sent), txn::apply_by(conn, batch, pass, on_held));
            let Ok(applied) = tokio::time::timeout_at(until, applied).await else {
                self.conn = None;
                if !sent.load(Ordering::Relaxed) {
                    // Cut off before its COMMIT went out: the server ends
                    // the transaction with the session, and nothing of it
                    // committed, so every caller may retry.
                    tracing::error!(
                        timeout = ?limit,
                        batch = batch.len(),
                        "PostgreSQL did not answer the batch in time, before its COMMIT; \
                         dropping the connection, nothing of the batch committed"
                    );
                    return Err(timed_out(limit));
                }
                // Cut off between sending COMMIT and its answer: the batch
                // may have committed.
                tracing::error!(
                    timeout = ?limit,
                    batch = batch.len(),
                    "PostgreSQL did not answer the batch in time; dropping the connection, \
                     its writes' outcome is unknown"
                );
                return Err(Error::OutcomeUnknown);
            };
            match &applied {
                // Refused on a new connection too: not a stale statement
                // but a feature the server does not have, the batch's error.
                Err(e) if plans_changed(e) && replanned => return applied,
                Err(e) if plans_changed(e) => {
                    replanned = true;
                    let e = e.clone();
                    self.drop_connection(&e);
                    continue;
                }
                Err(e) if e.is_retryable() && attempt < RACE_RETRIES => {
                    attempt += 1;
                    metrics::counter!("tally_write_retries_total").increment(1);
                    tracing::debug!(error = %e, attempt, "batch lost a race; running it again");
                    // Back off a little, at random (every pod's tally is PID
                    // 1, so nothing about the process tells them apart), so
                    // that two processes that deadlocked do not meet again
                    // at once.
                    tokio::time::sleep(backoff(attempt)).await;
                    continue;
                }
                // Lost every time: the server is too busy to take it now.
                Err(Error::Raced(source)) => return Err(Error::Unavailable(source.clone())),
                Err(e) if needs_new_connection(e) && stale => {
                    stale = false;
                    let e = e.clone();
                    self.drop_connection(&e);
                    continue;
                }
                Err(e) if needs_new_connection(e) => {
                    let e = e.clone();
                    self.drop_connection(&e);
                }
                Err(Error::OutcomeUnknown) => self.drop_connection(&Error::OutcomeUnknown),
                _ => {}
            }
            return applied;
        }
    }

    /// Forgets the connection: the next batch connects anew. A session the
    /// server ended for being idle past its `idle_session_timeout` (a
    /// managed service's setting, met after every quiet spell) is routine,
    /// and told as what it is.
    fn drop_connection(&mut self, why: &Error) {
        if self.conn.take().is_none() {
            return;
        }
        let idle = matches!(why, Error::Unavailable(e) if super::pg_code(e) == Some("57P05"));
        if idle {
            tracing::info!(
                "the server ended the writer's idle PostgreSQL session (its \
                 idle_session_timeout); the next batch connects anew"
            );
        } else {
            tracing::warn!(
                error = %why,
                "writer dropped its PostgreSQL connection; the next batch connects anew"
            );
        }
    }

    pub async fn forget_expired_keys(&mut self, ttl: std::time::Duration) -> Result<u64, Error> {
        self.outside_batch(async |conn| keys::forget_expired(conn, ttl).await)
            .await
    }

    /// The next share of a budget's prune ([`budgets::prune_more`]), in
    /// the time a batch has.
    pub async fn prune_more(
        &mut self,
        budget: &str,
        after: &mut Option<budgets::RowKey>,
    ) -> Result<(u64, bool), Error> {
        self.outside_batch(async |conn| budgets::prune_more(conn, budget, after).await)
            .await
    }

    /// The deleted budgets whose usage is still stored, outside any batch.
    pub async fn orphaned_usage(&mut self) -> Result<Vec<String>, Error> {
        self.outside_batch(async |conn| Store::orphaned_usage(conn).await)
            .await
    }

    /// The server's clock, outside any batch.
    pub async fn now(&mut self) -> Result<jiff::Timestamp, Error> {
        self.outside_batch(async |conn| Store::now(conn).await)
            .await
    }

    /// `work` on the writer's connection outside any batch, in the time a
    /// batch has (connecting included), the connection dropped if its
    /// error calls for a new one.
    ///
    /// Once a step of this work could not reach the server (no connection
    /// could be had, or the server did not answer in time), the steps
    /// after it (the clock's reading, the keys' clean-up, a prune, the look
    /// for orphans, one after another) are not tried until the next batch
    /// or idle check: each would wait out a time limit of its own (a
    /// connect's, 2 s), and the write queued behind them with it. A server
    /// that stops answering just after a batch then holds the next write
    /// for one step's limit and its own connect, not for every step's. A
    /// kept connection found dead (the server ended an idle session, a
    /// proxy closed it) stops nothing: the next step connects anew.
    async fn outside_batch<T>(
        &mut self,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        if let Some(e @ Error::Unavailable(_)) = &self.stopped {
            return Err(e.clone());
        }
        let until = Instant::now() + BATCH_TIMEOUT;
        let conn = match tokio::time::timeout_at(until, self.conn()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(self.stop(e)),
            Err(_) => return Err(self.stop(timed_out(BATCH_TIMEOUT))),
        };
        match tokio::time::timeout_at(until, work(conn)).await {
            Ok(r) => self.keep_if_sound(r),
            Err(_) => {
                let e = timed_out(BATCH_TIMEOUT);
                self.drop_connection(&e);
                Err(self.stop(e))
            }
        }
    }

    /// `e`, remembered as what stops the writer's steps between batches
    /// ([`Self::outside_batch`]).
    fn stop(&mut self, e: Error) -> Error {
        if let Error::Unavailable(_) = e {
            self.stopped = Some(e.clone());
        }
        e
    }

    /// `r`, having dropped the connection if its error calls for a new one.
    fn keep_if_sound<T>(&mut self, r: Result<T, Error>) -> Result<T, Error> {
        if let Err(e) = &r
            && (needs_new_connection(e) || plans_changed(e))
        {
            self.drop_connection(e);
        }
        r
    }

    pub async fn close(self) {
        if let Some(conn) = self.conn
            && let Err(e) = conn.close().await
        {
            tracing::warn!(error = %e, "closing the writer's PostgreSQL connection failed");
        }
    }
}

/// Names the commands of a committed batch that found their row held by
/// another transaction past the lock timeout: one line per batch, and only
/// when a row is found held, not while it stays held ([`HeldRows`]), so a
/// row held for long is not one line per request.
fn log_busy(batch: &[Queued]) {
    let busy: Vec<String> = batch
        .iter()
        .filter_map(|q| match q.command.outcome() {
            Some(Err(Error::Busy(_, crate::db::HeldRow::Key))) if q.key.is_none() => Some(format!(
                "{} (a key another command of its batch claims)",
                q.command
            )),
            Some(Err(Error::Busy(_, held))) => Some(format!("{} ({})", q.command, held.what())),
            _ => None,
        })
        .collect();
    if let Some(first) = busy.first() {
        tracing::warn!(
            commands = busy.len(),
            first = %first,
            "rows held by another transaction past the lock timeout (a session outside \
             tally; a prepared transaction, which only COMMIT PREPARED or ROLLBACK PREPARED \
             ends (pg_prepared_xacts); a tally session the network cut off, which PostgreSQL \
             ends after idle_in_transaction_session_timeout, 30 s; or another tally process's \
             batch, slow for its distance to the server): those commands were answered row-busy, \
             the rest of the batch committed"
        );
    }
}

/// How long a batch of `commands` may take, all its transactions together.
fn batch_limit(commands: usize) -> Duration {
    let commands = u32::try_from(commands).unwrap_or(u32::MAX);
    BATCH_TIMEOUT.saturating_add(BATCH_TIMEOUT_PER_COMMAND.saturating_mul(commands))
}

/// A random wait of up to 2^attempt ms (at most 256 ms).
fn backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let ceiling = 1u64 << attempt.min(8);
    Duration::from_micros(random % (ceiling * 1000))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        db::command::{Answer, Command, Reply},
        meter::Name,
    };

    fn increment(name: &str) -> (Queued, tokio::sync::oneshot::Receiver<Answer<i64>>) {
        let (reply, rx) = Reply::new();
        let command = Command::Increment {
            name: Name::parse(name).unwrap(),
            by: 1,
            reply,
        };
        let q = Queued {
            command,
            key: None,
            request_id: None,
            queued_at: std::time::Instant::now(),
        };
        (q, rx)
    }

    fn heard(rx: &mut tokio::sync::oneshot::Receiver<Answer<i64>>) -> Error {
        match rx.try_recv().expect("answered").result {
            Err(e) => e,
            Ok(v) => panic!("answered {v}"),
        }
    }

    /// A port nothing listens on: every connection to it is refused.
    fn nowhere() -> PgConnectOptions {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        PgConnectOptions::new().host("127.0.0.1").port(port)
    }

    /// A writer with no server to reach that found counter `name` held a
    /// second ago: due for a try.
    fn found_held_a_second_ago(name: &str) -> WriterConn {
        let mut writer = WriterConn::new(nowhere());
        let then = Instant::now() - Duration::from_secs(1);
        let (mut found, _) = increment(name);
        found.command.fail(Error::Busy(
            Arc::new(sqlx::Error::PoolTimedOut),
            crate::db::HeldRow::Own,
        ));
        writer.held.learn(std::slice::from_ref(&found), then);
        writer
    }

    /// A server that takes connections and never answers (a frozen host,
    /// a partition past the first packet): the first step of the writer's
    /// work between batches waits out its connect; the steps after it are
    /// not tried, since each would wait as long, and a write queued behind
    /// them with it; the next idle check, and the next batch, try the
    /// server again.
    #[tokio::test]
    async fn steps_between_batches_stop_at_the_first_that_cannot_reach_the_server() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        let mut writer = WriterConn::new(PgConnectOptions::new().host("127.0.0.1").port(port));
        let unreachable = |r: Result<_, Error>| matches!(r, Err(Error::Unavailable(_)));

        let started = std::time::Instant::now();
        assert!(unreachable(writer.now().await.map(drop)));
        let took = started.elapsed();
        assert!(took >= CONNECT_TIMEOUT, "{took:?}");
        let started = std::time::Instant::now();
        let ttl = Duration::from_secs(60);
        assert!(unreachable(writer.forget_expired_keys(ttl).await.map(drop)));
        assert!(unreachable(writer.orphaned_usage().await.map(drop)));
        let pruned = writer.prune_more("b", &mut None).await;
        assert!(unreachable(pruned.map(drop)));
        assert!(unreachable(Engine::clock_hold(&mut writer).await.map(drop)));
        assert!(unreachable(writer.now().await.map(drop)));
        // Without the stop, 2 s each.
        let took = started.elapsed();
        assert!(took < CONNECT_TIMEOUT / 4, "{took:?}");

        Engine::idle(&mut writer);
        let started = std::time::Instant::now();
        assert!(unreachable(writer.now().await.map(drop)));
        let took = started.elapsed();
        assert!(took >= CONNECT_TIMEOUT, "{took:?}");

        writer.begin_batch(1);
        let (q, _rx) = increment("tried");
        let started = std::time::Instant::now();
        let commit = writer.apply(&mut [q]).await;
        let took = started.elapsed();
        assert!(matches!(commit, Err(Error::Unavailable(_))), "{commit:?}");
        assert!(took >= CONNECT_TIMEOUT, "{took:?}");
        drop(silent);
    }

    /// A kept connection found dead between batches (the server ended the
    /// session: its `idle_session_timeout`, `pg_terminate_backend`) stops
    /// nothing: the step after it connects anew and runs.
    #[tokio::test]
    async fn a_connection_found_dead_between_batches_stops_no_later_step() {
        use sqlx::Connection;
        let db = crate::db::tests::FreshPostgres::new("dead_between").await;
        let options = connect_options(&db.url, Duration::from_millis(100)).unwrap();
        let mut writer = WriterConn::new(options);
        writer.now().await.unwrap();
        let mut admin = PgConnection::connect(&db.url).await.unwrap();
        let writers = "FROM pg_stat_activity WHERE application_name = 'tally-writer' \
                       AND datname = current_database()";
        let end = format!("SELECT pg_terminate_backend(pid) {writers}");
        sqlx::query(sqlx::AssertSqlSafe(end))
            .execute(&mut admin)
            .await
            .unwrap();
        let left = format!("SELECT count(*) {writers}");
        while sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(left.clone()))
            .fetch_one(&mut admin)
            .await
            .unwrap()
            > 0
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        let found_dead = writer.forget_expired_keys(Duration::from_secs(60)).await;
        assert!(
            matches!(found_dead, Err(Error::Unavailable(_))),
            "{found_dead:?}"
        );
        assert!(writer.stopped.is_none(), "{:?}", writer.stopped);
        writer.now().await.unwrap();
        writer.orphaned_usage().await.unwrap();
        drop((admin, writer));
        db.drop().await;
    }

    /// A batch's time limit is its own, not each transaction's: once the
    /// batch has used it up (in earlier transactions, say), a transaction
    /// of it is not begun, and its callers hear that the server did not
    /// answer in time, without a connection tried.
    #[tokio::test(start_paused = true)]
    async fn a_batch_out_of_time_begins_no_more_transactions() {
        let mut writer = WriterConn::new(nowhere());
        writer.begin_batch(2);
        tokio::time::advance(batch_limit(2) - Duration::from_millis(1)).await;
        let (q, _rx) = increment("early");
        let commit = writer.apply(&mut [q]).await;
        let Err(Error::Unavailable(e)) = commit else {
            panic!("{commit:?}")
        };
        assert!(!e.to_string().contains("did not answer"), "{e}");

        let mut writer = WriterConn::new(nowhere());
        writer.begin_batch(2);
        tokio::time::advance(batch_limit(2)).await;
        let (q, _rx) = increment("late");
        let commit = writer.apply(&mut [q]).await;
        let Err(Error::Unavailable(e)) = commit else {
            panic!("{commit:?}")
        };
        assert!(e.to_string().contains("did not answer within"), "{e}");
    }

    /// A session holding every row a batch needs (an operator's bulk
    /// `SELECT ... FOR UPDATE`): the batch is cut in halves at most
    /// [`CUTS_PER_BATCH`] times, so it costs a bounded number of
    /// transactions, not a few per held name (about 300 here), and every
    /// command hears row-busy well within the batch's time limit.
    #[tokio::test]
    async fn every_row_held_costs_a_batch_a_bounded_number_of_transactions() {
        use sqlx::Connection;
        const HELD: usize = 150;
        let db = crate::db::tests::FreshPostgres::new("all_held").await;
        let mut holder = PgConnection::connect(&db.url).await.unwrap();
        let hold = format!(
            "INSERT INTO counters (name, value) SELECT 'h' || i, 1 FROM generate_series(1, {HELD}) i;
             BEGIN; SELECT * FROM counters FOR UPDATE"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(hold))
            .execute(&mut holder)
            .await
            .unwrap();
        let options = connect_options(&db.url, Duration::from_millis(100)).unwrap();
        let mut writer = WriterConn::new(options);
        let (mut batch, _answers): (Vec<_>, Vec<_>) =
            (1..=HELD).map(|i| increment(&format!("h{i}"))).unzip();
        writer.begin_batch(HELD);
        let started = std::time::Instant::now();
        let commit = writer.apply(&mut batch).await;
        let took = started.elapsed();
        assert!(commit.is_ok(), "{commit:?}");
        for q in &batch {
            let outcome = q.command.outcome();
            assert!(
                matches!(outcome, Some(Err(Error::Busy(..)))),
                "{}: {outcome:?}",
                q.command
            );
        }
        // At most 1 + 2 x 16; cut without a bound, about 2 per held name.
        assert!(
            writer.transactions < HELD as u32 / 4,
            "{} transactions",
            writer.transactions
        );
        assert!(took < batch_limit(HELD), "{took:?}");
        drop((holder, writer));
        db.drop().await;
    }

    /// A try of a held row that cannot reach the server stops the batch
    /// as any transaction of it would: the later parts of a split batch
    /// do not run, each waiting to connect in turn.
    #[tokio::test]
    async fn a_probe_out_of_reach_stops_the_batch() {
        let mut writer = found_held_a_second_ago("held");
        let (tried, mut tried_rx) = increment("held");
        let mut batch = vec![tried];
        writer.begin_batch(batch.len());
        let commit = writer.apply(&mut batch).await;
        assert!(commit.is_ok(), "{commit:?}");
        assert!(
            matches!(writer.stopped(), Some(Error::Unavailable(_))),
            "{:?}",
            writer.stopped()
        );
        for mut q in batch {
            q.command.send(&commit);
        }
        assert!(matches!(heard(&mut tried_rx), Error::Unavailable(_)));
    }

    /// A batch whose own part fails (here: no server to reach) answers its
    /// callers with that failure, but the commands it answered row-busy
    /// without running, and the try of a held row it never made, hear
    /// row-busy: none of them ran, whatever the batch's error says (an
    /// outcome-unknown, say, would send their callers reading and
    /// retrying for nothing).
    #[tokio::test]
    async fn commands_on_held_rows_hear_row_busy_whatever_the_batch_hears() {
        let mut writer = found_held_a_second_ago("held");

        let (free, mut free_rx) = increment("free");
        let (tried, mut tried_rx) = increment("held");
        let (refused, mut refused_rx) = increment("held");
        let mut batch = vec![free, tried, refused];
        let commit = writer.apply(&mut batch).await;
        assert!(matches!(commit, Err(Error::Unavailable(_))), "{commit:?}");
        for mut q in batch {
            q.command.send(&commit);
        }
        assert!(matches!(heard(&mut free_rx), Error::Unavailable(_)));
        assert!(matches!(heard(&mut tried_rx), Error::Busy(..)));
        assert!(matches!(heard(&mut refused_rx), Error::Busy(..)));
    }
}
