//! Counters: one upsert adds a batch of increments, whether the batch holds
//! one command or hundreds, inside a transaction the writer opened or as a
//! whole transaction of its own; each caller gets the value its own
//! increment produced, as if the batch had run one command at a time.

use std::collections::{BTreeMap, HashMap};

use super::{Error, command::Deleted, store::Store};
use crate::meter::{Name, Refusal};

/// Adds `by` to one counter and returns its new value.
pub async fn increment(conn: &mut impl Store, name: &Name, by: i64) -> Result<i64, Error> {
    match increment_many(conn, &[(name, by)]).await? {
        Some(values) => values.first().copied().ok_or_else(fewer_rows),
        None => Err(Refusal::Overflow(name.clone()).into()),
    }
}

/// Deletes a counter, or refuses with [`Refusal::UnknownCounter`]: one
/// never written (or deleted already) reads as 0 but is not there to
/// delete.
pub async fn delete(conn: &mut impl Store, name: &Name) -> Result<Deleted, Error> {
    match conn.delete_counter(name.as_str()).await? {
        true => Ok(Deleted { usage_rows: 0 }),
        false => Err(Refusal::UnknownCounter(name.clone()).into()),
    }
}

/// Adds each `(name, by)` in order, inside the caller's transaction.
/// Increments of one name are summed into one row of the upsert; caller
/// `i` gets the value its increment would have produced had the batch run
/// one command at a time. `None` when a counter would overflow: which
/// caller overflows is for one-by-one application to tell.
pub async fn increment_many(
    conn: &mut impl Store,
    items: &[(&Name, i64)],
) -> Result<Option<Vec<i64>>, Error> {
    let totals = totals(items);
    match conn.upsert_counters(&totals).await? {
        Some(rows) => values_in_order(items, &totals, rows).map(Some),
        None => Ok(None),
    }
}

/// [`increment_many`] as a whole transaction
/// ([`Store::upsert_counters_committed`]), opened with `begin`.
pub async fn increment_many_committed(
    conn: &mut impl Store,
    items: &[(&Name, i64)],
    begin: &'static str,
) -> Result<Option<Vec<i64>>, Error> {
    let totals = totals(items);
    match conn.upsert_counters_committed(&totals, begin).await? {
        Some(rows) => values_in_order(items, &totals, rows).map(Some),
        None => Ok(None),
    }
}

/// Each name once with the sum of its increments, in name order: rows are
/// locked in that order, so two processes upserting the same names cannot
/// deadlock.
fn totals<'a>(items: &[(&'a Name, i64)]) -> Vec<(&'a str, i64)> {
    let mut totals: BTreeMap<&str, i64> = BTreeMap::new();
    for (name, by) in items {
        let t = totals.entry(name.as_str()).or_default();
        *t = t.saturating_add(*by);
    }
    totals.into_iter().collect()
}

/// Each caller's value: the name's value before the batch, counted up in
/// queue order.
fn values_in_order(
    items: &[(&Name, i64)],
    totals: &[(&str, i64)],
    rows: Vec<(String, i64)>,
) -> Result<Vec<i64>, Error> {
    let added: HashMap<&str, i64> = totals.iter().copied().collect();
    let mut running: HashMap<String, i64> = rows
        .into_iter()
        .map(|(name, value)| {
            let before = value - added.get(name.as_str()).copied().unwrap_or(0);
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
