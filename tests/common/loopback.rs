//! Programs the tests run for real on loopback: the pinned tools under
//! `.tools/` (installed by `./scripts/install-tools`) and a moto S3 server,
//! started and stopped by the test. Shared by the test binaries through
//! `#[path]`.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

pub fn tool(name: &str) -> PathBuf {
    tool_in("venv/bin", name)
}

/// A pinned tool at `.tools/<dir>/<name>`.
pub fn tool_in(dir: &str, name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".tools")
        .join(dir)
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: run ./scripts/test, which installs the pinned tools",
        p.display()
    );
    p
}

/// A loopback port free now, for a server the test starts later.
///
/// Taken below Linux's ephemeral range (32768-60999 by default), where the
/// kernel never picks a port by itself: a port the kernel handed out (as
/// `bind(0)` did here before) could be given again to another test's
/// outgoing connection before this test's server bound it, which failed a
/// container start with "Address already in use". A counter keeps the
/// tests of one binary apart, the process id spreads binaries over the
/// range, and the bind skips a port something else holds.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const PORTS: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let offset = std::process::id().wrapping_mul(7919) % PORTS;
    for _ in 0..PORTS {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (FIRST + (offset + n) % PORTS) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FIRST}..{}", FIRST + PORTS)
}

/// A moto S3 server on a loopback port, killed on drop.
pub struct S3 {
    child: Child,
    pub endpoint: String,
}

impl S3 {
    pub async fn start() -> Self {
        let port = free_port();
        let child = Command::new(tool("moto_server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("moto_server starts");
        let endpoint = format!("http://127.0.0.1:{port}");
        let s3 = S3 { child, endpoint };
        let client = reqwest::Client::new();
        for _ in 0..200 {
            if client.get(&s3.endpoint).send().await.is_ok() {
                return s3;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("moto did not start on port {port}");
    }

    pub async fn create_bucket(&self, bucket: &str) {
        let r = reqwest::Client::new()
            .put(format!("{}/{bucket}", self.endpoint))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "bucket: {}", r.status());
    }
}

impl S3 {
    /// Freezes the server (SIGSTOP): calls to it hang until [`Self::resume`].
    /// Returns once every thread of it has stopped: the signal is only
    /// queued when `kill` returns, and a thread running on another core
    /// can still finish an answer in the meantime. (An answer already
    /// written before the stop still reaches its client.)
    pub fn pause(&self) {
        self.send(nix::sys::signal::Signal::SIGSTOP);
        let pid = self.child.id();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !all_stopped(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "moto (pid {pid}) did not stop within 10 s of SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn resume(&self) {
        self.send(nix::sys::signal::Signal::SIGCONT);
    }

    fn send(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }
}

/// Whether every thread of process `pid` is stopped (`T` in its
/// `/proc` stat), or the process is gone.
fn all_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|task| {
        // The state follows the command's name, which is in parentheses
        // and may hold anything, so it is read after the last `)`.
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                Some(
                    stat.rsplit_once(')')?
                        .1
                        .trim_start()
                        .starts_with(['T', 't']),
                )
            })
            .unwrap_or(true)
    })
}

impl Drop for S3 {
    fn drop(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
