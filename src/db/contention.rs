//! The contention lab: why tally funnels every write through one queue.
//!
//! Two throwaway databases, each with one counter row and `busy_timeout=0`.
//! Twelve writers are released at once against each; every write holds its
//! transaction open for a while (75 ms by default), as a slow request would.
//!
//! - **direct**: each writer has its own writable connection. SQLite allows
//!   one writer at a time, so the others fail with `SQLITE_BUSY` at once.
//! - **queued**: the writers send their command down one channel to one
//!   connection, which runs them one after another: all commit.

use std::{path::Path, sync::Arc, time::Duration};

use sqlx::{
    ConnectOptions, Connection, SqliteConnection,
    sqlite::{SqliteConnectOptions, SqliteJournalMode},
};
use tokio::{
    sync::{Barrier, mpsc, oneshot},
    time::Instant,
};

/// What one mode did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub mode: &'static str,
    pub committed: usize,
    pub busy: usize,
    pub other_errors: usize,
    pub final_counter: i64,
    pub elapsed: Duration,
}

async fn open(path: &Path) -> Result<SqliteConnection, sqlx::Error> {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::ZERO)
        .connect()
        .await
}

async fn setup(path: &Path) -> Result<(), sqlx::Error> {
    let mut conn = open(path).await?;
    sqlx::raw_sql(
        "CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL);
         INSERT INTO counter (id, n) VALUES (1, 0);",
    )
    .execute(&mut conn)
    .await?;
    conn.close().await
}

async fn read_counter(path: &Path) -> Result<i64, sqlx::Error> {
    let mut conn = open(path).await?;
    let n = sqlx::query_scalar("SELECT n FROM counter WHERE id = 1")
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(n)
}

/// One write: increment inside a transaction held open for `hold`.
async fn write(conn: &mut SqliteConnection, hold: Duration) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut *conn).await?;
    let r = async {
        sqlx::query("UPDATE counter SET n = n + 1 WHERE id = 1")
            .execute(&mut *conn)
            .await?;
        tokio::time::sleep(hold).await;
        sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
        Ok(())
    }
    .await;
    if r.is_err() {
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
    }
    r
}

fn is_busy(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        // Extended result codes keep the primary code in the low byte.
        .and_then(|c| c.parse::<i32>().ok())
        .is_some_and(|c| c & 0xff == 5)
}

fn tally_results(mode: &'static str, results: &[Result<(), sqlx::Error>]) -> Outcome {
    let committed = results.iter().filter(|r| r.is_ok()).count();
    let busy = results
        .iter()
        .filter(|r| r.as_ref().err().is_some_and(is_busy))
        .count();
    Outcome {
        mode,
        committed,
        busy,
        other_errors: results.len() - committed - busy,
        final_counter: 0,
        elapsed: Duration::ZERO,
    }
}

async fn direct(path: &Path, writers: usize, hold: Duration) -> Result<Outcome, sqlx::Error> {
    let mut conns = Vec::with_capacity(writers);
    for _ in 0..writers {
        conns.push(open(path).await?);
    }
    let gate = Arc::new(Barrier::new(writers));
    let started = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|mut conn| {
            let gate = Arc::clone(&gate);
            tokio::spawn(async move {
                gate.wait().await;
                let r = write(&mut conn, hold).await;
                let _ = conn.close().await;
                r
            })
        })
        .collect();
    let mut results = Vec::with_capacity(writers);
    for t in tasks {
        results.push(
            t.await
                .unwrap_or_else(|e| Err(sqlx::Error::Protocol(e.to_string()))),
        );
    }
    let mut out = tally_results("direct", &results);
    out.elapsed = started.elapsed();
    out.final_counter = read_counter(path).await?;
    Ok(out)
}

async fn queued(path: &Path, writers: usize, hold: Duration) -> Result<Outcome, sqlx::Error> {
    type Job = oneshot::Sender<Result<(), sqlx::Error>>;
    let mut conn = open(path).await?;
    let (tx, mut rx) = mpsc::channel::<Job>(writers);
    let writer = tokio::spawn(async move {
        while let Some(reply) = rx.recv().await {
            let _ = reply.send(write(&mut conn, hold).await);
        }
        let _ = conn.close().await;
    });
    let gate = Arc::new(Barrier::new(writers));
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|_| {
            let (tx, gate) = (tx.clone(), Arc::clone(&gate));
            tokio::spawn(async move {
                gate.wait().await;
                let (reply, answer) = oneshot::channel();
                tx.send(reply).await.map_err(|_| sqlx::Error::PoolClosed)?;
                answer.await.map_err(|_| sqlx::Error::WorkerCrashed)?
            })
        })
        .collect();
    drop(tx);
    let mut results = Vec::with_capacity(writers);
    for t in tasks {
        results.push(
            t.await
                .unwrap_or_else(|e| Err(sqlx::Error::Protocol(e.to_string()))),
        );
    }
    let _ = writer.await;
    let mut out = tally_results("queued", &results);
    out.elapsed = started.elapsed();
    out.final_counter = read_counter(path).await?;
    Ok(out)
}

/// Runs both modes in a fresh temporary directory.
pub async fn run(writers: usize, hold: Duration) -> anyhow::Result<[Outcome; 2]> {
    let dir = tempfile::tempdir()?;
    let (a, b) = (dir.path().join("direct.db"), dir.path().join("queued.db"));
    setup(&a).await?;
    setup(&b).await?;
    Ok([
        direct(&a, writers, hold).await?,
        queued(&b, writers, hold).await?,
    ])
}

/// The table `tally contention` prints.
pub fn render(outcomes: &[Outcome]) -> String {
    let mut s = format!(
        "{:<8} {:>9} {:>11} {:>12} {:>13} {:>10}\n",
        "mode", "committed", "SQLITE_BUSY", "other errors", "final counter", "elapsed"
    );
    for o in outcomes {
        s += &format!(
            "{:<8} {:>9} {:>11} {:>12} {:>13} {:>9.0}ms\n",
            o.mode,
            o.committed,
            o.busy,
            o.other_errors,
            o.final_counter,
            o.elapsed.as_secs_f64() * 1000.0
        );
    }
    s
}
