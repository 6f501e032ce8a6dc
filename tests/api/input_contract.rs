//! The input contract: every rule about input, each answered with a
//! problem+json 4xx; and what a hostile or careless client sends:
//! host-dependent time zones, bytes that are not UTF-8, request ids that
//! could forge log lines, body-less posts with any content type, and a
//! check that runs out of time. Each answer is a problem, or the request is
//! served as the contract says, and nothing else changes. (Days outside a
//! budget's window, with the rows looked at behind the API:
//! `on_sqlite::input_contract`.)

use std::{
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

use jiff::{Timestamp, civil::Date, tz::TimeZone};
use reqwest::{Method, StatusCode, header::HeaderValue};
use serde_json::{Value, json};

use crate::helpers::{ADMIN, Readers, TestApp, problem, spawn_app, spawn_with};

/// Waits, if need be, until the day in `tz` began more than the four
/// minutes after which a prune deletes the day its window left (a prune
/// within them keeps it till the next day's first call), and ends in more
/// than a minute: for a test that asserts what a prune deleted.
pub(crate) async fn clear_of_midnight(tz: &str) {
    let time = Timestamp::now()
        .to_zoned_datetime(TimeZone::get(tz).unwrap())
        .time();
    let secs =
        i64::from(time.hour()) * 3600 + i64::from(time.minute()) * 60 + i64::from(time.second());
    let wait = match secs {
        ..270 => 270 - secs,
        s if s >= 86_400 - 60 => 86_400 - s + 270,
        _ => return,
    };
    tokio::time::sleep(Duration::from_secs(wait.unsigned_abs())).await;
}

/// Today in `tz`, from the clock.
pub(crate) fn today_in(tz: &str) -> Date {
    Timestamp::now()
        .to_zoned_datetime(TimeZone::get(tz).unwrap())
        .date()
}

pub(crate) async fn post_check(app: &TestApp, budget: &str, body: Value) -> reqwest::Response {
    app.post_json(&format!("/budgets/{budget}/check"), body)
        .await
}

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
    // Valid JSON, past any range: out of range, as 2^64 is, not malformed.
    let huge = format!("{{\"by\": {}}}", "9".repeat(5000));
    for body in [
        r#"{"by": 18446744073709551616}"#,
        r#"{"by": 1e400}"#,
        r#"{"by": -1e400}"#,
        huge.as_str(),
    ] {
        let r = app
            .client
            .post(app.url("/counters/x"))
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert_eq!(p["type"], "/problems/invalid-body", "{body:.40}");
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
    // A JSON body with parameters in its media type is fine, however RFC
    // 9110 lets them be spaced (white space before `;`, empty ones); so is
    // an empty body.
    for ct in [
        "application/json; charset=utf-8",
        "application/json ; charset=utf-8",
        "application/json;;charset=utf-8",
        "Application/JSON;",
        "application/problem+json ;charset=utf-8",
    ] {
        let r = send(Some(ct), "{\"by\": 2}").await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{ct}");
    }
    for ct in [
        "application/jsonx",
        "application /json",
        "text/json; x=application/json",
    ] {
        let r = send(Some(ct), "{\"by\": 2}").await.unwrap();
        problem(r, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
    }
    let r = send(Some("application/json"), "").await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = app.get("/counters/x").await;
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["value"], 11);
    app.stop().await.unwrap();
}

/// A problem may quote what the client sent (serde names an unknown
/// field twice): its detail is cut at 1 KiB, so a body near the limit
/// cannot make an answer twice its size.
#[tokio::test]
async fn a_problem_quotes_at_most_a_kibibyte_of_the_request() {
    let app = spawn_app().await;
    let field = "é".repeat(30_000);
    let r = app
        .post_json("/counters/x", serde_json::json!({ field: 1 }))
        .await;
    let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.starts_with("éé"), "{detail:.80}");
    assert!(detail.ends_with("..."), "{detail:.80}");
    assert!(detail.len() <= 1024 + 3, "{}", detail.len());
    let r = app.get("/counters/x").await;
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["value"], 0);
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

