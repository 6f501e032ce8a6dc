//! The SQLite writer: the process's one writable connection.

use std::{collections::HashSet, sync::Arc, time::Duration};

use sqlx::{Connection, SqliteConnection};

use super::{files::DbFiles, space};
use crate::db::{
    Error, budgets,
    clock::KeptHold,
    command::{Command, Queued},
    keys,
    store::Store,
    txn,
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
    /// The directory's usage, and the storage limit checked before each
    /// batch.
    pub(super) space: space::Space,
    /// When the writer last tried to cut the WAL back, refused for the
    /// storage limit ([`Self::cut_back_wal`]): once a second at most.
    pub(super) wal_restarted_at: Option<std::time::Instant>,
}

impl Engine for SqliteWriter {
    const COMMITS_HERE: bool = true;
    const SPLITS_MIXED: bool = false;

    /// Past the storage limit, the commands that add data are answered
    /// storage-full without running (nothing of them is written); those
    /// that only delete (resets) still run, in queue order, so that room
    /// can be made, and so do retries of keyed writes whose key is stored,
    /// which replay their answer and write nothing. A refused check that
    /// could not be counted anyway (an unknown budget, a day out of its
    /// window) hears that instead: no retry would get it past.
    async fn apply(&mut self, batch: &mut [Queued]) -> txn::Applied {
        let adding = batch.iter().filter(|q| adds_data(&q.command)).count();
        let mut admitted = self.space.admit(adding);
        if admitted.is_err() && self.cut_back_wal().await {
            admitted = self.space.admit(adding);
        }
        let Err(over) = admitted else {
            return txn::apply_batch(&mut self.conn, batch).await;
        };
        let refusal = Error::StorageFull(Arc::new(sqlx::Error::Io(space::refusal(over))));
        // A command whose key is stored writes nothing: it is answered
        // with the stored result (or as a reused key), as at any time.
        let stored = stored_keys(&mut self.conn, batch).await;
        let refused = |q: &Queued| {
            adds_data(&q.command) && !q.key.as_ref().is_some_and(|k| stored.contains(k.as_str()))
        };
        // Stable: the commands that run keep their order.
        batch.sort_by_key(refused);
        let runs = batch.iter().filter(|q| !refused(q)).count();
        let own = check_refusals(&mut self.conn, &batch[runs..]).await;
        for (q, own) in batch[runs..].iter_mut().zip(own) {
            q.command.refuse(own.unwrap_or_else(|| refusal.clone()));
        }
        match runs {
            0 => Ok(()),
            _ => txn::apply_batch(&mut self.conn, &mut batch[..runs]).await,
        }
    }

    fn check(&mut self) -> Result<(), Lost> {
        self.files.check()
    }

    async fn forget_expired_keys(&mut self, ttl: Duration) -> Result<u64, Error> {
        keys::forget_expired(&mut self.conn, ttl).await
    }

    async fn prune_more(
        &mut self,
        budget: &str,
        after: &mut Option<budgets::RowKey>,
    ) -> Result<(u64, bool), Error> {
        budgets::prune_more(&mut self.conn, budget, after).await
    }

    async fn orphaned_usage(&mut self) -> Result<Vec<String>, Error> {
        self.conn.orphaned_usage().await
    }

    async fn now(&mut self) -> Result<jiff::Timestamp, Error> {
        self.conn.now().await
    }

    async fn clock_hold(&mut self) -> Result<Option<KeptHold>, Error> {
        self.conn.clock_hold().await
    }

    async fn keep_clock_hold(&mut self, hold: &KeptHold) -> Result<(), Error> {
        self.conn.keep_clock_hold(hold).await
    }

