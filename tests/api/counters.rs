use std::collections::HashSet;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::spawn_app;

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
