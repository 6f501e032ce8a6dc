//! The PostgreSQL engine: any number of tally processes on one database.
//!
//! Each process keeps its own queue and writer: a batch is one transaction
//! on the writer's one connection, answered only after COMMIT. What the
//! single SQLite writer gets for free, many processes get from row locks
//! taken in one order: counters are upserted in name order, a budget's
//! day is locked (its global row, created if need be) before any of its
//! usage is read, and an idempotency key is claimed by inserting it, so a
//! concurrent duplicate waits on the unique index and then replays the
//! first answer. A deadlock or serialization failure reruns the whole
//! batch, a few times, so a client never sees one.
//!
//! The writer's connection is opened when a batch needs it and dropped when
//! it breaks: while the server is unreachable every batch is answered 503
//! at once, and the first batch after it answers again reconnects. A COMMIT
//! whose connection broke has an unknown outcome and is answered so.
//!
//! One clock decides for every process: the database server's. The day a
//! check counts on, a day's window and an idempotency key's age are read
//! from `now()` inside the transaction, never from the clock of the
//! process that happens to run it.
//!
//! A row held by a transaction outside tally (an operator's session left
//! open) is waited for at most the lock timeout: then only the commands on
//! that row are answered busy, and the rest of their batch commits.
//!
//! A connection that reaches a server which cannot take writes (a standby,
//! or a primary demoted by a switchover that a Service or DNS name still
//! points to) is of no use: it is dropped, and the next batch or read
//! connects anew. Readers go to the primary too, so that a read after a
//! `200` sees that write.
//!
//! The SQL stays within what PostgreSQL 15 and CockroachDB both accept:
//! `ON CONFLICT`, `RETURNING`, `unnest` of arrays, `= ANY`. Names are
//! compared and ordered byte by byte (`COLLATE "C"`, as Rust orders
//! strings), whatever the database's default collation.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use deadpool::managed::{self, Object, PoolError, RecycleError};
use jiff::Timestamp;
use sqlx::{Connection, PgConnection, postgres::PgConnectOptions};

use super::{
    Error,
    command::Queued,
    keys,
    reads::{BoxFuture, Reads},
    store::{BudgetRow, Store, StoredKey, UsageRow},
    txn::{Applied, apply_batch},
    writer::{Engine, Lost},
};
use crate::meter::BudgetSpec;

/// PostgreSQL's SQLSTATE of `e`, if the server answered with one.
fn pg_code(e: &sqlx::Error) -> Option<&str> {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .map(|pg| pg.code())
}

/// What a PostgreSQL error means:
/// - 53100 disk_full: [`Error::StorageFull`];
/// - 55P03 lock_not_available, a lock not had within `lock_timeout`:
///   [`Error::Busy`], this command's alone;
/// - 40001 serialization failure, 40P01 deadlock: [`Error::Raced`], the
///   whole batch runs again;
/// - the server out of reach or unable to take writes now:
///   [`Error::Unavailable`]. SQLSTATE class 08, connection exceptions;
///   57P01-57P03, shutting down or starting; 53300, out of connection
///   slots; 57014, a statement cancelled by `statement_timeout`; 25006, a
///   read-only transaction: a standby, or a primary demoted by a
///   switchover, that a connection still reaches. The server did not do
///   it, and a retry later (on a new connection where
///   [`needs_new_connection`]) can succeed;
/// - the rest as [`Error::from_sqlx`] says.
pub(super) fn error(e: sqlx::Error) -> Error {
    let code = pg_code(&e);
    let unreachable = code.is_some_and(|c| {
        c.starts_with("08")
            || matches!(c, "57P01" | "57P02" | "57P03" | "53300" | "57014" | "25006")
    });
    match code {
        Some("53100") => Error::StorageFull(Arc::new(e)),
        Some("55P03") => Error::Busy(Arc::new(e)),
        Some("40001" | "40P01") => Error::Raced(Arc::new(e)),
        _ if unreachable => Error::Unavailable(Arc::new(e)),
        _ => Error::from_sqlx(e),
    }
}

/// Whether the connection that gave this error is of no more use: it
/// broke, the server ended it, or the server it reaches cannot take writes
/// (a standby, a demoted primary). A new connection, resolving the host
/// name again, may reach the server that can.
fn needs_new_connection(e: &Error) -> bool {
    let Error::Unavailable(e) = e else {
        return false;
    };
    match &**e {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
        e => pg_code(e).is_some_and(|code| {
            code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "25006")
        }),
    }
}

