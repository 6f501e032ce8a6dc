//! The storage boundary.
//!
//! [`Database::open`] returns two halves:
//!
//! - a [`Handle`], cheap to clone, for HTTP handlers: a pool of read-only
//!   connections (opened read-only *and* with `PRAGMA query_only`) and the
//!   sending end of a bounded queue of write commands;
//! - a [`Writer`], which owns the one writable connection in the process and
//!   the receiving end of the queue.
//!
//! No function hands out a writable connection: the only one is a private
//! field of `Writer`, and `Writer::run` consumes it. Every write is a round
//! trip through the queue (a command in, a oneshot reply back), and a reply
//! is sent only after the transaction holding the command has committed,
//! into the file that still has the database's name (`files`).

mod command;
mod files;
mod reads;
mod stats;
mod writer;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use sqlx::{
    ConnectOptions, SqlitePool,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use command::Envelope;
pub use command::{Op, Reply, WRITE_RESULTS};
pub use stats::{QueueStats, retry_after_secs};
pub use writer::{Writer, WriterFailed, WriterTask};

use crate::{
    config::Synchronous,
    meter::{
        Budget, BudgetSpec, Day, Decision, IdempotencyKey, MeterError, Name, ResetScope, VisitorId,
    },
};

tokio::task_local! {
    /// Who queued the commands of this task (the HTTP request id), for the
    /// writer's log lines about them.
    pub static CALLER: Arc<str>;
}

/// How to open the database.
#[derive(Debug, Clone)]
pub struct DbOptions {
    pub queue_capacity: usize,
    pub max_batch: usize,
    pub synchronous: Synchronous,
    pub readers: u32,
    /// Whether tally checkpoints the WAL (automatically, and once more when it
    /// closes). Off when Litestream owns checkpointing.
    pub checkpoints: bool,
    /// Test hook: the writer sleeps this long before each batch.
    pub writer_delay: Option<Duration>,
    /// Test hook: the writer panics on taking batch number N+1.
    pub writer_panic_after: Option<u64>,
}

/// Why a write got no result.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The queue was full: the command was not accepted and nothing ran, so
    /// retrying is safe.
    #[error("the write queue is full")]
    Unavailable { retry_after: Duration },
    /// The queue no longer accepts commands: tally is shutting down.
    #[error("the write queue is closed")]
    Closed,
    /// The command was accepted but its reply never came: it may or may not
    /// have committed.
    #[error("the write was accepted but its outcome is unknown")]
    OutcomeUnknown,
    /// The command ran and was refused, or the database failed.
    #[error(transparent)]
    Meter(#[from] MeterError),
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
    #[error("cannot migrate database {path}: {source}")]
    Migrate {
        path: PathBuf,
        source: sqlx::migrate::MigrateError,
    },
}

/// The entry point of the storage layer.
pub struct Database;

impl Database {
    /// Opens (creating if needed) the database at `path`, runs migrations on
    /// the writable connection, and returns the handle and the writer. Spawn
    /// [`Writer::run`] before using the handle for writes.
    pub async fn open(path: &Path, opts: &DbOptions) -> Result<(Handle, Writer), OpenError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| OpenError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        let open_err = |source| OpenError::Open {
            path: path.to_owned(),
            source,
        };

        // Whether tally's data was there before this start: a wrong replica
        // path makes a restore step skip quietly, and a first deploy looks
        // the same. Say which it was.
        let file_existed = std::fs::metadata(path).is_ok_and(|m| m.len() > 0);

        let synchronous = match opts.synchronous {
            Synchronous::Full => SqliteSynchronous::Full,
            Synchronous::Normal => SqliteSynchronous::Normal,
        };
        let mut conn = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(Duration::from_secs(5))
            // Litestream's guidance: the app must not checkpoint behind its
            // back, or WAL frames can be lost to the replica.
            .pragma(
                "wal_autocheckpoint",
                if opts.checkpoints { "1000" } else { "0" },
            )
            .connect()
            .await
            .map_err(open_err)?;

