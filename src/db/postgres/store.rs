//! The PostgreSQL engine's statements inside the writer's transaction
//! ([`Store`]): arrays through `unnest`, rows locked in byte order.

use std::collections::{HashMap, HashSet};

use super::*;

/// SQLSTATE 22003, numeric_value_out_of_range: a counter left `bigint`.
fn is_overflow(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "22003")
}

/// Columns of a list of tuples, as arrays for `unnest`.
fn column<T, U>(rows: &[T], f: impl Fn(&T) -> U) -> Vec<U> {
    rows.iter().map(f).collect()
}

impl Store for PgConnection {
    const BEGIN: &'static str = "BEGIN";

    /// A row lock is waited for 250 ms at most: past that the batch runs
    /// again command by command, where only the commands on the busy row
    /// wait for it (up to the configured lock timeout). Batches of other
    /// tally processes hold their rows for milliseconds.
    /// 20 ms: a row another tally process holds for its batch is had in
    /// time; one an outside session holds fails fast, so a batch meeting
    /// many held rows stays far within its deadline.
    const AFTER_BUSY: Option<&'static str> = Some("SET LOCAL lock_timeout = '20ms'");

    const BEGIN_SET_BASED: &'static str = "BEGIN; SET LOCAL lock_timeout = '250ms'";

    const BEGIN_PROBE: &'static str = "BEGIN; SET LOCAL lock_timeout = '20ms'";

    /// The server's clock, at the transaction's start: the same for every
    /// process, however far their own clocks drift.
    async fn now(&mut self) -> Result<Timestamp, Error> {
        let micros: i64 = sqlx::query_scalar(concat!("SELECT ", now_micros!()))
            .fetch_one(self)
            .await
            .map_err(error)?;
        timestamp(micros)
    }

    async fn clock_if_now_lags(&mut self) -> Result<Option<Timestamp>, Error> {
        let micros: i64 =
            sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8")
                .fetch_one(self)
                .await
                .map_err(error)?;
        timestamp(micros).map(Some)
    }

    async fn exec(&mut self, sql: &'static str) -> Result<(), Error> {
        if sql == "COMMIT" {
            // Outside a batch (no flag to set) nothing asks.
            let _ = COMMIT_SENT.try_with(|sent| sent.store(true, Ordering::Relaxed));
        }
        sqlx::raw_sql(sql).execute(self).await.map_err(error)?;
        Ok(())
    }

    async fn upsert_counters(
        &mut self,
        totals: &[(&str, i64)],
    ) -> Result<Option<Vec<(String, i64)>>, Error> {
        let rows = sqlx::query_as(
            "INSERT INTO counters AS c (name, value)
             SELECT name, value FROM unnest($1::text[], $2::int8[]) AS t (name, value)
             ORDER BY name COLLATE \"C\"
             ON CONFLICT (name) DO UPDATE SET value = c.value + excluded.value
             RETURNING name, value",
        )
        .bind(column(totals, |t| t.0))
        .bind(column(totals, |t| t.1))
        .fetch_all(self)
        .await;
        match rows {
            Ok(rows) => Ok(Some(rows)),
            Err(e) if is_overflow(&e) => Ok(None),
            Err(e) => Err(error(e)),
        }
    }