/// A body of exactly the limit is read whole, however it is cut up on the
/// wire; one byte more is 413 and counts nothing.
#[tokio::test]
async fn a_body_of_exactly_the_limit_is_read_whole_in_any_pieces() {
    const LIMIT: usize = 64 * 1024;
    let app = spawn_app().await;
    let json = |len: usize| {
        let head = "{\"by\": 2";
        format!("{head}{}}}", " ".repeat(len - head.len() - 1)).into_bytes()
    };
    for (body, status) in [
        (json(LIMIT), StatusCode::OK),
        (json(LIMIT + 1), StatusCode::PAYLOAD_TOO_LARGE),
    ] {
        for streamed in [false, true] {
            let req = app
                .client
                .post(app.url("/counters/edge"))
                .header("content-type", "application/json");
            let req = match streamed {
                // Pieces of 8 KiB, with no Content-Length.
                true => req.body(reqwest::Body::wrap_stream(futures_stream(body.clone()))),
                false => req.body(body.clone()),
            };
            let r = req.send().await.unwrap();
            assert_eq!(
                r.status(),
                status,
                "{} bytes, streamed: {streamed}",
                body.len()
            );
        }
    }
    let r = app.get("/counters/edge").await;
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["value"], 4);
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

/// Two `Authorization` fields are two credentials and two `Content-Type`
/// fields two types: neither is taken, in either order, and nothing runs.
#[tokio::test]
async fn a_field_that_must_be_one_is_refused_when_it_comes_twice() {
    let app = spawn_app().await;
    let body = json!({"visitor_limit": 1, "global_limit": 1});
    for pair in [
        [format!("Bearer {ADMIN}"), "Bearer wrong".into()],
        ["Bearer wrong".into(), format!("Bearer {ADMIN}")],
    ] {
        let r = app
            .client
            .put(app.url("/budgets/twice"))
            .header("authorization", &pair[0])
            .header("authorization", &pair[1])
            .json(&body)
            .send()
            .await
            .unwrap();
        problem(r, StatusCode::UNAUTHORIZED).await;
    }
    problem(app.get("/budgets/twice").await, StatusCode::NOT_FOUND).await;
    app.budget("b", 5, 5).await;
    for types in [
        ["application/json", "text/plain"],
        ["text/plain", "application/json"],
    ] {
        for path in ["/counters/twice", "/budgets/b/check"] {
            let r = app
                .client
                .post(app.url(path))
                .header("content-type", types[0])
                .header("content-type", types[1])
                .body(r#"{"by": 1, "visitor": "v"}"#.replace(
                    if path.contains("check") {
                        r#""by": 1, "#
                    } else {
                        r#", "visitor": "v""#
                    },
                    "",
                ))
                .send()
                .await
                .unwrap();
            let p = problem(r, StatusCode::BAD_REQUEST).await;
            assert!(
                p["detail"].as_str().unwrap().contains("one Content-Type"),
                "{p}"
            );
            if path.contains("check") {
                assert_eq!(p["allowed"], false, "{p}");
            }
        }
    }
    let v: Value = app.get("/counters/twice").await.json().await.unwrap();
    assert_eq!(v["value"], 0, "nothing was counted");
    let u = app.usage("b", "visitor=v").await;
    assert_eq!(u["global_calls"], 0, "{u}");
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

