//! The writer task: the only code in the process that holds a writable
//! connection. It takes every command already waiting in the queue (up to
//! the batch cap), runs each inside its own savepoint of one transaction,
//! commits once, and only then answers every caller.
//!
//! Before answering, it makes sure the commit went into the file at the
//! database's path (see [`super::files`]). If the file was deleted or
//! replaced, no caller hears a success: the batch and everything queued
//! behind it is answered `storage_lost`, the queue closes, and the writer
//! ends with an error so that tally exits non-zero and is restarted.

use std::{path::PathBuf, sync::Arc, time::Duration};

use sqlx::{Connection, SqliteConnection};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use std::sync::atomic::Ordering;

use super::{
    command::{Envelope, Keyed, Op, Reply, Target},
    files::{DbFiles, Lost},
    stats::QueueStats,
};
use crate::meter::{self, MeterError, idempotency};

/// Owns the writable connection and the receiving end of the queue.
/// Created by [`super::Database::open`]; run it with [`Writer::run`].
pub struct Writer {
    pub(super) conn: SqliteConnection,
    pub(super) rx: mpsc::Receiver<Envelope>,
    pub(super) max_batch: usize,
    pub(super) close: CancellationToken,
    pub(super) stats: Arc<QueueStats>,
    /// Checkpoint and truncate the WAL when the queue is drained. Off when
    /// another process (Litestream) owns checkpointing.
    pub(super) checkpoint_on_close: bool,
    /// Test hook: sleep before each batch to make the queue fill up.
    pub(super) delay: Option<Duration>,
    /// When expired idempotency keys were last deleted.
    pub(super) keys_forgotten_at: Option<std::time::Instant>,
    /// Test hook: panic on taking batch number N+1.
    pub(super) panic_after: Option<u64>,
    /// Batches taken so far.
    pub(super) batches: u64,
    /// The database's files as opened, to notice them being deleted.
    pub(super) files: DbFiles,
    /// Since when commits fail for a full disk, to log the start and the end
    /// of it rather than every failed batch.
    pub(super) disk_full_since: Option<std::time::Instant>,
}

/// How often an idle writer checks that its files are still in place. After
/// a batch it always checks.
const FILES_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// A command that ran, waiting for its transaction's fate before its caller
/// hears of it.
enum Finished {
    Counter(Done<i64>),
    Budget(Done<meter::Budget>),
    Check(Done<meter::Decision>),
    Reset(Done<u64>),
}

struct Done<T> {
    reply: Reply<T>,
    /// The request that queued the command, when it came over HTTP.
    request_id: Option<Arc<str>>,
    result: Result<T, MeterError>,
    target: Target,
    kind: &'static str,
}

impl<T> Done<T> {
    fn new(
        reply: Reply<T>,
        kind: &'static str,
        result: Result<T, MeterError>,
        target: Target,
    ) -> Self {
        Done {
            reply,
            request_id: None,
            result,
            target,
            kind,
        }
    }
}

impl<T: std::fmt::Debug> Done<T> {
    /// Answers the caller with the command's result if the batch committed,
    /// or with the commit's error if it did not. A caller that has gone away
    /// after its write committed is logged, so the write can be accounted for.
    fn deliver(self, commit: &Result<(), MeterError>) {
        let committed = commit.is_ok() && self.result.is_ok();
        let result = match (commit, &self.result) {
            // Why the batch failed, when the reason is the storage's.
            (Err(e @ (MeterError::StorageFull(_) | MeterError::StorageLost { .. })), _) => e.kind(),
            (Err(_), _) => "not_committed",
            (Ok(()), Ok(_)) => "ok",
            (Ok(()), Err(e)) => e.kind(),
        };
        metrics::counter!("tally_write_commands_total", "command" => self.kind, "result" => result)
            .increment(1);
        let answer = match commit {
            Ok(()) => self.result,
            Err(e) => Err(e.clone_shallow()),
        };
        if let Err(unheard) = self.reply.send(answer) {
            if committed {
                metrics::counter!("tally_write_committed_caller_gone_total", "command" => self.kind)
                    .increment(1);
                tracing::warn!(
                    command = self.kind,
                    target = %self.target,
                    request_id = self.request_id.as_deref(),
                    result = ?unheard.as_ref().ok(),
                    "write committed but its caller had gone; it did land"
                );
            } else {
                tracing::info!(
                    command = self.kind,
                    target = %self.target,
                    request_id = self.request_id.as_deref(),
                    error = ?unheard.err(),
                    "write failed and its caller had gone; it did not land"
                );
            }
        }
    }
}

