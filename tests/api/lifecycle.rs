//! The real binary: clean shutdown on SIGTERM, kill -9, exit codes. (Its
//! startup failures, given a SQLite file path: `on_sqlite::lifecycle`.)

use std::{collections::HashSet, time::Duration};

use nix::sys::signal::Signal;
use reqwest::{Client, StatusCode};
use serde_json::Value;

use crate::helpers::{Binary, database_in, on_postgres};

async fn read_counter(db: &str, name: &str) -> i64 {
    let bin = Binary::start(&[("TALLY_DATABASE", db)]);
    let v: Value = reqwest::get(bin.url(&format!("/counters/{name}")))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    bin.sigterm();
    v["value"].as_i64().unwrap()
}

#[tokio::test]
async fn sigterm_commits_and_answers_every_accepted_write() {
    stop_commits_and_answers_every_accepted_write(Signal::SIGTERM).await;
}

/// A hangup (the terminal tally runs in closing) is a clean stop too, not
/// the default action's instant death.
#[tokio::test]
async fn sighup_drains_as_sigterm_does() {
    stop_commits_and_answers_every_accepted_write(Signal::SIGHUP).await;
}

/// Under `nohup` (SIGHUP ignored from the start) a hangup is not a stop:
/// tally run by hand that way goes on serving when its terminal closes.
#[tokio::test]
async fn a_hangup_under_nohup_stops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let mut bin = Binary::start_through(&["nohup"], &[("TALLY_DATABASE", db.as_str())]);
    bin.signal(Signal::SIGHUP);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = reqwest::Client::new()
        .post(bin.url("/counters/after-hangup"))
        .send()
        .await
        .expect("still serving after a SIGHUP under nohup");
    assert_eq!(r.status(), StatusCode::OK);
    bin.sigterm();
    let status = bin.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    assert!(!bin.log_text().contains("SIGHUP"), "{}", bin.log_text());
}

async fn stop_commits_and_answers_every_accepted_write(signal: Signal) {
    let dir = tempfile::tempdir().unwrap();
    let db = match on_postgres() {
        true => database_in(dir.path()).await,
        false => dir
            .path()
            .join("nested/dir/tally.db")
            .to_str()
            .unwrap()
            .to_owned(),
    };
    let db = db.as_str();
    // A slow writer taking a few commands at a time: while it sleeps over
    // its first batch, every other write queues, and the drain after
    // SIGTERM takes several batches.
    let mut bin = Binary::start(&[
        ("TALLY_DATABASE", db),
        ("TALLY_TEST_WRITER_DELAY_MS", "700"),
        ("TALLY_MAX_BATCH", "4"),
    ]);
    let client = Client::new();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let client = client.clone();
        let url = bin.url("/counters/drain");
        tasks.push(tokio::spawn(async move { client.post(&url).send().await }));
    }
    // Every write accepted (queued, or in a batch the writer took) before
    // SIGTERM: a request tally has not read yet is not accepted, and its
    // connection is closed, as shutdown should. The polls go on a client
    // of their own, so that no write reuses their idle connection.
    bin.writes_accepted(20).await;
    bin.signal(signal);
    let mut values = HashSet::new();
    for t in tasks {
        let r = t.await.unwrap().expect("accepted write is answered");
        assert_eq!(r.status(), StatusCode::OK);
        values.insert(r.json::<Value>().await.unwrap()["value"].as_i64().unwrap());
    }
    assert_eq!(values, (1..=20).collect());
    let status = bin.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    let logs = bin.log_text();
    assert!(logs.contains("stopped cleanly"));
    assert!(
        logs.contains(&format!("{} received", signal.as_str())),
        "{logs}"
    );
    // Durable by default: WAL and synchronous=FULL (2). The WAL was
    // checkpointed into the main file on the way out.
    if !on_postgres() {
        let open: Value = logs
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["fields"]["message"] == "database open")
            .expect("database open is logged");
        assert_eq!(open["fields"]["journal_mode"], "wal");
        assert_eq!(open["fields"]["synchronous"], 2);
        let wal = std::path::Path::new(db).with_extension("db-wal");
        assert!(!wal.exists() || std::fs::metadata(&wal).unwrap().len() == 0);
    }
    assert_eq!(read_counter(db, "drain").await, 20);
}

