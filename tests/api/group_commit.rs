//! The writer's batches: one failing command must not take the rest of its
//! batch down. (That set-based execution answers exactly as one command at
//! a time is checked against the SQL itself, in `src/db/tests.rs`.)

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{problem, spawn_with, wait_for_queue_depth};

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
