//! The storage boundary: the only module that knows SQL, pools or
//! connections.
//!
//! [`Database::open`] returns two halves:
//!
//! - a [`Handle`], cheap to clone, for HTTP handlers: its methods are the
//!   whole storage API (increment, counter, put budget, budget, check,
//!   usage, reset, the deletes and the lists). Reads go to a pool of their own (on SQLite, connections
//!   opened read-only *and* with `PRAGMA query_only`; on PostgreSQL,
//!   connections to the primary); writes are queued as [`Command`]s on a
//!   bounded queue, each carrying a reply of exactly its own result.
//! - a [`Writer`], which owns the one writable connection in the process and
//!   the receiving end of the queue.
//!
//! No function hands out a writable connection: the only one belongs to
//! the engine the writer drives, and running the writer consumes it. Every
//! write is a round trip through the queue (a command in, its
//! [`command::Reply`] back), and a reply is sent only after the transaction
//! holding the command has committed: on SQLite into the file that still
//! has the database's name, on PostgreSQL on the server, where other tally
//! processes write too (see `postgres` for how they stay correct together).
//!
//! Layout:
//! - `open`: chooses the engine, once, and assembles the two halves.
//! - `writer`: the queue loop over an `Engine` (no SQL, no engine named);
//!   `txn`: the transaction rules both engines call (set-based or one by
//!   one, lock order, savepoints, keys); `command`: the commands.
//! - `counters`, `budgets`, `keys`: the rules, written once against the
//!   [`store::Store`] trait; `reads`: coalesced reads over a `Reads` trait;
//!   `list`: pages of names, as key ranges; `clock`: the writer's watch
//!   over steps of the wall clock, which hold pruning and key expiry back.
//! - `sqlite/`, `postgres/`: each engine's wing: its open, its `Store`,
//!   its writer engine, its readers, its error classification.

mod budgets;
pub(crate) mod clock;
mod command;
mod committed;
pub mod contention;
mod counters;

mod keys;
pub mod list;
mod migrations;
mod open;
mod postgres;
mod reads;
mod sqlite;
mod stats;
mod store;
mod txn;
mod writer;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use command::Command;
pub(crate) use command::WRITE_RESULTS;
use command::{Answer, Cleared, Deleted, Queued, Reply, Stored};
use list::{Page, PageRequest};
pub use open::Database;
/// The record of point-in-time restores inside a SQLite database (`tally restore-to`).
pub use sqlite::restores;
pub use sqlite::{ask_before_creating, data_dir};
use stats::QueueStats;
pub use writer::{Writer, WriterFailed, WriterTask};

use crate::{
    config::Synchronous,
    meter::{Budget, BudgetSpec, Day, Decision, IdempotencyKey, Name, Refusal, Usage, VisitorId},
};

/// How to open the database. The default is the smallest: a queue, a
/// batch and a reader of one.
#[derive(Debug, Clone, Default)]
pub struct DbOptions {
    pub queue_capacity: usize,
    pub max_batch: usize,
    pub synchronous: Synchronous,
    pub readers: u32,
    /// SQLite: how many counters' committed values are kept in memory; 0
    /// for none.
    pub counter_cache: usize,
    /// Whether tally checkpoints the WAL (automatically, and once more when it
    /// closes). Off when Litestream owns checkpointing.
    pub checkpoints: bool,
    /// SQLite under Litestream: write a row at start (`replica_starts`), so
    /// that the replica gate waits for an upload even when the database is
    /// already level with its replica; leave the mark of a replicated
    /// database, and refuse to start without tally's database where the
    /// mark is or where another file is (`sqlite::replicated`; where there
    /// is nothing, [`ask_before_creating`] asked the replica); and tell a
    /// loss of the database's files that Litestream may have shipped the
    /// last commit.
    pub under_litestream: bool,
    /// SQLite under Litestream: the replica was asked at this start
    /// ([`ask_before_creating`]) and holds nothing. Only then is a missing
    /// database created.
    pub replica_empty: bool,
    /// PostgreSQL: longest a command waits for a row another transaction
    /// holds, before it is answered busy.
    pub lock_timeout: Duration,
    /// PostgreSQL: the schema of tally's tables; `None`: found at start.
    pub schema: Option<String>,
    /// How long an idempotency key is remembered; `None`: a day.
    pub key_ttl: Option<Duration>,
    /// SQLite: the most the database's directory may use on disk, beyond
    /// which writes that add data are refused as on a full disk
    /// (`sqlite::space`). `None`: no limit.
    pub storage_limit: Option<u64>,
    /// Test hook: the writer sleeps this long before each batch.
    #[cfg(feature = "test-hooks")]
    pub writer_delay: Option<Duration>,
    /// Test hook: the writer panics on taking batch number N+1.
    #[cfg(feature = "test-hooks")]
    pub writer_panic_after: Option<u64>,
    /// Test hook: the writer sleeps this long between a batch's COMMIT and
    /// the publication of its counter values.
    #[cfg(feature = "test-hooks")]
    pub publish_delay: Option<Duration>,
}

