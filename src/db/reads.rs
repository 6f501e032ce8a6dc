//! Counter reads, coalesced.
//!
//! Every statement on a sqlx SQLite connection is a hop to that
//! connection's thread and back, and under load those hops, not SQLite,
//! are what a read costs. So counter reads queue up, and each of a few
//! reader loops takes every read waiting, answers them all with one
//! statement on a read-only connection from the pool, and replies. An idle
//! loop answers a lone read at once: coalescing never waits to fill.

use std::sync::Arc;

use sqlx::SqlitePool;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::Error;
use crate::meter::Name;

/// Most reads answered by one statement.
const MAX_READ_BATCH: usize = 512;

pub(super) struct CounterRead {
    pub name: Name,
    pub reply: oneshot::Sender<Result<i64, Error>>,
}

/// Starts `loops` reader loops on the current runtime and returns the way in.
pub(super) fn start(pool: SqlitePool, loops: u32) -> mpsc::Sender<CounterRead> {
    let (tx, rx) = mpsc::channel(4 * MAX_READ_BATCH);
    let rx = Arc::new(Mutex::new(rx));
    for _ in 0..loops.max(1) {
        tokio::spawn(reader_loop(pool.clone(), Arc::clone(&rx)));
    }
    tx
}

async fn reader_loop(pool: SqlitePool, rx: Arc<Mutex<mpsc::Receiver<CounterRead>>>) {
    let mut batch = Vec::with_capacity(MAX_READ_BATCH);
    loop {
        // Hold the receiver only while waiting: the next loop takes the
        // next batch while this one is at the database.
        let n = rx.lock().await.recv_many(&mut batch, MAX_READ_BATCH).await;
        if n == 0 {
            return;
        }
        let names: Vec<&str> = batch.iter().map(|r| r.name.as_str()).collect();
        match super::counters::read(&pool, &names).await {
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
