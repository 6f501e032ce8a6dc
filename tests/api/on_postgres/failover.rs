//! A PostgreSQL switchover under load, as a cluster runs one: a primary
//! with a synchronous standby behind a read-write Service (here a loopback
//! forwarder), the primary stopped, the standby promoted, the old primary
//! back as a read-only standby of the new one, and the Service pointed at
//! the new primary, promptly or late. tally is the real binary, two
//! processes, never restarted.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use reqwest::{Client, StatusCode};
use serde_json::Value;
use sqlx::Connection;
use tokio::{net::TcpStream, task::JoinHandle};

use crate::{
    forwarding::accept_each,
    helpers::Binary,
    postgres::{self, PgServer},
};

/// A loopback TCP forwarder standing in for a cluster's read-write Service:
/// each connection it accepts goes to the target of the moment; switching
/// the target moves new connections only, and an old one lasts until its
/// upstream closes it, as kube-proxy's do.
struct Forwarder {
    addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    /// Owns the accept loop, which owns every connection's task: dropping
    /// the forwarder ends them all.
    task: JoinHandle<()>,
}

impl Forwarder {
    async fn start(target: SocketAddr) -> Self {
        let target = Arc::new(Mutex::new(target));
        let current = Arc::clone(&target);
        let (addr, task) =
            accept_each(move |inbound| forward(inbound, *current.lock().unwrap())).await;
        Forwarder { addr, target, task }
    }

    fn point_at(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies both ways until either side closes. An upstream that refuses
/// (a stopped server) closes the client's connection at once, as a
/// Service without a ready endpoint does.
async fn forward(mut inbound: TcpStream, upstream: SocketAddr) {
    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
        return;
    };
    // The protocol's messages are small: Nagle's algorithm would hold each
    // one back for the previous one's ACK.
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// What one write was answered.
#[derive(Debug)]
enum Answer {
    Acked(i64),
    /// 503 database-unavailable, with Retry-After.
    Unavailable,
    /// 429: tally's queue was full.
    Busy,
    /// 500 outcome-unknown: a COMMIT cut off.
    Unknown,
    /// Anything else breaks the contract.
    Other(String),
}

/// One answer, by the process that gave it and when it arrived.
#[derive(Debug)]
struct Seen {
    process: usize,
    at: Instant,
    answer: Answer,
}

async fn classify(r: Result<reqwest::Response, reqwest::Error>) -> Answer {
    let r = match r {
        Ok(r) => r,
        Err(e) => return Answer::Other(format!("no answer: {e}")),
    };
    let status = r.status();
    let retry_after = r.headers().contains_key("retry-after");
    let text = r.text().await.unwrap_or_default();
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    match (status, body["type"].as_str()) {
        (StatusCode::OK, _) if body["value"].is_i64() => {
            Answer::Acked(body["value"].as_i64().unwrap())
        }
        (StatusCode::SERVICE_UNAVAILABLE, Some("/problems/database-unavailable"))
            if retry_after =>
        {
            Answer::Unavailable
        }
        (StatusCode::TOO_MANY_REQUESTS, _) => Answer::Busy,
        (StatusCode::INTERNAL_SERVER_ERROR, Some("/problems/outcome-unknown")) => Answer::Unknown,
        _ => Answer::Other(format!("{status} (retry-after: {retry_after}): {text}")),
    }
}

/// The primary stopped mid-load, its synchronous standby promoted and the
/// Service pointed at it at once: no acknowledged write is lost and none
/// is counted twice, every answer is one the contract names, each process
/// writes again within 10 s of the promotion, and neither is restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_switchover_to_a_synchronous_standby_loses_no_acknowledged_write() {
    switch_over(None).await;
}

/// The same switchover, but the Service still points at the old primary
/// for 2 s after it came back as a read-only standby (an endpoint update
/// that lags behind the demotion): connections made then land on a server
/// that refuses every write (SQLSTATE 25006) and that never closes them.
/// tally must let go of them and write on the new primary, within the same
/// 10 s, with the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_that_lags_behind_the_demotion_costs_only_retryable_answers() {
    switch_over(Some(Duration::from_secs(2))).await;
}

