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
    list::KeyRange,
    reads::{BoxFuture, Reads},
    store::{BudgetRow, Store, StoredKey, UsageRow},
    txn::{self, Applied, OnHeld, Pass},
    writer::{Engine, Lost},
};
use crate::{
    config::PostgresUrl,
    db::{DbOptions, Driver, OpenError, migrations, reads::Readers as ReadPool},
    meter::BudgetSpec,
};

/// PostgreSQL's answer in `e`, if the server answered.
pub(super) fn pg_error(e: &sqlx::Error) -> Option<&sqlx::postgres::PgDatabaseError> {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
}

/// PostgreSQL's SQLSTATE of `e`, if the server answered with one.
fn pg_code(e: &sqlx::Error) -> Option<&str> {
    pg_error(e).map(|pg| pg.code())
}

/// What a PostgreSQL error means:
/// - 53100 disk_full: [`Error::StorageFull`];
/// - 55P03 lock_not_available, a lock not had within `lock_timeout`:
///   [`Error::Busy`], this command's alone;
/// - 40001 serialization failure, 40P01 deadlock: [`Error::Raced`], the
///   whole batch runs again; so does the plan cache's 0A000 (see
///   [`plans_changed`]), once, on a new connection;
/// - the server out of reach or unable to take writes now:
///   [`Error::Unavailable`]. SQLSTATE class 08, connection exceptions;
///   57P01-57P03, shutting down or starting; 57P04, the database
///   dropped; 57P05, 25P03 and 25P04, a session ended for being idle, or
///   a transaction open, too long; 53300, out of connection
///   slots; 57014, a statement cancelled by `statement_timeout`; 25006, a
///   read-only transaction: a standby, or a primary demoted by a
///   switchover, that a connection still reaches. The server did not do
///   it, and a retry later (on a new connection where
///   [`needs_new_connection`]) can succeed. So is an answer the driver
///   could not make sense of (`sqlx::Error::Protocol`: a message out of
///   turn, a stream ended in the middle of one): the connection's state
///   is unknown, it is not used again, and a COMMIT so answered may have
///   committed ([`Error::at_commit`]: outcome unknown, never "nothing was
///   written");
/// - the rest as [`Error::from_sqlx`] says.
pub(super) fn error(e: sqlx::Error) -> Error {
    let code = pg_code(&e);
    let unreachable = code.is_some_and(|c| connection_done(c) || matches!(c, "53300" | "57014"))
        || matches!(e, sqlx::Error::Protocol(_));
    match code {
        Some("53100") => Error::StorageFull(Arc::new(e)),
        Some("55P03") => Error::Busy(Arc::new(e), super::HeldRow::Own),
        Some("40001" | "40P01") => Error::Raced(Arc::new(e)),
        // A statement prepared before its table changed ([`plans_changed`]):
        // the transaction's, not one command's.
        Some("0A000") if stale_plan(&e) => Error::Raced(Arc::new(e)),
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
        e => pg_code(e).is_some_and(connection_done),
    }
}

/// Whether `e` is PostgreSQL refusing a statement the connection prepared
/// before a table it reads changed under it (SQLSTATE 0A000, "cached plan
/// must not change result type": a column's type or collation altered, by
/// a newer tally's migration or by hand). The connection's prepared
/// statements are of no more use, and a new connection prepares them
/// again; the work runs once more on one, not again and again.
fn plans_changed(e: &Error) -> bool {
    matches!(e, Error::Raced(e) if pg_code(e) == Some("0A000"))
}

/// Whether a 0A000 is the plan cache's ([`plans_changed`]): told by the
/// server's routine, which its translations leave as it is. Any other
/// 0A000 is a feature the server does not have (CockroachDB answers so),
/// the statement's own error: a new connection would fail alike, and
/// reconnecting for it on every batch stormed the server with sessions.
fn stale_plan(e: &sqlx::Error) -> bool {
    pg_error(e).and_then(|pg| pg.routine()) == Some("RevalidateCachedQuery")
}