/// Why the database could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open database {path}: {source}")]
    Open { path: PathBuf, source: sqlx::Error },
    /// WAL is what lets readers run beside the writer; some file systems
    /// cannot give it, and then serving would be wrong, not just slow.
    #[error("database {path} runs in journal mode {mode}, not WAL")]
    NotWal { path: PathBuf, mode: String },
    #[error("cannot migrate database {path}: {source}")]
    Migrate {
        path: PathBuf,
        source: sqlx::migrate::MigrateError,
    },
    /// Its migrations say tally must not run on it.
    #[error("cannot use database {path}: {reason}")]
    Refused { path: PathBuf, reason: String },
    /// The URL is shown with its password replaced.
    #[error("cannot use PostgreSQL at {url}: {reason}")]
    Postgres { url: String, reason: String },
    /// Opening failed where the file system had hardly any space left: a
    /// full disk is the likely cause, whatever SQLite called it (a WAL
    /// index that cannot grow is a "disk I/O error").
    #[error(
        "the file system holding {dir} has {free} bytes free, too little for the database: \
         free space there, then start again: {source}"
    )]
    SpaceLow {
        dir: PathBuf,
        free: u64,
        source: Box<OpenError>,
    },
}

/// Why a storage call gave no result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The command was refused for what the client asked; nothing changed.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The queue was full: the command was not accepted and nothing ran, so
    /// retrying is safe.
    #[error("the write queue is full")]
    QueueFull { retry_after: Duration },
    /// The queue or the read pool no longer takes work: tally is shutting
    /// down.
    #[error("the database is closing")]
    Closed,
    /// The command was accepted but its reply never came, or the database
    /// connection broke during its COMMIT: it may or may not have
    /// committed.
    #[error("the write was accepted but its outcome is unknown")]
    OutcomeUnknown,
    /// The disk (or the database's size limit) is full: nothing was
    /// written, and the same write succeeds once space is freed. Not a bug,
    /// so it is told apart from [`Self::Database`].
    #[error("the disk is full: {}", Driver(.0))]
    StorageFull(#[source] Arc<sqlx::Error>),
    /// The database file, or its `-wal` or `-shm`, was deleted or replaced
    /// while tally had it open, or the database file was cut short in
    /// place: whatever is written now goes to a file that no longer has a
    /// name and vanishes when tally exits, or beside pages that are gone.
    #[error(
        "the database file {} was deleted, replaced or cut short while open",
        .0.display()
    )]
    StorageLost(Arc<Path>),
    /// The database server cannot be reached or cannot take writes now
    /// (refused, timed out, the connection dropped, the server shutting
    /// down or out of connection slots, a standby): nothing was written,
    /// and the same write succeeds once it answers again.
    #[error("the database is unavailable: {}", Driver(.0))]
    Unavailable(#[source] Arc<sqlx::Error>),
    /// A row the command needs was held by another transaction (another
    /// process's batch, an operator's open transaction) for longer than
    /// the lock timeout: this command wrote nothing, and the same write
    /// succeeds once the row is released. The batch's other commands are
    /// not held up by it.
    #[error(
        "a row it needs was locked by another transaction past the lock timeout: {}",
        Driver(.0)
    )]
    Busy(#[source] Arc<sqlx::Error>, HeldRow),
    /// The transaction lost a race with another (a deadlock, a
    /// serialization failure): nothing of it committed, and the same
    /// transaction run again can succeed.
    #[error("the transaction lost a race with another: {}", Driver(.0))]
    Raced(#[source] Arc<sqlx::Error>),
    /// The database failed. Shared, because one failed COMMIT is every
    /// caller's answer in a batch.
    #[error("database error: {}", Driver(.0))]
    Database(#[source] Arc<sqlx::Error>),
    /// A `PUT` would create a budget again while more of its deleted
    /// namesake's usage is left than one share deletes
    /// ([`budgets::PRUNE_SHARE`]): the writer is deleting it, a share at a
    /// time, and the same `PUT` succeeds once it is gone. Nothing changed.
    #[error(
        "the usage of the deleted budget `{0}` is still being deleted; \
         nothing was changed, and the same request succeeds once it is gone"
    )]
    Purging(crate::meter::Name),
    /// tally found its own data or its own bookkeeping inconsistent: a
    /// stored value it cannot read back, or a batch short of a result.
    /// Never the client's doing.
    #[error("internal error: {0}")]
    Internal(Arc<str>),
}

