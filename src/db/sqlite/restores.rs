//! The record of point-in-time restores, kept inside the database itself.
//!
//! `tally restore-to` writes a row here into the database it has just
//! restored, before Litestream replicates it. The row travels with the
//! database: every later restore of the latest state carries it, which is
//! how a restore to the same instant, asked for again by a value left set,
//! is told apart from the first one (see `crate::restore`). The table is
//! not part of the migrations: it is created by the first restore that
//! needs it, and the service never reads or writes it.

use std::path::Path;

use sqlx::{ConnectOptions, Connection, SqliteConnection, sqlite::SqliteConnectOptions};

/// One restore to a point in time, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The instant asked for, RFC 3339 in UTC.
    pub target: String,
    /// Litestream's transaction id the database was restored to.
    pub txid: String,
    /// When the restore ran, RFC 3339 in UTC.
    pub restored_at: String,
}

/// The restore to `target` recorded in the database at `db`, if any. A
/// database without the table has none. Instants are compared as
/// instants, not as text: a release that writes them otherwise (more
/// fractional digits, say) still finds a restore an earlier one recorded.
pub async fn find(db: &Path, target: jiff::Timestamp) -> Result<Option<Restored>, sqlx::Error> {
    let mut conn = SqliteConnectOptions::new()
        .filename(db)
        .read_only(true)
        .connect()
        .await?;
    let found = recorded(&mut conn, target).await;
    conn.close().await?;
    found
}

/// [`find`], on a connection already open to the database.
pub async fn recorded(
    conn: &mut SqliteConnection,
    target: jiff::Timestamp,
) -> Result<Option<Restored>, sqlx::Error> {
    let exists: Option<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'point_in_time_restores'",
    )
    .fetch_optional(&mut *conn)
    .await?;
    if exists.is_none() {
        return Ok(None);
    }
    let rows: Vec<(String, String, String)> =
        sqlx::query_as("SELECT target, txid, restored_at FROM point_in_time_restores")
            .fetch_all(&mut *conn)
            .await?;
    let row = rows
        .into_iter()
        .find(|(t, _, _)| t.parse::<jiff::Timestamp>().is_ok_and(|t| t == target));
    Ok(row.map(|(target, txid, restored_at)| Restored {
        target,
        txid,
        restored_at,
    }))
}

/// Records `restored` in the database at `db`, and checkpoints the write
/// into the database file, so that the file is whole on its own, as a
/// restore leaves it: one file to put in place, for Litestream to find.
/// An error unless it is: a checkpoint that cannot finish (out of room,
/// say) leaves part of the record only in the WAL, which SQLite's own
/// checkpoint on closing would fail silently to move, and a file without
/// its WAL is damaged. So is one Litestream left damaged, which the check
/// after the checkpoint finds too. (The caller checks that no WAL is left
/// beside the file before it moves it into place.)
pub async fn record(db: &Path, restored: &Restored) -> anyhow::Result<()> {
    let mut conn = SqliteConnectOptions::new().filename(db).connect().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS point_in_time_restores (
             target TEXT PRIMARY KEY NOT NULL,
             txid TEXT NOT NULL,
             restored_at TEXT NOT NULL
         )",
    )
    .execute(&mut conn)
    .await?;
    sqlx::query(
        "INSERT OR REPLACE INTO point_in_time_restores (target, txid, restored_at) VALUES (?, ?, ?)",
    )
    .bind(&restored.target)
    .bind(&restored.txid)
    .bind(&restored.restored_at)
    .execute(&mut conn)
    .await?;
    let (busy, _, _): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(TRUNCATE)")
        .fetch_one(&mut conn)
        .await?;
    if busy != 0 {
        anyhow::bail!("another connection kept the record from being checkpointed");
    }
    let check: Vec<String> = sqlx::query_scalar("PRAGMA quick_check(3)")
        .fetch_all(&mut conn)
        .await?;
    if check != ["ok"] {
        anyhow::bail!("the restored database is damaged: {}", check.join("; "));
    }
    conn.close().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record is found by its instant however the text spells it: with
    /// the digits another release writes, or none, it is the same restore.
    #[tokio::test]
    async fn a_restore_is_found_by_its_instant_not_its_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        // What a restore leaves: a database file (here an empty one).
        std::fs::File::create(&db).unwrap();
        let restored = Restored {
            target: "2026-05-01T10:04:00.500000000Z".to_owned(),
            txid: "0000000000000007".to_owned(),
            restored_at: "2026-05-01T11:00:00Z".to_owned(),
        };
        record(&db, &restored).await.unwrap();
        for same in ["2026-05-01T10:04:00.5Z", "2026-05-01T12:04:00.50+02:00"] {
            let found = find(&db, same.parse().unwrap()).await.unwrap();
            assert_eq!(found.as_ref(), Some(&restored), "{same}");
        }
        let other = find(&db, "2026-05-01T10:04:00Z".parse().unwrap()).await;
        assert_eq!(other.unwrap(), None);
    }
}
