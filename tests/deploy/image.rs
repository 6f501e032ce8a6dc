//! The container image: the repository's `Dockerfile`, unchanged, built
//! with podman against local stand-ins for its base images
//! (`scripts/standin-images`: no image registry is reachable here), then
//! run for real with a read-only root filesystem, host networking and moto
//! on loopback: restore -> replicate -> write -> SIGTERM (exit 0) -> wipe
//! the data directory -> restore -> every acknowledged write present.

use std::{
    fs::File,
    io::{Read, Seek, SeekFrom},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use reqwest::{Client, StatusCode};
use serde_json::Value;

use crate::loopback::{S3, free_port, tool_in};

/// The tag the tests build and run: one per checkout (named after a hash of
/// its path), so that two checkouts tested on one machine at once never run
/// each other's image.
pub fn tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        env!("CARGO_MANIFEST_DIR").hash(&mut hasher);
        format!("localhost/tally:test-{:08x}", hasher.finish() as u32)
    })
}

/// The most the image may weigh, as podman counts it (the uncompressed
/// layers, in decimal megabytes): every node a pod lands on pulls it.
const SIZE_LIMIT: u64 = 80_000_000;

/// A data volume that lives as long as its container, owned by the image's
/// user (`U`).
const DATA_TMPFS: &str = "/data:rw,size=64m,U";

/// A cold build compiles every dependency in release mode on two cores.
const BUILD_LIMIT: Duration = Duration::from_secs(40 * 60);

/// Builds the stand-ins and then the image from the repository's
/// Dockerfile, once per test process, and returns its tag. Later calls
/// return at once (or panic again with the first failure).
pub fn built() -> &'static str {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    if let Err(e) = BUILT.get_or_init(build) {
        panic!("{e}");
    }
    tag()
}

fn build() -> Result<(), String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("image-build.log");
    let started = Instant::now();
    let deadline = started + BUILD_LIMIT;
    let steps: [(&str, Vec<&str>); 2] = [
        ("the stand-in base images", vec!["scripts/standin-images"]),
        (
            "the image",
            // Other test processes may build at the same moment; the lock
            // makes the second one a fully cached rebuild. --pull=never:
            // a missing stand-in fails at once instead of trying a registry.
            vec![
                "flock",
                "--timeout",
                "2400",
                ".tools/images/.build.lock",
                "podman",
                "build",
                "--runtime",
                "runc",
                "--network",
                "host",
                "--pull=never",
                "-t",
                tag(),
                ".",
            ],
        ),
    ];
    let mut file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    for (what, argv) in steps {
        let mut child = Command::new(argv[0])
            .args(&argv[1..])
            .current_dir(root)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file.try_clone().unwrap())
            // Its own process group, so that a timeout can kill the whole
            // build, not only its first process.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", argv[0]))?;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(child.id() as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        if status.is_none_or(|s| !s.success()) {
            let outcome = match status {
                Some(s) => format!("failed ({s})"),
                None => format!("did not finish within {BUILD_LIMIT:?}"),
            };
            return Err(format!(
                "building {what} {outcome}: `{}` in {}\n--- last lines of {} ---\n{}",
                argv.join(" "),
                root.display(),
                log.display(),
                tail(&mut file, 16 * 1024)
            ));
        }
    }
    eprintln!(
        "image {} built in {:.0?} (log: {})",
        tag(),
        started.elapsed(),
        log.display()
    );
    Ok(())
}

/// The last `bytes` of a log.
fn tail(file: &mut File, bytes: u64) -> String {
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(bytes)));
    let mut text = Vec::new();
    let _ = file.read_to_end(&mut text);
    String::from_utf8_lossy(&text).into_owned()
}