        // WAL is what lets readers run beside the writer; some file systems
        // cannot give it, and then serving would be wrong, not just slow.
        let (journal_mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
            .fetch_one(&mut conn)
            .await
            .map_err(open_err)?;
        let (sync_level,): (i64,) = sqlx::query_as("PRAGMA synchronous")
            .fetch_one(&mut conn)
            .await
            .map_err(open_err)?;
        if !journal_mode.eq_ignore_ascii_case("wal") {
            return Err(OpenError::Open {
                path: path.to_owned(),
                source: sqlx::Error::Configuration(
                    format!("journal_mode is {journal_mode}, not wal").into(),
                ),
            });
        }
        tracing::info!(
            path = %path.display(),
            journal_mode,
            synchronous = sync_level,
            checkpoints = opts.checkpoints,
            "database open"
        );
        let had_tables = file_existed && {
            let (n,): (i64,) = sqlx::query_as(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'counters'",
            )
            .fetch_one(&mut conn)
            .await
            .map_err(open_err)?;
            n > 0
        };
        if had_tables {
            tracing::info!(path = %path.display(), "opened an existing database");
        } else {
            tracing::warn!(
                path = %path.display(),
                file_existed,
                "created a new, empty database; if this is not the first start, a restore \
                 from the replica did not happen"
            );
        }
        metrics::gauge!("tally_database_new").set(if had_tables { 0.0 } else { 1.0 });

        sqlx::migrate!("./migrations")
            .run(&mut conn)
            .await
            .map_err(|source| OpenError::Migrate {
                path: path.to_owned(),
                source,
            })?;

        let readers = SqlitePoolOptions::new()
            .max_connections(opts.readers)
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(5))
            // A local file does not drop connections; a ping before every
            // read would be one more round trip to the connection's thread.
            .test_before_acquire(false)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(path)
                    .read_only(true)
                    .pragma("query_only", "ON")
                    .busy_timeout(Duration::from_secs(5)),
            )
            .await
            .map_err(open_err)?;

        let (tx, rx) = mpsc::channel(opts.queue_capacity.max(1));
        let stats = Arc::new(QueueStats::default());
        let close = CancellationToken::new();
        let counter_reads = reads::start(readers.clone(), opts.readers);
        let handle = Handle(Arc::new(HandleInner {
            readers,
            counter_reads,
            tx,
            stats: Arc::clone(&stats),
            close: close.clone(),
        }));
        let writer = Writer {
            conn,
            rx,
            max_batch: opts.max_batch.max(1),
            close,
            stats,
            checkpoint_on_close: opts.checkpoints,
            delay: opts.writer_delay,
            keys_forgotten_at: None,
            panic_after: opts.writer_panic_after,
            batches: 0,
            // After the migrations: by now SQLite has created -wal and -shm.
            files: files::DbFiles::record(path),
            disk_full_since: None,
        };
        Ok((handle, writer))
    }
}

/// What handlers hold: read-only connections and the way into the queue.
/// Cloned for every request, so a clone is one reference count.
#[derive(Clone)]
pub struct Handle(Arc<HandleInner>);

struct HandleInner {
    readers: SqlitePool,
    counter_reads: mpsc::Sender<reads::CounterRead>,
    tx: mpsc::Sender<Envelope>,
    stats: Arc<QueueStats>,
    close: CancellationToken,
}

impl Handle {
    /// The read-only pool. Its connections cannot write: they were opened
    /// read-only and run with `query_only`.
    pub fn readers(&self) -> &SqlitePool {
        &self.0.readers
    }

    /// Whether the queue still accepts commands. A full queue still does.
    pub fn accepts_writes(&self) -> bool {
        !self.0.tx.is_closed()
    }

    /// Commands waiting in the queue right now.
    pub fn queue_depth(&self) -> usize {
        self.0.tx.max_capacity() - self.0.tx.capacity()
    }

    /// Stops the queue accepting commands. The writer still runs every
    /// command already accepted, then closes the database.
    pub fn close(&self) {
        self.0.close.cancel();
    }