/// A driver's error as tally tells it: PostgreSQL's own answer with its
/// SQLSTATE (which an operator can look up) instead of sqlx's `at line N`,
/// a line of the server's C source, read as one of a migration's; any
/// other error as sqlx tells it.
pub(crate) struct Driver<'a>(pub(crate) &'a sqlx::Error);

impl std::fmt::Display for Driver<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match postgres::pg_error(self.0) {
            Some(pg) => write!(
                f,
                "error returned from database: {} (SQLSTATE {})",
                pg.message(),
                pg.code()
            ),
            None => self.0.fmt(f),
        }
    }
}

impl Error {
    /// The database cannot be used for writes, for `reason` (not an error
    /// the driver gave): nothing was written, and retrying is safe.
    pub(crate) fn unavailable(reason: &'static str) -> Self {
        Error::Unavailable(Arc::new(sqlx::Error::Io(std::io::Error::other(reason))))
    }

    /// An error each engine has no more to say about (a pool closed, a
    /// connection that broke, anything else the database answered). Each
    /// engine classifies its own errors first (`sqlite::error`,
    /// `postgres::error`) and leaves the rest to this.
    pub(crate) fn from_sqlx(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::PoolClosed => Error::Closed,
            sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolTimedOut => {
                Error::Unavailable(Arc::new(e))
            }
            e => Error::Database(Arc::new(e)),
        }
    }
}

/// Which row a command found held ([`Error::Busy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldRow {
    /// Its own: a counter, a visitor's usage, a budget.
    Own,
    /// The day of a budget it counts on (the day's global usage row, which
    /// every writer of that day's usage locks first).
    Day,
    /// The budget's own row, which every check and reset of it reads
    /// (`FOR SHARE` on PostgreSQL).
    Budget,
    /// Its idempotency key, claimed by another transaction (a retry of the
    /// same request on another process, or a session outside tally): no
    /// row of counts, which other commands may still have.
    Key,
}

impl HeldRow {
    /// What of a command was found held, in words for the log.
    pub fn what(self) -> &'static str {
        match self {
            HeldRow::Own => "its row",
            HeldRow::Day => "its budget's day",
            HeldRow::Budget => "its budget's row",
            HeldRow::Key => "its idempotency key",
        }
    }
}

impl Error {
    /// The error of a statement that locks a budget's days: a row found
    /// held there is the day's.
    pub(crate) fn at_day(self) -> Self {
        match self {
            Error::Busy(e, _) => Error::Busy(e, HeldRow::Day),
            e => e,
        }
    }

    /// The error of a statement that claims idempotency keys: a row found
    /// held there is a key's.
    pub(crate) fn at_key(self) -> Self {
        match self {
            Error::Busy(e, _) => Error::Busy(e, HeldRow::Key),
            e => e,
        }
    }

    /// The error of a statement that reads budgets' rows: a row found held
    /// there is the budget's.
    pub(crate) fn at_budget(self) -> Self {
        match self {
            Error::Busy(e, _) => Error::Busy(e, HeldRow::Budget),
            e => e,
        }
    }

