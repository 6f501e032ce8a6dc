//! The writer's batches: set-based execution must answer exactly as running
//! the commands one at a time would, and one failing command must not take
//! the rest of its batch down.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::{ConnectOptions, SqliteConnection, sqlite::SqliteConnectOptions};
use tally::meter::{self, CheckItem, Day, Name, VisitorId};

use crate::helpers::{problem, spawn_with, wait_for_queue_depth};

async fn fresh_db(dir: &std::path::Path, name: &str) -> SqliteConnection {
    let mut conn = SqliteConnectOptions::new()
        .filename(dir.join(name))
        .create_if_missing(true)
        .connect()
        .await
        .unwrap();
    sqlx::migrate!("./migrations").run(&mut conn).await.unwrap();
    conn
}

/// A database whose counter `big` is 807 below the largest 64-bit integer.
async fn near_overflow(dir: &std::path::Path) -> SqliteConnection {
    let mut conn = fresh_db(dir, "o.db").await;
    sqlx::query("INSERT INTO counters (name, value) VALUES ('big', 9223372036854775000)")
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

async fn dump(conn: &mut SqliteConnection) -> Vec<(String, String, String, i64)> {
    let mut rows: Vec<(String, String, String, i64)> = sqlx::query_as(
        "SELECT budget, day, visitor, calls FROM budget_visitor_usage
         UNION ALL SELECT budget, day, '*global*', calls FROM budget_global_usage
         UNION ALL SELECT name, '', '*counter*', value FROM counters
         ORDER BY 1, 2, 3",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    rows.sort();
    rows
}

/// Random batches of checks and increments, applied set-based to one
/// database (falling back to one by one when asked, as the writer does) and
/// one at a time to another: every answer and the final rows must agree.
#[tokio::test]
async fn set_based_batches_answer_as_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut batched = fresh_db(dir.path(), "batched.db").await;
    let mut single = fresh_db(dir.path(), "single.db").await;
    let budgets: Vec<Name> = ["b0", "b1", "b2"]
        .iter()
        .map(|n| Name::parse(n).unwrap())
        .collect();
    for (i, b) in budgets.iter().enumerate() {
        let spec = meter::BudgetSpec::new(2 + i as u32, 5 + 3 * i as u32, Some(3), None).unwrap();
        for conn in [&mut batched, &mut single] {
            meter::put_budget(conn, b, &spec).await.unwrap();
        }
    }
    let unknown = Name::parse("nope").unwrap();
    let visitors: Vec<VisitorId> = ["A", "B", "C", "*"]
        .iter()
        .map(|v| VisitorId::parse(v).unwrap())
        .collect();
    let days: Vec<Day> = [
        "2000-03-01",
        "2000-03-02",
        "2000-03-05",
        "2000-03-09",
        "2000-03-10",
    ]
    .iter()
    .map(|d| Day::parse(d).unwrap())
    .collect();
    let counters: Vec<Name> = ["c0", "c1", "c2"]
        .iter()
        .map(|n| Name::parse(n).unwrap())
        .collect();

    let mut rng = fastrand::Rng::with_seed(7);
    let mut replays = 0;
    for _round in 0..150 {
        let n = rng.usize(1..40);
        let mut incs: Vec<(&Name, i64)> = Vec::new();
        let mut checks: Vec<CheckItem> = Vec::new();
        for _ in 0..n {
            if rng.bool() {
                incs.push((&counters[rng.usize(..counters.len())], rng.i64(1..=1000)));
            } else {
                let budget = if rng.u8(..20) == 0 {
                    &unknown
                } else {
                    &budgets[rng.usize(..budgets.len())]
                };
                checks.push(CheckItem {
                    budget,
                    visitor: &visitors[rng.usize(..visitors.len())],
                    day: Some(days[rng.usize(..days.len())]),
                });
            }
        }
        // One by one.
        let mut want_values = Vec::new();
        for (name, by) in &incs {
            want_values.push(meter::increment(&mut single, name, *by).await.unwrap());
        }
        let mut want_decisions = Vec::new();
        for c in &checks {
            want_decisions.push(
                meter::check(&mut single, c.budget, c.visitor, c.day)
                    .await
                    .map_err(|e| e.to_string()),
            );
        }
        // Set-based, inside a transaction like the writer's.
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut batched)
            .await
            .unwrap();
        let values = meter::increment_many(&mut batched, &incs)
            .await
            .unwrap()
            .unwrap();
        let decisions = match meter::check_many(&mut batched, &checks).await.unwrap() {
            Some(d) => d
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()))
                .collect(),
            None => {
                replays += 1;
                let mut d = Vec::new();
                for c in &checks {
                    d.push(
                        meter::check(&mut batched, c.budget, c.visitor, c.day)
                            .await
                            .map_err(|e| e.to_string()),
                    );
                }
                d
            }
        };
        sqlx::raw_sql("COMMIT").execute(&mut batched).await.unwrap();
        assert_eq!(values, want_values);
        let strip = |d: Vec<Result<meter::Decision, String>>| {
            d.into_iter()
                .map(|r| {
                    r.map(|mut d| {
                        // Which command of a batch reports the prune may differ.
                        d.pruned_rows = 0;
                        d
                    })
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(decisions), strip(want_decisions));
        assert_eq!(dump(&mut batched).await, dump(&mut single).await);
    }
    // The comparison covered the replay path too, and not only it.
    assert!(replays > 0 && replays < 150, "replays: {replays}");
}