/// SQLSTATEs after which a connection is of no more use: class 08
/// (connection exceptions), 57P01-57P03 (the server shutting down or
/// starting), 57P04 (the database dropped), 57P05, 25P03 and 25P04 (the
/// server ended a session idle past its `idle_session_timeout` or
/// `idle_in_transaction_session_timeout`, or a transaction past
/// PostgreSQL 17's `transaction_timeout`), 25006 (it takes no writes: a
/// standby, a demoted primary).
fn connection_done(code: &str) -> bool {
    code.starts_with("08")
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "57P04" | "57P05" | "25P03" | "25P04" | "25006"
        )
}

/// Longest wait for a connection to the server, the writer's or a reader's.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest the migrations at start wait for a table lock.
const MIGRATION_LOCK_TIMEOUT: &str = "10s";

/// Longest a statement may run before the server cancels it.
pub const STATEMENT_TIMEOUT: &str = "10s";

/// Longest a transaction may sit idle before the server ends it. The writer
/// never waits between the statements of a batch.
pub const IDLE_IN_TRANSACTION_TIMEOUT: &str = "30s";

/// Seconds a connection is idle before the server probes it (see
/// [`connect_options`]).
pub const TCP_KEEPALIVES_IDLE: &str = "60";

/// Longest a batch may take, all its statements and its COMMIT together:
/// this, plus [`BATCH_TIMEOUT_PER_COMMAND`] for each of its commands. A
/// server that stops answering without closing the connection (a network
/// partition, a frozen host) would otherwise hold the writer, and every
/// write queued behind it, until TCP gives up, minutes later.
const BATCH_TIMEOUT: Duration = Duration::from_secs(15);

/// What each command adds to [`BATCH_TIMEOUT`]: a batch run command by
/// command (one holding a delete, say) costs several round trips per
/// command, and a large one on a distant server must not be cut off while
/// it progresses.
const BATCH_TIMEOUT_PER_COMMAND: Duration = Duration::from_millis(40);

tokio::task_local! {
    /// Set when the writer's batch hands its `COMMIT` to the connection:
    /// a batch cut off before that committed nothing, since no other
    /// statement of tally's commits (see [`writer::WriterConn`]).
    static COMMIT_SENT: Arc<AtomicBool>;
}

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
        // The server probes an idle connection after a minute, every 10 s,
        // and ends the session after 3 probes unanswered: a connection cut
        // off by the network (a partition, a NAT that dropped its entry
        // without a reset) would otherwise keep its session, and its slot
        // of max_connections, for the system's default of over 2 hours,
        // and the probes keep a NAT's entry for an idle connection alive.
        ("tcp_keepalives_idle", TCP_KEEPALIVES_IDLE),
        ("tcp_keepalives_interval", "10"),
        ("tcp_keepalives_count", "3"),
        // tally's batches are made for READ COMMITTED (rows locked in one
        // order, each statement seeing what committed before it). A
        // database or role whose default is SERIALIZABLE failed reads with
        // serialization errors (500 for a GET that nothing else could
        // fail) and made two processes' batches on the same rows lose
        // races until their callers heard 503.
        ("default_transaction_isolation", "read committed"),
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
            Err(Error::unavailable(
                "the server takes no writes (a standby, or read-only): tally needs the primary",
            ))
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

fn timed_out(after: Duration) -> Error {
    Error::Unavailable(std::sync::Arc::new(sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("PostgreSQL did not answer within {after:?}"),
    ))))
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

mod held;
mod readers;
mod store;
mod writer;

pub use readers::Readers;
pub use writer::WriterConn;

/// A table only tally's migrations make, found with the migrations' own
/// table to tell a schema that holds tally's data.
const TALLY_TABLE: &str = "budget_global_usage";