/// Longest wait for a connection to the server, the writer's or a reader's.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest a statement may run before the server cancels it.
pub const STATEMENT_TIMEOUT: &str = "10s";

/// Longest a transaction may sit idle before the server ends it. The writer
/// never waits between the statements of a batch.
pub const IDLE_IN_TRANSACTION_TIMEOUT: &str = "30s";

/// Longest a batch may take, all its statements and its COMMIT together:
/// this, plus [`BATCH_TIMEOUT_PER_COMMAND`] for each of its commands. A
/// server that stops answering without closing the connection (a network
/// partition, a frozen host) would otherwise hold the writer, and every
/// write queued behind it, until TCP gives up, minutes later.
const BATCH_TIMEOUT: Duration = Duration::from_secs(15);

/// What each command adds to [`BATCH_TIMEOUT`]: a batch run command by
/// command (keyed writes) costs several round trips per command, and a
/// large one on a distant server must not be cut off while it progresses.
const BATCH_TIMEOUT_PER_COMMAND: Duration = Duration::from_millis(40);

/// Longest a read may take; see [`BATCH_TIMEOUT`].
pub const READ_TIMEOUT: Duration = Duration::from_secs(12);

/// How many times a batch that lost a race (deadlock, serialization
/// failure) is run again before its callers hear 503.
const RACE_RETRIES: u32 = 8;

/// Longest an idle read connection is kept.
const READER_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The connection options every connection of the process uses: the URL's,
/// plus the statement, lock and idle-transaction timeouts and the
/// application's name (seen in `pg_stat_activity`).
pub fn connect_options(url: &str, lock_timeout: Duration) -> Result<PgConnectOptions, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    let lock_timeout = format!("{}ms", lock_timeout.as_millis().max(1));
    Ok(options.application_name("tally").options([
        ("statement_timeout", STATEMENT_TIMEOUT),
        // A row held by a session outside tally (an operator's open
        // transaction) is waited for this long, no more: then the command
        // that needs it is answered busy, and the rest of its batch goes
        // on without it.
        ("lock_timeout", lock_timeout.as_str()),
        // A transaction whose client vanished (a partition that lost the
        // close) would otherwise keep its row locks for hours, and every
        // process's writes to those rows would time out behind it.
        (
            "idle_in_transaction_session_timeout",
            IDLE_IN_TRANSACTION_TIMEOUT,
        ),
    ]))
}

/// One connection to a server that takes writes, or
/// [`Error::Unavailable`] within [`CONNECT_TIMEOUT`], at the server's first
/// refusal: the host name is resolved anew every time.
pub async fn connect(options: &PgConnectOptions) -> Result<PgConnection, Error> {
    let connected = async {
        let mut conn = PgConnection::connect_with(options).await?;
        // What libpq's `target_session_attrs=read-write` asks: a standby,
        // or a database whose sessions start read-only, cannot take a
        // write, and a read there may not see the last one.
        let read_only: bool = sqlx::query_scalar(
            "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool",
        )
        .fetch_one(&mut conn)
        .await?;
        Ok::<_, sqlx::Error>((conn, read_only))
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, connected).await {
        Ok(Ok((conn, false))) => Ok(conn),
        Ok(Ok((conn, true))) => {
            let _ = conn.close().await;
            Err(Error::Unavailable(Arc::new(sqlx::Error::Io(
                std::io::Error::other(
                    "the server takes no writes (a standby, or read-only): \
                     tally needs the primary",
                ),
            ))))
        }
        Ok(Err(e)) => Err(match error(e) {
            // Refused credentials or an unknown database are not a
            // passing outage, but they are the server's answer all the
            // same: nothing was written, and retrying is safe.
            Error::Database(e) => Error::Unavailable(e),
            e => e,
        }),
        Err(_) => Err(timed_out(CONNECT_TIMEOUT)),
    }
}

/// The read connections: at most `readers`, opened on demand.
///
/// Not sqlx's pool: it keeps trying to connect until its acquire timeout
/// while the server refuses (down, or out of connection slots), so a read
/// took seconds to be answered 503; and it hands out one idle connection
/// after another that a server restart had killed. Here a refused
/// connection is answered at once, and a read that finds its pooled
/// connection dead drops every idle one and runs once more on a new one.
pub struct Readers {
    pool: managed::Pool<ReaderConnections>,
    /// Whether reads fail for an unreachable server now: its start and end
    /// are logged once, not once per failed read.
    failing: AtomicBool,
}

