//! The writer task: the only code in the process that holds a writable
//! connection. It takes every command already waiting in the queue (up to
//! the batch cap), applies them in one transaction, commits once, and only
//! then answers every caller, from one place ([`answer`]).
//!
//! A batch of increments and checks without idempotency keys is applied
//! set-based, a few statements for the whole batch; any other batch (and
//! one whose set-based result could differ, an overflowing counter) runs
//! command by command, each in a savepoint of its own, so that one refused
//! command does not take the rest of its batch down.
//!
//! The engine is the writer's `Backend`: SQLite's one connection and its
//! files, or a PostgreSQL connection opened on demand (see
//! [`super::postgres`], which also reruns a batch that lost a race with
//! another process).
//!
//! On SQLite, before answering, the writer makes sure the commit went into
//! the file at the database's path (see [`super::files`]). If the file was
//! deleted or replaced, no caller hears a success: the batch and everything
//! queued behind it is answered `storage_lost`, the queue closes, and the
//! writer ends with an error so that tally exits non-zero and is restarted.

use std::{path::PathBuf, sync::Arc, time::Duration};

use jiff::Timestamp;
use sqlx::{Connection, SqliteConnection};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    Error, budgets,
    command::{Command, NOT_COMMITTED, Outcome, Queued, Reply},
    counters,
    files::{DbFiles, Lost},
    keys, postgres,
    stats::QueueStats,
    store::Store,
};
use crate::meter::{IdempotencyKey, Refusal};

/// Owns the writable connection and the receiving end of the queue.
/// Created by [`super::Database::open`]; run it with [`Writer::run`].
pub struct Writer {
    pub(super) backend: Backend,
    pub(super) rx: mpsc::Receiver<Queued>,
    pub(super) max_batch: usize,
    pub(super) close: CancellationToken,
    pub(super) stats: Arc<QueueStats>,
    /// Test hook: sleep before each batch to make the queue fill up.
    #[cfg(feature = "test-hooks")]
    pub(super) delay: Option<Duration>,
    /// When expired idempotency keys were last deleted.
    pub(super) keys_forgotten_at: Option<std::time::Instant>,
    /// Test hook: panic on taking batch number N+1.
    #[cfg(feature = "test-hooks")]
    pub(super) panic_after: Option<u64>,
    /// Batches taken so far.
    pub(super) batches: u64,
    /// Since when commits fail for a full disk or an unreachable database,
    /// to log the start and the end of it rather than every failed batch.
    /// The message for when it ends.
    pub(super) failing_since: Option<(std::time::Instant, &'static str)>,
}

/// The writer's connection, of either engine.
pub(super) enum Backend {
    Sqlite {
        conn: SqliteConnection,
        /// The database's files as opened, to notice them being deleted.
        files: DbFiles,
        /// Checkpoint and truncate the WAL when the queue is drained. Off
        /// when another process (Litestream) owns checkpointing.
        checkpoint_on_close: bool,
    },
    Postgres(postgres::WriterConn),
}

impl Backend {
    /// Whether the database's files are still where they were opened; a
    /// server database has none.
    fn check_files(&mut self) -> Result<(), Lost> {
        match self {
            Backend::Sqlite { files, .. } => files.check(),
            Backend::Postgres(_) => Ok(()),
        }
    }

    async fn apply(&mut self, batch: &[Queued]) -> Applied {
        match self {
            Backend::Sqlite { conn, .. } => apply_batch(conn, batch).await,
            Backend::Postgres(pg) => pg.apply(batch).await,
        }
    }

    async fn forget_expired_keys(&mut self) -> Result<u64, Error> {
        match self {
            Backend::Sqlite { conn, .. } => keys::forget_expired(conn).await,
            Backend::Postgres(pg) => pg.forget_expired_keys().await,
        }
    }
}

/// How often an idle writer checks that its files are still in place. After
/// a batch it always checks.
const FILES_CHECK_INTERVAL: Duration = Duration::from_secs(1);

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

/// The writer running on its own thread; see [`Writer::spawn`].
pub struct WriterTask {
    done: tokio::sync::oneshot::Receiver<Result<(), WriterFailed>>,
    /// The writer's outcome, once [`Self::died`] has seen it end.
    ended: Option<Result<(), WriterFailed>>,
}

impl WriterTask {
    /// Waits for the writer to drain the queue and close the database.
    pub async fn join(mut self) -> Result<(), WriterFailed> {
        match self.ended.take() {
            Some(r) => r,
            None => self.done.await.unwrap_or(Err(WriterFailed::Died)),
        }
    }