/// The schema tally's tables are in. The schemas of the role's
/// `search_path` that exist and that it may use are looked in: the one
/// asked for, if no schema of the path holds tally's tables or it does;
/// else the one of them that holds the tables; else the first of them
/// (where the migrations would create them), unless tally's tables are in
/// a schema the role may use but its path does not name. Tables in several
/// schemas of the path, or only outside it, are an error to resolve by
/// hand: which one holds the data that was acknowledged is not for tally
/// to guess, and a path changed since the last start (or a start without
/// the `TALLY_POSTGRES_SCHEMA` the others have) would otherwise serve
/// empty tables made for it, beside processes serving the old ones.
async fn schema(conn: &mut PgConnection, asked: Option<&str>) -> Result<String, String> {
    let holds = "EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid AND c.relname = $1)
                 AND EXISTS (SELECT 1 FROM pg_class c
                             WHERE c.relnamespace = n.oid AND c.relname = '_sqlx_migrations')";
    let found = async {
        let path: Vec<(String, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT s.name::text, {holds}
             FROM unnest(current_schemas(false)) WITH ORDINALITY AS s (name, i)
             JOIN pg_namespace n ON n.nspname = s.name
             WHERE has_schema_privilege(n.oid, 'USAGE')
             ORDER BY s.i"
        )))
        .bind(TALLY_TABLE)
        .fetch_all(&mut *conn)
        .await?;
        let holding: Vec<&str> = path
            .iter()
            .filter(|(_, holds)| *holds)
            .map(|(name, _)| name.as_str())
            .collect();
        if let Some(asked) = asked {
            let named: Option<(bool, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT {holds}, has_schema_privilege(n.oid, 'USAGE')
                 FROM pg_namespace n WHERE n.nspname = $2"
            )))
            .bind(TALLY_TABLE)
            .bind(asked)
            .fetch_optional(&mut *conn)
            .await?;
            let named = named.map(|(holds, usage)| (holds && usage, usage));
            return Ok(match (named, holding.first()) {
                (None, _) => Err(format!(
                    "TALLY_POSTGRES_SCHEMA names schema {asked:?}, which does not exist: create \
                     it (CREATE SCHEMA), or leave the setting out"
                )),
                (Some((_, false)), _) => {
                    let role = role_name(conn).await?;
                    Err(format!(
                        "TALLY_POSTGRES_SCHEMA names schema {asked:?}, which role {role:?} may \
                         not use: grant it (GRANT USAGE ON SCHEMA {} TO {})",
                        always_quoted(asked),
                        always_quoted(&role)
                    ))
                }
                (Some((false, _)), Some(other)) if *other != asked => Err(format!(
                    "TALLY_POSTGRES_SCHEMA names schema {asked:?}, which holds none of tally's \
                     tables, while schema {other:?} of the role's search_path does: tally would \
                     serve empty tables. Name {other:?}, or, for a new deployment in {asked:?}, \
                     take {other:?} out of the role's search_path"
                )),
                (Some(_), _) => Ok(asked.to_owned()),
            });
        }
        let elsewhere: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT n.nspname::text FROM pg_namespace n
             WHERE n.nspname <> ALL (current_schemas(false))
             AND has_schema_privilege(n.oid, 'USAGE') AND {holds}
             ORDER BY 1"
        )))
        .bind(TALLY_TABLE)
        .fetch_all(&mut *conn)
        .await?;
        Ok(match holding.as_slice() {
            [one] => {
                // Another deployment's, most often; or this one's data,
                // left behind by a search_path changed since a release
                // that followed it made the tables served here.
                if !elsewhere.is_empty() {
                    tracing::warn!(
                        schema = %one,
                        elsewhere = %elsewhere.join(", "),
                        "tally's tables are also in schemas the role's search_path does not \
                         name: another deployment's, or this one's data if the search_path \
                         changed since they were made (then set TALLY_POSTGRES_SCHEMA to \
                         the schema that holds it)"
                    );
                }
                Ok((*one).to_owned())
            }
            [] if !elsewhere.is_empty() => {
                let (first, made) = match path.first() {
                    Some((first, _)) => (
                        format!("its first schema is {first}"),
                        format!("in {first}"),
                    ),
                    None => (
                        "it names none that exists and may be used".to_owned(),
                        "elsewhere".to_owned(),
                    ),
                };
                Err(format!(
                    "tally's tables are in schema {}, which the role's search_path does not \
                     name ({first}): tally would make empty tables {made} and serve those. Set \
                     TALLY_POSTGRES_SCHEMA to the schema that holds the data (as the other \
                     processes have it), or, for a new deployment beside it, to a schema of its \
                     own",
                    elsewhere.join(", "),
                ))
            }
            [] => path.first().map(|(name, _)| name.clone()).ok_or_else(|| {
                "no schema of the role's search_path exists (or may be used) to create \
                 tally's tables in: create one, or name one with TALLY_POSTGRES_SCHEMA"
                    .to_owned()
            }),
            several => Err(format!(
                "tally's tables are in several schemas of the role's search_path ({}): set \
                 TALLY_POSTGRES_SCHEMA to the one that holds its data (the others may be empty \
                 copies made when a schema named like the role was created)",
                several.join(", ")
            )),
        })
    }
    .await
    .map_err(|e: sqlx::Error| format!("cannot find tally's schema: {}", Driver(&e)));
    found?
}