    /// A stable name for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Refused(r) => r.kind(),
            Error::QueueFull { .. } => "queue_full",
            Error::Closed => "closed",
            Error::OutcomeUnknown => "outcome_unknown",
            Error::StorageFull(_) => "storage_full",
            Error::StorageLost(_) => "storage_lost",
            Error::Unavailable(_) => "unavailable",
            Error::Busy(..) => "busy",
            Error::Purging(_) => "purging",
            Error::Raced(_) | Error::Database(_) | Error::Internal(_) => "database_error",
        }
    }

    /// Whether the error is the whole transaction's rather than one
    /// command's: the connection is gone, or the transaction lost a race
    /// ([`Self::is_retryable`]). Then no command of the batch can commit.
    pub(crate) fn breaks_transaction(&self) -> bool {
        matches!(self, Error::Unavailable(_)) || self.is_retryable()
    }

    /// What a transaction of a batch hears that did not run because an
    /// earlier one of the same batch failed with this: `None` unless that
    /// one could not reach the server, or lost its connection during its
    /// `COMMIT` (the later ones are not run, rather than each waiting out
    /// its own time limit).
    pub(crate) fn not_run_after(&self) -> Option<Error> {
        match self {
            Error::Unavailable(_) => Some(self.clone()),
            Error::OutcomeUnknown => Some(Error::unavailable(
                "the connection was lost during an earlier transaction of the same batch; this \
                 one did not run",
            )),
            _ => None,
        }
    }

    /// A serialization failure or deadlock: the same transaction run again
    /// can succeed.
    pub(crate) fn is_retryable(&self) -> bool {
        matches!(self, Error::Raced(_))
    }

    /// What a failed COMMIT means. A server that could not be reached
    /// during COMMIT may have committed before the connection went: the
    /// outcome is unknown, and no caller may hear "nothing was written".
    pub(crate) fn at_commit(self) -> Self {
        match self {
            Error::Unavailable(_) => Error::OutcomeUnknown,
            e => e,
        }
    }

    /// Whether the storage failed, rather than the command being refused
    /// or not taken: a budget check fails closed on any of these.
    pub fn is_storage_failure(&self) -> bool {
        matches!(
            self,
            Error::StorageFull(_)
                | Error::StorageLost(_)
                | Error::Unavailable(_)
                | Error::Busy(..)
                | Error::Raced(_)
                | Error::Database(_)
                | Error::Internal(_)
        )
    }
}

/// JSON text for a `json_each` parameter, written straight from `v` (no
/// intermediate `serde_json::Value` on the hot path). Maps with string keys
/// and sequences of strings and numbers cannot fail to serialize.
fn to_json<T: serde::Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".to_owned())
}

/// What handlers hold: the storage API. Cloned for every request, so a
/// clone is one reference count.
#[derive(Clone)]
pub struct Handle(Arc<HandleInner>);

struct HandleInner {
    readers: reads::Readers,
    counter_reads: mpsc::Sender<reads::CounterRead>,
    /// Committed counter values in memory (SQLite only).
    committed: Option<Arc<committed::Committed>>,
    tx: mpsc::Sender<Queued>,
    stats: Arc<QueueStats>,
    close: CancellationToken,
}

/// A write's result, and whether it was replayed for an idempotency key
/// (nothing new was written).
pub type Replayable<T> = (T, bool);

impl Handle {
    /// Adds `by` to a counter (created at 0), under an idempotency key if
    /// given; answers the new value.
    pub async fn increment(
        &self,
        name: Name,
        by: i64,
        key: Option<IdempotencyKey>,
        request_id: Option<Arc<str>>,
    ) -> Result<Replayable<i64>, Error> {
        let (reply, answer) = Reply::new();
        let command = Command::Increment { name, by, reply };
        self.submit(command, key, request_id, answer).await
    }

    /// The current value of a counter (0 if never written), read from the
    /// file by a read-only connection; concurrent reads share one statement.
    pub async fn counter(&self, name: &Name) -> Result<i64, Error> {
        let Some(committed) = &self.0.committed else {
            return self.read_counter(name.clone()).await;
        };
        if let Some(value) = committed.get(name.as_str()) {
            return Ok(value);
        }
        let as_of = committed.as_of();
        let value = self.read_counter(name.clone()).await?;
        committed.offer(name.as_str(), value, as_of);
        Ok(value)
    }

    /// A counter's value, read from the database.
    async fn read_counter(&self, name: Name) -> Result<i64, Error> {
        let (reply, answer) = oneshot::channel();
        self.0
            .counter_reads
            .send(reads::CounterRead { name, reply })
            .await
            .map_err(|_| Error::Closed)?;
        answer.await.map_err(|_| Error::Closed)?
    }

    /// Creates or replaces a budget's configuration; its usage is kept.
    pub async fn put_budget(
        &self,
        name: Name,
        spec: BudgetSpec,
        request_id: Option<Arc<str>>,
    ) -> Result<Budget, Error> {
        let (reply, answer) = Reply::new();
        let command = Command::PutBudget { name, spec, reply };
        self.submit(command, None, request_id, answer)
            .await
            .map(|(Stored { budget, .. }, _)| budget)
    }

    /// A budget's configuration.
    pub async fn budget(&self, name: &Name) -> Result<Budget, Error> {
        self.0.readers.budget(name).await
    }

