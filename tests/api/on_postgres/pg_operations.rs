//! PostgreSQL as operators run it, on the days that are not quiet: a
//! database that turns read-only (a switchover's demoted primary), a
//! default collation that is not byte order, processes whose clocks
//! disagree, a row an operator's session keeps locked, a restart under a
//! full read pool, and a server that refuses connection slots. Every
//! process is the real binary; the server is the test command's (a fresh
//! database per test) or one the test stops and starts itself.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use reqwest::{Client, StatusCode};
use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::{
    helpers::{
        ADMIN, Binary, failed_start, faketime_library, json, problem, put_budget, set_clock,
        wait_for_queue_depth,
    },
    on_postgres::scale_out::{a_writer_waits_for_a_lock, metric, processes, stop_all},
    postgres::{self, PgServer},
};

/// A name for a role or database of the test's own on the shared server,
/// where names outlive processes (and process ids come round again).
fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}_{}_{nanos}", std::process::id())
}

/// The database name at the end of `url`.
fn database_name(url: &str) -> &str {
    url.rsplit('/').next().unwrap()
}

/// Runs `sql` (made in the test, never of input) on `url`.
async fn run_sql(url: &str, sql: String) {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
}

/// Ends every session on `db` but the caller's, as a switchover or a
/// server restart does.
async fn terminate_sessions(server: &str, db: &str) {
    run_sql(
        server,
        format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = '{db}' AND pid <> pg_backend_pid()"
        ),
    )
    .await;
}

