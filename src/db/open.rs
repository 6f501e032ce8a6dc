//! Opening the database: for SQLite, the one writable connection (WAL, the
//! chosen `synchronous`, migrations) and the pool of read-only ones; for
//! PostgreSQL, the migrations and the read pool, the writer connecting on
//! its own.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use sqlx::{
    ConnectOptions, SqliteConnection, SqlitePool,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    DbOptions, Handle, HandleInner, Writer, files, postgres,
    reads::{self, Readers},
    sqlite::{SqliteReaders, SqliteWriter},
    stats::QueueStats,
    writer::{Engine, WriterLoop},
};
use crate::config::{PostgresUrl, Storage, Synchronous};

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
    /// The URL is shown with its password replaced.
    #[error("cannot use PostgreSQL at {url}: {reason}")]
    Postgres { url: String, reason: String },
}

/// The entry point of the storage layer.
pub struct Database;

impl Database {
    /// Opens the database (creating a SQLite file if needed), runs
    /// migrations, and returns the handle and the writer. Spawn the writer
    /// ([`Writer::spawn`]) before using the handle for writes.
    pub async fn open(storage: &Storage, opts: &DbOptions) -> Result<(Handle, Writer), OpenError> {
        match storage {
            Storage::Sqlite(path) => open_sqlite(path, opts).await,
            Storage::Postgres(url) => open_postgres(url, opts).await,
        }
    }
}

/// The two halves around a read pool and a writer's connection.
fn assemble(readers: Readers, engine: impl Engine, opts: &DbOptions) -> (Handle, Writer) {
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
    let writer = WriterLoop {
        engine,
        rx,
        max_batch: opts.max_batch.max(1),
        close,
        stats,
        #[cfg(feature = "test-hooks")]
        delay: opts.writer_delay,
        keys_forgotten_at: None,
        #[cfg(feature = "test-hooks")]
        panic_after: opts.writer_panic_after,
        batches: 0,
        failing_since: None,
    };
    (handle, writer.into())
}

/// Runs PostgreSQL's migrations on a connection of their own. sqlx holds
/// an advisory lock while it migrates, so replicas starting together
/// migrate one after the other, and the later ones find nothing to do.
async fn open_postgres(url: &PostgresUrl, opts: &DbOptions) -> Result<(Handle, Writer), OpenError> {
    let fail = |reason: String| OpenError::Postgres {
        url: url.to_string(),
        reason,
    };
    let options = postgres::connect_options(url.expose(), opts.lock_timeout)
        .map_err(|e| fail(format!("not a usable URL: {e}")))?;
    let mut conn = postgres::connect(&options)
        .await
        .map_err(|e| fail(format!("cannot connect: {e}")))?;
    sqlx::migrate!("./migrations/postgres")
        .run(&mut conn)
        .await
        .map_err(|e| fail(format!("cannot migrate: {e}")))?;
    let _ = sqlx::Connection::close(conn).await;
    tracing::info!(url = %url, readers = opts.readers, "PostgreSQL open");
    let readers = Readers(Arc::new(postgres::Readers::new(
        options.clone(),
        opts.readers,
    )));
    let engine = postgres::WriterConn::new(options);
    Ok(assemble(readers, engine, opts))
}

async fn open_sqlite(path: &Path, opts: &DbOptions) -> Result<(Handle, Writer), OpenError> {
    {
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
        let mut conn = open_writer(path, opts).await?;
        let had_tables = file_existed && has_tables(&mut conn).await.map_err(open_err)?;
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
        sqlx::migrate!("./migrations/sqlite")
            .run(&mut conn)
            .await
            .map_err(|source| OpenError::Migrate {
                path: path.to_owned(),
                source,
            })?;
        let readers = open_readers(path, opts.readers.max(1))
            .await
            .map_err(open_err)?;
        let engine = SqliteWriter {
            conn,
            // After the migrations: by now SQLite has created -wal and -shm.
            files: files::DbFiles::record(path),
            checkpoint_on_close: opts.checkpoints,
        };
        Ok(assemble(
            Readers(Arc::new(SqliteReaders(readers))),
            engine,
            opts,
        ))
    }
}

/// The one writable connection, in WAL mode (or an error).
async fn open_writer(path: &Path, opts: &DbOptions) -> Result<SqliteConnection, OpenError> {
    let open_err = |source| OpenError::Open {
        path: path.to_owned(),
        source,
    };
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
    let (journal_mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(&mut conn)
        .await
        .map_err(open_err)?;
    let (sync_level,): (i64,) = sqlx::query_as("PRAGMA synchronous")
        .fetch_one(&mut conn)
        .await
        .map_err(open_err)?;
    if !journal_mode.eq_ignore_ascii_case("wal") {
        return Err(OpenError::NotWal {
            path: path.to_owned(),
            mode: journal_mode,
        });
    }
    tracing::info!(
        path = %path.display(),
        journal_mode,
        synchronous = sync_level,
        checkpoints = opts.checkpoints,
        "database open"
    );
    Ok(conn)
}

/// Whether the file already holds tally's tables.
async fn has_tables(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'counters'",
    )
    .fetch_one(conn)
    .await?;
    Ok(n > 0)
}

/// The read-only pool: opened read-only *and* with `query_only`.
pub(super) async fn open_readers(path: &Path, readers: u32) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(readers)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(5))
        // A local file does not drop connections; a ping before every read
        // would be one more round trip to the connection's thread.
        .test_before_acquire(false)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .read_only(true)
                .pragma("query_only", "ON")
                .busy_timeout(Duration::from_secs(5)),
        )
        .await
}