impl Finished {
    /// The committed-to-be result, as stored for an idempotency key.
    fn stored_result(&self) -> Option<String> {
        match self {
            Finished::Counter(Done { result: Ok(v), .. }) => Some(v.to_string()),
            Finished::Check(Done { result: Ok(d), .. }) => Some(idempotency::encode_decision(d)),
            _ => None,
        }
    }

    /// The same command, answered with `e` instead.
    fn failed(self, e: MeterError) -> Self {
        match self {
            Finished::Counter(d) => Finished::Counter(Done {
                result: Err(e),
                ..d
            }),
            Finished::Budget(d) => Finished::Budget(Done {
                result: Err(e),
                ..d
            }),
            Finished::Check(d) => Finished::Check(Done {
                result: Err(e),
                ..d
            }),
            Finished::Reset(d) => Finished::Reset(Done {
                result: Err(e),
                ..d
            }),
        }
    }

    /// Names the request that queued the command.
    fn queued_by(mut self, id: Option<Arc<str>>) -> Self {
        match &mut self {
            Finished::Counter(d) => d.request_id = id,
            Finished::Budget(d) => d.request_id = id,
            Finished::Check(d) => d.request_id = id,
            Finished::Reset(d) => d.request_id = id,
        }
        self
    }

    fn deliver(self, commit: &Result<(), MeterError>) {
        match self {
            Finished::Counter(d) => d.deliver(commit),
            Finished::Budget(d) => d.deliver(commit),
            Finished::Check(d) => {
                if let (Ok(()), Ok(decision)) = (commit, &d.result)
                    && decision.pruned_rows > 0
                {
                    metrics::counter!("tally_budget_prunes_total").increment(1);
                    metrics::counter!("tally_budget_pruned_rows_total")
                        .increment(decision.pruned_rows);
                }
                d.deliver(commit)
            }
            Finished::Reset(d) => d.deliver(commit),
        }
    }

    fn is_ok(&self) -> bool {
        match self {
            Finished::Counter(d) => d.result.is_ok(),
            Finished::Budget(d) => d.result.is_ok(),
            Finished::Check(d) => d.result.is_ok(),
            Finished::Reset(d) => d.result.is_ok(),
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
            None => Self::outcome(self.done.await),
        }
    }

    /// Resolves if the writer dies. A writer that ended cleanly (its queue
    /// was closed and drained) has not died: then this never resolves, and
    /// [`Self::join`] reports the clean end.
    pub async fn died(&mut self) -> WriterFailed {
        if self.ended.is_none() {
            let r = Self::outcome((&mut self.done).await);
            if let Err(e) = r {
                return e;
            }
            self.ended = Some(Ok(()));
        }
        std::future::pending().await
    }

