//! `DELETE /budgets/{name}` and `DELETE /counters/{name}`: admin writes
//! through the queue, with their idempotency keys, and in queue order with
//! the checks and increments of the same name.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{ADMIN, TestApp, problem, spawn_app, spawn_with, wait_for_queue_depth};

async fn delete(app: &TestApp, path: &str, key: Option<&str>) -> Response {
    let mut rb = app.client.delete(app.url(path)).bearer_auth(ADMIN);
    if let Some(k) = key {
        rb = rb.header("idempotency-key", k);
    }
    rb.send().await.unwrap()
}

/// A 204 with no body.
async fn no_content(r: Response) -> reqwest::header::HeaderMap {
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let headers = r.headers().clone();
    assert!(r.bytes().await.unwrap().is_empty());
    headers
}

async fn check_status(app: &TestApp, budget: &str, visitor: &str) -> (StatusCode, Value) {
    let r = app
        .post_json(
            &format!("/budgets/{budget}/check"),
            json!({"visitor": visitor}),
        )
        .await;
    (r.status(), r.json().await.unwrap())
}

#[tokio::test]
async fn a_deleted_budget_is_gone_with_its_usage() {
    let app = spawn_app().await;
    app.budget("b", 10, 100).await;
    // Its name is a prefix of another's, whose usage must stay.
    app.budget("bb", 10, 100).await;
    for v in ["x", "y", "y"] {
        assert_eq!(check_status(&app, "b", v).await.0, StatusCode::OK);
    }
    assert_eq!(check_status(&app, "bb", "x").await.0, StatusCode::OK);
    no_content(delete(&app, "/budgets/b", None).await).await;

    let body = problem(app.get("/budgets/b").await, StatusCode::NOT_FOUND).await;
    assert_eq!(body["budget"], "b");
    let (status, body) = check_status(&app, "b", "x").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["allowed"], false);
    problem(app.get("/budgets/b/usage").await, StatusCode::NOT_FOUND).await;
    let (names, _) = list(&app, "/budgets").await;
    assert_eq!(names, ["bb"]);
    // Deleted once: a second delete finds nothing.
    let body = problem(
        delete(&app, "/budgets/b", None).await,
        StatusCode::NOT_FOUND,
    )
    .await;
    assert_eq!(body["type"], "/problems/not-found");
    assert_eq!(body["budget"], "b");
    // Created again, it starts with no usage; the other kept its own.
    app.budget("b", 10, 100).await;
    let usage = app.usage("b", "visitor=y").await;
    assert_eq!(
        (
            usage["global_calls"].as_i64(),
            usage["visitor_calls"].as_i64()
        ),
        (Some(0), Some(0))
    );
    let (_, d) = check_status(&app, "b", "y").await;
    assert_eq!(
        (d["visitor_calls"].as_i64(), d["global_calls"].as_i64()),
        (Some(1), Some(1))
    );
    assert_eq!(app.usage("bb", "").await["global_calls"], 1);
    // Never created: 404.
    problem(
        delete(&app, "/budgets/never", None).await,
        StatusCode::NOT_FOUND,
    )
    .await;
    app.stop().await.unwrap();
}

async fn list(app: &TestApp, path: &str) -> (Vec<String>, Value) {
    let body: Value = app.get(path).await.json().await.unwrap();
    let field = &path[1..];
    let names = body[field]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_owned())
        .collect();
    (names, body)
}

