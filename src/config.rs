//! The one settings struct. Every option is a flag with an environment
//! fallback, read here and nowhere else.

use std::{fmt, net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};
pub use secrecy::SecretString;

/// Durability of a commit on the writable connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Synchronous {
    /// fsync the WAL on every commit: a 200 survives power loss.
    #[default]
    Full,
    /// fsync only at checkpoints: a 200 survives a crash of tally, not of the machine.
    Normal,
}

#[derive(Debug, Parser)]
#[command(
    name = "tally",
    version,
    about = "Atomic counters and daily budgets over HTTP, on one SQLite file or a shared PostgreSQL"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub settings: Settings,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API (the default when no subcommand is given).
    Serve,
    /// Show why writes are queued: concurrent writers on their own
    /// connections against one queue in front of one connection.
    Contention {
        /// Concurrent writers released at once.
        #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(2..=1000))]
        writers: u32,
        /// How long each write holds its transaction open, in milliseconds.
        #[arg(long, default_value_t = 75, value_parser = clap::value_parser!(u64).range(0..=10_000))]
        hold_ms: u64,
    },
    /// Restore the database (TALLY_DATABASE) to an instant from
    /// Litestream's replica, if it does not exist yet; at most once per
    /// instant: a restore already made is found in the latest state, which
    /// is then restored instead. See docs/runbooks.md.
    RestoreTo {
        /// The instant, RFC 3339 (2026-05-01T10:04:00Z).
        #[arg(long, value_parser = parse_instant)]
        timestamp: jiff::Timestamp,
        /// Longest each of Litestream's restore steps may take: seconds,
        /// or a number with a unit s, m, h or d. An object store that
        /// accepts connections and never answers would otherwise hold the
        /// restore (and the pod's init container) forever.
        #[arg(long, env = "TALLY_RESTORE_TIMEOUT", default_value = "30m",
              value_parser = parse_restore_timeout)]
        timeout: Duration,
        /// Run at every start of a pod, as the chart's init container:
        /// a database already at the path is taken as done (restore
        /// nothing, exit 0), and a restore to this instant already made
        /// (the latest state records it) restores the latest state
        /// instead. By hand, without it, both are errors: the database was
        /// not moved aside, or the instant was gone back to before.
        #[arg(long)]
        at_every_start: bool,
    },
}

