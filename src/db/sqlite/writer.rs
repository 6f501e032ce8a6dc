//! The SQLite writer: the process's one writable connection.

use sqlx::{Connection, SqliteConnection};

use super::files::DbFiles;
use crate::db::{
    Error, keys, txn,
    writer::{Engine, Lost},
};

/// The SQLite writer: the process's one writable connection, and the
/// files it must still find at the database's path.
pub(crate) struct SqliteWriter {
    pub(super) conn: SqliteConnection,
    /// The database's files as opened, to notice them being deleted.
    pub(super) files: DbFiles,
    /// Checkpoint and truncate the WAL when the queue is drained. Off when
    /// another process (Litestream) owns checkpointing.
    pub(super) checkpoint_on_close: bool,
}

impl Engine for SqliteWriter {
    async fn apply(&mut self, batch: &mut [crate::db::command::Queued]) -> txn::Applied {
        txn::apply_batch(&mut self.conn, batch).await
    }

    fn check(&mut self) -> Result<(), Lost> {
        self.files.check()
    }

    async fn forget_expired_keys(&mut self) -> Result<u64, Error> {
        keys::forget_expired(&mut self.conn).await
    }

    /// Checkpoints (unless Litestream owns that) and closes the database.
    /// Every accepted command has been answered by now and every commit is
    /// in the WAL, which the next open replays: a failure here (a full disk
    /// cannot take the checkpointed pages) loses nothing, so it is logged,
    /// and the writer's end is still a clean one. Under Litestream a
    /// non-zero exit would skip its final sync, exactly when it matters.
    async fn close(mut self) {
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
}
