//! The PostgreSQL engine's reads: a pool of connections to the primary,
//! each read bounded in time and run once more on a new connection when
//! it finds its pooled one dead.

use super::*;

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
    /// Whether the outage under way was logged: its end is logged only then.
    logged: AtomicBool,
    /// Outages logged, one every [`OUTAGE_LOG_EVERY`] at most.
    outages: crate::telemetry::Throttle,
}

/// How often an outage of reads may be logged. With too few connection
/// slots on the server, one read gets a connection and the next does not:
/// each was an outage begun and ended, and a replica logged 540 lines in
/// 20 s.
const OUTAGE_LOG_EVERY: Duration = Duration::from_secs(10);

/// A line [`Readers::note_outage`] writes.
#[derive(Debug, PartialEq, Eq)]
enum OutageLine {
    /// Reads fail; with the outages since the last line not logged.
    Starts { held_back: u64 },
    /// Reads answer again, after an outage that was logged.
    Ends,
    /// Reads have answered for a while, and this many outages since the
    /// last line were not logged (each begun and ended within the period).
    Untold { outages: u64 },
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
            logged: AtomicBool::new(false),
            outages: crate::telemetry::Throttle::new(OUTAGE_LOG_EVERY),
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
                // A connection that broke, or whose statements were
                // prepared before a table changed under them: so were the
                // others pooled with it, and all go; a pooled one is tried
                // once more on a new one.
                Err(e) if needs_new_connection(&e) || plans_changed(&e) => {
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
    /// counted by route and status in the HTTP metrics), and one outage
    /// every [`OUTAGE_LOG_EVERY`] at most.
    fn note_outage<T>(&self, result: &Result<T, Error>) {
        let line = self.outage_line(matches!(result, Err(Error::Unavailable(_))));
        match (line, result) {
            (Some(OutageLine::Starts { held_back }), Err(e)) => tracing::error!(
                error = %e,
                held_back,
                "reads: the database is unavailable (one such line every 10 s at most; \
                 held_back: outages since the last, not logged)"
            ),
            (Some(OutageLine::Ends), _) => tracing::warn!("reads: the database answers again"),
            (Some(OutageLine::Untold { outages }), _) => tracing::warn!(
                outages,
                "reads: the database was unavailable this many more times since the last \
                 outage logged, each briefly (reads in them failed, 503); it answers now"
            ),
            _ => {}
        }
    }

    /// What [`Self::note_outage`] logs for a read that `failed` or not. An
    /// outage whose start was held back is logged by a later failed read
    /// once the throttle lets it: one that lasts is always logged.
    fn outage_line(&self, failed: bool) -> Option<OutageLine> {
        let was_failing = self.failing.swap(failed, Ordering::Relaxed);
        if !failed {
            return match was_failing {
                true => self
                    .logged
                    .swap(false, Ordering::Relaxed)
                    .then_some(OutageLine::Ends),
                // Answering: the outages held back are told once the
                // throttle lets a line through, though none follows.
                false => self
                    .outages
                    .untold()
                    .map(|outages| OutageLine::Untold { outages }),
            };
        }
        let held_back = match was_failing {
            false => self.outages.admit()?,
            true if self.logged.load(Ordering::Relaxed) => return None,
            true => self.outages.admit_held()?,
        };
        self.logged.store(true, Ordering::Relaxed);
        Some(OutageLine::Starts { held_back })
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
    ) -> BoxFuture<'a, Result<Option<crate::db::reads::DayCounts>, Error>> {
        Box::pin(self.read(move |conn| {
            let (b, d, v) = (
                budget.to_owned(),
                day.to_owned(),
                visitor.map(str::to_owned),
            );
            Box::pin(usage_counts(conn, b, d, v))
        }))
    }

    fn list_budgets<'a>(
        &'a self,
        range: &'a KeyRange,
    ) -> BoxFuture<'a, Result<Vec<BudgetRow>, Error>> {
        Box::pin(self.read(move |conn| Box::pin(list_budgets(conn, range.clone()))))
    }

    fn list_counters<'a>(
        &'a self,
        range: &'a KeyRange,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, Error>> {
        Box::pin(self.read(move |conn| Box::pin(list_counters(conn, range.clone()))))
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
) -> Result<Option<(i64, Option<i64>)>, Error> {
    let (global, visitor, exists): (i64, Option<i64>, bool) = sqlx::query_as(
        "SELECT
           coalesce((SELECT calls FROM budget_global_usage WHERE budget = $1 AND day = $2), 0),
           CASE WHEN $3::text IS NOT NULL THEN coalesce((SELECT calls FROM budget_visitor_usage
             WHERE budget = $1 AND day = $2 AND visitor = $3::text), 0) END,
           EXISTS (SELECT 1 FROM budgets WHERE name = $1)",
    )
    .bind(budget)
    .bind(day)
    .bind(visitor)
    .fetch_one(conn)
    .await
    .map_err(error)?;
    Ok(exists.then_some((global, visitor)))
}

/// A page of a table by name, compared and ordered byte by byte: `$1` the
/// lower bound (compared with `$op`), `$2` the upper (excluded), `$3` the
/// most rows; without an upper bound (`$upper` empty), `$2` the most rows.
macro_rules! list_sql {
    ($columns:literal, $table:literal, $op:literal, $upper:literal, $limit:literal) => {
        concat!(
            "SELECT ",
            $columns,
            " FROM ",
            $table,
            " WHERE name COLLATE \"C\" ",
            $op,
            " $1",
            $upper,
            " ORDER BY name COLLATE \"C\" LIMIT ",
            $limit
        )
    };
}

