//! The SQLite engine's statements: the writer's ([`Store`]) and the
//! readers'.

use jiff::Timestamp;
use sqlx::{Executor, Sqlite, SqliteConnection, SqlitePool};

use super::error;
use crate::db::{
    Error, keys,
    list::KeyRange,
    store::{BudgetRow, Store, StoredKey, UsageRow},
    to_json,
};
use crate::meter::BudgetSpec;

/// Adds every `(name, total)` of the JSON object `?1` (creating counters at
/// 0) and returns each counter's new value. An overflowing sum makes SQLite
/// produce a REAL, which the STRICT table refuses ([`is_overflow`]): the
/// statement then changes nothing.
///
/// The new values come back as one row, a JSON array of `[name, value]`
/// pairs, rather than one row per name: sqlx hands each row over from its
/// database thread separately, and on a busy core each row cost the writer
/// a wake-up and two context switches.
macro_rules! upsert_counters {
    () => {
        "INSERT INTO counters (name, value)
         SELECT key, value FROM json_each(?1) WHERE true
         ON CONFLICT (name) DO UPDATE SET value = value + excluded.value;
         SELECT json_group_array(json_array(c.name, c.value))
         FROM json_each(?1) AS j JOIN counters AS c ON c.name = j.key;"
    };
}

/// A page of a table by name: `?1` the lower bound (compared with `$op`),
/// `?2` the upper (excluded; `$upper` empty for none), `?3` the most rows.
macro_rules! list_sql {
    ($columns:literal, $table:literal, $op:literal, $upper:literal) => {
        concat!(
            "SELECT ",
            $columns,
            " FROM ",
            $table,
            " WHERE name ",
            $op,
            " ?1",
            $upper,
            " ORDER BY name LIMIT ?3"
        )
    };
}

/// [`list_sql`] for `range`: the lower bound's comparison, and an upper
/// bound only if the range has one (a prefix's end).
macro_rules! list_sql_for {
    ($columns:literal, $table:literal, $range:expr) => {
        match ($range.inclusive, $range.below.is_some()) {
            (true, true) => list_sql!($columns, $table, ">=", " AND name < ?2"),
            (true, false) => list_sql!($columns, $table, ">=", ""),
            (false, true) => list_sql!($columns, $table, ">", " AND name < ?2"),
            (false, false) => list_sql!($columns, $table, ">", ""),
        }
    };
}

/// SQLITE_CONSTRAINT_DATATYPE: a STRICT column refused a value, which for
/// `counters.value` means the sum left the 64-bit integers.
fn is_overflow(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "3091")
}

/// The values of a statement that returns them as its one row of JSON
/// (the counter upsert's `[name, value]` pairs, say; see
/// [`upsert_counters`] for why one row).
fn the_one_row<T: serde::de::DeserializeOwned>(rows: Vec<String>, what: &str) -> Result<T, Error> {
    let [row] = <[String; 1]>::try_from(rows).map_err(|rows| {
        Error::Internal(format!("the {what} returned {} rows, not 1", rows.len()).into())
    })?;
    from_one_row(&row, what)
}