/// The token as a secret written from a file gives it, newline and all, is
/// the token: a request cannot send the newline. An empty one turns admin
/// off (403, saying so), not on with a token no request can present.
#[tokio::test]
async fn the_admin_token_is_read_as_a_request_can_send_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = crate::helpers::database_in(dir.path()).await;
    let put = async |bin: &crate::helpers::Binary, token: &str| {
        reqwest::Client::new()
            .put(bin.url("/budgets/b"))
            .bearer_auth(token)
            .json(&json!({"visitor_limit": 1, "global_limit": 1}))
            .send()
            .await
            .unwrap()
    };
    let bin = crate::helpers::Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_ADMIN_TOKEN", "s3cret\n"),
    ]);
    assert_eq!(put(&bin, "s3cret").await.status(), StatusCode::OK);
    // On, and called guessable at start (without showing it).
    let log = bin.log_text();
    assert!(
        log.contains("TALLY_ADMIN_TOKEN is shorter than 16 characters") && !log.contains("s3cret"),
        "{log}"
    );
    problem(put(&bin, "wrong").await, StatusCode::UNAUTHORIZED).await;
    bin.sigterm();
    drop(bin);

    let bin = crate::helpers::Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_ADMIN_TOKEN", ""),
    ]);
    let p = problem(put(&bin, "").await, StatusCode::FORBIDDEN).await;
    assert_eq!(p["type"], "/problems/admin-disabled", "{p}");
    bin.sigterm();
    drop(bin);

    // One no request could send turns admin off, said in the log without
    // showing it; counters and checks are served.
    let bin = crate::helpers::Binary::start(&[
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_ADMIN_TOKEN", "s3cr\u{e9}t"),
    ]);
    let p = problem(put(&bin, "s3cret").await, StatusCode::FORBIDDEN).await;
    assert_eq!(p["type"], "/problems/admin-disabled", "{p}");
    let r = reqwest::Client::new()
        .post(bin.url("/counters/c"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let logs = bin.log_text();
    assert!(logs.contains("admin endpoints are off"), "{logs}");
    assert!(!logs.contains("s3cr"), "the token shown: {logs}");
    bin.sigterm();
}

#[tokio::test]
async fn unknown_routes_and_methods() {
    let app = spawn_app().await;
    problem(app.get("/nope").await, StatusCode::NOT_FOUND).await;
    problem(app.get("/counterz").await, StatusCode::NOT_FOUND).await;
    let p = problem(app.get("/counters/a/b").await, StatusCode::NOT_FOUND).await;
    assert!(p.get("allowed").is_none(), "{p}");
    // A check sent to a path that is nearly the check's is denied too.
    app.budget("near", 5, 5).await;
    for path in [
        "/budgets/near/check/",
        "/budgets/near//check",
        "/budgets//near/check/",
    ] {
        let r = app.post_json(path, json!({"visitor": "v"})).await;
        let p = problem(r, StatusCode::NOT_FOUND).await;
        assert_eq!(p["allowed"], false, "{path}: {p}");
        assert!(p["detail"].as_str().unwrap().contains("/check"), "{p}");
    }
    let u = app.usage("near", "visitor=v").await;
    assert_eq!(u["global_calls"], 0, "{u}");
    for (m, path) in [
        (Method::DELETE, "/counter"),
        (Method::POST, "/counters"),
        (Method::DELETE, "/budgets"),
        (Method::PUT, "/counters/x"),
        (Method::POST, "/budgets/x"),
        (Method::GET, "/budgets/x/check"),
        (Method::POST, "/ready"),
    ] {
        let r = app.client.request(m, app.url(path)).send().await.unwrap();
        assert!(r.headers().contains_key("allow"), "{path}");
        let p = problem(r, StatusCode::METHOD_NOT_ALLOWED).await;
        // Every answer of a check but a 200 is a denial.
        match path.ends_with("/check") {
            true => assert_eq!(p["allowed"], false, "{p}"),
            false => assert!(p.get("allowed").is_none(), "{p}"),
        }
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

/// Only names of the time zone database built into tally: nothing that
/// depends on the host, and nothing that is no place.
#[tokio::test]
async fn time_zones_come_from_the_bundled_database_only() {
    let app = spawn_app().await;
    for bad in [
        "localtime",
        "posixrules",
        "Factory",
        "Etc/Unknown",
        "posix/Europe/Berlin",
        "right/UTC",
        "Mars/Olympus_Mons",
        "+05:00",
        "EST5EDT,M3.2.0,M11.1.0",
        "/etc/localtime",
        "../zoneinfo/UTC",
    ] {
        let r = app
            .admin_put_budget(
                "tz",
                json!({"visitor_limit": 1, "global_limit": 1, "timezone": bad}),
            )
            .await;
        let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert!(p["detail"].as_str().unwrap().contains("IANA"), "{bad}: {p}");
        let r = app.get("/budgets/tz").await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND, "{bad} was stored");
    }
    for (given, stored) in [
        ("europe/berlin", "Europe/Berlin"),
        ("utc", "UTC"),
        (
            "America/Argentina/Buenos_Aires",
            "America/Argentina/Buenos_Aires",
        ),
        ("Etc/GMT+5", "Etc/GMT+5"),
    ] {
        let r = app
            .admin_put_budget(
                "tz",
                json!({"visitor_limit": 1, "global_limit": 1, "timezone": given}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK, "{given}");
        assert_eq!(r.json::<Value>().await.unwrap()["timezone"], stored);
        let v: Value = app.get("/budgets/tz").await.json().await.unwrap();
        assert_eq!(v["timezone"], stored);
    }
    app.stop().await.unwrap();
}

/// Percent-encoded bytes that are not UTF-8 are refused in a query as they
/// are in a path, never read as U+FFFD.
#[tokio::test]
async fn a_query_that_is_not_utf8_is_refused() {
    let app = spawn_app().await;
    app.budget("u8", 5, 5).await;
    app.check("u8", "é", &today_in("UTC").to_string()).await;
    for q in [
        "visitor=%FF",
        "visitor=a%C3%28",
        "visitor=%E9",
        "day=%FF",
        "%FF=1",
    ] {
        let r = app.get(&format!("/budgets/u8/usage?{q}")).await;
        let p = problem(r, StatusCode::BAD_REQUEST).await;
        assert_eq!(p["type"], "/problems/invalid-query", "{q}: {p}");
    }
    // The same bytes in a path.
    let r = app.get("/counters/%FF").await;
    problem(r, StatusCode::BAD_REQUEST).await;
    // Real UTF-8, escaped or not, and a stray `%`, still read.
    let u = app.usage("u8", "visitor=%C3%A9").await;
    assert_eq!(u["visitor_calls"], 1);
    let u = app.usage("u8", "visitor=100%").await;
    assert_eq!(u["visitor_calls"], 0);
    app.stop().await.unwrap();
}

/// Sends `request` over a fresh connection and returns the whole answer.
async fn raw(app: &TestApp, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("tally answers and closes within 10 s")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// HTTP/1.1's rule on `Host` (RFC 9112, section 3.2): a request without
/// one, or with two, is `400`, and writes nothing; HTTP/1.0 needs none.
#[tokio::test]
async fn a_request_needs_exactly_one_host() {
    let app = spawn_app().await;
    app.budget("hb", 5, 5).await;
    let body = r#"{"visitor":"v"}"#;
    for (head, why) in [
        ("POST /counters/h HTTP/1.1\r\n", "must have"),
        (
            "POST /counters/h HTTP/1.1\r\nHost: a\r\nHost: b\r\n",
            "more than one",
        ),
        ("POST /budgets/hb/check HTTP/1.1\r\n", "must have"),
    ] {
        let request = format!(
            "{head}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let answer = raw(&app, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        let (_, json) = answer.split_once("\r\n\r\n").unwrap();
        let p: Value = serde_json::from_str(json).unwrap();
        assert_eq!(p["type"], "/problems/invalid-host", "{p}");
        assert!(p["detail"].as_str().unwrap().contains(why), "{p}");
        assert!(p["request_id"].is_string(), "{p}");
        if head.contains("/check") {
            assert_eq!(p["allowed"], false, "a check's refusal denies: {p}");
        }
    }
    let v: Value = app.get("/counters/h").await.json().await.unwrap();
    assert_eq!(v["value"], 0, "no refused request wrote");
    let u = app.usage("hb", "").await;
    assert_eq!(u["global_calls"], 0);
    // HTTP/1.0 has no Host rule.
    let answer = raw(&app, b"GET /livez HTTP/1.0\r\n\r\n").await;
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    app.stop().await.unwrap();
}

/// A body in a content coding, or a transfer coding besides `chunked`, is
/// refused from the head: tally reads bodies as sent, and would otherwise
/// parse compressed bytes as JSON, or count a body that only claims to be
/// compressed. `identity`, and `chunked` alone, are taken.
#[tokio::test]
async fn bodies_in_codings_tally_does_not_take_apart_are_refused() {
    let app = spawn_app().await;
    app.budget("cb", 5, 5).await;
    // A request's fields and body: `fields` then a `Content-Length`, or
    // (`chunked`) the body in one chunk.
    let request = |path: &str, fields: &str, chunked: bool, body: &str| {
        let framed = match chunked {
            true => format!("\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n", body.len()),
            false => format!("Content-Length: {}\r\n\r\n{body}", body.len()),
        };
        format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n{fields}{framed}"
        )
    };
    let refused = [
        // Plain JSON that claims to be compressed: counting it would take
        // the claim for a lie, and parsing real gzip would say the wrong
        // thing (a 400 for JSON that does not parse).
        (
            "Content-Encoding: gzip\r\n",
            false,
            "415 ",
            "unsupported-content-encoding",
        ),
        (
            "Content-Encoding: identity, br\r\n",
            false,
            "415 ",
            "unsupported-content-encoding",
        ),
        (
            "Content-Encoding: gzip\r\nTransfer-Encoding: chunked",
            true,
            "415 ",
            "unsupported-content-encoding",
        ),
        // hyper takes the chunks apart and hands over what is left.
        (
            "Transfer-Encoding: gzip, chunked",
            true,
            "400 ",
            "unsupported-transfer-encoding",
        ),
        (
            "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked",
            true,
            "400 ",
            "unsupported-transfer-encoding",
        ),
        // Chunked twice: a proxy that took both apart would read another
        // body than tally.
        (
            "Transfer-Encoding: chunked, chunked",
            true,
            "400 ",
            "unsupported-transfer-encoding",
        ),
    ];
    for (fields, chunked, status, kind) in refused {
        for (path, body) in [
            ("/counters/coded", r#"{"by":5}"#),
            ("/budgets/cb/check", r#"{"visitor":"v"}"#),
        ] {
            let answer = raw(&app, request(path, fields, chunked, body).as_bytes()).await;
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status}")),
                "{fields}: {answer}"
            );
            let (head, json) = answer.split_once("\r\n\r\n").unwrap();
            let p: Value = serde_json::from_str(json).unwrap();
            assert_eq!(p["type"], format!("/problems/{kind}"), "{fields}: {p}");
            if status == "415 " {
                assert!(
                    head.to_ascii_lowercase()
                        .contains("accept-encoding: identity"),
                    "{head}"
                );
            }
            if path.contains("check") {
                assert_eq!(p["allowed"], false, "a check's refusal denies: {p}");
            }
        }
    }
    let v: Value = app.get("/counters/coded").await.json().await.unwrap();
    assert_eq!(v["value"], 0, "no refused body was counted");
    assert_eq!(app.usage("cb", "").await["global_calls"], 0);
    // What is taken: `identity`, `chunked` alone, and a coding named on a
    // request with no body.
    for (fields, chunked, body) in [
        ("Content-Encoding: identity\r\n", false, r#"{"by":5}"#),
        ("Transfer-Encoding: chunked", true, r#"{"by":5}"#),
        (
            "Transfer-Encoding: Chunked\r\nContent-Encoding: IDENTITY",
            true,
            r#"{"by":5}"#,
        ),
        ("Content-Encoding: gzip\r\n", false, ""),
    ] {
        let answer = raw(
            &app,
            request("/counters/coded", fields, chunked, body).as_bytes(),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{fields}: {answer}");
    }
    let v: Value = app.get("/counters/coded").await.json().await.unwrap();
    assert_eq!(v["value"], 16);
    app.stop().await.unwrap();
}

/// A `POST` without a body (or with JSON's `null`) is valid where the body
/// is optional, whatever its `Content-Type`; a body that is there must
/// still be JSON.
#[tokio::test]
async fn a_post_without_a_body_needs_no_json_type() {
    let app = spawn_app().await;
    app.budget("rb", 5, 5).await;
    let types = [
        "text/html",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
    ];
    for ct in types {
        let r = app
            .client
            .post(app.url("/counters/empty"))
            .header("content-type", ct)
            .body("")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{ct}");
        let r = app
            .client
            .post(app.url("/budgets/rb/reset"))
            .bearer_auth(ADMIN)
            .header("content-type", ct)
            .body("")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{ct}");
        // A body, even blank space, must still be JSON.
        for body in ["by=5", " "] {
            let r = app
                .client
                .post(app.url("/counters/empty"))
                .header("content-type", ct)
                .body(body)
                .send()
                .await
                .unwrap();
            let p = problem(r, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
            assert_eq!(p["type"], "/problems/unsupported-media-type");
        }
        // A check needs its body: missing is 422, and a denial.
        let r = app
            .client
            .post(app.url("/budgets/rb/check"))
            .header("content-type", ct)
            .body("")
            .send()
            .await
            .unwrap();
        assert_eq!(
            problem(r, StatusCode::UNPROCESSABLE_ENTITY).await["allowed"],
            false
        );
    }
    // No Content-Length at all (what `hey -m POST` sends): no body.
    let answer = raw(
        &app,
        b"POST /counters/empty HTTP/1.1\r\nHost: t\r\nContent-Type: text/html\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // JSON's `null` stands for `{}` too, as documented; a check still
    // needs its visitor.
    let r = app.post_json("/counters/empty", Value::Null).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = app.post_json("/budgets/rb/check", Value::Null).await;
    problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    let v: Value = app.get("/counters/empty").await.json().await.unwrap();
    assert_eq!(v["value"], types.len() + 2);
    app.stop().await.unwrap();
}

/// A client's request id is kept only when it is short and safe to log;
/// otherwise a fresh one is made, echoed, and quoted in problem bodies.
#[tokio::test]
async fn unsafe_request_ids_are_replaced() {
    let app = spawn_app().await;
    let send = |ids: Vec<HeaderValue>| {
        let mut req = app.client.get(app.url("/budgets/nope"));
        for id in ids {
            req = req.header("x-request-id", id);
        }
        req.send()
    };
    let safe = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = send(vec![HeaderValue::from_static(safe)]).await.unwrap();
    assert_eq!(r.headers()["x-request-id"], safe);
    assert_eq!(problem(r, StatusCode::NOT_FOUND).await["request_id"], safe);

    let long = "x".repeat(65);
    let cases: Vec<Vec<HeaderValue>> = vec![
        vec![HeaderValue::from_static("a forged=field level=ERROR")],
        vec![HeaderValue::from_static("\"quoted\"")],
        vec![HeaderValue::from_static("back\\slash")],
        vec![HeaderValue::from_static("brace}:")],
        vec![HeaderValue::from_str(&long).unwrap()],
        vec![HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()],
        vec![HeaderValue::from_bytes(b"tab\there").unwrap()],
        vec![
            HeaderValue::from_static("one"),
            HeaderValue::from_static("two"),
        ],
    ];
    for ids in cases {
        let r = send(ids.clone()).await.unwrap();
        let echoed: Vec<_> = r
            .headers()
            .get_all("x-request-id")
            .iter()
            .cloned()
            .collect();
        assert_eq!(echoed.len(), 1, "{ids:?}");
        let id = echoed[0].to_str().unwrap().to_owned();
        assert!(!ids.contains(&echoed[0]), "{ids:?} was kept");
        assert_eq!(id.len(), 36, "a fresh UUID, not {id:?}");
        assert_eq!(problem(r, StatusCode::NOT_FOUND).await["request_id"], id);
    }
    // Control characters never reach tally as an id: refused by the HTTP
    // parser, or replaced.
    for bad in [&b"esc\x1b[31mred"[..], b"bell\x07"] {
        let mut req =
            b"GET /budgets/nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\nx-request-id: "
                .to_vec();
        req.extend_from_slice(bad);
        req.extend_from_slice(b"\r\n\r\n");
        let answer = raw(&app, &req).await;
        assert!(
            answer.starts_with("HTTP/1.1 400") || answer.starts_with("HTTP/1.1 404"),
            "{answer}"
        );
        assert!(
            !answer.contains('\x1b') && !answer.contains('\x07'),
            "{answer:?}"
        );
    }
    app.stop().await.unwrap();
}

/// A check that runs out of time is still a denial.
#[tokio::test]
async fn a_timed_out_check_says_it_was_denied() {
    let app = spawn_with(|s| {
        s.test_writer_delay_ms = Some(1_500);
        s.request_timeout = Duration::from_millis(300);
    })
    .await;
    // Set up behind the API: through the writer it would time out too.
    app.sql_behind("INSERT INTO budgets VALUES ('slow', 5, 5, 7, 'UTC', '2000-01-01T00:00:00Z')")
        .await;
    let r = post_check(&app, "slow", json!({"visitor": "A"})).await;
    let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(p["type"], "/problems/timeout", "{p}");
    assert_eq!(p["allowed"], false, "{p}");
    // Other writes that time out are not checks.
    let r = app
        .client
        .post(app.url("/counters/slow"))
        .send()
        .await
        .unwrap();
    let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(p["type"], "/problems/timeout");
    assert!(p.get("allowed").is_none(), "{p}");
    app.stop().await.unwrap();
}

/// The real binary writing text logs to a pipe, its stderr collected.
struct TextLogs {
    child: Child,
    addr: String,
    lines: Arc<Mutex<Vec<String>>>,
    readers: Readers,
    _dir: tempfile::TempDir,
}

impl TextLogs {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_tally"))
            .env_clear()
            .env("TALLY_LISTEN", "127.0.0.1:0")
            .env("TALLY_DATABASE", dir.path().join("tally.db"))
            .env("TALLY_LOG_FORMAT", "text")
            .env("TALLY_LOG", "info,tally::request=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tally binary starts");
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = Arc::clone(&lines);
        let readers = Readers::default();
        readers.read_lines(stderr, move |line| {
            // `... serving addr=127.0.0.1:PORT`, colours or not.
            if line.contains("serving")
                && let Some(at) = line.find("127.0.0.1:")
            {
                let addr: String = line[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                    .collect();
                sink.lock().unwrap().push(line);
                let _ = tx.send(addr);
            } else {
                sink.lock().unwrap().push(line);
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("tally did not start: {:?}", lines.lock().unwrap()));
        TextLogs {
            child,
            addr,
            lines,
            readers,
            _dir: dir,
        }
    }

    /// Stops tally with SIGTERM and returns everything it logged.
    fn stop(mut self) -> String {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        for _ in 0..200 {
            if self.child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Every line tally wrote is read once its pipe ends.
        self.readers.all_read_blocking(Duration::from_secs(10));
        self.lines.lock().unwrap().join("\n")
    }
}

impl Drop for TextLogs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Text logs written to a pipe carry no colours, and a client's request id
/// cannot write into them anything but a safe id.
#[tokio::test]
async fn text_logs_to_a_pipe_are_plain_and_unforgeable() {
    let tally = TextLogs::start();
    let client = reqwest::Client::new();
    let url = format!("http://{}/counters/logged", tally.addr);
    for id in ["safe-id-123", "x}: tally::forged: ERROR forged line"] {
        let r = client
            .post(&url)
            .header("x-request-id", id)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    let logs = tally.stop();
    assert!(logs.contains("serving"), "{logs}");
    assert!(!logs.contains('\x1b'), "colours in a pipe:\n{logs:?}");
    assert!(logs.contains("request_id=safe-id-123"), "{logs}");
    assert!(!logs.contains("forged"), "{logs}");
}

/// Every API endpoint refuses a query parameter it does not take, and does
/// nothing: `POST /counters/c?by=5` must not quietly add 1.
#[tokio::test]
async fn parameters_an_endpoint_does_not_take_are_refused_and_nothing_runs() {
    let app = spawn_app().await;
    app.budget("b", 10, 10).await;
    let cases: [(Method, &str, Option<Value>); 8] = [
        (Method::POST, "/counter?by=5", None),
        (Method::GET, "/counter?x=1", None),
        (Method::POST, "/counters/c?by=5", Some(json!({"by": 1}))),
        (Method::GET, "/counters/c?fresh=1", None),
        (
            Method::PUT,
            "/budgets/b?visitor_limit=99",
            Some(json!({"visitor_limit": 1, "global_limit": 1})),
        ),
        (Method::GET, "/budgets/b?x=1", None),
        (
            Method::POST,
            "/budgets/b/check?visitor=v",
            Some(json!({"visitor": "v"})),
        ),
        (Method::POST, "/budgets/b/reset?visitor=v", Some(json!({}))),
    ];
    for (method, path, body) in cases {
        let mut req = app
            .client
            .request(method.clone(), app.url(path))
            .bearer_auth(ADMIN);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        let p = problem(r, StatusCode::BAD_REQUEST).await;
        assert_eq!(p["type"], "/problems/invalid-query", "{method} {path}: {p}");
        if path.contains("/check") {
            assert_eq!(p["allowed"], false, "{p}");
        }
    }
    // Nothing ran: no counter, the budget as it was, no usage.
    let v: Value = app.get("/counters/c").await.json().await.unwrap();
    assert_eq!(v["value"], 0);
    let v: Value = app.get("/counter").await.json().await.unwrap();
    assert_eq!(v["value"], 0);
    let b: Value = app.get("/budgets/b").await.json().await.unwrap();
    assert_eq!(b["visitor_limit"], 10);
    let u = app.usage("b", "").await;
    assert_eq!(u["global_calls"], 0, "{u}");
    app.stop().await.unwrap();
}