/// With a shutdown delay tally serves on after SIGTERM, new connections
/// included, each answer asking its client to reconnect (`Connection:
/// close`, so that keep-alive clients move, through the load balancer, to
/// another process); then it drains as usual and exits 0.
#[tokio::test]
async fn a_shutdown_delay_serves_on_asking_clients_to_reconnect() {
    const DELAY: Duration = Duration::from_secs(5);
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let mut bin = Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_SHUTDOWN_DELAY", "5"),
    ]);
    let kept = Client::new();
    let r = kept.post(bin.url("/counters/d")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers().get("connection").is_none());
    let signalled = std::time::Instant::now();
    bin.sigterm();
    while !bin.log_text().contains("serving on for the shutdown delay") {
        assert!(signalled.elapsed() < DELAY / 2, "{}", bin.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A connection kept from before, and a new one.
    for client in [&kept, &Client::new()] {
        let r = client.post(bin.url("/counters/d")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["connection"], "close");
    }
    assert!(signalled.elapsed() < DELAY, "too slow to tell");
    let status = bin.wait(Duration::from_secs(30)).await;
    assert!(signalled.elapsed() >= DELAY);
    assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    assert!(bin.log_text().contains("stopped cleanly"));
    assert_eq!(read_counter(&db, "d").await, 3);
}

/// Writes whose clients left while they were queued all commit, are each
/// counted once in `tally_write_committed_caller_gone_total`, and are
/// logged (the first, then at most a line a second, each saying how many
/// it held back) with the counter, the request id and the value.
#[tokio::test]
async fn a_write_whose_caller_gave_up_still_commits_and_is_logged() {
    use tokio::io::AsyncWriteExt;
    const N: usize = 20;
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let db = db.as_str();
    let mut bin = Binary::start(&[
        ("TALLY_DATABASE", db),
        ("TALLY_TEST_WRITER_DELAY_MS", "2500"),
    ]);
    let client = Client::new();
    // The writer held by a first write, so that every later one queues.
    let held = tokio::spawn(client.post(bin.url("/counters/first")).send());
    bin.writer_holds(1).await;
    let mut conns = Vec::new();
    for _ in 0..N {
        let mut c = tokio::net::TcpStream::connect(bin.addr).await.unwrap();
        c.write_all(b"POST /counters/late HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        conns.push(c);
    }
    // Queued, or taken into a batch the writer holds (the first one's hold
    // may end while they are sent, on a loaded host): none answered yet.
    bin.writes_accepted(N as u64 + 1).await;
    // The clients give up.
    drop(conns);
    assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::OK);
    let series = r#"tally_write_committed_caller_gone_total{command="increment"}"#;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while crate::helpers::sample(&bin.metrics().await, series) != Some(N as f64) {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            bin.metrics().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bin.sigterm();
    let status = bin.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    let logs = bin.log_text();
    let gone: Vec<Value> = logs
        .lines()
        .filter(|l| l.contains("write committed but its caller had gone"))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!gone.is_empty(), "{logs}");
    let held_back: u64 = gone
        .iter()
        .map(|v| v["fields"]["held_back"].as_u64().unwrap())
        .sum();
    assert!(gone.len() as u64 + held_back <= N as u64, "{logs}");
    for v in gone {
        assert_eq!(v["level"], "WARN");
        assert_eq!(v["fields"]["command"], "increment");
        // Written by the request it came from when the writer's answer
        // reached it as it was dropped: no target, the request id only.
        if let Some(target) = v["fields"].get("target") {
            assert_eq!(target, "counter=late");
        }
        assert!(v["fields"]["result"].as_str().unwrap().starts_with("Some("));
        // The request it came from, to match with the client's side.
        assert_eq!(v["fields"]["request_id"].as_str().unwrap().len(), 36, "{v}");
    }
    assert_eq!(read_counter(db, "late").await, N as i64);
}