/// Everything the service needs to run. Secrets are in types whose `Debug`
/// hides them ([`SecretString`], [`PostgresUrl`]), so the derived `Debug`
/// (logged at start) cannot leak one.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Address to listen on for HTTP.
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:3000")]
    pub listen: SocketAddr,

    /// Serve `/metrics` on this address instead of the API's listener.
    #[arg(long, env = "TALLY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// Where the data lives: a SQLite database file (parent directories are
    /// created), or a `postgres://` / `postgresql://` URL for PostgreSQL.
    #[arg(long, env = "TALLY_DATABASE", default_value = "./data/tally.db",
          value_parser = parse_storage, hide_env_values = true)]
    pub database: Storage,

    /// Capacity of the write queue. A full queue answers 429 at once.
    #[arg(long, env = "TALLY_QUEUE_CAPACITY", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub queue_capacity: u32,

    /// Most commands the writer commits in one transaction.
    #[arg(long, env = "TALLY_MAX_BATCH", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_batch: u32,

    /// SQLite `synchronous` mode of the writable connection.
    #[arg(long, env = "TALLY_SYNCHRONOUS", value_enum, default_value_t = Synchronous::Full)]
    pub synchronous: Synchronous,

    /// Number of read-only connections for GET requests.
    #[arg(long, env = "TALLY_READERS", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub readers: u32,

    /// SQLite only: how many counters' committed values are kept in memory
    /// (the most recently written or read), so that reading one needs no
    /// statement. About 90 bytes each (200 with 128-character names); 0 reads
    /// every counter from the file.
    #[arg(long, env = "TALLY_COUNTER_CACHE", default_value_t = 16_384,
          value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub counter_cache: u64,

    /// PostgreSQL only: longest a write waits, in seconds, for a row that
    /// another transaction holds (an operator's open session, say); then
    /// that write alone is answered 503 row-busy, and the rest of its batch
    /// commits. At most 9 s: below the statement timeout.
    #[arg(long, env = "TALLY_POSTGRES_LOCK_TIMEOUT", default_value = "2",
          value_parser = parse_lock_timeout)]
    pub postgres_lock_timeout: Duration,

    /// PostgreSQL only: the schema tally's tables are in. Unset: the one
    /// that holds them (found at start), or, in a database without them,
    /// the first schema of the role's `search_path` that exists. Every
    /// connection is then held to that schema, whatever schema is created
    /// or `search_path` set later.
    #[arg(long, env = "TALLY_POSTGRES_SCHEMA", value_parser = parse_schema)]
    pub postgres_schema: Option<String>,

    /// Bearer token for the admin endpoints; admin is disabled (403) when
    /// unset or empty. Surrounding white space (the newline of a secret
    /// written from a file) is not part of it: no request could send it.
    #[arg(long, env = "TALLY_ADMIN_TOKEN", hide_env_values = true,
          value_parser = parse_secret)]
    pub admin_token: Option<SecretString>,

    /// How long tally keeps serving after SIGTERM before it stops accepting
    /// connections, in seconds: its answers meanwhile carry `Connection:
    /// close`, so that clients reconnect, through the load balancer, to
    /// other processes while the balancer learns of the stop. For several
    /// processes behind one address; 0 stops accepting at once.
    #[arg(long, env = "TALLY_SHUTDOWN_DELAY", default_value = "0", value_parser = parse_seconds)]
    pub shutdown_delay: Duration,

    /// How long in-flight requests may take to finish after SIGTERM, in seconds.
    #[arg(long, env = "TALLY_DRAIN_TIMEOUT", default_value = "10", value_parser = parse_positive_seconds)]
    pub drain_timeout: Duration,

    /// How long the writer may take, once the HTTP drain is over, to
    /// commit what its queue still holds and close the database, in
    /// seconds. Past it tally exits without it: every caller of what it
    /// held had already left (answered, timed out or dropped at the
    /// drain), so nothing answered is lost; a database that stopped
    /// answering (a partition) would otherwise hold the stop for a whole
    /// batch's time limit and more, past a pod's grace period.
    #[arg(long, env = "TALLY_WRITER_DRAIN_TIMEOUT", default_value = "5", value_parser = parse_positive_seconds)]
    pub writer_drain_timeout: Duration,

    /// Longest a single request may run before it is answered 503, in seconds.
    #[arg(long, env = "TALLY_REQUEST_TIMEOUT", default_value = "30", value_parser = parse_positive_seconds)]
    pub request_timeout: Duration,

    /// Longest a connection may take to send a complete request header, in
    /// seconds, counted from when it opens or its previous answer was sent:
    /// it bounds slow headers and idle keep-alive connections alike. A
    /// request's body gets as long again after its head, or half the
    /// request timeout if that is shorter (else 408).
    #[arg(long, env = "TALLY_HEADER_TIMEOUT", default_value = "10", value_parser = parse_positive_seconds)]
    pub header_timeout: Duration,

    /// Most HTTP connections open at once on the API listener; past it a new
    /// connection is answered 503 and closed. Derived from the open-files
    /// limit when unset.
    #[arg(long, env = "TALLY_MAX_CONNECTIONS",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: Option<u32>,

    /// Unix socket of Litestream's control server. When set, tally runs as
    /// Litestream's child: it leaves WAL checkpoints to Litestream and binds
    /// its listener only once Litestream confirms the replica is in sync.
    #[arg(long, env = "TALLY_LITESTREAM_SOCKET")]
    pub litestream_socket: Option<PathBuf>,

    /// Litestream's configuration file, for `restore-to`. Unset:
    /// LITESTREAM_CONFIG, else /etc/litestream.yml, as Litestream reads it.
    /// (Under `litestream replicate -exec tally`, tally reads its parent's
    /// own `-config` instead.)
    #[arg(long, env = "TALLY_LITESTREAM_CONFIG", global = true)]
    pub litestream_config: Option<PathBuf>,

    /// The litestream program: `restore-to` runs it, and so does a start
    /// under Litestream that finds no database, to ask the replica whether
    /// it holds one before creating one.
    #[arg(
        long,
        env = "TALLY_LITESTREAM",
        default_value = "litestream",
        global = true
    )]
    pub litestream: PathBuf,

    /// Longest wait at startup for the replica, in seconds: for the first
    /// confirmed replica sync and, where there is no database, for the
    /// replica's answer whether it holds one, together; tally exits
    /// non-zero when it passes.
    #[arg(long, env = "TALLY_REPLICA_WAIT_TIMEOUT", default_value = "60", value_parser = parse_positive_seconds)]
    pub replica_wait_timeout: Duration,

    /// SQLite only: the most the database's directory may use on disk
    /// (allocated blocks, as `du` and the kubelet count them, less the free
    /// pages inside the database, which SQLite reuses before it grows the
    /// file). Past it, writes that would add data are answered 507
    /// storage-full, as on a full disk; resets still run. Bytes, or a
    /// number with a unit: k, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti
    /// (powers of 1024). No limit when unset.
    #[arg(long, env = "TALLY_STORAGE_LIMIT", value_parser = parse_bytes)]
    pub storage_limit: Option<u64>,

    /// How long an idempotency key is remembered (a retry with it within
    /// that time replays the first answer): seconds, or a number with a
    /// unit s, m, h or d. From 1 s to 30 d; each key costs about 130 bytes
    /// of the database while it is kept (shaped like a UUID; up to ~620
    /// for a key of 255 characters).
    #[arg(long, env = "TALLY_IDEMPOTENCY_KEY_TTL", default_value = "24h",
          value_parser = parse_key_ttl)]
    pub idempotency_key_ttl: Duration,

    /// Pause the writer this many milliseconds before each batch. For tests of
    /// backpressure only: a build with the `test-hooks` feature (the test
    /// suite's) has it, a release build does not.
    #[cfg(feature = "test-hooks")]
    #[arg(long, env = "TALLY_TEST_WRITER_DELAY_MS", hide = true)]
    pub test_writer_delay_ms: Option<u64>,

    /// Make the writer thread panic when it takes its batch number N+1,
    /// holding that batch. For tests of losing the writer only (the
    /// `test-hooks` feature).
    #[cfg(feature = "test-hooks")]
    #[arg(long, env = "TALLY_TEST_WRITER_PANIC_AFTER", hide = true)]
    pub test_writer_panic_after: Option<u64>,

    /// Pause the writer this many milliseconds between a batch's COMMIT and
    /// the publication of its counter values, for tests of reads in that
    /// window only (the `test-hooks` feature).
    #[cfg(feature = "test-hooks")]
    #[arg(long, env = "TALLY_TEST_PUBLISH_DELAY_MS", hide = true)]
    pub test_publish_delay_ms: Option<u64>,
}

