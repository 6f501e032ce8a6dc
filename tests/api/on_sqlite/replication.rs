//! tally under the real Litestream 0.5.17 with a real S3 server (moto) on
//! loopback: restore at start, the replica gate, draining on SIGTERM, what
//! a crash can lose, the replica's lag, and tally stopping when Litestream,
//! its parent, dies.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use nix::sys::signal::Signal;
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use sqlx::{ConnectOptions, sqlite::SqliteConnectOptions};

use crate::{
    forwarding::accept_each,
    helpers::sample,
    on_sqlite::replica_env::{Deployment, S3, ended_within, free_port},
};

async fn read_db(path: &std::path::Path) -> (String, HashMap<String, i64>, i64) {
    let mut conn = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .connect()
        .await
        .unwrap();
    let integrity: String = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let counters: Vec<(String, i64)> = sqlx::query_as("SELECT name, value FROM counters")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let calls: i64 = sqlx::query_scalar("SELECT COALESCE(SUM(calls), 0) FROM budget_global_usage")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    (integrity, counters.into_iter().collect(), calls)
}

fn assert_restored(d: &Deployment) {
    let out = d.restore();
    assert!(
        out.status.success(),
        "restore failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `n` increments to `counter` and `n` budget checks, all acknowledged.
async fn write(run: &crate::on_sqlite::replica_env::Running, counter: &str, n: usize) {
    let client = Client::new();
    for _ in 0..n {
        let r = client
            .post(run.url(&format!("/counters/{counter}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let r = client
            .post(run.url("/budgets/rb/check"))
            .json(&json!({"visitor": "v"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}

async fn stop_cleanly(mut run: crate::on_sqlite::replica_env::Running) {
    run.signal(Signal::SIGTERM);
    let status = run.wait(Duration::from_secs(40)).await;
    assert_eq!(status.code(), Some(0), "litestream: {}", run.log_text());
    let logs = run.log_text();
    assert!(logs.contains("stopped cleanly"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_start_restores_nothing_and_serves_only_after_the_gate() {
    let s3 = S3::start().await;
    s3.create_bucket("fresh").await;
    let d = Deployment::new(&s3.endpoint, "fresh");
    assert_restored(&d);
    assert!(
        !d.db().exists(),
        "restore from an empty replica must not create a database"
    );

    // Hold the replica back: while the object store does not answer, tally
    // must wait and not listen. With no database, its first question is
    // whether the replica holds one; it creates one only once the replica
    // has answered that it holds nothing.
    s3.pause();
    let run = d.replicate();
    run.not_listening_for(Duration::from_secs(2), "the replica was in sync")
        .await;
    let asked = run
        .line_of("asking the replica whether it holds one")
        .unwrap_or_else(|| panic!("{}", run.log_text()));
    assert!(
        run.line_of("created a new, empty database").is_none(),
        "created before the replica answered: {}",
        run.log_text()
    );
    assert!(run.line_of("replica confirmed in sync").is_none());
    s3.resume();
    run.wait_serving(Duration::from_secs(30)).await;
    let created = run.line_of("created a new, empty database").unwrap();
    let gate = run
        .line_of("replica confirmed in sync")
        .expect("the gate passed");
    let serving = run.line_of("\"serving\"").unwrap();
    assert!(
        asked < created && created < gate && gate < serving,
        "{}",
        run.log_text()
    );

    let r = reqwest::get(run.url("/ready")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    stop_cleanly(run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_stop_wipe_and_restore_twice() {
    let s3 = S3::start().await;
    s3.create_bucket("cycle").await;
    let d = Deployment::new(&s3.endpoint, "cycle");
    let client = Client::new();
    let mut expected = 0;
    for round in 0..3 {
        assert_restored(&d);
        let run = d.replicate();
        run.wait_serving(Duration::from_secs(20)).await;
        if round == 0 {
            let r = client
                .put(run.url("/budgets/rb"))
                .bearer_auth(crate::helpers::ADMIN)
                .json(&json!({"visitor_limit": 1000000, "global_limit": 1000000}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
        }
        // What the previous rounds wrote is back.
        let v: Value = client
            .get(run.url("/counters/kept"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["value"], expected, "round {round}");
        write(&run, "kept", 40).await;
        expected += 40;
        stop_cleanly(run).await;
        d.wipe();
        assert_restored(&d);
        let (integrity, counters, calls) = read_db(&d.db()).await;
        assert_eq!(integrity, "ok");
        assert_eq!(counters.get("kept"), Some(&expected), "round {round}");
        assert_eq!(calls, expected);
        d.wipe();
    }
}

/// A loopback forwarder to an S3 server that, while `refusing` is set,
/// answers every request that writes (`PUT`, `POST`, `DELETE`) `403
/// AccessDenied` and closes, as a bucket policy or write access revoked
/// would; reads pass through.
struct WritesRefused {
    endpoint: String,
    refusing: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl WritesRefused {
    async fn start(upstream: &str) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let target: std::net::SocketAddr = upstream.trim_start_matches("http://").parse().unwrap();
        let refusing = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&refusing);
        let (addr, task) = accept_each(move |mut inbound| {
            let refusing = Arc::clone(&flag);
            async move {
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let (mut out_read, mut out_write) = outbound.into_split();
                let (mut in_read, mut in_write) = inbound.split();
                // Ends with whether it stopped at a write to refuse.
                let up = async {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n @ 1..) = in_read.read(&mut buf).await {
                        let writes = [&b"PUT "[..], b"POST ", b"DELETE "]
                            .iter()
                            .any(|m| buf[..n].starts_with(m));
                        if writes && refusing.load(Ordering::SeqCst) {
                            return true;
                        }
                        if out_write.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    false
                };
                let refuse = tokio::select! {
                    refuse = up => refuse,
                    _ = tokio::io::copy(&mut out_read, &mut in_write) => false,
                };
                if refuse {
                    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error>\
                                <Code>AccessDenied</Code><Message>Access Denied</Message></Error>";
                    let answer = format!(
                        "HTTP/1.1 403 Forbidden\r\ncontent-type: application/xml\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = in_write.write_all(answer.as_bytes()).await;
                }
            }
        })
        .await;
        WritesRefused {
            endpoint: format!("http://{addr}"),
            refusing,
            task,
        }
    }
}

impl Drop for WritesRefused {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A restart in place (a container restarted in its pod, or a data
/// directory on a disk of its own) finds its database level with the
/// replica: the gate must still prove that the object store takes writes,
/// not only that nothing was left to send. Before, it passed at once while
/// every upload was refused, and writes acknowledged after it reached no
/// replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_place_serves_only_once_the_replica_takes_a_write() {
    let s3 = S3::start().await;
    s3.create_bucket("inplace").await;
    let store = WritesRefused::start(&s3.endpoint).await;
    let d = Deployment::new(&store.endpoint, "inplace");
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    for _ in 0..3 {
        let r = Client::new()
            .post(run.url("/counters/kept"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    stop_cleanly(run).await;

    // The same directory, every upload refused: tally must not listen.
    store.refusing.store(true, Ordering::SeqCst);
    let run = d.replicate();
    run.not_listening_for(Duration::from_secs(4), "the replica took a write")
        .await;
    assert!(
        run.line_of("replica confirmed in sync").is_none(),
        "{}",
        run.log_text()
    );
    // Uploads taken again: the gate passes, and what was kept is there.
    store.refusing.store(false, Ordering::SeqCst);
    run.wait_serving(Duration::from_secs(30)).await;
    let r = reqwest::get(run.url("/counters/kept")).await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 3);
    stop_cleanly(run).await;
}

/// A loopback forwarder to an S3 server that takes what is sent to it at
/// `bytes_per_second` at most, as a slow link or a throttled bucket does;
/// answers come back at once.
async fn slow_uploads(
    upstream: &str,
    bytes_per_second: u64,
) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let target: std::net::SocketAddr = upstream.trim_start_matches("http://").parse().unwrap();
    let (addr, task) = accept_each(move |mut inbound| async move {
        let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
            return;
        };
        let (mut out_read, mut out_write) = outbound.into_split();
        let (mut in_read, mut in_write) = inbound.split();
        let up = async {
            let mut buf = vec![0u8; 4096];
            while let Ok(n @ 1..) = in_read.read(&mut buf).await {
                tokio::time::sleep(Duration::from_micros(
                    n as u64 * 1_000_000 / bytes_per_second,
                ))
                .await;
                if out_write.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        };
        tokio::select! {
            () = up => {}
            _ = tokio::io::copy(&mut out_read, &mut in_write) => {}
        }
    })
    .await;
    (format!("http://{addr}"), task)
}

/// The startup gate over a store that takes uploads slowly: the first
/// upload of a database (Litestream's snapshot) takes longer than one call
/// to Litestream's control socket. The gate asked Litestream to wait for
/// the replica, and Litestream made the call's 10 s limit the deadline of
/// the upload itself: cut off at 10 s ("context deadline exceeded" in its
/// log) and started again from nothing; with a database large enough for
/// the link, never done, and every start failed (measured with a 75 MB
/// database at 500 KB/s). The gate now only asks how far the replica is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_upload_longer_than_one_call_gets_through_the_gate() {
    let s3 = S3::start().await;
    s3.create_bucket("slow").await;
    let (endpoint, forwarder) = slow_uploads(&s3.endpoint, 100_000).await;
    let mut d = Deployment::new(&endpoint, "slow");
    d.extra_env
        .push(("TALLY_REPLICA_WAIT_TIMEOUT".into(), "120".into()));
    // A database of about 2.5 MB that does not compress: 25 s or more of
    // uploads at 100 KB/s.
    {
        let db = d.db();
        std::fs::create_dir_all(db.parent().unwrap()).unwrap();
        let bin = crate::helpers::Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
        let r = Client::new().post(bin.url("/counters/c")).send().await;
        assert_eq!(r.unwrap().status(), StatusCode::OK);
        let mut bin = bin;
        bin.sigterm();
        bin.wait(Duration::from_secs(20)).await;
        crate::helpers::behind(
            db.to_str().unwrap(),
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 25000)
             INSERT INTO counters (name, value) SELECT hex(randomblob(40)), i FROM n",
        )
        .await;
    }
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(120)).await;
    let r = reqwest::get(run.url("/counters/c")).await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 1);
    let logs = run.log_text();
    assert!(!logs.contains("context deadline exceeded"), "{logs}");
    stop_cleanly(run).await;
    forwarder.abort();
}

/// Litestream with tally as its child on `d`, watched until it exits: it
/// must never listen, must give up (non-zero) after `at_least` and within a
/// minute. Returns the log.
async fn unserved(d: &Deployment, at_least: Duration) -> String {
    let mut run = d.replicate();
    let started = std::time::Instant::now();
    while run.child.try_wait().unwrap().is_none() {
        assert!(
            tokio::net::TcpStream::connect(run.listen).await.is_err(),
            "tally listened without a working replica"
        );
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "tally never gave up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = run.wait(Duration::from_secs(1)).await;
    assert_ne!(status.code(), Some(0));
    assert!(started.elapsed() >= at_least);
    let logs = run.log_text();
    assert!(!logs.contains("\"serving\""), "{logs}");
    logs
}

/// A database of tally's at `db`, made by the real binary without
/// Litestream (so without the mark of a replicated one).
async fn served_without_litestream(db: &std::path::Path) {
    let mut bin = crate::helpers::Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    bin.sigterm();
    assert!(bin.wait(Duration::from_secs(20)).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_replica_keeps_tally_from_serving() {
    // Nothing listens on this port: every S3 call fails.
    let mut d = Deployment::new(&format!("http://127.0.0.1:{}", free_port()), "nowhere");
    d.extra_env
        .push(("TALLY_REPLICA_WAIT_TIMEOUT".into(), "4".into()));
    // No database: whether the replica holds one cannot be told (Litestream
    // retries for minutes), so none is created.
    let logs = unserved(&d, Duration::from_secs(4)).await;
    assert!(
        logs.contains("whether the replica holds a database cannot be told"),
        "{logs}"
    );
    assert!(logs.contains("gave no answer within 4s"), "{logs}");
    assert!(!d.db().exists(), "{logs}");

    // The question and the gate share one wait: a replica that takes 10
    // of the 12 s to answer that it holds nothing leaves the gate 2 s (it
    // may overrun by its last call, at most 3 s), not 12 more: the chart's
    // startup probe is sized for one wait.
    let slow = d.dir.path().join("slow-litestream");
    tally::testing::script(&slow, "sleep 10\necho '[]'");
    d.extra_env
        .push(("TALLY_REPLICA_WAIT_TIMEOUT".into(), "12".into()));
    d.extra_env.push((
        "TALLY_LITESTREAM".into(),
        slow.to_string_lossy().into_owned(),
    ));
    let mut run = d.replicate();
    assert!(!run.wait(Duration::from_secs(60)).await.success());
    let logs = run.log_text();
    assert!(!logs.contains("\"serving\""), "{logs}");
    assert!(logs.contains("created a new, empty database"), "{logs}");
    // How long tally lived, by its own log's first and last lines
    // (Litestream's own end then waits on its final sync to nowhere).
    let stamps: Vec<jiff::Timestamp> = logs
        .lines()
        .filter_map(|l| {
            let v = serde_json::from_str::<Value>(l).ok()?;
            v.get("timestamp")?.as_str()?.parse().ok()
        })
        .collect();
    let lived = stamps[stamps.len() - 1].duration_since(stamps[0]);
    assert!((11..18).contains(&lived.as_secs()), "{lived:?}: {logs}");
    assert!(logs.contains("the replica is unreachable"), "{logs}");
    d.extra_env.truncate(1);
    d.wipe();
    // A database there: the first sync never reaches the replica.
    served_without_litestream(&d.db()).await;
    let logs = unserved(&d, Duration::from_secs(4)).await;
    assert!(logs.contains("the replica is unreachable"), "{logs}");
}

/// Processes whose command line holds `needle`.
fn processes_with(needle: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(needle))
        .collect()
}

/// A stop asked for while tally starts against an object store that does
/// not answer ends the start at once, in either wait: the question whether
/// the replica holds a database (none is there), and the wait for the first
/// replica sync (the chart lets both run for minutes, longer than a pod's
/// grace period). The `litestream ltx` asked goes with it. Nothing was
/// served, so nothing is left to drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_waiting_for_the_replica_ends_the_start() {
    let mut d = Deployment::new(&format!("http://127.0.0.1:{}", free_port()), "nowhere");
    d.extra_env
        .push(("TALLY_REPLICA_WAIT_TIMEOUT".into(), "60".into()));
    for waiting_for in [
        "asking the replica whether it holds one",
        "waiting for the first replica sync",
    ] {
        if waiting_for.starts_with("waiting") {
            served_without_litestream(&d.db()).await;
        }
        let mut run = d.replicate();
        let waiting = std::time::Instant::now();
        while run.line_of(waiting_for).is_none() {
            assert!(
                waiting.elapsed() < Duration::from_secs(30),
                "tally never began {waiting_for:?}: {}",
                run.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let tally =
            nix::unistd::Pid::from_raw(run.tally_pid().expect("tally runs under Litestream"));
        run.signal(Signal::SIGTERM);
        // tally's stop, not Litestream's: Litestream then makes its final
        // sync, which against this replica gives up at once or, if a sync
        // of its own was under way, after litestream.yml's
        // shutdown-sync-timeout (20 s).
        let signalled = std::time::Instant::now();
        ended_within(tally, Duration::from_secs(10), "tally").await;
        eprintln!("tally stopped {:?} after SIGTERM", signalled.elapsed());
        let asking = processes_with(&d.db().to_string_lossy())
            .into_iter()
            .filter(|c| c.contains(" ltx "))
            .collect::<Vec<_>>();
        assert!(asking.is_empty(), "left running: {asking:?}");
        run.wait(Duration::from_secs(40)).await;
        let logs = run.log_text();
        assert!(logs.contains("stopped while starting"), "{logs}");
        assert!(!logs.contains("\"serving\""), "{logs}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loses_at_most_a_short_window_and_never_consistency() {
    let s3 = S3::start().await;
    s3.create_bucket("crash").await;
    let d = Deployment::new(&s3.endpoint, "crash");
    assert_restored(&d);
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(20)).await;

    let load = crate::helpers::Hammer::start(run.url("/counters/crash"), 4);
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let tally = run.tally_pid().expect("tally runs under litestream");
    // Both at once, as a node failure would.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(tally), Signal::SIGKILL).unwrap();
    run.signal(Signal::SIGKILL);
    let killed_at = std::time::Instant::now();
    let acked = load.stop().await;
    drop(run);
    let (highest, _) = *acked.last().expect("some writes were acknowledged");

    d.wipe();
    assert_restored(&d);
    let (integrity, counters, _) = read_db(&d.db()).await;
    assert_eq!(integrity, "ok");
    let restored = counters.get("crash").copied().unwrap_or(0);
    // A prefix: the restored value is one the counter really had.
    assert!(
        restored <= highest,
        "restored {restored} > highest acknowledged {highest}"
    );
    let lost = highest - restored;
    let window = acked
        .iter()
        .find(|(v, _)| *v > restored)
        .map(|(_, at)| killed_at.duration_since(*at))
        .unwrap_or_default();
    println!(
        "crash: {} writes acknowledged, highest {highest}; restored {restored}; \
         lost {lost} acknowledged writes, the last {window:?} before the kill",
        acked.len()
    );
    // Litestream ships WAL frames every second (sync-interval: 1s).
    assert!(window < Duration::from_secs(5), "lost a {window:?} window");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_lag_grows_while_the_object_store_hangs_and_returns_to_zero() {
    let s3 = S3::start().await;
    s3.create_bucket("lag").await;
    let d = Deployment::new(&s3.endpoint, "lag");
    assert_restored(&d);
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    let start = run
        .metrics_until(Duration::from_secs(15), "caught up at start", |t| {
            sample(t, "tally_replica_up") == Some(1.0)
                && sample(t, "tally_replica_lag_seconds") == Some(0.0)
                && sample(t, "tally_replica_local_txid") > Some(0.0)
        })
        .await;
    let start_txid = sample(&start, "tally_replica_local_txid").unwrap();

    // A frozen object store: uploads hang, writes still commit locally.
    s3.pause();
    let client = Client::new();
    for _ in 0..20 {
        let r = client.post(run.url("/counters/lag")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    let behind = run
        .metrics_until(Duration::from_secs(30), "lag past 3 s", |t| {
            sample(t, "tally_replica_lag_seconds").is_some_and(|l| l >= 3.0)
        })
        .await;
    // Litestream either still answers and shows the replica behind, or
    // hangs on the frozen store and says nothing at all.
    let (local, replicated) = (
        sample(&behind, "tally_replica_local_txid").unwrap(),
        sample(&behind, "tally_replica_replicated_txid").unwrap(),
    );
    assert!(
        local > replicated || sample(&behind, "tally_replica_up") == Some(0.0),
        "{behind}"
    );

    s3.resume();
    // The watch sets its gauges one by one: wait for a scrape that shows
    // all of them from one answer.
    let caught_up = run
        .metrics_until(Duration::from_secs(60), "lag back to 0", caught_up)
        .await;
    assert_eq!(
        sample(&caught_up, "tally_replica_local_txid"),
        sample(&caught_up, "tally_replica_replicated_txid")
    );
    assert!(
        sample(&caught_up, "tally_replica_local_txid").unwrap() > start_txid,
        "the writes made while frozen reached the replica"
    );
    assert_eq!(sample(&caught_up, "tally_replica_up"), Some(1.0));
    stop_cleanly(run).await;
}

/// The replica is level with the database, as one answer of Litestream's
/// shows it.
fn caught_up(t: &str) -> bool {
    sample(t, "tally_replica_lag_seconds") == Some(0.0)
        && sample(t, "tally_replica_up") == Some(1.0)
        && sample(t, "tally_replica_local_txid") == sample(t, "tally_replica_replicated_txid")
}

/// Kills a process that is not our child (tally under a dead Litestream)
/// when the test ends, however it ends.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Whether `pid` still runs (a zombie waiting for its reaper does not).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the parenthesised command name.
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tally_stops_when_litestream_its_parent_dies() {
    let s3 = S3::start().await;
    s3.create_bucket("orphan").await;
    let d = Deployment::new(&s3.endpoint, "orphan");
    let mut run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    let tally = run.tally_pid().expect("tally runs as Litestream's child");
    let _guard = KillOnDrop(tally);
    let r = Client::new()
        .post(run.url("/counters/orphan"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);

    // Litestream dies without a chance to tell anyone.
    run.child.kill().unwrap();
    run.child.wait().unwrap();
    let killed = Instant::now();
    while running(tally) {
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "tally outlived Litestream: {}",
            run.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = killed.elapsed();
    // Both are gone: every line they wrote is read once the pipes end.
    run.readers.all_read(Duration::from_secs(10)).await;
    let logs = run.log_text();
    let line = |needle: &str| {
        run.line_of(needle)
            .unwrap_or_else(|| panic!("no `{needle}` in {logs}"))
    };
    // Why, logged as an error; drained as on SIGTERM (HTTP, then the
    // writer); and a non-zero exit.
    line("stopping if the parent process exits");
    let noticed = line("the parent process (Litestream) exited");
    let http = line("HTTP stopped");
    let failed = line("tally failed");
    assert!(noticed < http && http < failed, "{logs}");
    assert!(
        tokio::net::TcpStream::connect(run.listen).await.is_err(),
        "still listening"
    );
    eprintln!("tally stopped {took:?} after Litestream was killed");
}

/// A hangup of the terminal both run from reaches both: Litestream ends at
/// once, with no final sync, and tally, which drains on SIGHUP as on
/// SIGTERM, exited `0` and said it stopped cleanly, though the last writes
/// were in the local database only. Under Litestream it leaves a hangup
/// to Litestream, and stops as when Litestream dies: non-zero, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hangup_that_ends_litestream_too_is_no_clean_stop() {
    let s3 = S3::start().await;
    s3.create_bucket("hangup").await;
    let d = Deployment::new(&s3.endpoint, "hangup");
    let mut run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    let tally = run.tally_pid().expect("tally runs as Litestream's child");
    let _guard = KillOnDrop(tally);
    let r = Client::new()
        .post(run.url("/counters/hangup"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);

    // As a closing terminal signals its foreground process group.
    run.signal(Signal::SIGHUP);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(tally), Signal::SIGHUP).unwrap();
    let hung_up = Instant::now();
    while running(tally) {
        assert!(
            hung_up.elapsed() < Duration::from_secs(10),
            "tally still runs: {}",
            run.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run.wait(Duration::from_secs(10)).await;
    let logs = run.log_text();
    assert!(logs.contains("SIGHUP received: under Litestream"), "{logs}");
    let gone = run.line_of("the parent process (Litestream) exited");
    let failed = run.line_of("tally failed");
    assert!(gone.is_some() && gone < failed, "{logs}");
}

/// Litestream with tally as its child, on `d`'s directory as it is: tally
/// must refuse to start, saying `says`. Returns the log.
async fn refused_start(d: &Deployment, says: &str) -> String {
    let mut run = d.replicate();
    let status = run.wait(Duration::from_secs(40)).await;
    let logs = run.log_text();
    assert!(!status.success(), "{logs}");
    assert!(logs.contains(says), "{logs}");
    logs
}

/// A database file deleted underneath tally under Litestream: tally exits,
/// and the container restarted in place (the same volume, no restore) must
/// not start on an empty database (nor on another file put in its place,
/// nor after every file of the directory was removed, the mark too), which
/// Litestream would replicate as the replica's latest state. Before, it
/// did, and the next new pod restored the empty one. Nor must a new pod
/// whose restore skipped over an empty file. A new pod (a new volume, and
/// its restore) gets every replicated write back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_lost_under_litestream_is_not_replaced_by_an_empty_one() {
    let s3 = S3::start().await;
    s3.create_bucket("lost").await;
    let mut d = Deployment::new(&s3.endpoint, "lost");
    assert_restored(&d);
    let mut run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    let client = Client::new();
    for _ in 0..3 {
        let r = client.post(run.url("/counters/kept")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    run.metrics_until(Duration::from_secs(30), "the writes replicated", caught_up)
        .await;

    std::fs::remove_file(d.db()).unwrap();
    // Seen before the write ran (the idle writer looks every second), it
    // is refused and not kept; committed into the deleted file before
    // the loss was seen, Litestream may have copied it to the replica.
    let r = client.post(run.url("/counters/kept")).send().await.unwrap();
    let answered = r.status();
    let body: Value = r.json().await.unwrap();
    let kept = match (answered, body["type"].as_str()) {
        (StatusCode::SERVICE_UNAVAILABLE, Some("/problems/storage-lost")) => 3..=3,
        (StatusCode::INTERNAL_SERVER_ERROR, Some("/problems/outcome-unknown")) => 3..=4,
        _ => panic!("{answered}: {body}"),
    };
    let status = run.wait(Duration::from_secs(40)).await;
    assert!(!status.success(), "{}", run.log_text());
    drop(run);

    // The container restarted in place: refused, nothing created.
    let logs = refused_start(&d, "a database served under Litestream was here").await;
    assert!(!logs.contains("created a new, empty database"), "{logs}");
    assert!(!d.db().exists());

    // A new pod: its volume is empty, its init container restores the
    // replica's latest state, which still holds the writes.
    d.wipe();
    assert_restored(&d);
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    let r = reqwest::get(run.url("/counters/kept")).await.unwrap();
    let value = r.json::<Value>().await.unwrap()["value"].as_i64().unwrap();
    assert!(
        kept.contains(&value),
        "{value}, answered {answered}: {body}"
    );
    assert!(
        run.line_of("opened an existing database").is_some(),
        "{}",
        run.log_text()
    );
    stop_cleanly(run).await;

    // `rm tally.db*` under a running tally: the database, its WAL and
    // -shm, its lock, but not the mark, whose name starts with a dot.
    // (What the replica then holds is Litestream's doing: measured, its
    // latest state lost the writes since the last checkpoint, which a
    // restore to an instant before the loss brings back, as below; see the
    // runbook.)
    let mut run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    // An instant after this start has reached the replica (Litestream
    // ships every second), well before the loss.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before_loss = jiff::Timestamp::now().to_string();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let data = d.db().parent().unwrap().to_owned();
    for entry in std::fs::read_dir(&data).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("tally.db")
        {
            std::fs::remove_file(&path).unwrap();
        }
    }
    let r = client.post(run.url("/counters/kept")).send().await.unwrap();
    assert_ne!(r.status(), StatusCode::OK);
    assert!(!run.wait(Duration::from_secs(40)).await.success());
    drop(run);
    refused_start(&d, "it is missing").await;
    assert!(!d.db().exists());

    // Another file in its place, with no table of tally's (what `sqlite3
    // tally.db` leaves once anything is asked of it): refused too. (Not a
    // repair: Litestream, which starts first, replicates whatever
    // database is at the path.)
    for f in crate::on_sqlite::storage_faults::db_files(&d.db()) {
        let _ = std::fs::remove_file(f);
    }
    let mut other = SqliteConnectOptions::new()
        .filename(d.db())
        .create_if_missing(true)
        .connect()
        .await
        .unwrap();
    sqlx::raw_sql("PRAGMA journal_mode=WAL; CREATE TABLE t (a); DROP TABLE t;")
        .execute(&mut other)
        .await
        .unwrap();
    drop(other);
    refused_start(&d, "no table of tally's").await;

    // Every file of the directory gone, the mark too: the replica is asked,
    // and it holds a database. Asked with the configuration Litestream
    // replicates with, read from its command line: not with another one
    // tally is told of, here one naming an empty replica path.
    d.wipe();
    let elsewhere = d.dir.path().join("elsewhere.yml");
    let config = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("litestream.yml"),
    )
    .unwrap()
    .replace("path: ${LITESTREAM_PATH}", "path: elsewhere");
    assert!(config.contains("path: elsewhere"));
    std::fs::write(&elsewhere, config).unwrap();
    d.extra_env.push((
        "TALLY_LITESTREAM_CONFIG".into(),
        elsewhere.to_string_lossy().into_owned(),
    ));
    let logs = refused_start(&d, "it is missing, but the replica holds a database").await;
    assert!(
        logs.contains("TALLY_LITESTREAM_CONFIG is not the configuration Litestream"),
        "{logs}"
    );
    assert!(!logs.contains("created a new, empty database"), "{logs}");
    assert!(!d.db().exists());
    d.extra_env.pop();

    // A new pod whose volume had an empty file at the database's path
    // (what `sqlite3` leaves when asked about a missing database): its
    // restore skips it, taking it for a database, and the start is
    // refused at once rather than make a database of it. (Litestream,
    // which starts first, may make one of it: its doing, within a second.)
    d.wipe();
    std::fs::create_dir_all(d.db().parent().unwrap()).unwrap();
    std::fs::write(d.db(), b"").unwrap();
    assert_restored(&d);
    assert_eq!(std::fs::metadata(d.db()).unwrap().len(), 0);
    // (Refused as an empty file, or as a file with no table of tally's
    // once Litestream, which starts first, has made a database of it.)
    let logs = refused_start(&d, "replicates whatever database is at the path").await;
    assert!(!logs.contains("created a new, empty database"), "{logs}");

    // Whatever the latest state now holds, the instant before the loss
    // holds every write.
    d.wipe();
    let out = d.restore_to(&before_loss);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (integrity, counters, _) = read_db(&d.db()).await;
    assert_eq!(integrity, "ok");
    let value = counters.get("kept").copied().unwrap_or(0);
    assert!(kept.contains(&value), "{value} at {before_loss}");
}
