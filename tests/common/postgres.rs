//! PostgreSQL for the tests: a fresh database per test on the server the
//! test command started (`TALLY_TEST_POSTGRES`, see `scripts/test`), and
//! servers of their own for the tests that stop and start one. Shared by
//! the test binaries through `#[path]`.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use sqlx::{Connection, PgConnection};

/// The shared server's URL. Tests of the PostgreSQL engine need it: they
/// fail, rather than pass without running, when it is not set.
pub fn server_url() -> String {
    std::env::var("TALLY_TEST_POSTGRES").unwrap_or_else(|_| {
        panic!(
            "TALLY_TEST_POSTGRES is not set: run ./scripts/test, which starts a PostgreSQL \
             server for the tests, or point it at one (postgres://user@host:port/db)"
        )
    })
}

/// A new, empty database on the server at `server` (a URL), and its URL.
pub async fn fresh_database_on(server: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "tally_test_{}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let mut conn = PgConnection::connect(server)
        .await
        .unwrap_or_else(|e| panic!("cannot reach the test PostgreSQL server: {e}"));
    // The name is made here of digits and underscores, never of input.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    with_database(server, &name)
}

/// A new, empty database on the shared server.
pub async fn fresh_database() -> String {
    fresh_database_on(&server_url()).await
}

/// `server` with its database replaced by `db`.
fn with_database(server: &str, db: &str) -> String {
    let (base, query) = match server.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (server, String::new()),
    };
    let authority_end = base
        .find("://")
        .map(|i| i + 3)
        .and_then(|start| base[start..].find('/').map(|j| start + j))
        .unwrap_or(base.len());
    format!("{}/{db}{query}", &base[..authority_end])
}

/// Runs `sql` on the database at `url`, from outside tally.
pub async fn sql(url: &str, sql: &'static str) {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
    let _ = conn.close().await;
}

/// A PostgreSQL server of the test's own, on a free loopback port in a
/// temp directory, for tests that stop and start it. Stopped (immediate
/// shutdown) when dropped.
pub struct PgServer {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    /// Set for the server's processes (a clock of their own).
    env: Vec<(String, String)>,
}