    async fn put_budget(&mut self, name: &str, spec: &BudgetSpec) -> Result<(), Error> {
        sqlx::query(
            "INSERT INTO budgets (name, visitor_limit, global_limit, retention_days, timezone, updated_at)
             VALUES ($1, $2, $3, $4, $5,
                     to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'))
             ON CONFLICT (name) DO UPDATE SET
                 visitor_limit = excluded.visitor_limit,
                 global_limit = excluded.global_limit,
                 retention_days = excluded.retention_days,
                 timezone = excluded.timezone,
                 updated_at = excluded.updated_at",
        )
        .bind(name)
        .bind(i64::from(spec.visitor_limit))
        .bind(i64::from(spec.global_limit))
        .bind(i64::from(spec.retention_days))
        .bind(&spec.timezone_name)
        .execute(self)
        .await.map_err(error)?;
        Ok(())
    }

    /// With a share lock on each budget until COMMIT: a check decides with
    /// the limits that hold when it commits. A `PUT` committed on another
    /// process while this one waited for a day's lock is seen (the lock
    /// waits for it, then reads its row), and a later `PUT` waits for this
    /// transaction.
    async fn load_budgets(&mut self, names: &[&str]) -> Result<Vec<BudgetRow>, Error> {
        sqlx::query_as(
            "SELECT name, visitor_limit, global_limit, retention_days, timezone
             FROM budgets WHERE name = ANY($1) ORDER BY name COLLATE \"C\" FOR SHARE",
        )
        .bind(names)
        .fetch_all(self)
        .await
        .map_err(error)
    }

    async fn lock_budget(&mut self, name: &str) -> Result<Option<BudgetRow>, Error> {
        sqlx::query_as(
            "SELECT name, visitor_limit, global_limit, retention_days, timezone
             FROM budgets WHERE name = $1 FOR UPDATE",
        )
        .bind(name)
        .fetch_optional(self)
        .await
        .map_err(error)
    }

    /// Creates each day's global row if missing and locks it: the no-op
    /// update takes the row lock, in the order given (sorted by the
    /// caller), and a concurrent creator of the same row is waited for.
    async fn lock_days(&mut self, days: &[(&str, &str)]) -> Result<(), Error> {
        sqlx::query(
            "INSERT INTO budget_global_usage AS g (budget, day, calls)
             SELECT budget, day, 0 FROM unnest($1::text[], $2::text[]) AS t (budget, day)
             ORDER BY budget COLLATE \"C\", day COLLATE \"C\"
             ON CONFLICT (budget, day) DO UPDATE SET calls = g.calls",
        )
        .bind(column(days, |d| d.0))
        .bind(column(days, |d| d.1))
        .execute(self)
        .await
        .map_err(error)?;
        Ok(())
    }

    /// Planned anew for its arrays every time (an unnamed statement,
    /// never cached): a plan cached while the tables were small joins the
    /// keys against a sequential scan, and keeps doing so as they grow.
    async fn read_usage(
        &mut self,
        visitors: &[(&str, &str, &str)],
        globals: &[(&str, &str)],
    ) -> Result<Vec<UsageRow>, Error> {
        sqlx::query_as(
            "SELECT u.budget, u.day, u.visitor, u.calls
             FROM budget_visitor_usage AS u
             JOIN unnest($1::text[], $2::text[], $3::text[]) AS k (budget, day, visitor)
               ON u.budget = k.budget AND u.day = k.day AND u.visitor = k.visitor
             UNION ALL
             SELECT g.budget, g.day, NULL::text, g.calls
             FROM budget_global_usage AS g
             JOIN unnest($4::text[], $5::text[]) AS k (budget, day)
               ON g.budget = k.budget AND g.day = k.day",
        )
        .bind(column(visitors, |v| v.0))
        .bind(column(visitors, |v| v.1))
        .bind(column(visitors, |v| v.2))
        .bind(column(globals, |g| g.0))
        .bind(column(globals, |g| g.1))
        .persistent(false)
        .fetch_all(self)
        .await
        .map_err(error)
    }

    async fn write_usage(
        &mut self,
        visitors: &[(&str, &str, &str, i64)],
        globals: &[(&str, &str, i64)],
    ) -> Result<(), Error> {
        sqlx::query(
            "INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
             SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[])
             ON CONFLICT (budget, day, visitor) DO UPDATE SET calls = excluded.calls",
        )
        .bind(column(visitors, |v| v.0))
        .bind(column(visitors, |v| v.1))
        .bind(column(visitors, |v| v.2))
        .bind(column(visitors, |v| v.3))
        .execute(&mut *self)
        .await
        .map_err(error)?;
        if globals.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO budget_global_usage (budget, day, calls)
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])
             ON CONFLICT (budget, day) DO UPDATE SET calls = excluded.calls",
        )
        .bind(column(globals, |g| g.0))
        .bind(column(globals, |g| g.1))
        .bind(column(globals, |g| g.2))
        .execute(self)
        .await
        .map_err(error)?;
        Ok(())
    }

    /// From just after `after`: the rows earlier shares deleted stay in
    /// the index until no snapshot can see them (a long transaction
    /// elsewhere, `pg_dump`), and every share walking over them again
    /// would cost more than the last. A row comparison on the key's
    /// columns after `budget` is where the index scan starts (one that
    /// repeats `budget` starts at the budget's first entry: measured with
    /// a snapshot open over 200,000 deleted rows, 1,039 buffers against 54
    /// for the share's search).
    async fn nth_visitor_row(
        &mut self,
        budget: &str,
        before: &str,
        after: Option<(&str, &str)>,
        n: u64,
    ) -> Result<Option<(String, String)>, Error> {
        let (day, visitor) = after.unwrap_or(("", ""));
        sqlx::query_as(
            "SELECT day, visitor FROM budget_visitor_usage
             WHERE budget = $1 AND (day, visitor) > ($2, $3) AND day < $4
             ORDER BY day, visitor LIMIT 1 OFFSET $5",
        )
        .bind(budget)
        .bind(day)
        .bind(visitor)
        .bind(before)
        .bind(i64::try_from(n).unwrap_or(i64::MAX))
        .fetch_optional(self)
        .await
        .map_err(error)
    }

    async fn delete_visitor_usage(
        &mut self,
        budget: &str,
        before: &str,
        after: Option<(&str, &str)>,
        through: Option<((&str, &str), u64)>,
        only_if_gone: bool,
    ) -> Result<u64, Error> {
        let (day, visitor) = after.unwrap_or(("", ""));
        let query = match through {
            // The share's rows found as the rows after `after` in key
            // order, as many as `through` was counted to be, then deleted
            // by where they are stored. A row comparison as the scan's end
            // (`(day, visitor) <= ...`) does not stop the index scan early
            // and reads a heap page per row (measured: 250 ms a share,
            // against 24 ms, in a day of a million visitors); as a range
            // of the whole statement the planner cannot tell how few rows
            // it holds, and reads the table. `through` still bounds what
            // is deleted.
            Some(((last_day, last_visitor), rows)) => sqlx::query(
                "DELETE FROM budget_visitor_usage
                 WHERE ctid = ANY (ARRAY(
                     SELECT ctid FROM budget_visitor_usage
                     WHERE budget = $1 AND (day, visitor) > ($2, $3) AND day <= $4
                     ORDER BY day, visitor LIMIT $6))
                   AND budget = $1 AND (day, visitor) <= ($4, $5)
                   AND NOT ($7 AND EXISTS (SELECT 1 FROM budgets WHERE name = $1))",
            )
            .bind(budget)
            .bind(day)
            .bind(visitor)
            .bind(last_day)
            .bind(last_visitor)
            .bind(i64::try_from(rows).unwrap_or(i64::MAX)),
            None => sqlx::query(
                "DELETE FROM budget_visitor_usage
                 WHERE budget = $1 AND (day, visitor) > ($2, $3) AND day < $4
                   AND NOT ($5 AND EXISTS (SELECT 1 FROM budgets WHERE name = $1))",
            )
            .bind(budget)
            .bind(day)
            .bind(visitor)
            .bind(before),
        };
        Ok(query
            .bind(only_if_gone)
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected())
    }

    async fn delete_days(&mut self, budget: &str, from: &str, before: &str) -> Result<u64, Error> {
        let mut deleted = 0;
        for sql in [
            "DELETE FROM budget_visitor_usage WHERE budget = $1 AND day >= $2 AND day < $3",
            "DELETE FROM budget_global_usage WHERE budget = $1 AND day >= $2 AND day < $3",
        ] {
            deleted += sqlx::query(sql)
                .bind(budget)
                .bind(from)
                .bind(before)
                .execute(&mut *self)
                .await
                .map_err(error)?
                .rows_affected();
        }
        Ok(deleted)
    }

    async fn delete_global_usage(
        &mut self,
        budget: &str,
        before: &str,
        only_if_gone: bool,
    ) -> Result<u64, Error> {
        Ok(sqlx::query(
            "DELETE FROM budget_global_usage WHERE budget = $1 AND day < $2
             AND NOT ($3 AND EXISTS (SELECT 1 FROM budgets WHERE name = $1))",
        )
        .bind(budget)
        .bind(before)
        .bind(only_if_gone)
        .execute(self)
        .await
        .map_err(error)?
        .rows_affected())
    }

    async fn prune_after(&mut self, budget: &str, after: &str) -> Result<u64, Error> {
        let mut deleted = 0;
        for sql in [
            "DELETE FROM budget_visitor_usage WHERE budget = $1 AND day > $2",
            "DELETE FROM budget_global_usage WHERE budget = $1 AND day > $2",
        ] {
            let r = sqlx::query(sql)
                .bind(budget)
                .bind(after)
                .execute(&mut *self)
                .await
                .map_err(error)?;
            deleted += r.rows_affected();
        }
        Ok(deleted)
    }

    async fn delete_usage(
        &mut self,
        budget: &str,
        day: &str,
        visitor: Option<&str>,
    ) -> Result<u64, Error> {
        if let Some(v) = visitor {
            let r = sqlx::query(
                "DELETE FROM budget_visitor_usage WHERE budget = $1 AND day = $2 AND visitor = $3",
            )
            .bind(budget)
            .bind(day)
            .bind(v)
            .execute(self)
            .await
            .map_err(error)?;
            return Ok(r.rows_affected());
        }
        let visitors =
            sqlx::query("DELETE FROM budget_visitor_usage WHERE budget = $1 AND day = $2")
                .bind(budget)
                .bind(day)
                .execute(&mut *self)
                .await
                .map_err(error)?
                .rows_affected();
        // The day's lock may have created its global row at 0 calls: that
        // one held no usage, and is not counted as deleted.
        let globals: i64 = sqlx::query_scalar(
            "WITH d AS (DELETE FROM budget_global_usage WHERE budget = $1 AND day = $2 RETURNING calls)
             SELECT count(*) FROM d WHERE calls > 0",
        )
        .bind(budget)
        .bind(day)
        .fetch_one(self)
        .await.map_err(error)?;
        Ok(visitors + u64::try_from(globals).unwrap_or(0))
    }

    async fn delete_budget(&mut self, name: &str) -> Result<bool, Error> {
        let deleted = sqlx::query("DELETE FROM budgets WHERE name = $1")
            .bind(name)
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected();
        Ok(deleted > 0)
    }

    async fn orphaned_usage(&mut self) -> Result<Vec<String>, Error> {
        sqlx::query_scalar(crate::db::store::ORPHANED_USAGE)
            .fetch_all(self)
            .await
            .map_err(error)
    }

    async fn clock_hold(&mut self) -> Result<Option<crate::db::clock::KeptHold>, Error> {
        let row: Option<(i64, i64, i64)> = sqlx::query_as(crate::db::store::CLOCK_HOLD)
            .fetch_optional(self)
            .await
            .map_err(error)?;
        Ok(row.and_then(crate::db::store::kept_hold))
    }

    async fn keep_clock_hold(&mut self, hold: &crate::db::clock::KeptHold) -> Result<(), Error> {
        let sql = match hold.ends {
            Some(_) => crate::db::store::END_CLOCK_HOLD,
            None => crate::db::store::KEEP_CLOCK_HOLD,
        };
        let mut q = sqlx::query(sql)
            .bind(hold.stepped_to.as_microsecond())
            .bind(hold.expected.as_microsecond())
            .bind(hold.until.as_microsecond());
        if let Some(ends) = hold.ends {
            q = q.bind(ends.as_microsecond());
        }
        q.execute(self).await.map_err(error)?;
        Ok(())
    }

    async fn delete_counter(&mut self, name: &str) -> Result<bool, Error> {
        let deleted = sqlx::query("DELETE FROM counters WHERE name = $1")
            .bind(name)
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected();
        Ok(deleted > 0)
    }

    /// Inserts the key with an empty answer. If another transaction holds
    /// the same key uncommitted, the insert waits for it; if the key is
    /// there (committed, or claimed earlier in this transaction), nothing is
    /// inserted and its row is read instead.
    async fn claim_keys(
        &mut self,
        keys: &[(&str, &str)],
        not_before: i64,
    ) -> Result<Vec<Option<StoredKey>>, Error> {
        let claimed: Vec<String> = sqlx::query_scalar(
            "INSERT INTO idempotency_keys (key, fingerprint, result, created_at)
             SELECT key, fingerprint, '', greatest(extract(epoch FROM now())::int8, $3)
             FROM unnest($1::text[], $2::text[]) AS t (key, fingerprint)
             ORDER BY key COLLATE \"C\"
             ON CONFLICT (key) DO NOTHING
             RETURNING key",
        )
        .bind(column(keys, |k| k.0))
        .bind(column(keys, |k| k.1))
        .bind(not_before)
        .fetch_all(&mut *self)
        .await
        .map_err(error)?;
        let claimed: HashSet<&str> = claimed.iter().map(String::as_str).collect();
        let others: Vec<&str> = keys
            .iter()
            .map(|k| k.0)
            .filter(|k| !claimed.contains(k))
            .collect();
        let mut stored: HashMap<String, StoredKey> = HashMap::new();
        if !others.is_empty() {
            // A statement of its own: its snapshot sees the keys whose
            // claims the insert waited for, committed meanwhile.
            let rows: Vec<(String, String, String)> = sqlx::query_as(
                "SELECT key, fingerprint, result FROM idempotency_keys WHERE key = ANY($1)",
            )
            .bind(&others)
            .fetch_all(&mut *self)
            .await
            .map_err(error)?;
            stored.extend(rows.into_iter().map(|(key, fingerprint, result)| {
                (
                    key,
                    StoredKey {
                        fingerprint,
                        result,
                    },
                )
            }));
        }
        keys.iter()
            .map(|(key, _)| match claimed.contains(key) {
                true => Ok(None),
                // Gone between the two statements: forgotten as expired by
                // another process (keys may be kept for as little as a
                // second). A race lost, as a deadlock is: the batch runs
                // again, and this time claims the key.
                false => stored.remove(*key).map(Some).ok_or_else(|| {
                    Error::Raced(Arc::new(sqlx::Error::Protocol(
                        "an idempotency key was forgotten as expired while claimed".into(),
                    )))
                }),
            })
            .collect()
    }

    async fn remember_keys(&mut self, answers: &[(&str, String)]) -> Result<(), Error> {
        sqlx::query(
            "UPDATE idempotency_keys AS k SET result = t.result
             FROM unnest($1::text[], $2::text[]) AS t (key, result)
             WHERE k.key = t.key",
        )
        .bind(column(answers, |a| a.0))
        .bind(answers.iter().map(|a| a.1.as_str()).collect::<Vec<_>>())
        .execute(self)
        .await
        .map_err(error)?;
        Ok(())
    }

    async fn unclaim_keys(&mut self, keys: &[&str]) -> Result<(), Error> {
        sqlx::query("DELETE FROM idempotency_keys WHERE key = ANY($1)")
            .bind(keys)
            .execute(self)
            .await
            .map_err(error)?;
        Ok(())
    }

    /// By the server's clock: a process whose own clock runs a day ahead
    /// must not forget a key another process has just stored.
    async fn forget_keys_stored_before(&mut self, cutoff: i64) -> Result<u64, Error> {
        Ok(
            // A bounded share at a time, so that a backlog of millions
            // never runs into the statement timeout; the rest goes next
            // time (once a minute).
            sqlx::query(
                "DELETE FROM idempotency_keys WHERE key IN
                   (SELECT key FROM idempotency_keys WHERE created_at < $1 LIMIT 10000)",
            )
            .bind(cutoff)
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected(),
        )
    }
}