    /// Resolves if the writer dies. A writer that ended cleanly (its queue
    /// was closed and drained) has not died: then this never resolves, and
    /// [`Self::join`] reports the clean end.
    pub async fn died(&mut self) -> WriterFailed {
        if self.ended.is_none() {
            if let Err(e) = (&mut self.done).await.unwrap_or(Err(WriterFailed::Died)) {
                return e;
            }
            self.ended = Some(Ok(()));
        }
        std::future::pending().await
    }
}

/// Why the writer ended without answering everything it should have. A
/// failed final checkpoint or close is not one: by then every accepted
/// command has been answered (see [`Writer::run`]).
#[derive(Debug, thiserror::Error)]
pub enum WriterFailed {
    #[error("the writer could not start: {0}")]
    Start(std::io::Error),
    #[error("the writer thread died")]
    Died,
    #[error(
        "the database file {} was {what} while open; writes since went to a file that is gone",
        path.display()
    )]
    StorageLost { path: PathBuf, what: &'static str },
}

impl Writer {
    /// Runs the writer on a thread of its own, with a single-threaded
    /// runtime. The writer is the one task every write waits on: on the
    /// shared runtime its wake-ups queue behind every HTTP task, and under
    /// load each of its many database round trips per batch would wait its
    /// turn there. On its own thread it runs the moment SQLite answers.
    pub fn spawn(self) -> std::io::Result<WriterTask> {
        let (tx, done) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("tally-writer".into())
            .spawn(move || {
                let result = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt.block_on(self.run()),
                    Err(e) => Err(WriterFailed::Start(e)),
                };
                let _ = tx.send(result);
            })?;
        Ok(WriterTask { done, ended: None })
    }

    /// Runs until the queue is closed (by [`super::Handle::close`] or by every
    /// handle being dropped) and every command already accepted has been
    /// committed and answered; then closes the database, logging (not
    /// returning) a failed final checkpoint or close: nothing is left to
    /// answer, and every commit is already in the WAL. It returns an error
    /// only if the database files were lost (see [`super::files`]).
    pub async fn run(mut self) -> Result<(), WriterFailed> {
        let mut batch = Vec::with_capacity(self.max_batch);
        let mut closing = false;
        let mut watch = tokio::time::interval(FILES_CHECK_INTERVAL);
        watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                n = self.rx.recv_many(&mut batch, self.max_batch) => {
                    if n == 0 {
                        break;
                    }
                }
                () = self.close.cancelled(), if !closing => {
                    // Refuse new commands; those already queued still run.
                    self.rx.close();
                    metrics::gauge!("tally_write_queue_closed").set(1.0);
                    closing = true;
                    tracing::info!(queued = self.rx.len(), "write queue closed, draining");
                    continue;
                }
                // Idle: a deleted file would otherwise go unnoticed until the
                // next write, and tally would look ready all that time.
                _ = watch.tick() => {
                    if let Err(lost) = self.backend.check_files() {
                        return Err(self.lose(lost, &mut batch).await);
                    }
                    continue;
                }
            }
            #[cfg(feature = "test-hooks")]
            self.test_hooks().await;
            self.batches += 1;
            if let Err(lost) = self.run_batch(&mut batch).await {
                return Err(self.lose(lost, &mut batch).await);
            }
        }
        tracing::info!("write queue drained");
        if let Err(lost) = self.backend.check_files() {
            return Err(self.lose(lost, &mut batch).await);
        }
        self.shutdown().await;
        Ok(())
    }

    /// Checkpoints (unless Litestream owns that) and closes the database.
    /// Every accepted command has been answered by now and every commit is
    /// in the WAL, which the next open replays: a failure here (a full disk
    /// cannot take the checkpointed pages) loses nothing, so it is logged,
    /// and the writer's end is still a clean one. Under Litestream a
    /// non-zero exit would skip its final sync, exactly when it matters.
    async fn shutdown(self) {
        let Backend::Sqlite {
            mut conn,
            checkpoint_on_close,
            ..
        } = self.backend
        else {
            if let Backend::Postgres(pg) = self.backend {
                pg.close().await;
            }
            return;
        };
        if checkpoint_on_close {
            match sqlx::query_as::<_, (i64, i64, i64)>("PRAGMA wal_checkpoint(TRUNCATE)")
                .fetch_one(&mut conn)
                .await
            {
                Ok((0, _, _)) => {}
                Ok(_) => {
                    tracing::warn!("final WAL checkpoint was blocked by a reader; the WAL stays")
                }
                Err(e) => tracing::error!(
                    error = %e,
                    "final WAL checkpoint failed; the WAL stays and is replayed at the next start, \
                     nothing is lost"
                ),
            }
        }
        if let Err(e) = conn.close().await {
            tracing::error!(
                error = %e,
                "closing the database failed after every write was committed and answered"
            );
        }
    }

    /// The database files are gone: stop taking writes at once, so that
    /// `/ready` fails and no later write is queued behind a dead file.
    fn stop_taking_writes(&mut self, lost: &Lost) {
        if self.rx.is_closed() && self.stats.storage_lost().is_some() {
            return;
        }
        tracing::error!(
            path = %lost.path.display(),
            what = lost.what,
            "the database file was {} underneath tally: writes would go to a file that no \
             longer has a name; refusing every write and stopping",
            lost.what
        );
        self.stats.set_storage_lost(Arc::clone(&lost.path));
        self.rx.close();
        metrics::gauge!("tally_write_queue_closed").set(1.0);
    }

    /// Answers every command still queued `storage_lost` without running
    /// it, and gives the writer's error.
    async fn lose(mut self, lost: Lost, batch: &mut Vec<Queued>) -> WriterFailed {
        self.stop_taking_writes(&lost);
        let err = Error::StorageLost(Arc::clone(&lost.path));
        let mut refused = 0;
        loop {
            refused += batch.len();
            for q in batch.drain(..) {
                answer(q, Reply::new(Err(err.clone())), &Ok(()));
            }
            // The queue is closed: this ends once it is empty.
            if self.rx.recv_many(batch, self.max_batch).await == 0 {
                break;
            }
        }
        tracing::error!(refused, "queued writes refused: the database file is gone");
        WriterFailed::StorageLost {
            path: lost.path.to_path_buf(),
            what: lost.what,
        }
    }

    /// Runs one batch and answers its callers; an error if the database
    /// files turned out to be gone (every caller was answered so).
    async fn run_batch(&mut self, batch: &mut Vec<Queued>) -> Result<(), Lost> {
        let size = batch.len();
        let started = std::time::Instant::now();
        let keyed = batch.iter().any(|q| q.key.is_some());
        let Applied { replies, commit } = self.backend.apply(batch).await;
        // Before anyone hears of the batch: a commit into a deleted file
        // succeeded for SQLite and is lost all the same.
        let lost = self.backend.check_files().err();
        let commit = match &lost {
            Some(lost) => {
                self.stop_taking_writes(lost);
                Err(Error::StorageLost(Arc::clone(&lost.path)))
            }
            None => commit,
        };
        self.log_commit(&commit, size);
        let took = started.elapsed();
        self.stats.record_batch(size, took);
        metrics::histogram!("tally_commit_batch_size").record(size as f64);
        metrics::gauge!("tally_write_queue_depth").set(self.rx.len() as f64);
        let ok = replies.iter().filter(|r| r.outcome.is_ok()).count();
        tracing::debug!(batch = size, ok, elapsed = ?took, "batch done");
        // One reply per command, by construction; should one ever be
        // missing, its caller hears an error rather than nothing.
        let missing = std::iter::repeat_with(|| {
            Reply::new(Err(Error::Internal(
                "the batch produced no reply for this command".into(),
            )))
        });
        for (q, reply) in batch.drain(..).zip(replies.into_iter().chain(missing)) {
            answer(q, reply, &commit);
        }
        // After the answers: nobody waits for the clean-up.
        if keyed && lost.is_none() {
            self.forget_expired_keys().await;
        }
        match lost {
            Some(lost) => Err(lost),
            None => Ok(()),
        }
    }

    /// Logs a failed commit once per cause: a full disk or an unreachable
    /// database when it starts and when it ends, any other failure every
    /// time.
    fn log_commit(&mut self, commit: &Result<(), Error>, size: usize) {
        let (lasting, ended) = match commit {
            Err(Error::StorageLost(_)) => return,
            Err(Error::StorageFull(_)) => (
                "the disk is full: writes fail (507) until space is freed",
                "space was freed: writes commit again",
            ),
            Err(Error::Unavailable(_)) => (
                "the database cannot be reached: writes fail (503) until it answers again",
                "the database answers again: writes commit again",
            ),
            Err(e @ Error::OutcomeUnknown) => {
                tracing::error!(error = %e, batch = size, "the batch's COMMIT may or may not have happened; every caller in it hears outcome-unknown");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, batch = size, "batch not committed; every caller in it gets an error");
                return;
            }
            Ok(()) => {
                if let Some((since, ended)) = self.failing_since.take() {
                    tracing::warn!(failed_for = ?since.elapsed(), "{ended}");
                }
                return;
            }
        };
        match self.failing_since {
            None => {
                self.failing_since = Some((std::time::Instant::now(), ended));
                if let Err(e) = commit {
                    tracing::error!(error = %e, batch = size, "{lasting}");
                }
            }
            Some(_) => tracing::debug!(batch = size, "batch not committed: {lasting}"),
        }
    }
}