    /// Closes the read-only pool, waiting for readers to finish.
    pub async fn close_readers(&self) {
        self.0.readers.close().await;
    }

    /// The current value of a counter (0 if never written), read from the
    /// file by a read-only connection; concurrent reads share one statement.
    pub async fn read_counter(&self, name: Name) -> Result<i64, MeterError> {
        let (reply, answer) = oneshot::channel();
        let gone = || MeterError::from(sqlx::Error::PoolClosed);
        self.0
            .counter_reads
            .send(reads::CounterRead { name, reply })
            .await
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }

    /// Adds `by` to a counter, under an idempotency key if given: the second
    /// value is `true` when the answer is the one stored for the key
    /// (nothing new was written).
    pub async fn increment(
        &self,
        name: Name,
        by: i64,
        key: Option<IdempotencyKey>,
    ) -> Result<(i64, bool), WriteError> {
        self.submit(key, |reply| Op::Increment { name, by, reply })
            .await
    }

    pub async fn put_budget(&self, name: Name, spec: BudgetSpec) -> Result<Budget, WriteError> {
        Ok(self
            .submit(None, |reply| Op::PutBudget { name, spec, reply })
            .await?
            .0)
    }

    /// One budget check, under an idempotency key if given; see
    /// [`Self::increment`].
    pub async fn check(
        &self,
        budget: Name,
        visitor: VisitorId,
        day: Option<Day>,
        key: Option<IdempotencyKey>,
    ) -> Result<(Decision, bool), WriteError> {
        self.submit(key, |reply| Op::Check {
            budget,
            visitor,
            day,
            reply,
        })
        .await
    }

    pub async fn reset(&self, budget: Name, scope: ResetScope) -> Result<u64, WriteError> {
        Ok(self
            .submit(None, |reply| Op::Reset {
                budget,
                scope,
                reply,
            })
            .await?
            .0)
    }

    /// How long a client refused for a full queue should wait: see
    /// [`stats::retry_after_secs`].
    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(stats::retry_after_secs(
            self.queue_depth(),
            self.0.stats.commit_rate(),
        ))
    }

    /// Queues a command and waits for its answer; the flag says whether the
    /// answer was replayed for an idempotency key.
    async fn submit<T>(
        &self,
        key: Option<IdempotencyKey>,
        op: impl FnOnce(Reply<T>) -> Op,
    ) -> Result<(T, bool), WriteError> {
        let (reply, answer) = oneshot::channel();
        // Only keyed writes can be replays; the rest skip the allocation.
        let keyed = key.map(|key| command::Keyed {
            key,
            replayed: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        });
        let replayed = keyed.as_ref().map(|k| Arc::clone(&k.replayed));
        let envelope = Envelope {
            op: op(reply),
            request_id: CALLER.try_with(Arc::clone).ok(),
            key: keyed,
        };
        let queued_at = std::time::Instant::now();
        // Never wait for room: a full queue is answered at once, and since
        // the command was not accepted, a retry cannot double-apply it.
        self.0.tx.try_send(envelope).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                metrics::counter!("tally_write_rejected_total").increment(1);
                WriteError::Unavailable {
                    retry_after: self.retry_after(),
                }
            }
            mpsc::error::TrySendError::Closed(_) => match self.0.stats.storage_lost() {
                Some(path) => WriteError::Meter(MeterError::StorageLost {
                    path: Arc::clone(path),
                }),
                None => WriteError::Closed,
            },
        })?;
        match answer.await {
            Ok(result) => {
                metrics::histogram!("tally_write_wait_seconds")
                    .record(queued_at.elapsed().as_secs_f64());
                // The oneshot orders the writer's store before this load.
                let replayed =
                    replayed.is_some_and(|r| r.load(std::sync::atomic::Ordering::Acquire));
                Ok((result?, replayed))
            }
            // The writer dropped the reply without answering: it died with
            // our command in hand, before or after committing it.
            Err(_) => {
                metrics::counter!("tally_write_outcome_unknown_total").increment(1);
                Err(WriteError::OutcomeUnknown)
            }
        }
    }
}
