//! The OpenAPI document: complete, and what the server really does
//! (checked by schemathesis, a property-based API tester, against the
//! running server).

use std::{path::Path, time::Duration};

use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::helpers::{ADMIN, spawn_app};

/// Every route of the API, as docs/api.md documents it.
const ROUTES: &[(&str, &str)] = &[
    ("POST", "/counter"),
    ("GET", "/counter"),
    ("POST", "/counters/{name}"),
    ("GET", "/counters/{name}"),
    ("DELETE", "/counters/{name}"),
    ("GET", "/counters"),
    ("PUT", "/budgets/{name}"),
    ("GET", "/budgets/{name}"),
    ("DELETE", "/budgets/{name}"),
    ("GET", "/budgets"),
    ("POST", "/budgets/{name}/check"),
    ("GET", "/budgets/{name}/usage"),
    ("POST", "/budgets/{name}/reset"),
    ("GET", "/ready"),
    ("GET", "/livez"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
];

#[tokio::test]
async fn the_document_covers_every_route_and_only_real_ones() {
    let app = spawn_app().await;
    let doc: Value = app.get("/openapi.json").await.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let mut documented = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let method = method.to_uppercase();
            documented.push((method.clone(), path.clone()));
            let responses = op["responses"].as_object().unwrap();
            // A delete answers 204, no content; everything else a 200.
            let success = if method == "DELETE" { "204" } else { "200" };
            assert!(
                responses.contains_key(success),
                "{method} {path} documents no {success}"
            );
            // The server knows the route: no 404 "no such route", no 405.
            let url = app.url(&path.replace("{name}", "probe"));
            let r = app
                .client
                .request(Method::from_bytes(method.as_bytes()).unwrap(), url)
                .bearer_auth(ADMIN)
                .send()
                .await
                .unwrap();
            assert_ne!(
                r.status(),
                StatusCode::METHOD_NOT_ALLOWED,
                "{method} {path}"
            );
            if r.status() == StatusCode::NOT_FOUND {
                let body: Value = r.json().await.unwrap();
                assert_ne!(body["detail"], "no such route", "{method} {path}");
            }
        }
    }
    for (method, path) in ROUTES {
        assert!(
            documented.contains(&(method.to_string(), path.to_string())),
            "{method} {path} is served but not documented"
        );
    }
    assert_eq!(documented.len(), ROUTES.len(), "{documented:?}");
    // Operation ids are unique, as generated clients need.
    let mut ids: Vec<&str> = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|i| i.as_object().unwrap().values())
        .map(|op| op["operationId"].as_str().unwrap())
        .collect();
    ids.sort();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "duplicate operation ids");
    app.stop().await.unwrap();
}

/// Every operation that takes an `Idempotency-Key` says what a repeat of
/// it gets, and the server does that: a replay where the key is stored,
/// and where it is not (a budget's `PUT`) no promise of one. Each is sent
/// twice with one key, as a client retrying it would.
#[tokio::test]
async fn each_idempotency_key_does_what_the_document_says() {
    let app = spawn_app().await;
    let doc: Value = app.get("/openapi.json").await.json().await.unwrap();
    app.budget("b", 10, 10).await;
    app.post_json("/counters/gone", serde_json::json!({})).await;
    app.budget("gone", 1, 1).await;
    let bodies = [
        ("POST", "/counter", "{}"),
        ("POST", "/counters/{name}", r#"{"by":2}"#),
        ("POST", "/budgets/{name}/check", r#"{"visitor":"v"}"#),
        ("POST", "/budgets/{name}/reset", "{}"),
        (
            "PUT",
            "/budgets/{name}",
            r#"{"visitor_limit":3,"global_limit":9}"#,
        ),
        ("DELETE", "/counters/{name}", ""),
        ("DELETE", "/budgets/{name}", ""),
    ];
    let mut keyed = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let method = method.to_uppercase();
            let Some(param) = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == "Idempotency-Key")
            else {
                continue;
            };
            keyed += 1;
            let said = param["description"].as_str().unwrap();
            let promised = said.contains("Idempotent-Replayed: true");
            let &(_, _, body) = bodies
                .iter()
                .find(|(m, p, _)| *m == method && p == path)
                .unwrap_or_else(|| panic!("{method} {path} takes a key: give it a body here"));
            let name = if method == "DELETE" { "gone" } else { "b" };
            let url = app.url(&path.replace("{name}", name));
            let key = format!("k-{method}-{}", path.replace(['/', '{', '}'], "_"));
            let mut replayed = Vec::new();
            for _ in 0..2 {
                let mut r = app
                    .client
                    .request(Method::from_bytes(method.as_bytes()).unwrap(), &url)
                    .bearer_auth(ADMIN)
                    .header("idempotency-key", &key);
                if !body.is_empty() {
                    r = r.header("content-type", "application/json").body(body);
                }
                let r = r.send().await.unwrap();
                assert!(r.status().is_success(), "{method} {path}: {}", r.status());
                replayed.push(r.headers().contains_key("idempotent-replayed"));
            }
            assert_eq!(
                replayed,
                [false, promised],
                "{method} {path}: the document says {said:?}"
            );
        }
    }
    assert_eq!(keyed, bodies.len());
    app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_and_no_schema_violation() {
    let st = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/venv/bin/schemathesis");
    assert!(
        st.exists(),
        "{} is missing: run ./scripts/test",
        st.display()
    );
    let app = spawn_app().await;
    let url = app.url("/openapi.json");
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(st);
    cmd.args([
        "run",
        &url,
        "--checks",
        "not_a_server_error,response_schema_conformance,content_type_conformance",
        "--header",
        &format!("Authorization: Bearer {ADMIN}"),
        "--max-examples",
        "100",
        "--seed",
        "20261130",
        "--no-color",
        "--report-dir",
    ])
    .arg(dir.path())
    .env("SCHEMATHESIS_HOOKS", "")
    .current_dir(dir.path())
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(240), cmd.output())
        .await
        .expect("schemathesis finished within its bound")
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found problems:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Warnings may remain: generated retries that reuse an idempotency key
    // for another body are refused (422), as they must be.
    let summary = text.lines().last().unwrap_or_default();
    assert!(
        !summary.contains("fail") && !summary.contains("error"),
        "{text}"
    );
    app.stop().await.unwrap();
}
