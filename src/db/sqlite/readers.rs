//! The SQLite readers: a pool of read-only connections.

use jiff::Timestamp;
use sqlx::SqlitePool;

use super::store::{list_budgets, list_counters, load_budgets, read_counters, usage_counts};
use crate::db::{
    Error,
    list::KeyRange,
    reads::{BoxFuture, Reads},
    store::BudgetRow,
};

/// The read-only pool: connections opened read-only *and* with
/// `query_only`.
pub(crate) struct SqliteReaders(pub SqlitePool);

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
    ) -> BoxFuture<'a, Result<Option<crate::db::reads::DayCounts>, Error>> {
        Box::pin(usage_counts(&self.0, budget, day, visitor))
    }

    fn list_budgets<'a>(
        &'a self,
        range: &'a KeyRange,
    ) -> BoxFuture<'a, Result<Vec<BudgetRow>, Error>> {
        Box::pin(list_budgets(&self.0, range))
    }

    fn list_counters<'a>(
        &'a self,
        range: &'a KeyRange,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, Error>> {
        Box::pin(list_counters(&self.0, range))
    }

    fn size_and_idle(&self) -> (u32, usize) {
        (self.0.size(), self.0.num_idle())
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.0.close())
    }
}
