//! The input contract's tests that look at the usage rows behind the API,
//! in SQLite's SQL: a day outside a budget's window, in its own time zone,
//! is refused and changes no row, and pruning counts back from the real
//! today, whatever day a check names.

use jiff::civil::Date;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::{ConnectOptions, sqlite::SqliteConnectOptions};

use crate::{
    helpers::{ADMIN, TestApp, problem, spawn_app},
    input_contract::{clear_of_midnight, post_check, today_in},
};

fn day(d: Date, plus: i64) -> String {
    d.checked_add(jiff::Span::new().days(plus))
        .unwrap()
        .to_string()
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
    clear_of_midnight(tz).await;
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