struct ReaderConnections {
    options: PgConnectOptions,
}

impl managed::Manager for ReaderConnections {
    type Type = PgConnection;
    type Error = Error;

    async fn create(&self) -> Result<PgConnection, Error> {
        connect(&self.options).await
    }

    async fn recycle(
        &self,
        _: &mut PgConnection,
        metrics: &managed::Metrics,
    ) -> managed::RecycleResult<Error> {
        // No ping: it would double every read's round trips. A dead
        // connection is found by the read itself (see `Readers::read`).
        match metrics.last_used() > READER_IDLE_TIMEOUT {
            true => Err(RecycleError::message("idle too long")),
            false => Ok(()),
        }
    }
}

impl Readers {
    pub fn new(options: PgConnectOptions, readers: u32) -> Self {
        let pool = managed::Pool::builder(ReaderConnections { options })
            .max_size(usize::try_from(readers.max(1)).unwrap_or(1))
            .wait_timeout(Some(CONNECT_TIMEOUT))
            .runtime(deadpool::Runtime::Tokio1)
            .build();
        let pool = match pool {
            Ok(pool) => pool,
            // Only a missing runtime fails a build, and one is given.
            Err(e) => unreachable!("the read pool cannot be built: {e}"),
        };
        Readers {
            pool,
            failing: AtomicBool::new(false),
        }
    }

    /// Runs `read` on a connection, within [`READ_TIMEOUT`]. A connection
    /// found dead (it died while idle: a server restart, a proxy's idle
    /// timeout) is dropped with every idle one, which died with it most
    /// likely, and the read runs once more on a new connection: a read
    /// changes nothing.
    ///
    /// `read` is called once per try with the connection; what it reads
    /// with is owned by its future (async closures borrowing both would not
    /// be `Send` for every lifetime, which a spawned task needs).
    pub async fn read<T>(
        &self,
        read: impl Fn(&mut PgConnection) -> BoxFuture<'_, Result<T, Error>>,
    ) -> Result<T, Error> {
        let mut again = true;
        let result = loop {
            let mut conn = match self.pool.get().await {
                Ok(conn) => conn,
                Err(PoolError::Backend(e)) => break Err(e),
                Err(PoolError::Closed) => break Err(Error::Closed),
                Err(PoolError::Timeout(_)) => break Err(timed_out(CONNECT_TIMEOUT)),
                Err(e) => break Err(Error::Internal(format!("read pool: {e}").into())),
            };
            let pooled = Object::metrics(&conn).recycle_count > 0;
            let Ok(r) = tokio::time::timeout(READ_TIMEOUT, read(&mut conn)).await else {
                // Left in the middle of a statement: of no more use.
                drop(Object::take(conn));
                break Err(timed_out(READ_TIMEOUT));
            };
            match r {
                Err(e) if needs_new_connection(&e) => {
                    drop(Object::take(conn));
                    if pooled && again {
                        again = false;
                        self.pool.retain(|_, _| false);
                        continue;
                    }
                    break Err(e);
                }
                r => break r,
            }
        };
        self.note_outage(&result);
        result
    }

    /// Logs when reads start failing for an unreachable server, and when
    /// they stop: once each, however many reads fail in between (each is
    /// counted by route and status in the HTTP metrics).
    fn note_outage<T>(&self, result: &Result<T, Error>) {
        let failing = matches!(result, Err(Error::Unavailable(_)));
        if self.failing.swap(failing, Ordering::Relaxed) == failing {
            return;
        }
        match result {
            Err(e) if failing => {
                tracing::error!(error = %e, "reads: the database cannot be reached")
            }
            _ => tracing::warn!("reads: the database answers again"),
        }
    }
}

impl Reads for Readers {
    fn counters<'a>(
        &'a self,
        names: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, Error>> {
        let names: Vec<String> = names.iter().map(|&n| n.to_owned()).collect();
        Box::pin(self.read(move |conn| {
            let names = names.clone();
            Box::pin(async move { read_counters(conn, &names).await })
        }))
    }