    /// One call against a budget, on `day` (the budget's today when
    /// `None`), under an idempotency key if given.
    pub async fn check(
        &self,
        budget: Name,
        visitor: VisitorId,
        day: Option<Day>,
        key: Option<IdempotencyKey>,
        request_id: Option<Arc<str>>,
    ) -> Result<Replayable<Decision>, Error> {
        let (reply, answer) = Reply::new();
        let command = Command::Check {
            budget,
            visitor,
            day,
            reply,
        };
        self.submit(command, key, request_id, answer).await
    }

    /// A budget's usage on `day` (its today when `None`), and `visitor`'s
    /// calls if asked; nothing is counted.
    pub async fn usage(
        &self,
        budget: &Name,
        day: Option<Day>,
        visitor: Option<&VisitorId>,
    ) -> Result<Usage, Error> {
        self.0.readers.usage(budget, day, visitor).await
    }

    /// Clears a day's usage of a budget (its today when `None`): every row
    /// of that day, or one visitor's only, under an idempotency key if
    /// given. Answers the day and the rows deleted, and whether that was
    /// replayed for its key.
    pub async fn reset(
        &self,
        budget: Name,
        day: Option<Day>,
        visitor: Option<VisitorId>,
        key: Option<IdempotencyKey>,
        request_id: Option<Arc<str>>,
    ) -> Result<(Cleared, bool), Error> {
        let (reply, answer) = Reply::new();
        let command = Command::Reset {
            budget,
            day,
            visitor,
            reply,
        };
        self.submit(command, key, request_id, answer).await
    }

    /// Deletes a budget and all its usage, in one transaction, under an
    /// idempotency key if given. A check queued before it was counted (and
    /// its calls go with the budget); one queued after it finds no budget.
    /// Answers whether the delete was replayed for its key.
    pub async fn delete_budget(
        &self,
        name: Name,
        key: Option<IdempotencyKey>,
        request_id: Option<Arc<str>>,
    ) -> Result<bool, Error> {
        let (reply, answer) = Reply::new();
        let command = Command::DeleteBudget { name, reply };
        self.submit(command, key, request_id, answer)
            .await
            .map(|(Deleted { .. }, replayed)| replayed)
    }

    /// Deletes a counter, under an idempotency key if given; a later
    /// increment starts again from 0. Answers whether the delete was
    /// replayed for its key.
    pub async fn delete_counter(
        &self,
        name: Name,
        key: Option<IdempotencyKey>,
        request_id: Option<Arc<str>>,
    ) -> Result<bool, Error> {
        let (reply, answer) = Reply::new();
        let command = Command::DeleteCounter { name, reply };
        self.submit(command, key, request_id, answer)
            .await
            .map(|(Deleted { .. }, replayed)| replayed)
    }

    /// A page of budgets, by name in byte order, from the read pool.
    pub async fn list_budgets(&self, page: &PageRequest) -> Result<Page<Budget>, Error> {
        self.0.readers.list_budgets(page).await
    }

    /// A page of counters and their values, by name in byte order, from
    /// the read pool.
    pub async fn list_counters(&self, page: &PageRequest) -> Result<Page<(Name, i64)>, Error> {
        self.0.readers.list_counters(page).await
    }

    /// Whether the queue still accepts commands. A full queue still does.
    pub fn accepts_writes(&self) -> bool {
        !self.0.tx.is_closed()
    }

    /// How long the writer has been on its current batch (zero between
    /// batches): see [`QueueStats::batch_age`].
    pub fn batch_age(&self) -> Duration {
        self.0.stats.batch_age()
    }

    /// Commands waiting in the queue right now.
    pub fn queue_depth(&self) -> usize {
        self.0.tx.max_capacity() - self.0.tx.capacity()
    }

    /// Read-only connections open, and how many of them are in use.
    pub fn readers_open_and_busy(&self) -> (u32, u32) {
        let (open, idle) = self.0.readers.size_and_idle();
        let idle = u32::try_from(idle).unwrap_or(open);
        (open, open.saturating_sub(idle))
    }

    /// Stops the queue accepting commands. The writer still runs every
    /// command already accepted, then closes the database.
    pub fn close(&self) {
        self.0.close.cancel();
    }

