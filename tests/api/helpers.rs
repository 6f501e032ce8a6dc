//! Starting tally for a test: the real router on port 0 with a fresh
//! database, or the real binary.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
        mpsc,
    },
    time::Duration,
};

use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};
use tally::{Application, Settings, Storage};
use tempfile::TempDir;
use tokio::{sync::oneshot, task::JoinHandle};

pub const ADMIN: &str = "test-admin-token";

/// Which engine the suite runs on: SQLite, unless `TALLY_TEST_ENGINE` is
/// `postgres` (then on a fresh database of the test server, see
/// `crate::postgres`). The test command runs the suite once with each.
pub fn on_postgres() -> bool {
    match std::env::var("TALLY_TEST_ENGINE").as_deref() {
        Ok("postgres") => true,
        Ok("sqlite") | Err(_) => false,
        Ok(other) => panic!("TALLY_TEST_ENGINE={other}: sqlite or postgres"),
    }
}

/// A database for the binary's `TALLY_DATABASE`: a SQLite file in `dir`, or
/// a fresh database on the test server when the suite runs on PostgreSQL.
pub async fn database_in(dir: &Path) -> String {
    match on_postgres() {
        true => crate::postgres::fresh_database().await,
        false => dir.join("tally.db").to_str().unwrap().to_owned(),
    }
}

/// A running in-process tally.
pub struct TestApp {
    pub addr: SocketAddr,
    /// The metrics listener's address, when it has one of its own.
    pub metrics_addr: Option<SocketAddr>,
    pub client: Client,
    /// The SQLite file (a path that does not exist on PostgreSQL).
    pub db_path: PathBuf,
    pub storage: Storage,
    pub db: tally::db::Handle,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
    _dir: TempDir,
}

pub fn settings(dir: &Path) -> Settings {
    let mut s = Settings::for_database(dir.join("tally.db"));
    s.listen = "127.0.0.1:0".parse().unwrap();
    s.admin_token = Some(ADMIN.into());
    s
}

/// Starts the real router with default test settings.
pub async fn spawn_app() -> TestApp {
    spawn_with(|_| {}).await
}

