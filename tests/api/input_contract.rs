//! What a hostile or careless client sends: days outside a budget's window,
//! host-dependent time zones, bytes that are not UTF-8, request ids that
//! could forge log lines, body-less posts with any content type, and a
//! check that runs out of time. Each answer is a problem, or the request is
//! served as the contract says, and nothing else changes.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

use jiff::{Timestamp, civil::Date, tz::TimeZone};
use reqwest::{StatusCode, header::HeaderValue};
use serde_json::{Value, json};
use sqlx::{ConnectOptions, sqlite::SqliteConnectOptions};

use crate::helpers::{ADMIN, TestApp, problem, spawn_app, spawn_with};

/// Today in `tz`, from the clock.
fn today_in(tz: &str) -> Date {
    Timestamp::now()
        .to_zoned_datetime(TimeZone::get(tz).unwrap())
        .date()
}

fn day(d: Date, plus: i64) -> String {
    d.checked_add(jiff::Span::new().days(plus))
        .unwrap()
        .to_string()
}

async fn post_check(app: &TestApp, budget: &str, body: Value) -> reqwest::Response {
    app.post_json(&format!("/budgets/{budget}/check"), body)
        .await
}

async fn reset(app: &TestApp, budget: &str, body: Value) -> reqwest::Response {
    app.client
        .post(app.url(&format!("/budgets/{budget}/reset")))
        .bearer_auth(ADMIN)
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// Every usage row of a budget, as (table, day, visitor, calls).
async fn rows(app: &TestApp, budget: &str) -> Vec<(String, String, String, i64)> {
    sqlx::query_as(
        "SELECT 'visitor', day, visitor, calls FROM budget_visitor_usage WHERE budget = ?1
         UNION ALL SELECT 'global', day, '', calls FROM budget_global_usage WHERE budget = ?1
         ORDER BY 1, 2, 3",
    )
    .bind(budget)
    .fetch_all(&app.peek().await)
    .await
    .unwrap()
}

/// Asserts a `/problems/day-outside-window` answer naming the window.
async fn outside_window(r: reqwest::Response, oldest: &str, today: &str) -> Value {
    let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert_eq!(p["type"], "/problems/day-outside-window", "{p}");
    assert_eq!(
        (p["oldest_day"].as_str(), p["today"].as_str()),
        (Some(oldest), Some(today))
    );
    p
}

/// The reproduction of issue 9, defect 1: a check naming a far-future day
/// used to prune from that day, deleting today's usage.
#[tokio::test]
async fn a_far_future_day_cannot_wipe_usage() {
    let app = spawn_app().await;
    let r = app
        .admin_put_budget(
            "lim",
            json!({"visitor_limit": 3, "global_limit": 1_000_000}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let mut reasons = Vec::new();
    for _ in 0..4 {
        let r = post_check(&app, "lim", json!({"visitor": "alice"})).await;
        assert_eq!(r.status(), StatusCode::OK);
        reasons.push(r.json::<Value>().await.unwrap()["reason"].clone());
    }
    assert_eq!(reasons, ["ok", "ok", "ok", "visitor_limit"]);
    let before = rows(&app, "lim").await;

    for far in ["2099-01-01", "9999-12-31"] {
        let r = post_check(&app, "lim", json!({"visitor": "mallory", "day": far})).await;
        let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert_eq!(p["allowed"], false, "{p}");
        assert_eq!(p["type"], "/problems/day-outside-window", "{p}");
    }
    // Nothing was counted or deleted.
    assert_eq!(rows(&app, "lim").await, before);
    let u = app.usage("lim", "visitor=alice").await;
    assert_eq!(
        (u["global_calls"].clone(), u["visitor_calls"].clone()),
        (json!(3), json!(4))
    );
    let r = post_check(&app, "lim", json!({"visitor": "alice"})).await;
    assert_eq!(r.json::<Value>().await.unwrap()["reason"], "visitor_limit");
    app.stop().await.unwrap();
}

/// Pruning counts back from the budget's real today, whatever day the
/// check names: a check on the oldest kept day keeps everything the window
/// holds and deletes what lies before it.
#[tokio::test]
async fn pruning_counts_back_from_the_real_today() {
    let app = spawn_app().await;
    let tz = "Pacific/Kiritimati";
    let mut conn = SqliteConnectOptions::new()
        .filename(&app.db_path)
        .connect()
        .await
        .unwrap();
    for attempt in 0.. {
        let name = format!("pr{attempt}");
        let r = app
            .admin_put_budget(
                &name,
                json!({"visitor_limit": 9, "global_limit": 9, "retention_days": 2, "timezone": tz}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK);
        let today = today_in(tz);
        let [older, oldest, yesterday, now] = [-3, -2, -1, 0].map(|d| day(today, d));
        // Rows as earlier days' calls left them, written behind the API.
        for d in [&older, &yesterday, &now] {
            sqlx::query(
                "INSERT INTO budget_visitor_usage VALUES (?1, ?2, 'A', 1);
                 INSERT INTO budget_global_usage VALUES (?1, ?2, 1);",
            )
            .bind(&name)
            .bind(d)
            .execute(&mut conn)
            .await
            .unwrap();
        }
        // The first call of the oldest kept day prunes.
        let r = post_check(&app, &name, json!({"visitor": "B", "day": oldest})).await;
        assert_eq!(r.status(), StatusCode::OK);
        if today_in(tz) != today && attempt == 0 {
            continue; // midnight passed in the budget's zone: once more
        }
        let days: Vec<String> = rows(&app, &name)
            .await
            .into_iter()
            .filter(|r| r.0 == "global")
            .map(|r| r.1)
            .collect();
        assert_eq!(days, [oldest, yesterday, now]);
        break;
    }
    app.stop().await.unwrap();
}

/// Check, usage and reset take only days the budget keeps: today in its own
/// time zone and the `retention_days` days before it.
#[tokio::test]
async fn days_outside_the_window_are_refused_in_the_budget_time_zone() {
    let app = spawn_app().await;
    // +14 h and -11 h: their todays are always different dates, and differ
    // from UTC's for part of every day.
    for tz in ["Pacific/Kiritimati", "Pacific/Pago_Pago", "UTC"] {
        for attempt in 0.. {
            let name = format!("{}-{attempt}", tz.replace('/', "-"));
            let r = app
                .admin_put_budget(
                    &name,
                    json!({"visitor_limit": 100, "global_limit": 100, "retention_days": 3, "timezone": tz}),
                )
                .await;
            assert_eq!(r.status(), StatusCode::OK);
            let today = today_in(tz);
            let (oldest, last) = (day(today, -3), day(today, 0));
            let mut answers = Vec::new();
            for (offset, kept) in [(1, false), (0, true), (-3, true), (-4, false)] {
                let d = day(today, offset);
                let r = post_check(&app, &name, json!({"visitor": "A", "day": d})).await;
                answers.push((offset, kept, r));
            }
            let u_future = app
                .get(&format!("/budgets/{name}/usage?day={}", day(today, 1)))
                .await;
            let u_old = app
                .get(&format!("/budgets/{name}/usage?day={}", day(today, -4)))
                .await;
            let u_oldest = app
                .get(&format!("/budgets/{name}/usage?day={oldest}"))
                .await;
            let before_reset = rows(&app, &name).await;
            let r_future = reset(&app, &name, json!({"day": day(today, 1)})).await;
            let r_old = reset(&app, &name, json!({"day": day(today, -4)})).await;
            let after_reset = rows(&app, &name).await;
            if today_in(tz) != today && attempt == 0 {
                continue; // midnight passed in the budget's zone: once more
            }
            for (offset, kept, r) in answers {
                if kept {
                    assert_eq!(r.status(), StatusCode::OK, "{tz} today{offset:+}");
                    let d: Value = r.json().await.unwrap();
                    assert_eq!(d["day"], day(today, offset));
                } else {
                    let p = outside_window(r, &oldest, &last).await;
                    assert_eq!(p["allowed"], false, "{tz} today{offset:+}");
                }
            }
            outside_window(u_future, &oldest, &last).await;
            outside_window(u_old, &oldest, &last).await;
            let u: Value = u_oldest.json().await.unwrap();
            assert_eq!(u["global_calls"], 1, "{tz}");
            outside_window(r_future, &oldest, &last).await;
            outside_window(r_old, &oldest, &last).await;
            // The refused resets deleted nothing; the refused checks wrote
            // nothing: only today and the oldest day hold rows.
            assert_eq!(before_reset, after_reset);
            let days: Vec<&str> = after_reset.iter().map(|r| r.1.as_str()).collect();
            assert_eq!(days, [&oldest, &last, &oldest, &last], "{tz}");
            break;
        }
    }
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

/// A `POST` without a body is valid where the body is optional, whatever
/// its `Content-Type`; a body that is there must still be JSON.
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
    let v: Value = app.get("/counters/empty").await.json().await.unwrap();
    assert_eq!(v["value"], types.len() + 1);
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
            .env("TALLY_LOG", "info,tower_http=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tally binary starts");
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                // `... serving addr=127.0.0.1:PORT`, colours or not.
                if line.contains("serving")
                    && let Some(at) = line.find("127.0.0.1:")
                {
                    let addr: String = line[at..]
                        .chars()
                        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                        .collect();
                    let _ = tx.send(addr);
                }
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
        // The reader thread sees the pipe close once tally has exited.
        std::thread::sleep(Duration::from_millis(100));
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
