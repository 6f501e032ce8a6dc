//! The writer task: the only code in the process that holds a writable
//! connection. It takes every command already waiting in the queue (up to
//! the batch cap), applies them in one transaction, commits once, and only
//! then answers every caller, from one place ([`answer`]).
//!
//! How a batch is applied is the transaction rules' ([`super::txn`]); the
//! connection it runs on is the [`Engine`]'s, chosen once at open. This
//! loop knows neither SQL nor which engine it drives.
//!
//! Before answering, the writer asks the engine whether its storage is
//! still where it was opened ([`Engine::check`]: SQLite's files can be
//! deleted or replaced underneath it). If it is not, no caller hears a
//! success: the batch and everything queued behind it is answered
//! `storage_lost`, the queue closes, and the writer ends with an error so
//! that tally exits non-zero and is restarted.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    Error, budgets,
    clock::{self, StepWatch},
    command::{Command, NOT_COMMITTED, Queued, Sent},
    committed::Committed,
    stats::QueueStats,
    txn::{self, Applied},
};
use crate::{meter::Refusal, telemetry::Throttle};

/// The writer, ready to run on its own thread ([`Writer::spawn`]):
/// created by [`super::Database::open`] around the engine it opened.
pub struct Writer(Box<dyn FnOnce() -> std::io::Result<WriterTask> + Send>);

impl Writer {
    /// Runs the writer on a thread of its own, with a single-threaded
    /// runtime. The writer is the one task every write waits on: on the
    /// shared runtime its wake-ups queue behind every HTTP task, and under
    /// load each of its many database round trips per batch would wait its
    /// turn there. On its own thread it runs the moment the database
    /// answers.
    pub fn spawn(self) -> std::io::Result<WriterTask> {
        (self.0)()
    }
}

impl<E: Engine> From<WriterLoop<E>> for Writer {
    fn from(writer: WriterLoop<E>) -> Self {
        Writer(Box::new(move || writer.spawn()))
    }
}

/// Owns the engine's writable connection and the receiving end of the
/// queue.
pub(super) struct WriterLoop<E: Engine> {
    pub(super) engine: E,
    pub(super) rx: mpsc::Receiver<Queued>,
    /// Where committed counter values are published (SQLite only).
    pub(super) committed: Option<Arc<Committed>>,
    pub(super) max_batch: usize,
    pub(super) close: CancellationToken,
    pub(super) stats: Arc<QueueStats>,
    /// Test hook: sleep before each batch to make the queue fill up.
    #[cfg(feature = "test-hooks")]
    pub(super) delay: Option<Duration>,
    /// When expired idempotency keys were last deleted.
    pub(super) keys_forgotten_at: Option<std::time::Instant>,
    /// How long an idempotency key is remembered.
    pub(super) key_ttl: Duration,
    /// Budgets whose usage older than their retention may not all be
    /// pruned yet (a day of more visitors than [`budgets::PRUNE_SHARE`]),
    /// and when the next share may be tried after one failed.
    pub(super) prunes_due: PrunesDue,
    /// Steps of the wall clock the batches go by, which hold pruning and
    /// forgetting keys back ([`clock`]).
    pub(super) clock: Arc<StepWatch>,
    /// Whether keeping the clock's hold failed, and was logged.
    pub(super) hold_unkept: bool,
    /// When the writer last read the clock for itself ([`Self::read_clock`]).
    pub(super) clock_read_at: Option<std::time::Instant>,
    /// When reading the hold the database keeps last failed, if it has
    /// not been read yet ([`Self::read_hold_late`]).
    pub(super) hold_unread: Option<std::time::Instant>,
    /// Test hook: panic on taking batch number N+1.
    #[cfg(feature = "test-hooks")]
    pub(super) panic_after: Option<u64>,
    /// Test hook: sleep between a batch's COMMIT and the publication of
    /// its counter values.
    #[cfg(feature = "test-hooks")]
    pub(super) publish_delay: Option<Duration>,
    /// Batches taken so far.
    pub(super) batches: u64,
    /// Since when, and when last, writes met a full disk; and since when
    /// commits fail for an unreachable database: to log the start and the
    /// end of each rather than every failed batch (see [`Lasting`]).
    pub(super) failing: Lasting,
}

/// The lasting failures the writer logs when they start and when they end,
/// each on its own: one may begin while the other lasts.
#[derive(Debug, Default)]
pub(super) struct Lasting {
    /// Since when, and when last, a write met a full disk.
    full: Option<(std::time::Instant, std::time::Instant)>,
    /// Since when the database cannot be reached, and whether that was
    /// logged.
    unreachable: Option<(std::time::Instant, bool)>,
    /// When an outage was last logged, and how many began since without
    /// being logged: one outage every [`OUTAGE_LOG_EVERY`] at most, as
    /// the reads log theirs (a session cancelled every 50 ms by an
    /// operator's loop was one pair of lines each time).
    outage_logged: Option<std::time::Instant>,
    outages_held: u64,
}

/// The least time between two outages the writer logs. One that lasts is
/// logged all the same, late, once this has passed.
const OUTAGE_LOG_EVERY: Duration = Duration::from_secs(10);

/// How long writes must commit with none meeting a full disk before the
/// full disk is logged as over. A full disk does not fail every write: one
/// that fits where there is room (a counter's update in its page, SQLite's
/// WAL written over from its start) commits while one that needs more
/// space fails, so a commit says nothing of the disk.
const FULL_DISK_QUIET: Duration = Duration::from_secs(5);