/// [`list_sql`] for `range`, and the query with its bounds bound. A lower
/// bound holding a NUL (the `next` of a SQLite page, passed by a client to
/// this engine, which stores none and refuses it in any text) is the same
/// range cut at the NUL, with U+0001 after it, inclusive.
macro_rules! list_query {
    ($columns:literal, $table:literal, $range:expr) => {{
        let range: &KeyRange = $range;
        let (from, inclusive) = match range.from.split_once('\0') {
            Some((before, _)) => (format!("{before}\u{1}"), true),
            None => (range.from.clone(), range.inclusive),
        };
        let sql = match (inclusive, range.below.is_some()) {
            (true, true) => {
                list_sql!($columns, $table, ">=", " AND name COLLATE \"C\" < $2", "$3")
            }
            (true, false) => list_sql!($columns, $table, ">=", "", "$2"),
            (false, true) => {
                list_sql!($columns, $table, ">", " AND name COLLATE \"C\" < $2", "$3")
            }
            (false, false) => list_sql!($columns, $table, ">", "", "$2"),
        };
        let query = sqlx::query_as(sql).bind(from);
        match &range.below {
            Some(below) => query.bind(below.clone()).bind(range.take),
            None => query.bind(range.take),
        }
    }};
}

/// Budgets whose names are in `range` (see `KeyRange`), by name: one range
/// scan of the primary key.
pub async fn list_budgets(
    conn: &mut PgConnection,
    range: KeyRange,
) -> Result<Vec<BudgetRow>, Error> {
    list_query!(
        "name, visitor_limit, global_limit, retention_days, timezone",
        "budgets",
        &range
    )
    .fetch_all(conn)
    .await
    .map_err(error)
}

/// Counters whose names are in `range`, by name, as [`list_budgets`].
pub async fn list_counters(
    conn: &mut PgConnection,
    range: KeyRange,
) -> Result<Vec<(String, i64)>, Error> {
    list_query!("name, value", "counters", &range)
        .fetch_all(conn)
        .await
        .map_err(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Readers of a server nothing answers at, whose outage lines are
    /// throttled to one every `every`.
    fn readers(every: Duration) -> Readers {
        let options =
            connect_options("postgres://tally@127.0.0.1:1/x", Duration::from_secs(1)).unwrap();
        let mut readers = Readers::new(options, 2);
        readers.outages = crate::telemetry::Throttle::new(every);
        readers
    }

    /// Reads that fail and succeed in turn (a server short of connection
    /// slots) log one outage, with its end, every 10 s at most; the next
    /// says how many were not logged.
    #[test]
    fn flapping_reads_log_one_outage_every_ten_seconds() {
        let readers = readers(OUTAGE_LOG_EVERY);
        assert_eq!(readers.outage_line(false), None);
        assert_eq!(
            readers.outage_line(true),
            Some(OutageLine::Starts { held_back: 0 })
        );
        assert_eq!(readers.outage_line(true), None);
        assert_eq!(readers.outage_line(false), Some(OutageLine::Ends));
        for _ in 0..100 {
            assert_eq!(readers.outage_line(true), None);
            assert_eq!(readers.outage_line(false), None);
        }
    }

    /// An outage that begins while the throttle holds lines back, and
    /// lasts, is logged once it lets one through; its end then too.
    #[test]
    fn an_outage_whose_start_was_held_back_is_logged_if_it_lasts() {
        // Long enough that a test thread descheduled for a while on a
        // loaded host still makes its calls within one period.
        let every = Duration::from_secs(2);
        let readers = readers(every);
        let starts = |held_back| Some(OutageLine::Starts { held_back });
        assert_eq!(readers.outage_line(true), starts(0));
        assert_eq!(readers.outage_line(false), Some(OutageLine::Ends));
        // Within the period: held back, however many reads fail.
        for _ in 0..100 {
            assert_eq!(readers.outage_line(true), None);
        }
        std::thread::sleep(every);
        assert_eq!(readers.outage_line(true), starts(0), "logged late");
        assert_eq!(readers.outage_line(true), None);
        assert_eq!(readers.outage_line(false), Some(OutageLine::Ends));
    }

    /// Outages held back whose reads then answer for good are told in one
    /// line once the throttle lets one through: the log does not end on
    /// "answers again" with outages never told.
    #[test]
    fn outages_held_back_are_told_once_reads_answer() {
        let every = Duration::from_secs(1);
        let readers = readers(every);
        assert_eq!(
            readers.outage_line(true),
            Some(OutageLine::Starts { held_back: 0 })
        );
        assert_eq!(readers.outage_line(false), Some(OutageLine::Ends));
        for _ in 0..3 {
            assert_eq!(readers.outage_line(true), None);
            assert_eq!(readers.outage_line(false), None);
        }
        assert_eq!(readers.outage_line(false), None, "within the period");
        std::thread::sleep(every);
        assert_eq!(
            readers.outage_line(false),
            Some(OutageLine::Untold { outages: 3 })
        );
        std::thread::sleep(every);
        assert_eq!(readers.outage_line(false), None, "told once");
    }
}