/// Starts the real router after `tweak` has adjusted the settings.
pub async fn spawn_with(tweak: impl FnOnce(&mut Settings)) -> TestApp {
    let dir = tempfile::tempdir().unwrap();
    let mut s = settings(dir.path());
    if on_postgres() {
        s.database = crate::postgres::fresh_database().await.parse().unwrap();
    }
    tweak(&mut s);
    let storage = s.database.clone();
    let db_path = storage
        .sqlite_path()
        .map_or_else(|| dir.path().join("not-sqlite"), ToOwned::to_owned);
    let app = Application::build(s).await.expect("app builds");
    let addr = app.local_addr();
    let metrics_addr = app.metrics_addr();
    let db = app.db();
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(app.run_until_stopped(async {
        let _ = stopped.await;
    }));
    TestApp {
        addr,
        metrics_addr,
        client: Client::new(),
        db_path,
        storage,
        db,
        stop: Some(stop),
        task: Some(task),
        _dir: dir,
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Waits until the slowed writer holds its `n`th batch: what is sent
    /// next queues behind it.
    pub async fn writer_holds(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.db.batches_held() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the writer never took batch {n}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    pub async fn post_json(&self, path: &str, body: Value) -> Response {
        self.client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    pub async fn get(&self, path: &str) -> Response {
        self.client.get(self.url(path)).send().await.unwrap()
    }

    pub async fn admin_put_budget(&self, name: &str, body: Value) -> Response {
        self.client
            .put(self.url(&format!("/budgets/{name}")))
            .bearer_auth(ADMIN)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// Creates a budget, asserting success.
    pub async fn budget(&self, name: &str, visitor_limit: u32, global_limit: u32) {
        let r = self
            .admin_put_budget(
                name,
                json!({"visitor_limit": visitor_limit, "global_limit": global_limit}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
    }

    pub async fn check(&self, budget: &str, visitor: &str, day: &str) -> Value {
        let r = self
            .post_json(
                &format!("/budgets/{budget}/check"),
                json!({"visitor": visitor, "day": day}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK);
        r.json().await.unwrap()
    }

    pub async fn usage(&self, budget: &str, query: &str) -> Value {
        let r = self.get(&format!("/budgets/{budget}/usage?{query}")).await;
        assert_eq!(r.status(), StatusCode::OK);
        r.json().await.unwrap()
    }

    /// A read-only look at the SQLite file, to check rows the API does not
    /// show. Tests that use it are SQLite's: they live in `on_sqlite/`.
    pub async fn peek(&self) -> sqlx::SqlitePool {
        assert!(!on_postgres(), "this test looks at SQLite itself");
        sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(&self.db_path)
                    .read_only(true),
            )
            .await
            .unwrap()
    }

    /// Runs `sql` on the database from outside tally, on a connection of
    /// its own, as another process would.
    pub async fn sql_behind(&self, sql: &'static str) {
        match &self.storage {
            Storage::Postgres(url) => behind(url.expose(), sql).await,
            _ => behind(self.db_path.to_str().unwrap(), sql).await,
        }
    }

    /// Stops the app the way SIGTERM would, and returns its result.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap()
    }
}

/// Asserts that `r` is a problem+json answer with `status`, and returns its body.
pub async fn problem(r: Response, status: StatusCode) -> Value {
    assert_eq!(r.status(), status, "unexpected status");
    let ct = r.headers()["content-type"].to_str().unwrap().to_owned();
    assert_eq!(ct, "application/problem+json");
    let id = r
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let body: Value = r.json().await.unwrap();
    for key in ["type", "title", "status", "detail"] {
        assert!(body.get(key).is_some(), "problem lacks `{key}`: {body}");
    }
    assert_eq!(body["status"], status.as_u16());
    // Every answer from the router names its request, in the header and in
    // the body alike (too long a URI and too large a head included); only
    // a connection refused past the cap, before any request is read, has
    // no id.
    if body["type"] != "/problems/too-many-connections" {
        let id = id.unwrap_or_else(|| panic!("a {status} problem without x-request-id: {body}"));
        assert_eq!(body["request_id"], id.as_str(), "{body}");
    }
    body
}

/// The pipes of a child process still being read, each by a thread of its
/// own. A line the child wrote just before it exited may still sit in the
/// pipe when the exit is seen; a test that reads the logs after the exit
/// first waits for every reader to reach the end of its pipe.
#[derive(Clone, Default)]
pub struct Readers(Arc<AtomicUsize>);

/// Held by a reader thread until its pipe ends.
pub struct Reading(Arc<AtomicUsize>);

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Readers {
    /// Counts one more pipe; taken before its thread starts, so that no
    /// wait can miss it.
    fn reading(&self) -> Reading {
        self.0.fetch_add(1, Ordering::SeqCst);
        Reading(Arc::clone(&self.0))
    }

    /// Reads `pipe` line by line on a thread of its own, handing each line
    /// to `on_line`, and counts the pipe as read once it ends.
    pub fn read_lines(
        &self,
        pipe: impl std::io::Read + Send + 'static,
        mut on_line: impl FnMut(String) + Send + 'static,
    ) {
        let reading = self.reading();
        std::thread::spawn(move || {
            let _reading = reading;
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                on_line(line);
            }
        });
    }

    /// Waits until every pipe has ended, at most `limit`: a process the
    /// child left behind could hold one open, and then what was read is
    /// all there is.
    pub async fn all_read(&self, limit: Duration) {
        let readers = self.clone();
        let _ = tokio::task::spawn_blocking(move || readers.all_read_blocking(limit)).await;
    }

    /// [`Readers::all_read`], for code that is not async.
    pub fn all_read_blocking(&self, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        while self.0.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The real binary, started with `env`; its stderr is collected.
pub struct Binary {
    pub child: Child,
    pub addr: SocketAddr,
    pub logs: Arc<Mutex<Vec<String>>>,
    readers: Readers,
}

/// Runs the binary with `env` (and nothing else of this process's) to
/// its exit, a start that must fail with status 1 within 30 s; its stderr.
/// One that is still running then is killed, and the test fails.
pub fn failed_start(env: &[(&str, &str)]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tally"))
        .env_clear()
        .env("TALLY_LISTEN", "127.0.0.1:0")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read while it runs: a full pipe would hold it up.
    let mut pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
        text
    });
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "tally started instead of failing: {}",
                reader.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = reader.join().unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    stderr
}

impl Binary {
    pub fn start(env: &[(&str, &str)]) -> Self {
        Self::start_through(&[], env)
    }

    /// The binary started through `prefix` (e.g. `prlimit`, which execs it:
    /// the pid stays tally's).
    pub fn start_through(prefix: &[&str], env: &[(&str, &str)]) -> Self {
        let tally = env!("CARGO_BIN_EXE_tally");
        let mut cmd = match prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(tally);
                c
            }
            None => Command::new(tally),
        };
        cmd.env_clear()
            .env("TALLY_LISTEN", "127.0.0.1:0")
            .env("TALLY_LOG_FORMAT", "json")
            .env("TALLY_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("tally binary starts");
        let stderr = child.stderr.take().unwrap();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = Arc::clone(&logs);
        let readers = Readers::default();
        // Kept before it is told of: a test woken by the line finds it.
        readers.read_lines(stderr, move |line| {
            let serving = serde_json::from_str::<Value>(&line)
                .ok()
                .filter(|v| v["fields"]["message"] == "serving")
                .map(|v| v["fields"]["addr"].as_str().unwrap().to_owned());
            sink.lock().unwrap().push(line);
            if let Some(addr) = serving {
                let _ = tx.send(addr);
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("tally did not start: {:?}", logs.lock().unwrap()))
            .parse()
            .unwrap();
        Binary {
            child,
            addr,
            logs,
            readers,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn sigterm(&self) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), signal).unwrap();
    }

    /// Waits for the process to exit, at most `limit`, and then for its
    /// last lines to be read.
    pub async fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                self.readers.all_read(Duration::from_secs(10)).await;
                return status;
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("tally did not exit within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What `/metrics` answers now.
    pub async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    pub fn log_text(&self) -> String {
        self.logs.lock().unwrap().join("\n")
    }

    /// Waits until the log holds `text`, failing with the log after
    /// `limit`.
    pub async fn logs_within(&self, text: &str, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        while !self.log_text().contains(text) {
            assert!(
                std::time::Instant::now() < deadline,
                "no `{text}` in {limit:?}: {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How many batches a writer slowed by `TALLY_TEST_WRITER_DELAY_MS`
    /// has taken and held so far.
    pub fn batches_held(&self) -> usize {
        let logs = self.logs.lock().unwrap();
        logs.iter()
            .filter(|l| l.contains("test hook: the writer holds its batch"))
            .count()
    }

    /// Waits until `n` writes have reached the writer: queued, or taken in
    /// a batch of a writer slowed by `TALLY_TEST_WRITER_DELAY_MS`. Queue
    /// depth alone says too little: the writer takes what has arrived, so
    /// its first batch may hold one write or several.
    pub async fn writes_accepted(&self, n: u64) {
        let client = reqwest::Client::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            // The batches first, then the queue: a batch taken between the
            // two readings is counted in neither (never twice).
            let taken: u64 = self
                .logs
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains("test hook: the writer holds its batch"))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter_map(|v| v["fields"]["commands"].as_u64())
                .sum();
            let queued = queue_depth(&client, &self.url("")).await;
            if taken + queued >= n {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "only {taken} taken and {queued} queued of {n} writes"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Waits until the slowed writer holds its `n`th batch: what is sent
    /// next queues behind it.
    pub async fn writer_holds(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.batches_held() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the writer never took batch {n}; its log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Load until a crash: `clients` loops posting to the counter at `url`
/// until `stop` is set or the server goes away. Returns what was
/// acknowledged (value, when).
pub struct Hammer {
    stop: Arc<std::sync::atomic::AtomicBool>,
    acked: Arc<std::sync::atomic::AtomicUsize>,
    tasks: Vec<JoinHandle<Vec<(i64, std::time::Instant)>>>,
}

impl Hammer {
    pub fn start(url: String, clients: usize) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let acked_all = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tasks = (0..clients)
            .map(|_| {
                let (url, stop) = (url.clone(), Arc::clone(&stop));
                let acked_all = Arc::clone(&acked_all);
                tokio::spawn(async move {
                    let client = Client::new();
                    let mut acked = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let Ok(r) = client.post(&url).send().await else {
                            break;
                        };
                        if r.status() != StatusCode::OK {
                            break;
                        }
                        let Ok(v) = r.json::<Value>().await else {
                            break;
                        };
                        acked.push((v["value"].as_i64().unwrap(), std::time::Instant::now()));
                        acked_all.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    acked
                })
            })
            .collect();
        Hammer {
            stop,
            acked: acked_all,
            tasks,
        }
    }

    /// Waits until `n` writes are acknowledged, or `limit` passes (a load
    /// measured in writes, not in time, however slow the host).
    pub async fn until_acknowledged(&self, n: usize, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        while self.acked.load(std::sync::atomic::Ordering::Relaxed) < n
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops the clients; every acknowledged write, sorted by value.
    pub async fn stop(self) -> Vec<(i64, std::time::Instant)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut acked = Vec::new();
        for t in self.tasks {
            acked.extend(t.await.unwrap());
        }
        acked.sort();
        acked
    }
}

/// Polls `/ready` at `base` (`http://host:port`) until the write queue holds
/// at least `depth` commands.
/// The write queue's depth as `/ready` at `base` tells it.
pub async fn queue_depth(client: &Client, base: &str) -> u64 {
    let ready: Value = client
        .get(format!("{base}/ready"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    ready["queue_depth"].as_u64().unwrap()
}

pub async fn wait_for_queue_depth(client: &Client, base: &str, depth: u64) {
    for _ in 0..1000 {
        if queue_depth(client, base).await >= depth {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("queue never reached depth {depth}");
}

/// The value of one series, written as the exposition prints it (`name` or
/// `name{labels}`), in a Prometheus text exposition.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// An answer's JSON body.
pub async fn json(r: Response) -> Value {
    r.json().await.unwrap()
}

/// Creates budget `name` through `bin`'s admin API, asserting success.
pub async fn put_budget(client: &reqwest::Client, bin: &Binary, name: &str, spec: Value) {
    let r = client
        .put(bin.url(&format!("/budgets/{name}")))
        .bearer_auth(ADMIN)
        .json(&spec)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
}

/// libfaketime's library, which moves the clock of the program it is
/// preloaded into.
pub fn faketime_library() -> PathBuf {
    std::fs::read_dir("/usr/lib")
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path().join("faketime/libfaketimeMT.so.1")))
        .find(|p| p.exists())
        .expect("libfaketime is missing: run ./scripts/install-tools")
}

/// Moves the clock libfaketime reads from `clock` (its
/// `FAKETIME_TIMESTAMP_FILE`, read at every call with `FAKETIME_NO_CACHE`)
/// to `offset` (as `+10d`) at once: a new file put in place, so that no
/// process reads one half written.
pub fn set_clock(clock: &Path, offset: &str) {
    let next = clock.with_extension("next");
    std::fs::write(&next, format!("{offset}\n")).unwrap();
    std::fs::rename(&next, clock).unwrap();
}

/// Runs `sql` on the database `db` (a SQLite file or a PostgreSQL URL)
/// from outside tally.
pub async fn behind(db: &str, sql: &'static str) {
    use sqlx::ConnectOptions;
    if on_postgres() {
        return crate::postgres::sql(db, sql).await;
    }
    let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(db)
        .connect()
        .await
        .unwrap();
    sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
}

/// What a query of one number answers on the database `db`.
pub async fn count_behind(db: &str, sql: &'static str) -> i64 {
    use sqlx::{ConnectOptions, Connection};
    if on_postgres() {
        let mut conn = sqlx::PgConnection::connect(db).await.unwrap();
        return sqlx::query_scalar(sql).fetch_one(&mut conn).await.unwrap();
    }
    let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(db)
        .connect()
        .await
        .unwrap();
    sqlx::query_scalar(sql).fetch_one(&mut conn).await.unwrap()
}

/// A connection outside tally to the SQLite database at `db`, holding a
/// read transaction (a snapshot in the WAL), as an operator's `sqlite3`
/// session left open does. Dropping it ends the transaction.
pub async fn reader_outside(db: &Path) -> sqlx::SqliteConnection {
    use sqlx::{ConnectOptions, Executor};
    let mut reader = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(db)
        .connect()
        .await
        .unwrap();
    reader
        .execute("BEGIN; SELECT count(*) FROM counters;")
        .await
        .unwrap();
    reader
}
