//! The budgets' tests that read and write usage rows behind the API, in
//! SQLite's SQL: the first call of a day prunes what lies past the
//! budget's retention, counted from the real today.

use reqwest::StatusCode;
use serde_json::json;

use crate::{
    budgets::today_in,
    helpers::{TestApp, problem, spawn_app},
    input_contract::clear_of_midnight,
};

async fn days_in_db(app: &TestApp) -> (Vec<String>, Vec<String>) {
    let pool = &app.peek().await;
    let global: Vec<String> =
        sqlx::query_scalar("SELECT day FROM budget_global_usage WHERE budget = 'p' ORDER BY day")
            .fetch_all(pool)
            .await
            .unwrap();
    let visitor: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT day FROM budget_visitor_usage WHERE budget = 'p' ORDER BY day",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    (global, visitor)
}

/// Writes usage of budget `p` on `days` behind the API, as earlier days'
/// calls would have left it (visitors `A` and `B`, so 2 global calls),
/// once the writer is done with what it does after a batch: a `PUT` makes
/// its budget due, and the writer's share after it (which runs before the
/// writer takes its next batch) would otherwise prune rows written
/// meanwhile. A write answered after it is the sign.
async fn usage_behind(app: &TestApp, days: &[&str]) {
    use sqlx::ConnectOptions;
    let r = app
        .post_json("/counters/after-the-writers-share", json!({}))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&app.db_path)
        .connect()
        .await
        .unwrap();
    for day in days {
        sqlx::query(
            "INSERT INTO budget_visitor_usage VALUES ('p', ?1, 'A', 1), ('p', ?1, 'B', 1);
             INSERT INTO budget_global_usage VALUES ('p', ?1, 2);",
        )
        .bind(day)
        .execute(&mut conn)
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn first_call_of_a_day_prunes_usage_past_retention() {
    clear_of_midnight("UTC").await;
    let app = spawn_app().await;
    app.budget("p", 100, 100).await;
    // Kiritimati, UTC+14, would show whether the prune counted in the
    // budget's zone; UTC keeps the arithmetic plain. Older days from the
    // real today back, written behind the API: a check may not name them.
    let d = |plus: i64| today_in("UTC", plus);
    let (t9, t8, t7, t1, t0) = (d(-9), d(-8), d(-7), d(-1), d(0));
    usage_behind(&app, &[&t9, &t8, &t7, &t1]).await;
    let all = [&t9, &t8, &t7, &t1].map(|s| s.to_string());
    assert_eq!(days_in_db(&app).await, (all.to_vec(), all.to_vec()));

    // Today minus 7 days is kept; older days go. The cutoff counts from
    // the real today, whatever day the first call names.
    let d0 = app.check("p", "A", &t0).await;
    assert_eq!(d0["global_calls"], 1);
    let kept = [&t7, &t1, &t0].map(|s| s.to_string());
    assert_eq!(days_in_db(&app).await, (kept.to_vec(), kept.to_vec()));

    // The oldest kept day still reads; a pruned day is outside the window.
    let u = app.usage("p", &format!("day={t7}&visitor=A")).await;
    assert_eq!(u, json!({"day": t7, "global_calls": 2, "visitor_calls": 1}));
    let r = app.get(&format!("/budgets/p/usage?day={t8}")).await;
    let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert_eq!(p["type"], "/problems/day-outside-window");

    // Only the first call of a day prunes: usage left behind on an old day
    // afterwards survives the second call of today.
    usage_behind(&app, &[&t9]).await;
    app.check("p", "B", &t0).await;
    let with_old = [&t9, &t7, &t1, &t0].map(|s| s.to_string());
    assert_eq!(
        days_in_db(&app).await,
        (with_old.to_vec(), with_old.to_vec())
    );
    app.stop().await.unwrap();
}

#[tokio::test]
async fn retention_is_per_budget() {
    clear_of_midnight("UTC").await;
    let app = spawn_app().await;
    let r = app
        .admin_put_budget(
            "p",
            json!({"visitor_limit": 9, "global_limit": 9, "retention_days": 1}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let d = |plus: i64| today_in("UTC", plus);
    usage_behind(&app, &[&d(-2), &d(-1)]).await;
    app.check("p", "A", &d(0)).await;
    let kept = [d(-1), d(0)];
    assert_eq!(days_in_db(&app).await.0, kept.to_vec());
    app.stop().await.unwrap();
}

/// A budget whose visitor limit is 0 denies every call before the global
/// counter: its calls still prune the days it no longer keeps (a visitor's
/// first call of the day does), or its visitors' rows would pile up a day
/// at a time for as long as it is checked.
#[tokio::test]
async fn a_budget_that_admits_no_one_prunes_too() {
    clear_of_midnight("UTC").await;
    let app = spawn_app().await;
    let r = app
        .admin_put_budget(
            "p",
            json!({"visitor_limit": 0, "global_limit": 9, "retention_days": 1}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let d = |plus: i64| today_in("UTC", plus);
    usage_behind(&app, &[&d(-3), &d(-2), &d(-1)]).await;
    let decision = app.check("p", "A", &d(0)).await;
    assert_eq!(decision["allowed"], false);
    assert_eq!(decision["reason"], "visitor_limit");
    assert_eq!(
        days_in_db(&app).await,
        (vec![d(-1)], vec![d(-1), d(0)]),
        "(global days, visitor days)"
    );
    app.stop().await.unwrap();
}

/// A budget row tally cannot read back (edited by hand past the table's
/// checks: a retention of more days than a date can reach back, a time
/// zone tally does not know, a limit no `u32` holds) is the database's
/// inconsistency: its checks are denied (`503 meter_error`, with no
/// `Retry-After`: waiting mends nothing), tally goes on
/// serving every other budget, and a `PUT` replaces the row. A retention
/// past what a date span holds once made every check, reset and `PUT` of
/// the budget kill the writer, and tally with it, again after each start.
#[tokio::test]
async fn a_budget_row_tally_cannot_read_denies_its_checks_and_a_put_replaces_it() {
    use sqlx::ConnectOptions;
    let app = spawn_app().await;
    app.budget("fine", 5, 5).await;
    let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&app.db_path)
        .connect()
        .await
        .unwrap();
    let rows = [
        ("far", "retention_days = 7304485"),
        ("huge", "retention_days = 4294967295"),
        ("mars", "timezone = 'Mars/Olympus'"),
        ("negative", "global_limit = -1"),
    ];
    for (name, set) in rows {
        app.budget(name, 5, 5).await;
        let edit = format!(
            "PRAGMA ignore_check_constraints = ON; UPDATE budgets SET {set} WHERE name = '{name}'"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(edit))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    for (name, _) in rows {
        let path = format!("/budgets/{name}/check");
        let r = app.post_json(&path, json!({"visitor": "v"})).await;
        // No wait mends the row: a client told to retry would loop.
        let retry_after = r.headers().get("retry-after").cloned();
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(
            (&p["allowed"], &p["reason"]),
            (&json!(false), &json!("meter_error")),
            "{name}: {p}"
        );
        assert_eq!(retry_after, None, "{name}");
        let r = app.get(&format!("/budgets/{name}/usage")).await;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR, "{name}");
        // The rest goes on.
        app.check("fine", "v", &today_in("UTC", 0)).await;
    }
    for (name, _) in rows {
        app.budget(name, 5, 5).await;
        let d = app.check(name, "v", &today_in("UTC", 0)).await;
        assert_eq!(d["allowed"], true, "{name}: {d}");
    }
    app.stop().await.unwrap();
}