#[tokio::test]
async fn a_deleted_counter_starts_again_from_zero() {
    let app = spawn_app().await;
    app.post_json("/counters/c", json!({"by": 5})).await;
    app.post_json("/counters/cc", json!({"by": 7})).await;
    no_content(delete(&app, "/counters/c", None).await).await;
    let v: Value = app.get("/counters/c").await.json().await.unwrap();
    assert_eq!(v["value"], 0);
    assert_eq!(list(&app, "/counters").await.0, ["cc"]);
    let body = problem(
        delete(&app, "/counters/c", None).await,
        StatusCode::NOT_FOUND,
    )
    .await;
    assert_eq!(body["type"], "/problems/not-found");
    assert_eq!(body["counter"], "c");
    // Never written: nothing to delete, though it reads as 0.
    problem(
        delete(&app, "/counters/never", None).await,
        StatusCode::NOT_FOUND,
    )
    .await;
    let r = app.post_json("/counters/c", json!({"by": 2})).await;
    assert_eq!(r.json::<Value>().await.unwrap()["value"], 2);
    let v: Value = app.get("/counters/cc").await.json().await.unwrap();
    assert_eq!(v["value"], 7);
    // The default counter is a counter like the others.
    app.post_json("/counter", json!({})).await;
    no_content(delete(&app, "/counters/default", None).await).await;
    let v: Value = app.get("/counter").await.json().await.unwrap();
    assert_eq!(v["value"], 0);
    // A bad name is refused before anything is looked up.
    let body = problem(
        delete(&app, "/counters/a*b", None).await,
        StatusCode::BAD_REQUEST,
    )
    .await;
    assert_eq!(body["type"], "/problems/invalid-input");
    app.stop().await.unwrap();
}

#[tokio::test]
async fn deletes_need_the_admin_token() {
    let app = spawn_app().await;
    app.budget("b", 1, 1).await;
    app.post_json("/counters/c", json!({})).await;
    for path in ["/budgets/b", "/counters/c"] {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("Basic dGVzdA=="),
            Some(ADMIN),
        ] {
            let mut rb = app.client.delete(app.url(path));
            if let Some(a) = auth {
                rb = rb.header("authorization", a);
            }
            let r = rb.send().await.unwrap();
            assert!(
                r.headers().contains_key("www-authenticate"),
                "{path} {auth:?}"
            );
            let body = problem(r, StatusCode::UNAUTHORIZED).await;
            assert_eq!(body["type"], "/problems/unauthorized");
        }
    }
    // Nothing was deleted.
    assert_eq!(app.get("/budgets/b").await.status(), StatusCode::OK);
    assert_eq!(list(&app, "/counters").await.0, ["c"]);
    app.stop().await.unwrap();

    let app = spawn_with(|s| s.admin_token = None).await;
    for path in ["/budgets/b", "/counters/c"] {
        let r = app
            .client
            .delete(app.url(path))
            .bearer_auth("anything")
            .send()
            .await
            .unwrap();
        let body = problem(r, StatusCode::FORBIDDEN).await;
        assert_eq!(body["type"], "/problems/admin-disabled");
    }
    app.stop().await.unwrap();
}

#[tokio::test]
async fn a_retried_delete_replays_its_204() {
    let app = spawn_app().await;
    app.budget("b", 1, 1).await;
    app.post_json("/counters/c", json!({})).await;
    for (path, key) in [("/budgets/b", "del-b"), ("/counters/c", "del-c")] {
        let h = no_content(delete(&app, path, Some(key)).await).await;
        assert!(!h.contains_key("idempotent-replayed"));
        for _ in 0..2 {
            let h = no_content(delete(&app, path, Some(key)).await).await;
            assert_eq!(h["idempotent-replayed"], "true", "{path}");
        }
        // Without the key it is a new request, and finds nothing.
        problem(delete(&app, path, None).await, StatusCode::NOT_FOUND).await;
    }
    // The same key for another request is refused, whatever that is.
    app.budget("other", 1, 1).await;
    for (path, key) in [
        ("/counters/b", "del-b"),
        ("/budgets/other", "del-b"),
        ("/budgets/b", "del-c"),
    ] {
        let body = problem(
            delete(&app, path, Some(key)).await,
            StatusCode::UNPROCESSABLE_ENTITY,
        )
        .await;
        assert_eq!(body["type"], "/problems/idempotency-key-reused", "{path}");
    }
    let r = app
        .client
        .post(app.url("/counters/b"))
        .header("idempotency-key", "del-b")
        .send()
        .await
        .unwrap();
    problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert_eq!(app.get("/budgets/other").await.status(), StatusCode::OK);
    // A delete that found nothing stored nothing for its key: its retry,
    // once there is something, deletes it.
    problem(
        delete(&app, "/counters/later", Some("del-later")).await,
        StatusCode::NOT_FOUND,
    )
    .await;
    app.post_json("/counters/later", json!({})).await;
    let h = no_content(delete(&app, "/counters/later", Some("del-later")).await).await;
    assert!(!h.contains_key("idempotent-replayed"));
    // A malformed key is refused, and nothing is deleted.
    app.post_json("/counters/kept", json!({})).await;
    let r = app
        .client
        .delete(app.url("/counters/kept"))
        .bearer_auth(ADMIN)
        .header("idempotency-key", "bad key")
        .send()
        .await
        .unwrap();
    problem(r, StatusCode::BAD_REQUEST).await;
    let v: Value = app.get("/counters/kept").await.json().await.unwrap();
    assert_eq!(v["value"], 1);
    app.stop().await.unwrap();
}

