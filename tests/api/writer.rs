//! The writer and the queue in front of it: backpressure and readiness,
//! and batches, in which one failing command must not take the rest of its
//! batch down. (That set-based execution answers exactly as one command at
//! a time is checked against the SQL itself, in `src/db/tests.rs`.)

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{problem, spawn_app, spawn_with, wait_for_queue_depth};

#[tokio::test]
async fn a_full_queue_answers_429_and_stays_ready() {
    let app = spawn_with(|s| {
        s.queue_capacity = 2;
        s.max_batch = 1;
        s.test_writer_delay_ms = Some(40);
    })
    .await;
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let client = app.client.clone();
        let url = app.url("/counters/bp");
        tasks.push(tokio::spawn(async move {
            client.post(&url).send().await.unwrap()
        }));
    }
    // Readiness holds while the queue is full.
    for _ in 0..5 {
        let r = app.get("/ready").await;
        assert_eq!(r.status(), StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.status() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                let after: u64 = r.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!((1..=30).contains(&after), "Retry-After {after}");
                let body = problem(r, StatusCode::TOO_MANY_REQUESTS).await;
                assert_eq!(body["type"], "/problems/queue-full");
                refused += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert!(ok >= 1 && refused >= 1, "ok={ok} refused={refused}");
    // Exactly the accepted writes happened.
    let r = app.get("/counters/bp").await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], ok);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn budget_checks_refused_for_a_full_queue_are_denied() {
    let app = spawn_with(|s| {
        s.queue_capacity = 1;
        s.max_batch = 1;
        s.test_writer_delay_ms = Some(40);
    })
    .await;
    app.budget("q", 100, 100).await;
    // A check may name only a day its budget keeps: today in UTC, its zone.
    let day = jiff::Timestamp::now()
        .in_tz("UTC")
        .unwrap()
        .date()
        .to_string();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let client = app.client.clone();
        let (url, day) = (app.url("/budgets/q/check"), day.clone());
        tasks.push(tokio::spawn(async move {
            client
                .post(&url)
                .json(&serde_json::json!({"visitor": "A", "day": day}))
                .send()
                .await
                .unwrap()
        }));
    }
    let mut refused = 0;
    for t in tasks {
        let r = t.await.unwrap();
        if r.status() == StatusCode::TOO_MANY_REQUESTS {
            assert!(r.headers().contains_key("retry-after"));
            assert_eq!(
                problem(r, StatusCode::TOO_MANY_REQUESTS).await["allowed"],
                false
            );
            refused += 1;
        } else {
            assert_eq!(r.status(), StatusCode::OK);
        }
    }
    assert!(refused >= 1);
    let u = app.usage("q", &format!("day={day}")).await;
    assert_eq!(u["global_calls"], 20 - refused);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn a_closed_queue_is_not_ready_and_refuses_writes() {
    let app = spawn_app().await;
    assert_eq!(app.get("/ready").await.status(), StatusCode::OK);
    app.db.close();
    // The writer closes the queue on its next turn.
    let mut ready = StatusCode::OK;
    for _ in 0..100 {
        ready = app.get("/ready").await.status();
        if ready != StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ready, StatusCode::SERVICE_UNAVAILABLE);
    problem(app.get("/ready").await, StatusCode::SERVICE_UNAVAILABLE).await;
    let r = app.client.post(app.url("/counter")).send().await.unwrap();
    assert!(r.headers().contains_key("retry-after"));
    let body = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(body["type"], "/problems/shutting-down");
    // Reads still work, and liveness holds.
    assert_eq!(app.get("/counter").await.status(), StatusCode::OK);
    assert_eq!(app.get("/livez").await.status(), StatusCode::OK);
    app.stop().await.unwrap();
}

/// One batch holding a refused check, an overflowing increment (which sends
/// the batch down the one-by-one path), an admin write and good commands:
/// every caller gets its own correct answer and the good ones commit.
#[tokio::test]
async fn one_failing_command_does_not_fail_its_batch() {
    // Held long enough for every command below to queue, one at a time.
    let app = spawn_with(|s| s.test_writer_delay_ms = Some(3000)).await;
    app.budget("gc", 1, 10).await;
    app.sql_behind("INSERT INTO counters (name, value) VALUES ('big', 9223372036854775000)")
        .await;
    // Occupy the writer, so that the commands below queue up behind it.
    let held = app.db.batches_held();
    let warm = tokio::spawn({
        let (c, u) = (app.client.clone(), app.url("/counters/warm"));
        async move { c.post(u).send().await.unwrap().status() }
    });
    app.writer_holds(held + 1).await;

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
