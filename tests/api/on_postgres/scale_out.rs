//! Many tally processes on one PostgreSQL database: the limits, counters
//! and idempotency keys hold across processes, not just within one; a
//! server that stops mid-load loses nothing acknowledged and tally
//! recovers without a restart. Every process is the real binary; the
//! server is the test command's (a fresh database per test) or, for the
//! faults, one the test stops and starts itself.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use futures_util::future::join_all;
use reqwest::{Client, StatusCode};
use serde_json::json;

use crate::{
    helpers::{ADMIN, Binary, json, problem, put_budget, wait_for_queue_depth},
    postgres::{self, PgServer},
};

/// `n` tally processes on the database at `url`.
pub(crate) fn processes(n: usize, url: &str, extra: &[(&str, &str)]) -> Vec<Binary> {
    (0..n)
        .map(|_| {
            let mut env = vec![("TALLY_DATABASE", url), ("TALLY_ADMIN_TOKEN", ADMIN)];
            env.extend_from_slice(extra);
            Binary::start(&env)
        })
        .collect()
}

pub(crate) async fn stop_all(bins: Vec<Binary>) {
    for mut bin in bins {
        bin.sigterm();
        let status = bin.wait(Duration::from_secs(20)).await;
        assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    }
}

/// Waits (20 s at most) until a tally writer on `watch`'s database waits
/// for a lock: a batch that has begun and met a row held elsewhere.
pub(crate) async fn a_writer_waits_for_a_lock(watch: &mut sqlx::PgConnection) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = 'tally-writer' AND wait_event_type = 'Lock'
               AND datname = current_database()",
        )
        .fetch_one(&mut *watch)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no writer waited for a lock in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Budget `name`'s calls today, as `bin` reads them.
pub(crate) async fn global_calls(client: &Client, bin: &Binary, name: &str) -> i64 {
    let url = bin.url(&format!("/budgets/{name}/usage"));
    let usage = json(client.get(url).send().await.unwrap()).await;
    usage["global_calls"].as_i64().unwrap()
}

/// One series of `bin`'s `/metrics`.
pub(crate) async fn metric(client: &Client, bin: &Binary, series: &str) -> Option<f64> {
    let url = bin.url("/metrics");
    let text = client.get(url).send().await.unwrap().text().await.unwrap();
    crate::helpers::sample(&text, series)
}