/// Posts to `url` until it answers 200, at most `limit`; how long it took.
async fn until_ok(client: &Client, url: &str, limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let r = client.post(url).send().await.unwrap();
        if r.status() == StatusCode::OK {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "still {} after {limit:?}: {:?}",
            r.status(),
            r.text().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A database whose sessions start read-only, as a primary demoted by a
/// switchover (or a standby) is to a connection that still reaches it:
/// writes answer 503 database-unavailable with Retry-After and write
/// nothing, checks deny with meter_error, reads refuse it too (a read
/// there may not see the last write), `/ready` stays 200; and once the
/// database takes writes again, so does tally, within seconds, with no
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_that_turns_read_only_is_unavailable_and_then_writable_again() {
    let server = postgres::server_url();
    let url = postgres::fresh_database().await;
    let db = database_name(&url).to_owned();
    let bins = processes(1, &url, &[]);
    let client = Client::new();
    let counter = bins[0].url("/counters/rw");
    put_budget(
        &client,
        &bins[0],
        "b",
        json!({"visitor_limit": 10, "global_limit": 10}),
    )
    .await;
    assert_eq!(
        client.post(&counter).send().await.unwrap().status(),
        StatusCode::OK
    );
    // A read connection is pooled now, as the writer's connection is.
    assert_eq!(
        client.get(&counter).send().await.unwrap().status(),
        StatusCode::OK
    );

    run_sql(
        &server,
        format!("ALTER DATABASE {db} SET default_transaction_read_only = on"),
    )
    .await;
    terminate_sessions(&server, &db).await;
    for _ in 0..3 {
        let r = client.post(&counter).send().await.unwrap();
        assert_eq!(r.headers()["retry-after"], "1");
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(p["type"], "/problems/database-unavailable", "{p}");
        let r = client
            .post(bins[0].url("/budgets/b/check"))
            .json(&json!({"visitor": "v"}))
            .send()
            .await
            .unwrap();
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(
            (&p["reason"], &p["allowed"]),
            (&json!("meter_error"), &json!(false))
        );
        let r = client.get(&counter).send().await.unwrap();
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(p["type"], "/problems/database-unavailable", "{p}");
    }
    let r = client.get(bins[0].url("/ready")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);

    run_sql(
        &server,
        format!("ALTER DATABASE {db} RESET default_transaction_read_only"),
    )
    .await;
    let took = until_ok(&client, &counter, Duration::from_secs(5)).await;
    eprintln!("writable again after {took:?}");
    // Nothing written while it was read-only: this write is the second.
    let v = json(client.get(&counter).send().await.unwrap()).await;
    assert_eq!(v["value"], 2);
    let logs = bins[0].log_text();
    assert!(logs.contains("takes no writes"), "{logs}");
    assert!(
        !logs.contains("response failed"),
        "a line per failed request"
    );
    stop_all(bins).await;
}

/// A database in an encoding other than UTF-8 cannot hold every name and
/// visitor id, nor the lists' upper bound: on one, every list failed
/// (`500`) and checks by visitors it cannot spell were denied. tally now
/// refuses it at start, and says how to create one it can use.
#[tokio::test]
async fn a_database_not_in_utf8_is_refused_at_start() {
    let server = postgres::server_url();
    let db = unique("tally_latin1");
    run_sql(
        &server,
        format!("CREATE DATABASE {db} ENCODING 'LATIN1' TEMPLATE template0 LOCALE 'C'"),
    )
    .await;
    let url = format!("{}/{db}", server.rsplit_once('/').unwrap().0);
    let e = failed_start(&[("TALLY_DATABASE", &url)]);
    assert!(
        e.contains("the database is encoded LATIN1") && e.contains("ENCODING 'UTF8'"),
        "{e}"
    );
}

/// Two processes writing the same counters, one with Idempotency-Keys (its
/// batches run command by command, in lock order computed in Rust) and one
/// without (its batches run set-based, ordered in SQL), on a database whose
/// default collation sorts `a` before `B` and `a_b` before `a-b`, which
/// byte order does not: they take their row locks in one order, so they
/// never deadlock, and they go as fast as on names whose orders agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn names_lock_in_byte_order_whatever_the_databases_collation() {
    let server = postgres::server_url();
    let db = unique("tally_icu");
    run_sql(
        &server,
        format!(
            "CREATE DATABASE {db} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' \
             LOCALE 'C.UTF-8'"
        ),
    )
    .await;
    let url = format!("{}/{db}", server.rsplit_once('/').unwrap().0);
    // The premise: this database orders names otherwise than bytes do.
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let sorted: Vec<String> = sqlx::query_scalar(
        "SELECT n FROM unnest(ARRAY['B', 'a', 'a-b', 'a_b']) AS t (n) ORDER BY n",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(sorted, ["a", "a_b", "a-b", "B"]);
    let _ = conn.close().await;

    // A short delay before each batch, so that batches hold several names.
    let bins = processes(2, &url, &[("TALLY_TEST_WRITER_DELAY_MS", "2")]);
    let client = Client::new();
    let rate = async |names: [&str; 4]| {
        let run_for = Duration::from_secs(1);
        let started = Instant::now();
        let clients = (0..8).map(|c| {
            let client = client.clone();
            let bin = &bins[c % 2];
            async move {
                let mut done = 0u32;
                while started.elapsed() < run_for {
                    let name = names[(done as usize + c) % names.len()];
                    let mut r = client.post(bin.url(&format!("/counters/{name}")));
                    if c % 2 == 1 {
                        r = r.header("idempotency-key", format!("{name}-{c}-{done}"));
                    }
                    let r = r.send().await.unwrap();
                    assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
                    done += 1;
                }
                done
            }
        });
        let done: u32 = join_all(clients).await.into_iter().sum();
        f64::from(done) / started.elapsed().as_secs_f64()
    };
    // In turns, so that whatever else loads the machine weighs on both.
    let (mut control, mut mixed) = (0.0, 0.0);
    for _ in 0..3 {
        control += rate(["a", "b", "c", "d"]).await / 3.0;
        mixed += rate(["a", "B", "a-b", "a_b"]).await / 3.0;
    }
    eprintln!("writes/s: names in one order {control:.0}, in two orders {mixed:.0}");
    for bin in &bins {
        let retries = metric(&client, bin, "tally_write_retries_total").await;
        assert_eq!(retries, Some(0.0), "deadlocks were broken and rerun");
    }
    // Lock waits between batches taking names in two orders would cost a
    // deadlock check (1 s) each, and the rate far more than this margin
    // (kept wide: another test's burst may land on one kind of round).
    assert!(
        mixed * 4.0 >= control,
        "{mixed:.0}/s against {control:.0}/s"
    );
    stop_all(bins).await;
}

/// One process's clock runs 25 hours ahead (a node whose clock drifted):
/// on PostgreSQL the server's clock decides for everyone, so both count
/// the same day (a visitor's limit and the global limit hold across them),
/// both show and reset the same day, and the fast one's key clean-up does
/// not forget a key the other has just stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_process_whose_clock_runs_ahead_goes_by_the_servers_clock() {
    let url = postgres::fresh_database().await;
    let library = faketime_library();
    let env = [
        ("TALLY_DATABASE", url.as_str()),
        ("TALLY_ADMIN_TOKEN", ADMIN),
    ];
    let normal = Binary::start(&env);
    let mut shifted_env = env.to_vec();
    shifted_env.extend([
        ("LD_PRELOAD", library.to_str().unwrap()),
        ("FAKETIME", "+25h"),
        // Timers and deadlines keep the real pace.
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ]);
    let ahead = Binary::start(&shifted_env);
    let bins = [&normal, &ahead];
    let client = Client::new();
    put_budget(
        &client,
        &normal,
        "b",
        json!({"visitor_limit": 5, "global_limit": 8}),
    )
    .await;

    let mut allowed = 0;
    let mut days = std::collections::HashSet::new();
    // Seconds until the day resets, as each answer's RateLimit header says.
    let mut resets = Vec::new();
    let visitors = std::iter::repeat_n("v", 10).chain(["w0", "w1", "w2", "w3", "w4", "w5"]);
    for (i, visitor) in visitors.enumerate() {
        let r = client
            .post(bins[i % 2].url("/budgets/b/check"))
            .json(&json!({"visitor": visitor}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let header = r.headers()["ratelimit"].to_str().unwrap().to_owned();
        resets.extend(
            header
                .split(';')
                .filter_map(|f| f.strip_prefix("t="))
                .map(|t| t.split(',').next().unwrap().parse::<u64>().unwrap()),
        );
        let d = json(r).await;
        allowed += usize::from(d["allowed"] == true);
        days.insert(d["day"].as_str().unwrap().to_owned());
    }
    assert_eq!(days.len(), 1, "checks counted on {days:?}");
    // The day's window by the server's clock too: both processes tell the
    // same time until it resets, within a day, the fast one not 0.
    let (least, most) = (resets.iter().min().unwrap(), resets.iter().max().unwrap());
    assert!(
        most - least <= 10 && *most <= 86_400 && *least > 0,
        "the day resets in {resets:?} seconds"
    );
    // v: its 5, then w0..w2 until the global 8. Every call past its
    // visitor's limit is counted globally, allowed or not: 5 + 6.
    assert_eq!(allowed, 8);
    let day = days.into_iter().next().unwrap();
    for bin in bins {
        let u = json(
            client
                .get(bin.url("/budgets/b/usage?visitor=v"))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(
            (&u["day"], &u["global_calls"], &u["visitor_calls"]),
            (&json!(day), &json!(11), &json!(10)),
            "{u}"
        );
    }
    // The day either of them shows, the other can reset.
    let r = client
        .post(ahead.url("/budgets/b/reset"))
        .bearer_auth(ADMIN)
        .json(&json!({"day": day, "visitor": "w0"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);

    // A key stored through the normal process...
    let keyed = |bin: &Binary, name: &str, key: &str| {
        client
            .post(bin.url(&format!("/counters/{name}")))
            .header("idempotency-key", key)
            .send()
    };
    let first = json(keyed(&normal, "k", "key-1").await.unwrap()).await;
    assert_eq!(first["value"], 1);
    // ...outlives the clean-up the fast process runs after its first keyed
    // batch: by its own clock the key would be a day old.
    assert_eq!(
        keyed(&ahead, "other", "key-2").await.unwrap().status(),
        StatusCode::OK
    );
    let retry = keyed(&ahead, "k", "key-1").await.unwrap();
    assert!(retry.headers().contains_key("idempotent-replayed"));
    assert_eq!(json(retry).await["value"], 1);
    let v = json(client.get(normal.url("/counters/k")).send().await.unwrap()).await;
    assert_eq!(v["value"], 1);
}

/// An idempotency key another transaction has claimed and not committed
/// (a retry of the same request on a process whose batch hangs, or an
/// outside session) holds up only the write with that key: answered
/// row-busy after the lock timeout, while writes to the same counter
/// without it are applied as usual. Its retries, while it stays held, cost
/// their batches only the brief waits (the writer is wary of it), not the
/// lock timeout each. Once the claim is gone the keyed write runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_held_elsewhere_holds_up_only_its_own_write() {
    const LOCK_TIMEOUT: Duration = Duration::from_secs(3);
    let url = postgres::fresh_database().await;
    let bins = processes(1, &url, &[("TALLY_POSTGRES_LOCK_TIMEOUT", "3")]);
    let client = Client::new();
    let post = |key: Option<&str>| {
        let r = client.post(bins[0].url("/counters/c"));
        match key {
            Some(k) => r.header("idempotency-key", k),
            None => r,
        }
        .send()
    };
    assert_eq!(post(None).await.unwrap().status(), StatusCode::OK);
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "BEGIN; INSERT INTO idempotency_keys (key, fingerprint, result, created_at)
         VALUES ('held', 'increment c 1', '', 0)",
    )
    .execute(&mut holder)
    .await
    .unwrap();
    let started = Instant::now();
    let p = problem(
        post(Some("held")).await.unwrap(),
        StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    assert_eq!(p["type"], "/problems/row-busy", "{p}");
    assert!(started.elapsed() >= LOCK_TIMEOUT, "{:?}", started.elapsed());
    for _ in 0..3 {
        let r = post(None).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        let started = Instant::now();
        let p = problem(
            post(Some("held")).await.unwrap(),
            StatusCode::SERVICE_UNAVAILABLE,
        )
        .await;
        assert_eq!(p["type"], "/problems/row-busy", "{p}");
        // About 20 ms and 250 ms of brief waits, not the lock timeout.
        assert!(
            started.elapsed() < LOCK_TIMEOUT / 2,
            "{:?}",
            started.elapsed()
        );
    }
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .unwrap();
    let r = post(Some("held")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(!r.headers().contains_key("idempotent-replayed"));
    assert_eq!(json(r).await["value"], 5);
    stop_all(bins).await;
}

/// A row an outside session keeps locked (an operator's `SELECT ... FOR
/// UPDATE` left open) holds up only the writes to that row, each for the
/// lock timeout, answered 503 row-busy with Retry-After; writes to other
/// rows are answered 200 as usual, the log says what happened (not that a
/// connection was lost), and once the row is released it takes writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_locked_outside_tally_holds_up_only_its_own_writes() {
    const LOCK_TIMEOUT: Duration = Duration::from_secs(1);
    // The set-based try, then the wait for the row, then a little.
    const BOUND: Duration = Duration::from_millis(1000 + 250 + 750);
    let url = postgres::fresh_database().await;
    let bins = processes(1, &url, &[("TALLY_POSTGRES_LOCK_TIMEOUT", "1")]);
    let client = Client::new();
    let post = |name: String| {
        client
            .post(bins[0].url(&format!("/counters/{name}")))
            .send()
    };
    for n in 0..5 {
        assert_eq!(
            post(format!("c{n}")).await.unwrap().status(),
            StatusCode::OK
        );
    }
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT * FROM counters WHERE name = 'c0' FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();
    let held_since = Instant::now();

    let mut busy = 0;
    for i in 0..60 {
        let name = format!("c{}", i % 5);
        let started = Instant::now();
        let r = post(name.clone()).await.unwrap();
        let took = started.elapsed();
        if name == "c0" {
            assert_eq!(r.headers()["retry-after"], "1");
            let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
            assert_eq!(p["type"], "/problems/row-busy", "{p}");
            // The first waited for the row; the others know it is held
            // (a_write_beside_a_held_row_is_not_held_up_by_it).
            if busy == 0 {
                assert!(took >= LOCK_TIMEOUT, "{took:?}");
            }
            busy += 1;
        } else {
            assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        }
        assert!(took < BOUND, "write {i} to {name} took {took:?}");
    }
    assert_eq!(busy, 12);
    assert!(held_since.elapsed() < Duration::from_secs(25));
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();

    // Released: every row takes writes again, the held one once it is
    // tried again (at most a quarter of a second after its last try).
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in 0..5 {
        let r = post(format!("c{n}")).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    let v = json(
        client
            .get(bins[0].url("/counters/c0"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(v["value"], 2, "a busy write wrote nothing");
    let logs = bins[0].log_text();
    assert!(logs.contains("past the lock timeout"), "{logs}");
    assert!(
        !logs.contains("dropped its PostgreSQL connection"),
        "{logs}"
    );
    stop_all(bins).await;
}

/// Writes that share a batch with writes to rows held outside tally, on
/// two processes: a counter's row, and a budget's day (its global usage,
/// which every check of that budget needs). Once each process has found
/// them held, by waiting out the lock timeout, the writes beside them,
/// its own and the other process's, are not held up again, and the writes
/// to them are refused at once (row-busy; a check denied, meter_error);
/// released, they are forgotten without a write to them.
/// (Each batch holding a write to a held row waited the lock timeout, so a
/// client retrying that write held up every other write of the process,
/// and the other processes' writes to the rows it had locked meanwhile:
/// 1 % of writes to a held row cut the write rate from 18 k to 36 a
/// second.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_beside_a_held_row_is_not_held_up_by_it() {
    // Long, so that a write held up by it stands out from a slow machine.
    const LOCK_TIMEOUT: Duration = Duration::from_secs(8);
    const ROUNDS: i64 = 12;
    let url = postgres::fresh_database().await;
    // A slow writer, so that the writes sent together share a batch.
    let bins = processes(
        2,
        &url,
        &[
            ("TALLY_TEST_WRITER_DELAY_MS", "30"),
            ("TALLY_POSTGRES_LOCK_TIMEOUT", "8"),
        ],
    );
    let client = Client::new();
    let timed = |request: reqwest::RequestBuilder, what: String| async move {
        let started = Instant::now();
        let r = request.send().await.unwrap();
        (what, r, started.elapsed())
    };
    let post = |bin: &Binary, name: &str| {
        let request = client.post(bin.url(&format!("/counters/{name}")));
        timed(request, name.to_owned())
    };
    let visitors = std::sync::atomic::AtomicUsize::new(0);
    let check = |bin: &Binary| {
        let visitor = format!(
            "v{}",
            visitors.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let request = client
            .post(bin.url("/budgets/m/check"))
            .json(&json!({ "visitor": visitor }));
        timed(request, format!("check by {visitor}"))
    };
    put_budget(
        &client,
        &bins[0],
        "m",
        json!({"visitor_limit": 100, "global_limit": 1000}),
    )
    .await;
    assert_eq!(check(&bins[0]).await.1.status(), StatusCode::OK);
    let names = ["c0", "c1", "c2", "c3"];
    for name in names {
        assert_eq!(post(&bins[0], name).await.1.status(), StatusCode::OK);
    }
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "BEGIN; SELECT * FROM counters WHERE name = 'c0' FOR UPDATE;
         SELECT * FROM budget_global_usage WHERE budget = 'm' FOR UPDATE",
    )
    .execute(&mut holder)
    .await
    .unwrap();
    let refused = |what: &str, r: &reqwest::Response| {
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE, "{what}");
        assert_eq!(r.headers()["retry-after"], "1", "{what}");
    };
    // Each process finds the rows held by waiting out the lock timeout
    // once (or twice, should its first batch hold only some of these).
    for attempt in 0.. {
        let writes = bins
            .iter()
            .flat_map(|b| [post(b, "c0"), check(b), check(b)]);
        let answers = join_all(writes).await;
        let mut slow = 0;
        for (what, r, took) in answers {
            refused(&what, &r);
            slow += usize::from(took >= LOCK_TIMEOUT / 2);
        }
        if slow == 0 {
            break;
        }
        assert!(attempt < 4, "the held rows are still waited for");
    }
    for round in 0..ROUNDS {
        let writes = bins.iter().flat_map(|b| {
            let counters = names.map(|name| post(b, name));
            let checks = [check(b), check(b)];
            counters.into_iter().chain(checks)
        });
        for (what, r, took) in join_all(writes).await {
            if what == "c0" || what.starts_with("check") {
                refused(&what, &r);
                let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
                let kind = if what == "c0" {
                    "row_busy"
                } else {
                    "meter_error"
                };
                assert_eq!(p["reason"], kind, "{what}: {p}");
            } else {
                assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
            }
            assert!(
                took < LOCK_TIMEOUT / 2,
                "round {round}: {what} answered after {took:?}"
            );
        }
    }
    // Each process shows what it takes for held: the counter and the day
    // at least (a visitor whose check waited too, until it is forgotten).
    for bin in &bins {
        let held = metric(&client, bin, "tally_rows_held").await;
        assert!(held.is_some_and(|n| n >= 2.0), "{held:?}");
    }
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    // Released: the rows take writes again, once tried (each within a
    // quarter of a second of a write to it).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, r, _) = post(&bins[1], "c0").await;
        let (_, c, _) = check(&bins[1]).await;
        if r.status() == StatusCode::OK && c.status() == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "still refused after the release");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (name, want) in [("c1", 1 + 2 * ROUNDS), ("c3", 1 + 2 * ROUNDS)] {
        let r = client.get(bins[0].url(&format!("/counters/{name}"))).send();
        assert_eq!(json(r.await.unwrap()).await["value"], want, "{name}");
    }
    // The first process, written to no more, forgets the rows 10 s after
    // it last found them held, and shows it (the gauge went on showing
    // them until a write came).
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&client, &bins[0], "tally_rows_held").await != Some(0.0) {
        assert!(Instant::now() < deadline, "rows still shown held");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_all(bins).await;
}

/// An outside session holding many rows (a bulk `SELECT ... FOR UPDATE`)
/// while one batch needs them all: the first command waits the lock
/// timeout, the others on held rows are answered row-busy quickly, and a
/// command on a free row commits, all well within the batch's deadline.
/// (Waiting the whole lock timeout for each held row in turn ran the batch
/// past its deadline, and every caller heard outcome-unknown.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_holding_many_rows_costs_only_the_writes_to_them() {
    const HELD: usize = 12;
    let url = postgres::fresh_database().await;
    // The default lock timeout (2 s); a slow writer, so that the writes
    // below share a batch.
    let bins = processes(1, &url, &[("TALLY_TEST_WRITER_DELAY_MS", "300")]);
    let client = Client::new();
    let post = |name: String| {
        client
            .post(bins[0].url(&format!("/counters/{name}")))
            .send()
    };
    for r in join_all((0..HELD).map(|n| post(format!("h{n}")))).await {
        assert_eq!(r.unwrap().status(), StatusCode::OK);
    }
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT * FROM counters WHERE name LIKE 'h%' FOR UPDATE")
        .execute(&mut holder)
        .await
        .unwrap();

    let started = Instant::now();
    let writes = (0..HELD)
        .map(|n| format!("h{n}"))
        .chain(["free".to_owned()])
        .map(|name| {
            let request = post(name.clone());
            async move { (name, request.await.unwrap(), started.elapsed()) }
        });
    for (name, r, took) in join_all(writes).await {
        assert!(
            took < Duration::from_secs(8),
            "{name} answered after {took:?}"
        );
        if name == "free" {
            assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        } else {
            let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
            assert_eq!(p["type"], "/problems/row-busy", "{name}: {p}");
        }
    }
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    let reads = (0..HELD).map(|n| {
        let read = client.get(bins[0].url(&format!("/counters/h{n}"))).send();
        async move { (n, json(read.await.unwrap()).await) }
    });
    for (n, v) in join_all(reads).await {
        assert_eq!(v["value"], 1, "h{n}: a busy write wrote nothing");
    }
    stop_all(bins).await;
}

/// One visitor's usage row held by an outside session: that visitor's
/// check is denied (meter_error, nothing counted), and the checks of the
/// budget's other visitors in the same batch are counted as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_visitor_row_denies_only_that_visitor() {
    let url = postgres::fresh_database().await;
    let bins = processes(
        1,
        &url,
        &[
            ("TALLY_TEST_WRITER_DELAY_MS", "300"),
            ("TALLY_POSTGRES_LOCK_TIMEOUT", "1"),
        ],
    );
    let client = Client::new();
    put_budget(
        &client,
        &bins[0],
        "m",
        json!({"visitor_limit": 100, "global_limit": 1000}),
    )
    .await;
    let check = |visitor: String| {
        client
            .post(bins[0].url("/budgets/m/check"))
            .json(&json!({ "visitor": visitor }))
            .send()
    };
    assert_eq!(check("vh".into()).await.unwrap().status(), StatusCode::OK);
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "BEGIN; UPDATE budget_visitor_usage SET calls = calls WHERE budget = 'm' AND visitor = 'vh'",
    )
    .execute(&mut holder)
    .await
    .unwrap();

    // While the writer sleeps over a batch of its own, the held visitor
    // queues first, then six others: the next batch.
    let occupy = tokio::spawn(client.post(bins[0].url("/counters/occupy")).send());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let held = tokio::spawn(check("vh".into()));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let others = join_all((0..6).map(|n| check(format!("v{n}")))).await;
    assert_eq!(occupy.await.unwrap().unwrap().status(), StatusCode::OK);
    let p = problem(
        held.await.unwrap().unwrap(),
        StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    assert_eq!(p["reason"], "meter_error", "{p}");
    for r in others {
        let r = r.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
        assert_eq!(json(r).await["allowed"], true);
    }
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    let u = json(
        client
            .get(bins[0].url("/budgets/m/usage?visitor=vh"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (&u["visitor_calls"], &u["global_calls"]),
        (&json!(1), &json!(7)),
        "{u}"
    );
    stop_all(bins).await;
}

/// PostgreSQL restarted while every read connection is pooled: the reads
/// right after find theirs dead and are answered all the same, from new
/// connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_right_after_a_restart_find_new_connections() {
    let server = PgServer::start();
    let url = postgres::fresh_database_on(&server.url()).await;
    let bins = processes(1, &url, &[("TALLY_READERS", "4")]);
    let client = Client::new();
    put_budget(
        &client,
        &bins[0],
        "b",
        json!({"visitor_limit": 10, "global_limit": 10}),
    )
    .await;
    // Fill the read pool: enough reads at once that all four are opened.
    for _ in 0..20 {
        let reads = (0..32).map(|_| client.get(bins[0].url("/budgets/b/usage")).send());
        for r in join_all(reads).await {
            assert_eq!(r.unwrap().status(), StatusCode::OK);
        }
        if metric(&client, &bins[0], "tally_db_readers_open").await == Some(4.0) {
            break;
        }
    }
    assert_eq!(
        metric(&client, &bins[0], "tally_db_readers_open").await,
        Some(4.0)
    );

    server.stop_fast();
    server.start_again();
    postgres::wait_until_up(&url, Duration::from_secs(20)).await;
    for path in [
        "/budgets/b/usage",
        "/budgets/b",
        "/counters/x",
        "/budgets/b/usage?visitor=v",
    ] {
        let r = client.get(bins[0].url(path)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{path}: {:?}", r.text().await);
    }
    stop_all(bins).await;
}

/// A server that refuses a read its connection (the role's connection
/// limit is reached) is answered 503 at once, not after seconds of
/// retrying; reads work again once a slot is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_read_connection_is_answered_at_once() {
    let server = postgres::server_url();
    let role = unique("limited");
    let db = unique("tally_limited");
    run_sql(
        &server,
        format!("CREATE ROLE {role} LOGIN CONNECTION LIMIT 2"),
    )
    .await;
    run_sql(&server, format!("CREATE DATABASE {db} OWNER {role}")).await;
    let base = server
        .rsplit_once('/')
        .unwrap()
        .0
        .replacen("tally@", &format!("{role}@"), 1);
    let url = format!("{base}/{db}");
    let bins = processes(1, &url, &[]);
    let client = Client::new();
    // The writer's connection: one of the role's two.
    let r = client
        .post(bins[0].url("/counters/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // The other, taken from outside, once the server has let go of the
    // migrations' connection (closed at start without waiting for its
    // backend to exit).
    let deadline = Instant::now() + Duration::from_secs(5);
    let outside = loop {
        match PgConnection::connect(&url).await {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    let started = Instant::now();
    let r = client.get(bins[0].url("/counters/x")).send().await.unwrap();
    let took = started.elapsed();
    let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(p["type"], "/problems/database-unavailable", "{p}");
    // Refused at once, not retried until a 2 s acquire timeout, twice.
    assert!(
        took < Duration::from_millis(1500),
        "answered after {took:?}"
    );

    // The server counts a session until its backend has exited, a moment
    // after the client has closed it.
    let _ = outside.close().await;
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..100 {
        status = client
            .get(bins[0].url("/counters/x"))
            .send()
            .await
            .unwrap()
            .status();
        if status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, StatusCode::OK);
    stop_all(bins).await;
}

/// A process on `url` (migrating it, if fresh) writes counter `kept` once,
/// and stops.
async fn kept_once(client: &Client, url: &str) {
    let bins = processes(1, url, &[]);
    let r = client.post(bins[0].url("/counters/kept")).send().await;
    assert_eq!(r.unwrap().status(), StatusCode::OK);
    stop_all(bins).await;
}

/// The value of counter `name` as `bin` reads it.
async fn counter(client: &Client, bin: &Binary, name: &str) -> i64 {
    let r = client
        .get(bin.url(&format!("/counters/{name}")))
        .send()
        .await;
    json(r.unwrap()).await["value"].as_i64().unwrap()
}

/// A DBA creates a schema named like tally's role (what PostgreSQL's own
/// documentation recommends since 15), which the default `search_path`,
/// `"$user", public`, puts first: tally stays on its tables in `public`,
/// in the processes already running and in those started after, and
/// creates nothing in the new schema. Before, the next process to start
/// made empty tables there, and every process then read and wrote those:
/// every acknowledged count, budget and stored key gone from the API.
#[tokio::test]
async fn a_schema_named_like_the_role_moves_nothing() {
    let url = postgres::fresh_database().await;
    let client = Client::new();
    let first = processes(1, &url, &[]);
    for _ in 0..3 {
        let r = client.post(first[0].url("/counters/hits")).send().await;
        assert_eq!(r.unwrap().status(), StatusCode::OK);
    }
    put_budget(
        &client,
        &first[0],
        "api",
        json!({"visitor_limit": 5, "global_limit": 9}),
    )
    .await;

    run_sql(&url, "CREATE SCHEMA AUTHORIZATION CURRENT_USER".into()).await;
    let later = processes(1, &url, &[]);
    for bin in [&first[0], &later[0]] {
        assert_eq!(counter(&client, bin, "hits").await, 3, "{}", bin.log_text());
        let r = client.get(bin.url("/budgets/api")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    for bin in [&first[0], &later[0]] {
        let r = client.post(bin.url("/counters/hits")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    assert_eq!(counter(&client, &first[0], "hits").await, 5);
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let made: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_user",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(made, 0, "tally made tables in the new schema");
    let _ = conn.close().await;
    stop_all(first).await;
    stop_all(later).await;
}

/// The schemas of the role's `search_path` are where tally looks: another
/// deployment's tables in a schema of its own (named with
/// `TALLY_POSTGRES_SCHEMA`) do not stop it. Tally's tables in two schemas of the path
/// (as the bug above left them) are for the operator to choose between:
/// tally does not start, and says what to set; named with
/// `TALLY_POSTGRES_SCHEMA`, it serves that schema's data. A name that
/// would serve empty tables while the path holds tally's (a typo) is
/// refused, and so is one that does not exist.
#[tokio::test]
async fn only_the_roles_schemas_count_and_two_are_for_the_operator_to_choose() {
    let url = postgres::fresh_database().await;
    let client = Client::new();
    kept_once(&client, &url).await;
    let path_of = |schema: &str| format!("{url}?options=-c%20search_path%3D{schema}");

    // Another deployment, on a path of its own: refused while it does
    // not name its schema, since a path that no longer names the schema
    // of tally's tables looks the same (see the next test).
    run_sql(&url, "CREATE SCHEMA other".into()).await;
    let e = failed_start(&[("TALLY_DATABASE", &path_of("other"))]);
    assert!(
        e.contains("tally's tables are in schema public, which the role's search_path does not name (its first schema is other)"),
        "{e}"
    );
    let other = processes(1, &path_of("other"), &[("TALLY_POSTGRES_SCHEMA", "other")]);
    assert_eq!(counter(&client, &other[0], "kept").await, 0);
    let bins = processes(1, &url, &[]);
    assert_eq!(counter(&client, &bins[0], "kept").await, 1);
    // Served, and said: the other schema may hold this deployment's data
    // (a path changed since), which only the operator can tell.
    let log = bins[0].log_text();
    assert!(
        log.contains("tally's tables are also in schemas the role's search_path does not name")
            && log.contains("\"elsewhere\":\"other\""),
        "{log}"
    );
    stop_all(bins).await;
    stop_all(other).await;

    run_sql(&url, "CREATE SCHEMA empty_one".into()).await;
    let e = failed_start(&[
        ("TALLY_DATABASE", &url),
        ("TALLY_POSTGRES_SCHEMA", "empty_one"),
    ]);
    assert!(
        e.contains("holds none of tally's tables, while schema \"public\""),
        "{e}"
    );
    let e = failed_start(&[
        ("TALLY_DATABASE", &url),
        ("TALLY_POSTGRES_SCHEMA", "missing"),
    ]);
    assert!(
        e.contains("schema \"missing\", which does not exist"),
        "{e}"
    );

    // The copy the bug made: tables in a schema named like the role,
    // which the default path puts before public.
    run_sql(&url, "CREATE SCHEMA AUTHORIZATION CURRENT_USER".into()).await;
    let copy = processes(1, &path_of("tally"), &[("TALLY_POSTGRES_SCHEMA", "tally")]);
    assert_eq!(counter(&client, &copy[0], "kept").await, 0);
    stop_all(copy).await;
    let e = failed_start(&[("TALLY_DATABASE", &url)]);
    assert!(
        e.contains(
            "tally's tables are in several schemas of the role's search_path (tally, public)"
        ) && e.contains("TALLY_POSTGRES_SCHEMA"),
        "{e}"
    );
    let bins = processes(1, &url, &[("TALLY_POSTGRES_SCHEMA", "public")]);
    assert_eq!(counter(&client, &bins[0], "kept").await, 1);
    stop_all(bins).await;
}

/// A new login role (named from `prefix`) that may connect to the
/// database at `url` and use its schema `public` but create nothing in it,
/// given `grants` too (`{role}` in them names it); its name and a URL that
/// logs in as it. Roles outlive databases on the shared server: a test
/// drops it (`DROP OWNED BY`, `DROP ROLE`) when done.
async fn role_without_create(url: &str, prefix: &str, grants: &str) -> (String, String) {
    let role = unique(prefix);
    let db = database_name(url).to_owned();
    let grants = grants.replace("{role}", &role);
    run_sql(
        url,
        format!(
            "CREATE ROLE {role} LOGIN;
             REVOKE CREATE ON SCHEMA public FROM PUBLIC;
             GRANT CONNECT ON DATABASE {db} TO {role};
             GRANT USAGE ON SCHEMA public TO {role};
             {grants}"
        ),
    )
    .await;
    let app_url = url.replacen("://tally@", &format!("://{role}@"), 1);
    assert_ne!(app_url, url);
    (role, app_url)
}

/// The common split of roles: one that owns the schema migrates, one that
/// may only read and write the tables serves. With nothing left to migrate
/// tally starts no migration, which would need to create a table; before,
/// every start as the second role failed. And a database a newer tally
/// migrated (a rollback) is served, with a warning.
#[tokio::test]
async fn a_role_that_may_only_read_and_write_serves_a_migrated_database() {
    let url = postgres::fresh_database().await;
    let client = Client::new();
    kept_once(&client, &url).await;

    let (role, app_url) = role_without_create(
        &url,
        "tally_app",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role};
         INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99, 'a newer release', true, '\\x00', 1);",
    )
    .await;
    let app = processes(1, &app_url, &[]);
    let r = client
        .post(app[0].url("/counters/kept"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{}", app[0].log_text());
    assert_eq!(counter(&client, &app[0], "kept").await, 2);
    put_budget(
        &client,
        &app[0],
        "b",
        json!({"visitor_limit": 1, "global_limit": 1}),
    )
    .await;
    let r = client
        .post(app[0].url("/budgets/b/check"))
        .json(&json!({"visitor": "v"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let logs = app[0].log_text();
    assert!(
        logs.contains("migrations this tally does not know"),
        "{logs}"
    );
    stop_all(app).await;
    // Roles outlive databases on the shared server.
    run_sql(&url, format!("DROP OWNED BY {role}; DROP ROLE {role}")).await;
}

/// The same split through an upgrade that adds a table: the new table
/// belongs to the role that migrated, and the serving role has no rights
/// on it until they are granted. Such a role is refused at start, told
/// which rights it lacks on which tables and the `GRANT` that gives them;
/// before, it started, warned once that it could not read the clock's
/// hold, and served on without it (and a table it could not update
/// failed every request that needed it).
#[tokio::test]
async fn a_role_without_rights_on_a_table_of_tallys_is_refused_at_start() {
    let url = postgres::fresh_database().await;
    let client = Client::new();
    kept_once(&client, &url).await;
    let (role, app_url) = role_without_create(
        &url,
        "tally_srv",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role};
         REVOKE ALL ON clock_hold FROM {role};
         REVOKE UPDATE ON counters FROM {role};
         REVOKE SELECT ON _sqlx_migrations FROM {role};",
    )
    .await;
    // The record of migrations, read first, is told with its grant too.
    let e = failed_start(&[("TALLY_DATABASE", &app_url)]);
    let grant = format!("GRANT SELECT ON \"public\".\"_sqlx_migrations\" TO \"{role}\"");
    assert!(
        e.contains("cannot read the applied migrations") && e.contains(&grant),
        "{e}"
    );
    run_sql(&url, grant).await;
    let e = failed_start(&[("TALLY_DATABASE", &app_url)]);
    assert!(
        e.contains(&format!(
            "role \"{role}\" lacks UPDATE on `counters`; SELECT, INSERT, UPDATE, DELETE on \
             `clock_hold`"
        )),
        "{e}"
    );
    // Quoted, as psql reads any name (a keyword such as `user` too); the
    // statement printed is run as it is.
    let grant = format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON \"public\".\"counters\", \
         \"public\".\"clock_hold\" TO \"{role}\""
    );
    assert!(e.contains(&grant), "{e}");
    assert!(
        e.contains("ALTER DEFAULT PRIVILEGES IN SCHEMA \"public\""),
        "{e}"
    );
    run_sql(&url, grant).await;
    // Rights given column by column count as the table's.
    run_sql(
        &url,
        format!(
            "REVOKE ALL ON clock_hold FROM {role}; \
             GRANT SELECT (id, stepped_to_us, expected_us, until_us), \
             INSERT (id, stepped_to_us, expected_us, until_us), \
             UPDATE (stepped_to_us, expected_us, until_us), DELETE ON clock_hold TO {role}"
        ),
    )
    .await;
    let app = processes(1, &app_url, &[]);
    assert_eq!(counter(&client, &app[0], "kept").await, 1);
    stop_all(app).await;
    run_sql(&url, format!("DROP OWNED BY {role}; DROP ROLE {role}")).await;
}

/// A migration that fails says why as the server did: a role that may not
/// create tables is told so, with the SQLSTATE the server answered. A
/// database whose tables are there but whose record of the migrations is
/// not (`_sqlx_migrations` renamed) is told that, not that its role lacks
/// rights (every failed migration was), before any migration runs.
#[tokio::test]
async fn a_failed_migration_says_what_the_server_refused() {
    let url = postgres::fresh_database().await;
    let (role, app_url) = role_without_create(&url, "tally_new", "").await;
    let e = failed_start(&[("TALLY_DATABASE", &app_url)]);
    assert!(
        e.contains("migrations need a role that may create tables in schema `public`"),
        "{e}"
    );
    // The server's answer with its SQLSTATE, not sqlx's `at line N` (a
    // line of the server's C source, read as one of the migration's).
    assert!(e.contains("(SQLSTATE 42501)"), "{e}");
    assert!(!e.contains(" at line "), "{e}");
    run_sql(&url, format!("DROP OWNED BY {role}; DROP ROLE {role}")).await;

    let client = Client::new();
    kept_once(&client, &url).await;
    run_sql(
        &url,
        "ALTER TABLE _sqlx_migrations RENAME TO migrations_kept".into(),
    )
    .await;
    let e = failed_start(&[("TALLY_DATABASE", &url)]);
    assert!(
        e.contains("schema `public` holds tables named like tally's (counters, ")
            && e.contains("no record of tally's migrations")
            && e.contains("with that record dropped or renamed"),
        "{e}"
    );
    assert!(!e.contains("may create tables"), "{e}");
}

/// Another application's schema first in the role's `search_path`,
/// holding a table named like one of tally's: a first start is refused,
/// saying whose the table may be and what to set, and leaves nothing in
/// that schema (before, the migrations made their record table there, then
/// failed on the table, and the refusal blamed a dropped record of
/// tally's).
#[tokio::test]
async fn another_applications_table_named_like_talls_is_left_alone() {
    let url = postgres::fresh_database().await;
    run_sql(
        &url,
        "CREATE SCHEMA otherapp;
         CREATE TABLE otherapp.counters (name text PRIMARY KEY, value bigint NOT NULL);
         INSERT INTO otherapp.counters VALUES ('pageviews', 123456)"
            .into(),
    )
    .await;
    let path = format!("{url}?options=-c%20search_path%3Dotherapp,public");
    let e = failed_start(&[("TALLY_DATABASE", &path)]);
    assert!(
        e.contains("schema `otherapp` holds tables named like tally's (counters)")
            && e.contains("another application's tables")
            && e.contains("TALLY_POSTGRES_SCHEMA"),
        "{e}"
    );
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'otherapp' AND c.relkind = 'r' ORDER BY 1",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let _ = conn.close().await;
    assert_eq!(tables, ["counters"]);
}

/// A column's collation changed under a serving process (what a newer
/// tally's migration does, or an operator's `ALTER TABLE`): PostgreSQL
/// refuses the statements its connections prepared before (0A000, "cached
/// plan must not change result type"). The writer runs the batch again on
/// a new connection, the readers drop their pool: every request is
/// answered as before. Before, every increment and counter read answered
/// 500 until the process was restarted, while `/ready` said yes.
#[tokio::test]
async fn a_column_changed_under_a_serving_process_costs_no_request() {
    let url = postgres::fresh_database().await;
    let client = Client::new();
    let bins = processes(1, &url, &[]);
    put_budget(
        &client,
        &bins[0],
        "b",
        json!({"visitor_limit": 1000, "global_limit": 1000}),
    )
    .await;
    // A check first: a batch of checks that meets a statement's error goes
    // on command by command, each command failing on its own.
    let round = async |expected: i64| {
        let r = client
            .post(bins[0].url("/budgets/b/check"))
            .json(&json!({"visitor": "v"}))
            .send()
            .await
            .unwrap();
        assert_eq!(json(r).await["visitor_calls"], expected);
        let r = client
            .post(bins[0].url("/counters/c"))
            .header("idempotency-key", format!("k{expected}"))
            .send()
            .await
            .unwrap();
        assert_eq!(json(r).await["value"], expected);
        let r = client
            .post(bins[0].url("/counters/d"))
            .send()
            .await
            .unwrap();
        assert_eq!(json(r).await["value"], expected);
        assert_eq!(counter(&client, &bins[0], "c").await, expected);
        let r = client
            .get(bins[0].url("/budgets/b/usage?visitor=v"))
            .send()
            .await
            .unwrap();
        assert_eq!(json(r).await["visitor_calls"], expected);
    };
    // Every statement prepared, on the writer's connection and a reader's.
    round(1).await;
    round(2).await;
    run_sql(
        &url,
        "ALTER TABLE counters ALTER COLUMN name TYPE TEXT COLLATE \"POSIX\"; \
         ALTER TABLE budget_visitor_usage ALTER COLUMN visitor TYPE TEXT COLLATE \"POSIX\"; \
         ALTER TABLE idempotency_keys ALTER COLUMN key TYPE TEXT COLLATE \"POSIX\""
            .into(),
    )
    .await;
    for n in 3..6 {
        round(n).await;
    }
    let logs = bins[0].log_text();
    assert!(logs.contains("SQLSTATE 0A000"), "{logs}");
    let dropped = |logs: &str| {
        logs.matches("writer dropped its PostgreSQL connection")
            .count()
    };
    let before = dropped(&logs);

    // Any other 0A000 (a feature the server does not have, which
    // CockroachDB answers so) is the statement's own error: no new
    // connection for it, which reconnected on every batch.
    run_sql(
        &url,
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'not here' USING ERRCODE = 'feature_not_supported'; END $$; \
         CREATE TRIGGER refuse BEFORE UPDATE ON counters FOR EACH ROW EXECUTE FUNCTION refuse()"
            .into(),
    )
    .await;
    for _ in 0..10 {
        let r = client
            .post(bins[0].url("/counters/c"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(dropped(&bins[0].log_text()), before);
    run_sql(&url, "DROP TRIGGER refuse ON counters".into()).await;
    let r = client
        .post(bins[0].url("/counters/c"))
        .send()
        .await
        .unwrap();
    assert_eq!(json(r).await["value"], 6);
    stop_all(bins).await;
}

/// A database whose migrations are recorded but one of whose tables is
/// gone (dropped or renamed by hand) is refused at start, naming the
/// tables: before, tally started, said it was ready, and answered every
/// request that needed them 500. Put back, the data is served again.
#[tokio::test]
async fn a_database_missing_a_table_of_tallys_is_refused_at_start() {
    let url = postgres::fresh_database().await;
    let client = Client::new();
    kept_once(&client, &url).await;
    run_sql(
        &url,
        "ALTER TABLE counters RENAME TO counters_kept; \
         ALTER TABLE clock_hold RENAME TO clock_hold_kept"
            .into(),
    )
    .await;
    let e = failed_start(&[("TALLY_DATABASE", &url)]);
    assert!(
        e.contains("tally's tables `counters`, `clock_hold` are missing"),
        "{e}"
    );
    run_sql(&url, "ALTER TABLE counters_kept RENAME TO counters".into()).await;
    let e = failed_start(&[("TALLY_DATABASE", &url)]);
    assert!(e.contains("tally's table `clock_hold` is missing"), "{e}");
    run_sql(
        &url,
        "ALTER TABLE clock_hold_kept RENAME TO clock_hold".into(),
    )
    .await;
    let bins = processes(1, &url, &[]);
    assert_eq!(counter(&client, &bins[0], "kept").await, 1);
    stop_all(bins).await;
}

/// A schema named with `TALLY_POSTGRES_SCHEMA`, outside the role's
/// `search_path`, is where a fresh database gets tally's tables, the
/// migrations' included, and where its writes go.
#[tokio::test]
async fn a_named_schema_gets_the_tables_of_a_fresh_database() {
    let url = postgres::fresh_database().await;
    run_sql(&url, "CREATE SCHEMA mine".into()).await;
    let client = Client::new();
    let bins = processes(1, &url, &[("TALLY_POSTGRES_SCHEMA", "mine")]);
    let r = client
        .post(bins[0].url("/counters/here"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    stop_all(bins).await;
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let tables: Vec<(String, String)> = sqlx::query_as(
        "SELECT n.nspname::text, c.relname::text FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relname IN ('counters', '_sqlx_migrations') ORDER BY 1, 2",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let here: i64 = sqlx::query_scalar("SELECT value FROM mine.counters WHERE name = 'here'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
    assert_eq!(
        tables,
        [
            ("mine".to_owned(), "_sqlx_migrations".to_owned()),
            ("mine".to_owned(), "counters".to_owned())
        ]
    );
    assert_eq!(here, 1);

    // A process started without the setting the others have: before, it
    // made empty tables in `public`, the first schema of its path, and
    // served those (`here` read 0); now it is refused, naming `mine`.
    let e = failed_start(&[("TALLY_DATABASE", &url)]);
    assert!(
        e.contains("tally's tables are in schema mine, which the role's search_path does not name (its first schema is public)")
            && e.contains("Set TALLY_POSTGRES_SCHEMA to the schema that holds the data"),
        "{e}"
    );
}

/// The role's `search_path` changed since tally's tables were made (an
/// operator's `ALTER ROLE ... SET search_path`, here the URL's): the next
/// start is refused, naming the schema that holds them, instead of making
/// empty tables in the new path's first schema and serving those, beside
/// processes still serving the old ones (each admitting a budget's whole
/// limit, each reading half of the acknowledged counts). A path that
/// names no schema at all is told where the tables are too.
#[tokio::test]
async fn a_path_that_no_longer_names_tallys_schema_is_refused() {
    let url = postgres::fresh_database().await;
    let client = Client::new();
    kept_once(&client, &url).await;
    run_sql(&url, "CREATE SCHEMA otherapp".into()).await;
    let moved = format!("{url}?options=-c%20search_path%3Dotherapp");
    let e = failed_start(&[("TALLY_DATABASE", &moved)]);
    assert!(
        e.contains("tally's tables are in schema public, which the role's search_path does not name (its first schema is otherapp): tally would make empty tables in otherapp"),
        "{e}"
    );
    let none = format!("{url}?options=-c%20search_path%3Dnowhere");
    let e = failed_start(&[("TALLY_DATABASE", &none)]);
    assert!(
        e.contains("tally's tables are in schema public, which the role's search_path does not name (it names none that exists and may be used)"),
        "{e}"
    );
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let made: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'otherapp'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let _ = conn.close().await;
    assert_eq!(made, 0);
    let bins = processes(1, &moved, &[("TALLY_POSTGRES_SCHEMA", "public")]);
    assert_eq!(counter(&client, &bins[0], "kept").await, 1);
    stop_all(bins).await;
}

/// A budget whose prune cannot go on (a row of its old day held by an
/// operator's session) waits its turn alone: the next budget's shares go
/// on at once, not after a pause every budget shares, and the held one
/// finishes once the row is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prune_held_up_by_a_locked_row_holds_up_no_other_budget() {
    let url = postgres::fresh_database().await;
    let bins = processes(1, &url, &[("TALLY_POSTGRES_LOCK_TIMEOUT", "1")]);
    let bin = &bins[0];
    let client = Client::new();
    let spec = json!({"visitor_limit": 5, "global_limit": 1_000_000, "retention_days": 1, "timezone": "UTC"});
    for name in ["held", "free"] {
        put_budget(&client, bin, name, spec.clone()).await;
    }
    // A day long gone: 2.5 shares of visitors for `held`, 5 for `free`.
    run_sql(
        &url,
        "INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
           SELECT 'held', '2000-01-01', 'v' || i, 1 FROM generate_series(1, 25000) i
           UNION ALL
           SELECT 'free', '2000-01-01', 'v' || i, 1 FROM generate_series(1, 50000) i"
            .to_owned(),
    )
    .await;
    // The last of `held`'s rows in key order ('v9999' sorts after
    // 'v25000'), which its third share deletes.
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "BEGIN; SELECT * FROM budget_visitor_usage
           WHERE budget = 'held' AND visitor = 'v9999' FOR UPDATE",
    )
    .execute(&mut holder)
    .await
    .unwrap();
    // A PUT that changes nothing prunes a share and leaves the rest due:
    // `held` first in line.
    put_budget(&client, bin, "held", spec.clone()).await;
    bin.logs_within("could not prune a budget's usage", Duration::from_secs(20))
        .await;
    // From the failure (give or take the log's polling): `held` is tried
    // again 10 s after it, and `free` must not wait for that.
    let put = Instant::now();
    put_budget(&client, bin, "free", spec.clone()).await;
    let old_rows = async |budget: &str| -> i64 {
        let mut conn = PgConnection::connect(&url).await.unwrap();
        sqlx::query_scalar(
            "SELECT count(*) FROM budget_visitor_usage WHERE budget = $1 AND day = '2000-01-01'",
        )
        .bind(budget)
        .fetch_one(&mut conn)
        .await
        .unwrap()
    };
    // Four shares of 10,000 rows (on a quiet host, within 2 s): under the
    // 10 s a failed share used to hold every budget's.
    while old_rows("free").await > 0 {
        assert!(
            put.elapsed() < Duration::from_secs(8),
            "free's prune waited on held's: {} rows left after {:?}",
            old_rows("free").await,
            put.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(old_rows("held").await > 0);
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    // Released: `held` goes on at its next turn (10 s after its failure).
    let deadline = Instant::now() + Duration::from_secs(30);
    while old_rows("held").await > 0
        || metric(&client, bin, "tally_budget_prunes_due").await != Some(0.0)
    {
        assert!(Instant::now() < deadline, "{}", bin.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every row, whether the PUTs or the writer's shares took it.
    assert_eq!(
        metric(&client, bin, "tally_budget_pruned_rows_total").await,
        Some(75_000.0)
    );
    stop_all(bins).await;
}

/// A `PUT` that waits for its budget's row past midnight (an operator's
/// session holding it) reckons the days by the server's clock as it reads
/// once it has the row, not as it read when its transaction began: the
/// day a longer retention brings back, which a prune on the new day had
/// begun on, reads empty rather than part pruned (a past day a check may
/// still name, whose global row that prune had taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_put_that_waits_past_midnight_reckons_from_after_its_wait() {
    // The server's midnight this long after it starts: time to set up.
    const AHEAD: i64 = 40;
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let offset = format!("{:+}s", 86_400 - real % 86_400 - AHEAD);
    let library = faketime_library();
    let server = PgServer::start_with(&[
        ("LD_PRELOAD", library.to_str().unwrap()),
        ("FAKETIME", &offset),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ]);
    let url = postgres::fresh_database_on(&server.url()).await;
    let bins = processes(1, &url, &[("TALLY_POSTGRES_LOCK_TIMEOUT", "9")]);
    let bin = &bins[0];
    let client = Client::new();
    let mut outside = PgConnection::connect(&url).await.unwrap();
    let server_clock = async |c: &mut PgConnection| -> i64 {
        sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::int8")
            .fetch_one(c)
            .await
            .unwrap()
    };
    let started = server_clock(&mut outside).await;
    let midnight = started - started % 86_400 + 86_400;
    let yesterday = jiff::Timestamp::from_second(started - 86_400)
        .unwrap()
        .in_tz("UTC")
        .unwrap()
        .date()
        .to_string();
    let spec = |days: u32| json!({"visitor_limit": 5, "global_limit": 1_000_000, "retention_days": days, "timezone": "UTC"});
    put_budget(&client, bin, "b", spec(1)).await;
    run_sql(
        &url,
        format!(
            "INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
               SELECT 'b', '{yesterday}', 'v' || i, 1 FROM generate_series(1, 25000) i;
             INSERT INTO budget_global_usage (budget, day, calls) VALUES ('b', '{yesterday}', 25000)"
        ),
    )
    .await;
    sqlx::raw_sql("BEGIN; SELECT * FROM budgets WHERE name = 'b' FOR UPDATE")
        .execute(&mut outside)
        .await
        .unwrap();
    let before = midnight - server_clock(&mut outside).await;
    assert!(before > 4, "set up too slowly: {before} s before midnight");
    while server_clock(&mut outside).await < midnight - 3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A longer retention, whose transaction begins before midnight and
    // waits for the row.
    let put = client
        .put(bin.url("/budgets/b"))
        .bearer_auth(ADMIN)
        .json(&spec(2))
        .send();
    let put = tokio::spawn(put);
    while server_clock(&mut outside).await < midnight + 1 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A prune of the new day on another process, as it goes (four minutes
    // past midnight; here by hand, sooner): yesterday is past a one-day
    // retention now; its global row and a share of its visitors go. Then
    // the row is let go.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DELETE FROM budget_global_usage WHERE budget = 'b' AND day = '{yesterday}';
         DELETE FROM budget_visitor_usage WHERE budget = 'b' AND day = '{yesterday}'
           AND visitor <= (SELECT visitor FROM budget_visitor_usage
                           WHERE budget = 'b' AND day = '{yesterday}'
                           ORDER BY visitor OFFSET 9999 LIMIT 1);
         COMMIT"
    )))
    .execute(&mut outside)
    .await
    .unwrap();
    let r = put.await.unwrap().unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
    // Two days kept now, yesterday among them: as if never counted.
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM budget_visitor_usage WHERE budget = 'b' AND day = $1",
    )
    .bind(&yesterday)
    .fetch_one(&mut outside)
    .await
    .unwrap();
    assert_eq!(left, 0, "yesterday part pruned, and kept");
    let usage = json(
        client
            .get(bin.url(&format!("/budgets/b/usage?day={yesterday}&visitor=v9999")))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (&usage["visitor_calls"], &usage["global_calls"]),
        (&json!(0), &json!(0)),
        "{usage}"
    );
    stop_all(bins).await;
}

/// A whole table held (an operator's `LOCK TABLE`, `VACUUM FULL`, a
/// migration), which PostgreSQL tells as it tells a held row: the shares
/// of many budgets due fail one after another, and after two every share
/// waits (10 s), so that writes which never touch the table go on at
/// their pace rather than each waiting out a share's lock timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_table_holds_up_no_write_for_the_shares_it_fails() {
    let url = postgres::fresh_database().await;
    // The schema made by a process that then stops; the usage below is
    // written after it stopped, so that it never looks at it (had it run
    // while the rows were written, it could purge some before the lock).
    stop_all(processes(1, &url, &[])).await;
    let client = Client::new();
    // Usage of 40 budgets that no longer exist, left by a process that
    // stopped: the next process to start purges it.
    run_sql(
        &url,
        "INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
           SELECT 'gone' || b, '2026-01-01', 'v' || v, 1
           FROM generate_series(1, 40) b, generate_series(1, 3) v"
            .to_owned(),
    )
    .await;
    let mut holder = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE budget_visitor_usage IN SHARE MODE")
        .execute(&mut holder)
        .await
        .unwrap();
    let bins = processes(1, &url, &[]);
    let bin = &bins[0];
    let found = Instant::now() + Duration::from_secs(20);
    loop {
        let due = metric(&client, bin, "tally_budget_prunes_due").await;
        if due == Some(40.0) {
            break;
        }
        assert!(
            Instant::now() < found,
            "{due:?} budgets due, not 40\n{}",
            bin.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each write a batch, each batch followed by a share: at most two
    // shares wait out their lock timeout (250 ms) before all wait, rather
    // than one after each write (60 of them: 15 s).
    let failed = || {
        bin.log_text()
            .matches("could not prune a budget's usage")
            .count()
    };
    let failed_before = failed();
    let started = Instant::now();
    for _ in 0..60 {
        let r = client.post(bin.url("/counters/c")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    let took = started.elapsed();
    let shares_failed = failed() - failed_before;
    assert!(
        shares_failed <= 2 && took < Duration::from_secs(8),
        "{shares_failed} shares failed during 60 writes, which took {took:?}"
    );
    sqlx::raw_sql("COMMIT").execute(&mut holder).await.unwrap();
    // Released: every budget's usage goes at the next turn.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&client, bin, "tally_budget_prunes_due").await != Some(0.0) {
        assert!(Instant::now() < deadline, "{}", bin.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM budget_visitor_usage")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    assert_eq!(left, 0);
    stop_all(bins).await;
}

/// The server's clock stepped ahead while one process runs, and a new
/// replica started during the hold: the new one took the stepped clock
/// for the real one, and the first call of the stepped day it took pruned
/// every day before the budget's retention for all (the real today among
/// them: once the clock was set right, a visitor at its limit was allowed
/// again). The process that saw the step keeps its hold in the database;
/// the new one takes it over, prunes nothing and, the clock set right,
/// is back in step.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_started_during_a_hold_holds_too() {
    replica_started_during_a_hold(false).await;
}

/// As [`a_replica_started_during_a_hold_holds_too`], with the hold's table
/// locked by an operator's session as the new replica starts: its read of
/// the hold failed, and it took the stepped clock for the real one for as
/// long as it ran. It reads the hold again before its batches, and takes
/// it over once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_that_could_not_read_the_hold_at_its_start_reads_it_later() {
    replica_started_during_a_hold(true).await;
}

/// Settings of a SQLite database alone, given with PostgreSQL, are refused
/// at start rather than silently ignored.
#[tokio::test]
async fn settings_of_sqlite_alone_are_refused_on_postgres() {
    let url = postgres::fresh_database().await;
    for (setting, value) in [
        ("TALLY_STORAGE_LIMIT", "1Gi"),
        ("TALLY_SYNCHRONOUS", "normal"),
    ] {
        let e = failed_start(&[("TALLY_DATABASE", &url), (setting, value)]);
        assert!(
            e.contains(setting) && e.contains("SQLite database only"),
            "{e}"
        );
    }
    // `full`, the default, said by name: nothing to refuse.
    stop_all(processes(1, &url, &[("TALLY_SYNCHRONOUS", "full")])).await;
}

/// A lock left on `clock_hold` (an operator's `LOCK TABLE`) while a
/// process starts: the process reads the kept hold again every second until
/// it can, and each read waits for the lock only briefly. Waiting the whole
/// lock timeout, it held up every write behind it, about one in two
/// seconds. (Here, on a server whose clock is not faked: under libfaketime
/// the server's lock timeouts did not fire.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_left_on_the_clock_hold_table_holds_up_no_write() {
    let url = postgres::fresh_database().await;
    stop_all(processes(1, &url, &[])).await;
    let mut admin = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE clock_hold IN ACCESS EXCLUSIVE MODE")
        .execute(&mut admin)
        .await
        .unwrap();
    // The lock timeout as long as it may be.
    let bins = processes(1, &url, &[("TALLY_POSTGRES_LOCK_TIMEOUT", "9")]);
    let client = Client::new();
    bins[0]
        .logs_within(
            "could not read the clock's hold the database keeps",
            Duration::from_secs(20),
        )
        .await;
    let writing = Instant::now();
    let (mut slowest, mut writes) = (Duration::ZERO, 0);
    while writing.elapsed() < Duration::from_secs(4) {
        let sent = Instant::now();
        let r = client
            .post(bins[0].url("/counters/x"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        slowest = slowest.max(sent.elapsed());
        writes += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        slowest < Duration::from_secs(3),
        "a write waited {slowest:?} behind a read of the locked hold: {}",
        bins[0].log_text()
    );
    sqlx::raw_sql("COMMIT").execute(&mut admin).await.unwrap();
    bins[0]
        .logs_within("the database keeps, late", Duration::from_secs(20))
        .await;
    let r = client.get(bins[0].url("/counters/x")).send().await.unwrap();
    assert_eq!(json(r).await["value"], writes);
    stop_all(bins).await;
}

/// A PostgreSQL server whose clock libfaketime reads from `clock` (see
/// [`set_clock`]).
fn faketime_server(clock: &std::path::Path) -> PgServer {
    let library = faketime_library();
    PgServer::start_with(&[
        ("LD_PRELOAD", library.to_str().unwrap()),
        ("FAKETIME_TIMESTAMP_FILE", clock.to_str().unwrap()),
        ("FAKETIME_NO_CACHE", "1"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ])
}

async fn replica_started_during_a_hold(locked_at_start: bool) {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    set_clock(&clock, "+0");
    let server = faketime_server(&clock);
    let url = postgres::fresh_database_on(&server.url()).await;
    let mut bins = processes(1, &url, &[]);
    let client = Client::new();
    let spec = json!({"visitor_limit": 2, "global_limit": 1000, "retention_days": 1});
    put_budget(&client, &bins[0], "b", spec.clone()).await;
    put_budget(&client, &bins[0], "other", spec).await;
    let check = async |bin: &Binary, budget: &str, visitor: &str| {
        let r = client
            .post(bin.url(&format!("/budgets/{budget}/check")))
            .json(&json!({"visitor": visitor}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        json(r).await
    };
    for _ in 0..2 {
        assert_eq!(check(&bins[0], "b", "v").await["allowed"], true);
    }
    let today = check(&bins[0], "b", "v").await;
    assert_eq!(today["allowed"], false, "{today}");

    // Seen by the first process, on another budget: `b` has no call on the
    // stepped day yet. Its hold is kept once that batch is answered.
    set_clock(&clock, "+10d");
    check(&bins[0], "other", "w").await;
    let steps = async |bin: &Binary, direction: &str| {
        let series = format!("tally_clock_steps_total{{direction=\"{direction}\"}}");
        metric(&client, bin, &series).await
    };
    assert_eq!(steps(&bins[0], "forward").await, Some(1.0));
    let mut outside = PgConnection::connect(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM clock_hold")
            .fetch_one(&mut outside)
            .await
            .unwrap();
        if kept == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "{}", bins[0].log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    if locked_at_start {
        let mut admin = PgConnection::connect(&url).await.unwrap();
        sqlx::raw_sql("BEGIN; LOCK TABLE clock_hold IN ACCESS EXCLUSIVE MODE")
            .execute(&mut admin)
            .await
            .unwrap();
        bins.extend(processes(
            1,
            &url,
            &[("TALLY_POSTGRES_LOCK_TIMEOUT", "0.5")],
        ));
        bins[1]
            .logs_within(
                "could not read the clock's hold the database keeps",
                Duration::from_secs(20),
            )
            .await;
        sqlx::raw_sql("COMMIT").execute(&mut admin).await.unwrap();
        // Read at the next idle check, or before the next batch.
        bins[1]
            .logs_within("the database keeps, late", Duration::from_secs(20))
            .await;
    } else {
        bins.extend(processes(1, &url, &[]));
    }
    let stepped = check(&bins[1], "b", "w").await;
    assert_ne!(stepped["day"], today["day"], "{stepped}");
    assert_eq!(steps(&bins[1], "forward").await, Some(1.0));
    set_clock(&clock, "+0");
    for bin in &bins {
        let after = check(bin, "b", "v").await;
        assert_eq!(after["day"], today["day"]);
        assert_eq!(
            after["allowed"], false,
            "the replica started during the hold pruned today's calls: {after}"
        );
        assert_eq!(steps(bin, "backward").await, Some(0.0));
        assert_eq!(
            metric(&client, bin, "tally_budget_prunes_total").await,
            Some(0.0)
        );
    }
    let logs = bins[1].log_text();
    assert!(
        logs.contains("the wall clock stepped before this process started"),
        "{logs}"
    );
    assert!(logs.contains("the wall clock is back in step"), "{logs}");
    stop_all(bins).await;
}

/// A batch whose transaction began before midnight and waited for a row
/// past it, while the day that left the window was pruned (by a prune
/// more than four minutes past midnight, a batch waiting that long; here
/// by hand, at the moment another process's first call of the new day
/// goes): the batch, judging its days by when it began, counted on that
/// day, brought it back empty, and allowed a visitor at its limit there
/// again. It judges them again once the days are held, and runs again:
/// the day has left the window (422).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_waited_past_midnight_brings_back_no_pruned_day() {
    // Each run holds whatever happens; the race must have been run in one
    // of them (on a host slow enough, the batch is split before it).
    for _ in 0..3 {
        if batch_waits_past_midnight().await {
            return;
        }
    }
    panic!("in three runs the batch never waited past midnight: the race was not run");
}

/// One run of [`a_batch_that_waited_past_midnight_brings_back_no_pruned_day`];
/// whether the batch ran again for a day that changed while it waited.
async fn batch_waits_past_midnight() -> bool {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    // Frozen, moved by hand.
    set_clock(&clock, "2026-05-01 23:59:58");
    let server = faketime_server(&clock);
    let url = postgres::fresh_database_on(&server.url()).await;
    let bins = processes(2, &url, &[("TALLY_POSTGRES_LOCK_TIMEOUT", "8")]);
    let client = Client::new();
    let spec = json!({"visitor_limit": 2, "global_limit": 1000, "retention_days": 1});
    put_budget(&client, &bins[0], "b", spec).await;
    let check = async |bin: &Binary, body: serde_json::Value| {
        client
            .post(bin.url("/budgets/b/check"))
            .json(&body)
            .send()
            .await
            .unwrap()
    };
    // The visitor at its limit on 04-30, the oldest day kept on 05-01.
    let on_oldest = json!({"visitor": "w", "day": "2026-04-30"});
    for allowed in [true, true, false] {
        let r = check(&bins[0], on_oldest.clone()).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(json(r).await["allowed"], allowed);
    }
    for name in ["plug", "hot"] {
        let r = client
            .post(bins[0].url(&format!("/counters/{name}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    // The first process's writer held on `plug`, so that the increment
    // of `hot` and the check queue behind it and go in one batch; that
    // batch then waits on `hot` past midnight.
    let mut plug = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT * FROM counters WHERE name = 'plug' FOR UPDATE")
        .execute(&mut plug)
        .await
        .unwrap();
    let mut hot = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT * FROM counters WHERE name = 'hot' FOR UPDATE")
        .execute(&mut hot)
        .await
        .unwrap();
    // The server's clock is frozen, and its lock waits are timed by it:
    // nothing here gives up while the test waits for each step.
    let mut watch = PgConnection::connect(&url).await.unwrap();
    let plugged = tokio::spawn(client.post(bins[0].url("/counters/plug")).send());
    a_writer_waits_for_a_lock(&mut watch).await;
    let hot_write = tokio::spawn(client.post(bins[0].url("/counters/hot")).send());
    wait_for_queue_depth(&client, &bins[0].url(""), 1).await;
    let late = tokio::spawn(
        client
            .post(bins[0].url("/budgets/b/check"))
            .json(&on_oldest)
            .send(),
    );
    wait_for_queue_depth(&client, &bins[0].url(""), 2).await;
    sqlx::raw_sql("COMMIT").execute(&mut plug).await.unwrap();
    let plugged = plugged.await.unwrap().unwrap();
    assert_eq!(plugged.status(), StatusCode::OK);
    // The batch of `hot` and the check begins, at 23:59:58, and waits on
    // `hot` (for 250 ms of the server's clock before it is split and run
    // again, in new transactions: the clock moves 3 s below).
    a_writer_waits_for_a_lock(&mut watch).await;
    // Less than the lock timeout later: the server times its lock waits by
    // this clock.
    set_clock(&clock, "2026-05-02 00:00:01");
    // The new day's first call, on the other process (within four minutes
    // of midnight, its prune keeps 04-30), and 04-30 pruned.
    let r = check(&bins[1], json!({"visitor": "x"})).await;
    let pruned = "DELETE FROM budget_visitor_usage WHERE day < '2026-05-01';
                  DELETE FROM budget_global_usage WHERE day < '2026-05-01'";
    sqlx::raw_sql(pruned).execute(&mut watch).await.unwrap();
    sqlx::raw_sql("COMMIT").execute(&mut hot).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let first = json(r).await;
    assert_eq!(first["day"], "2026-05-02", "{first}");
    assert_eq!(hot_write.await.unwrap().unwrap().status(), StatusCode::OK);
    let r = late.await.unwrap().unwrap();
    let status = r.status();
    let answer = json(r).await;
    assert_eq!(
        status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "the check counted on a day pruned under it: {answer}"
    );
    assert_eq!(answer["allowed"], false);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM budget_visitor_usage WHERE day < '2026-05-01'")
            .fetch_one(&mut hot)
            .await
            .unwrap();
    assert_eq!(left, 0, "a pruned day was brought back");
    // Run again in a new transaction: the race was run (split first, the
    // check would have met the new day without it).
    let raced = metric(&client, &bins[0], "tally_write_retries_total").await;
    stop_all(bins).await;
    raced.is_some_and(|n| n >= 1.0)
}

/// A database whose `synchronous_commit` is `off` (an operator's, or a
/// managed service's, setting tally inherits) answers `200` before the
/// commit is on the server's disk: tally says so at start, and only then.
#[tokio::test]
async fn a_start_warns_of_commits_that_are_not_durable() {
    let url = postgres::fresh_database().await;
    let bins = processes(1, &url, &[]);
    assert!(
        !bins[0].log_text().contains("synchronous_commit is off"),
        "{}",
        bins[0].log_text()
    );
    stop_all(bins).await;
    run_sql(
        &url,
        format!(
            "ALTER DATABASE {} SET synchronous_commit = off",
            database_name(&url)
        ),
    )
    .await;
    let bins = processes(1, &url, &[]);
    let log = bins[0].log_text();
    assert!(
        log.contains("PostgreSQL's synchronous_commit is off for tally's role or database"),
        "{log}"
    );
    stop_all(bins).await;
}

/// `TALLY_POSTGRES_SCHEMA` naming a schema the role may not use is refused
/// saying so, with the grant; before, the migrations failed with "no
/// schema has been selected to create in".
#[tokio::test]
async fn a_named_schema_the_role_may_not_use_is_told_with_its_grant() {
    let url = postgres::fresh_database().await;
    run_sql(&url, "CREATE SCHEMA locked".into()).await;
    let (role, app_url) = role_without_create(&url, "tally_nouse", "").await;
    let e = failed_start(&[
        ("TALLY_DATABASE", &app_url),
        ("TALLY_POSTGRES_SCHEMA", "locked"),
    ]);
    assert!(
        e.contains(&format!(
            "TALLY_POSTGRES_SCHEMA names schema \"locked\", which role \"{role}\" may not use: \
             grant it (GRANT USAGE ON SCHEMA \"locked\" TO \"{role}\")"
        )),
        "{e}"
    );
    run_sql(&url, format!("DROP OWNED BY {role}; DROP ROLE {role}")).await;
}