#[tokio::test]
async fn a_stuck_client_cannot_hold_shutdown_past_the_drain_timeout() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let mut bin = Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_DRAIN_TIMEOUT", "0.5"),
    ]);
    // Half a request, never finished.
    let mut stuck = tokio::net::TcpStream::connect(bin.addr).await.unwrap();
    stuck
        .write_all(b"POST /counter HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        .await
        .unwrap();
    // Accepted (then the head, sent whole, is read as soon as it is
    // polled: a moment, even on a loaded host). The scrape, served on the
    // same listener, is the other connection open.
    let series = r#"tally_http_connections_open{listener="api"}"#;
    let accepted = std::time::Instant::now();
    while crate::helpers::sample(&bin.metrics().await, series) != Some(2.0) {
        assert!(
            accepted.elapsed() < Duration::from_secs(5),
            "never accepted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    bin.sigterm();
    let status = bin.wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(400),
        "exited before the drain timeout: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    assert!(bin.log_text().contains("did not finish in time"));
    drop(stuck);
}

/// A writer that does not finish once the HTTP drain is over (its
/// database stopped answering: a partition) cannot hold the stop past
/// `TALLY_WRITER_DRAIN_TIMEOUT`: tally exits 0 without it, and nothing
/// answered is lost (its caller was dropped at the drain). Before, a stop
/// in a partition took a whole batch's time limit and more (36 s
/// measured on PostgreSQL), past the chart's grace period of 30 s.
#[tokio::test]
async fn a_stuck_writer_cannot_hold_shutdown_past_the_writer_drain_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let mut bin = Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_TEST_WRITER_DELAY_MS", "60000"),
        ("TALLY_DRAIN_TIMEOUT", "0.5"),
        ("TALLY_WRITER_DRAIN_TIMEOUT", "1"),
    ]);
    let write = tokio::spawn(Client::new().post(bin.url("/counters/held")).send());
    bin.writer_holds(1).await;
    let started = std::time::Instant::now();
    bin.sigterm();
    let status = bin.wait(Duration::from_secs(30)).await;
    let took = started.elapsed();
    assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(15),
        "the stop took {took:?}"
    );
    let log = bin.log_text();
    assert!(
        log.contains("did not finish within the writer drain timeout"),
        "{log}"
    );
    assert!(log.contains("stopped, without the writer"), "{log}");
    assert!(!log.contains("stopped cleanly"), "{log}");
    // Never answered: dropped at the drain.
    assert!(write.await.unwrap().is_err());
}

/// kill -9 in the middle of a write load: every write answered 200 is in
/// the database when it starts again.
#[tokio::test]
async fn acknowledged_writes_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let db = db.as_str();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db)]);
    let load = crate::helpers::Hammer::start(bin.url("/counters/crash"), 8);
    load.until_acknowledged(3000, Duration::from_secs(15)).await;
    bin.child.kill().unwrap(); // SIGKILL
    let _ = bin.wait(Duration::from_secs(5)).await;
    let acked: Vec<i64> = load.stop().await.into_iter().map(|(v, _)| v).collect();
    assert!(
        acked.len() > 100,
        "too few writes before the kill: {}",
        acked.len()
    );
    let highest = *acked.iter().max().unwrap();
    let value = read_counter(db, "crash").await;
    assert!(
        value >= highest,
        "counter {value} < highest acknowledged {highest}"
    );
    assert!(
        value >= acked.len() as i64,
        "counter {value} < {} acks",
        acked.len()
    );
}

/// A key outlives a restart: it is committed with its write.
#[tokio::test]
async fn idempotency_keys_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let db = db.as_str();
    let client = Client::new();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let mut bin = Binary::start(&[("TALLY_DATABASE", db)]);
        let r = client
            .post(bin.url("/counters/restart"))
            .header("idempotency-key", "across-restarts")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let replayed = r.headers().contains_key("idempotent-replayed");
        answers.push((r.json::<Value>().await.unwrap()["value"].clone(), replayed));
        bin.sigterm();
        assert_eq!(bin.wait(Duration::from_secs(20)).await.code(), Some(0));
    }
    assert_eq!(
        answers,
        [(serde_json::json!(1), false), (serde_json::json!(1), true)]
    );
}

/// If the writer dies holding accepted writes, their callers hear that the
/// outcome is unknown (not a false success, not a false failure), and tally
/// stops with an error instead of serving without a writer.
#[tokio::test]
async fn losing_the_writer_reports_outcome_unknown_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let mut bin = Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_TEST_WRITER_PANIC_AFTER", "1"),
        // Long enough for the three writes below to reach the queue before
        // the writer dies holding the first of them (a write that comes
        // later finds the queue closed: 503, not outcome unknown).
        ("TALLY_TEST_WRITER_DELAY_MS", "1000"),
    ]);
    let client = Client::new();
    let r = client.post(bin.url("/counters/w")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let (c, u) = (client.clone(), bin.url("/counters/w"));
        tasks.push(tokio::spawn(async move { c.post(u).send().await.unwrap() }));
    }
    for t in tasks {
        let r = t.await.unwrap();
        let body = crate::helpers::problem(r, StatusCode::INTERNAL_SERVER_ERROR).await;
        assert_eq!(body["type"], "/problems/outcome-unknown");
        assert!(body["detail"].as_str().unwrap().contains("Idempotency-Key"));
    }
    let status = bin.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(1), "{}", bin.log_text());
    let logs = bin.log_text();
    assert!(logs.contains("the writer stopped; shutting down"), "{logs}");
    assert!(logs.contains("the writer thread died"), "{logs}");
}

