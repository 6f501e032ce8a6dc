//! Opening the database: the engine is chosen here, once (`sqlite::open`,
//! `postgres::open`), and everything else is assembled around it the same
//! way for both.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{
    DbOptions, Handle, HandleInner, OpenError, Writer,
    committed::Committed,
    keys, postgres,
    reads::{self, Readers},
    sqlite,
    stats::QueueStats,
    writer::{Engine, WriterLoop},
};
use crate::config::Storage;

/// The entry point of the storage layer.
pub struct Database;

impl Database {
    /// Opens the database (creating a SQLite file if needed), runs
    /// migrations, and returns the handle and the writer. Spawn the writer
    /// ([`Writer::spawn`]) before using the handle for writes.
    pub async fn open(storage: &Storage, opts: &DbOptions) -> Result<(Handle, Writer), OpenError> {
        match storage {
            Storage::Sqlite(path) => {
                let (readers, engine) = sqlite::open(path, opts).await?;
                // The only writer: it knows every committed value.
                let committed =
                    (opts.counter_cache > 0).then(|| Arc::new(Committed::new(opts.counter_cache)));
                Ok(assemble(readers, engine, committed, opts))
            }
            Storage::Postgres(url) => {
                if opts.storage_limit.is_some() {
                    return Err(OpenError::Postgres {
                        url: url.to_string(),
                        reason: "TALLY_STORAGE_LIMIT applies to a SQLite database only (the \
                                 server keeps its own disk): unset it"
                            .into(),
                    });
                }
                // Asked for by name (the default is `full`): a commit's
                // durability is the server's own (`synchronous_commit`).
                if opts.synchronous == crate::config::Synchronous::Normal {
                    return Err(OpenError::Postgres {
                        url: url.to_string(),
                        reason: "TALLY_SYNCHRONOUS=normal applies to a SQLite database only (a \
                                 commit on PostgreSQL is as durable as the server's \
                                 synchronous_commit makes it): unset it"
                            .into(),
                    });
                }
                let (readers, engine) = postgres::open(url, opts).await?;
                // Other processes write too: reads go to the database.
                Ok(assemble(readers, engine, None, opts))
            }
        }
    }
}

/// The two halves around a read pool and a writer's connection.
fn assemble(
    readers: Readers,
    engine: impl Engine,
    committed: Option<Arc<Committed>>,
    opts: &DbOptions,
) -> (Handle, Writer) {
    let (tx, rx) = mpsc::channel(opts.queue_capacity.max(1));
    let stats = Arc::new(QueueStats::default());
    let close = CancellationToken::new();
    let counter_reads = reads::start(readers.clone(), opts.readers);
    let handle = Handle(Arc::new(HandleInner {
        readers,
        counter_reads,
        committed: committed.clone(),
        tx,
        stats: Arc::clone(&stats),
        close: close.clone(),
    }));
    let writer = WriterLoop {
        engine,
        rx,
        committed,
        max_batch: opts.max_batch.max(1),
        close,
        stats,
        #[cfg(feature = "test-hooks")]
        delay: opts.writer_delay,
        keys_forgotten_at: None,
        prunes_due: Default::default(),
        clock: Default::default(),
        hold_unkept: false,
        hold_unread: None,
        clock_read_at: None,
        key_ttl: opts.key_ttl.unwrap_or(keys::DEFAULT_KEY_TTL),
        #[cfg(feature = "test-hooks")]
        panic_after: opts.writer_panic_after,
        #[cfg(feature = "test-hooks")]
        publish_delay: opts.publish_delay,
        batches: 0,
        failing: Default::default(),
    };
    (handle, writer.into())
}
