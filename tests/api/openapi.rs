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
            // What the request frame answers on any route, before its
            // handler: each a real answer here, and documented.
            let url = app.url(&path.replace("{name}", "probe"));
            let m = Method::from_bytes(method.as_bytes()).unwrap();
            let long = format!("{url}?{}", "a".repeat(9000));
            let mut crowded = app.client.request(m.clone(), &url);
            for i in 0..70 {
                crowded = crowded.header(format!("x-{i}"), "v");
            }
            for (status, request) in [
                (414, app.client.request(m.clone(), long)),
                (431, crowded),
                (405, app.client.request(Method::PATCH, &url)),
            ] {
                let r = request.send().await.unwrap();
                assert_eq!(r.status().as_u16(), status, "{method} {path}");
                assert!(
                    responses.contains_key(&status.to_string()),
                    "{method} {path} answers {status} but documents none"
                );
            }
            assert!(responses.contains_key("400"), "{method} {path}: no 400");
            // The server knows the route: no 404 "no such route", no 405.
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

/// Answers at the edges of what the API takes fit the schemas the
/// document gives them: integer formats and bounds hold the largest
/// values the server stores and sends back (a generated client reads a
/// field by its `format`), and no answer is described as any JSON at all.
/// (schemathesis checks shapes, not formats, and seldom sends the edges.)
#[tokio::test]
async fn answers_at_the_edges_fit_the_document() {
    let app = spawn_app().await;
    let doc: Value = app.get("/openapi.json").await.json().await.unwrap();
    let max = u32::MAX;
    let put = app
        .client
        .put(app.url("/budgets/big"))
        .bearer_auth(ADMIN)
        .json(
            &serde_json::json!({"visitor_limit": max, "global_limit": max, "retention_days": 3650}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), StatusCode::OK);
    let answers = [
        ("put", "/budgets/{name}", put.json::<Value>().await.unwrap()),
        (
            "get",
            "/budgets/{name}",
            app.get("/budgets/big").await.json().await.unwrap(),
        ),
        (
            "get",
            "/budgets",
            app.get("/budgets").await.json().await.unwrap(),
        ),
        (
            "post",
            "/budgets/{name}/check",
            app.post_json("/budgets/big/check", serde_json::json!({"visitor": "v"}))
                .await
                .json()
                .await
                .unwrap(),
        ),
        (
            "post",
            "/counter",
            app.post_json("/counter", serde_json::json!({}))
                .await
                .json()
                .await
                .unwrap(),
        ),
        (
            "get",
            "/counter",
            app.get("/counter").await.json().await.unwrap(),
        ),
    ];
    for (method, path, answer) in answers {
        let schema = &doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]
            ["schema"];
        if let Err(e) = fits(&doc, schema, &answer, "") {
            panic!("{method} {path}: {e}\nanswer {answer}\nschema {schema}");
        }
    }
    app.stop().await.unwrap();
}

/// Whether `value` fits `schema` (references followed) in what a client
/// generated from it relies on: the schema says something, an object's
/// properties are there, integers fit their format and bounds.
fn fits(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(r) = schema["$ref"].as_str() {
        let name = r.trim_start_matches("#/components/schemas/");
        return fits(doc, &doc["components"]["schemas"][name], value, at);
    }
    if let Some(any) = schema["oneOf"].as_array().or(schema["anyOf"].as_array()) {
        return match any.iter().any(|s| fits(doc, s, value, at).is_ok()) {
            true => Ok(()),
            false => Err(format!("{at}: {value} fits none of {schema}")),
        };
    }
    if schema.as_object().is_some_and(|o| o.is_empty()) {
        return Err(format!("{at}: described as any JSON value ({{}})"));
    }
    match value {
        Value::Object(o) => {
            let props = schema["properties"]
                .as_object()
                .ok_or(format!("{at}: an object, described without properties"))?;
            for (k, v) in o {
                let s = props
                    .get(k)
                    .ok_or(format!("{at}.{k}: sent, not described"))?;
                fits(doc, s, v, &format!("{at}.{k}"))?;
            }
            Ok(())
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| fits(doc, &schema["items"], v, &format!("{at}[{i}]"))),
        Value::Number(n) if n.is_u64() || n.is_i64() => {
            let n = n.as_i128().unwrap();
            let (lo, hi) = match schema["format"].as_str() {
                Some("int32") => (i128::from(i32::MIN), i128::from(i32::MAX)),
                Some("int64") => (i128::from(i64::MIN), i128::from(i64::MAX)),
                _ => (i128::MIN, i128::MAX),
            };
            let lo = schema["minimum"].as_i64().map_or(lo, |m| lo.max(m.into()));
            let hi = schema["maximum"].as_i64().map_or(hi, |m| hi.min(m.into()));
            match (lo..=hi).contains(&n) {
                true => Ok(()),
                false => Err(format!("{at}: {n} outside {lo}..={hi} ({schema})")),
            }
        }
        _ => Ok(()),
    }
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