/// Runs a switchover under load; `service_lag` is how long the Service
/// goes on pointing at the old primary once it is back as a standby.
async fn switch_over(service_lag: Option<Duration>) {
    const CLIENTS: usize = 8;
    const COUNTER: &str = "/counters/switchover";
    let primary = PgServer::start();
    let on_primary = postgres::fresh_database_on(&primary.url()).await;
    let db = on_primary.rsplit_once('/').unwrap().1.to_owned();
    let standby = PgServer::standby_of(&primary);
    primary.replicate_synchronously().await;
    let service = Forwarder::start(loopback(primary.port)).await;
    let url = format!("postgres://tally@{}/{db}", service.addr);
    let mut bins: Vec<Binary> = (0..2)
        .map(|_| Binary::start(&[("TALLY_DATABASE", url.as_str())]))
        .collect();
    let client = Client::builder()
        .timeout(Duration::from_secs(12))
        .build()
        .unwrap();
    // Each process reads once first, so that its readers hold connections
    // to the primary when it goes.
    for bin in &bins {
        let r = client.get(bin.url(COUNTER)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
    }

    let seen = Arc::new(Mutex::new(Vec::<Seen>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let process = i % bins.len();
            let (client, url) = (client.clone(), bins[process].url(COUNTER));
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let answer = classify(client.post(&url).send().await).await;
                    let failed = !matches!(answer, Answer::Acked(_));
                    let at = Instant::now();
                    seen.lock().unwrap().push(Seen {
                        process,
                        at,
                        answer,
                    });
                    // Far sooner than Retry-After says: the outage is timed
                    // to 10 ms, and enough requests fail that logging each
                    // one would show.
                    if failed {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stopping = Instant::now();
    // The cluster's steps block; the clients and the forwarder go on on
    // the other workers.
    tokio::task::block_in_place(|| primary.stop_fast());
    let stopped = Instant::now();
    tokio::task::block_in_place(|| standby.promote());
    let promoted = Instant::now();
    standby.replicate_asynchronously().await;
    let new_primary = loopback(standby.port);
    let switch = || {
        service.point_at(new_primary);
        Instant::now()
    };
    let mut switched = service_lag.is_none().then(switch);
    // The old primary follows the new one, so that nothing can write to
    // it (and so that it can be dropped: a stopped server cannot).
    tokio::task::block_in_place(|| primary.start_as_standby_of(&standby));
    let demoted = Instant::now();
    if let Some(lag) = service_lag {
        let on_old_primary = format!("postgres://tally@{}/{db}", loopback(primary.port));
        let mut old = sqlx::PgConnection::connect(&on_old_primary).await.unwrap();
        let refused = sqlx::query("INSERT INTO counters (name, value) VALUES ('probe', 1)")
            .execute(&mut old)
            .await
            .unwrap_err();
        // What tally's connections meet there (read_only_sql_transaction).
        assert_eq!(
            refused
                .as_database_error()
                .and_then(|e| e.code())
                .as_deref(),
            Some("25006"),
            "{refused}"
        );
        let _ = old.close().await;
        tokio::time::sleep(lag).await;
        switched = Some(switch());
    }
    let switched = switched.unwrap();

    // Until both processes have written again, at most 12 s.
    let written_again = |seen: &[Seen], process: usize| {
        seen.iter()
            .find(|s| {
                s.process == process && s.at > switched && matches!(s.answer, Answer::Acked(_))
            })
            .map(|s| s.at)
    };
    let deadline = promoted + Duration::from_secs(12);
    while Instant::now() < deadline {
        let both = {
            let seen = seen.lock().unwrap();
            (0..bins.len()).all(|p| written_again(&seen, p).is_some())
        };
        if both {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let ended = Instant::now();
    let seen = std::mem::take(&mut *seen.lock().unwrap());

    // What the clients saw, for the docs to quote; times from the moment
    // the primary was asked to stop.
    let ms = |at: Instant| {
        let (from, to, sign) = match at.checked_duration_since(stopping) {
            Some(_) => (stopping, at, ""),
            None => (at, stopping, "-"),
        };
        format!("{sign}{} ms", to.duration_since(from).as_millis())
    };
    eprintln!(
        "switchover (Service lag {service_lag:?}): primary stopped at {}, standby promoted at \
         {}, old primary back as a standby at {}, Service switched at {}",
        ms(stopped),
        ms(promoted),
        ms(demoted),
        ms(switched),
    );
    let mut recovered = Vec::new();
    for p in 0..bins.len() {
        let mine: Vec<&Seen> = seen.iter().filter(|s| s.process == p).collect();
        let count = |f: fn(&Answer) -> bool| mine.iter().filter(|s| f(&s.answer)).count();
        let oks: Vec<Instant> = mine
            .iter()
            .filter(|s| matches!(s.answer, Answer::Acked(_)))
            .map(|s| s.at)
            .collect();
        let first_failure = mine
            .iter()
            .find(|s| !matches!(s.answer, Answer::Acked(_)))
            .map(|s| ms(s.at));
        let last_ok_before = oks.iter().rev().find(|at| **at < promoted).copied();
        let first_ok_after = written_again(&seen, p);
        // From the last write the old primary acknowledged to the first
        // the new one did, or to the end of the load.
        let outage = match (last_ok_before, first_ok_after) {
            (Some(from), Some(to)) => format!("{:?}", to.duration_since(from)),
            (Some(from), None) => format!("more than {:?}: to the end", ended.duration_since(from)),
            (None, _) => "?".to_owned(),
        };
        eprintln!(
            "process {p}: 200 {}, 503 database-unavailable {}, 429 {}, 500 outcome-unknown {}, \
             other {}; first failure at {first_failure:?}, last 200 before the promotion at \
             {:?}, first 200 after it at {:?} ({:?} after the promotion); writes not 200 for \
             {outage}",
            oks.len(),
            count(|a| matches!(a, Answer::Unavailable)),
            count(|a| matches!(a, Answer::Busy)),
            count(|a| matches!(a, Answer::Unknown)),
            count(|a| matches!(a, Answer::Other(_))),
            last_ok_before.map(ms),
            first_ok_after.map(ms),
            first_ok_after.map(|at| at.duration_since(promoted)),
        );
        recovered.push(first_ok_after.map(|at| at.duration_since(promoted)));
    }
    let logs: Vec<String> = bins.iter().map(Binary::log_text).collect();
    let errors: Vec<usize> = logs
        .iter()
        .map(|l| {
            l.lines()
                .filter(|l| l.contains(r#""level":"ERROR""#))
                .count()
        })
        .collect();
    for (p, log) in logs.iter().enumerate() {
        eprintln!(
            "process {p}: {} ERROR lines; its WARN and ERROR lines:\n{}",
            errors[p],
            digest(log)
        );
    }

    let other: Vec<String> = seen
        .iter()
        .filter_map(|s| match &s.answer {
            Answer::Other(what) => Some(format!("process {} at {}: {what}", s.process, ms(s.at))),
            _ => None,
        })
        .collect();
    assert!(
        other.is_empty(),
        "{} answers outside the contract, the first: {:#?}",
        other.len(),
        &other[..other.len().min(5)],
    );
    let acked: Vec<i64> = seen
        .iter()
        .filter_map(|s| match s.answer {
            Answer::Acked(v) => Some(v),
            _ => None,
        })
        .collect();
    let unknown = seen
        .iter()
        .filter(|s| matches!(s.answer, Answer::Unknown))
        .count() as i64;
    assert!(acked.len() < seen.len(), "the switchover was never seen");
    let distinct: HashSet<i64> = acked.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        acked.len(),
        "an acknowledged value was given twice"
    );
    // The count on the new primary, from outside tally: every acknowledged
    // write is there, and the only others that may be are those answered
    // outcome-unknown.
    let on_new_primary = format!("postgres://tally@{new_primary}/{db}");
    let mut conn = sqlx::PgConnection::connect(&on_new_primary).await.unwrap();
    let value: i64 = sqlx::query_scalar("SELECT value FROM counters WHERE name = 'switchover'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    let n = acked.len() as i64;
    assert!(
        n <= value && value <= n + unknown,
        "counter {value}, acknowledged {n}, outcome unknown {unknown}"
    );
    assert!(acked.iter().all(|v| *v <= value), "{acked:?} > {value}");
    for (p, took) in recovered.iter().enumerate() {
        assert!(
            took.is_some_and(|t| t <= Duration::from_secs(10)),
            "process {p} wrote again {took:?} after the promotion"
        );
    }
    // The old primary follows the new one, and has caught up: tally's
    // readers may still be connected there (the Service moves new
    // connections only), and a read must not be told apart by timing.
    standby.wait_for_streaming_standby().await;
    primary.wait_to_replay(&standby).await;
    // The same processes, ready, and reading the new primary's count.
    for bin in &mut bins {
        assert!(bin.child.try_wait().unwrap().is_none(), "tally exited");
        let r = client.get(bin.url("/ready")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        let r = client.get(bin.url(COUNTER)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        assert_eq!(r.json::<Value>().await.unwrap()["value"], value);
    }
    // A failed request is the client's to see, not one log line each.
    for (p, n) in errors.iter().enumerate() {
        assert!(*n <= 20, "process {p} logged {n} ERROR lines");
    }
    for mut bin in bins {
        bin.sigterm();
        let status = bin.wait(Duration::from_secs(20)).await;
        assert_eq!(status.code(), Some(0), "{}", digest(&bin.log_text()));
    }
}

/// tally's WARN and ERROR lines, each kind once with its count: a failing
/// run logs thousands.
fn digest(log: &str) -> String {
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for line in log.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let level = v["level"].as_str().unwrap_or_default();
        if !matches!(level, "WARN" | "ERROR") {
            continue;
        }
        let kind = format!(
            "{level} {} {:?} {:?}",
            v["target"].as_str().unwrap_or_default(),
            v["fields"]["message"].as_str().unwrap_or_default(),
            v["fields"]["error"].as_str().unwrap_or_default(),
        );
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => kinds.push((kind, 1)),
        }
    }
    kinds
        .iter()
        .map(|(kind, n)| format!("  {n:>6} {kind}"))
        .collect::<Vec<_>>()
        .join("\n")
}