impl PgServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server whose processes run with `env` set (libfaketime's, for a
    /// clock of their own).
    pub fn start_with(env: &[(&str, &str)]) -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL is missing: run ./scripts/install-tools")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("initdb").exists())
            .max()
            .expect("no PostgreSQL server binaries: run ./scripts/install-tools");
        let dir = tempfile::tempdir().unwrap();
        if is_root() {
            run(Command::new("chown").arg("postgres").arg(dir.path()));
        }
        let port = super::loopback::free_port();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let server = PgServer {
            dir,
            bin,
            port,
            env: env.collect(),
        };
        run(server
            .as_postgres("initdb")
            .arg("-D")
            .arg(server.data())
            .args(["-A", "trust", "-U", "tally", "--no-sync"]));
        server.start_again();
        server
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn as_postgres(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut c = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        };
        c.stdout(Stdio::null()).stderr(Stdio::piped());
        c
    }

    fn pg_ctl(&self, args: &[&str]) -> Command {
        let mut c = self.as_postgres("pg_ctl");
        c.arg("-D").arg(self.data()).args(args);
        c
    }

    /// The server's URL, database `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://tally@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server (again), waiting until it takes connections.
    pub fn start_again(&self) {
        let options = format!(
            "-k {} -p {} -c listen_addresses=127.0.0.1 -c max_connections=200",
            self.dir.path().display(),
            self.port
        );
        let log = self.dir.path().join("log");
        let start = || {
            let mut c = self.pg_ctl(&["-w", "-t", "30", "-o", &options, "-l"]);
            c.arg(&log)
                .arg("start")
                .envs(self.env.iter().map(|(k, v)| (k, v)));
            c
        };
        // libfaketime (0.9.10) shares a semaphore from the first process
        // it is preloaded into (runuser, then pg_ctl) with their children,
        // and the one that made it removes it when it exits: a process
        // that opens it a moment late exits 1 ("sem_open failed and
        // recreation attempts failed"), and pg_ctl fails, whether the
        // server started or not. Seen once in a CI run (the server had
        // started): such a start counts if the server answers within
        // pg_ctl's 30 s, and is tried again if it is not running.
        for _ in 1..3 {
            let out = start().output().unwrap();
            if out.status.success() {
                return;
            }
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(said.contains("libfaketime:"), "pg_ctl start failed: {said}");
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while self.pg_ctl(&["status"]).status().unwrap().success() {
                let ready = self
                    .as_postgres("pg_isready")
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                    .status()
                    .unwrap();
                if ready.success() {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the server runs but takes no connection: {said}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        run(&mut start());
    }

    /// Stops the server the way an operator or a failover would: fast
    /// shutdown, which ends every session at once.
    pub fn stop_fast(&self) {
        run(&mut self.pg_ctl(&["-w", "-m", "fast", "stop"]));
    }
}

impl PgServer {
    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server and every backend:
    /// connections stay open and nothing answers, as in a network
    /// partition.
    pub fn freeze(&self, frozen: bool) {
        use nix::sys::signal::{Signal, kill};
        let pid_file = std::fs::read_to_string(self.data().join("postmaster.pid")).unwrap();
        let postmaster: i32 = pid_file.lines().next().unwrap().trim().parse().unwrap();
        let mut pids = vec![postmaster];
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // The parent pid is the second field after the command name.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<i32>().ok());
            if ppid == Some(postmaster) {
                pids.push(pid);
            }
        }
        let signal = if frozen {
            Signal::SIGSTOP
        } else {
            Signal::SIGCONT
        };
        for pid in pids {
            let _ = kill(nix::unistd::Pid::from_raw(pid), signal);
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.freeze(false);
        let _ = self
            .pg_ctl(&["-m", "immediate", "stop"])
            .stderr(Stdio::null())
            .status();
    }
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn run(c: &mut Command) {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits until `url` takes connections again, at most `limit`.
pub async fn wait_until_up(url: &str, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    while PgConnection::connect(url).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "PostgreSQL did not come back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Replication: a primary, its streaming standby, and a failover, as an HA
/// manager (Patroni, CloudNativePG) runs them.
impl PgServer {
    /// A streaming standby of `primary` on a port of its own: a base backup
    /// (`pg_basebackup -R -X stream`, which writes `standby.signal` and
    /// `primary_conninfo`), started. Read-only until [`Self::promote`].
    /// initdb's `-A trust` pg_hba already lets loopback connect for
    /// replication.
    pub fn standby_of(primary: &PgServer) -> Self {
        let dir = tempfile::tempdir().unwrap();
        if is_root() {
            run(Command::new("chown").arg("postgres").arg(dir.path()));
        }
        let port = super::loopback::free_port();
        let standby = PgServer {
            dir,
            bin: primary.bin.clone(),
            port,
            env: primary.env.clone(),
        };
        run(standby
            .as_postgres("pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", "tally", "-D"])
            .arg(standby.data())
            // A spread checkpoint would make the backup wait minutes on a
            // server that has just copied a template database.
            .args(["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"]));
        standby.start_again();
        standby
    }

    /// Makes every COMMIT here wait until a standby has flushed it, and
    /// waits until a standby is synchronous. Set with `ALTER SYSTEM` after
    /// the base backup, so the standby does not inherit it: promoted, it
    /// would wait for a standby of its own that does not exist.
    pub async fn replicate_synchronously(&self) {
        sql(
            &self.url(),
            "ALTER SYSTEM SET synchronous_standby_names = '*'",
        )
        .await;
        sql(&self.url(), "SELECT pg_reload_conf()").await;
        self.until(
            "SELECT count(*) > 0 FROM pg_stat_replication WHERE sync_state = 'sync'",
            "no standby became synchronous",
        )
        .await;
    }

    /// Waits until a standby streams from this server.
    pub async fn wait_for_streaming_standby(&self) {
        self.until(
            "SELECT count(*) > 0 FROM pg_stat_replication WHERE state = 'streaming'",
            "no standby streams from this server",
        )
        .await;
    }

    /// Waits until this standby has replayed all that `primary` has
    /// written so far: a read here sees every commit made there before.
    pub async fn wait_to_replay(&self, primary: &PgServer) {
        let mut conn = PgConnection::connect(&primary.url()).await.unwrap();
        let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        let _ = conn.close().await;
        let mut conn = PgConnection::connect(&self.url()).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let replayed: Option<bool> =
                sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                    .bind(&written)
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
            if replayed == Some(true) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the standby did not replay up to {written}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = conn.close().await;
    }

    /// Polls `query` (one boolean) here until it is true, at most 20 s.
    async fn until(&self, query: &'static str, failure: &str) {
        let mut conn = PgConnection::connect(&self.url()).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !sqlx::query_scalar::<_, bool>(query)
            .fetch_one(&mut conn)
            .await
            .unwrap()
        {
            assert!(std::time::Instant::now() < deadline, "{failure}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = conn.close().await;
    }

    /// Commits without waiting for any standby: what an HA manager sets on
    /// a promoted standby that has none yet, or whose standby is gone.
    pub async fn replicate_asynchronously(&self) {
        sql(
            &self.url(),
            "ALTER SYSTEM SET synchronous_standby_names = ''",
        )
        .await;
        sql(&self.url(), "SELECT pg_reload_conf()").await;
    }

    /// Promotes this standby, returning once it takes writes.
    pub fn promote(&self) {
        run(&mut self.pg_ctl(&["-w", "-t", "30", "promote"]));
    }

    /// Starts this stopped former primary again as a standby of `primary`
    /// (the new one), as an HA manager demotes it after a failover: never a
    /// second primary.
    pub fn start_as_standby_of(&self, primary: &PgServer) {
        let conninfo = format!(
            "\nprimary_conninfo = 'host=127.0.0.1 port={} user=tally'\n",
            primary.port
        );
        let auto_conf = self.data().join("postgresql.auto.conf");
        let mut conf = std::fs::read_to_string(&auto_conf).unwrap();
        conf.push_str(&conninfo);
        std::fs::write(&auto_conf, conf).unwrap();
        let signal = self.data().join("standby.signal");
        std::fs::write(&signal, "").unwrap();
        if is_root() {
            run(Command::new("chown").arg("postgres").arg(&signal));
        }
        self.start_again();
    }
}
