//! Reads, which go straight to the database on a pool of their own
//! (read-only connections to the SQLite file, or connections to
//! PostgreSQL), never through the writer.
//!
//! Counter reads are coalesced. Every statement on a sqlx SQLite
//! connection is a hop to that connection's thread and back, and every
//! statement to PostgreSQL a network round trip; under load those, not the
//! database, are what a read costs. So counter reads queue up, and each of
//! a few reader loops takes every read waiting, answers them all with one
//! statement on a connection from the pool, and replies. An idle loop
//! answers a lone read at once: coalescing never waits to fill.

use std::{collections::HashMap, pin::Pin, sync::Arc};

use jiff::Timestamp;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::{
    Error, budgets,
    list::{KeyRange, Page, PageRequest},
    store::BudgetRow,
};
use crate::meter::{Budget, Day, Name, Refusal, Usage, VisitorId};

/// A boxed future, as a read hands it over.
pub(super) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What an engine's read pool answers: each engine implements it once
/// (`sqlite::SqliteReaders`, `postgres::Readers`) and is chosen at open.
pub(super) trait Reads: Send + Sync {
    /// The current values of many counters; names never written are absent.
    fn counters<'a>(
        &'a self,
        names: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, Error>>;

    /// The named budgets that exist, and the time their days go by: the
    /// server's clock on PostgreSQL, the one every process's writer goes
    /// by too.
    fn budgets_and_now<'a>(
        &'a self,
        names: &'a [&'a str],
    ) -> BoxFuture<'a, Result<(Vec<BudgetRow>, Timestamp), Error>>;

    /// A day's global calls of a budget and, if asked, one visitor's, in
    /// one statement (one snapshot); absent rows read as 0. `None` if the
    /// budget does not exist in that snapshot: deleted since it was read,
    /// its usage may be part deleted (see [`budgets::purge`]).
    fn usage_counts<'a>(
        &'a self,
        budget: &'a str,
        day: &'a str,
        visitor: Option<&'a str>,
    ) -> BoxFuture<'a, Result<Option<DayCounts>, Error>>;

    /// The budgets whose names are in `range`, by name in byte order.
    fn list_budgets<'a>(
        &'a self,
        range: &'a KeyRange,
    ) -> BoxFuture<'a, Result<Vec<BudgetRow>, Error>>;

    /// The counters whose names are in `range`, by name in byte order.
    fn list_counters<'a>(
        &'a self,
        range: &'a KeyRange,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, Error>>;

    /// Connections open, and how many of them are idle.
    fn size_and_idle(&self) -> (u32, usize);

    /// Closes the pool, waiting for readers to finish.
    fn close(&self) -> BoxFuture<'_, ()>;
}

/// A day's global calls and, if asked, one visitor's.
pub(super) type DayCounts = (i64, Option<i64>);

/// The read pool of the engine that was opened.
#[derive(Clone)]
pub(super) struct Readers(pub Arc<dyn Reads>);

impl Readers {
    /// The current values of many counters; names never written are absent.
    async fn counters(&self, names: &[&str]) -> Result<HashMap<String, i64>, Error> {
        Ok(self.0.counters(names).await?.into_iter().collect())
    }

    /// One budget, or [`crate::meter::Refusal::UnknownBudget`].
    pub async fn budget(&self, name: &Name) -> Result<Budget, Error> {
        self.budget_and_now(name).await.map(|(budget, _)| budget)
    }

    async fn budget_and_now(&self, name: &Name) -> Result<(Budget, Timestamp), Error> {
        let (rows, now) = self.0.budgets_and_now(&[name.as_str()]).await?;
        Ok((budgets::one(rows, name)?, now))
    }

    /// A budget's usage on a day it keeps (its today by default); the two
    /// numbers come from one statement, one snapshot. Days without usage
    /// read as 0.
    pub async fn usage(
        &self,
        budget: &Name,
        day: Option<Day>,
        visitor: Option<&VisitorId>,
    ) -> Result<Usage, Error> {
        let (found, now) = self.budget_and_now(budget).await?;
        let day = found.day(day, now)?;
        let (global_calls, visitor_calls) = self
            .0
            .usage_counts(
                budget.as_str(),
                &day.to_string(),
                visitor.map(VisitorId::as_str),
            )
            .await?
            .ok_or_else(|| Refusal::UnknownBudget(budget.clone()))?;
        Ok(Usage {
            day,
            global_calls,
            visitor_calls,
        })
    }

    /// A page of budgets, by name in byte order; rows tally cannot read
    /// back are named among the page's unreadable ones.
    pub async fn list_budgets(&self, page: &PageRequest) -> Result<Page<Budget>, Error> {
        let rows = self.0.list_budgets(&page.range()).await?;
        Ok(page.page(rows, |r| &r.name, budgets::read_row))
    }

    /// A page of counters and their values, by name in byte order, as
    /// [`Self::list_budgets`].
    pub async fn list_counters(&self, page: &PageRequest) -> Result<Page<(Name, i64)>, Error> {
        let rows = self.0.list_counters(&page.range()).await?;
        let read = |(name, value): (String, i64)| Ok((Name::parse(&name).map_err(|e| e.0)?, value));
        Ok(page.page(rows, |(name, _)| name, read))
    }

    /// Connections open, and how many of them are idle.
    pub fn size_and_idle(&self) -> (u32, usize) {
        self.0.size_and_idle()
    }

    pub async fn close(&self) {
        self.0.close().await;
    }
}

/// Most reads answered by one statement.
const MAX_READ_BATCH: usize = 512;

pub(super) struct CounterRead {
    pub name: Name,
    pub reply: oneshot::Sender<Result<i64, Error>>,
}

/// Starts `loops` reader loops on the current runtime and returns the way in.
pub(super) fn start(pool: Readers, loops: u32) -> mpsc::Sender<CounterRead> {
    let (tx, rx) = mpsc::channel(4 * MAX_READ_BATCH);
    let rx = Arc::new(Mutex::new(rx));
    for _ in 0..loops.max(1) {
        tokio::spawn(reader_loop(pool.clone(), Arc::clone(&rx)));
    }
    tx
}

async fn reader_loop(pool: Readers, rx: Arc<Mutex<mpsc::Receiver<CounterRead>>>) {
    let mut batch = Vec::with_capacity(MAX_READ_BATCH);
    loop {
        // Hold the receiver only while waiting: the next loop takes the
        // next batch while this one is at the database.
        let n = rx.lock().await.recv_many(&mut batch, MAX_READ_BATCH).await;
        if n == 0 {
            return;
        }
        let names: Vec<&str> = batch.iter().map(|r| r.name.as_str()).collect();
        match pool.counters(&names).await {
            Ok(values) => {
                for read in batch.drain(..) {
                    let v = values.get(read.name.as_str()).copied().unwrap_or(0);
                    let _ = read.reply.send(Ok(v));
                }
            }
            Err(e) => {
                for read in batch.drain(..) {
                    let _ = read.reply.send(Err(e.clone()));
                }
            }
        }
    }
}