/// A check and a delete of its budget in one batch, in either order, and
/// an increment and a delete of its counter: each answered as queue order
/// says. A plug write holds the writer while the rest queue up behind it,
/// in a known order, to be taken as one batch.
#[tokio::test]
async fn in_one_batch_a_delete_keeps_queue_order() {
    // Held long enough for every request below to queue, one at a time.
    let app = Arc::new(spawn_with(|s| s.test_writer_delay_ms = Some(1500)).await);
    app.budget("b", 100, 100).await;
    app.post_json("/counters/c", json!({"by": 5})).await;
    let base = format!("http://{}", app.addr);
    let held = app.db.batches_held();
    let plug = {
        let app = Arc::clone(&app);
        tokio::spawn(async move { app.post_json("/counters/plug", json!({})).await.status() })
    };
    // The writer has taken the plug and sleeps: the queue is empty.
    app.writer_holds(held + 1).await;
    let mut answers = Vec::new();
    let requests: Vec<(&str, &str)> = vec![
        ("check", "b"),
        ("delete", "/budgets/b"),
        ("check", "b"),
        ("increment", "c"),
        ("delete", "/counters/c"),
        ("increment", "c"),
    ];
    for (depth, (what, target)) in requests.into_iter().enumerate() {
        let client = Arc::clone(&app);
        answers.push(tokio::spawn(async move {
            let app = client;
            match what {
                "check" => {
                    let (s, body) = check_status(&app, target, "v").await;
                    (s, body["global_calls"].as_i64().or(body["value"].as_i64()))
                }
                "delete" => (delete(&app, target, None).await.status(), None),
                _ => {
                    let r = app
                        .post_json(&format!("/counters/{target}"), json!({}))
                        .await;
                    let s = r.status();
                    (s, r.json::<Value>().await.unwrap()["value"].as_i64())
                }
            }
        }));
        wait_for_queue_depth(&app.client, &base, depth as u64 + 1).await;
    }
    assert_eq!(plug.await.unwrap(), StatusCode::OK);
    let mut got = Vec::new();
    for a in answers {
        got.push(a.await.unwrap());
    }
    assert_eq!(
        got,
        [
            (StatusCode::OK, Some(1)),
            (StatusCode::NO_CONTENT, None),
            (StatusCode::NOT_FOUND, None),
            (StatusCode::OK, Some(6)),
            (StatusCode::NO_CONTENT, None),
            (StatusCode::OK, Some(1)),
        ]
    );
    // The call counted before the delete went with it.
    app.budget("b", 100, 100).await;
    assert_eq!(app.usage("b", "visitor=v").await["global_calls"], 0);
    Arc::into_inner(app).unwrap().stop().await.unwrap();
}

/// Many clients check a budget while it is deleted: every check sent
/// after the delete's 204 arrived is a 404, no check is answered anything
/// but a decision or a 404, and the budget created again holds none of the
/// calls, however the checks and the delete fell into batches (one by one,
/// and gathered by a slow writer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_racing_a_delete_are_counted_before_it_or_refused() {
    for delay in [None, Some(2)] {
        let app = Arc::new(spawn_with(|s| s.test_writer_delay_ms = delay).await);
        for round in 0..3 {
            race_once(&app, round).await;
        }
        Arc::into_inner(app).unwrap().stop().await.unwrap();
    }
}