    fn outcome(
        r: Result<Result<(), WriterFailed>, tokio::sync::oneshot::error::RecvError>,
    ) -> Result<(), WriterFailed> {
        r.unwrap_or(Err(WriterFailed::Died))
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
                    if let Err(lost) = self.files.check() {
                        return Err(self.lose(lost, &mut batch).await);
                    }
                    continue;
                }
            }
            if let Some(delay) = self.delay {
                tokio::time::sleep(delay).await;
            }
            if self.panic_after == Some(self.batches) {
                panic!(
                    "test hook: the writer panics holding batch {}",
                    self.batches + 1
                );
            }
            self.batches += 1;
            if let Err(lost) = self.run_batch(&mut batch).await {
                return Err(self.lose(lost, &mut batch).await);
            }
        }
        tracing::info!("write queue drained");
        if let Err(lost) = self.files.check() {
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
    async fn shutdown(mut self) {
        if self.checkpoint_on_close {
            match sqlx::query_as::<_, (i64, i64, i64)>("PRAGMA wal_checkpoint(TRUNCATE)")
                .fetch_one(&mut self.conn)
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
        if let Err(e) = self.conn.close().await {
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
    async fn lose(mut self, lost: Lost, batch: &mut Vec<Envelope>) -> WriterFailed {
        self.stop_taking_writes(&lost);
        let err = MeterError::StorageLost {
            path: Arc::clone(&lost.path),
        };
        let mut refused = batch.len();
        for e in batch.drain(..) {
            fail(e.op, &err).queued_by(e.request_id).deliver(&Ok(()));
        }
        // The queue is closed: this ends once it is empty.
        while self.rx.recv_many(batch, self.max_batch).await > 0 {
            refused += batch.len();
            for e in batch.drain(..) {
                fail(e.op, &err).queued_by(e.request_id).deliver(&Ok(()));
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
    async fn run_batch(&mut self, batch: &mut Vec<Envelope>) -> Result<(), Lost> {
        let size = batch.len();
        let started = std::time::Instant::now();
        // Keyed commands look up and store their key one by one.
        let set_based = batch
            .iter()
            .all(|e| e.key.is_none() && matches!(e.op, Op::Increment { .. } | Op::Check { .. }));
        let keyed = batch.iter().any(|e| e.key.is_some());
        let (finished, outcome) = match set_based {
            true => match self.run_set_based(batch).await {
                Some(done) => done,
                None => self.run_one_by_one(batch).await,
            },
            false => self.run_one_by_one(batch).await,
        };
        // Before anyone hears of the batch: a commit into a deleted file
        // succeeded for SQLite and is lost all the same.
        let lost = self.files.check().err();
        let outcome = match &lost {
            Some(lost) => {
                self.stop_taking_writes(lost);
                Err(MeterError::StorageLost {
                    path: Arc::clone(&lost.path),
                })
            }
            None => outcome,
        };
        match &outcome {
            Err(MeterError::StorageLost { .. }) => {}
            Err(e @ MeterError::StorageFull(_)) => {
                if self.disk_full_since.is_none() {
                    self.disk_full_since = Some(std::time::Instant::now());
                    tracing::error!(error = %e, batch = size, "the disk is full: writes fail (507) until space is freed");
                } else {
                    tracing::debug!(batch = size, "batch not committed: the disk is still full");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, batch = size, "batch not committed; every caller in it gets an error")
            }
            Ok(()) => {
                if let Some(since) = self.disk_full_since.take() {
                    tracing::warn!(full_for = ?since.elapsed(), "space was freed: writes commit again");
                }
            }
        }
        if keyed && lost.is_none() {
            self.forget_expired_keys().await;
        }
        let took = started.elapsed();
        self.stats.record_batch(size, took);
        metrics::histogram!("tally_commit_batch_size").record(size as f64);
        metrics::gauge!("tally_write_queue_depth").set(self.rx.len() as f64);
        let ok = finished.iter().filter(|f| f.is_ok()).count();
        tracing::debug!(batch = size, ok, elapsed = ?took, "batch done");
        for f in finished {
            f.deliver(&outcome);
        }
        match lost {
            Some(lost) => Err(lost),
            None => Ok(()),
        }
    }

    /// The fast path: all increments of the batch in one statement, all
    /// checks in a handful (see [`meter::increment_many`] and
    /// [`meter::check_many`]). Increments and checks touch disjoint tables,
    /// so running each kind as a group keeps every caller's answer what it
    /// would be in queue order. `None` (with the transaction rolled back and
    /// `batch` untouched) when the batch must be replayed one by one: a
    /// statement failed, or the set-based result could differ.
    async fn run_set_based(
        &mut self,
        batch: &mut Vec<Envelope>,
    ) -> Option<(Vec<Finished>, Result<(), MeterError>)> {
        if batch.iter().all(|e| matches!(e.op, Op::Increment { .. })) {
            return self.run_increments(batch).await;
        }
        exec(&mut self.conn, "BEGIN IMMEDIATE").await.ok()?;
        let mut increments = Vec::new();
        let mut checks = Vec::new();
        for e in batch.iter() {
            match &e.op {
                Op::Increment { name, by, .. } => increments.push((name, *by)),
                Op::Check {
                    budget,
                    visitor,
                    day,
                    ..
                } => checks.push(meter::CheckItem {
                    budget,
                    visitor,
                    day: *day,
                }),
                _ => {}
            }
        }
        let counted = match increments.is_empty() {
            true => Ok(Some(Vec::new())),
            false => meter::increment_many(&mut self.conn, &increments).await,
        };
        let checked = match (&counted, checks.is_empty()) {
            (Ok(Some(_)), false) => meter::check_many(&mut self.conn, &checks).await,
            _ => Ok(Some(Vec::new())),
        };
        let (Ok(Some(values)), Ok(Some(decisions))) = (counted, checked) else {
            let _ = exec(&mut self.conn, "ROLLBACK").await;
            return None;
        };
        let outcome = commit(&mut self.conn).await;
        Some((answer_in_order(batch, values, decisions), outcome))
    }

    /// The hottest batch, increments only: the whole transaction in one
    /// round trip ([`meter::increment_many_committed`]).
    async fn run_increments(
        &mut self,
        batch: &mut Vec<Envelope>,
    ) -> Option<(Vec<Finished>, Result<(), MeterError>)> {
        let items: Vec<(&meter::Name, i64)> = batch
            .iter()
            .filter_map(|e| match &e.op {
                Op::Increment { name, by, .. } => Some((name, *by)),
                _ => None,
            })
            .collect();
        let started = std::time::Instant::now();
        let (values, outcome) = match meter::increment_many_committed(&mut self.conn, &items).await
        {
            Ok(Some(values)) => (values, Ok(())),
            // A counter would overflow; nothing was written.
            Ok(None) => return None,
            Err(e) => {
                let _ = exec(&mut self.conn, "ROLLBACK").await;
                (Vec::new(), Err(e))
            }
        };
        metrics::histogram!("tally_commit_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        Some((answer_in_order(batch, values, Vec::new()), outcome))
    }

    /// The general path: one transaction, each command in its own savepoint.
    async fn run_one_by_one(
        &mut self,
        batch: &mut Vec<Envelope>,
    ) -> (Vec<Finished>, Result<(), MeterError>) {
        let mut finished = Vec::with_capacity(batch.len());
        let outcome = match exec(&mut self.conn, "BEGIN IMMEDIATE").await {
            Err(e) => Err(e),
            Ok(()) => {
                let mut broken = None;
                for envelope in batch.drain(..) {
                    if broken.is_some() {
                        // The transaction is gone; nothing more may run in it.
                        let done = apply(&mut self.conn, envelope.op, broken.as_ref()).await;
                        finished.push(done.queued_by(envelope.request_id));
                        continue;
                    }
                    let id = envelope.request_id;
                    match self
                        .apply_in_savepoint(envelope.op, envelope.key.as_ref())
                        .await
                    {
                        (done, None) => finished.push(done.queued_by(id)),
                        (done, Some(e)) => {
                            finished.push(done.queued_by(id));
                            broken = Some(e);
                        }
                    }
                }
                match broken {
                    Some(e) => {
                        let _ = exec(&mut self.conn, "ROLLBACK").await;
                        Err(e)
                    }
                    None => commit(&mut self.conn).await,
                }
            }
        };
        if let Err(e) = &outcome {
            // If BEGIN itself failed, the commands are still in `batch`.
            for envelope in batch.drain(..) {
                let done = apply(&mut self.conn, envelope.op, Some(e)).await;
                finished.push(done.queued_by(envelope.request_id));
            }
        }
        (finished, outcome)
    }

    /// Runs one command inside a savepoint. A command that fails is rolled
    /// back to its savepoint and answers its own error; the others in the
    /// batch are untouched. If the savepoint itself cannot be rolled back
    /// (SQLite already rolled the whole transaction back, as it does on some
    /// I/O errors), the second value says the batch is broken.
    async fn apply_in_savepoint(
        &mut self,
        op: Op,
        key: Option<&Keyed>,
    ) -> (Finished, Option<MeterError>) {
        if let Err(e) = exec(&mut self.conn, "SAVEPOINT cmd").await {
            let done = apply(&mut self.conn, op, Some(&e)).await;
            return (done, Some(e));
        }
        let done = match key {
            None => apply(&mut self.conn, op, None).await,
            Some(key) => apply_once(&mut self.conn, op, key).await,
        };
        let end = if done.is_ok() {
            exec(&mut self.conn, "RELEASE cmd").await
        } else {
            match exec(&mut self.conn, "ROLLBACK TO cmd").await {
                Ok(()) => exec(&mut self.conn, "RELEASE cmd").await,
                Err(e) => Err(e),
            }
        };
        (done, end.err())
    }
}

impl Writer {
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
        match idempotency::forget_expired(&mut self.conn).await {
            Ok(n) if n > 0 => tracing::info!(keys = n, "forgot expired idempotency keys"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not forget expired idempotency keys"),
        }
    }
}

/// Runs a keyed command once: if its key is known, answers what was stored
/// for it (or refuses a different command reusing the key); otherwise runs
/// the command and stores its result under the key, in the same savepoint.
async fn apply_once(conn: &mut SqliteConnection, op: Op, keyed: &Keyed) -> Finished {
    let fingerprint = op.fingerprint();
    match idempotency::lookup(conn, &keyed.key).await {
        Err(e) => fail(op, &e),
        Ok(Some(stored)) if stored.fingerprint != fingerprint => fail(op, &MeterError::KeyReused),
        Ok(Some(stored)) => {
            let answer = match &op {
                Op::Increment { .. } => {
                    Answer::Counter(Some(idempotency::decode_value(&stored.result)))
                }
                Op::Check { .. } => {
                    Answer::Check(Some(idempotency::decode_decision(&stored.result)))
                }
                // Only increments and checks take keys.
                _ => Answer::Counter(None),
            };
            keyed.replayed.store(true, Ordering::Release);
            finish(op, answer)
        }
        Ok(None) => {
            let done = apply(conn, op, None).await;
            let Some(result) = done.stored_result() else {
                return done;
            };
            match idempotency::remember(conn, &keyed.key, &fingerprint, &result).await {
                Ok(()) => done,
                // The savepoint is rolled back: the write and its key go
                // together or not at all.
                Err(e) => done.failed(e),
            }
        }
    }
}

/// COMMIT, timed: its fsync is most of what a durable write waits for.
/// A failed COMMIT may leave the transaction open, so it is rolled back.
async fn commit(conn: &mut SqliteConnection) -> Result<(), MeterError> {
    let started = std::time::Instant::now();
    let r = exec(conn, "COMMIT").await;
    metrics::histogram!("tally_commit_duration_seconds").record(started.elapsed().as_secs_f64());
    if r.is_err() {
        let _ = exec(conn, "ROLLBACK").await;
    }
    r
}

/// Pairs each command of a set-based batch, in queue order, with its
/// result: the next value for an increment, the next decision for a check.
fn answer_in_order(
    batch: &mut Vec<Envelope>,
    values: Vec<i64>,
    decisions: Vec<Result<meter::Decision, MeterError>>,
) -> Vec<Finished> {
    let mut values = values.into_iter();
    let mut decisions = decisions.into_iter();
    batch
        .drain(..)
        .map(|e| {
            let answer = match &e.op {
                Op::Increment { .. } => Answer::Counter(values.next().map(Ok)),
                Op::Check { .. } => Answer::Check(decisions.next()),
                // Not in a set-based batch; `finish` answers it an error.
                _ => Answer::Counter(None),
            };
            finish(e.op, answer).queued_by(e.request_id)
        })
        .collect()
}

async fn exec(conn: &mut SqliteConnection, sql: &'static str) -> Result<(), MeterError> {
    sqlx::raw_sql(sql).execute(conn).await?;
    Ok(())
}

/// A result worked out by the set-based path, for [`finish`].
enum Answer {
    Counter(Option<Result<i64, MeterError>>),
    Check(Option<Result<meter::Decision, MeterError>>),
}

/// Pairs a command with its set-based result. A result of the wrong kind
/// or a missing one cannot happen (results are produced per command, in
/// order); if it ever did, the caller gets an error rather than a wrong
/// answer.
fn finish(op: Op, answer: Answer) -> Finished {
    let missing = || {
        MeterError::from(sqlx::Error::Protocol(
            "the set-based batch produced no result for this command".into(),
        ))
    };
    let kind = op.kind();
    match (op, answer) {
        (Op::Increment { name, reply, .. }, Answer::Counter(r)) => Finished::Counter(Done::new(
            reply,
            kind,
            r.unwrap_or_else(|| Err(missing())),
            Target::Counter(name),
        )),
        (
            Op::Check {
                budget,
                visitor,
                reply,
                ..
            },
            Answer::Check(r),
        ) => Finished::Check(Done::new(
            reply,
            kind,
            r.unwrap_or_else(|| Err(missing())),
            Target::Check { budget, visitor },
        )),
        (op, _) => fail(op, &missing()),
    }
}

/// The command, answered with `err` without running.
fn fail(op: Op, err: &MeterError) -> Finished {
    let kind = op.kind();
    match op {
        Op::Increment { name, reply, .. } => Finished::Counter(Done::new(
            reply,
            kind,
            Err(err.clone_shallow()),
            Target::Counter(name),
        )),
        Op::PutBudget { name, reply, .. } => Finished::Budget(Done::new(
            reply,
            kind,
            Err(err.clone_shallow()),
            Target::Budget(name),
        )),
        Op::Check {
            budget,
            visitor,
            reply,
            ..
        } => Finished::Check(Done::new(
            reply,
            kind,
            Err(err.clone_shallow()),
            Target::Check { budget, visitor },
        )),
        Op::Reset {
            budget,
            scope,
            reply,
        } => Finished::Reset(Done::new(
            reply,
            kind,
            Err(err.clone_shallow()),
            Target::Reset { budget, scope },
        )),
    }
}

/// Applies `op`, or, when `skip` holds the error that broke its batch, only
/// answers it with that error.
async fn apply(conn: &mut SqliteConnection, op: Op, skip: Option<&MeterError>) -> Finished {
    if let Some(e) = skip {
        return fail(op, e);
    }
    let kind = op.kind();
    match op {
        Op::Increment { name, by, reply } => Finished::Counter(Done::new(
            reply,
            kind,
            meter::increment(conn, &name, by).await,
            Target::Counter(name),
        )),
        Op::PutBudget { name, spec, reply } => Finished::Budget(Done::new(
            reply,
            kind,
            meter::put_budget(conn, &name, &spec).await,
            Target::Budget(name),
        )),
        Op::Check {
            budget,
            visitor,
            day,
            reply,
        } => Finished::Check(Done::new(
            reply,
            kind,
            meter::check(conn, &budget, &visitor, day).await,
            Target::Check { budget, visitor },
        )),
        Op::Reset {
            budget,
            scope,
            reply,
        } => Finished::Reset(Done::new(
            reply,
            kind,
            meter::reset(conn, &budget, &scope).await,
            Target::Reset { budget, scope },
        )),
    }
}
