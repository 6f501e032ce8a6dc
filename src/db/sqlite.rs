//! The SQLite engine's statements: the writer's ([`Store`] for its one
//! connection) and the readers'. Lists go in as one JSON parameter read by
//! `json_each`, so a batch of any size is one statement, one round trip to
//! the connection's thread.
//!
//! There is one writable connection in the process and its transactions
//! are `BEGIN IMMEDIATE`: nothing else can write between two statements, so
//! [`Store::lock_days`] has nothing to do.

use std::time::Duration;

use jiff::Timestamp;
use sqlx::{Connection, Executor, Sqlite, SqliteConnection, SqlitePool};

use super::{
    Error,
    files::DbFiles,
    keys,
    reads::{BoxFuture, Reads},
    store::{BudgetRow, Store, StoredKey, UsageRow},
    to_json, txn,
    writer::{Engine, Lost},
};
use crate::meter::BudgetSpec;

/// SQLite's primary result code for a full disk (`SQLITE_FULL`). SQLite
/// reports every failed `write()` with `ENOSPC` this way.
const SQLITE_FULL: i32 = 13;

/// What a SQLite error means: a full disk is told apart (nothing was
/// written, and the same write succeeds once space is freed); the rest is
/// [`Error::from_sqlx`]'s.
pub(super) fn error(e: sqlx::Error) -> Error {
    match is_storage_full(&e) {
        true => Error::StorageFull(std::sync::Arc::new(e)),
        false => Error::from_sqlx(e),
    }
}

/// Whether `e` says the disk is full. SQLite hands out extended result
/// codes, whose low byte is the primary code. An fsync or truncate that
/// fails with `ENOSPC` is an `SQLITE_IOERR_*` carrying no errno through
/// sqlx, so it stays an [`Error::Database`]: it cannot be told from a
/// failing disk.
fn is_storage_full(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|c| c.parse::<i32>().ok())
            .is_some_and(|c| c & 0xff == SQLITE_FULL),
        sqlx::Error::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
        ),
        _ => false,
    }
}

/// Adds every `(name, total)` of the JSON object `?1` (creating counters at
/// 0) and returns each counter's new value. An overflowing sum makes SQLite
/// produce a REAL, which the STRICT table refuses ([`is_overflow`]): the
/// statement then changes nothing.
macro_rules! upsert_counters {
    () => {
        "INSERT INTO counters (name, value)
         SELECT key, value FROM json_each(?1) WHERE true
         ON CONFLICT (name) DO UPDATE SET value = value + excluded.value
         RETURNING name, value;"
    };
}

/// SQLITE_CONSTRAINT_DATATYPE: a STRICT column refused a value, which for
/// `counters.value` means the sum left the 64-bit integers.
fn is_overflow(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "3091")
}

/// The `(name, total)` pairs (names distinct) as the JSON object `json_each`
/// reads, written straight from the slice: no map built on the hot path.
fn totals_json(totals: &[(&str, i64)]) -> String {
    struct AsObject<'a>(&'a [(&'a str, i64)]);
    impl serde::Serialize for AsObject<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
        }
    }
    to_json(&AsObject(totals))
}

/// The SQLite writer: the process's one writable connection, and the
/// files it must still find at the database's path.
pub(super) struct SqliteWriter {
    pub conn: SqliteConnection,
    /// The database's files as opened, to notice them being deleted.
    pub files: DbFiles,
    /// Checkpoint and truncate the WAL when the queue is drained. Off when
    /// another process (Litestream) owns checkpointing.
    pub checkpoint_on_close: bool,
}