#[tokio::test]
async fn increment_overflow_in_a_batch_is_replayed_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut conn = near_overflow(dir.path()).await;
    let (big, small) = (Name::parse("big").unwrap(), Name::parse("small").unwrap());
    // Each alone fits; together they overflow: only one by one tells who.
    let r = meter::increment_many(&mut conn, &[(&small, 1), (&big, 500), (&big, 500)])
        .await
        .unwrap();
    assert_eq!(r, None);
}

/// One batch holding a refused check, an overflowing increment (which sends
/// the batch down the one-by-one path), an admin write and good commands:
/// every caller gets its own correct answer and the good ones commit.
#[tokio::test]
async fn one_failing_command_does_not_fail_its_batch() {
    let app = spawn_with(|s| s.test_writer_delay_ms = Some(400)).await;
    app.budget("gc", 1, 10).await;
    app.sql_behind("INSERT INTO counters (name, value) VALUES ('big', 9223372036854775000)")
        .await;
    // Occupy the writer, so that the commands below queue up behind it.
    let warm = tokio::spawn({
        let (c, u) = (app.client.clone(), app.url("/counters/warm"));
        async move { c.post(u).send().await.unwrap().status() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;

    // A check may name only a day its budget keeps: today in UTC, its zone.
    let today = jiff::Timestamp::now()
        .in_tz("UTC")
        .unwrap()
        .date()
        .to_string();
    type Req = (reqwest::Method, &'static str, Option<Value>, bool);
    let plan: Vec<Req> = vec![
        (
            reqwest::Method::POST,
            "/counters/a",
            Some(json!({"by": 1})),
            false,
        ),
        (
            reqwest::Method::POST,
            "/budgets/ghost/check",
            // No day: a check naming one reads its budget before queueing,
            // and an unknown one is answered without reaching the writer.
            Some(json!({"visitor": "A"})),
            false,
        ),
        (
            reqwest::Method::POST,
            "/counters/a",
            Some(json!({"by": 2})),
            false,
        ),
        (
            reqwest::Method::POST,
            "/counters/big",
            Some(json!({"by": 1000})),
            false,
        ),
        (
            reqwest::Method::POST,
            "/budgets/gc/check",
            Some(json!({"visitor": "A", "day": today})),
            false,
        ),
        (
            reqwest::Method::PUT,
            "/budgets/gc",
            Some(json!({"visitor_limit": 2, "global_limit": 10})),
            true,
        ),
        (
            reqwest::Method::POST,
            "/budgets/gc/check",
            Some(json!({"visitor": "A", "day": today})),
            false,
        ),
        (
            reqwest::Method::POST,
            "/counters/a",
            Some(json!({"by": 3})),
            false,
        ),
    ];
    let mut tasks = Vec::new();
    for (i, (method, path, body, admin)) in plan.into_iter().enumerate() {
        let mut rb = app.client.request(method, app.url(path));
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        if admin {
            rb = rb.bearer_auth(crate::helpers::ADMIN);
        }
        tasks.push(tokio::spawn(rb.send()));
        // In queue order: each waits for the one before it to be queued.
        wait_for_queue_depth(&app.client, &app.url(""), i as u64 + 1).await;
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap().unwrap());
    }
    assert_eq!(warm.await.unwrap(), StatusCode::OK);
    let mut it = answers.into_iter();
    let mut next_json = async || it.next().unwrap();
    let r = next_json().await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 1);
    let r = next_json().await;
    assert_eq!(problem(r, StatusCode::NOT_FOUND).await["allowed"], false);
    let r = next_json().await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 3);
    let r = next_json().await;
    problem(r, StatusCode::CONFLICT).await;
    let r = next_json().await;
    assert_eq!(r.json::<Value>().await.unwrap()["reason"], "ok");
    let r = next_json().await;
    assert_eq!(r.status(), StatusCode::OK);
    // The raised visitor limit applies to the check queued after it.
    let r = next_json().await;
    let d: Value = r.json().await.unwrap();
    assert_eq!(
        (d["reason"].clone(), d["visitor_calls"].clone()),
        (json!("ok"), json!(2))
    );
    let r = next_json().await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 6);
    let r = app.get("/counters/big").await;
    assert_eq!(
        r.json::<Value>().await.unwrap()["value"],
        9223372036854775000i64
    );
    app.stop().await.unwrap();
}

