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

use sqlx::{ConnectOptions, Connection, sqlite::SqliteConnectOptions};

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
/// database without the table has none.
pub async fn find(db: &Path, target: &str) -> Result<Option<Restored>, sqlx::Error> {
    let mut conn = SqliteConnectOptions::new()
        .filename(db)
        .read_only(true)
        .connect()
        .await?;
    let exists: Option<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'point_in_time_restores'",
    )
    .fetch_optional(&mut conn)
    .await?;
    if exists.is_none() {
        conn.close().await?;
        return Ok(None);
    }
    let row: Option<(String, String, String)> = sqlx::query_as(
        "SELECT target, txid, restored_at FROM point_in_time_restores WHERE target = ?",
    )
    .bind(target)
    .fetch_optional(&mut conn)
    .await?;
    conn.close().await?;
    Ok(row.map(|(target, txid, restored_at)| Restored {
        target,
        txid,
        restored_at,
    }))
}

/// Records `restored` in the database at `db`. Closing the connection
/// checkpoints the write into the database file, so Litestream finds one
/// file, as a restore leaves it.
pub async fn record(db: &Path, restored: &Restored) -> Result<(), sqlx::Error> {
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
    conn.close().await
}