/// Where the data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Storage {
    /// One SQLite file, written by this process alone.
    Sqlite(PathBuf),
    /// A PostgreSQL server, shared by any number of tally processes.
    Postgres(PostgresUrl),
}

/// A PostgreSQL connection URL. It may hold a password: it is shown only
/// with the password replaced ([`fmt::Display`]).
#[derive(Clone, PartialEq, Eq)]
pub struct PostgresUrl(String);

impl PostgresUrl {
    /// The URL itself, password included: for connecting only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PostgresUrl {
    /// The URL with its password, and every parameter that can hold one,
    /// replaced by `***`. A URL that does not parse is not shown at all:
    /// where its password is cannot be told.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Ok(mut url) = url::Url::parse(&self.0) else {
            return f.write_str("<a PostgreSQL URL that does not parse>");
        };
        if url.password().is_some() {
            let _ = url.set_password(Some("***"));
        }
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| match k.to_ascii_lowercase().contains("password") {
                true => (k.into_owned(), "***".to_owned()),
                false => (k.into_owned(), v.into_owned()),
            })
            .collect();
        if !pairs.is_empty() {
            url.query_pairs_mut().clear().extend_pairs(pairs);
        }
        // `***` stays readable rather than percent-encoded.
        f.write_str(&url.as_str().replace("%2A%2A%2A", "***"))
    }
}

/// Shown as [`fmt::Display`] shows it: with its password replaced.
impl fmt::Debug for PostgresUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PostgresUrl")
            .field(&self.to_string())
            .finish()
    }
}

impl Storage {
    /// A name for logs and the `engine` label of `tally_build_info`.
    pub fn engine(&self) -> &'static str {
        match self {
            Storage::Sqlite(_) => "sqlite",
            Storage::Postgres(_) => "postgres",
        }
    }

    /// The SQLite file, if the data lives in one.
    pub fn sqlite_path(&self) -> Option<&std::path::Path> {
        match self {
            Storage::Sqlite(path) => Some(path),
            Storage::Postgres(_) => None,
        }
    }

    /// Refuses a SQLite path that would start a new, empty database
    /// somewhere else than meant, or defeat the checks on the open file.
    /// Checked at start rather than when the value is parsed, whose error
    /// would show the value: a mistyped URL may hold a password.
    pub fn check(&self) -> Result<(), &'static str> {
        let Some(path) = self.sqlite_path() else {
            return Ok(());
        };
        let s = path.to_string_lossy();
        if s.trim() != s {
            return Err(
                "the database path begins or ends with white space: give the SQLite file's \
                 path, or the postgres:// URL, without it (a database already kept under \
                 such a name: rename the file, its -wal and -shm first, tally stopped)",
            );
        }
        if has_scheme(&s) {
            return Err(
                "the database is a SQLite file's path or a postgres:// or postgresql:// URL; \
                 this one begins with another scheme (such as `sqlite:` or `file:`), which \
                 would be taken for a directory's name (a database already kept in such a \
                 directory: move it, tally stopped, and give its path)",
            );
        }
        if lacks_its_colon(&s) {
            return Err(
                "the database path begins as a URL without its colon (such as `postgres//`): \
                 give postgres://... for PostgreSQL (a SQLite file in a directory really named \
                 so: give its path as ./postgres//...)",
            );
        }
        if holds_credentials(&s) {
            return Err(
                "the database path holds `user:password@host`, as a PostgreSQL URL does: give \
                 the URL as postgres://user:password@host/database (a mistyped one is taken for \
                 a SQLite file's path)",
            );
        }
        if s.ends_with('/') {
            return Err(
                "the database path ends in `/`: name the SQLite file, not a directory (the \
                 checks that the open file is still the one at its path would look in vain)",
            );
        }
        // A shell would have expanded these; tally takes them as written,
        // while Litestream, reading the same variable in its configuration,
        // expands `~` and drops the quotes: the two would go by two files.
        if s.starts_with('~') {
            return Err(
                "the database path begins with `~`, which tally does not expand (Litestream \
                 would): give the whole path",
            );
        }
        if s.starts_with(['"', '\'']) || s.ends_with(['"', '\'']) {
            return Err(
                "the database path begins or ends with a quote, which would be part of the \
                 file's name here (and not in Litestream's): give it without quotes",
            );
        }
        Ok(())
    }
}

