use std::collections::HashSet;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{spawn_app, spawn_with};

#[tokio::test]
async fn default_counter_counts_from_plain_posts() {
    let app = spawn_app().await;
    let r = app.get("/counter").await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"value": 0}));
    for expected in 1..=3 {
        // Like `curl -X POST`: no body, no Content-Type.
        let r = app.client.post(app.url("/counter")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.json::<Value>().await.unwrap(), json!({"value": expected}));
    }
    let r = app.get("/counter").await;
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"value": 3}));
    app.stop().await.unwrap();
}

#[tokio::test]
async fn named_counters_add_by_and_read_back() {
    let app = spawn_app().await;
    let r = app.get("/counters/page:home").await;
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"name": "page:home", "value": 0})
    );
    let r = app.post_json("/counters/page:home", json!({"by": 5})).await;
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"name": "page:home", "value": 5})
    );
    let r = app.post_json("/counters/page:home", json!({})).await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 6);
    let r = app
        .post_json("/counters/page:home", json!({"by": 1_000_000}))
        .await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 1_000_006);
    // Other counters are separate; the default counter is the one named `default`.
    app.client.post(app.url("/counter")).send().await.unwrap();
    let r = app.get("/counters/default").await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 1);
    let r = app.get("/counters/page:home").await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 1_000_006);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn concurrent_increments_are_exact_and_distinct() {
    let app = spawn_app().await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let client = app.client.clone();
        let url = app.url("/counters/hits");
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::with_capacity(500);
            for _ in 0..500 {
                let r = client.post(&url).send().await.unwrap();
                assert_eq!(r.status(), StatusCode::OK);
                seen.push(r.json::<Value>().await.unwrap()["value"].as_i64().unwrap());
            }
            seen
        }));
    }
    let mut all = HashSet::new();
    for t in tasks {
        for v in t.await.unwrap() {
            assert!(all.insert(v), "value {v} answered twice");
        }
    }
    assert_eq!(all.len(), 4000);
    assert_eq!(all, (1..=4000).collect::<HashSet<i64>>());
    let r = app.get("/counters/hits").await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 4000);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn overflow_is_refused_and_leaves_the_counter_alone() {
    let app = spawn_app().await;
    // Put the counter near the top from behind the API.
    app.sql_behind("INSERT INTO counters (name, value) VALUES ('big', 9223372036854775000)")
        .await;
    let r = app.post_json("/counters/big", json!({"by": 1000})).await;
    let body = crate::helpers::problem(r, StatusCode::CONFLICT).await;
    assert_eq!(body["type"], "/problems/counter-overflow");
    let r = app.get("/counters/big").await;
    assert_eq!(
        r.json::<Value>().await.unwrap()["value"],
        9223372036854775000i64
    );
    // Within range still works in the same batch machinery afterwards.
    let r = app.post_json("/counters/big", json!({"by": 807})).await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], i64::MAX);
    app.stop().await.unwrap();
}

/// A read after a 200 sees that write, and never a value older than one
/// already read, while many names come and go from SQLite's in-memory
/// values (16 kept, 200 names written and read by 8 clients at once): every
/// value a read answers was committed, and the last reads are the totals.
#[tokio::test]
async fn reads_see_every_acknowledged_write_while_names_come_and_go() {
    let app = spawn_with(|s| s.counter_cache = 1).await;
    const NAMES: u64 = 200;
    let mut tasks = Vec::new();
    for client_no in 0..8u64 {
        let client = app.client.clone();
        let base = app.url("");
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(client_no);
            let mut seen = std::collections::HashMap::<u64, i64>::new();
            let mut acked = 0;
            for _ in 0..300 {
                let n = rng.u64(0..NAMES);
                let url = format!("{base}/counters/c{n}");
                if rng.bool() {
                    let r = client
                        .post(&url)
                        .json(&json!({"by": 1}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), StatusCode::OK);
                    acked += 1;
                    let v = r.json::<Value>().await.unwrap()["value"].as_i64().unwrap();
                    let before = seen.insert(n, v).unwrap_or(0);
                    assert!(v > before, "c{n}: wrote {v} after reading {before}");
                }
                let r = client.get(&url).send().await.unwrap();
                assert_eq!(r.status(), StatusCode::OK);
                let v = r.json::<Value>().await.unwrap()["value"].as_i64().unwrap();
                let before = seen.insert(n, v).unwrap_or(0);
                assert!(
                    v >= before,
                    "c{n}: read {v} after {before} was acknowledged or read"
                );
            }
            acked
        }));
    }
    let mut acked = 0;
    for t in tasks {
        acked += t.await.unwrap();
    }
    // Every increment was by 1: the values read add up to the 200s.
    let mut total = 0;
    for n in 0..NAMES {
        let r = app.get(&format!("/counters/c{n}")).await;
        total += r.json::<Value>().await.unwrap()["value"].as_i64().unwrap();
    }
    assert_eq!(total, acked);
    app.stop().await.unwrap();
}