    fn budgets_and_now<'a>(
        &'a self,
        names: &'a [&'a str],
    ) -> BoxFuture<'a, Result<(Vec<BudgetRow>, Timestamp), Error>> {
        let names: Vec<String> = names.iter().map(|&n| n.to_owned()).collect();
        Box::pin(self.read(move |conn| {
            let names = names.clone();
            Box::pin(async move { load_budgets(conn, &names).await })
        }))
    }

    fn usage_counts<'a>(
        &'a self,
        budget: &'a str,
        day: &'a str,
        visitor: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(i64, Option<i64>), Error>> {
        Box::pin(self.read(move |conn| {
            let (b, d, v) = (
                budget.to_owned(),
                day.to_owned(),
                visitor.map(str::to_owned),
            );
            Box::pin(usage_counts(conn, b, d, v))
        }))
    }

    fn size_and_idle(&self) -> (u32, usize) {
        let status = self.pool.status();
        (
            u32::try_from(status.size).unwrap_or(u32::MAX),
            status.available,
        )
    }

    /// Closes every idle connection now, and each busy one when its read
    /// returns it.
    fn close(&self) -> BoxFuture<'_, ()> {
        self.pool.close();
        Box::pin(std::future::ready(()))
    }
}

/// The writer's connection: opened when a batch needs one, dropped when it
/// breaks.
pub struct WriterConn {
    options: PgConnectOptions,
    conn: Option<PgConnection>,
}

impl Engine for WriterConn {
    async fn apply(&mut self, batch: &mut [Queued]) -> Applied {
        WriterConn::apply(self, batch).await
    }

    /// A server's storage cannot be deleted underneath tally.
    fn check(&mut self) -> Result<(), Lost> {
        Ok(())
    }

    async fn forget_expired_keys(&mut self) -> Result<u64, Error> {
        WriterConn::forget_expired_keys(self).await
    }

    async fn close(self) {
        WriterConn::close(self).await
    }
}

impl WriterConn {
    pub fn new(options: PgConnectOptions) -> Self {
        WriterConn {
            // Told apart from the readers in `pg_stat_activity`.
            options: options.application_name("tally-writer"),
            conn: None,
        }
    }

    async fn conn(&mut self) -> Result<&mut PgConnection, Error> {
        if self.conn.is_none() {
            self.conn = Some(connect(&self.options).await?);
            tracing::info!("writer connected to PostgreSQL");
        }
        self.conn
            .as_mut()
            .ok_or_else(|| Error::Internal("no writer connection".into()))
    }

    /// Applies a batch, running it again when it lost a race with another
    /// process.
    pub async fn apply(&mut self, batch: &mut [Queued]) -> Applied {
        let mut attempt = 0;
        // A connection kept from an earlier batch may have died while idle
        // (a server restart, a proxy's or firewall's idle timeout): a batch
        // that finds it gone, before COMMIT, committed nothing and runs
        // once more on a new one.
        let mut stale = self.conn.is_some();
        loop {
            let conn = match self.conn().await {
                Ok(conn) => conn,
                Err(e) => return Err(e),
            };
            let commands = u32::try_from(batch.len()).unwrap_or(u32::MAX);
            let limit =
                BATCH_TIMEOUT.saturating_add(BATCH_TIMEOUT_PER_COMMAND.saturating_mul(commands));
            let Ok(applied) = tokio::time::timeout(limit, apply_batch(conn, batch)).await else {
                // Cut off somewhere between BEGIN and COMMIT's answer: the
                // batch may have committed.
                tracing::error!(
                    timeout = ?limit,
                    batch = batch.len(),
                    "PostgreSQL did not answer the batch in time; dropping the connection, \
                     its writes' outcome is unknown"
                );
                self.conn = None;
                return Err(Error::OutcomeUnknown);
            };
            match &applied {
                Err(e) if e.is_retryable() && attempt < RACE_RETRIES => {
                    attempt += 1;
                    metrics::counter!("tally_write_retries_total").increment(1);
                    tracing::debug!(error = %e, attempt, "batch lost a race; running it again");
                    // Back off a little, at random (every pod's tally is PID
                    // 1, so nothing about the process tells them apart), so
                    // that two processes that deadlocked do not meet again
                    // at once.
                    tokio::time::sleep(backoff(attempt)).await;
                    continue;
                }
                // Lost every time: the server is too busy to take it now.
                Err(Error::Raced(source)) => return Err(Error::Unavailable(source.clone())),
                Err(e) if needs_new_connection(e) && stale => {
                    stale = false;
                    let e = e.clone();
                    self.drop_connection(&e);
                    continue;
                }
                Err(e) if needs_new_connection(e) => {
                    let e = e.clone();
                    self.drop_connection(&e);
                }
                Err(Error::OutcomeUnknown) => self.drop_connection(&Error::OutcomeUnknown),
                _ => {}
            }
            log_busy(batch, &applied);
            return applied;
        }
    }

