//! The queue in front of the writer: backpressure and readiness.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::{problem, spawn_app, spawn_with};

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