#[tokio::test]
async fn one_trip_increment_batches_answer_as_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut batched = fresh_db(dir.path(), "b.db").await;
    let mut single = fresh_db(dir.path(), "s.db").await;
    let names: Vec<Name> = (0..5)
        .map(|i| Name::parse(&format!("n{i}")).unwrap())
        .collect();
    let mut rng = fastrand::Rng::with_seed(11);
    for _ in 0..100 {
        let items: Vec<(&Name, i64)> = (0..rng.usize(1..50))
            .map(|_| (&names[rng.usize(..names.len())], rng.i64(1..=1_000_000)))
            .collect();
        let mut want = Vec::new();
        for (n, by) in &items {
            want.push(meter::increment(&mut single, n, *by).await.unwrap());
        }
        let got = meter::increment_many_committed(&mut batched, &items)
            .await
            .unwrap();
        assert_eq!(got, Some(want));
    }
    assert_eq!(dump(&mut batched).await, dump(&mut single).await);
}

#[tokio::test]
async fn a_one_trip_batch_that_overflows_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut conn = near_overflow(dir.path()).await;
    let (big, small) = (Name::parse("big").unwrap(), Name::parse("small").unwrap());
    let r = meter::increment_many_committed(&mut conn, &[(&small, 1), (&big, 500), (&big, 500)])
        .await
        .unwrap();
    assert_eq!(r, None);
    let before = dump(&mut conn).await;
    assert_eq!(
        before,
        vec![(
            "big".into(),
            "".into(),
            "*counter*".into(),
            9223372036854775000
        )]
    );
    // No transaction was left open: the next one starts and commits.
    let r = meter::increment_many_committed(&mut conn, &[(&small, 1)])
        .await
        .unwrap();
    assert_eq!(r, Some(vec![1]));
}