    /// Forgets the connection: the next batch connects anew.
    fn drop_connection(&mut self, why: &Error) {
        if self.conn.take().is_some() {
            tracing::warn!(
                error = %why,
                "writer dropped its PostgreSQL connection; the next batch connects anew"
            );
        }
    }

    pub async fn forget_expired_keys(&mut self) -> Result<u64, Error> {
        let conn = self.conn().await?;
        let r = tokio::time::timeout(BATCH_TIMEOUT, keys::forget_expired(conn))
            .await
            .unwrap_or_else(|_| Err(timed_out(BATCH_TIMEOUT)));
        if let Err(e) = &r
            && needs_new_connection(e)
        {
            self.drop_connection(e);
        }
        r
    }

    pub async fn close(self) {
        if let Some(conn) = self.conn
            && let Err(e) = conn.close().await
        {
            tracing::warn!(error = %e, "closing the writer's PostgreSQL connection failed");
        }
    }
}

/// Names the commands of a committed batch that found their row held by
/// another transaction past the lock timeout: one line per batch, and a
/// batch that meets a held row waits the lock timeout, so a row held for
/// long is not one line per request.
fn log_busy(batch: &[Queued], applied: &Applied) {
    if applied.is_err() {
        return;
    }
    let busy: Vec<String> = batch
        .iter()
        .filter(|q| matches!(q.command.outcome(), Some(Err(Error::Busy(_)))))
        .map(|q| q.command.to_string())
        .collect();
    if let Some(first) = busy.first() {
        tracing::warn!(
            commands = busy.len(),
            first = %first,
            "rows held by another transaction past the lock timeout (a session outside \
             tally?): those commands were answered row-busy, the rest of the batch committed"
        );
    }
}

/// A random wait of up to 2^attempt ms (at most 256 ms).
fn backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let ceiling = 1u64 << attempt.min(8);
    Duration::from_micros(random % (ceiling * 1000))
}

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

/// `now()` (the transaction's start) as a timestamp: microseconds since
/// the epoch, which every PostgreSQL keeps.
macro_rules! now_micros {
    () => {
        "(extract(epoch FROM now()) * 1000000)::int8"
    };
}

fn timestamp(micros: i64) -> Result<Timestamp, Error> {
    Timestamp::from_microsecond(micros)
        .map_err(|e| Error::Internal(format!("the server's clock reads {micros} us: {e}").into()))
}

impl Store for PgConnection {
    const BEGIN: &'static str = "BEGIN";

    /// A row lock is waited for 250 ms at most: past that the batch runs
    /// again command by command, where only the commands on the busy row
    /// wait for it (up to the configured lock timeout). Batches of other
    /// tally processes hold their rows for milliseconds.
    const BEGIN_SET_BASED: &'static str = "BEGIN; SET LOCAL lock_timeout = '250ms'";

    /// The server's clock, at the transaction's start: the same for every
    /// process, however far their own clocks drift.
    async fn now(&mut self) -> Result<Timestamp, Error> {
        let micros: i64 = sqlx::query_scalar(concat!("SELECT ", now_micros!()))
            .fetch_one(self)
            .await
            .map_err(error)?;
        timestamp(micros)
    }