/// What the writer loop needs of an engine: its writable connection and
/// whatever comes with it (SQLite's files and checkpoints, PostgreSQL's
/// reconnection and race reruns). Chosen once, at open; nothing in this
/// module asks which engine it is.
pub(super) trait Engine: Send + 'static {
    /// Applies a batch in one transaction ([`super::txn::apply_batch`]).
    async fn apply(&mut self, batch: &mut [Queued]) -> Applied;

    /// A batch of `commands` is about to be applied, in one transaction
    /// or several ([`Self::SPLITS_MIXED`]).
    fn begin_batch(&mut self, _commands: usize) {}

    /// What stopped the batch begun last part-way, if anything did: a
    /// transaction of it (not necessarily a whole part) that could not
    /// reach the server, or whose `COMMIT`'s outcome is unknown. Since
    /// that batch (or the last idle check), also a step of the writer's
    /// own work that could not reach the server: the steps after it wait
    /// for the next batch.
    fn stopped(&self) -> Option<&Error> {
        None
    }

    /// Whether the storage is still where it was opened: SQLite's files
    /// can be deleted or replaced underneath it (see `sqlite::files`); a
    /// server's cannot.
    fn check(&mut self) -> Result<(), Lost>;

    /// Called once a second while no batch comes, before the idle check's
    /// work: what ages with time alone is brought up to date (on
    /// PostgreSQL, rows found held and not asked for since are forgotten,
    /// and `tally_rows_held` says so; a server found unreachable is tried
    /// again, see [`Self::stopped`]).
    fn idle(&mut self) {}

    /// Forgets one share (at most [`super::keys::FORGET_SHARE`]) of the
    /// idempotency keys older than `ttl`; returns how many.
    async fn forget_expired_keys(&mut self, ttl: Duration) -> Result<u64, Error>;

    /// Prunes the next share of a budget's usage older than its retention
    /// ([`budgets::prune_more`]), or of a deleted budget's: the rows
    /// deleted, and whether more may be left.
    async fn prune_more(
        &mut self,
        budget: &str,
        after: &mut Option<budgets::RowKey>,
    ) -> Result<(u64, bool), Error>;

    /// The deleted budgets whose usage is still stored
    /// ([`super::store::Store::orphaned_usage`]).
    async fn orphaned_usage(&mut self) -> Result<Vec<String>, Error>;

    /// The clock the batches go by (the host's; on PostgreSQL the
    /// server's), as [`super::store::Store::now`] reads it.
    async fn now(&mut self) -> Result<jiff::Timestamp, Error>;

    /// The clock's hold the database keeps, if any ([`clock::KeptHold`]).
    async fn clock_hold(&mut self) -> Result<Option<clock::KeptHold>, Error>;

    /// Keeps the clock's hold, outside any batch.
    async fn keep_clock_hold(&mut self, hold: &clock::KeptHold) -> Result<(), Error>;

    /// Closes the connection once every accepted command has been
    /// answered: what fails here is logged, since nothing is left to
    /// answer (see [`Writer::run`]).
    async fn close(self);

    /// Whether a commit's work runs in this process (SQLite, on a thread
    /// of its own) rather than in a server's (PostgreSQL): only then can
    /// handlers speed it up by yielding their core ([`CommitClock`](super::stats::CommitClock)).
    const COMMITS_HERE: bool;

    /// Whether a batch that mixes an operator's commands with increments
    /// and checks is split into transactions ([`txn::transactions`]):
    /// where every statement is a round trip over a network (PostgreSQL),
    /// command by command costs each write of such a batch several; in
    /// this process (SQLite) it costs little, and a commit (an fsync) per
    /// part would cost more.
    const SPLITS_MIXED: bool;
}

/// The storage was lost underneath tally, for the log line and the answers.
#[derive(Debug)]
pub(super) struct Lost {
    pub path: Arc<Path>,
    pub what: &'static str,
    /// Whether what was committed before the loss was seen may be kept
    /// all the same: only `-shm` is gone (the WAL holding the commit still
    /// has its name), or Litestream replicates the database (it reads the
    /// WAL by its name, which a loss of the database file alone leaves,
    /// and ships the commit to the replica, from which it comes back).
    pub may_be_kept: bool,
}

/// How often an idle writer checks that its files are still in place. After
/// a batch it always checks.
const FILES_CHECK_INTERVAL: Duration = Duration::from_secs(1);

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
        "the database file {} was {what} while open; writes since went where they are not kept",
        path.display()
    )]
    StorageLost { path: PathBuf, what: &'static str },
}