/// Clients that leave before their checks are answered: every check still
/// commits and is counted where it is decided (`tally_budget_decisions_total`,
/// `tally_write_wait_seconds`, `tally_write_committed_caller_gone_total`,
/// one each), each dropped request is counted as `499`, and the log lines
/// about them are few (at most one a second) and never name a visitor.
#[tokio::test]
async fn checks_whose_clients_left_are_counted_once_and_logged_sparingly() {
    use tokio::io::AsyncWriteExt;
    const N: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let bin = Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_ADMIN_TOKEN", crate::helpers::ADMIN),
        ("TALLY_TEST_WRITER_DELAY_MS", "2500"),
    ]);
    let client = Client::new();
    let r = client
        .put(bin.url("/budgets/left"))
        .bearer_auth(crate::helpers::ADMIN)
        .json(&serde_json::json!({"visitor_limit": 1000, "global_limit": 100000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // The writer held by a write, so that every check queues behind it.
    let held = tokio::spawn(client.post(bin.url("/counters/first")).send());
    bin.writer_holds(2).await;
    let mut conns = Vec::new();
    for i in 0..N {
        let body = format!(r#"{{"visitor":"victim-{i}@example.com"}}"#);
        let mut c = tokio::net::TcpStream::connect(bin.addr).await.unwrap();
        let head = format!(
            "POST /budgets/left/check HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        c.write_all(head.as_bytes()).await.unwrap();
        conns.push(c);
    }
    // Queued, or taken into a batch the writer holds: none answered yet.
    bin.writes_accepted(N as u64 + 2).await;
    drop(conns);
    assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::OK);
    // All of them commit.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let text = bin.metrics().await;
        // Each counted where it happens: the decisions and the callers
        // gone by the writer, the dropped requests by the HTTP side.
        let all = [
            r#"tally_budget_decisions_total{budget="left",reason="ok"}"#,
            r#"tally_write_committed_caller_gone_total{command="check"}"#,
            r#"tally_http_requests_total{method="POST",route="/budgets/{name}/check",status="499"}"#,
        ]
        .iter()
        .all(|series| crate::helpers::sample(&text, series) == Some(N as f64));
        if all {
            break text;
        }
        assert!(std::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let get = |series: &str| crate::helpers::sample(&metrics, series).unwrap_or(0.0);
    assert_eq!(
        get(r#"tally_write_committed_caller_gone_total{command="check"}"#),
        N as f64,
        "{metrics}"
    );
    // The budget's PUT, the write and the checks.
    assert_eq!(
        get("tally_write_wait_seconds_count"),
        (N + 2) as f64,
        "{metrics}"
    );
    assert_eq!(
        get(
            r#"tally_http_requests_total{method="POST",route="/budgets/{name}/check",status="499"}"#
        ),
        N as f64,
        "{metrics}"
    );
    let logs = bin.log_text();
    assert!(
        !logs.contains("victim-"),
        "a visitor's id was logged: {logs}"
    );
    let gone: Vec<Value> = logs
        .lines()
        .filter(|l| l.contains("caller had gone"))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(!gone.is_empty());
    assert!(
        gone.len() < 20,
        "{} lines for {N} checks: {logs}",
        gone.len()
    );
    let accounted: u64 = gone
        .iter()
        .map(|v| 1 + v["fields"]["held_back"].as_u64().unwrap())
        .sum();
    assert!(accounted <= N as u64, "{logs}");
}

/// A writer held on one batch shows in `tally_write_batch_age_seconds`,
/// which grows at every scrape while nothing else moves (the alert
/// `TallyWriterStalled` reads it), and is back at 0 once the batch is done.
#[tokio::test]
async fn a_writer_held_on_a_batch_shows_its_age_at_every_scrape() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let bin = Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_TEST_WRITER_DELAY_MS", "3000"),
    ]);
    let client = Client::new();
    let age = || async {
        let text = bin.metrics().await;
        crate::helpers::sample(&text, "tally_write_batch_age_seconds")
            .unwrap_or_else(|| panic!("no batch age: {text}"))
    };
    // (The writer's idle check of its files, every second, counts as a
    // batch for the few microseconds it takes; its first, as the writer
    // starts, looks for a deleted budget's usage too, and on a loaded
    // host may take longer.)
    let started = std::time::Instant::now();
    while age().await >= 0.05 {
        assert!(started.elapsed() < Duration::from_secs(5), "no batch yet");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let write = tokio::spawn(client.post(bin.url("/counters/held")).send());
    bin.writer_holds(1).await;
    let first = age().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = age().await;
    assert!(
        second >= first + 0.35 && second < 3.0,
        "{first} then {second}"
    );
    assert_eq!(write.await.unwrap().unwrap().status(), StatusCode::OK);
    // After its answers the writer cleans up (expired keys: on PostgreSQL
    // two round trips), then takes nothing more.
    let started = std::time::Instant::now();
    while age().await >= 0.05 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the batch is done"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