    /// Checkpoints (unless Litestream owns that) and closes the database.
    /// Every accepted command has been answered by now and every commit is
    /// in the WAL, which the next open replays: a failure here (a full disk
    /// cannot take the checkpointed pages) loses nothing, so it is logged,
    /// and the writer's end is still a clean one. Under Litestream a
    /// non-zero exit would skip its final sync, exactly when it matters.
    async fn close(mut self) {
        if self.checkpoint_on_close {
            // A reader outside tally (an operator's `sqlite3` session) holds
            // a checkpoint up for the busy timeout: a second, not the 5 s
            // writes wait, so that the stop stays well within
            // `TALLY_WRITER_DRAIN_TIMEOUT`. What is left is checkpointed at
            // the next start.
            let _ = sqlx::raw_sql("PRAGMA busy_timeout = 1000")
                .execute(&mut self.conn)
                .await;
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

impl SqliteWriter {
    /// Refused for the storage limit with a WAL file far larger than it is
    /// cut back to (4 MiB, `journal_size_limit`): SQLite keeps the file at
    /// its largest until a write of tally's starts it over, which the
    /// refused writes never do. Without Litestream, tally's checkpoint
    /// (PASSIVE: it waits for nobody) takes the WAL in, and only if it took
    /// in every frame (no reader outside tally holds a snapshot in it) one
    /// write of the database's header, as small as a write gets (its
    /// `user_version`, unchanged), starts the WAL over, cut back. A reader
    /// still there costs nothing: no write is made while it holds the WAL.
    /// Under Litestream, whose own write starts the WAL over, tally neither
    /// checkpoints nor writes here; what the file takes past its frames
    /// counts as room instead ([`space::Space::admit`]). At most once a
    /// second. Whether it tried.
    async fn cut_back_wal(&mut self) -> bool {
        let now = std::time::Instant::now();
        let due = self
            .wal_restarted_at
            .is_none_or(|at| now.duration_since(at) >= std::time::Duration::from_secs(1));
        if !self.checkpoint_on_close || !due || !self.space.wal_oversized() {
            return false;
        }
        self.wal_restarted_at = Some(now);
        let cut = async {
            let (busy, frames, taken_in): (i64, i64, i64) =
                sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
                    .fetch_one(&mut self.conn)
                    .await?;
            if busy != 0 || taken_in < frames {
                return Ok(false);
            }
            let version: i64 = sqlx::query_scalar("PRAGMA user_version")
                .fetch_one(&mut self.conn)
                .await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "PRAGMA user_version = {version}"
            )))
            .execute(&mut self.conn)
            .await?;
            Ok::<_, sqlx::Error>(true)
        }
        .await;
        match cut {
            Ok(true) if !self.space.wal_oversized() => tracing::info!(
                "the WAL was cut back to 4 MiB: its room counts towards the storage limit again"
            ),
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "could not start the WAL over to cut it back"),
        }
        true
    }
}

/// Whether a command can add data to the database: the storage limit
/// refuses these. A reset only deletes; so does any command not named
/// here, which the limit lets through (a new command that adds data
/// belongs here).
fn adds_data(command: &Command) -> bool {
    matches!(
        command,
        Command::Increment { .. } | Command::PutBudget { .. } | Command::Check { .. }
    )
}

/// Each refused command's own refusal, if it is a check that has one
/// ([`budgets::refusals`]: an unknown budget, a day out of its window);
/// `None` for the rest, and for all when they cannot be read. Looked up
/// before the batch's other commands run: a check queued after a delete of
/// its budget hears the storage refusal, not `404`.
async fn check_refusals(conn: &mut SqliteConnection, refused: &[Queued]) -> Vec<Option<Error>> {
    let mut own: Vec<Option<Error>> = refused.iter().map(|_| None).collect();
    let checks: Vec<(usize, budgets::CheckItem<'_>)> = refused
        .iter()
        .enumerate()
        .filter_map(|(i, q)| Some((i, q.command.check_item()?)))
        .collect();
    if checks.is_empty() {
        return own;
    }
    let Ok(now) = conn.now().await else {
        return own;
    };
    let items: Vec<budgets::CheckItem<'_>> = checks.iter().map(|(_, item)| *item).collect();
    if let Ok(found) = budgets::refusals(conn, &items, now).await {
        for ((i, _), found) in checks.iter().zip(found) {
            own[*i] = found;
        }
    }
    own
}

/// The keys of `batch`'s commands that add data which are stored already.
/// A key that cannot be read counts as not stored: its command is refused.
async fn stored_keys(conn: &mut SqliteConnection, batch: &[Queued]) -> HashSet<String> {
    let mut stored = HashSet::new();
    for key in batch
        .iter()
        .filter(|q| adds_data(&q.command))
        .filter_map(|q| q.key.as_ref())
    {
        let found = sqlx::query_scalar::<_, i64>("SELECT 1 FROM idempotency_keys WHERE key = ?1")
            .bind(key.as_str())
            .fetch_optional(&mut *conn)
            .await;
        if let Ok(Some(_)) = found {
            stored.insert(key.as_str().to_owned());
        }
    }
    stored
}
