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

use std::{collections::HashMap, sync::Arc};

use jiff::Timestamp;
use sqlx::SqlitePool;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::{Error, budgets, postgres, sqlite};
use crate::meter::{Budget, Day, Name, Usage, VisitorId};

/// The read pool of either engine.
#[derive(Clone)]
pub(super) enum Readers {
    Sqlite(SqlitePool),
    Postgres(Arc<postgres::Readers>),
}

impl Readers {
    /// The current values of many counters; names never written are absent.
    async fn counters(&self, names: &[&str]) -> Result<HashMap<String, i64>, Error> {
        let rows = match self {
            Readers::Sqlite(pool) => sqlite::read_counters(pool, names).await?,
            Readers::Postgres(pool) => {
                let names: Vec<String> = names.iter().map(|&n| n.to_owned()).collect();
                pool.read(|conn| {
                    let names = names.clone();
                    Box::pin(async move { postgres::read_counters(conn, &names).await })
                })
                .await?
            }
        };
        Ok(rows.into_iter().collect())
    }

    /// One budget, or [`crate::meter::Refusal::UnknownBudget`].
    pub async fn budget(&self, name: &Name) -> Result<Budget, Error> {
        self.budget_and_now(name).await.map(|(budget, _)| budget)
    }

    /// One budget, and the time its days go by: the server's clock on
    /// PostgreSQL, the one every process's writer goes by too.
    async fn budget_and_now(&self, name: &Name) -> Result<(Budget, Timestamp), Error> {
        let (rows, now) = match self {
            Readers::Sqlite(pool) => (
                sqlite::load_budgets(pool, &[name.as_str()]).await?,
                Timestamp::now(),
            ),
            Readers::Postgres(pool) => {
                pool.read(|conn| {
                    let names = [name.as_str().to_owned()];
                    Box::pin(async move { postgres::load_budgets(conn, &names).await })
                })
                .await?
            }
        };
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
        let (b, d, v) = (
            budget.as_str(),
            day.to_string(),
            visitor.map(VisitorId::as_str),
        );
        let (global_calls, visitor_calls) = match self {
            Readers::Sqlite(pool) => sqlite::usage_counts(pool, b, &d, v).await?,
            Readers::Postgres(pool) => {
                pool.read(|conn| {
                    let (b, d, v) = (b.to_owned(), d.clone(), v.map(str::to_owned));
                    Box::pin(postgres::usage_counts(conn, b, d, v))
                })
                .await?
            }
        };
        Ok(Usage {
            day,
            global_calls,
            visitor_calls,
        })
    }

    /// Connections open, and how many of them are idle.
    pub fn size_and_idle(&self) -> (u32, usize) {
        match self {
            Readers::Sqlite(pool) => (pool.size(), pool.num_idle()),
            Readers::Postgres(pool) => pool.size_and_idle(),
        }
    }

    pub async fn close(&self) {
        match self {
            Readers::Sqlite(pool) => pool.close().await,
            Readers::Postgres(pool) => pool.close(),
        }
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
