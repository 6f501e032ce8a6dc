//! Real Litestream and a real S3 server (moto) on loopback, started and
//! stopped by the tests. `./scripts/test` installs both under `.tools/`.

pub use crate::loopback::{S3, free_port, tool};

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::helpers::Readers;

/// Everything one tally-under-Litestream deployment needs: a data
/// directory, a replica location, ports and a socket.
pub struct Deployment {
    pub dir: tempfile::TempDir,
    pub endpoint: String,
    pub bucket: String,
    pub replica_path: String,
    pub listen: SocketAddr,
    pub extra_env: Vec<(String, String)>,
}

impl Deployment {
    pub fn new(endpoint: &str, bucket: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        Deployment {
            dir,
            endpoint: endpoint.to_owned(),
            bucket: bucket.to_owned(),
            replica_path: "tally".to_owned(),
            listen: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            extra_env: Vec::new(),
        }
    }

    pub fn db(&self) -> PathBuf {
        self.dir.path().join("data/tally.db")
    }

    fn env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            ("TALLY_DATABASE", self.db().to_string_lossy().into_owned()),
            ("TALLY_LISTEN", self.listen.to_string()),
            (
                "TALLY_LITESTREAM_SOCKET",
                self.dir
                    .path()
                    .join("litestream.sock")
                    .to_string_lossy()
                    .into_owned(),
            ),
            ("TALLY_REPLICA_WAIT_TIMEOUT", "20".into()),
            (
                "TALLY_LITESTREAM",
                tool("litestream").to_string_lossy().into_owned(),
            ),
            ("TALLY_LOG_FORMAT", "json".into()),
            ("TALLY_ADMIN_TOKEN", crate::helpers::ADMIN.into()),
            ("LITESTREAM_BUCKET", self.bucket.clone()),
            ("LITESTREAM_PATH", self.replica_path.clone()),
            ("LITESTREAM_ENDPOINT", self.endpoint.clone()),
            ("LITESTREAM_REGION", "us-east-1".into()),
            ("LITESTREAM_FORCE_PATH_STYLE", "true".into()),
            (
                "LITESTREAM_METRICS_ADDR",
                format!("127.0.0.1:{}", free_port()),
            ),
            ("LITESTREAM_ACCESS_KEY_ID", "test".into()),
            ("LITESTREAM_SECRET_ACCESS_KEY", "test".into()),
            ("PATH", std::env::var("PATH").unwrap_or_default()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        env.extend(self.extra_env.iter().cloned());
        env
    }

    fn litestream(&self) -> Command {
        let mut cmd = Command::new(tool("litestream"));
        // This machine's AWS_CA_BUNDLE breaks every Litestream S3 call.
        cmd.env_clear()
            .envs(self.env())
            .current_dir(self.dir.path());
        cmd
    }

    /// `litestream restore -if-db-not-exists -if-replica-exists`, as the
    /// chart's init container runs it.
    pub fn restore(&self) -> std::process::Output {
        self.litestream()
            .args([
                "restore",
                "-config",
                &config(),
                "-if-db-not-exists",
                "-if-replica-exists",
            ])
            .arg(self.db())
            .output()
            .unwrap()
    }

    /// `tally restore-to --timestamp AT --at-every-start`, as the
    /// chart's init container runs it when `restore.timestamp` is set.
    pub fn restore_to(&self, at: &str) -> std::process::Output {
        self.restore_to_with(at, &["--at-every-start"])
    }

    /// `tally restore-to --timestamp AT`, as an operator runs it by hand.
    pub fn restore_to_by_hand(&self, at: &str) -> std::process::Output {
        self.restore_to_with(at, &[])
    }

    fn restore_to_with(&self, at: &str, extra: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_tally"))
            .env_clear()
            .envs(self.env())
            .current_dir(self.dir.path())
            .args([
                "restore-to",
                "--timestamp",
                at,
                "--litestream-config",
                &config(),
            ])
            .args(extra)
            .arg("--litestream")
            .arg(tool("litestream"))
            .output()
            .unwrap()
    }

    /// `litestream replicate -exec tally`.
    pub fn replicate(&self) -> Running {
        let mut child = self
            .litestream()
            .args([
                "replicate",
                "-config",
                &config(),
                "-exec",
                env!("CARGO_BIN_EXE_tally"),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("litestream starts");
        let logs = Arc::new(Mutex::new(Vec::<(Instant, String)>::new()));
        let (tx, serving) = mpsc::channel();
        let readers = Readers::default();
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let (logs, tx) = (Arc::clone(&logs), tx.clone());
            // Kept before it is told of: a test woken by the line finds it.
            readers.read_lines(pipe, move |line| {
                let serving = serde_json::from_str::<Value>(&line)
                    .is_ok_and(|v| v["fields"]["message"] == "serving");
                logs.lock().unwrap().push((Instant::now(), line));
                if serving {
                    let _ = tx.send(());
                }
            });
        }
        Running {
            child,
            logs,
            serving,
            listen: self.listen,
            readers,
        }
    }

    /// Deletes the local database and its WAL, as a new pod's emptyDir.
    pub fn wipe(&self) {
        std::fs::remove_dir_all(self.dir.path().join("data")).unwrap();
    }
}

fn config() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("litestream.yml")
        .to_string_lossy()
        .into_owned()
}

/// Litestream with tally as its child.
pub struct Running {
    pub child: Child,
    pub logs: Arc<Mutex<Vec<(Instant, String)>>>,
    serving: mpsc::Receiver<()>,
    pub listen: SocketAddr,
    /// Litestream's two pipes, which tally shares.
    pub readers: Readers,
}

impl Running {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    pub async fn wait_serving(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.serving.try_recv().is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("tally did not start serving: {}", self.log_text());
    }

    /// Polls tally's /metrics until `until` holds for the replica's
    /// series, or `limit` passes; returns the last exposition.
    pub async fn metrics_until(
        &self,
        limit: Duration,
        what: &str,
        until: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let text = reqwest::get(self.url("/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if until(&text) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "{what} within {limit:?}; last: {:?}",
                text.lines()
                    .filter(|l| l.starts_with("tally_replica"))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Asserts that nothing listens at tally's address for `held`, tried
    /// every 20 ms: tally waits at the replica gate for `why`.
    pub async fn not_listening_for(&self, held: Duration, why: &str) {
        let started = Instant::now();
        while started.elapsed() < held {
            assert!(
                tokio::net::TcpStream::connect(self.listen).await.is_err(),
                "tally listened before {why}: {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .map(|(_, l)| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Where the first line containing `needle` stands in tally's output.
    pub fn line_of(&self, needle: &str) -> Option<usize> {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, l)| l.contains("\"target\":\"tally"))
            .position(|(_, l)| l.contains(needle))
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    /// tally's pid: Litestream's child (started by any of its threads).
    pub fn tally_pid(&self) -> Option<i32> {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.child.id())).ok()?;
        tasks
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
            .flat_map(|c| c.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .find_map(|p| p.parse().ok())
    }

    pub async fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                self.readers.all_read(Duration::from_secs(10)).await;
                return s;
            }
            if Instant::now() > deadline {
                panic!(
                    "litestream did not exit within {limit:?}: {}",
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(pid) = self.tally_pid() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `pid` is gone: no such process, or a zombie (dead; its
/// reaping is up to whichever process inherited it). Fails after `limit`,
/// naming the process `what`.
pub async fn ended_within(pid: nix::unistd::Pid, limit: Duration, what: &str) {
    let running = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
    };
    let gone = Instant::now();
    while running() {
        assert!(
            gone.elapsed() < limit,
            "{what} left running after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