impl Writer {
    /// The test hooks, before a batch: sleep, or panic holding it.
    #[cfg(feature = "test-hooks")]
    async fn test_hooks(&self) {
        if let Some(delay) = self.delay {
            tokio::time::sleep(delay).await;
        }
        if self.panic_after == Some(self.batches) {
            panic!(
                "test hook: the writer panics holding batch {}",
                self.batches + 1
            );
        }
    }

    /// Forgets idempotency keys past their day, at most once a minute, in a
    /// statement of its own after a batch that used keys.
    async fn forget_expired_keys(&mut self) {
        let due = self
            .keys_forgotten_at
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(60));
        if !due {
            return;
        }
        self.keys_forgotten_at = Some(std::time::Instant::now());
        match self.backend.forget_expired_keys().await {
            Ok(n) if n > 0 => tracing::info!(keys = n, "forgot expired idempotency keys"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not forget expired idempotency keys"),
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

/// Answers one caller: with its command's reply if the batch committed, or
/// with the commit's error if it did not. A caller that has gone away
/// after its write committed is logged, so the write can be accounted for.
fn answer(q: Queued, reply: Reply, commit: &Result<(), Error>) {
    let kind = q.command.kind();
    let result = match (commit, &reply.outcome) {
        // Why the batch failed, when the reason is the storage's.
        (
            Err(
                e @ (Error::StorageFull(_)
                | Error::StorageLost(_)
                | Error::Unavailable(_)
                | Error::OutcomeUnknown),
            ),
            _,
        ) => e.kind(),
        (Err(_), _) => NOT_COMMITTED,
        (Ok(()), Ok(_)) => "ok",
        (Ok(()), Err(e)) => e.kind(),
    };
    metrics::counter!("tally_write_commands_total", "command" => kind, "result" => result)
        .increment(1);
    let reply = match commit {
        Ok(()) => reply,
        Err(e) => Reply::new(Err(e.clone())),
    };
    let committed = reply.outcome.is_ok();
    if let Ok(Outcome::Decision(d)) = &reply.outcome
        && d.pruned_rows > 0
    {
        metrics::counter!("tally_budget_prunes_total").increment(1);
        metrics::counter!("tally_budget_pruned_rows_total").increment(d.pruned_rows);
    }
    if let Err(unheard) = q.reply.send(reply) {
        let request_id = q.request_id.as_deref();
        if committed {
            metrics::counter!("tally_write_committed_caller_gone_total", "command" => kind)
                .increment(1);
            tracing::warn!(
                command = kind,
                target = %q.command,
                request_id,
                result = ?unheard.outcome.ok(),
                "write committed but its caller had gone; it did land"
            );
        } else {
            tracing::info!(
                command = kind,
                target = %q.command,
                request_id,
                error = ?unheard.outcome.err(),
                "write failed and its caller had gone; it did not land"
            );
        }
    }
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