/// The migrations applied to the database (none without sqlx's table).
async fn applied_migrations(
    conn: &mut PgConnection,
) -> Result<Vec<(i64, Vec<u8>, bool)>, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if !exists {
        return Ok(Vec::new());
    }
    sqlx::query_as("SELECT version, checksum, success FROM _sqlx_migrations")
        .fetch_all(&mut *conn)
        .await
}

/// `name` as an SQL identifier: as it is when PostgreSQL would read it
/// unquoted as itself (CockroachDB before 23.1 kept quotes in a
/// `search_path` given at connection as part of the name), else quoted.
fn quote_ident(name: &str) -> String {
    let plain = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'$');
    match plain {
        true => name.to_owned(),
        false => format!("\"{}\"", name.replace('"', "\"\"")),
    }
}

/// Runs PostgreSQL's migrations on a connection of their own. sqlx holds
/// an advisory lock while it migrates, so replicas starting together
/// migrate one after the other, and the later ones find nothing to do.
pub async fn open(
    url: &PostgresUrl,
    opts: &DbOptions,
) -> Result<(ReadPool, WriterConn), OpenError> {
    let fail = |reason: String| OpenError::Postgres {
        url: url.to_string(),
        reason,
    };
    let options = connect_options(url.expose(), opts.lock_timeout)
        .map_err(|e| fail(format!("not a usable URL: {e}")))?;
    // A migration may rewrite a large table and its indexes: no statement
    // timeout for it (a migration cut off is rolled back and tried again at
    // every start, locking the tables each time), and a lock it cannot have
    // within a while (other processes' transactions on those tables) is a
    // startup failure to retry, not a wait that stalls every writer
    // queued behind it.
    let migrating = options.clone().options([
        ("statement_timeout", "0"),
        ("lock_timeout", MIGRATION_LOCK_TIMEOUT),
    ]);
    let mut conn = connect(&migrating)
        .await
        .map_err(|e| fail(format!("cannot connect: {e}")))?;
    // Names and visitor ids are UTF-8, and the lists' upper bound is the
    // last code point: a database in another encoding refuses whatever it
    // cannot hold, and every list would fail on it. Said at start.
    let encoding: String = sqlx::query_scalar("SELECT current_setting('server_encoding')")
        .fetch_one(&mut conn)
        .await
        .map_err(|e| {
            fail(format!(
                "cannot read the database's encoding: {}",
                Driver(&e)
            ))
        })?;
    if encoding != "UTF8" {
        return Err(fail(format!(
            "the database is encoded {encoding}; tally stores names and visitor ids as UTF-8, \
             which {encoding} cannot hold all of (every list would fail, and checks by many \
             visitors): create it with ENCODING 'UTF8' (CREATE DATABASE ... ENCODING 'UTF8' \
             TEMPLATE template0)"
        )));
    }
    warn_if_commits_are_not_durable(&mut conn).await;
    let schema = schema(&mut conn, opts.schema.as_deref())
        .await
        .map_err(&fail)?;
    // Every connection names the schema: a schema created later that the
    // role's `search_path` would put first (`"$user"`, PostgreSQL's
    // default), or a new `search_path`, would otherwise move tally, at its
    // next start, onto empty tables of its own making. This one, which
    // found it, is held to it from here.
    let search_path = quote_ident(&schema);
    sqlx::query("SELECT set_config('search_path', $1, false)")
        .bind(&search_path)
        .execute(&mut conn)
        .await
        .map_err(|e| fail(format!("cannot set the search_path: {}", Driver(&e))))?;
    let options = options.options([("search_path", search_path)]);
    let migrator = migrations::tolerant(sqlx::migrate!("./migrations/postgres"));
    let mut applied = read_applied_migrations(&mut conn, &schema)
        .await
        .map_err(&fail)?;
    let tables = migrations::tables(&migrator);
    if applied.is_empty()
        && let Err(refused) = lookalikes(&mut conn, &tables, &schema).await
    {
        // Another process starting beside this one may have migrated
        // since the record was read: a migration's tables and its record
        // commit together, so with the tables seen its record is there.
        applied = read_applied_migrations(&mut conn, &schema)
            .await
            .map_err(&fail)?;
        if applied.is_empty() {
            return Err(fail(refused));
        }
    }
    let standing = migrations::standing(&migrator, &applied);
    standing.admit().map_err(&fail)?;
    migrations::warn_of_newer(&standing.newer);
    // Nothing to run: the migrator is not started, so a role that may read
    // and write tally's tables but not create any in the schema runs tally
    // once a role that may has migrated it.
    if !standing.up_to_date {
        migrator.run(&mut conn).await.map_err(|e| {
            fail(format!(
                "cannot migrate{}: {}",
                migration_hint(&e, &schema),
                Migration(&e)
            ))
        })?;
    }
    let found = found_tables(&mut conn, &tables).await.map_err(&fail)?;
    let missing: Vec<String> = (tables.iter())
        .filter(|t| !found.contains(t))
        .cloned()
        .collect();
    migrations::admit_tables(&missing).map_err(&fail)?;
    rights(&mut conn, &tables, &schema).await.map_err(&fail)?;
    let _ = sqlx::Connection::close(conn).await;
    tracing::info!(url = %url, schema = %schema, readers = opts.readers, "PostgreSQL open");
    let readers = ReadPool(Arc::new(Readers::new(options.clone(), opts.readers)));
    Ok((readers, WriterConn::new(options)))
}

