//! /metrics after real traffic: a valid exposition (promtool finds nothing
//! to lint) whose numbers moved the way the traffic says. A test binary of
//! its own, because the metrics recorder is process-wide.

use std::{collections::HashMap, io::Write, path::Path, process::Stdio, time::Duration};

use reqwest::{Client, StatusCode};
use serde_json::json;
use tally::{Application, Settings};

fn promtool() -> std::path::PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/prometheus/usr/bin/promtool");
    assert!(p.exists(), "{} is missing: run ./scripts/test", p.display());
    p
}

/// Samples of the exposition, keyed by `name{labels}` as printed.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_valid_and_move_with_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Settings::for_database(dir.path().join("m.db"));
    s.listen = "127.0.0.1:0".parse().unwrap();
    s.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    s.admin_token = Some("t".into());
    s.queue_capacity = 2;
    s.max_batch = 1;
    s.test_writer_delay_ms = Some(30);
    let app = Application::build(s).await.unwrap();
    let (api, metrics_addr) = (app.local_addr(), app.metrics_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(app.run_until_stopped(async {
        let _ = stopped.await;
    }));
    let client = Client::new();
    let url = |p: &str| format!("http://{api}{p}");

    let scrape = async || {
        client
            .get(format!("http://{metrics_addr}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let put_m = async || {
        let r = client
            .put(url("/budgets/m"))
            .bearer_auth("t")
            .json(&json!({"visitor_limit": 1, "global_limit": 100}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    };

    // Before any traffic, every counter whose labels are known in advance
    // is already there at 0: an alert on its increase sees the first event.
    let fresh = samples(&scrape().await);
    for series in [
        "tally_write_rejected_total",
        "tally_write_refusal_pauses_total",
        "tally_write_outcome_unknown_total",
        r#"tally_write_commands_total{command="increment",result="storage_full"}"#,
        r#"tally_write_commands_total{command="check",result="database_error"}"#,
        r#"tally_write_commands_total{command="reset",result="not_committed"}"#,
        r#"tally_write_committed_caller_gone_total{command="check"}"#,
        r#"tally_budget_decisions_total{budget="",reason="meter_error"}"#,
        r#"tally_http_connections_refused_total{listener="api"}"#,
        r#"tally_http_header_timeouts_total{listener="metrics"}"#,
    ] {
        assert_eq!(fresh.get(series), Some(&0.0), "{series} at start");
    }

    put_m().await;
    // Concurrent writes into a 2-slot queue: some are refused.
    let mut tasks = Vec::new();
    for _ in 0..30 {
        let (c, u) = (client.clone(), url("/counters/m1"));
        tasks.push(tokio::spawn(async move {
            c.post(u).send().await.unwrap().status()
        }));
    }
    let mut by_status: HashMap<u16, u64> = HashMap::new();
    for t in tasks {
        *by_status.entry(t.await.unwrap().as_u16()).or_default() += 1;
    }
    let refused = by_status.get(&429).copied().unwrap_or(0);
    let written = by_status.get(&200).copied().unwrap_or(0);
    assert!(refused > 0 && written > 0, "{by_status:?}");
    // Three rows of a day long past retention, as its calls left them
    // (written behind the API: a check may name only a day the budget keeps).
    let today = jiff::Timestamp::now().in_tz("UTC").unwrap().date();
    let long_ago = today.checked_sub(jiff::Span::new().days(30)).unwrap();
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!(
        "sqlite://{}",
        dir.path().join("m.db").display()
    ))
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO budget_visitor_usage VALUES ('m', ?1, 'a', 2), ('m', ?1, 'b', 1);
         INSERT INTO budget_global_usage VALUES ('m', ?1, 2);",
    )
    .bind(long_ago.to_string())
    .execute(&mut conn)
    .await
    .unwrap();
    // The first call of today prunes them; yesterday's first call finds
    // nothing more to prune.
    let yesterday = today.yesterday().unwrap();
    for (v, day) in [("a", today), ("a", today), ("b", today), ("a", yesterday)] {
        let r = client
            .post(url("/budgets/m/check"))
            .json(&json!({"visitor": v, "day": day.to_string()}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
    assert_eq!(
        client
            .get(url("/no/such/path/123"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    // /metrics lives on its own listener.
    assert_eq!(
        client.get(url("/metrics")).send().await.unwrap().status(),
        404
    );

    let r = client
        .get(format!("http://{metrics_addr}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = r.text().await.unwrap();

    let mut lint = std::process::Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    lint.stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = lint.wait_with_output().unwrap();
    let findings = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && findings.trim().is_empty(),
        "promtool: {findings}\n{text}"
    );

    let m = samples(&text);
    let get = |k: &str| {
        m.get(k)
            .copied()
            .unwrap_or_else(|| panic!("no sample {k}\n{text}"))
    };
    assert_eq!(get("tally_write_rejected_total"), refused as f64);
    assert_eq!(
        get(r#"tally_http_requests_total{method="POST",route="/counters/{name}",status="429"}"#),
        refused as f64
    );
    assert_eq!(
        get(r#"tally_http_requests_total{method="POST",route="/counters/{name}",status="200"}"#),
        written as f64
    );
    assert_eq!(
        get(r#"tally_http_requests_total{method="GET",route="unmatched",status="404"}"#),
        2.0
    );
    assert!(!text.contains("/no/such/path"), "a raw path became a label");
    assert_eq!(
        get(r#"tally_write_commands_total{command="increment",result="ok"}"#),
        written as f64
    );
    assert_eq!(
        get(r#"tally_budget_decisions_total{budget="m",reason="ok"}"#),
        3.0
    );
    assert_eq!(
        get(r#"tally_budget_decisions_total{budget="m",reason="visitor_limit"}"#),
        1.0
    );
    assert_eq!(get("tally_budget_prunes_total"), 1.0);
    assert_eq!(get("tally_budget_pruned_rows_total"), 3.0);
    assert_eq!(get("tally_write_queue_capacity"), 2.0);
    assert_eq!(get("tally_write_queue_closed"), 0.0);
    assert_eq!(
        get(r#"tally_build_info{version="0.1.0",engine="sqlite"}"#),
        1.0
    );
    assert!(get("tally_start_time_seconds") > 1.7e9);
    assert!(get("tally_db_size_bytes") > 0.0);
    assert!(get("tally_commit_batch_size_count") >= written as f64);
    assert!(get("tally_commit_duration_seconds_count") >= 1.0);
    assert!(get("tally_write_wait_seconds_count") >= written as f64);
    assert!(text.contains(r#"tally_http_request_duration_seconds_bucket{method="POST",route="/counters/{name}",le="0.0001"}"#));
    assert!(
        !text.contains("quantile="),
        "histograms must have buckets, not summaries"
    );

    // A deleted budget's series go with it (the recorder would have kept
    // them for as long as the process runs: created and deleted budgets
    // grew /metrics without bound); created again, it counts from 0.
    let check_a = async || {
        client
            .post(url("/budgets/m/check"))
            .json(&json!({"visitor": "a"}))
            .send()
            .await
            .unwrap()
            .status()
    };
    let delete_m = async || {
        let r = client
            .delete(url("/budgets/m"))
            .bearer_auth("t")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
    };
    delete_m().await;
    let text = scrape().await;
    assert!(!text.contains(r#"budget="m""#), "{text}");
    assert!(text.contains(r#"tally_budget_decisions_total{budget="",reason="meter_error"} 0"#));
    put_m().await;
    assert_eq!(check_a().await, StatusCode::OK);
    let m = samples(&scrape().await);
    assert_eq!(
        m.get(r#"tally_budget_decisions_total{budget="m",reason="ok"}"#),
        Some(&1.0)
    );
    assert_eq!(
        m.get(r#"tally_budget_decisions_total{budget="m",reason="visitor_limit"}"#),
        None
    );
    // A keyed check replayed after its budget was deleted gets its stored
    // answer, and brings no series back (anyone could, for every budget
    // ever deleted).
    let keyed = async || {
        let r = client
            .post(url("/budgets/m/check"))
            .header("idempotency-key", "k-1")
            .json(&json!({"visitor": "b"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    };
    keyed().await;
    delete_m().await;
    keyed().await;
    let text = scrape().await;
    assert!(!text.contains(r#"budget="m""#), "{text}");
    put_m().await;
    assert_eq!(check_a().await, StatusCode::OK);
    // Deleted behind this process's back (as another process on the same
    // PostgreSQL would): gone from here at the first check that finds it
    // gone.
    sqlx::query("DELETE FROM budgets WHERE name = 'm'")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(check_a().await, StatusCode::NOT_FOUND);
    let text = scrape().await;
    assert!(!text.contains(r#"budget="m""#), "{text}");

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