    async fn exec(&mut self, sql: &'static str) -> Result<(), Error> {
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

    async fn prune(&mut self, budget: &str, before: &str) -> Result<u64, Error> {
        let mut deleted = 0;
        for sql in [
            "DELETE FROM budget_visitor_usage WHERE budget = $1 AND day < $2",
            "DELETE FROM budget_global_usage WHERE budget = $1 AND day < $2",
        ] {
            let r = sqlx::query(sql)
                .bind(budget)
                .bind(before)
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

    /// Inserts the key with an empty answer. If another transaction holds
    /// the same key uncommitted, the insert waits for it; if the key is
    /// there (committed, or claimed earlier in this transaction), nothing is
    /// inserted and its row is read instead.
    async fn claim_key(
        &mut self,
        key: &str,
        fingerprint: &str,
    ) -> Result<Option<StoredKey>, Error> {
        let claimed = sqlx::query(
            "INSERT INTO idempotency_keys (key, fingerprint, result, created_at)
             VALUES ($1, $2, '', extract(epoch FROM now())::int8)
             ON CONFLICT (key) DO NOTHING",
        )
        .bind(key)
        .bind(fingerprint)
        .execute(&mut *self)
        .await
        .map_err(error)?
        .rows_affected();
        if claimed == 1 {
            return Ok(None);
        }
        let stored: Option<StoredKey> =
            sqlx::query_as("SELECT fingerprint, result FROM idempotency_keys WHERE key = $1")
                .bind(key)
                .fetch_optional(self)
                .await
                .map_err(error)?;
        // Gone between the two statements (forgotten as expired by another
        // process, which only forgets keys a day old): the caller hears an
        // error and may retry.
        stored
            .map(Some)
            .ok_or_else(|| Error::Internal("an idempotency key vanished while claimed".into()))
    }

    async fn remember_key(
        &mut self,
        key: &str,
        _fingerprint: &str,
        result: &str,
    ) -> Result<(), Error> {
        sqlx::query("UPDATE idempotency_keys SET result = $2 WHERE key = $1")
            .bind(key)
            .bind(result)
            .execute(self)
            .await
            .map_err(error)?;
        Ok(())
    }

    /// By the server's clock: a process whose own clock runs a day ahead
    /// must not forget a key another process has just stored.
    async fn forget_keys_older_than(&mut self, age: Duration) -> Result<u64, Error> {
        Ok(
            // A bounded share at a time, so that a backlog of millions
            // never runs into the statement timeout; the rest goes next
            // time (once a minute).
            sqlx::query(
                "DELETE FROM idempotency_keys WHERE key IN
                   (SELECT key FROM idempotency_keys
                    WHERE created_at < extract(epoch FROM now())::int8 - $1 LIMIT 10000)",
            )
            .bind(i64::try_from(age.as_secs()).unwrap_or(i64::MAX))
            .execute(self)
            .await
            .map_err(error)?
            .rows_affected(),
        )
    }
}

fn timed_out(after: Duration) -> Error {
    Error::Unavailable(std::sync::Arc::new(sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("PostgreSQL did not answer within {after:?}"),
    ))))
}

/// The named budgets that exist, in one statement, and the server's clock.
pub async fn load_budgets(
    conn: &mut PgConnection,
    names: &[String],
) -> Result<(Vec<BudgetRow>, Timestamp), Error> {
    #[derive(sqlx::FromRow)]
    struct WithNow {
        #[sqlx(flatten)]
        budget: BudgetRow,
        now_micros: i64,
    }
    let rows: Vec<WithNow> = sqlx::query_as(concat!(
        "SELECT name, visitor_limit, global_limit, retention_days, timezone, ",
        now_micros!(),
        " AS now_micros FROM budgets WHERE name = ANY($1)"
    ))
    .bind(names)
    .fetch_all(conn)
    .await
    .map_err(error)?;
    // No budget, no day to tell: this process's clock does as well.
    let now = match rows.first() {
        Some(row) => timestamp(row.now_micros)?,
        None => Timestamp::now(),
    };
    Ok((rows.into_iter().map(|r| r.budget).collect(), now))
}

/// The current values of many counters in one statement; names never
/// written are absent.
pub async fn read_counters(
    conn: &mut PgConnection,
    names: &[String],
) -> Result<Vec<(String, i64)>, Error> {
    sqlx::query_as("SELECT name, value FROM counters WHERE name = ANY($1)")
        .bind(names)
        .fetch_all(conn)
        .await
        .map_err(error)
}

/// A day's global calls of a budget and, if asked, one visitor's, in one
/// statement (one snapshot); absent rows read as 0.
pub async fn usage_counts(
    conn: &mut PgConnection,
    budget: String,
    day: String,
    visitor: Option<String>,
) -> Result<(i64, Option<i64>), Error> {
    sqlx::query_as(
        "SELECT
           coalesce((SELECT calls FROM budget_global_usage WHERE budget = $1 AND day = $2), 0),
           CASE WHEN $3::text IS NOT NULL THEN coalesce((SELECT calls FROM budget_visitor_usage
             WHERE budget = $1 AND day = $2 AND visitor = $3::text), 0) END",
    )
    .bind(budget)
    .bind(day)
    .bind(visitor)
    .fetch_one(conn)
    .await
    .map_err(error)
}