/// Warns at start if the role's or the database's `synchronous_commit`
/// is `off`: the server then answers a `COMMIT` before its WAL is flushed,
/// and a crash of the server loses writes tally answered `200` (measured:
/// 68 of 18,457 in an immediate stop under load). tally leaves the setting
/// to the operator (a stronger one, `remote_apply`, is theirs to choose
/// too), but says what it costs.
async fn warn_if_commits_are_not_durable(conn: &mut PgConnection) {
    let setting: Result<String, _> =
        sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
            .fetch_one(&mut *conn)
            .await;
    if setting.is_ok_and(|s| s == "off") {
        tracing::warn!(
            synchronous_commit = "off",
            "PostgreSQL's synchronous_commit is off for tally's role or database: a 200 is \
             answered before its commit is on the server's disk, and a crash of the server \
             loses the last writes answered; set it on (ALTER ROLE ... SET synchronous_commit \
             = on) for a 200 to mean durable"
        );
    }
}

/// Refuses a schema with no record of tally's migrations that holds
/// tables named like tally's: another application's (a schema first in
/// the role's `search_path` that is not tally's), or tally's own with the
/// record dropped. Told before the migrations start, which would fail on
/// the first such table having made their own record table there.
async fn lookalikes(
    conn: &mut PgConnection,
    tables: &[String],
    schema: &str,
) -> Result<(), String> {
    let found = found_tables(conn, tables).await?;
    if found.is_empty() {
        return Ok(());
    }
    Err(format!(
        "schema `{schema}` holds tables named like tally's ({}) but no record of tally's \
         migrations (`_sqlx_migrations`): another application's tables, or tally's with that \
         record dropped or renamed. tally changes nothing there: give it a schema of its own \
         with TALLY_POSTGRES_SCHEMA (CREATE SCHEMA first), or restore the record",
        found.join(", ")
    ))
}

