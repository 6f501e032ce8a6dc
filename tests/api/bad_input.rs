//! Every rule about input, each answered with a problem+json 4xx.

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::helpers::{ADMIN, problem, spawn_app, spawn_with};

#[tokio::test]
async fn bad_names() {
    let app = spawn_app().await;
    let long = "n".repeat(129);
    for name in ["a%20b", "a%2Fb", "%C3%A9", "*", "a!", long.as_str()] {
        for (method, path) in [
            (Method::POST, format!("/counters/{name}")),
            (Method::GET, format!("/counters/{name}")),
            (Method::GET, format!("/budgets/{name}")),
            (Method::GET, format!("/budgets/{name}/usage")),
        ] {
            let r = app
                .client
                .request(method, app.url(&path))
                .send()
                .await
                .unwrap();
            let body = problem(r, StatusCode::BAD_REQUEST).await;
            assert_eq!(body["type"], "/problems/invalid-input", "{path}");
        }
        let r = app
            .post_json(&format!("/budgets/{name}/check"), json!({"visitor": "A"}))
            .await;
        assert_eq!(problem(r, StatusCode::BAD_REQUEST).await["allowed"], false);
    }
    // 128 characters is fine.
    let r = app
        .client
        .post(app.url(&format!("/counters/{}", "n".repeat(128))))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn bad_increments() {
    let app = spawn_app().await;
    for body in [
        json!({"by": 0}),
        json!({"by": -1}),
        json!({"by": 1_000_001}),
        json!({"by": 1.5}),
        json!({"by": "2"}),
        json!({"by": null}),
        json!({"by": 1, "extra": true}),
        json!([1]),
    ] {
        let r = app.post_json("/counters/x", body.clone()).await;
        let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert_eq!(p["type"], "/problems/invalid-body", "{body}");
    }
    let r = app.get("/counters/x").await;
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["value"], 0);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn malformed_bodies_and_media_types() {
    let app = spawn_app().await;
    let send = |ct: Option<&str>, body: &'static str| {
        let mut rb = app.client.post(app.url("/counters/x")).body(body);
        if let Some(ct) = ct {
            rb = rb.header("content-type", ct);
        }
        rb.send()
    };
    let r = send(Some("application/json"), "{\"by\": ").await.unwrap();
    assert_eq!(
        problem(r, StatusCode::BAD_REQUEST).await["type"],
        "/problems/malformed-json"
    );
    let r = send(Some("application/json"), "not json").await.unwrap();
    problem(r, StatusCode::BAD_REQUEST).await;
    let r = send(Some("text/plain"), "{\"by\": 2}").await.unwrap();
    problem(r, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
    let r = send(None, "{\"by\": 2}").await.unwrap();
    problem(r, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
    // A JSON body with parameters in its media type is fine; so is an empty one.
    let r = send(Some("application/json; charset=utf-8"), "{\"by\": 2}")
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = send(Some("application/json"), "").await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = app.get("/counters/x").await;
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["value"], 3);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn huge_bodies_are_413() {
    let app = spawn_app().await;
    let big = format!("{{\"by\": 1, \"pad\": \"{}\"}}", "x".repeat(70 * 1024));
    for path in ["/counters/x", "/budgets/b/check", "/counter"] {
        let r = app
            .client
            .post(app.url(path))
            .header("content-type", "application/json")
            .body(big.clone())
            .send()
            .await
            .unwrap();
        problem(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    }
    // Streamed without a Content-Length, too.
    let stream = futures_stream(big.into_bytes());
    let r = app
        .client
        .post(app.url("/counters/x"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .unwrap();
    problem(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    app.stop().await.unwrap();
}

fn futures_stream(
    bytes: Vec<u8>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> + Send + 'static {
    let chunks: Vec<_> = bytes.chunks(8192).map(|c| Ok(c.to_vec())).collect();
    futures_util::stream::iter(chunks)
}

#[tokio::test]
async fn bad_checks() {
    let app = spawn_app().await;
    app.budget("b", 5, 5).await;
    let long = "v".repeat(257);
    for body in [
        json!({}),
        json!({"visitor": ""}),
        json!({"visitor": long}),
        json!({"visitor": "a\u{0007}b"}),
        json!({"visitor": "a\nb"}),
        json!({"visitor": 7}),
        json!({"visitor": "A", "day": "2000-02-30"}),
        json!({"visitor": "A", "day": "01/02/2000"}),
        json!({"visitor": "A", "day": "2000-1-1"}),
        json!({"visitor": "A", "day": 20000101}),
        json!({"visitor": "A", "extra": 1}),
    ] {
        let r = app.post_json("/budgets/b/check", body.clone()).await;
        let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert_eq!(p["allowed"], false, "{body}");
    }
    let r = app
        .client
        .post(app.url("/budgets/b/check"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        problem(r, StatusCode::UNPROCESSABLE_ENTITY).await["allowed"],
        false
    );
    let r = app
        .client
        .post(app.url("/budgets/b/check"))
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(problem(r, StatusCode::BAD_REQUEST).await["allowed"], false);
    // Nothing above was counted.
    let u = app.usage("b", "").await;
    assert_eq!(u["global_calls"], 0);
    for q in ["day=2000-02-30", "day=yesterday", "visitor=", "bogus=1"] {
        let r = app.get(&format!("/budgets/b/usage?{q}")).await;
        problem(r, StatusCode::BAD_REQUEST).await;
    }
    app.stop().await.unwrap();
}

#[tokio::test]
async fn bad_budget_configs() {
    let app = spawn_app().await;
    for body in [
        json!({}),
        json!({"visitor_limit": 1}),
        json!({"visitor_limit": -1, "global_limit": 1}),
        json!({"visitor_limit": 1, "global_limit": 4_294_967_296u64}),
        json!({"visitor_limit": 1, "global_limit": 1, "retention_days": 0}),
        json!({"visitor_limit": 1, "global_limit": 1, "retention_days": 3651}),
        json!({"visitor_limit": 1, "global_limit": 1, "timezone": "Mars/Olympus_Mons"}),
        json!({"visitor_limit": 1, "global_limit": 1, "timezone": "+05:00"}),
        json!({"visitor_limit": 1, "global_limit": 1, "colour": "red"}),
    ] {
        let r = app.admin_put_budget("b", body.clone()).await;
        problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    }
    problem(app.get("/budgets/b").await, StatusCode::NOT_FOUND).await;
    app.stop().await.unwrap();
}

#[tokio::test]
async fn admin_token_is_required() {
    let app = spawn_app().await;
    let body = json!({"visitor_limit": 1, "global_limit": 1});
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("Bearer"),
        Some(format!("Basic {ADMIN}").leak() as &str),
        Some("Bearer test-admin-token-and-more"),
    ] {
        for path in ["/budgets/b", "/budgets/b/reset"] {
            let method = if path.ends_with("reset") {
                Method::POST
            } else {
                Method::PUT
            };
            let mut rb = app.client.request(method, app.url(path)).json(&body);
            if let Some(a) = auth {
                rb = rb.header("authorization", a);
            }
            let r = rb.send().await.unwrap();
            assert!(r.headers().contains_key("www-authenticate"));
            problem(r, StatusCode::UNAUTHORIZED).await;
        }
    }
    let r = app.admin_put_budget("b", body).await;
    assert_eq!(r.status(), StatusCode::OK);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn admin_is_disabled_without_a_token() {
    let app = spawn_with(|s| s.admin_token = None).await;
    let r = app
        .client
        .put(app.url("/budgets/b"))
        .bearer_auth("anything")
        .json(&json!({"visitor_limit": 1, "global_limit": 1}))
        .send()
        .await
        .unwrap();
    problem(r, StatusCode::FORBIDDEN).await;
    app.stop().await.unwrap();
}

#[tokio::test]
async fn unknown_routes_and_methods() {
    let app = spawn_app().await;
    problem(app.get("/nope").await, StatusCode::NOT_FOUND).await;
    problem(app.get("/counters").await, StatusCode::NOT_FOUND).await;
    problem(app.get("/counters/a/b").await, StatusCode::NOT_FOUND).await;
    for (m, path) in [
        (Method::DELETE, "/counter"),
        (Method::PUT, "/counters/x"),
        (Method::POST, "/budgets/x"),
        (Method::GET, "/budgets/x/check"),
        (Method::POST, "/ready"),
    ] {
        let r = app.client.request(m, app.url(path)).send().await.unwrap();
        problem(r, StatusCode::METHOD_NOT_ALLOWED).await;
    }
    app.stop().await.unwrap();
}

/// A body is one JSON object and nothing after it but white space: a
/// second value or trailing text is refused, not half-read.
#[tokio::test]
async fn trailing_data_after_the_json_object_is_refused() {
    let app = spawn_app().await;
    for body in ["{\"by\": 5} x", "{\"by\": 5}{\"by\": 7}", "{\"by\": 5}]"] {
        let r = app
            .client
            .post(app.url("/counters/t"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let p = problem(r, StatusCode::BAD_REQUEST).await;
        assert_eq!(p["type"], "/problems/malformed-json", "{body}");
    }
    let r = app
        .client
        .post(app.url("/counters/t"))
        .header("content-type", "application/json")
        .body("{\"by\": 2} \r\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = app.get("/counters/t").await;
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["value"], 2);
    app.stop().await.unwrap();
}