impl std::str::FromStr for Storage {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        parse_storage(s)
    }
}

/// An instant as RFC 3339 writes it: a date, a time to the second (a
/// fraction allowed) and an offset (or `Z`), nothing else. A time zone
/// annotation (`[Europe/Paris]`, RFC 9557) is refused rather than dropped:
/// the instant is read from the offset alone, and an annotation that
/// disagrees with it would be silently ignored. So is what jiff reads
/// beyond RFC 3339, rather than read as some other instant: ISO 8601's
/// basic forms (`20161231T235960Z`, `+0200`), a leap second, which it reads
/// as the second before (Unix time, and so Litestream's, has no instant of
/// its own for it), and an offset of a day or more.
fn parse_instant(s: &str) -> Result<jiff::Timestamp, String> {
    if s.contains('[') {
        return Err(format!(
            "`{s}`: give the instant with an offset or Z (2026-05-01T10:04:00Z), without a \
             [time zone] annotation"
        ));
    }
    let Some(shape) = Rfc3339::of(s) else {
        return Err(format!(
            "`{s}`: not an RFC 3339 instant: give YYYY-MM-DDTHH:MM:SS, a fraction of a second \
             if wanted, then Z or an offset +HH:MM (2026-05-01T10:04:00Z)"
        ));
    };
    if shape.offset_hours >= 24 {
        return Err(format!(
            "`{s}`: an offset must be under 24 hours (+23:59 at most)"
        ));
    }
    if shape.second == 60 {
        return Err(format!(
            "`{s}`: a leap second (:60) has no instant of its own in Unix time; give :59 or the \
             next minute"
        ));
    }
    s.parse().map_err(|e: jiff::Error| format!("`{s}`: {e}"))
}

/// The fields of an RFC 3339 date-time that jiff would read otherwise
/// than as written, found by its shape: `YYYY-MM-DD`, `T` (or `t`, or a
/// space), `HH:MM:SS`, an optional `.` and digits, then `Z` (`z`) or
/// `+HH:MM` / `-HH:MM`. `None` for any other shape.
struct Rfc3339 {
    second: u8,
    offset_hours: u8,
}

impl Rfc3339 {
    fn of(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        let digits = |at: usize, n: usize| -> Option<u32> {
            let d = b.get(at..at + n)?;
            d.iter()
                .all(u8::is_ascii_digit)
                .then(|| d.iter().fold(0, |acc, c| acc * 10 + u32::from(c - b'0')))
        };
        let is = |at: usize, allowed: &[u8]| b.get(at).is_some_and(|c| allowed.contains(c));
        digits(0, 4)?;
        (is(4, b"-") && is(7, b"-") && is(10, b"Tt ") && is(13, b":") && is(16, b":"))
            .then_some(())?;
        digits(5, 2)?;
        digits(8, 2)?;
        digits(11, 2)?;
        digits(14, 2)?;
        let second = u8::try_from(digits(17, 2)?).ok()?;
        let mut at = 19;
        if is(at, b".") {
            let n = b[at + 1..]
                .iter()
                .take_while(|c| c.is_ascii_digit())
                .count();
            (n > 0).then_some(())?;
            at += 1 + n;
        }
        let offset_hours = match b.get(at..)? {
            [b'Z' | b'z'] => 0,
            [b'+' | b'-', ..] if b.len() == at + 6 && is(at + 3, b":") => {
                digits(at + 4, 2)?;
                u8::try_from(digits(at + 1, 2)?).ok()?
            }
            _ => return None,
        };
        Some(Rfc3339 {
            second,
            offset_hours,
        })
    }
}

/// A `postgres://` or `postgresql://` URL selects PostgreSQL; anything else
/// is a SQLite file's path. A URL is checked when the database is opened,
/// not here: an error here would echo it, password and all.
fn parse_storage(s: &str) -> Result<Storage, String> {
    let lower = s.to_ascii_lowercase();
    if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
        return Ok(Storage::Postgres(PostgresUrl(s.to_owned())));
    }
    if s.trim().is_empty() {
        return Err("the database path is empty".into());
    }
    Ok(Storage::Sqlite(PathBuf::from(s)))
}