    /// How many batches the writer slowed by `TALLY_TEST_WRITER_DELAY_MS`
    /// has taken: it holds the last while it sleeps.
    #[cfg(feature = "test-hooks")]
    pub fn batches_held(&self) -> usize {
        (self.0.stats.batches_held).load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Closes the read-only pool, waiting for readers to finish.
    pub async fn close_readers(&self) {
        self.0.readers.close().await;
    }

    /// How long a client refused for a full queue should wait: see
    /// [`stats::retry_after_secs`].
    fn retry_after(&self) -> Duration {
        Duration::from_secs(stats::retry_after_secs(
            self.queue_depth(),
            self.0.stats.commit_rate(),
        ))
    }

    /// Queues a command and waits for its answer on `answer`, the other
    /// end of the command's own [`Reply`].
    async fn submit<T: std::fmt::Debug>(
        &self,
        command: Command,
        key: Option<IdempotencyKey>,
        request_id: Option<Arc<str>>,
        answer: oneshot::Receiver<Answer<T>>,
    ) -> Result<Replayable<T>, Error> {
        // Whoever stops waiting for the answer (a request timed out, a
        // client gone) after the writer sent it still has it accounted for.
        let mut answer = Unread {
            rx: Some(answer),
            kind: command.kind(),
            request_id: request_id.clone(),
        };
        let queued = Queued {
            command,
            key,
            request_id,
            queued_at: std::time::Instant::now(),
        };
        // Never wait for room: a full queue is answered at once, and since
        // the command was not accepted, a retry cannot double-apply it.
        self.0.tx.try_send(queued).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                // The writer is the bottleneck. Clients that never back off
                // send the next request the moment their 429 arrives, and
                // on a busy core the threads answering them would keep the
                // writer's threads waiting for the core at every step of a
                // batch: measured on one core, the writes fell to a third
                // of their rate. Giving up this thread's turn once per
                // refusal lets them run first (a no-op when nothing else
                // is waiting for the core); while a commit is late, one
                // refusal a millisecond leaves the core idle for the
                // kernel's part of its flush (see `pause_refusal`). A 429
                // waits for nothing else.
                if self.0.stats.pause_refusal() {
                    metrics::counter!("tally_write_refusal_pauses_total").increment(1);
                    std::thread::sleep(stats::REFUSAL_PAUSE);
                } else {
                    std::thread::yield_now();
                }
                metrics::counter!("tally_write_rejected_total").increment(1);
                Error::QueueFull {
                    retry_after: self.retry_after(),
                }
            }
            mpsc::error::TrySendError::Closed(_) => match self.0.stats.storage_lost() {
                Some(path) => Error::StorageLost(Arc::clone(path)),
                None => Error::Closed,
            },
        })?;
        if self.0.stats.yield_to_writer(self.queue_depth()) {
            std::thread::yield_now();
        }
        let Some(answer) = answer.read().await else {
            // The writer dropped the reply without answering: it died with
            // our command in hand, before or after committing it.
            metrics::counter!("tally_write_outcome_unknown_total").increment(1);
            return Err(Error::OutcomeUnknown);
        };
        if let Err(Error::OutcomeUnknown) = &answer.result {
            metrics::counter!("tally_write_outcome_unknown_total").increment(1);
        }
        Ok((answer.result?, answer.replayed))
    }
}

/// The caller's end of a command's reply. Dropped unread with an answer
/// in it (the request timed out or its client left in the instant after
/// the writer answered), the answer is accounted for as the writer
/// accounts for one whose caller had gone before it answered
/// ([`writer::caller_gone`]): neither counts a command the other does.
struct Unread<T: std::fmt::Debug> {
    rx: Option<oneshot::Receiver<Answer<T>>>,
    kind: &'static str,
    request_id: Option<Arc<str>>,
}

impl<T: std::fmt::Debug> Unread<T> {
    /// The answer; `None` if the writer dropped the reply unanswered (or
    /// it was read already).
    async fn read(&mut self) -> Option<Answer<T>> {
        let answer = self.rx.as_mut()?.await.ok();
        self.rx = None;
        answer
    }
}

impl<T: std::fmt::Debug> Drop for Unread<T> {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        // Closed first: a send from now on fails, and the writer counts
        // it; one that came before is here to read. (Read first, a send
        // between the read and the drop would be counted by neither.)
        rx.close();
        let Ok(answer) = rx.try_recv() else { return };
        let what = match &answer.result {
            Ok(value) => format!("{:?}", Some(value)),
            Err(e) => format!("{:?}", Some(e)),
        };
        writer::caller_gone(
            self.kind,
            None,
            self.request_id.as_deref(),
            answer.result.is_ok(),
            &what,
        );
    }
}

#[cfg(test)]
mod tests;