impl Engine for SqliteWriter {
    async fn apply(&mut self, batch: &mut [super::command::Queued]) -> txn::Applied {
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

impl Store for SqliteConnection {
    const BEGIN: &'static str = "BEGIN IMMEDIATE";

    /// This process's clock: it is the database's only writer.
    async fn now(&mut self) -> Result<Timestamp, Error> {
        Ok(Timestamp::now())
    }

    async fn exec(&mut self, sql: &'static str) -> Result<(), Error> {
        sqlx::raw_sql(sql).execute(self).await.map_err(error)?;
        Ok(())
    }

    async fn upsert_counters(
        &mut self,
        totals: &[(&str, i64)],
    ) -> Result<Option<Vec<(String, i64)>>, Error> {
        let rows = sqlx::query_as(upsert_counters!())
            .bind(totals_json(totals))
            .fetch_all(self)
            .await;
        match rows {
            Ok(rows) => Ok(Some(rows)),
            Err(e) if is_overflow(&e) => Ok(None),
            Err(e) => Err(error(e)),
        }
    }

    /// `BEGIN`, the upsert and `COMMIT` as one script: the hottest batch in
    /// one round trip. On overflow the script stops before `COMMIT`, and
    /// the open transaction is rolled back here.
    async fn upsert_counters_committed(
        &mut self,
        totals: &[(&str, i64)],
    ) -> Result<Option<Vec<(String, i64)>>, Error> {
        let rows = sqlx::query_as(concat!("BEGIN IMMEDIATE;", upsert_counters!(), "COMMIT;"))
            .bind(totals_json(totals))
            .fetch_all(&mut *self)
            .await;
        match rows {
            Ok(rows) => Ok(Some(rows)),
            Err(e) if is_overflow(&e) => {
                self.exec("ROLLBACK").await?;
                Ok(None)
            }
            Err(e) => Err(error(e)),
        }
    }

    async fn put_budget(&mut self, name: &str, spec: &BudgetSpec) -> Result<(), Error> {
        sqlx::query(
            "INSERT INTO budgets (name, visitor_limit, global_limit, retention_days, timezone, updated_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (name) DO UPDATE SET
                 visitor_limit = excluded.visitor_limit,
                 global_limit = excluded.global_limit,
                 retention_days = excluded.retention_days,
                 timezone = excluded.timezone,
                 updated_at = excluded.updated_at",
        )
        .bind(name)
        .bind(spec.visitor_limit)
        .bind(spec.global_limit)
        .bind(spec.retention_days)
        .bind(&spec.timezone_name)
        .bind(Timestamp::now().to_string())
        .execute(self)
        .await.map_err(error)?;
        Ok(())
    }

    async fn load_budgets(&mut self, names: &[&str]) -> Result<Vec<BudgetRow>, Error> {
        load_budgets(self, names).await
    }

    async fn lock_days(&mut self, _days: &[(&str, &str)]) -> Result<(), Error> {
        Ok(())
    }

    async fn read_usage(
        &mut self,
        visitors: &[(&str, &str, &str)],
        globals: &[(&str, &str)],
    ) -> Result<Vec<UsageRow>, Error> {
        // Both kinds of rows in one statement. Tuples serialize as the JSON
        // arrays `->> 0`, `->> 1` read; a global row has no visitor.
        sqlx::query_as(
            "SELECT u.budget, u.day, u.visitor, u.calls
             FROM json_each(?1) AS k
             JOIN budget_visitor_usage AS u
               ON u.budget = k.value ->> 0 AND u.day = k.value ->> 1 AND u.visitor = k.value ->> 2
             UNION ALL
             SELECT g.budget, g.day, NULL, g.calls
             FROM json_each(?2) AS k
             JOIN budget_global_usage AS g
               ON g.budget = k.value ->> 0 AND g.day = k.value ->> 1",
        )
        .bind(to_json(visitors))
        .bind(to_json(globals))
        .fetch_all(self)
        .await
        .map_err(error)
    }

    /// Both write-backs as one script, one round trip.
    async fn write_usage(
        &mut self,
        visitors: &[(&str, &str, &str, i64)],
        globals: &[(&str, &str, i64)],
    ) -> Result<(), Error> {
        sqlx::query(
            "INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
             SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3 FROM json_each(?1) WHERE true
             ON CONFLICT (budget, day, visitor) DO UPDATE SET calls = excluded.calls;
             INSERT INTO budget_global_usage (budget, day, calls)
             SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?2) WHERE true
             ON CONFLICT (budget, day) DO UPDATE SET calls = excluded.calls;",
        )
        .bind(to_json(visitors))
        .bind(to_json(globals))
        .execute(self)
        .await
        .map_err(error)?;
        Ok(())
    }

    async fn prune(&mut self, budget: &str, before: &str) -> Result<u64, Error> {
        let deleted = sqlx::query(
            "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day < ?2;
             DELETE FROM budget_global_usage WHERE budget = ?1 AND day < ?2;",
        )
        .bind(budget)
        .bind(before)
        .execute(self)
        .await
        .map_err(error)?;
        Ok(deleted.rows_affected())
    }

    async fn delete_usage(
        &mut self,
        budget: &str,
        day: &str,
        visitor: Option<&str>,
    ) -> Result<u64, Error> {
        let sql = match visitor {
            Some(_) => {
                "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day = ?2 AND visitor = ?3"
            }
            None => {
                "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day = ?2;
                 DELETE FROM budget_global_usage WHERE budget = ?1 AND day = ?2;"
            }
        };
        let mut q = sqlx::query(sql).bind(budget).bind(day);
        if let Some(v) = visitor {
            q = q.bind(v);
        }
        Ok(q.execute(self).await.map_err(error)?.rows_affected())
    }

    /// A lookup: the one writer serialises every write, so an absent key
    /// stays absent until this transaction stores it.
    async fn claim_key(
        &mut self,
        key: &str,
        _fingerprint: &str,
    ) -> Result<Option<StoredKey>, Error> {
        let q = sqlx::query_as("SELECT fingerprint, result FROM idempotency_keys WHERE key = ?1");
        q.bind(key).fetch_optional(self).await.map_err(error)
    }

    async fn remember_key(
        &mut self,
        key: &str,
        fingerprint: &str,
        result: &str,
    ) -> Result<(), Error> {
        sqlx::query(
            "INSERT INTO idempotency_keys (key, fingerprint, result, created_at)
             VALUES (?1, ?2, ?3, ?4)",
        )
        .bind(key)
        .bind(fingerprint)
        .bind(result)
        .bind(keys::unix_now())
        .execute(self)
        .await
        .map_err(error)?;
        Ok(())
    }

    async fn forget_keys_older_than(&mut self, age: Duration) -> Result<u64, Error> {
        let cutoff = keys::unix_now() - i64::try_from(age.as_secs()).unwrap_or(i64::MAX);
        Ok(
            sqlx::query("DELETE FROM idempotency_keys WHERE created_at < ?1")
                .bind(cutoff)
                .execute(self)
                .await
                .map_err(error)?
                .rows_affected(),
        )
    }
}

/// The named budgets that exist, in one statement.
pub async fn load_budgets<'c>(
    db: impl Executor<'c, Database = Sqlite>,
    names: &[&str],
) -> Result<Vec<BudgetRow>, Error> {
    sqlx::query_as(
        "SELECT name, visitor_limit, global_limit, retention_days, timezone
         FROM budgets WHERE name IN (SELECT value FROM json_each(?1))",
    )
    .bind(to_json(names))
    .fetch_all(db)
    .await
    .map_err(error)
}