/// Whether `s` begins as a URL does: a scheme (a letter, then letters,
/// digits, `+`, `-` or `.`), `:`, and then `//` or, for the schemes a
/// database is named by (`sqlite:`, `file:`, ...), anything. A directory
/// whose name holds a colon (`restore-2026-05-01T10:04/`) is none.
fn has_scheme(s: &str) -> bool {
    s.split_once(':').is_some_and(|(scheme, rest)| {
        scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
            && (rest.starts_with("//") || names_a_database(scheme))
    })
}

/// Whether `s` begins as a database's URL with its colon left out or
/// mistyped (`postgres//u:pw@db/x`, `postgres;//...`): one of the schemes
/// a database is named by, then at most one stray character, then `//`.
fn lacks_its_colon(s: &str) -> bool {
    s.split_once("//").is_some_and(|(scheme, _)| {
        let scheme = scheme.strip_suffix([';', '.', ',', ' ']).unwrap_or(scheme);
        names_a_database(scheme)
    })
}

/// Whether a part of the path `s` reads as a URL's `user:password@host`:
/// no file is named so, and a mistyped URL taken for a path would start a
/// database in directories named after its password.
fn holds_credentials(s: &str) -> bool {
    s.split('/').any(|part| {
        part.split_once('@')
            .is_some_and(|(user, _)| user.contains(':'))
    })
}

/// `sqlite`, `file`, `postgres`, ...: the schemes a database is named by.
fn names_a_database(scheme: &str) -> bool {
    ["sqlite", "sqlite3", "file", "postgres", "postgresql"]
        .iter()
        .any(|d| scheme.eq_ignore_ascii_case(d))
}