/// The values a statement returned as one row of JSON: a row tally cannot
/// read back is its own inconsistency.
fn from_one_row<T: serde::de::DeserializeOwned>(row: &str, what: &str) -> Result<T, Error> {
    serde_json::from_str(row)
        .map_err(|e| Error::Internal(format!("the {what}'s values: {e}").into()))
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

/// The one `(budget, day)` every usage row of a batch is on, if there is
/// one: the common batch, checks of one budget on its today. Its rows are
/// then read and written with the budget and the day bound once and only
/// the visitors carried as JSON, instead of three or four fields
/// extracted from every element: SQLite's own CPU per check over 1,000
/// visitors fell from about 4.6 us to 2.9.
fn one_day<'a>(
    visitors: impl IntoIterator<Item = (&'a str, &'a str)>,
    globals: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Option<(&'a str, &'a str)> {
    let mut globals = globals.into_iter();
    let global = globals.next();
    if globals.next().is_some() {
        // Two global rows (even of one key): the general statements, which
        // read and write each as given.
        return None;
    }
    let mut keys = global.into_iter().chain(visitors);
    let first = keys.next()?;
    keys.all(|k| k == first).then_some(first)
}

impl Store for SqliteConnection {
    const BEGIN: &'static str = "BEGIN IMMEDIATE";

    /// This process's clock: it is the database's only writer. A clock
    /// stepped out of what days can be counted in fails the batch (its
    /// checks denied), not the writer.
    async fn now(&mut self) -> Result<Timestamp, Error> {
        crate::db::clock::wall_clock().map_err(|e| {
            Error::Database(std::sync::Arc::new(sqlx::Error::Io(std::io::Error::other(
                e,
            ))))
        })
    }

    async fn exec(&mut self, sql: &'static str) -> Result<(), Error> {
        sqlx::raw_sql(sql).execute(self).await.map_err(error)?;
        Ok(())
    }

    async fn upsert_counters(
        &mut self,
        totals: &[(&str, i64)],
    ) -> Result<Option<Vec<(String, i64)>>, Error> {
        let rows = sqlx::query_scalar(upsert_counters!())
            .bind(totals_json(totals))
            .fetch_all(self)
            .await;
        match rows {
            Ok(rows) => Ok(Some(the_one_row(rows, "counter upsert")?)),
            Err(e) if is_overflow(&e) => Ok(None),
            Err(e) => Err(error(e)),
        }
    }

    /// `BEGIN`, the upsert and `COMMIT` as one script: the hottest batch in
    /// one round trip. On overflow the script stops before `COMMIT`, and
    /// the open transaction is rolled back here. (Nothing else writes the
    /// file: every `begin` is `BEGIN IMMEDIATE`.)
    async fn upsert_counters_committed(
        &mut self,
        totals: &[(&str, i64)],
        _begin: &'static str,
    ) -> Result<Option<Vec<(String, i64)>>, Error> {
        let rows = sqlx::query_scalar(concat!("BEGIN IMMEDIATE;", upsert_counters!(), "COMMIT;"))
            .bind(totals_json(totals))
            .fetch_all(&mut *self)
            .await;
        match rows {
            // The script's COMMIT has run: a result that cannot be read
            // back (a table rebuilt without STRICT under a running tally,
            // holding a REAL) leaves the batch committed, not failed.
            Ok(rows) => match the_one_row(rows, "counter upsert") {
                Ok(values) => Ok(Some(values)),
                Err(e) => {
                    tracing::error!(error = %e, "a batch of increments committed, but its values cannot be read back; its callers hear outcome-unknown");
                    Err(Error::OutcomeUnknown)
                }
            },
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
        .bind(self.now().await?.to_string())
        .execute(self)
        .await.map_err(error)?;
        Ok(())
    }

    async fn load_budgets(&mut self, names: &[&str]) -> Result<Vec<BudgetRow>, Error> {
        load_budgets(self, names).await
    }

    /// The writer's connection is the only one that writes: nothing to lock.
    async fn lock_budget(&mut self, name: &str) -> Result<Option<BudgetRow>, Error> {
        Ok(load_budgets(self, &[name]).await?.pop())
    }

    async fn lock_days(&mut self, _days: &[(&str, &str)]) -> Result<(), Error> {
        Ok(())
    }

    async fn read_usage(
        &mut self,
        visitors: &[(&str, &str, &str)],
        globals: &[(&str, &str)],
    ) -> Result<Vec<UsageRow>, Error> {
        let keys = visitors.iter().map(|(b, d, _)| (*b, *d));
        match one_day(keys, globals.iter().copied()) {
            Some((budget, day)) => {
                read_one_day(self, budget, day, visitors, !globals.is_empty()).await
            }
            None => read_any_days(self, visitors, globals).await,
        }
    }

    /// Both write-backs as one script, one round trip.
    async fn write_usage(
        &mut self,
        visitors: &[(&str, &str, &str, i64)],
        globals: &[(&str, &str, i64)],
    ) -> Result<(), Error> {
        let keys = visitors.iter().map(|(b, d, _, _)| (*b, *d));
        match one_day(keys, globals.iter().map(|(b, d, _)| (*b, *d))) {
            Some((budget, day)) => {
                let global = globals.first().map(|(_, _, c)| *c);
                write_one_day(self, budget, day, visitors, global).await
            }
            None => write_any_days(self, visitors, globals).await,
        }
    }

    /// From the first row whatever `after` says: a row SQLite deletes is
    /// gone from the index at once, so there is nothing to walk over.
    ///
    /// The row's day and visitor come in hexadecimal, for
    /// [`Self::delete_visitor_usage`] only: SQLite does not check that
    /// text is UTF-8, and a key stored by hand with `CAST(X'..' AS TEXT)`
    /// read as a `String` would fail every prune that reaches it, and with
    /// the prune every check of the budget; one read with its bad bytes
    /// replaced would no longer end the share where it is.
    async fn nth_visitor_row(
        &mut self,
        budget: &str,
        before: &str,
        _after: Option<(&str, &str)>,
        n: u64,
    ) -> Result<Option<(String, String)>, Error> {
        sqlx::query_as(
            "SELECT hex(day), hex(visitor) FROM budget_visitor_usage WHERE budget = ?1 AND day < ?2
             ORDER BY day, visitor LIMIT 1 OFFSET ?3",
        )
        .bind(budget)
        .bind(before)
        .bind(i64::try_from(n).unwrap_or(i64::MAX))
        .fetch_optional(self)
        .await
        .map_err(error)
    }

    /// Two ranges of the primary key when `through` is given (the days
    /// before its day, and its day up to its visitor): one condition
    /// joining them with `OR` would be searched as one range to the end of
    /// `through`'s day, all of whose rows it would read.
    async fn delete_visitor_usage(
        &mut self,
        budget: &str,
        before: &str,
        _after: Option<(&str, &str)>,
        through: Option<((&str, &str), u64)>,
        only_if_gone: bool,
    ) -> Result<u64, Error> {
        // `through` as [`Self::nth_visitor_row`] gives it, in hexadecimal.
        let (before, last, sql) = match through {
            Some(((day, visitor), _)) => (
                day,
                Some(visitor),
                "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day < CAST(unhex(?2) AS TEXT)
                 AND NOT (?3 AND EXISTS (SELECT 1 FROM budgets WHERE name = ?1))",
            ),
            None => (
                before,
                None,
                "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day < ?2
                 AND NOT (?3 AND EXISTS (SELECT 1 FROM budgets WHERE name = ?1))",
            ),
        };
        let mut deleted = sqlx::query(sql)
            .bind(budget)
            .bind(before)
            .bind(only_if_gone)
            .execute(&mut *self)
            .await
            .map_err(error)?
            .rows_affected();
        if let Some(visitor) = last {
            deleted += sqlx::query(
                "DELETE FROM budget_visitor_usage
                 WHERE budget = ?1 AND day = CAST(unhex(?2) AS TEXT)
                 AND visitor <= CAST(unhex(?3) AS TEXT)
                 AND NOT (?4 AND EXISTS (SELECT 1 FROM budgets WHERE name = ?1))",
            )
            .bind(budget)
            .bind(before)
            .bind(visitor)
            .bind(only_if_gone)
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected();
        }
        Ok(deleted)
    }

    async fn delete_days(&mut self, budget: &str, from: &str, before: &str) -> Result<u64, Error> {
        let mut deleted = 0;
        for sql in [
            "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day >= ?2 AND day < ?3",
            "DELETE FROM budget_global_usage WHERE budget = ?1 AND day >= ?2 AND day < ?3",
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
            "DELETE FROM budget_global_usage WHERE budget = ?1 AND day < ?2
             AND NOT (?3 AND EXISTS (SELECT 1 FROM budgets WHERE name = ?1))",
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
        let deleted = sqlx::query(
            "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day > ?2;
             DELETE FROM budget_global_usage WHERE budget = ?1 AND day > ?2;",
        )
        .bind(budget)
        .bind(after)
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

    async fn delete_budget(&mut self, name: &str) -> Result<bool, Error> {
        let deleted = sqlx::query("DELETE FROM budgets WHERE name = ?1")
            .bind(name)
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected();
        Ok(deleted > 0)
    }

    /// Names that are not UTF-8 (stored by hand, see
    /// [`Self::nth_visitor_row`]) are left out, with a warning: no budget
    /// has such a name, its usage cannot be deleted by it as text, and one
    /// of them would otherwise fail the search for every other.
    async fn orphaned_usage(&mut self) -> Result<Vec<String>, Error> {
        let names: Vec<Vec<u8>> = sqlx::query_scalar(crate::db::store::ORPHANED_USAGE)
            .fetch_all(self)
            .await
            .map_err(error)?;
        let found = names.len();
        let names: Vec<String> = (names.into_iter())
            .filter_map(|name| String::from_utf8(name).ok())
            .collect();
        if names.len() < found {
            tracing::warn!(
                budgets = found - names.len(),
                "usage stored under budget names that are not UTF-8 is left as it is; \
                 delete it by hand (the rows of budget_visitor_usage and budget_global_usage \
                 whose budget is not valid text)"
            );
        }
        Ok(names)
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
        let deleted = sqlx::query("DELETE FROM counters WHERE name = ?1")
            .bind(name)
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected();
        Ok(deleted > 0)
    }

    /// What is stored, read before the claims are inserted, as one row of
    /// JSON. As on PostgreSQL, though here the one writer serialises every
    /// write: no other transaction holds a key meanwhile, and nothing comes
    /// between the two statements.
    async fn claim_keys(
        &mut self,
        keys: &[(&str, &str)],
        not_before: i64,
    ) -> Result<Vec<Option<StoredKey>>, Error> {
        let rows = sqlx::query_scalar(
            "SELECT json_group_array(json_array(key, fingerprint, result))
             FROM idempotency_keys WHERE key IN (SELECT value ->> 0 FROM json_each(?1));
             INSERT INTO idempotency_keys (key, fingerprint, result, created_at)
             SELECT value ->> 0, value ->> 1, '', ?2 FROM json_each(?1) WHERE true
             ON CONFLICT (key) DO NOTHING;",
        )
        .bind(to_json(keys))
        .bind(keys::unix_now().max(not_before))
        .fetch_all(&mut *self)
        .await
        .map_err(error)?;
        let found: Vec<(String, String, String)> = the_one_row(rows, "key claim")?;
        let mut stored: std::collections::HashMap<String, StoredKey> = found
            .into_iter()
            .map(|(key, fingerprint, result)| {
                (
                    key,
                    StoredKey {
                        fingerprint,
                        result,
                    },
                )
            })
            .collect();
        Ok(keys.iter().map(|(key, _)| stored.remove(*key)).collect())
    }

    async fn remember_keys(&mut self, answers: &[(&str, String)]) -> Result<(), Error> {
        sqlx::query(
            "UPDATE idempotency_keys AS k SET result = j.value ->> 1
             FROM json_each(?1) AS j WHERE k.key = j.value ->> 0",
        )
        .bind(to_json(answers))
        .execute(self)
        .await
        .map_err(error)?;
        Ok(())
    }

    async fn unclaim_keys(&mut self, keys: &[&str]) -> Result<(), Error> {
        sqlx::query("DELETE FROM idempotency_keys WHERE key IN (SELECT value FROM json_each(?1))")
            .bind(to_json(keys))
            .execute(self)
            .await
            .map_err(error)?;
        Ok(())
    }

    async fn forget_keys_stored_before(&mut self, cutoff: i64) -> Result<u64, Error> {
        // A bounded share, found by the age index: the writer runs
        // the next one after its next batch (see `keys::FORGET_SHARE`).
        Ok(sqlx::query(
            "DELETE FROM idempotency_keys WHERE key IN
               (SELECT key FROM idempotency_keys WHERE created_at < ?1 LIMIT ?2)",
        )
        .bind(cutoff)
        .bind(keys::FORGET_SHARE as i64)
        .execute(self)
        .await
        .map_err(error)?
        .rows_affected())
    }
}

/// [`read_one_day`]'s statement: `?1` the budget, `?2` the day, `?3` the
/// visitors as a JSON array, `?4` whether to read the global row. CROSS
/// JOIN keeps the visitors as the outer loop, each one a lookup in the
/// primary key: left to itself the planner scanned the day's rows and
/// searched the JSON for each (measured over 1,000 visitors: 50 us of
/// SQLite's CPU a check, against 3).
const READ_ONE_DAY: &str = "SELECT
   CASE WHEN ?4 THEN (SELECT calls FROM budget_global_usage WHERE budget = ?1 AND day = ?2) END,
   (SELECT json_group_array(json_array(u.visitor, u.calls))
    FROM json_each(?3) AS k
    CROSS JOIN budget_visitor_usage AS u
      ON u.budget = ?1 AND u.day = ?2 AND u.visitor = k.value)";

/// [`Store::read_usage`] when every row is on one `(budget, day)`
/// ([`one_day`]): the visitors' rows as one JSON row of `[visitor, calls]`
/// pairs, and the global row (if asked) as a column of its own.
pub(crate) async fn read_one_day(
    conn: &mut SqliteConnection,
    budget: &str,
    day: &str,
    visitors: &[(&str, &str, &str)],
    global: bool,
) -> Result<Vec<UsageRow>, Error> {
    let names: Vec<&str> = visitors.iter().map(|(_, _, v)| *v).collect();
    let (global_calls, rows): (Option<i64>, String) = sqlx::query_as(READ_ONE_DAY)
        .bind(budget)
        .bind(day)
        .bind(to_json(&names))
        .bind(global)
        .fetch_one(conn)
        .await
        .map_err(error)?;
    let rows: Vec<(String, i64)> = from_one_row(&rows, "usage")?;
    let row = |visitor, calls| UsageRow {
        budget: budget.to_owned(),
        day: day.to_owned(),
        visitor,
        calls,
    };
    let mut usage: Vec<UsageRow> = rows.into_iter().map(|(v, c)| row(Some(v), c)).collect();
    usage.extend(global_calls.map(|c| row(None, c)));
    Ok(usage)
}

/// [`Store::read_usage`] for rows on any days: both kinds of rows in one
/// statement, each key carried as a JSON array.
pub(crate) async fn read_any_days(
    conn: &mut SqliteConnection,
    visitors: &[(&str, &str, &str)],
    globals: &[(&str, &str)],
) -> Result<Vec<UsageRow>, Error> {
    // Both kinds of rows in one statement, and as one row: a JSON array
    // of `[budget, day, visitor, calls]` (see `upsert_counters!` for
    // why one row). Tuples serialize as the JSON arrays `->> 0`, `->> 1`
    // read; a global row has no visitor.
    let rows: String = sqlx::query_scalar(
        "SELECT json_group_array(json_array(budget, day, visitor, calls))
         FROM (
           SELECT u.budget, u.day, u.visitor, u.calls
           FROM json_each(?1) AS k
           JOIN budget_visitor_usage AS u
             ON u.budget = k.value ->> 0 AND u.day = k.value ->> 1 AND u.visitor = k.value ->> 2
           UNION ALL
           SELECT g.budget, g.day, NULL, g.calls
           FROM json_each(?2) AS k
           JOIN budget_global_usage AS g
             ON g.budget = k.value ->> 0 AND g.day = k.value ->> 1
         )",
    )
    .bind(to_json(visitors))
    .bind(to_json(globals))
    .fetch_one(conn)
    .await
    .map_err(error)?;
    let rows: Vec<(String, String, Option<String>, i64)> = from_one_row(&rows, "usage")?;
    Ok(rows
        .into_iter()
        .map(|(budget, day, visitor, calls)| UsageRow {
            budget,
            day,
            visitor,
            calls,
        })
        .collect())
}

/// [`Store::write_usage`] when every row is on one `(budget, day)`
/// ([`one_day`]): the visitors' calls as one JSON object, the global row's
/// calls (if any) as a parameter of its own.
pub(crate) async fn write_one_day(
    conn: &mut SqliteConnection,
    budget: &str,
    day: &str,
    visitors: &[(&str, &str, &str, i64)],
    global: Option<i64>,
) -> Result<(), Error> {
    let calls: Vec<(&str, i64)> = visitors.iter().map(|(_, _, v, c)| (*v, *c)).collect();
    // `?4` NULL: no global row to write.
    sqlx::query(
        "INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
         SELECT ?1, ?2, key, value FROM json_each(?3) WHERE true
         ON CONFLICT (budget, day, visitor) DO UPDATE SET calls = excluded.calls;
         INSERT INTO budget_global_usage (budget, day, calls)
         SELECT ?1, ?2, ?4 WHERE ?4 IS NOT NULL
         ON CONFLICT (budget, day) DO UPDATE SET calls = excluded.calls;",
    )
    .bind(budget)
    .bind(day)
    .bind(totals_json(&calls))
    .bind(global)
    .execute(conn)
    .await
    .map_err(error)?;
    Ok(())
}

/// [`Store::write_usage`] for rows on any days: both write-backs as one
/// script, each row carried as a JSON array.
pub(crate) async fn write_any_days(
    conn: &mut SqliteConnection,
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
    .execute(conn)
    .await
    .map_err(error)?;
    Ok(())
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
/// statement (one snapshot); absent rows read as 0. `None` if the budget
/// does not exist (see [`crate::db::reads::Reads::usage_counts`]).
pub async fn usage_counts(
    pool: &SqlitePool,
    budget: &str,
    day: &str,
    visitor: Option<&str>,
) -> Result<Option<(i64, Option<i64>)>, Error> {
    let (global, visitor, exists): (i64, Option<i64>, bool) = sqlx::query_as(
        "SELECT
           coalesce((SELECT calls FROM budget_global_usage WHERE budget = ?1 AND day = ?2), 0),
           CASE WHEN ?3 IS NOT NULL THEN coalesce((SELECT calls FROM budget_visitor_usage
             WHERE budget = ?1 AND day = ?2 AND visitor = ?3), 0) END,
           EXISTS (SELECT 1 FROM budgets WHERE name = ?1)",
    )
    .bind(budget)
    .bind(day)
    .bind(visitor)
    .fetch_one(pool)
    .await
    .map_err(error)?;
    Ok(exists.then_some((global, visitor)))
}

/// Budgets whose names are in `range` (see `KeyRange`), by name: one range
/// scan of the primary key. Text compares byte by byte (`BINARY`).
pub async fn list_budgets(pool: &SqlitePool, range: &KeyRange) -> Result<Vec<BudgetRow>, Error> {
    let sql = list_sql_for!(
        "name, visitor_limit, global_limit, retention_days, timezone",
        "budgets",
        range
    );
    sqlx::query_as(sql)
        .bind(&range.from)
        .bind(&range.below)
        .bind(range.take)
        .fetch_all(pool)
        .await
        .map_err(error)
}

/// Counters whose names are in `range`, by name, as [`list_budgets`].
pub async fn list_counters(
    pool: &SqlitePool,
    range: &KeyRange,
) -> Result<Vec<(String, i64)>, Error> {
    sqlx::query_as(list_sql_for!("name, value", "counters", range))
        .bind(&range.from)
        .bind(&range.below)
        .bind(range.take)
        .fetch_all(pool)
        .await
        .map_err(error)
}

#[cfg(test)]
mod tests {
    use sqlx::Connection;

    use super::*;

    #[test]
    fn one_day_is_found_only_when_every_row_is_on_it() {
        let (a, b) = (("b0", "2026-03-01"), ("b0", "2026-03-02"));
        assert_eq!(one_day([a, a], [a]), Some(a));
        // Every check over its visitor limit: no global row.
        assert_eq!(one_day([a], []), Some(a));
        assert_eq!(one_day([], [a]), Some(a));
        assert_eq!(one_day([a, b], [a, b]), None);
        assert_eq!(one_day([a, b], [a]), None);
        assert_eq!(one_day([a], [b]), None);
        assert_eq!(one_day([a], [("b1", "2026-03-01")]), None);
        assert_eq!(one_day([a], [a, a]), None);
        assert_eq!(one_day([], []), None);
    }

    /// The plan the CROSS JOIN is there for: the visitors outside, each a
    /// lookup of the whole primary key.
    #[tokio::test]
    async fn one_day_read_looks_each_visitor_up() {
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        sqlx::migrate!("./migrations/sqlite")
            .run(&mut conn)
            .await
            .unwrap();
        let plan: Vec<(i64, i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "EXPLAIN QUERY PLAN {READ_ONE_DAY}"
        )))
        .bind("b")
        .bind("2026-03-01")
        .bind("[]")
        .bind(true)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let steps: Vec<&str> = plan.iter().map(|(.., s)| s.as_str()).collect();
        let at = |what: &str| steps.iter().position(|s| s.starts_with(what));
        let (scan, search) = (
            at("SCAN k"),
            at("SEARCH u USING PRIMARY KEY (budget=? AND day=? AND visitor=?)"),
        );
        assert!(
            scan.is_some() && search.is_some() && scan < search,
            "{steps:?}"
        );
    }
}
