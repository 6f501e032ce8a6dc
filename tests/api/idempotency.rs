//! Idempotency keys: a retried write with the same key is answered, not
//! applied again.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{TestApp, problem, spawn_app};

pub(crate) async fn post_keyed(
    app: &TestApp,
    path: &str,
    key: &str,
    body: Value,
) -> reqwest::Response {
    app.client
        .post(app.url(path))
        .header("idempotency-key", key)
        .json(&body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_retried_increment_is_answered_not_applied() {
    let app = spawn_app().await;
    let r = post_keyed(&app, "/counters/pay", "k-1", json!({"by": 5})).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(!r.headers().contains_key("idempotent-replayed"));
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 5);
    // Someone else writes in between.
    app.post_json("/counters/pay", json!({"by": 100})).await;
    for _ in 0..3 {
        let r = post_keyed(&app, "/counters/pay", "k-1", json!({"by": 5})).await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["idempotent-replayed"], "true");
        assert_eq!(
            r.json::<Value>().await.unwrap()["value"],
            5,
            "the first answer"
        );
    }
    let v: Value = app.get("/counters/pay").await.json().await.unwrap();
    assert_eq!(v["value"], 105);
    // The quoted structured-field form names the same key.
    let r = post_keyed(&app, "/counters/pay", "\"k-1\"", json!({"by": 5})).await;
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    // The default counter takes keys too.
    let r = app
        .client
        .post(app.url("/counter"))
        .header("idempotency-key", "d")
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 1);
    let r = app
        .client
        .post(app.url("/counter"))
        .header("idempotency-key", "d")
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 1);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_refused() {
    let app = spawn_app().await;
    post_keyed(&app, "/counters/a", "same", json!({"by": 1})).await;
    for (path, body) in [
        ("/counters/a", json!({"by": 2})),
        ("/counters/b", json!({"by": 1})),
        ("/budgets/x/check", json!({"visitor": "v"})),
    ] {
        let r = post_keyed(&app, path, "same", body).await;
        let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert_eq!(p["type"], "/problems/idempotency-key-reused", "{path}");
    }
    let v: Value = app.get("/counters/a").await.json().await.unwrap();
    assert_eq!(v["value"], 1);
    let v: Value = app.get("/counters/b").await.json().await.unwrap();
    assert_eq!(v["value"], 0);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn a_retried_check_is_answered_not_counted() {
    let app = spawn_app().await;
    app.budget("idem", 1, 10).await;
    // Today in UTC, the budget's zone: a check may name only a day its
    // budget keeps.
    let day = jiff::Timestamp::now()
        .in_tz("UTC")
        .unwrap()
        .date()
        .to_string();
    let body = json!({"visitor": "A", "day": day});
    let first: Value = post_keyed(&app, "/budgets/idem/check", "c-1", body.clone())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(first["allowed"], true);
    let r = post_keyed(&app, "/budgets/idem/check", "c-1", body.clone()).await;
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert!(r.headers().contains_key("ratelimit"));
    assert_eq!(r.json::<Value>().await.unwrap(), first);
    let u = app.usage("idem", &format!("day={day}&visitor=A")).await;
    assert_eq!(
        (u["global_calls"].clone(), u["visitor_calls"].clone()),
        (json!(1), json!(1))
    );
    // A new key is a new call: over the visitor limit now.
    let r: Value = post_keyed(&app, "/budgets/idem/check", "c-2", body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["reason"], "visitor_limit");
    app.stop().await.unwrap();
}

#[tokio::test]
async fn concurrent_requests_with_one_key_write_once() {
    let app = spawn_app().await;
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (c, u) = (app.client.clone(), app.url("/counters/once"));
        tasks.push(tokio::spawn(async move {
            let r = c
                .post(u)
                .header("idempotency-key", "one")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            r.json::<Value>().await.unwrap()["value"].as_i64().unwrap()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 1);
    }
    let v: Value = app.get("/counters/once").await.json().await.unwrap();
    assert_eq!(v["value"], 1);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn bad_keys_are_400_and_write_nothing() {
    let app = spawn_app().await;
    let long = "k".repeat(256);
    for key in ["", "has space", "qu\"ote", long.as_str()] {
        let r = post_keyed(&app, "/counters/k", key, json!({})).await;
        problem(r, StatusCode::BAD_REQUEST).await;
        let r = post_keyed(&app, "/budgets/k/check", key, json!({"visitor": "v"})).await;
        assert_eq!(problem(r, StatusCode::BAD_REQUEST).await["allowed"], false);
    }
    let v: Value = app.get("/counters/k").await.json().await.unwrap();
    assert_eq!(v["value"], 0);
    app.stop().await.unwrap();
}

/// A stored key is answered before the day is judged: a retry of a check
/// that named a day gets its decision back even once the day has left the
/// budget's window (here: the window shrinks), while the same request
/// without the key is refused.
#[tokio::test]
async fn a_keyed_check_replays_after_its_day_left_the_window() {
    let app = spawn_app().await;
    let put = |retention: u32| json!({"visitor_limit": 5, "global_limit": 10, "retention_days": retention});
    assert_eq!(
        app.admin_put_budget("w", put(3)).await.status(),
        StatusCode::OK
    );
    let day = (jiff::Timestamp::now().in_tz("UTC").unwrap().date() - jiff::Span::new().days(3))
        .to_string();
    let body = json!({"visitor": "A", "day": day});
    let first = post_keyed(&app, "/budgets/w/check", "k-day", body.clone()).await;
    assert_eq!(first.status(), StatusCode::OK);
    let first: Value = first.json().await.unwrap();
    assert_eq!(
        app.admin_put_budget("w", put(1)).await.status(),
        StatusCode::OK
    );

    let again = post_keyed(&app, "/budgets/w/check", "k-day", body.clone()).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Value>().await.unwrap(), first);
    let fresh = post_keyed(&app, "/budgets/w/check", "k-other", body).await;
    let p = problem(fresh, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert_eq!(p["type"], "/problems/day-outside-window");
    assert_eq!(p["allowed"], false);
    app.stop().await.unwrap();
}

/// Two `Idempotency-Key` fields are refused: taking the first would let a
/// retry that sends only the second write again.
#[tokio::test]
async fn two_keys_in_one_request_are_refused() {
    let app = spawn_app().await;
    let r = app
        .client
        .post(app.url("/counters/twice"))
        .header("idempotency-key", "k-a")
        .header("idempotency-key", "k-b")
        .send()
        .await
        .unwrap();
    let body = problem(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(body["type"], "/problems/invalid-input", "{body}");
    let r = app.get("/counters/twice").await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 0);
    app.stop().await.unwrap();
}

/// A reset retried under its key answers the first reset's result and
/// clears nothing counted since (without the key a retry would hand the
/// visitor its allowance again); the same key on another reset is `422`.
/// A `PUT` takes no stored key but checks the field like every write.
#[tokio::test]
async fn a_retried_reset_is_answered_not_applied() {
    let app = spawn_app().await;
    app.budget("rk", 1, 100).await;
    let reset = |key: &'static str, body: Value| {
        app.client
            .post(app.url("/budgets/rk/reset"))
            .bearer_auth(crate::helpers::ADMIN)
            .header("idempotency-key", key)
            .json(&body)
            .send()
    };
    let allowed = async || {
        let r = app
            .post_json("/budgets/rk/check", json!({"visitor": "a"}))
            .await;
        assert_eq!(r.status(), StatusCode::OK);
        r.json::<Value>().await.unwrap()["allowed"] == true
    };
    assert!(allowed().await);
    let first = reset("reset-1", json!({"visitor": "a"})).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["deleted_rows"], 1, "{first}");
    // Counted after the reset, then the reset retried: still counted.
    assert!(allowed().await);
    let retried = reset("reset-1", json!({"visitor": "a"})).await.unwrap();
    assert_eq!(retried.status(), StatusCode::OK);
    assert_eq!(retried.headers()["idempotent-replayed"], "true");
    assert_eq!(retried.json::<Value>().await.unwrap(), first);
    assert!(!allowed().await, "the retry cleared nothing");
    // The key on another reset: all visitors, or another visitor.
    for other in [json!({}), json!({"visitor": "b"})] {
        let r = reset("reset-1", other).await.unwrap();
        let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert_eq!(p["type"], "/problems/idempotency-key-reused", "{p}");
    }
    assert_eq!(app.usage("rk", "visitor=a").await["visitor_calls"], 2);
    assert_eq!(app.usage("rk", "").await["global_calls"], 2);
    // Two key fields: 400 on a reset and on a PUT, and nothing done.
    for (method, path) in [("POST", "/budgets/rk/reset"), ("PUT", "/budgets/rk")] {
        let r = app
            .client
            .request(method.parse().unwrap(), app.url(path))
            .bearer_auth(crate::helpers::ADMIN)
            .header("idempotency-key", "k-a")
            .header("idempotency-key", "k-b")
            .json(&json!({"visitor_limit": 5, "global_limit": 5}))
            .send()
            .await
            .unwrap();
        problem(r, StatusCode::BAD_REQUEST).await;
    }
    let b: Value = app.get("/budgets/rk").await.json().await.unwrap();
    assert_eq!(b["visitor_limit"], 1, "the PUT changed nothing");
    app.stop().await.unwrap();
}