fn parse_secret(s: &str) -> Result<SecretString, String> {
    // The rest of what a request can present is checked at start
    // (`app::admin_token`): a parse error here would print the secret.
    Ok(SecretString::from(s.trim_ascii()))
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(0.0..=86_400.0).contains(&secs) {
        return Err(format!("`{s}` must be between 0 and 86400 seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A schema's name as PostgreSQL stores it (quoted in SQL if need be):
/// 1 to 63 bytes, no control characters.
fn parse_schema(s: &str) -> Result<String, String> {
    match !s.is_empty() && s.len() <= 63 && !s.chars().any(char::is_control) {
        true => Ok(s.to_owned()),
        false => Err(format!(
            "{s:?} is not a schema name: 1 to 63 bytes, no control characters (the name as \
             stored, without quotes: Tally, not \"Tally\")"
        )),
    }
}

fn parse_lock_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    // Written so that NaN fails too.
    if !(0.001..=9.0).contains(&secs) {
        return Err(format!(
            "`{s}` must be between 0.001 and 9 seconds: no wait at all would make every \
             row another process holds for a moment busy, and a longer one would be cut off \
             by the statement timeout (10 s) and answered as an unreachable database"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_positive_seconds(s: &str) -> Result<Duration, String> {
    let d = parse_seconds(s)?;
    if d < Duration::from_millis(1) {
        return Err(format!("`{s}` must be at least a millisecond (0.001)"));
    }
    Ok(d)
}

/// A size in bytes: a whole number, bare or with a unit (`k`, `M`, `G`,
/// `T` decimal; `Ki`, `Mi`, `Gi`, `Ti` binary), or a decimal number with
/// a unit (`1.5Gi`). At least 8 MiB: the WAL alone grows to about 4 MiB
/// (1000 pages) before it is checkpointed, and SQLite never shrinks it, so
/// a smaller limit is filled by the WAL and never makes room again.
const MIN_STORAGE_LIMIT: u64 = 8 << 20;

fn parse_bytes(s: &str) -> Result<u64, String> {
    const UNITS: [(&str, f64); 8] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ];
    let not_a_size = || {
        format!(
            "`{s}` is not a size: give bytes (1073741824) or a number with a unit, such as 1Gi \
             (Ki Mi Gi Ti are powers of 1024, k M G T of 1000)"
        )
    };
    let t = s.trim();
    let (number, factor) = match UNITS.iter().find(|(u, _)| t.ends_with(u)) {
        Some((u, f)) => (&t[..t.len() - u.len()], *f),
        None => (t, 1.0),
    };
    let digits_and_point =
        |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    if !digits_and_point(number) || (factor == 1.0 && number.contains('.')) {
        return Err(not_a_size());
    }
    let value: f64 = number.parse().map_err(|_| not_a_size())?;
    let bytes = (value * factor).floor();
    if bytes < MIN_STORAGE_LIMIT as f64 {
        return Err(format!(
            "`{s}` must be at least 8Mi (8388608 bytes): the WAL alone takes about 4Mi \
             before it is checkpointed"
        ));
    }
    if bytes > 9.0e18 {
        return Err(format!("`{s}` is too large: at most 9000000T"));
    }
    Ok(bytes as u64)
}

/// How long a key is kept: seconds, or a number with a unit (`s`, `m`,
/// `h`, `d`), from 1 s to 30 days.
fn parse_key_ttl(s: &str) -> Result<Duration, String> {
    let secs = parse_duration(s)?;
    // Written so that NaN fails too.
    if !(1.0..=30.0 * 86_400.0).contains(&secs) {
        return Err(format!(
            "`{s}` must be between 1s and 30d: a key must outlive a client's retries, and every \
             key is kept (about 130 bytes of the database) for that long"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_restore_timeout(s: &str) -> Result<Duration, String> {
    let secs = parse_duration(s)?;
    if !(1.0..=7.0 * 86_400.0).contains(&secs) {
        return Err(format!(
            "`{s}` must be between 1s and 7d: the longest one of Litestream's restore steps \
             may take"
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Seconds, or a number with a unit s, m, h or d, in seconds.
fn parse_duration(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (number, unit) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => t.split_at(i),
        None => (t, "s"),
    };
    let factor = match unit {
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => {
            return Err(format!(
                "`{s}` is not a duration: give seconds or a number with a unit s, m, h or d \
                 (such as 24h)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a duration: give seconds or a number with a unit s, m, h or d (such as 24h)"))?;
    Ok(value * factor)
}

/// The name of the first `TALLY_*` variable in `vars` whose value is not
/// UTF-8. Every setting is read as text, a path included, and clap's own
/// refusal ("invalid UTF-8 was detected in one or more arguments") names
/// no variable.
pub fn variable_not_utf8(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Option<String> {
    vars.into_iter()
        .find(|(name, value)| {
            name.as_encoded_bytes().starts_with(b"TALLY_") && value.to_str().is_none()
        })
        .map(|(name, _)| name.to_string_lossy().into_owned())
}

impl Settings {
    /// Settings for a SQLite database at `path`, everything else at its
    /// default.
    pub fn for_database(path: impl Into<PathBuf>) -> Self {
        Self::for_storage(Storage::Sqlite(path.into()))
    }

    /// Settings for `storage`, everything else at its default.
    pub fn for_storage(storage: Storage) -> Self {
        let mut cli = Cli::parse_from(["tally"]);
        cli.settings.database = storage;
        cli.settings
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn a_variable_that_is_not_utf8_is_named() {
        use std::{ffi::OsString, os::unix::ffi::OsStringExt};
        let var = |n: &str, v: &[u8]| (OsString::from(n), OsString::from_vec(v.to_vec()));
        let vars = || {
            [
                var("HOME", b"/\xff"),
                var("TALLY_LISTEN", b"127.0.0.1:0"),
                var("TALLY_DATABASE", b"/data/\xfft.db"),
                var("TALLY_LOG", b"\xc3"),
            ]
        };
        assert_eq!(variable_not_utf8(vars()).as_deref(), Some("TALLY_DATABASE"));
        assert_eq!(variable_not_utf8(vars().into_iter().take(2)), None);
    }

    #[test]
    fn an_instant_has_an_offset_and_no_annotation() {
        let t = parse_instant("2026-05-01T12:04:00+02:00").unwrap();
        assert_eq!(t.to_string(), "2026-05-01T10:04:00Z");
        // The widest offsets RFC 3339 has, and a 60th minute that is not a
        // leap second.
        let t = parse_instant("2026-05-01T23:59:59+23:59").unwrap();
        assert_eq!(t.to_string(), "2026-05-01T00:00:59Z");
        let t = parse_instant("2026-05-01T00:00:59-23:59").unwrap();
        assert_eq!(t.to_string(), "2026-05-01T23:59:59Z");
        assert!(parse_instant("2026-05-01T10:59:59.999Z").is_ok());
        let t = parse_instant("2026-05-01 10:04:00.5-05:30").unwrap();
        assert_eq!(t.to_string(), "2026-05-01T15:34:00.5Z");
        assert!(parse_instant("2026-05-01t10:04:00z").is_ok());
        for bad in [
            "2026-05-01T10:04:00+00:00[!Europe/Paris]",
            "2026-05-01T10:04:00Z[UTC]",
            "2026-05-01T10:04:00",
            "2026-05-01",
            "2026-05-01T10:04:00+25:00",
            "2026-05-01T10:04:00-24:00",
            "2016-12-31T23:59:60Z",
            "2016-12-31t23:59:60.5+00:00",
            // ISO 8601's basic forms, which jiff reads too, a leap second
            // among them read as :59.
            "20161231T235960Z",
            "2016-12-31T235960Z",
            "2016-12-31T23:59:59+0200",
            "2026-05-01T10:04:00+02:00:30",
            "2026-05-01T10:04Z",
            "2026-05-01T10:04:00.Z",
            "2026-05-01T10:04:00Zx",
            "2026-05-01T10:04:00+2:00",
            "２０２６-05-01T10:04:00Z",
        ] {
            assert!(parse_instant(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn connection_limits_parse_and_refuse_nonsense() {
        let s = Settings::for_database("x.db");
        assert_eq!(s.header_timeout, Duration::from_secs(10));
        assert_eq!(s.max_connections, None);
        let cli = Cli::try_parse_from([
            "tally",
            "--header-timeout",
            "2.5",
            "--max-connections",
            "100",
        ])
        .unwrap();
        assert_eq!(cli.settings.header_timeout, Duration::from_millis(2500));
        assert_eq!(cli.settings.max_connections, Some(100));
        // A zero header timeout would close every connection at once.
        assert!(Cli::try_parse_from(["tally", "--header-timeout", "0"]).is_err());
        assert!(Cli::try_parse_from(["tally", "--max-connections", "0"]).is_err());
        // No zero waits either: a request timeout of 0 would answer every
        // write 503 while it commits, a drain of 0 would cut every request
        // in flight, and a replica wait of 0 would fail every start.
        for flag in [
            "--request-timeout",
            "--drain-timeout",
            "--replica-wait-timeout",
        ] {
            assert!(Cli::try_parse_from(["tally", flag, "0"]).is_err(), "{flag}");
            assert!(
                Cli::try_parse_from(["tally", flag, "0.0001"]).is_err(),
                "{flag}"
            );
            assert!(
                Cli::try_parse_from(["tally", flag, "0.5"]).is_ok(),
                "{flag}"
            );
        }
    }

    #[test]
    fn a_url_selects_postgres_and_its_password_is_never_shown() {
        let parse = |s: &str| Cli::try_parse_from(["tally", "--database", s]).map(|c| c.settings);
        let s =
            parse("postgres://tally:hunter2@db:5432/tally?sslmode=require&password=other").unwrap();
        let Storage::Postgres(url) = &s.database else {
            panic!("{:?}", s.database)
        };
        assert_eq!(
            url.to_string(),
            "postgres://tally:***@db:5432/tally?sslmode=require&password=***"
        );
        let shown = format!("{s:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("other"),
            "{shown}"
        );
        assert_eq!(s.database.engine(), "postgres");
        assert!(parse("postgresql://db/tally").is_ok());
        // A path, even one that mentions postgres, stays SQLite.
        let s = parse("./postgres/tally.db").unwrap();
        assert_eq!(s.database, Storage::Sqlite("./postgres/tally.db".into()));
        assert_eq!(s.database.engine(), "sqlite");
        assert!(parse("").is_err());
        for ok in [
            "data/tally.db",
            "/data/tally.db",
            "./a:b/t.db",
            "t.db/x",
            "9x:/t.db",
            "restore-2026-05-01T10:04/tally.db",
            "postgres/tally.db",
            "data/postgres//tally.db",
            "data/a@b:c/t.db",
            "data/a:b/c@d.db",
        ] {
            assert_eq!(parse(ok).unwrap().database.check(), Ok(()), "{ok}");
        }
        // What would start a new, empty database somewhere else than meant,
        // refused without showing the value.
        for bad in [
            " /data/t.db",
            "/data/t.db ",
            "/data/t.db\n",
            " postgres://u:hunter2@db/x",
            "/data/t.db/",
            "sqlite:///data/t.db",
            "file:/data/t.db?mode=ro",
            "postgres:/u:hunter2@db/x",
            "postgres//u:hunter2@db/x",
            "PostgreSQL//db/x",
            "postgres;//db/x",
            "postgres;//u:hunter2@db/x",
            "postgres/u:hunter2@db/x",
            "postgress//u:hunter2@db/x",
            "SQLite:t.db",
            "mysql://db/t.db",
            "~/t.db",
            "~tally/t.db",
            "\"/data/t.db\"",
            "'/data/t.db'",
        ] {
            let e = parse(bad).unwrap().database.check().unwrap_err();
            assert!(!e.contains("hunter2") && !e.contains("t.db"), "{bad}: {e}");
        }
        // Passwords the URL syntax makes hard to find are hidden all the
        // same, or the URL is not shown.
        for (url, secret) in [
            ("postgres://pw:hunter/2@db/x", "hunter"),
            ("postgres://u:p@ss:w/rd?#%x@db/x", "ss:w"),
            ("postgres://u@db/x?pass%77ord=hunter2", "hunter2"),
            (
                "postgres://u@db/x?sslpassword=keyPassphrase9",
                "keyPassphrase9",
            ),
            ("postgres://u@db/x?PASSWORD=Upper1", "Upper1"),
            ("postgres://u:s%40cret@db/x", "cret"),
        ] {
            let Storage::Postgres(u) = parse(url).unwrap().database else {
                panic!("{url}")
            };
            let shown = u.to_string();
            assert!(!shown.contains(secret), "{url} -> {shown}");
        }
    }

    #[test]
    fn the_lock_timeout_is_a_few_seconds_at_most() {
        let parse = |s: &str| {
            let flag = format!("--postgres-lock-timeout={s}");
            Cli::try_parse_from(["tally", flag.as_str()]).map(|c| c.settings.postgres_lock_timeout)
        };
        assert_eq!(parse("2.5").unwrap(), Duration::from_millis(2500));
        assert_eq!(parse("9").unwrap(), Duration::from_secs(9));
        for bad in ["-1", "0", "9.5", "10", "nan", "inf"] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("between 0.001 and 9 seconds"), "{bad}: {e}");
        }
        assert!(
            parse("abc")
                .unwrap_err()
                .to_string()
                .contains("not a number")
        );
        assert_eq!(
            Settings::for_database("x.db").postgres_lock_timeout,
            Duration::from_secs(2)
        );
    }

    #[test]
    fn the_storage_limit_takes_bytes_or_a_unit() {
        let parse = |s: &str| {
            let flag = format!("--storage-limit={s}");
            Cli::try_parse_from(["tally", flag.as_str()]).map(|c| c.settings.storage_limit)
        };
        assert_eq!(Settings::for_database("x.db").storage_limit, None);
        assert_eq!(parse("1073741824").unwrap(), Some(1 << 30));
        assert_eq!(parse("1Gi").unwrap(), Some(1 << 30));
        assert_eq!(parse("1.5Gi").unwrap(), Some(3 << 29));
        assert_eq!(parse("2G").unwrap(), Some(2_000_000_000));
        assert_eq!(parse("600Mi").unwrap(), Some(600 << 20));
        assert_eq!(parse("9000k").unwrap(), Some(9_000_000));
        for bad in [
            "", "Gi", "1GB", "1 g", "-1Gi", "1.5", "0x10", "512m", "nan", "1e9",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("is not a size"), "{bad}: {e}");
        }
        for small in ["0", "1000", "1000k", "1Mi", "4Mi", "8388607"] {
            let e = parse(small).unwrap_err().to_string();
            assert!(e.contains("at least 8Mi"), "{small}: {e}");
        }
        assert_eq!(parse("8Mi").unwrap(), Some(8 << 20));
        for large in ["18446744073709551615", "99999999T"] {
            let e = parse(large).unwrap_err().to_string();
            assert!(e.contains("too large"), "{large}: {e}");
        }
    }

    #[test]
    fn the_key_ttl_is_a_duration_from_a_second_to_thirty_days() {
        let parse = |s: &str| {
            let flag = format!("--idempotency-key-ttl={s}");
            Cli::try_parse_from(["tally", flag.as_str()]).map(|c| c.settings.idempotency_key_ttl)
        };
        assert_eq!(
            Settings::for_database("x.db").idempotency_key_ttl,
            Duration::from_secs(24 * 3600)
        );
        assert_eq!(parse("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("15m").unwrap(), Duration::from_secs(900));
        assert_eq!(parse("1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse("7d").unwrap(), Duration::from_secs(7 * 86_400));
        for bad in [
            "", "h", "1w", "24 hours", "abc", "1h30m", "nan", "inf", "1e9",
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("is not a duration"), "{bad}: {e}");
        }
        for out in ["0", "0.5s", "-1h", "31d", "1000000000"] {
            let e = parse(out).unwrap_err().to_string();
            assert!(e.contains("between 1s and 30d"), "{out}: {e}");
        }
    }

    #[test]
    fn the_admin_token_is_what_a_request_can_present() {
        use secrecy::ExposeSecret;
        let parse = |s: &str| {
            let flag = format!("--admin-token={s}");
            Cli::try_parse_from(["tally", flag.as_str()])
                .map(|c| c.settings.admin_token.unwrap().expose_secret().to_owned())
        };
        assert_eq!(parse("s3cret").unwrap(), "s3cret");
        assert_eq!(parse("s3cret\n").unwrap(), "s3cret");
        assert_eq!(parse(" \ts3cret \r\n").unwrap(), "s3cret");
        assert_eq!(parse("").unwrap(), "");
    }

    #[test]
    fn a_schema_is_a_name_as_stored() {
        let parse = |s: &str| {
            let flag = format!("--postgres-schema={s}");
            Cli::try_parse_from(["tally", flag.as_str()]).map(|c| c.settings.postgres_schema)
        };
        assert_eq!(Settings::for_database("x.db").postgres_schema, None);
        for ok in ["public", "tally", "_t$1", "Tally", "a b", &"s".repeat(63)] {
            assert_eq!(parse(ok).unwrap().as_deref(), Some(ok));
        }
        for bad in ["", "a\nb", "a\u{7}", &"s".repeat(64)] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains("is not a schema name"), "{bad}: {e}");
        }
    }

    #[test]
    fn debug_redacts_the_admin_token() {
        let mut s = Settings::for_database("x.db");
        s.admin_token = Some("hunter2".into());
        let shown = format!("{s:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("[REDACTED]"));
    }
}