impl<E: Engine> WriterLoop<E> {
    fn spawn(self) -> std::io::Result<WriterTask> {
        let (tx, done) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("tally-writer".into())
            .spawn(move || {
                // SQLite's writer reaches its database through sqlx's
                // thread, by channels: without an I/O driver its runtime
                // parks on a futex instead of in `epoll_wait`, and a
                // statement's answer wakes it without an eventfd's write
                // and read. PostgreSQL's talks over a socket.
                let mut rt = tokio::runtime::Builder::new_current_thread();
                if E::COMMITS_HERE {
                    rt.enable_time();
                } else {
                    rt.enable_all();
                }
                let result = match rt.build() {
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
    /// only if the database files were lost (see `sqlite::files`).
    pub async fn run(mut self) -> Result<(), WriterFailed> {
        // The clock's first reading, before any batch: a step after the
        // start is a step from here. One before it, this process cannot
        // see; a process before it that saw one kept its hold.
        let kept = match self.engine.clock_hold().await {
            Ok(kept) => kept,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "could not read the clock's hold the database keeps: until it is read \
                     (tried again before batches, once a second at most), a step of the \
                     clock a process before this one saw does not hold this one back"
                );
                self.hold_unread = Some(std::time::Instant::now());
                None
            }
        };
        let now = match self.engine.now().await {
            Ok(now) => Some(now),
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "could not read the clock as the writer starts: a step of it before the \
                     first batch will not be seen"
                );
                None
            }
        };
        self.clock.start(now, kept);
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
                    // Timed as a batch is: a check stuck on a hung volume
                    // holds every write behind it.
                    self.stats.set_on_batch(true);
                    // First: on PostgreSQL it tries the server again, the
                    // hold's late reading included.
                    self.engine.idle();
                    self.read_hold_late().await;
                    let checked = self.engine.check();
                    // A prune left part done goes on with no batch to
                    // follow (a day's first call, then quiet): shares
                    // for half the interval, while nothing is
                    // queued.
                    if checked.is_ok() {
                        self.keep_clock_hold().await;
                        self.look_for_orphans().await;
                        self.prune_while_quiet().await;
                    }
                    self.stats.set_on_batch(false);
                    if let Err(lost) = checked {
                        return Err(self.lose(lost, &mut batch).await);
                    }
                    continue;
                }
            }
            self.stats.set_on_batch(true);
            self.read_hold_late().await;
            #[cfg(feature = "test-hooks")]
            self.test_hooks(batch.len()).await;
            self.batches += 1;
            let ran = self.run_parts(&mut batch).await;
            self.stats.set_on_batch(false);
            // Every batch checks the files after its commit: the idle
            // check is due a whole interval after it, not at once.
            watch.reset();
            if let Err(lost) = ran {
                return Err(self.lose(lost, &mut batch).await);
            }
        }
        tracing::info!("write queue drained");
        self.read_clock(true).await;
        self.keep_clock_hold().await;
        if let Err(lost) = self.engine.check() {
            return Err(self.lose(lost, &mut batch).await);
        }
        self.engine.close().await;
        Ok(())
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
            "the database file was {} underneath tally: writes would go where they are not \
             kept; refusing every write and stopping",
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
                answer(q, &Err(err.clone()));
            }
            // The queue is closed: this ends once it is empty.
            if self.rx.recv_many(batch, self.max_batch).await == 0 {
                break;
            }
        }
        tracing::error!(
            refused,
            "queued writes refused: the database file was {}",
            lost.what
        );
        WriterFailed::StorageLost {
            path: lost.path.to_path_buf(),
            what: lost.what,
        }
    }

    /// Runs what the queue gave: in one transaction, or where statements
    /// are round trips over a network ([`Engine::SPLITS_MIXED`]) in the
    /// transactions [`txn::transactions`] splits it into, one after
    /// another. Once one of them has failed for the database (unreachable,
    /// out of time, or cut off during its `COMMIT`), the parts after it do
    /// not run: their callers hear at once that nothing of theirs was
    /// done, as the whole batch would have, rather than each part waiting
    /// out its own time limit while they give up. But a command whose key
    /// was in a part cut off during its `COMMIT` would have been answered
    /// from what that part stored, or run: its outcome is unknown too. An
    /// error, with the commands not yet run back in `batch`, if the
    /// database files turned out to be gone.
    async fn run_parts(&mut self, batch: &mut Vec<Queued>) -> Result<(), Lost> {
        self.engine.begin_batch(batch.len());
        self.run_split(batch).await?;
        // After the answers, and after the batch's last transaction: nobody
        // waits for the clean-up. After any batch, keyed or not: past the
        // storage limit, the writes refused may carry no key, and only
        // forgetting expired keys makes room for them. Not when the server
        // could not be reached: the next batch would wait for it.
        if self.engine.stopped().is_none() {
            self.keep_clock_hold().await;
            self.forget_expired_keys().await;
            // Under steady writes the writer may never be idle: one share
            // whatever is queued, more while nothing is (a client retrying
            // a refused PUT every second would otherwise never let the
            // idle shares run).
            self.look_for_orphans().await;
            self.prune_while_quiet().await;
        }
        Ok(())
    }

    /// [`Self::run_parts`]'s transactions, one after another.
    async fn run_split(&mut self, batch: &mut Vec<Queued>) -> Result<(), Lost> {
        if !E::SPLITS_MIXED || !txn::mixed(batch) {
            return self.run_batch(batch).await.map(drop);
        }
        let parts = txn::transactions(std::mem::take(batch));
        let mut parts = parts.into_iter();
        while let Some(mut part) = parts.next() {
            let keys: HashSet<String> = part
                .iter()
                .filter_map(|q| Some(q.key.as_ref()?.as_str().to_owned()))
                .collect();
            let commit = match self.run_batch(&mut part).await {
                Err(lost) => {
                    batch.extend(parts.flatten());
                    return Err(lost);
                }
                Ok(commit) => commit,
            };
            // The part's own error, or one of its transactions' (a part cut
            // in halves around a held row commits some and may fail others).
            let stopped = commit.err().or_else(|| self.engine.stopped().cloned());
            match stopped {
                Some(e) if let Some(not_run) = e.not_run_after() => {
                    let unknown = matches!(e, Error::OutcomeUnknown);
                    let not_run = Err(not_run);
                    for q in parts.flatten() {
                        let keyed_there = q.key.as_ref().is_some_and(|k| keys.contains(k.as_str()));
                        match unknown && keyed_there {
                            true => answer(q, &Err(Error::OutcomeUnknown)),
                            false => answer(q, &not_run),
                        }
                    }
                    return Ok(());
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Runs one transaction's commands and answers their callers; its
    /// commit, or an error if the database files turned out to be gone
    /// (every caller was answered so).
    async fn run_batch(&mut self, batch: &mut Vec<Queued>) -> Result<Applied, Lost> {
        let size = batch.len();
        let started = std::time::Instant::now();
        let clock = if E::COMMITS_HERE {
            self.stats.begin_commit()
        } else {
            None
        };
        if let Some(committed) = &self.committed {
            committed.begin(batch.iter().filter_map(|q| q.command.counter_changed()));
        }
        let commit = clock::watched(Arc::clone(&self.clock), self.engine.apply(batch)).await;
        if let Some(clock) = clock {
            self.stats.record_commit_cpu(clock);
        }
        // Before anyone hears of the batch: a commit into a deleted file
        // succeeded for SQLite and is lost all the same, unless Litestream
        // shipped it first (or only `-shm` is gone): then whether it is
        // kept is unknown.
        let lost = self.engine.check().err();
        let commit = match (&lost, commit) {
            (Some(lost), commit) => {
                self.stop_taking_writes(lost);
                Err(match commit {
                    Ok(()) if lost.may_be_kept => Error::OutcomeUnknown,
                    _ => Error::StorageLost(Arc::clone(&lost.path)),
                })
            }
            (None, commit) => commit,
        };
        // A transaction of it that failed is logged as the batch's failure,
        // even when others of it committed: that the database answers
        // again is said once a batch commits whole. A command of it that
        // met a full disk while others committed (run one by one, or on
        // their own) is a full disk all the same; one the storage limit
        // refused without running is logged by the limit.
        let met_full = batch.iter().any(|q| {
            !q.command.is_refused()
                && matches!(q.command.outcome(), Some(Err(Error::StorageFull(_))))
        });
        match (&commit, self.engine.stopped().cloned()) {
            (Ok(()), Some(e)) => self.log_commit(&Err(e), size, met_full),
            _ => self.log_commit(&commit, size, met_full),
        }
        let took = started.elapsed();
        self.stats.record_batch(size, took);
        crate::kept!(histogram "tally_commit_batch_size").record(size as f64);
        metrics::gauge!("tally_write_queue_depth").set(self.rx.len() as f64);
        tracing::debug!(batch = size, elapsed = ?took, "batch done");
        #[cfg(feature = "test-hooks")]
        if let Some(delay) = self.publish_delay {
            tokio::time::sleep(delay).await;
        }
        // Before the answers: a read after a 200 sees its write. Whether it
        // committed or not: the batch has ended.
        if let Some(committed) = &self.committed {
            let ok = commit.is_ok();
            let values = batch.iter().filter(|_| ok);
            committed.publish(values.filter_map(|q| q.command.committed_counter()));
        }
        if commit.is_ok() {
            self.prunes_due.note(batch);
        }
        for q in batch.drain(..) {
            answer(q, &commit);
        }
        match lost {
            Some(lost) => Err(lost),
            None => Ok(commit),
        }
    }

    /// Logs a failed commit once per cause: a full disk or an unreachable
    /// database when it starts and when it ends (each on its own, see
    /// [`Lasting`]), any other failure every time (at most once in 10 s).
    /// `met_full`: a command of the batch met a full disk, whatever the
    /// batch's result.
    fn log_commit(&mut self, commit: &Result<(), Error>, size: usize, met_full: bool) {
        let full = met_full || matches!(commit, Err(Error::StorageFull(_)));
        let unreachable = matches!(commit, Err(Error::Unavailable(_)));
        let said =
            self.failing
                .after_batch(full, unreachable, commit.is_ok(), std::time::Instant::now());
        for s in said.into_iter().flatten() {
            match s {
                Said::FullBegan => {
                    let error = match commit {
                        Err(e @ Error::StorageFull(_)) => e.to_string(),
                        _ => "a write of the batch met it; others committed".to_owned(),
                    };
                    tracing::error!(%error, batch = size, "the disk is full: writes that need room fail (507) until space is freed");
                }
                Said::FullEnded {
                    failed_for,
                    quiet_for,
                } => {
                    tracing::warn!(
                        ?failed_for,
                        ?quiet_for,
                        "no write has met a full disk for 5 s: writes commit again"
                    );
                }
                Said::UnreachableBegan { held_back } => {
                    if let Err(e) = commit {
                        tracing::error!(error = %e, batch = size, held_back, "the database is unavailable (it cannot be reached, or takes no writes now): writes fail (503) until it answers again (one outage every 10 s at most; held_back: outages since the last, not logged)");
                    }
                }
                Said::UnreachableEnded { failed_for } => {
                    tracing::warn!(
                        ?failed_for,
                        "the database answers again: writes commit again"
                    );
                }
                Said::OutagesUntold { outages } => {
                    tracing::warn!(
                        outages,
                        "the database was unavailable this many more times since the last \
                         outage logged, each briefly (writes in them failed, 503); it answers \
                         now"
                    );
                }
            }
        }
        match commit {
            Err(Error::StorageLost(_) | Error::StorageFull(_) | Error::Unavailable(_)) | Ok(()) => {
            }
            Err(e @ Error::OutcomeUnknown) => {
                tracing::error!(error = %e, batch = size, "the batch's COMMIT may or may not have happened; every caller in it that ran hears outcome-unknown");
            }
            Err(e) => {
                static FAILED: Throttle = Throttle::new(Duration::from_secs(10));
                if let Some(held_back) = FAILED.admit() {
                    tracing::error!(error = %e, batch = size, held_back, "batch not committed; every caller in it gets an error (one line every 10 s at most; held_back: like lines not written since the last)");
                }
            }
        }
    }
}

/// What [`Lasting::after_batch`] has the writer say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    FullBegan,
    FullEnded {
        failed_for: Duration,
        quiet_for: Duration,
    },
    UnreachableBegan {
        /// Outages since the last one logged, not logged.
        held_back: u64,
    },
    UnreachableEnded {
        failed_for: Duration,
    },
    /// Outages since the last one logged, each over before it could be.
    OutagesUntold {
        outages: u64,
    },
}

impl Lasting {
    /// After a batch at `now`: whether a write of it met a full disk
    /// (`full`), whether it could not reach the database (`unreachable`),
    /// and whether it committed. A full disk ends once a batch commits
    /// with no write having met one for [`FULL_DISK_QUIET`] of batches
    /// that went through (a batch that failed otherwise, the server out of
    /// reach, says nothing of the disk); an unreachable database when a
    /// batch commits.
    fn after_batch(
        &mut self,
        full: bool,
        unreachable: bool,
        committed: bool,
        now: std::time::Instant,
    ) -> [Option<Said>; 2] {
        let mut said = [None, None];
        match &mut self.full {
            None if full => {
                self.full = Some((now, now));
                said[0] = Some(Said::FullBegan);
            }
            None => {}
            // Met again, or no batch went through: no quiet.
            Some((_, last)) if full || !committed => *last = now,
            Some((since, last)) => {
                let quiet_for = now.saturating_duration_since(*last);
                if quiet_for >= FULL_DISK_QUIET {
                    said[0] = Some(Said::FullEnded {
                        failed_for: now.saturating_duration_since(*since),
                        quiet_for,
                    });
                    self.full = None;
                }
            }
        }
        match (self.unreachable, unreachable) {
            (None, true) => {
                self.outages_held += 1;
                let logged = self.log_outage(now);
                self.unreachable = Some((now, logged.is_some()));
                said[1] = logged.map(|held_back| Said::UnreachableBegan { held_back });
            }
            // Its start was held back, and it lasts: said once it may be.
            (Some((since, false)), true) => {
                if let Some(held_back) = self.log_outage(now) {
                    self.unreachable = Some((since, true));
                    said[1] = Some(Said::UnreachableBegan { held_back });
                }
            }
            (Some((since, logged)), false) if committed => {
                self.unreachable = None;
                said[1] = logged.then(|| Said::UnreachableEnded {
                    failed_for: now.saturating_duration_since(since),
                });
            }
            _ => {}
        }
        // Outages held back that no later one logged told of: said once
        // the database answers and a line may be written, so that the log
        // never ends on "answers again" with outages after it untold.
        if said[1].is_none()
            && self.unreachable.is_none()
            && committed
            && self.outages_held > 0
            && let Some(held_back) = self.log_outage(now)
        {
            said[1] = Some(Said::OutagesUntold {
                outages: held_back + 1,
            });
        }
        said
    }

    /// Whether an outage may be logged at `now`, and if so how many
    /// others began since the last one logged without being logged.
    fn log_outage(&mut self, now: std::time::Instant) -> Option<u64> {
        let due = self
            .outage_logged
            .is_none_or(|at| now.saturating_duration_since(at) >= OUTAGE_LOG_EVERY);
        if !due {
            return None;
        }
        self.outage_logged = Some(now);
        // This one is counted in, and is not held back.
        Some(std::mem::take(&mut self.outages_held).saturating_sub(1))
    }
}

impl<E: Engine> WriterLoop<E> {
    /// The test hooks, before a batch: sleep, or panic holding it. A test
    /// that has the writer sleep knows from the log line that it holds a
    /// batch: what is sent next queues behind it.
    #[cfg(feature = "test-hooks")]
    async fn test_hooks(&self, commands: usize) {
        if let Some(delay) = self.delay {
            tracing::info!(commands, "test hook: the writer holds its batch");
            self.stats
                .batches_held
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(delay).await;
        }
        if self.panic_after == Some(self.batches) {
            panic!(
                "test hook: the writer panics holding batch {}",
                self.batches + 1
            );
        }
    }

    /// Reads the clock against the watch (at most once a second, unless
    /// `now`): checks, prunes and the keys' clean-up read it as they go,
    /// increments (keyed or not) do not, and a writer serving increments
    /// alone would not see a step, nor keep it for the process after it.
    async fn read_clock(&mut self, now: bool) {
        if !now
            && self
                .clock_read_at
                .is_some_and(|at| at.elapsed() < FILES_CHECK_INTERVAL)
        {
            return;
        }
        self.clock_read_at = Some(std::time::Instant::now());
        // Unread, it is read at the next chance.
        if let Ok(wall) = self.engine.now().await {
            self.clock.read(wall);
        }
    }

    /// The hold the database keeps, if reading it at the start failed (a
    /// PostgreSQL server lost in that instant, a lock held on its table):
    /// read before the next batch or idle check, once a second at most,
    /// with the clock, and taken over if the clock is still inside it
    /// ([`StepWatch::start_late`]). Until then the batches go by the clock
    /// as it reads, as they did before holds were kept.
    async fn read_hold_late(&mut self) {
        let Some(tried) = self.hold_unread else {
            return;
        };
        // Not while the server cannot be reached: the batch would wait for
        // it twice. The first batch it answers again clears that.
        if tried.elapsed() < FILES_CHECK_INTERVAL || self.engine.stopped().is_some() {
            return;
        }
        let read = match self.engine.clock_hold().await {
            Ok(kept) => self.engine.now().await.map(|now| (kept, now)),
            Err(e) => Err(e),
        };
        match read {
            Ok((kept, now)) => {
                self.hold_unread = None;
                let taken = self.clock.start_late(now, kept);
                tracing::info!(
                    held = taken,
                    "read the clock's hold the database keeps, late (held: taken over)"
                );
            }
            Err(_) => self.hold_unread = Some(std::time::Instant::now()),
        }
    }

    /// Keeps a hold of the clock begun or ended since the last batch in
    /// the database, for a process started during it ([`clock::KeptHold`]);
    /// tried again after the next batch (or idle check) if it fails.
    async fn keep_clock_hold(&mut self) {
        self.read_clock(false).await;
        let Some(hold) = self.clock.to_keep() else {
            return;
        };
        if let Err(e) = self.engine.keep_clock_hold(&hold).await {
            self.clock.keep_again(hold);
            if !std::mem::replace(&mut self.hold_unkept, true) {
                tracing::warn!(
                    error = %e,
                    "could not keep the clock's hold in the database: a process started \
                     during it would not hold; trying again after each batch"
                );
            }
            return;
        }
        if std::mem::take(&mut self.hold_unkept) {
            tracing::info!("the clock's hold is kept in the database");
        }
    }

    /// Forgets expired idempotency keys, a bounded share at a time, in a
    /// statement of its own after a batch: at most once a minute (or once
    /// per key lifetime, when that is shorter), and after every batch while
    /// a backlog lasts (a full share), so that deletion keeps up with any
    /// rate of new keys.
    async fn forget_expired_keys(&mut self) {
        let every = self.key_ttl.min(Duration::from_secs(60));
        let due = self
            .keys_forgotten_at
            .is_none_or(|at| at.elapsed() >= every);
        if !due {
            return;
        }
        self.keys_forgotten_at = Some(std::time::Instant::now());
        let forget = self.engine.forget_expired_keys(self.key_ttl);
        match clock::watched(Arc::clone(&self.clock), forget).await {
            Ok(n) if n >= super::keys::FORGET_SHARE => {
                self.keys_forgotten_at = None;
                tracing::info!(keys = n, "forgot expired idempotency keys; more are due");
            }
            Ok(n) if n > 0 => tracing::info!(keys = n, "forgot expired idempotency keys"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not forget expired idempotency keys"),
        }
    }
}

/// Budgets whose prune a check left part done, for the writer to go on
/// with a share at a time ([`budgets::prune_more`]) after each batch and
/// when idle. Kept in memory only: what a restart forgets is pruned by
/// the next day's first call, and a day the window has left is never read
/// meanwhile.
#[derive(Debug)]
pub(super) struct PrunesDue {
    /// In turn, a share each: the first whose turn it is
    /// ([`Due::not_before`]) is next, and goes to the back after its
    /// share, so that a small purge (a `PUT` waiting to create a budget
    /// again) is not held behind a large one.
    budgets: std::collections::VecDeque<String>,
    /// The same names, to find one at once (thousands of deleted budgets
    /// may be due).
    due: std::collections::HashMap<String, Due>,
    /// After a share failed for a reason every share may fail for (the
    /// database out of reach, the storage full or lost, a database error),
    /// or a budget's first failure came right after another share failed
    /// (a whole table locked, which PostgreSQL tells as it tells a row):
    /// no share before then.
    not_before: Option<std::time::Instant>,
    /// The last share tried failed.
    failed_last: bool,
    /// When a share last failed: for [`Self::AFTER_FAILURE`] after it, only
    /// budgets whose last share did not fail go, so that budgets that keep
    /// failing (each after a lock timeout) are tried one at a time, one
    /// every 10 s at most, and never hold back the others.
    last_failure: Option<std::time::Instant>,
    /// When to look for what deletes left before a restart, until a look
    /// succeeds ([`WriterLoop::look_for_orphans`]).
    orphans_at: Option<std::time::Instant>,
}

/// One budget's place in [`PrunesDue`].
#[derive(Debug, Default)]
struct Due {
    /// Where its last share ended.
    after: Option<budgets::RowKey>,
    /// After its own share failed (a lock held past the lock timeout, a
    /// time zone gone from the database built in): its next share not
    /// before then, while the others' go on.
    not_before: Option<std::time::Instant>,
    /// Its last share failed.
    failing: bool,
}

impl Default for PrunesDue {
    fn default() -> Self {
        Self {
            budgets: Default::default(),
            due: Default::default(),
            not_before: None,
            failed_last: false,
            last_failure: None,
            orphans_at: Some(std::time::Instant::now()),
        }
    }
}

impl PrunesDue {
    /// How long after a failed share the next is tried.
    const AFTER_FAILURE: Duration = Duration::from_secs(10);

    /// How long after a failed look for deleted budgets' usage the next.
    const ORPHANS_AFTER_FAILURE: Duration = Duration::from_secs(60);

    /// The budgets whose check in a committed batch pruned a full share,
    /// and those it deleted or put (whose first share may not have been
    /// all: a shorter retention's). And those whose check the storage limit
    /// refused: the day's first call, which prunes, would be refused too,
    /// and its old days are room to be had.
    fn note(&mut self, batch: &[Queued]) {
        for q in batch {
            // The budget due, and whether a put or a delete of it ran.
            let (due, ran) = match &q.command {
                Command::Check { reply, budget, .. } => {
                    let more = (reply.value())
                        .is_some_and(|d| d.pruned_rows >= budgets::PRUNE_SHARE)
                        || matches!(reply.error(), Some(Error::StorageFull(_)));
                    (more.then_some(budget), false)
                }
                // Not a replay under its key: it deleted nothing now.
                Command::DeleteBudget { reply, name } => {
                    let ran = reply.value().is_some() && !reply.is_replayed();
                    (ran.then_some(name), ran)
                }
                // Refused for a deleted namesake's usage: that usage, which
                // a process that stopped may have left.
                Command::PutBudget { reply, name, .. } => {
                    let ran = reply.value().is_some();
                    let purging = matches!(reply.error(), Some(Error::Purging(_)));
                    ((ran || purging).then_some(name), ran)
                }
                _ => (None, false),
            };
            if let Some(budget) = due {
                self.add(budget.as_str());
                // A put or a delete may have brought rows before where
                // the last share ended (days a longer window shows, a
                // budget created again): the next share starts from the
                // first row.
                if ran && let Some(due) = self.due.get_mut(budget.as_str()) {
                    due.after = None;
                }
            }
        }
    }

    fn add(&mut self, budget: &str) {
        if !self.due.contains_key(budget) {
            self.due.insert(budget.to_owned(), Due::default());
            self.budgets.push_back(budget.to_owned());
            self.show();
        }
    }

    fn remove(&mut self, budget: &str) {
        if self.due.remove(budget).is_some() {
            match self.budgets.front().is_some_and(|b| b == budget) {
                true => drop(self.budgets.pop_front()),
                false => self.budgets.retain(|b| b != budget),
            }
        }
        self.show();
    }

    /// `tally_budget_prunes_due`.
    fn show(&self) {
        metrics::gauge!("tally_budget_prunes_due").set(self.budgets.len() as f64);
    }

    /// The budget whose share is next, if one is due now.
    fn next(&self) -> Option<&str> {
        let now = std::time::Instant::now();
        let waits = |t: &Option<std::time::Instant>| t.is_some_and(|t| now < t);
        if waits(&self.not_before) {
            return None;
        }
        let failed_lately = waits(&self.last_failure.map(|t| t + Self::AFTER_FAILURE));
        self.budgets
            .iter()
            .find(|b| {
                !self
                    .due
                    .get(*b)
                    .is_some_and(|d| waits(&d.not_before) || (failed_lately && d.failing))
            })
            .map(String::as_str)
    }

    /// After `budget`'s share failed with `e`: it goes to the back of the
    /// line and waits [`Self::AFTER_FAILURE`], and so does every budget
    /// whose last share failed ([`Self::last_failure`]). Every budget waits
    /// when the error is not one of the budget's own rows (a row held, a
    /// lost race, a stored budget tally cannot read), or when a budget
    /// that had not failed fails right after another share did: one held
    /// table fails every share, each after the lock timeout, and trying
    /// them all in turn would hold the writer for good.
    fn failed(&mut self, budget: &str, e: &Error) {
        let now = std::time::Instant::now();
        let then = now + Self::AFTER_FAILURE;
        let mut first = true;
        if let Some(due) = self.due.get_mut(budget) {
            first = !due.failing;
            due.not_before = Some(then);
            due.failing = true;
        }
        self.send_back(budget);
        let own = matches!(e, Error::Busy(..) | Error::Raced(_) | Error::Internal(_));
        if !own || (first && self.failed_last) {
            self.not_before = Some(then);
        }
        self.failed_last = true;
        self.last_failure = Some(now);
    }

    /// After `budget`'s share committed: to the back of the line if `more`
    /// may be left, out of it if not.
    fn succeeded(&mut self, budget: &str, more: bool) {
        self.not_before = None;
        self.failed_last = false;
        if let Some(due) = self.due.get_mut(budget) {
            due.not_before = None;
            due.failing = false;
        }
        match more {
            true => self.send_back(budget),
            false => self.remove(budget),
        }
    }

    fn send_back(&mut self, budget: &str) {
        if self.budgets.back().is_some_and(|b| b == budget) {
            return;
        }
        if let Some(at) = self.budgets.iter().position(|b| b == budget)
            && let Some(b) = self.budgets.remove(at)
        {
            self.budgets.push_back(b);
        }
    }
}

impl<E: Engine> WriterLoop<E> {
    /// Looks once (as the writer starts, at its first idle check, or after
    /// its first batch) for the usage of deleted budgets that a purge cut
    /// short by a restart left stored, and goes on with it as with its own
    /// (again a minute after a failed look).
    async fn look_for_orphans(&mut self) {
        if self
            .prunes_due
            .orphans_at
            .is_none_or(|at| std::time::Instant::now() < at)
        {
            return;
        }
        match self.engine.orphaned_usage().await {
            Ok(budgets) => {
                self.prunes_due.orphans_at = None;
                if !budgets.is_empty() {
                    tracing::info!(
                        budgets = budgets.len(),
                        "usage of deleted budgets found: purging it a share at a time"
                    );
                }
                budgets.iter().for_each(|b| self.prunes_due.add(b));
            }
            Err(e) => {
                self.prunes_due.orphans_at =
                    Some(std::time::Instant::now() + PrunesDue::ORPHANS_AFTER_FAILURE);
                tracing::warn!(
                    error = %e,
                    "could not look for usage of deleted budgets; trying again in a minute"
                );
            }
        }
    }

    /// Shares ([`Self::prune_more`]): one, then more while nothing is
    /// queued, for half of [`FILES_CHECK_INTERVAL`] at most. A write that
    /// comes meanwhile waits for one share at most. Not past a share that
    /// could not reach the server: the others would fail at once, each
    /// with a warning of its own.
    async fn prune_while_quiet(&mut self) {
        let until = std::time::Instant::now() + FILES_CHECK_INTERVAL / 2;
        while self.prune_more().await
            && self.rx.is_empty()
            && self.engine.stopped().is_none()
            && std::time::Instant::now() < until
        {}
    }

    /// Prunes one share of the first budget a prune left part done (see
    /// [`PrunesDue`]), in a transaction of its own; the budget stays due
    /// while its shares come back full. Whether another share is due now.
    async fn prune_more(&mut self) -> bool {
        let Some(budget) = self.prunes_due.next().map(str::to_owned) else {
            return false;
        };
        let mut after = (self.prunes_due.due.get(&budget)).and_then(|d| d.after.clone());
        let prune = self.engine.prune_more(&budget, &mut after);
        let pruned = clock::watched(Arc::clone(&self.clock), prune).await;
        if let Some(due) = self.prunes_due.due.get_mut(&budget) {
            due.after = after;
        }
        match pruned {
            Ok((rows, more)) => {
                // Said before it shows in the metrics.
                if !more && rows > 0 {
                    // A put or a delete that left nothing to do says nothing.
                    tracing::info!(
                        budget,
                        rows,
                        "deleted the last of a budget's usage past its retention, or of a deleted budget's"
                    );
                }
                if rows > 0 {
                    metrics::counter!("tally_budget_pruned_rows_total").increment(rows);
                }
                self.prunes_due.succeeded(&budget, more);
                !self.prunes_due.budgets.is_empty()
            }
            Err(e) => {
                // The others' turn first: this one may fail for good (a
                // time zone gone from the database built in).
                self.prunes_due.failed(&budget, &e);
                tracing::warn!(budget, error = %e, "could not prune a budget's usage past its retention; trying again in 10 s");
                self.prunes_due.next().is_some()
            }
        }
    }
}

/// Answers one caller: with its command's result if the batch committed,
/// or with the commit's error if it did not. A caller that has gone away
/// is counted and logged ([`caller_gone`]), so the write can be accounted
/// for. How long the command waited, and a check's decision, are recorded
/// here, whether or not its caller still listens: the slowest writes are
/// the ones callers give up on.
fn answer(mut q: Queued, commit: &Result<(), Error>) {
    let kind = q.command.kind();
    crate::prometheus::write_commands(kind, result_label(&q.command, commit)).increment(1);
    crate::kept!(histogram "tally_write_wait_seconds").record(q.queued_at.elapsed().as_secs_f64());
    if commit.is_ok() {
        // Usage rows a command's own transaction deleted, now committed
        // (the writer's later shares count their own).
        let pruned_rows = match &q.command {
            Command::Check { reply, budget, .. } => {
                if let Some(Error::Refused(Refusal::UnknownBudget(_))) = reply.error() {
                    // Deleted, here or by another process.
                    crate::prometheus::budget_gone(budget.as_str());
                }
                reply.value().map_or(0, |d| {
                    // Budget names are the operator's: a bounded set. A
                    // replay (a stored answer) is counted again, but never
                    // brings back the series of a budget deleted since.
                    crate::prometheus::budget_decided(
                        budget.as_str(),
                        d.reason,
                        !reply.is_replayed(),
                    );
                    if d.pruned_rows > 0 {
                        metrics::counter!("tally_budget_prunes_total").increment(1);
                    }
                    d.pruned_rows
                })
            }
            Command::PutBudget { reply, .. } => reply.value().map_or(0, |s| s.pruned_rows),
            Command::DeleteBudget { reply, name } => reply.value().map_or(0, |d| {
                // A replay deleted nothing now: the budget may be a new one.
                if !reply.is_replayed() {
                    crate::prometheus::budget_gone(name.as_str());
                }
                d.usage_rows
            }),
            _ => 0,
        };
        if pruned_rows > 0 {
            metrics::counter!("tally_budget_pruned_rows_total").increment(pruned_rows);
        }
    }
    let Sent::Unheard { committed, what } = q.command.send(commit) else {
        return;
    };
    caller_gone(
        kind,
        Some(&q.command),
        q.request_id.as_deref(),
        committed,
        &what,
    );
}

/// A command whose caller was gone when its answer came: counted, and
/// logged with what it was applied to (`target`, when known: never a
/// visitor's id), the request it came from and its result, so that "did my
/// write land?" has an answer. A client that gives up on every write it
/// sends would get a line per write: at most one line a second is written
/// (of each kind, landed or not), with `held_back`, how many were not since
/// the last; the counter counts every one.
pub(crate) fn caller_gone(
    kind: &'static str,
    target: Option<&dyn std::fmt::Display>,
    request_id: Option<&str>,
    committed: bool,
    what: &str,
) {
    static LANDED: Throttle = Throttle::new(Duration::from_secs(1));
    static NOT_LANDED: Throttle = Throttle::new(Duration::from_secs(1));
    let target = target.map(tracing::field::display);
    if committed {
        metrics::counter!("tally_write_committed_caller_gone_total", "command" => kind)
            .increment(1);
        if let Some(held_back) = LANDED.admit() {
            tracing::warn!(
                command = kind,
                target,
                request_id,
                result = what,
                held_back,
                "write committed but its caller had gone; it did land"
            );
        }
    } else if let Some(held_back) = NOT_LANDED.admit() {
        tracing::info!(
            command = kind,
            target,
            request_id,
            error = what,
            held_back,
            "write failed and its caller had gone; it did not land"
        );
    }
}

/// The `result` label of `tally_write_commands_total` for a command its
/// batch answered: its own refusal if it was answered without running
/// ([`Command::is_refused`]), whatever the batch's; else why the batch
/// failed, or its own result.
fn result_label(command: &Command, commit: &Result<(), Error>) -> &'static str {
    match (commit, command.outcome()) {
        // Answered without running: its own refusal, whatever the batch's.
        (_, Some(Err(e))) if command.is_refused() => e.kind(),
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
        (Ok(()), Some(Ok(()))) => "ok",
        (Ok(()), Some(Err(e))) => e.kind(),
        // No result: answered as tally's own error (see `Reply::send`).
        (Ok(()), None) => "database_error",
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{db::command::Reply, meter::Name};

    /// A full disk fails only the writes that need room: batches that
    /// commit in between (an update in its page) do not end it, an
    /// outage of the server while it lasts is said on its own, and it
    /// ends once writes have met no full disk for [`FULL_DISK_QUIET`].
    /// Before, one state for both said "space was freed" at the first
    /// batch that committed, and nothing of an outage meanwhile.
    #[test]
    fn a_full_disk_and_an_outage_are_each_said_once_when_they_begin_and_end() {
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut l = Lasting::default();
        let mut said = |full, unreachable, committed, ms| {
            l.after_batch(full, unreachable, committed, at(ms))
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
        };
        // Refused for room, then a batch of updates commits, then refused.
        assert_eq!(said(true, false, false, 0), [Said::FullBegan]);
        assert_eq!(said(false, false, true, 100), []);
        assert_eq!(said(true, false, true, 200), []);
        // The server goes, and comes back, while the disk is full.
        assert_eq!(
            said(false, true, false, 1_000),
            [Said::UnreachableBegan { held_back: 0 }]
        );
        assert_eq!(said(false, true, false, 2_000), []);
        assert_eq!(
            said(false, false, true, 3_000),
            [Said::UnreachableEnded {
                failed_for: Duration::from_secs(2)
            }]
        );
        // Still meeting it now and then; then five quiet seconds.
        assert_eq!(said(true, false, true, 4_000), []);
        assert_eq!(said(false, false, true, 8_999), []);
        assert_eq!(
            said(false, false, true, 9_000),
            [Said::FullEnded {
                failed_for: Duration::from_secs(9),
                quiet_for: Duration::from_secs(5)
            }]
        );
        assert_eq!(said(false, false, true, 9_100), []);
        // Full again; then the server out of reach for 10 s: no write met
        // the disk, but none went through either. Back, it is still full
        // until five seconds of batches have gone through.
        assert_eq!(said(true, false, false, 10_000), [Said::FullBegan]);
        assert_eq!(
            said(false, true, false, 11_000),
            [Said::UnreachableBegan { held_back: 0 }]
        );
        assert_eq!(said(false, true, false, 21_000), []);
        assert_eq!(
            said(false, false, true, 21_100),
            [Said::UnreachableEnded {
                failed_for: Duration::from_millis(10_100)
            }]
        );
        // A batch that failed for its own reason is no quiet either.
        assert_eq!(said(false, false, false, 24_000), []);
        assert_eq!(said(false, false, true, 28_999), []);
        assert_eq!(
            said(false, false, true, 29_000),
            [Said::FullEnded {
                failed_for: Duration::from_secs(19),
                quiet_for: Duration::from_secs(5)
            }]
        );
    }

    /// Outages are logged one every [`OUTAGE_LOG_EVERY`] at most, with
    /// how many were not: an operator's loop cancelling the writer's
    /// statement every 50 ms was a pair of lines each time. One whose
    /// start was held back and that lasts is logged late, and its end with
    /// it; one never logged ends in silence.
    #[test]
    fn outages_are_logged_one_every_ten_seconds_at_most() {
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut l = Lasting::default();
        let mut said = |unreachable, committed, ms| {
            l.after_batch(false, unreachable, committed, at(ms))
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            said(true, false, 0),
            [Said::UnreachableBegan { held_back: 0 }]
        );
        assert_eq!(
            said(false, true, 50),
            [Said::UnreachableEnded {
                failed_for: Duration::from_millis(50)
            }]
        );
        // A cancel every 100 ms for 9.9 s: nothing said.
        for i in 1..100 {
            assert_eq!(said(true, false, i * 100), [], "{i}");
            assert_eq!(said(false, true, i * 100 + 50), [], "{i}");
        }
        // The next, 10 s after the first: said, with the 99 before it.
        assert_eq!(
            said(true, false, 10_000),
            [Said::UnreachableBegan { held_back: 99 }]
        );
        assert_eq!(
            said(false, true, 10_050),
            [Said::UnreachableEnded {
                failed_for: Duration::from_millis(50)
            }]
        );
        // One held back that lasts: said once it may be, and its end.
        assert_eq!(said(true, false, 11_000), []);
        assert_eq!(said(true, false, 15_000), []);
        assert_eq!(
            said(true, false, 20_000),
            [Said::UnreachableBegan { held_back: 0 }]
        );
        assert_eq!(
            said(false, true, 21_000),
            [Said::UnreachableEnded {
                failed_for: Duration::from_secs(10)
            }]
        );
        // Short ones after the last logged, and then none: told once a
        // line may be written, not left untold behind "answers again".
        assert_eq!(said(true, false, 22_000), []);
        assert_eq!(said(false, true, 22_050), []);
        assert_eq!(said(true, false, 23_000), []);
        assert_eq!(said(false, true, 23_050), []);
        assert_eq!(said(false, true, 29_999), []);
        assert_eq!(
            said(false, true, 30_000),
            [Said::OutagesUntold { outages: 2 }]
        );
        assert_eq!(said(false, true, 40_000), []);
    }

    /// The metric counts a command answered without running by its own
    /// refusal, as its caller hears it, whatever its batch did; a command
    /// that ran, by the batch's failure or its own result.
    #[test]
    fn a_refused_command_is_counted_by_its_own_refusal() {
        let busy = || Error::Busy(Arc::new(sqlx::Error::PoolTimedOut), crate::db::HeldRow::Own);
        let down = || Error::Unavailable(Arc::new(sqlx::Error::PoolClosed));
        let increment = |set: &dyn Fn(&mut Reply<i64>)| {
            let (mut reply, _rx) = Reply::new();
            set(&mut reply);
            Command::Increment {
                name: Name::parse("n").unwrap(),
                by: 1,
                reply,
            }
        };
        let refused = increment(&|r| r.refuse(busy()));
        let ran = increment(&|r| r.set(Ok(1)));
        let failed = increment(&|r| r.set(Err(busy())));
        for (command, commit, label) in [
            (&refused, Err(down()), "busy"),
            (&refused, Err(Error::OutcomeUnknown), "busy"),
            (&refused, Ok(()), "busy"),
            (&ran, Err(down()), "unavailable"),
            (&ran, Err(Error::OutcomeUnknown), "outcome_unknown"),
            (&ran, Err(Error::Internal("x".into())), NOT_COMMITTED),
            (&ran, Ok(()), "ok"),
            (&failed, Err(down()), "unavailable"),
            (&failed, Ok(()), "busy"),
        ] {
            assert_eq!(result_label(command, &commit), label, "{commit:?}");
        }
    }

    /// Budgets take a share each in turn. A share that failed for its own
    /// budget (a row held) puts that budget at the back, and for 10 s only
    /// budgets whose last share did not fail go: the others go on, and
    /// those that keep failing are tried one at a time. A failure any
    /// share may meet (the database out of reach, a database error), or a
    /// budget's first failure right after another (a whole table held),
    /// pauses them all. A share that commits ends its budget's wait.
    #[test]
    fn a_failed_share_waits_alone_unless_every_share_may_fail() {
        let held = || Error::Busy(Arc::new(sqlx::Error::PoolTimedOut), crate::db::HeldRow::Own);
        let down = || Error::Unavailable(Arc::new(sqlx::Error::PoolTimedOut));
        let broken = || Error::Database(Arc::new(sqlx::Error::PoolTimedOut));
        // 10 s later.
        let later = |due: &mut PrunesDue| {
            due.not_before = None;
            due.last_failure = None;
            for d in due.due.values_mut() {
                d.not_before = None;
            }
        };
        let mut due = PrunesDue::default();
        for b in ["a", "b", "c"] {
            due.add(b);
        }
        // A share each, in turn.
        assert_eq!(due.next(), Some("a"));
        due.succeeded("a", true);
        assert_eq!(due.next(), Some("b"));
        due.succeeded("b", true);
        assert_eq!(due.budgets, ["c", "a", "b"]);
        // One held: the others go on, and it waits out 10 s after the
        // last failure, whatever its own wait.
        due.failed("c", &held());
        assert_eq!(due.next(), Some("a"));
        due.succeeded("a", true);
        due.due.get_mut("c").unwrap().not_before = None;
        assert_eq!(due.next(), Some("b"));
        due.succeeded("b", true);
        assert_eq!(due.budgets, ["c", "a", "b"]);
        assert_eq!(due.next(), Some("a"));
        // 10 s on: tried again, first in line; failing again right after
        // pauses no one (it is known to fail), and the others go on.
        later(&mut due);
        assert_eq!(due.next(), Some("c"));
        due.failed("c", &held());
        assert_eq!(due.next(), Some("a"));
        // A budget's first failure right after another failure: all wait.
        due.failed("a", &held());
        assert_eq!(due.next(), None);
        later(&mut due);
        due.succeeded("b", true);
        due.succeeded("a", true);
        due.succeeded("c", true);
        // A failure any share may meet: all wait at once.
        for e in [down(), broken()] {
            due.failed("b", &e);
            assert_eq!(due.next(), None, "{e}");
            later(&mut due);
            due.succeeded("b", true);
        }
        for b in ["a", "b", "c"] {
            due.succeeded(b, false);
        }
        assert_eq!(due.next(), None);
        assert!(due.due.is_empty());
    }
}