/// `podman ARGS`, bounded in time.
async fn podman(args: &[String], limit: Duration) -> Output {
    tokio::time::timeout(
        limit,
        tokio::process::Command::new("podman")
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("podman {} took longer than {limit:?}", args.join(" ")))
    .expect("podman runs")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A container name unique to this run, removed on drop even when the test
/// fails (a failed test must not leave a container holding a port).
struct Container {
    name: String,
}

impl Container {
    fn new(role: &str) -> Self {
        Container {
            name: format!(
                "tally-image-{role}-{}-{:08x}",
                std::process::id(),
                fastrand::u32(..)
            ),
        }
    }

    async fn inspect(&self, format: &str) -> String {
        let out = podman(
            &strings(&["inspect", "--format", format, &self.name]),
            Duration::from_secs(30),
        )
        .await;
        assert!(out.status.success(), "inspect: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    async fn logs(&self) -> String {
        text(&podman(&strings(&["logs", &self.name]), Duration::from_secs(30)).await)
    }

    /// The host's view of a process of the container: PID 1 and its
    /// children, from /proc.
    async fn processes(&self) -> Vec<Proc> {
        let pid1: i32 = self.inspect("{{.State.Pid}}").await.parse().unwrap();
        let mut procs = vec![Proc::read(pid1)];
        let tasks = std::fs::read_dir(format!("/proc/{pid1}/task")).unwrap();
        for task in tasks {
            let children =
                std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default();
            for child in children.split_whitespace() {
                procs.push(Proc::read(child.parse().unwrap()));
            }
        }
        procs
    }

    /// `podman stop -t 30` (SIGTERM, then SIGKILL after 30 s); returns the
    /// exit code and how long the stop took.
    async fn stop(&self) -> (i32, Duration) {
        let started = Instant::now();
        let out = podman(
            &strings(&["stop", "-t", "30", &self.name]),
            Duration::from_secs(60),
        )
        .await;
        let took = started.elapsed();
        assert!(out.status.success(), "stop: {}", text(&out));
        let code = self.inspect("{{.State.ExitCode}}").await.parse().unwrap();
        (code, took)
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .args(["rm", "--force", "--time", "0", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A process as /proc shows it.
#[derive(Debug)]
struct Proc {
    args: Vec<String>,
    uid: String,
    gid: String,
    cap_eff: String,
}

impl Proc {
    fn read(pid: i32) -> Self {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap_or_default()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        Proc {
            args: cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect(),
            // Real, effective, saved and file-system ids.
            uid: field("Uid:"),
            gid: field("Gid:"),
            cap_eff: field("CapEff:"),
        }
    }
}

/// `podman run` as every test here runs the image: host network, a
/// read-only root filesystem with `data` (a mount option and its value) as
/// the one writable place, the ulimits runc needs on this kind of machine,
/// `env`, and `command` (none: the image's default).
fn run_args(
    image: &str,
    c: &Container,
    detach: bool,
    data: [&str; 2],
    env: &[(String, String)],
    command: &[&str],
) -> Vec<String> {
    let mut args = strings(&["run", "--name", &c.name]);
    if detach {
        args.push("--detach".into());
    }
    args.extend(strings(&[
        "--pull=never",
        "--runtime",
        "runc",
        "--network",
        "host",
        "--read-only",
        // Without this podman mounts writable tmpfs on /tmp, /var/tmp and
        // /run; a Kubernetes readOnlyRootFilesystem has none.
        "--read-only-tmpfs=false",
        data[0],
        data[1],
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
    ]));
    for (k, v) in env {
        args.push("--env".into());
        args.push(format!("{k}={v}"));
    }
    args.push(image.into());
    args.extend(strings(command));
    args
}

/// One deployment of the image: a data directory on the host that outlives
/// each container (as a pod's volume outlives a container restart, and so
/// that a wipe is something the test does and sees), S3 settings and
/// loopback ports.
struct Deployment {
    image: &'static str,
    data: tempfile::TempDir,
    env: Vec<(String, String)>,
    http: u16,
}

impl Deployment {
    fn new(image: &'static str, s3: &S3, bucket: &str) -> Self {
        let data = tempfile::tempdir().unwrap();
        // The image's user: the only writer of /data.
        std::os::unix::fs::chown(data.path(), Some(65532), Some(65532)).unwrap();
        let http = free_port();
        let env = [
            // Loopback, not the image's 0.0.0.0: the host network is shared.
            ("TALLY_LISTEN", format!("127.0.0.1:{http}")),
            ("TALLY_METRICS_LISTEN", format!("127.0.0.1:{}", free_port())),
            ("TALLY_REPLICA_WAIT_TIMEOUT", "30".to_owned()),
            ("TALLY_LOG_FORMAT", "json".to_owned()),
            ("LITESTREAM_BUCKET", bucket.to_owned()),
            ("LITESTREAM_PATH", "tally".to_owned()),
            ("LITESTREAM_ENDPOINT", s3.endpoint.clone()),
            ("LITESTREAM_REGION", "us-east-1".to_owned()),
            ("LITESTREAM_FORCE_PATH_STYLE", "true".to_owned()),
            ("LITESTREAM_ACCESS_KEY_ID", "test".to_owned()),
            ("LITESTREAM_SECRET_ACCESS_KEY", "test".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        Deployment {
            image,
            data,
            env,
            http,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http)
    }

    fn db(&self) -> PathBuf {
        self.data.path().join("tally.db")
    }

    fn run_args(&self, c: &Container, detach: bool, command: &[&str]) -> Vec<String> {
        let volume = format!("{}:/data", self.data.path().display());
        run_args(
            self.image,
            c,
            detach,
            ["--volume", &volume],
            &self.env,
            command,
        )
    }

    /// The chart's init container: restore unless there is a database or
    /// nothing to restore.
    async fn restore(&self) {
        let c = Container::new("restore");
        let out = podman(
            &self.run_args(
                &c,
                false,
                &[
                    "litestream",
                    "restore",
                    "-config",
                    "/etc/litestream.yml",
                    "-if-db-not-exists",
                    "-if-replica-exists",
                    "/data/tally.db",
                ],
            ),
            Duration::from_secs(120),
        )
        .await;
        assert!(out.status.success(), "restore failed: {}", text(&out));
    }

    /// The image's default command, detached, once it serves.
    async fn start(&self) -> Container {
        let c = Container::new("serve");
        let out = podman(&self.run_args(&c, true, &[]), Duration::from_secs(60)).await;
        assert!(out.status.success(), "run: {}", text(&out));
        wait_ready(&c, &self.url("/ready")).await;
        c
    }

    /// Deletes everything in the data directory, as a new pod's empty volume.
    fn wipe(&self) {
        for entry in std::fs::read_dir(self.data.path()).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
        }
    }
}

/// Polls `/ready` until it answers 200, failing early with the logs if the
/// container exits.
async fn wait_ready(c: &Container, url: &str) {
    let client = Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Ok(r) = client.get(url).send().await
            && r.status() == StatusCode::OK
        {
            return;
        }
        let running = c.inspect("{{.State.Running}}").await;
        if running != "true" || Instant::now() > deadline {
            panic!(
                "{} never became ready (running: {running}):\n{}",
                c.name,
                c.logs().await
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn post(client: &Client, url: &str) -> Result<Value, reqwest::Error> {
    client
        .post(url)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await
}

async fn value(client: &Client, url: &str) -> i64 {
    let v: Value = client.get(url).send().await.unwrap().json().await.unwrap();
    v["value"].as_i64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_restores_replicates_stops_cleanly_and_restores_after_a_wipe() {
    let image = built();
    let s3 = S3::start().await;
    s3.create_bucket("image").await;
    let d = Deployment::new(image, &s3, "image");
    let client = Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();

    // First deploy: an empty replica restores nothing and succeeds.
    d.restore().await;
    assert!(!d.db().exists(), "restore from an empty replica made a db");

    let c = d.start().await;
    let mut expected = Vec::new();
    for (name, n) in [("kept", 25), ("other", 3)] {
        for _ in 0..n {
            post(&client, &d.url(&format!("/counters/{name}")))
                .await
                .unwrap();
        }
        expected.push((name, n));
    }

    // Litestream is PID 1 (env exec'd it; no shell in between), tally its
    // only child, both as 65532:65532 without capabilities.
    let procs = c.processes().await;
    assert_eq!(procs.len(), 2, "{procs:?}");
    assert_eq!(procs[0].args[..2], ["litestream", "replicate"], "{procs:?}");
    assert_eq!(procs[1].args, ["tally"], "{procs:?}");
    for p in &procs {
        assert_eq!(p.uid, "65532 65532 65532 65532", "{p:?}");
        assert_eq!(p.gid, "65532 65532 65532 65532", "{p:?}");
        assert_eq!(p.cap_eff, "0000000000000000", "{p:?}");
    }
    // Read-only even for root, /tmp included: only /data is writable. The
    // image has no program that writes a file, so the host writes, as root,
    // through the container's own view of its file system (its PID 1's
    // root directory).
    assert_eq!(c.inspect("{{.HostConfig.ReadonlyRootfs}}").await, "true");
    let root = format!("/proc/{}/root", c.inspect("{{.State.Pid}}").await);
    for path in ["/etc/probe", "/tmp/probe", "/probe", "/usr/local/bin/probe"] {
        let written = std::fs::write(format!("{root}{path}"), "x");
        assert!(
            written
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ReadOnlyFilesystem),
            "{path}: {written:?}"
        );
    }
    let probe = format!("{root}/data/probe");
    std::fs::write(&probe, "x").expect("/data is writable");
    std::fs::remove_file(&probe).unwrap();

    // Writes race the SIGTERM: whatever was acknowledged, up to the last
    // moment, reaches the replica only through tally's drain and
    // Litestream's final sync (its periodic sync runs once a second).
    let burst = {
        let (client, url) = (client.clone(), d.url("/counters/burst"));
        tokio::spawn(async move {
            let (mut acked, mut unknown) = (0, 0);
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                match post(&client, &url).await {
                    Ok(_) => acked += 1,
                    // Refused, or 503 (shutting down) before it ran:
                    // nothing was written.
                    Err(e)
                        if e.is_connect()
                            || e.status() == Some(StatusCode::SERVICE_UNAVAILABLE) =>
                    {
                        break;
                    }
                    Err(_) => {
                        unknown += 1;
                        break;
                    }
                }
            }
            (acked, unknown)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, took) = c.stop().await;
    let logs = c.logs().await;
    let (acked, unknown) = burst.await.unwrap();
    assert_eq!(code, 0, "exit code after SIGTERM:\n{logs}");
    assert!(
        took < Duration::from_secs(25),
        "stop took {took:?}:\n{logs}"
    );
    assert!(acked > 0, "no write was acknowledged before the stop");
    eprintln!("stop took {took:?}; writes racing it: {acked} acknowledged, {unknown} unknown");
    for line in [
        "signal received, litestream shutting down",
        "stopped cleanly",
        "litestream shut down",
    ] {
        assert!(logs.contains(line), "no {line:?} in:\n{logs}");
    }
    for bad in [
        "shutdown sync failed",
        "failed to close database",
        "\"ERROR\"",
    ] {
        assert!(!logs.contains(bad), "{bad:?} in:\n{logs}");
    }
    drop(c);

    // A new pod on an empty volume gets everything back.
    assert!(d.db().exists());
    d.wipe();
    d.restore().await;
    assert!(d.db().exists(), "nothing was restored");
    let c = d.start().await;
    for (name, n) in expected {
        assert_eq!(
            value(&client, &d.url(&format!("/counters/{name}"))).await,
            n
        );
    }
    let burst_value = value(&client, &d.url("/counters/burst")).await;
    assert!(
        (acked..=acked + unknown).contains(&burst_value),
        "burst: {acked} acknowledged (+{unknown} unknown), {burst_value} restored"
    );
    let (code, _) = c.stop().await;
    assert_eq!(code, 0, "{}", c.logs().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_tally_alone_when_the_command_is_overridden() {
    let image = built();

    // What the image declares.
    let out = podman(
        &strings(&["image", "inspect", "--format", "{{json .Config}}", image]),
        Duration::from_secs(30),
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let config: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(config["User"], "65532:65532");
    assert_eq!(
        config["Cmd"],
        serde_json::json!([
            "env",
            "TALLY_LITESTREAM_SOCKET=/data/litestream.sock",
            "litestream",
            "replicate",
            "-config",
            "/etc/litestream.yml",
            "-exec",
            "tally"
        ])
    );
    assert!(config["Entrypoint"].is_null(), "{config}");
    let ports = config["ExposedPorts"].as_object().unwrap();
    assert!(ports.contains_key("3000/tcp") && ports.contains_key("9100/tcp"));
    assert_eq!(
        config["Labels"]["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION"),
        "the image's version label must follow Cargo.toml"
    );

    let c = Container::new("version");
    let out = podman(
        &run_args(
            image,
            &c,
            false,
            ["--tmpfs", DATA_TMPFS],
            &[],
            &["tally", "--version"],
        ),
        Duration::from_secs(60),
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("tally {}", env!("CARGO_PKG_VERSION"))
    );

    // Embedded mode: no Litestream, no socket, tally is PID 1 and stops on
    // SIGTERM by itself.
    let c = Container::new("embedded");
    let port = free_port();
    let env = [
        ("TALLY_LISTEN", format!("127.0.0.1:{port}")),
        ("TALLY_METRICS_LISTEN", format!("127.0.0.1:{}", free_port())),
    ]
    .map(|(k, v)| (k.to_owned(), v));
    let out = podman(
        &run_args(image, &c, true, ["--tmpfs", DATA_TMPFS], &env, &["tally"]),
        Duration::from_secs(60),
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let url = |p: &str| format!("http://127.0.0.1:{port}{p}");
    wait_ready(&c, &url("/ready")).await;
    let client = Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let v = post(&client, &url("/counters/alone")).await.unwrap();
    assert_eq!(v["value"], 1);
    let procs = c.processes().await;
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(procs[0].args, ["tally"]);
    assert_eq!(procs[0].uid, "65532 65532 65532 65532");
    let (code, took) = c.stop().await;
    assert_eq!(code, 0, "{}", c.logs().await);
    assert!(took < Duration::from_secs(25), "stop took {took:?}");
}

/// The image as the chart runs it with `storage: postgres`: tally alone, a
/// read-only root filesystem with only a tmpfs, the database a PostgreSQL
/// URL. Two processes on one database share one counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_serves_from_postgres_as_the_chart_runs_it() {
    let image = built();
    let db = crate::postgres::fresh_database().await;
    let client = Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut containers = Vec::new();
    for n in 0..2 {
        let c = Container::new(&format!("postgres-{n}"));
        let port = free_port();
        let env = [
            ("TALLY_DATABASE", db.clone()),
            ("TALLY_LISTEN", format!("127.0.0.1:{port}")),
            ("TALLY_METRICS_LISTEN", format!("127.0.0.1:{}", free_port())),
            ("TMPDIR", "/tmp".to_owned()),
        ]
        .map(|(k, v)| (k.to_owned(), v));
        let out = podman(
            &run_args(
                image,
                &c,
                true,
                ["--tmpfs", "/tmp:rw,size=64m,mode=1777"],
                &env,
                &["tally"],
            ),
            Duration::from_secs(60),
        )
        .await;
        assert!(out.status.success(), "{}", text(&out));
        let url = move |p: &str| format!("http://127.0.0.1:{port}{p}");
        wait_ready(&c, &url("/ready")).await;
        containers.push((c, url));
    }
    for (c, url) in &containers {
        let v = post(&client, &url("/counters/shared")).await;
        assert!(v.is_ok(), "{v:?}: {}", c.logs().await);
    }
    for (c, url) in &containers {
        assert_eq!(value(&client, &url("/counters/shared")).await, 2);
        let logs = c.logs().await;
        assert!(logs.contains("PostgreSQL open"), "{logs}");
    }
    for (c, _) in &containers {
        let (code, took) = c.stop().await;
        assert_eq!(code, 0, "{}", c.logs().await);
        assert!(took < Duration::from_secs(25), "stop took {took:?}");
    }
}

/// A container of `image`, created and never started, to read the image's
/// files from: the image has no program that could print them.
async fn created(image: &str) -> Container {
    let c = Container::new("files");
    let out = podman(
        &strings(&["create", "--pull=never", "--name", &c.name, image]),
        Duration::from_secs(60),
    )
    .await;
    assert!(out.status.success(), "create: {}", text(&out));
    c
}

/// One file of the image.
async fn image_file(image: &str, path: &str) -> Vec<u8> {
    let c = created(image).await;
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("copy");
    let out = podman(
        &strings(&["cp", &format!("{}:{path}", c.name), &copy.to_string_lossy()]),
        Duration::from_secs(60),
    )
    .await;
    assert!(out.status.success(), "cp {path}: {}", text(&out));
    std::fs::read(&copy).unwrap()
}

/// A file, directory or link of the image, as `tar -tv` lists it.
#[derive(Debug)]
struct Entry {
    /// `drwxr-x---`, `-rwxr-xr-x`, ...
    mode: String,
    /// `uid/gid`
    owner: String,
    /// Relative to `/`, without a trailing slash.
    path: String,
}

/// Everything in the image: its file system exported and listed.
async fn image_entries(image: &str) -> Vec<Entry> {
    let c = created(image).await;
    let dir = tempfile::tempdir().unwrap();
    let tar = dir.path().join("rootfs.tar");
    let out = podman(
        &strings(&["export", "--output", &tar.to_string_lossy(), &c.name]),
        Duration::from_secs(120),
    )
    .await;
    assert!(out.status.success(), "export: {}", text(&out));
    let out = Command::new("tar")
        .args(["--numeric-owner", "-tvf"])
        .arg(&tar)
        .output()
        .expect("tar runs");
    assert!(out.status.success(), "tar: {}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            // mode owner size date time path [-> target]
            let fields: Vec<&str> = line.split_whitespace().collect();
            assert!(fields.len() >= 6, "{line}");
            let path = fields[5..].join(" ");
            let path = path.split(" -> ").next().unwrap();
            Entry {
                mode: fields[0].to_owned(),
                owner: fields[1].to_owned(),
                path: path
                    .trim_start_matches("./")
                    .trim_end_matches('/')
                    .to_owned(),
            }
        })
        .filter(|e| !e.path.is_empty() && e.path != ".")
        .collect()
}

/// Every node a pod lands on pulls the image: it holds tally (without debug
/// info), Litestream, env (the default command's) and the shared libraries
/// tally and env link, and no other program: no shell, no package manager.
/// Everything is root's but /data, which is the image user's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_is_small_and_holds_nothing_but_what_it_runs() {
    let image = built();
    let out = podman(
        &strings(&["image", "inspect", "--format", "{{.Size}}", image]),
        Duration::from_secs(30),
    )
    .await;
    assert!(out.status.success(), "{}", text(&out));
    let size: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    eprintln!("image size: {size} bytes");
    assert!(
        size <= SIZE_LIMIT,
        "the image is {size} bytes, more than {SIZE_LIMIT}"
    );

    let entries = image_entries(image).await;
    let mut programs: Vec<&str> = entries
        .iter()
        .filter(|e| e.mode.starts_with('-') && e.mode.contains('x'))
        .map(|e| e.path.as_str())
        .filter(|p| !p.rsplit('/').next().unwrap().contains(".so"))
        .collect();
    programs.sort_unstable();
    assert_eq!(
        programs,
        [
            "usr/bin/env",
            "usr/local/bin/litestream",
            "usr/local/bin/tally"
        ],
        "{entries:#?}"
    );
    for shell in ["bin/sh", "usr/bin/sh", "bin/bash", "usr/bin/bash"] {
        assert!(!entries.iter().any(|e| e.path == shell), "{shell} is there");
    }
    let libc = entries
        .iter()
        .filter(|e| e.path.ends_with("/libc.so.6"))
        .count();
    assert_eq!(libc, 1, "{entries:#?}");

    let not_roots: Vec<&Entry> = entries.iter().filter(|e| e.owner != "0/0").collect();
    assert_eq!(not_roots.len(), 1, "{not_roots:#?}");
    assert_eq!(not_roots[0].path, "data", "{not_roots:#?}");
    assert_eq!(not_roots[0].owner, "65532/65532");
    assert_eq!(not_roots[0].mode, "drwxr-x---");
}

/// tally is built without debug info but keeps its symbol table, so that a
/// panic's backtrace still names functions. tokio panics before tally does
/// anything when its worker count, from the environment, is not a number: a
/// real panic of the shipped binary, with no test hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_images_tally_names_its_functions() {
    let image = built();
    let c = Container::new("panic");
    let env = [("TOKIO_WORKER_THREADS", "many"), ("RUST_BACKTRACE", "1")]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let out = podman(
        &run_args(image, &c, false, ["--tmpfs", DATA_TMPFS], &env, &["tally"]),
        Duration::from_secs(60),
    )
    .await;
    let printed = text(&out);
    assert_eq!(out.status.code(), Some(101), "{printed}");
    assert!(
        printed.contains("panicked at") && printed.contains("TOKIO_WORKER_THREADS"),
        "{printed}"
    );
    // A backtrace's frames: "  12: tally::main".
    let frames: Vec<&str> = printed
        .lines()
        .filter_map(|l| l.trim_start().split_once(": "))
        .filter(|(n, _)| n.parse::<u32>().is_ok())
        .map(|(_, f)| f.trim())
        .collect();
    assert!(
        frames.iter().any(|f| f.starts_with("tally::main")),
        "no frame names tally::main:\n{printed}"
    );
    assert!(
        frames.iter().any(|f| f.starts_with("tokio::runtime::")),
        "no frame names tokio's runtime:\n{printed}"
    );
}

#[test]
fn the_dockerfile_is_hadolint_clean() {
    let out = Command::new(tool_in("lint/bin", "hadolint"))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Dockerfile"))
        .output()
        .expect("hadolint runs");
    assert!(
        out.status.success() && out.stdout.is_empty(),
        "hadolint: {}",
        text(&out)
    );
}

/// The base64 bodies of the PEM certificates in `text`, whitespace removed.
fn pem_bodies(text: &str) -> Vec<String> {
    let mut bodies = Vec::new();
    let mut body: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if line == "-----BEGIN CERTIFICATE-----" {
            body = Some(String::new());
        } else if line == "-----END CERTIFICATE-----" {
            bodies.extend(body.take());
        } else if let Some(b) = body.as_mut() {
            b.push_str(line);
        }
    }
    bodies
}

/// The image trusts Debian's public CAs and nothing the build machine added:
/// the builder (here the stand-in, as on many build machines) trusts the
/// CAs in /usr/local/share/ca-certificates, such as a re-signing proxy's,
/// and a bundle copied from it would carry them into every deployment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_images_ca_bundle_is_debians_not_the_build_machines() {
    let image = built();
    let pem = image_file(image, "/etc/ssl/certs/ca-certificates.crt").await;
    let bundle: std::collections::HashSet<String> = pem_bodies(&String::from_utf8_lossy(&pem))
        .into_iter()
        .collect();
    // Debian's bundle holds well over a hundred public roots.
    assert!(bundle.len() > 100, "{} certificates", bundle.len());

    let mut local = Vec::new();
    let mut dirs = vec![PathBuf::from("/usr/local/share/ca-certificates")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "crt") {
                let pem = std::fs::read_to_string(&path).unwrap_or_default();
                local.extend(pem_bodies(&pem).into_iter().map(|b| (path.clone(), b)));
            }
        }
    }
    eprintln!("{} local CA certificate(s) on this machine", local.len());
    for (path, body) in &local {
        assert!(
            !bundle.contains(body),
            "the image trusts this machine's local CA {}",
            path.display()
        );
    }
}