/// Which of `tables` the schema of the connection's `search_path` holds,
/// in their order.
async fn found_tables(conn: &mut PgConnection, tables: &[String]) -> Result<Vec<String>, String> {
    sqlx::query_scalar(
        "SELECT t FROM unnest($1::text[]) WITH ORDINALITY AS x (t, i)
         WHERE to_regclass(t) IS NOT NULL ORDER BY i",
    )
    .bind(tables)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| format!("cannot look for tally's tables: {}", Driver(&e)))
}

/// The migrations applied to the database in `schema`, or why they
/// cannot be read: a serving role that may not read their record is told
/// the grant, as for tally's other tables ([`rights`]).
async fn read_applied_migrations(
    conn: &mut PgConnection,
    schema: &str,
) -> Result<Vec<(i64, Vec<u8>, bool)>, String> {
    let e = match applied_migrations(conn).await {
        Ok(applied) => return Ok(applied),
        Err(e) => e,
    };
    let hint = match pg_code(&e) {
        Some("42501") => format!(
            " (tally reads it at every start: GRANT SELECT ON {}.\"_sqlx_migrations\" TO {})",
            always_quoted(schema),
            role_name(conn)
                .await
                .map_or("the role".to_owned(), |r| always_quoted(&r))
        ),
        _ => String::new(),
    };
    Err(format!(
        "cannot read the applied migrations: {}{hint}",
        Driver(&e)
    ))
}

/// The role the connection acts as (for the `GRANT`s tally prints).
async fn role_name(conn: &mut PgConnection) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(conn)
        .await
}

/// A failed migration as sqlx tells it, but with PostgreSQL's answer told
/// as [`Driver`] tells it (its SQLSTATE, not `at line N`).
struct Migration<'a>(&'a sqlx::migrate::MigrateError);

impl std::fmt::Display for Migration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use sqlx::migrate::MigrateError;
        match self.0 {
            MigrateError::Execute(e) => write!(f, "while executing migrations: {}", Driver(e)),
            MigrateError::ExecuteMigration(e, version) => {
                write!(f, "while executing migration {version}: {}", Driver(e))
            }
            e => e.fmt(f),
        }
    }
}

/// What tally does to each of its tables.
const TABLE_RIGHTS: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

