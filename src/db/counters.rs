//! Counters in SQLite: one upsert adds a batch of increments, whether the
//! batch holds one command or hundreds, inside a transaction the writer
//! opened or as a whole transaction of its own.

use std::collections::HashMap;

use sqlx::{SqliteConnection, SqlitePool};

use super::{Error, to_json};
use crate::meter::{Name, Refusal};

/// Adds every `(name, total)` of the JSON object `?1` (creating counters at
/// 0) and returns each counter's new value. An overflowing sum makes SQLite
/// produce a REAL, which the STRICT table refuses
/// ([`is_overflow`]): the statement then changes nothing.
macro_rules! upsert_counters {
    () => {
        "INSERT INTO counters (name, value)
         SELECT key, value FROM json_each(?1) WHERE true
         ON CONFLICT (name) DO UPDATE SET value = value + excluded.value
         RETURNING name, value;"
    };
}

/// Adds `by` to one counter and returns its new value.
pub async fn increment(conn: &mut SqliteConnection, name: &Name, by: i64) -> Result<i64, Error> {
    match increment_many(conn, &[(name, by)]).await? {
        Some(values) => values.first().copied().ok_or_else(fewer_rows),
        None => Err(Refusal::Overflow(name.clone()).into()),
    }
}

/// Adds each `(name, by)` in order, inside the caller's transaction.
/// Increments of one name are summed into one row of the upsert; caller
/// `i` gets the value its increment would have produced had the batch run
/// one command at a time. `None` when a counter would overflow: which
/// caller overflows is for one-by-one application to tell.
pub async fn increment_many(
    conn: &mut SqliteConnection,
    items: &[(&Name, i64)],
) -> Result<Option<Vec<i64>>, Error> {
    let totals = totals(items);
    let rows = sqlx::query_as(upsert_counters!())
        .bind(to_json(&totals))
        .fetch_all(&mut *conn)
        .await;
    match rows {
        Ok(rows) => values_in_order(items, &totals, rows).map(Some),
        Err(e) if is_overflow(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// A whole transaction of increments in one round trip to SQLite: `BEGIN`,
/// the upsert and `COMMIT` go as one script. On overflow the script stops
/// before `COMMIT`: the open transaction is rolled back here and the
/// answer is `None`. On any other error the caller rolls back (the
/// transaction may still be open) and must treat the batch as failed.
pub async fn increment_many_committed(
    conn: &mut SqliteConnection,
    items: &[(&Name, i64)],
) -> Result<Option<Vec<i64>>, Error> {
    let totals = totals(items);
    let rows = sqlx::query_as(concat!("BEGIN IMMEDIATE;", upsert_counters!(), "COMMIT;"))
        .bind(to_json(&totals))
        .fetch_all(&mut *conn)
        .await;
    match rows {
        Ok(rows) => values_in_order(items, &totals, rows).map(Some),
        Err(e) if is_overflow(&e) => {
            sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// SQLITE_CONSTRAINT_DATATYPE: a STRICT column refused a value, which for
/// `counters.value` means the sum left the 64-bit integers.
fn is_overflow(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "3091")
}

fn totals<'a>(items: &[(&'a Name, i64)]) -> HashMap<&'a str, i64> {
    let mut totals: HashMap<&str, i64> = HashMap::new();
    for (name, by) in items {
        let t = totals.entry(name.as_str()).or_default();
        *t = t.saturating_add(*by);
    }
    totals
}

/// Each caller's value: the name's value before the batch, counted up in
/// queue order.
fn values_in_order(
    items: &[(&Name, i64)],
    totals: &HashMap<&str, i64>,
    rows: Vec<(String, i64)>,
) -> Result<Vec<i64>, Error> {
    let mut running: HashMap<String, i64> = rows
        .into_iter()
        .map(|(name, value)| {
            let before = value - totals.get(name.as_str()).copied().unwrap_or(0);
            (name, before)
        })
        .collect();
    let mut values = Vec::with_capacity(items.len());
    for (name, by) in items {
        let v = running.get_mut(name.as_str()).ok_or_else(fewer_rows)?;
        *v += by;
        values.push(*v);
    }
    Ok(values)
}

/// Every name of a batch is upserted, so every name has a row; if one ever
/// did not, its caller gets an error rather than a made-up value.
fn fewer_rows() -> Error {
    Error::Internal("the counter upsert returned fewer rows than names".into())
}

/// The current values of many counters in one statement; names never
/// written are absent from the map.
pub async fn read(pool: &SqlitePool, names: &[&str]) -> Result<HashMap<String, i64>, Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT name, value FROM counters
         WHERE name IN (SELECT value FROM json_each(?1))",
    )
    .bind(to_json(&names))
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}