/// Four processes, many concurrent clients, one budget with small limits:
/// exactly the limits are admitted, and every call is counted as the rule
/// says (visitor first, then global; denied calls stay counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_processes_admit_exactly_a_budgets_limits() {
    const VISITORS: usize = 20;
    const CALLS: usize = 10;
    const VISITOR_LIMIT: usize = 5;
    const GLOBAL_LIMIT: usize = 60;
    let url = postgres::fresh_database().await;
    let bins = processes(4, &url, &[]);
    let client = Client::new();
    put_budget(
        &client,
        &bins[0],
        "api",
        json!({"visitor_limit": VISITOR_LIMIT, "global_limit": GLOBAL_LIMIT}),
    )
    .await;

    // Every call of every visitor at once, spread over the processes.
    let calls = (0..VISITORS * CALLS).map(|i| {
        let visitor = format!("v{}", i % VISITORS);
        let url = bins[i % bins.len()].url("/budgets/api/check");
        let client = client.clone();
        async move {
            let r = client
                .post(url)
                .json(&json!({"visitor": visitor}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
            (visitor, json(r).await)
        }
    });
    let answers = join_all(calls).await;

    let mut allowed: HashMap<String, usize> = HashMap::new();
    let mut global_calls_seen = HashSet::new();
    for (visitor, d) in &answers {
        if d["allowed"] == true {
            *allowed.entry(visitor.clone()).or_default() += 1;
            // Each admitted call took a global count of its own.
            assert!(global_calls_seen.insert(d["global_calls"].as_i64().unwrap()));
        }
    }
    let admitted: usize = allowed.values().sum();
    assert_eq!(admitted, GLOBAL_LIMIT.min(VISITORS * VISITOR_LIMIT));
    assert!(allowed.values().all(|&n| n <= VISITOR_LIMIT), "{allowed:?}");

    let usage = json(
        client
            .get(bins[3].url("/budgets/api/usage?visitor=v7"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    // Every call that passed its visitor's limit reached the global count.
    assert_eq!(usage["global_calls"], VISITORS * VISITOR_LIMIT);
    assert_eq!(usage["visitor_calls"], CALLS);
    stop_all(bins).await;
}

/// Eight processes incrementing one counter: every acknowledged value is
/// distinct and the final value is their number.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_processes_count_one_counter_exactly() {
    const PER_CLIENT: usize = 40;
    const CLIENTS_PER_PROCESS: usize = 4;
    let url = postgres::fresh_database().await;
    let bins = processes(8, &url, &[]);
    let client = Client::new();
    let clients = bins.iter().flat_map(|bin| {
        (0..CLIENTS_PER_PROCESS).map(|_| {
            let (client, url) = (client.clone(), bin.url("/counters/shared"));
            async move {
                let mut values = Vec::new();
                for _ in 0..PER_CLIENT {
                    let r = client.post(&url).send().await.unwrap();
                    assert_eq!(r.status(), StatusCode::OK);
                    values.push(json(r).await["value"].as_i64().unwrap());
                }
                values
            }
        })
    });
    let values: Vec<i64> = join_all(clients).await.into_iter().flatten().collect();
    let total = (bins.len() * CLIENTS_PER_PROCESS * PER_CLIENT) as i64;
    let distinct: HashSet<i64> = values.iter().copied().collect();
    assert_eq!(distinct, (1..=total).collect::<HashSet<_>>());
    for bin in &bins {
        let v = json(
            client
                .get(bin.url("/counters/shared"))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(v["value"], total);
    }
    stop_all(bins).await;
}

/// Retries of one Idempotency-Key land on different processes, at the same
/// time and later: one effect, one answer, replayed everywhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_retried_on_other_processes_has_one_effect() {
    const KEYS: usize = 30;
    let url = postgres::fresh_database().await;
    let bins = processes(4, &url, &[]);
    let client = Client::new();
    for round in 0..2 {
        let tries =
            (0..KEYS).flat_map(|k| bins.iter().map(move |bin| (k, bin.url("/counters/keyed"))));
        let answers = join_all(tries.map(|(k, url)| {
            let client = client.clone();
            async move {
                // Retries of one key racing on several processes can
                // deadlock each other; a batch that loses 8 times in a row
                // is answered 503 (nothing written), a request that takes
                // longer than the request timeout 503 too (outcome
                // unknown): the client retries with its key, as told.
                let mut r;
                let mut tries = 0;
                loop {
                    r = client
                        .post(&url)
                        .header("idempotency-key", format!("key-{k}"))
                        .json(&json!({"by": 2}))
                        .send()
                        .await
                        .unwrap();
                    tries += 1;
                    if r.status() != StatusCode::SERVICE_UNAVAILABLE || tries == 20 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
                let replayed = r.headers().contains_key("idempotent-replayed");
                (k, json(r).await["value"].as_i64().unwrap(), replayed)
            }
        }))
        .await;
        let mut by_key: HashMap<usize, Vec<(i64, bool)>> = HashMap::new();
        for (k, value, replayed) in answers {
            by_key.entry(k).or_default().push((value, replayed));
        }
        for (k, tries) in &by_key {
            let first = tries.iter().filter(|(_, replayed)| !replayed).count();
            // In the first round at most one try per key did it (none was
            // answered so when the one that did timed out: its client's
            // retry was a replay); in the second every try is a replay.
            // One effect per key either way: one value per key, and the
            // total below.
            assert!(first <= usize::from(round == 0), "key {k}: {tries:?}");
            assert!(
                tries.iter().all(|(v, _)| *v == tries[0].0),
                "key {k}: {tries:?}"
            );
        }
    }
    let v = json(
        client
            .get(bins[2].url("/counters/keyed"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(v["value"], 2 * KEYS);
    // A key reused for another request is refused on any process.
    let r = client
        .post(bins[1].url("/counters/other"))
        .header("idempotency-key", "key-0")
        .send()
        .await
        .unwrap();
    let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert_eq!(p["type"], "/problems/idempotency-key-reused");
    stop_all(bins).await;
}

/// The first calls of a day prune old usage; two processes racing on it
/// both succeed, the old days are gone once, and nothing of the kept days
/// is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_racing_on_a_days_prune_lose_nothing() {
    let url = postgres::fresh_database().await;
    let bins = processes(2, &url, &[]);
    let client = Client::new();
    put_budget(
        &client,
        &bins[0],
        "old",
        json!({"visitor_limit": 1000, "global_limit": 1000, "retention_days": 1}),
    )
    .await;
    // Usage of long ago, as an earlier day's calls left it.
    postgres::sql(
        &url,
        "INSERT INTO budget_visitor_usage VALUES ('old', '2001-01-01', 'a', 3), ('old', '2001-01-02', 'a', 4);
         INSERT INTO budget_global_usage VALUES ('old', '2001-01-01', 3), ('old', '2001-01-02', 4);",
    )
    .await;
    let checks = (0..200).map(|i| {
        let (client, url) = (client.clone(), bins[i % 2].url("/budgets/old/check"));
        async move {
            let r = client
                .post(url)
                .json(&json!({"visitor": format!("v{}", i % 7)}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            json(r).await
        }
    });
    let answers = join_all(checks).await;
    assert!(answers.iter().all(|d| d["allowed"] == true));
    assert_eq!(global_calls(&client, &bins[1], "old").await, 200);
    let mut pruned = 0.0;
    for bin in &bins {
        pruned += metric(&client, bin, "tally_budget_pruned_rows_total")
            .await
            .unwrap();
    }
    // Both days of long ago, each a visitor row and a global row.
    assert_eq!(pruned, 4.0);
    stop_all(bins).await;
}

/// What a client saw of one write while the server went away and came back.
#[derive(Debug, Default)]
struct Seen {
    acked: Vec<i64>,
    unavailable: usize,
    unknown: usize,
    other: Vec<String>,
}

/// PostgreSQL stopped mid-load (fast shutdown: every session ended) and
/// started again: writes answer 503 with Retry-After while it is gone (or
/// outcome-unknown for a COMMIT cut off), budget checks deny with
/// `meter_error`, `/ready` and `/livez` stay up, tally recovers without a
/// restart, and no acknowledged write is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_stopped_mid_load_loses_nothing_acknowledged_and_recovers() {
    let server = PgServer::start();
    let url = postgres::fresh_database_on(&server.url()).await;
    let bins = processes(2, &url, &[]);
    let client = Client::new();
    put_budget(
        &client,
        &bins[0],
        "b",
        json!({"visitor_limit": 1000000, "global_limit": 1000000}),
    )
    .await;

    let stop_at = Instant::now() + Duration::from_secs(6);
    let writers = (0..8).map(|i| {
        let (client, url) = (client.clone(), bins[i % 2].url("/counters/survivor"));
        tokio::spawn(async move {
            let mut seen = Seen::default();
            while Instant::now() < stop_at {
                let r = client.post(&url).send().await.unwrap();
                match r.status() {
                    StatusCode::OK => seen.acked.push(json(r).await["value"].as_i64().unwrap()),
                    StatusCode::SERVICE_UNAVAILABLE => {
                        assert_eq!(r.headers()["retry-after"], "1");
                        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
                        assert_eq!(p["type"], "/problems/database-unavailable", "{p}");
                        seen.unavailable += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    StatusCode::INTERNAL_SERVER_ERROR => {
                        let p = problem(r, StatusCode::INTERNAL_SERVER_ERROR).await;
                        assert_eq!(p["type"], "/problems/outcome-unknown", "{p}");
                        seen.unknown += 1;
                    }
                    s => seen.other.push(format!("{s}: {}", r.text().await.unwrap())),
                }
            }
            seen
        })
    });
    let writers: Vec<_> = writers.collect();

    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.stop_fast();
    // While it is gone: writes fail fast and clearly (above), checks
    // deny, and tally itself stays alive and ready.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for bin in bins.iter() {
        let r = client
            .post(bin.url("/budgets/b/check"))
            .json(&json!({"visitor": "v"}))
            .send()
            .await
            .unwrap();
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(
            (&p["reason"], &p["allowed"]),
            (&json!("meter_error"), &json!(false))
        );
        let r = client
            .get(bin.url("/counters/survivor"))
            .send()
            .await
            .unwrap();
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(p["type"], "/problems/database-unavailable");
        for path in ["/ready", "/livez"] {
            let r = client.get(bin.url(path)).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::OK, "{path}");
        }
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    server.start_again();
    postgres::wait_until_up(&url, Duration::from_secs(20)).await;

    let mut seen = Seen::default();
    for w in writers {
        let s = w.await.unwrap();
        seen.acked.extend(s.acked);
        seen.unavailable += s.unavailable;
        seen.unknown += s.unknown;
        seen.other.extend(s.other);
    }
    assert!(
        seen.other.is_empty(),
        "answers outside the contract: {:?}",
        seen.other
    );
    assert!(seen.unavailable > 0, "the outage was never seen: {seen:?}");
    // Writes commit again after the outage, without a restart.
    let r = client
        .post(bins[1].url("/counters/survivor"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    seen.acked.push(json(r).await["value"].as_i64().unwrap());
    let value = json(
        client
            .get(bins[0].url("/counters/survivor"))
            .send()
            .await
            .unwrap(),
    )
    .await["value"]
        .as_i64()
        .unwrap();
    let acked = seen.acked.len() as i64;
    let distinct: HashSet<i64> = seen.acked.iter().copied().collect();
    assert_eq!(
        distinct.len() as i64,
        acked,
        "an acknowledged value was given twice"
    );
    // Every acknowledged write is there; the only others that may be are
    // those whose COMMIT was cut off and were answered so.
    assert!(
        value >= acked && value <= acked + seen.unknown as i64,
        "counter {value}, acknowledged {acked}, unknown {}",
        seen.unknown
    );
    assert!(seen.acked.iter().all(|v| *v <= value));
    let logs: String = bins.iter().map(Binary::log_text).collect();
    assert!(logs.contains("the database is unavailable"), "{logs}");
    assert!(logs.contains("the database answers again"), "{logs}");
    // An outage is logged when it starts and ends, not once per request
    // it failed (there were hundreds).
    for bin in &bins {
        let errors = bin
            .log_text()
            .lines()
            .filter(|l| l.contains("\"level\":\"ERROR\""))
            .count();
        assert!(errors <= 10, "{errors} ERROR lines: {}", bin.log_text());
    }
    stop_all(bins).await;
}

/// A server that stops answering without closing connections (a network
/// partition, a frozen host) does not hold the writer: the batch in flight
/// is cut off, later writes answer 503 database-unavailable, and writes
/// commit again once it answers. Cut off before its COMMIT went out, the
/// batch committed nothing and says so (503, not outcome-unknown): its
/// callers may retry without a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_that_stops_answering_does_not_hold_writes_forever() {
    let server = PgServer::start();
    let url = postgres::fresh_database_on(&server.url()).await;
    let bins = processes(1, &url, &[("TALLY_REQUEST_TIMEOUT", "60")]);
    let client = Client::new();
    let write = || client.post(bins[0].url("/counters/frozen")).send();
    assert_eq!(write().await.unwrap().status(), StatusCode::OK);

    server.freeze(true);
    let started = Instant::now();
    let cut_off = write().await.unwrap();
    let took = started.elapsed();
    let p = problem(cut_off, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(p["type"], "/problems/database-unavailable", "{p}");
    // At most 17 s: a batch's limit (15 s), or, frozen during the writer's
    // work after the first write's batch, one step of that work (15 s, its
    // connect included) and this batch's connect (2 s); the steps after
    // the first do not each wait out a connect (they did: 21 s).
    assert!(took < Duration::from_secs(25), "held for {took:?}");
    // The connection was dropped; a new one cannot be had while frozen: at
    // most 4 s, this batch's connect and, had an idle check come first,
    // its own.
    let started = Instant::now();
    let r = write().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(7),
        "{:?}",
        started.elapsed()
    );
    let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(p["type"], "/problems/database-unavailable", "{p}");

    server.freeze(false);
    let mut value = None;
    for _ in 0..100 {
        let r = write().await.unwrap();
        if r.status() == StatusCode::OK {
            value = json(r).await["value"].as_i64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first write and this one: the one cut off did not commit.
    let value = value.expect("writes commit again once the server answers");
    assert_eq!(value, 2);
    stop_all(bins).await;
}

/// A batch split around an operator's commands (checks of a budget
/// alternating with resets of its visitors: a transaction for the first
/// check, one for the first reset, one for the rest) on a server that
/// stops answering: the first transaction is cut off at its time limit,
/// and the others do not run. Every caller hears at once that the database
/// cannot be reached (`503`; a check `meter-error`, denied), rather than
/// each transaction after the first waiting out a connect timeout of its
/// own while its callers give up, and once the server answers again
/// nothing of the batch has been counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_split_batch_on_a_server_that_stops_answering_fails_as_one() {
    let server = PgServer::start();
    let url = postgres::fresh_database_on(&server.url()).await;
    // A slow writer, so that everything below shares one batch.
    let bins = processes(1, &url, &[("TALLY_TEST_WRITER_DELAY_MS", "2500")]);
    let bin = &bins[0];
    let client = Client::new();
    put_budget(
        &client,
        bin,
        "b",
        json!({"visitor_limit": 100, "global_limit": 100}),
    )
    .await;
    let held = bin.batches_held();
    let first = tokio::spawn(client.post(bin.url("/counters/first")).send());
    bin.writer_holds(held + 1).await;
    let mut sent = Vec::new();
    for i in 0..8 {
        let check = client
            .post(bin.url("/budgets/b/check"))
            .json(&json!({"visitor": format!("v{i}")}));
        sent.push(("/problems/meter-error", tokio::spawn(check.send())));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let reset = client
            .post(bin.url("/budgets/b/reset"))
            .bearer_auth(ADMIN)
            .json(&json!({"visitor": format!("w{i}")}));
        sent.push(("/problems/database-unavailable", tokio::spawn(reset.send())));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for_queue_depth(&client, &bin.url(""), 16).await;
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    server.freeze(true);
    let frozen = Instant::now();
    let mut answered = Vec::new();
    for (kind, sent) in sent {
        let p = problem(
            sent.await.unwrap().unwrap(),
            StatusCode::SERVICE_UNAVAILABLE,
        )
        .await;
        assert_eq!(p["type"], kind, "{p}");
        answered.push(frozen.elapsed());
    }
    let (earliest, latest) = (answered.iter().min(), answered.iter().max());
    let (earliest, latest) = (*earliest.unwrap(), *latest.unwrap());
    assert!(latest < Duration::from_secs(25), "{answered:?}");
    assert!(latest - earliest < Duration::from_secs(1), "{answered:?}");
    server.freeze(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(global_calls(&client, bin, "b").await, 0);
    stop_all(bins).await;
}

/// A deadlock between tally's batch and another transaction is PostgreSQL's
/// to break, and its victim here is tally's: the writer runs the batch
/// again and its callers only see their answers, a little later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_loses_a_deadlock_is_run_again_unseen() {
    use sqlx::Connection;
    let url = postgres::fresh_database().await;
    // A slow writer, so that the two deletes below share a batch.
    let bins = processes(1, &url, &[("TALLY_TEST_WRITER_DELAY_MS", "1500")]);
    let bin = &bins[0];
    let client = Client::new();
    let post = |name: &str| client.post(bin.url(&format!("/counters/{name}"))).send();
    for name in ["a", "b"] {
        assert_eq!(post(name).await.unwrap().status(), StatusCode::OK);
    }
    // Another transaction holds `b`.
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; UPDATE counters SET value = value + 100 WHERE name = 'b'")
        .execute(&mut other)
        .await
        .unwrap();
    // While the writer sleeps over a batch of `c`, the deletes of `a` and
    // `b` queue up and become the next batch, which locks `a`, then waits
    // for `b`. An operator's commands run command by command, where a row
    // is waited for up to the lock timeout (2 s), past PostgreSQL's
    // deadlock_timeout (1 s): a set-based batch would give up on `b` after
    // 250 ms, before a deadlock could be found.
    let c = tokio::spawn(post("c"));
    bin.writer_holds(3).await;
    let delete = |name: &str| {
        client
            .delete(bin.url(&format!("/counters/{name}")))
            .bearer_auth(ADMIN)
            .send()
    };
    let (a, b) = (delete("a"), delete("b"));
    let batch = tokio::spawn(async move { futures_util::future::join(a, b).await });
    wait_for_queue_depth(&client, &bin.url(""), 2).await;
    // Until tally's writer waits for the lock on `b`.
    let mut watch = sqlx::PgConnection::connect(&url).await.unwrap();
    a_writer_waits_for_a_lock(&mut watch).await;
    // The other transaction now waits for `a`: a deadlock. tally's backend
    // has waited longer, so its deadlock check runs first and it is the
    // one cancelled; the other transaction goes on and commits, and the
    // batch run again deletes both.
    sqlx::raw_sql("UPDATE counters SET value = value + 100 WHERE name = 'a'; COMMIT")
        .execute(&mut other)
        .await
        .unwrap();
    let (a, b) = batch.await.unwrap();
    assert_eq!(c.await.unwrap().unwrap().status(), StatusCode::OK);
    for r in [a.unwrap(), b.unwrap()] {
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM counters WHERE name IN ('a', 'b')")
        .fetch_one(&mut watch)
        .await
        .unwrap();
    assert_eq!(left, 0);
    let retries = metric(&client, bin, "tally_write_retries_total")
        .await
        .unwrap();
    assert!(retries >= 1.0, "{retries}");
    stop_all(bins).await;
}

/// Connections that die while idle (a server restart, a proxy's idle
/// timeout, an operator's `pg_terminate_backend`) cost no client an error:
/// the next write and the next read find theirs dead and use new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_that_died_while_idle_cost_no_client_an_error() {
    let url = postgres::fresh_database().await;
    let bins = processes(1, &url, &[]);
    let client = Client::new();
    let counter = bins[0].url("/counters/idle");
    for expected in 1..=3 {
        let r = client.post(&counter).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        assert_eq!(json(r).await["value"], expected);
        let r = client.get(&counter).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        assert_eq!(json(r).await["value"], expected);
        postgres::sql(
            &url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_all(bins).await;
}

/// A server that ends idle sessions (`idle_session_timeout`, set on the
/// database as an operator or a managed service sets it) costs no client
/// an error either: each write, read and check after a quiet spell finds
/// its connection ended (57P05) and uses a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_that_ends_idle_sessions_costs_no_client_an_error() {
    let url = postgres::fresh_database().await;
    postgres::sql(
        &url,
        "DO $$ BEGIN
           EXECUTE format('ALTER DATABASE %I SET idle_session_timeout = %L',
                          current_database(), '300ms');
         END $$",
    )
    .await;
    let bins = processes(1, &url, &[]);
    let client = Client::new();
    let r = client
        .put(bins[0].url("/budgets/quiet"))
        .bearer_auth(ADMIN)
        .json(&json!({"visitor_limit": 10, "global_limit": 10}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
    let counter = bins[0].url("/counters/quiet");
    for expected in 1..=3 {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let r = client.post(&counter).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        assert_eq!(json(r).await["value"], expected);
        tokio::time::sleep(Duration::from_millis(800)).await;
        let r = client.get(&counter).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        assert_eq!(json(r).await["value"], expected);
        tokio::time::sleep(Duration::from_millis(800)).await;
        let r = client
            .post(bins[0].url("/budgets/quiet/check"))
            .json(&json!({"visitor": "v"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        assert_eq!(json(r).await["visitor_calls"], expected);
    }
    // Routine, and logged as such: not as a dropped connection, a warning
    // after every quiet spell.
    let log = bins[0].log_text();
    assert!(
        log.contains("the server ended the writer's idle PostgreSQL session"),
        "{log}"
    );
    assert!(
        !log.contains("writer dropped its PostgreSQL connection"),
        "{log}"
    );
    stop_all(bins).await;
}

/// Keyed writes to many counters from several processes take their row
/// locks in one order, whether their batch claims its keys set-based or
/// (with a budget's configuration among them, every 25th request) command
/// by command, in savepoints: no deadlock, no retry, every write answered
/// 200 and counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keyed_writes_to_many_counters_on_many_processes_never_deadlock() {
    const WRITES: usize = 600;
    let url = postgres::fresh_database().await;
    let bins = processes(3, &url, &[("TALLY_TEST_WRITER_DELAY_MS", "5")]);
    let client = Client::new();
    let writes = (0..WRITES).map(|i| {
        // Names in an order that differs per request, so batches hold
        // them in every order.
        let name = format!("c{}", (i * 7919) % 13);
        let (client, url) = (
            client.clone(),
            bins[i % 3].url(&format!("/counters/{name}")),
        );
        let admin = (i % 25 == 0).then(|| {
            let put = url.replace(&format!("/counters/{name}"), "/budgets/b");
            client
                .put(put)
                .bearer_auth(ADMIN)
                .json(&json!({"visitor_limit": 1, "global_limit": 1}))
                .send()
        });
        async move {
            let r = client
                .post(url)
                .header("idempotency-key", format!("w-{i}"))
                .send();
            let (r, admin) = futures_util::future::join(r, async {
                match admin {
                    Some(put) => Some(put.await.unwrap().status()),
                    None => None,
                }
            })
            .await;
            let r = r.unwrap();
            assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
            assert!(admin.is_none_or(|s| s == StatusCode::OK), "{admin:?}");
        }
    });
    join_all(writes).await;
    let mut total = 0;
    for n in 0..13 {
        let v = json(
            client
                .get(bins[0].url(&format!("/counters/c{n}")))
                .send()
                .await
                .unwrap(),
        )
        .await;
        total += v["value"].as_i64().unwrap();
    }
    assert_eq!(total, WRITES as i64);
    for bin in &bins {
        let retries = metric(&client, bin, "tally_write_retries_total").await;
        assert_eq!(retries, Some(0.0));
    }
    stop_all(bins).await;
}

/// Processes starting together on an empty database migrate it once
/// between them (sqlx's migration lock) and all serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_starting_together_migrate_once() {
    let url = postgres::fresh_database().await;
    let starts = (0..4).map(|_| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || Binary::start(&[("TALLY_DATABASE", url.as_str())]))
    });
    let bins: Vec<Binary> = join_all(starts)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let client = Client::new();
    for bin in &bins {
        let r = client.post(bin.url("/counters/m")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    let v = json(client.get(bins[0].url("/counters/m")).send().await.unwrap()).await;
    assert_eq!(v["value"], 4);
    stop_all(bins).await;
}

/// A server that cannot be reached at start is a clear startup failure,
/// and the password in the URL is never printed.
#[tokio::test]
async fn an_unreachable_server_at_start_fails_clearly_without_the_password() {
    let port = crate::loopback::free_port();
    let url = format!("postgres://tally:sekret-pw@127.0.0.1:{port}/tally");
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", &url)]);
    assert!(
        err.contains(&format!(
            "cannot use PostgreSQL at postgres://tally:***@127.0.0.1:{port}/tally"
        )),
        "{err}"
    );
    assert!(!err.contains("sekret-pw"), "{err}");
}