/// Whether the role may do to each of `tables` what tally does: a role
/// that may not was found out by the first request that needed the table
/// (or, for the clock's hold, by one warning, and a process that then
/// went on without it). A table added by an upgrade belongs to the role
/// that migrated, and a role that only serves has no rights on it until
/// they are granted.
async fn rights(conn: &mut PgConnection, tables: &[String], schema: &str) -> Result<(), String> {
    let lacking: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT t, array_agg(p ORDER BY j)
         FROM unnest($1::text[]) WITH ORDINALITY AS x (t, i),
              unnest($2::text[]) WITH ORDINALITY AS y (p, j)
         -- A right on every column counts (DELETE has none of its own).
         WHERE NOT CASE WHEN p = 'DELETE' THEN has_table_privilege(t, p)
                        ELSE has_any_column_privilege(t, p) END
         GROUP BY t, i ORDER BY i",
    )
    .bind(tables)
    .bind(TABLE_RIGHTS)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| {
        format!(
            "cannot read the role's rights on tally's tables: {}",
            Driver(&e)
        )
    })?;
    if lacking.is_empty() {
        return Ok(());
    }
    let role = role_name(conn)
        .await
        .map_err(|e| format!("cannot read the role's name: {}", Driver(&e)))?;
    let role = always_quoted(&role);
    let told: Vec<String> = lacking
        .iter()
        .map(|(t, rights)| format!("{} on `{t}`", rights.join(", ")))
        .collect();
    let schema = always_quoted(schema);
    let names: Vec<String> = lacking
        .iter()
        .map(|(t, _)| format!("{schema}.{}", always_quoted(t)))
        .collect();
    Err(format!(
        "role {role} lacks {}: tally reads and writes every table of its own. Grant them \
         (GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {role}), and for the tables later \
         releases add, once, as the role that migrates: ALTER DEFAULT PRIVILEGES IN SCHEMA {} \
         GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {role}",
        told.join("; "),
        names.join(", "),
        schema,
    ))
}

/// `name` as a quoted SQL identifier, which psql reads whatever it is (a
/// keyword such as `user` included), for statements an operator pastes.
fn always_quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// What a failed migration's SQLSTATE says to do, if anything: a role
/// that may not create tables, or a table of tally's there with no record
/// of the migration that made it.
fn migration_hint(e: &sqlx::migrate::MigrateError, schema: &str) -> String {
    let code =
        anyhow::Chain::new(e).find_map(|s| s.downcast_ref::<sqlx::Error>().and_then(pg_code));
    match code {
        Some("42501") => {
            format!(" (migrations need a role that may create tables in schema `{schema}`)")
        }
        Some("42P07") => format!(
            " (a table of tally's is in schema `{schema}` with no record of the migration that \
             made it: was `_sqlx_migrations` dropped or renamed?)"
        ),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every connection asks the server to probe it when idle and to end
    /// its session when the probes go unanswered (a partition, a NAT that
    /// dropped its entry), besides its timeouts. Loopback cannot lose a
    /// probe, so this is checked as the settings sent at connection.
    #[test]
    fn every_connection_asks_for_keepalives_and_timeouts() {
        let options = connect_options("postgres://u@db/t", Duration::from_secs(2)).unwrap();
        let sent = options.get_options().unwrap();
        for setting in [
            "statement_timeout=10s",
            "lock_timeout=2000ms",
            "idle_in_transaction_session_timeout=30s",
            "tcp_keepalives_idle=60",
            "tcp_keepalives_interval=10",
            "tcp_keepalives_count=3",
            "default_transaction_isolation=read\\ committed",
        ] {
            assert!(sent.contains(setting), "{setting} not in {sent}");
        }
    }

    /// An answer the driver could not read leaves the connection's state
    /// unknown: it is dropped, and a COMMIT so answered is outcome
    /// unknown. It was a database error: "nothing was written", and the
    /// connection used again.
    #[test]
    fn an_answer_the_driver_cannot_read_is_a_lost_connection() {
        let e = error(sqlx::Error::Protocol("unexpected message".into()));
        assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
        assert!(needs_new_connection(&e));
        assert!(matches!(e.at_commit(), Error::OutcomeUnknown));
    }

    /// The server ending a session (for any reason it gives) ends the
    /// connection's use; a statement's own failure does not.
    #[test]
    fn sessions_the_server_ended_are_connections_done() {
        for code in [
            "08006", "57P01", "57P02", "57P03", "57P04", "57P05", "25P03", "25P04", "25006",
        ] {
            assert!(connection_done(code), "{code}");
        }
        for code in ["57014", "55P03", "40001", "23505", "25P02"] {
            assert!(!connection_done(code), "{code}");
        }
    }
}