/// The current values of many counters in one statement; names never
/// written are absent.
pub async fn read_counters(pool: &SqlitePool, names: &[&str]) -> Result<Vec<(String, i64)>, Error> {
    sqlx::query_as(
        "SELECT name, value FROM counters
         WHERE name IN (SELECT value FROM json_each(?1))",
    )
    .bind(to_json(&names))
    .fetch_all(pool)
    .await
    .map_err(error)
}

/// A day's global calls of a budget and, if asked, one visitor's, in one
/// statement (one snapshot); absent rows read as 0.
pub async fn usage_counts(
    pool: &SqlitePool,
    budget: &str,
    day: &str,
    visitor: Option<&str>,
) -> Result<(i64, Option<i64>), Error> {
    sqlx::query_as(
        "SELECT
           coalesce((SELECT calls FROM budget_global_usage WHERE budget = ?1 AND day = ?2), 0),
           CASE WHEN ?3 IS NOT NULL THEN coalesce((SELECT calls FROM budget_visitor_usage
             WHERE budget = ?1 AND day = ?2 AND visitor = ?3), 0) END",
    )
    .bind(budget)
    .bind(day)
    .bind(visitor)
    .fetch_one(pool)
    .await
    .map_err(error)
}

/// The read-only pool: connections opened read-only *and* with
/// `query_only`.
pub(super) struct SqliteReaders(pub SqlitePool);

impl Reads for SqliteReaders {
    fn counters<'a>(
        &'a self,
        names: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, Error>> {
        Box::pin(read_counters(&self.0, names))
    }

    /// This process's clock: it is the database's only writer.
    fn budgets_and_now<'a>(
        &'a self,
        names: &'a [&'a str],
    ) -> BoxFuture<'a, Result<(Vec<BudgetRow>, Timestamp), Error>> {
        Box::pin(async move { Ok((load_budgets(&self.0, names).await?, Timestamp::now())) })
    }

    fn usage_counts<'a>(
        &'a self,
        budget: &'a str,
        day: &'a str,
        visitor: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(i64, Option<i64>), Error>> {
        Box::pin(usage_counts(&self.0, budget, day, visitor))
    }

    fn size_and_idle(&self) -> (u32, usize) {
        (self.0.size(), self.0.num_idle())
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.0.close())
    }
}