async fn race_once(app: &Arc<TestApp>, round: usize) {
    app.budget("r", 1_000_000, 1_000_000).await;
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..12)
        .map(|i| {
            let (app, stop) = (Arc::clone(app), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let (status, body) = check_status(&app, "r", &format!("v{i}")).await;
                    seen.push((sent, status, body));
                }
                seen
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(60)).await;
    let r = delete(app, "/budgets/r", None).await;
    let deleted_at = Instant::now();
    assert_eq!(r.status(), StatusCode::NO_CONTENT, "round {round}");
    tokio::time::sleep(Duration::from_millis(60)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut counted, mut refused_after) = (0, 0);
    for c in clients {
        for (sent, status, body) in c.await.unwrap() {
            match status {
                StatusCode::OK => {
                    assert!(sent < deleted_at, "a check sent after the 204 was counted");
                    assert_eq!(body["allowed"], true);
                    counted += 1;
                }
                StatusCode::NOT_FOUND => {
                    assert_eq!(body["allowed"], false);
                    assert_eq!(body["budget"], "r");
                    if sent > deleted_at {
                        refused_after += 1;
                    }
                }
                other => panic!("round {round}: a check answered {other}: {body}"),
            }
        }
    }
    assert!(
        counted > 0 && refused_after > 0,
        "{counted} counted, {refused_after} refused"
    );
    // Created again, with none of the calls counted before the delete.
    app.budget("r", 1_000_000, 1_000_000).await;
    for i in 0..12 {
        let u = app.usage("r", &format!("visitor=v{i}")).await;
        assert_eq!(
            (u["global_calls"].as_i64(), u["visitor_calls"].as_i64()),
            (Some(0), Some(0))
        );
    }
    no_content(delete(app, "/budgets/r", None).await).await;
}

/// A delete takes no query parameters: one that comes with any is refused
/// and deletes nothing, rather than being read as a plain delete
/// (`?dry_run=true`, a list's `?prefix=` sent to the wrong path).
#[tokio::test]
async fn a_delete_with_query_parameters_is_refused_and_deletes_nothing() {
    let app = spawn_app().await;
    app.budget("b", 10, 100).await;
    let r = app.post_json("/counters/c", json!({})).await;
    assert_eq!(r.status(), StatusCode::OK);
    for path in ["/budgets/b", "/counters/c"] {
        for q in ["dry_run=true", "prefix=b", "x", "a=1&a=2"] {
            let r = delete(&app, &format!("{path}?{q}"), Some("with-a-query")).await;
            let body = problem(r, StatusCode::BAD_REQUEST).await;
            assert_eq!(
                body["type"], "/problems/invalid-query",
                "{path}?{q}: {body}"
            );
        }
        assert_eq!(app.get(path).await.status(), StatusCode::OK, "{path}");
        // An empty query is no parameter.
        no_content(delete(&app, &format!("{path}?"), None).await).await;
    }
    app.stop().await.unwrap();
}

/// A delete takes no body: one that asks for something narrower (a day, a
/// visitor) is refused and deletes nothing, instead of deleting the whole
/// budget; a body that is not JSON is `415`. No body, blank, `null` or
/// `{}` is a plain delete.
#[tokio::test]
async fn a_delete_with_a_body_is_refused_and_deletes_nothing() {
    let app = spawn_app().await;
    for name in ["b", "b2", "b3", "b4"] {
        app.budget(name, 10, 100).await;
    }
    let send = |path: &str, body: &'static str, json: bool| {
        let mut rb = app
            .client
            .delete(app.url(path))
            .bearer_auth(ADMIN)
            .body(body);
        if json {
            rb = rb.header("content-type", "application/json");
        }
        rb.send()
    };
    let r = send("/budgets/b", r#"{"day": "2026-11-30"}"#, true)
        .await
        .unwrap();
    let body = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert_eq!(body["type"], "/problems/invalid-body", "{body}");
    let r = send("/budgets/b", r#"{"visitor": "v"}"#, true)
        .await
        .unwrap();
    problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    let r = send("/budgets/b", "visitor=v", false).await.unwrap();
    problem(r, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
    assert_eq!(app.get("/budgets/b").await.status(), StatusCode::OK);
    no_content(send("/budgets/b", "", false).await.unwrap()).await;
    no_content(send("/budgets/b2", " ", true).await.unwrap()).await;
    no_content(send("/budgets/b3", "null", true).await.unwrap()).await;
    no_content(send("/budgets/b4", "{}", true).await.unwrap()).await;
    app.stop().await.unwrap();
}
