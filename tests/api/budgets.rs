use std::{collections::HashSet, sync::LazyLock};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{
    ADMIN, Binary, behind, count_behind, database_in, problem, put_budget, sample, spawn_app,
};

/// The day these tests count on: today in UTC (their budgets' zone) when
/// first asked. A check may name only a day its budget keeps; should a test
/// run past midnight, this is yesterday, which it still keeps.
static DAY: LazyLock<String> = LazyLock::new(|| today_in("UTC", 0));

/// Today in `tz`, `plus` days on.
pub(crate) fn today_in(tz: &str, plus: i64) -> String {
    let today = jiff::Timestamp::now().in_tz(tz).unwrap().date();
    today
        .checked_add(jiff::Span::new().days(plus))
        .unwrap()
        .to_string()
}

/// (visitor limit, global limit, visitors in order, expected outcomes,
/// global counter afterwards). `.` allowed, `V` visitor_limit, `G` global_limit.
const SEED: &[(u32, u32, &str, &str, i64)] = &[
    (3, 100, "AAAA", "...V", 3),
    (3, 100, "AAAAA", "...VV", 3),
    (3, 100, "AAAAB", "...V.", 4),
    (10, 4, "ABCDE", "....G", 5),
    (10, 4, "ABCDEF", "....GG", 6),
    (1, 3, "AAAABC", ".VVV..", 3),
    (2, 3, "AAABC", "..V.G", 4),
    (0, 100, "A", "V", 0),
];

#[tokio::test]
async fn seed_table() {
    let app = spawn_app().await;
    for (i, (v, g, visitors, expected, global)) in SEED.iter().enumerate() {
        let budget = format!("seed-{i}");
        app.budget(&budget, *v, *g).await;
        let mut got = String::new();
        let mut per_visitor = std::collections::HashMap::new();
        for visitor in visitors.chars() {
            let d = app.check(&budget, &visitor.to_string(), &DAY).await;
            *per_visitor.entry(visitor).or_insert(0) += 1;
            got.push(match d["reason"].as_str().unwrap() {
                "ok" => '.',
                "visitor_limit" => 'V',
                "global_limit" => 'G',
                other => panic!("unexpected reason {other}"),
            });
            assert_eq!(d["allowed"], d["reason"] == "ok");
            assert_eq!(d["day"], *DAY);
            assert_eq!(d["visitor_limit"], *v);
            assert_eq!(d["global_limit"], *g);
            // Denied calls are counted too.
            assert_eq!(d["visitor_calls"], per_visitor[&visitor]);
        }
        assert_eq!(&got, expected, "case {i}: v={v} g={g} {visitors}");
        let u = app.usage(&budget, &format!("day={}", *DAY)).await;
        assert_eq!(u["global_calls"], *global, "case {i}: global counter");
    }
    app.stop().await.unwrap();
}

#[tokio::test]
async fn a_visitor_named_star_is_not_the_global_row() {
    let app = spawn_app().await;
    app.budget("star", 1, 100).await;
    for _ in 0..3 {
        app.check("star", "*", &DAY).await;
    }
    let u = app.usage("star", &format!("day={}&visitor=*", *DAY)).await;
    assert_eq!(
        u,
        json!({"day": *DAY, "global_calls": 1, "visitor_calls": 3})
    );
    // Another visitor is still allowed: the global row holds only 1.
    assert_eq!(app.check("star", "B", &DAY).await["reason"], "ok");
    app.stop().await.unwrap();
}

#[tokio::test]
async fn concurrent_checks_lose_no_global_count() {
    let app = spawn_app().await;
    app.budget("busy", 1_000_000, 1_000_000).await;
    let mut tasks = Vec::new();
    for c in 0..8 {
        let client = app.client.clone();
        let url = app.url("/budgets/busy/check");
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..500 {
                let r = client
                    .post(&url)
                    .json(&json!({"visitor": format!("v{c}"), "day": *DAY}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), StatusCode::OK);
                let d: Value = r.json().await.unwrap();
                assert_eq!(d["allowed"], true);
                seen.push(d["global_calls"].as_i64().unwrap());
            }
            seen
        }));
    }
    let mut all = HashSet::new();
    for t in tasks {
        for v in t.await.unwrap() {
            assert!(all.insert(v), "global count {v} answered twice");
        }
    }
    assert_eq!(all, (1..=4000).collect::<HashSet<i64>>());
    let u = app.usage("busy", &format!("day={}&visitor=v3", *DAY)).await;
    assert_eq!(u["global_calls"], 4000);
    assert_eq!(u["visitor_calls"], 500);
    app.stop().await.unwrap();
}

#[tokio::test]
async fn budget_config_round_trips() {
    let app = spawn_app().await;
    let r = app.get("/budgets/nope").await;
    problem(r, StatusCode::NOT_FOUND).await;
    let r = app
        .admin_put_budget(
            "cfg",
            json!({"visitor_limit": 0, "global_limit": 5, "retention_days": 30, "timezone": "America/New_York"}),
        )
        .await;
    let expected = json!({
        "name": "cfg", "visitor_limit": 0, "global_limit": 5,
        "retention_days": 30, "timezone": "America/New_York"
    });
    assert_eq!(r.json::<Value>().await.unwrap(), expected);
    assert_eq!(
        app.get("/budgets/cfg").await.json::<Value>().await.unwrap(),
        expected
    );
    // Defaults, and replacing keeps the name.
    let r = app
        .admin_put_budget("cfg", json!({"visitor_limit": 1, "global_limit": 2}))
        .await;
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"name": "cfg", "visitor_limit": 1, "global_limit": 2, "retention_days": 7, "timezone": "UTC"})
    );
    app.stop().await.unwrap();
}

#[tokio::test]
async fn default_day_is_today_in_the_budget_time_zone() {
    let app = spawn_app().await;
    for tz in ["Pacific/Kiritimati", "Pacific/Pago_Pago", "UTC"] {
        let name = tz.replace('/', "-");
        let r = app
            .admin_put_budget(
                &name,
                json!({"visitor_limit": 5, "global_limit": 5, "timezone": tz}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK);
        let r = app
            .post_json(&format!("/budgets/{name}/check"), json!({"visitor": "A"}))
            .await;
        let d: Value = r.json().await.unwrap();
        let today = jiff::Timestamp::now().in_tz(tz).unwrap().date().to_string();
        assert_eq!(d["day"], today, "{tz}");
        let u = app.usage(&name, "").await;
        assert_eq!(u["day"], today);
        assert_eq!(u["global_calls"], 1);
    }
    app.stop().await.unwrap();
}

#[tokio::test]
async fn reset_clears_a_visitor_or_a_whole_day() {
    let app = spawn_app().await;
    app.budget("r", 2, 100).await;
    for v in ["A", "A", "A", "B"] {
        app.check("r", v, &DAY).await;
    }
    let reset = |body: Value| {
        app.client
            .post(app.url("/budgets/r/reset"))
            .bearer_auth(ADMIN)
            .json(&body)
            .send()
    };
    let r = reset(json!({"day": *DAY, "visitor": "A"})).await.unwrap();
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"budget": "r", "day": *DAY, "visitor": "A", "deleted_rows": 1})
    );
    // A is allowed again; the global counter was left alone.
    let d = app.check("r", "A", &DAY).await;
    assert_eq!(
        (d["reason"].clone(), d["global_calls"].clone()),
        (json!("ok"), json!(4))
    );
    let r = reset(json!({"day": *DAY})).await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["deleted_rows"], 3);
    let u = app.usage("r", &format!("day={}&visitor=B", *DAY)).await;
    assert_eq!(
        u,
        json!({"day": *DAY, "global_calls": 0, "visitor_calls": 0})
    );
    // Unknown budget.
    let r = app
        .client
        .post(app.url("/budgets/nope/reset"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    problem(r, StatusCode::NOT_FOUND).await;
    app.stop().await.unwrap();
}

#[tokio::test]
async fn unknown_budget_check_is_404_and_denied() {
    let app = spawn_app().await;
    let r = app
        .post_json("/budgets/ghost/check", json!({"visitor": "A"}))
        .await;
    let body = problem(r, StatusCode::NOT_FOUND).await;
    assert_eq!(body["allowed"], false);
    let r = app.get("/budgets/ghost/usage").await;
    problem(r, StatusCode::NOT_FOUND).await;
    app.stop().await.unwrap();
}

#[tokio::test]
async fn a_broken_database_denies_checks() {
    let app = spawn_app().await;
    app.budget("fc", 10, 10).await;
    assert_eq!(app.check("fc", "A", &DAY).await["allowed"], true);
    app.sql_behind("DROP TABLE budget_visitor_usage").await;
    for _ in 0..3 {
        let r = app
            .post_json("/budgets/fc/check", json!({"visitor": "A", "day": *DAY}))
            .await;
        // A database error is met again by a retry: no `Retry-After`.
        assert!(!r.headers().contains_key("retry-after"));
        let body = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(body["allowed"], false);
        assert_eq!(body["reason"], "meter_error");
    }
    // The writer survives: other writes in later batches still commit.
    let r = app.client.post(app.url("/counter")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    app.stop().await.unwrap();
}

fn header_params(
    v: &str,
) -> std::collections::HashMap<String, std::collections::HashMap<String, i64>> {
    // `"visitor";q=3;w=86400, "global";q=10;w=86400`
    v.split(", ")
        .map(|member| {
            let mut parts = member.split(';');
            let name = parts.next().unwrap().trim_matches('"').to_owned();
            let params = parts
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap();
                    (k.to_owned(), v.parse().unwrap())
                })
                .collect();
            (name, params)
        })
        .collect()
}

/// Where `day` starts and ends in `tz`, worked out here independently of
/// tally's own arithmetic.
fn day_bounds(
    day: jiff::civil::Date,
    tz: &jiff::tz::TimeZone,
) -> (jiff::Timestamp, jiff::Timestamp) {
    let start = |d: jiff::civil::Date| {
        d.to_zoned_datetime(tz.clone())
            .unwrap()
            .start_of_day()
            .unwrap()
            .timestamp()
    };
    (start(day), start(day.tomorrow().unwrap()))
}

#[tokio::test]
async fn checks_carry_ratelimit_fields_for_the_budget_day() {
    let app = spawn_app().await;
    let tz_name = "Pacific/Auckland";
    let tz = jiff::tz::TimeZone::get(tz_name).unwrap();
    let r = app
        .admin_put_budget(
            "rl",
            json!({"visitor_limit": 2, "global_limit": 10, "timezone": tz_name}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let now = jiff::Timestamp::now().to_zoned_datetime(tz.clone());
    let today = now.date();
    let (start, end) = day_bounds(today, &tz);
    let day_len = end.duration_since(start).as_secs();
    let left = end.duration_since(jiff::Timestamp::now()).as_secs();

    let check = |day: Option<String>| {
        let body = match day {
            Some(d) => json!({"visitor": "A", "day": d}),
            None => json!({"visitor": "A"}),
        };
        app.post_json("/budgets/rl/check", body)
    };
    for (i, (visitor_r, global_r)) in [(1, 9), (0, 8)].into_iter().enumerate() {
        let r = check(None).await;
        assert_eq!(r.status(), StatusCode::OK);
        let policy = header_params(r.headers()["ratelimit-policy"].to_str().unwrap());
        assert_eq!(policy["visitor"]["q"], 2);
        assert_eq!(policy["global"]["q"], 10);
        assert_eq!(policy["visitor"]["w"], day_len);
        assert_eq!(policy["global"]["w"], day_len);
        let state = header_params(r.headers()["ratelimit"].to_str().unwrap());
        assert_eq!(state["visitor"]["r"], visitor_r, "call {i}");
        assert_eq!(state["global"]["r"], global_r, "call {i}");
        let t = state["visitor"]["t"];
        assert!((t - left).abs() <= 3, "t={t}, expected about {left}");
        assert_eq!(state["global"]["t"], t);
        assert!(!r.headers().contains_key("retry-after"));
    }
    // Over the visitor limit: denied until the day resets.
    let r = check(None).await;
    let after: i64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let state = header_params(r.headers()["ratelimit"].to_str().unwrap());
    assert_eq!(state["visitor"]["r"], 0);
    assert_eq!(after, state["visitor"]["t"]);
    assert_eq!(r.json::<Value>().await.unwrap()["reason"], "visitor_limit");

    // Yesterday in Auckland is over: nothing left to wait for, so no
    // Retry-After (0 would ask for the retry at once, denied again).
    let yesterday = today.yesterday().unwrap().to_string();
    for _ in 0..3 {
        check(Some(yesterday.clone())).await;
    }
    let r = check(Some(yesterday)).await;
    assert!(
        !r.headers().contains_key("retry-after"),
        "{:?}",
        r.headers()
    );
    let state = header_params(r.headers()["ratelimit"].to_str().unwrap());
    assert_eq!(state["visitor"]["t"], 0);
    // Tomorrow in Auckland cannot be counted on yet.
    let r = check(Some(today.tomorrow().unwrap().to_string())).await;
    let p = problem(r, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert_eq!(
        (p["type"].as_str(), p["allowed"].as_bool()),
        (Some("/problems/day-outside-window"), Some(false))
    );
    app.stop().await.unwrap();
}

/// A PUT keeps the usage on the days the budget keeps under it and deletes
/// the rest at once: a time zone moved west leaves no usage on a day that
/// has not begun there (it would count against that day, and no client
/// could read or reset it), and what a past day holds after retention was
/// shortened and lengthened again does not depend on whether a prune ran.
#[tokio::test]
async fn a_put_keeps_only_the_usage_of_the_days_it_keeps() {
    let app = spawn_app().await;
    let put = |tz: &'static str, retention: u32| json!({"visitor_limit": 5, "global_limit": 50, "retention_days": retention, "timezone": tz});
    // Kiritimati (+14) is always a day or two ahead of Pago Pago (-11).
    let r = app
        .admin_put_budget("west", put("Pacific/Kiritimati", 7))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let d: Value = app
        .post_json("/budgets/west/check", json!({"visitor": "v"}))
        .await
        .json()
        .await
        .unwrap();
    let ahead = d["day"].as_str().unwrap().to_owned();
    for tz in ["Pacific/Pago_Pago", "Pacific/Kiritimati"] {
        let r = app.admin_put_budget("west", put(tz, 7)).await;
        assert_eq!(r.status(), StatusCode::OK);
    }
    // Kiritimati's midnight may have passed meanwhile: then the day is
    // gone from the window and not worth asking about.
    if today_in("Pacific/Kiritimati", 0) == ahead {
        let u = app.usage("west", &format!("day={ahead}&visitor=v")).await;
        assert_eq!(
            (&u["global_calls"], &u["visitor_calls"]),
            (&json!(0), &json!(0)),
            "{u}"
        );
    }

    let r = app.admin_put_budget("kept", put("UTC", 7)).await;
    assert_eq!(r.status(), StatusCode::OK);
    let past = today_in("UTC", -3);
    let d = app.check("kept", "v", &past).await;
    assert_eq!(d["visitor_calls"], 1, "{d}");
    let r = app.admin_put_budget("kept", put("UTC", 1)).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = app.admin_put_budget("kept", put("UTC", 7)).await;
    assert_eq!(r.status(), StatusCode::OK);
    let u = app.usage("kept", &format!("day={past}&visitor=v")).await;
    assert_eq!(
        (&u["global_calls"], &u["visitor_calls"]),
        (&json!(0), &json!(0)),
        "{u}"
    );
    // Today's usage is kept through all of it.
    let d = app.check("kept", "v", &DAY).await;
    assert_eq!(d["visitor_calls"], 1, "{d}");
    let r = app.admin_put_budget("kept", put("UTC", 1)).await;
    assert_eq!(r.status(), StatusCode::OK);
    let u = app.usage("kept", &format!("day={}&visitor=v", *DAY)).await;
    assert_eq!(u["visitor_calls"], 1, "{u}");
    app.stop().await.unwrap();
}

/// A day the window has left that holds more visitors than one prune
/// deletes (`PRUNE_SHARE`, 10,000) is pruned a share at a time: the day's
/// first call takes one, the writer the rest, with no call after it (a
/// first call at midnight, then quiet), down to the last row. The days
/// the budget keeps lose nothing, and every row pruned is counted.
#[tokio::test]
async fn a_day_of_many_visitors_is_pruned_to_the_last_row_with_no_call_after() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let bin = Binary::start(&[("TALLY_DATABASE", &db), ("TALLY_ADMIN_TOKEN", ADMIN)]);
    let client = reqwest::Client::new();
    let spec = json!({"visitor_limit": 5, "global_limit": 1_000_000, "retention_days": 1, "timezone": "UTC"});
    put_budget(&client, &bin, "big", spec).await;
    let check = |day: Option<&str>| {
        let body = match day {
            Some(day) => json!({"visitor": "kept", "day": day}),
            None => json!({"visitor": "today"}),
        };
        client
            .post(bin.url("/budgets/big/check"))
            .json(&body)
            .send()
    };
    // A kept day's call, made before the old day is there to prune.
    let yesterday = today_in("UTC", -1);
    assert_eq!(
        check(Some(&yesterday)).await.unwrap().status(),
        StatusCode::OK
    );
    // 25,000 visitors on a day long gone, and its global row.
    behind(
        &db,
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 25000)
         INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
         SELECT 'big', '2000-01-01', 'v' || i, 1 FROM g;
         INSERT INTO budget_global_usage (budget, day, calls) VALUES ('big', '2000-01-01', 25000);",
    )
    .await;

    assert_eq!(check(None).await.unwrap().status(), StatusCode::OK);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let metrics = bin.metrics().await;
        let pruned = sample(&metrics, "tally_budget_pruned_rows_total");
        // And no budget left due: the gauge goes back to 0, and the last
        // share's line (read from the pipe by another thread) is in.
        if pruned == Some(25_001.0)
            && sample(&metrics, "tally_budget_prunes_due") == Some(0.0)
            && bin
                .log_text()
                .contains("deleted the last of a budget's usage past its retention")
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pruned {pruned:?} of 25,001 rows in 30 s; log:\n{}",
            bin.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        count_behind(
            &db,
            "SELECT count(*) FROM budget_visitor_usage WHERE day = '2000-01-01'"
        )
        .await,
        0
    );
    let usage: Value = client
        .get(bin.url(&format!("/budgets/big/usage?day={yesterday}&visitor=kept")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&usage["visitor_calls"], &usage["global_calls"]),
        (&json!(1), &json!(1)),
        "{usage}"
    );
}

/// Puts a budget until it is created, as a client told to retry would:
/// each refusal must be `503 /problems/budget-purge-under-way` naming the
/// budget, with `Retry-After` in whole seconds, and the client waits
/// `pause` before the next try, or what `Retry-After` says. How many
/// times it was refused; fails if not created within `within_secs`.
async fn put_until_created(
    client: &reqwest::Client,
    bin: &Binary,
    name: &str,
    spec: &Value,
    pause: Option<std::time::Duration>,
    within_secs: u64,
) -> usize {
    let started = std::time::Instant::now();
    let mut refused = 0;
    loop {
        let r = client
            .put(bin.url(&format!("/budgets/{name}")))
            .bearer_auth(ADMIN)
            .json(spec)
            .send()
            .await
            .unwrap();
        if r.status() == StatusCode::OK {
            return refused;
        }
        let asked: u64 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(asked >= 1, "Retry-After {asked}");
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(p["type"], "/problems/budget-purge-under-way", "{p}");
        assert_eq!(p["budget"], name, "{p}");
        refused += 1;
        assert!(
            started.elapsed() < std::time::Duration::from_secs(within_secs),
            "refused {refused} times in {:?}",
            started.elapsed()
        );
        tokio::time::sleep(pause.unwrap_or(std::time::Duration::from_secs(asked))).await;
    }
}

/// A budget deleted, then created again by a client that retries its
/// refused `PUT` as `Retry-After` says (every second, which leaves the
/// writer no idle second): created within a few seconds, though a far
/// larger budget's usage, deleted first, is still being deleted. The
/// writer's shares go on after each batch while nothing is queued, and
/// take turns between budgets.
#[tokio::test]
async fn a_budget_created_again_waits_on_no_other_budgets_purge() {
    const USAGE: &str =
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 300000)
         INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
         SELECT 'large', '2026-01-01', 'v' || i, 1 FROM g;
         WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 25000)
         INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
         SELECT 'small', '2026-01-01', 'v' || i, 1 FROM g;";
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let bin = Binary::start(&[("TALLY_DATABASE", &db), ("TALLY_ADMIN_TOKEN", ADMIN)]);
    let client = reqwest::Client::new();
    let spec = json!({"visitor_limit": 5, "global_limit": 1_000_000, "retention_days": 3650, "timezone": "UTC"});
    for name in ["large", "small"] {
        put_budget(&client, &bin, name, spec.clone()).await;
    }
    behind(&db, USAGE).await;
    for name in ["large", "small"] {
        let r = client
            .delete(bin.url(&format!("/budgets/{name}")))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
    }
    // Within a few seconds, though `large` is far from deleted.
    put_until_created(&client, &bin, "small", &spec, None, 8).await;
    let left = count_behind(
        &db,
        "SELECT count(*) FROM budget_visitor_usage WHERE budget = 'small'",
    )
    .await;
    assert_eq!(left, 0);
}

/// Deleting a budget of many visitors answers at once and its usage goes
/// after, a share at a time, to the last row; a `PUT` that creates it
/// again meanwhile is refused (`503`, `Retry-After`) while more than a
/// share is left, then starts it empty. What a delete left when its
/// process stopped is found and purged by the next one.
#[tokio::test]
async fn a_deleted_budgets_usage_is_purged_to_the_last_row() {
    const MANY: &str =
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 25000)
         INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
         SELECT 'big', '2026-01-01', 'v' || i, 1 FROM g;
         INSERT INTO budget_global_usage (budget, day, calls) VALUES ('big', '2026-01-01', 25000);";
    const LEFT: &str = "SELECT (SELECT count(*) FROM budget_visitor_usage WHERE budget = 'big')
              + (SELECT count(*) FROM budget_global_usage WHERE budget = 'big')";
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let env = [
        ("TALLY_DATABASE", db.as_str()),
        ("TALLY_ADMIN_TOKEN", ADMIN),
    ];
    let client = reqwest::Client::new();
    let spec = json!({"visitor_limit": 5, "global_limit": 1_000_000, "retention_days": 3650, "timezone": "UTC"});
    let gone = async |bin: &Binary| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while count_behind(&db, LEFT).await > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "usage left after 30 s"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        bin.log_text()
    };

    let delete_big = async |bin: &Binary| {
        let r = client
            .delete(bin.url("/budgets/big"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
    };

    // Creates `big` again, as a client told to retry would: refused while
    // more of the deleted one's usage is left than a share. How many times
    // it was refused.
    let put_again = async |bin: &Binary| -> usize {
        let pause = std::time::Duration::from_millis(200);
        put_until_created(&client, bin, "big", &spec, Some(pause), 30).await
    };
    // None of the old usage counts.
    let counted_anew = async |bin: &Binary| {
        let d: Value = client
            .post(bin.url("/budgets/big/check"))
            .json(&json!({"visitor": "v9999", "day": "2026-01-01"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            (&d["visitor_calls"], &d["global_calls"]),
            (&json!(1), &json!(1)),
            "{d}"
        );
    };

    // Every row deleted is counted once, by whichever took it: the
    // delete, the writer's shares, the PUT.
    let counted = async |bin: &Binary, rows: f64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let n = sample(&bin.metrics().await, "tally_budget_pruned_rows_total");
            if n == Some(rows) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{n:?} of {rows}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };

    let bin = Binary::start(&env);
    put_budget(&client, &bin, "big", spec.clone()).await;
    behind(&db, MANY).await;
    delete_big(&bin).await;
    // Created again at once (refused, or not, as the writer's shares and
    // the PUT meet).
    put_again(&bin).await;
    counted_anew(&bin).await;
    delete_big(&bin).await;
    gone(&bin).await;
    // 25,000 visitors and the global row, then the new budget's two.
    counted(&bin, 25_003.0).await;
    // The writer's share after the delete (of nothing left) has run: one
    // still to come would take the rows written next.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let due = sample(&bin.metrics().await, "tally_budget_prunes_due");
        if due == Some(0.0) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{due:?} prunes due");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }

    // Left while this process runs and knows nothing of it (as a process
    // that stopped leaves it; on PostgreSQL, another process's): a PUT
    // creating the budget is refused, and changes nothing, until the
    // writer, told by the refusal, has deleted it.
    behind(&db, MANY).await;
    assert!(put_again(&bin).await >= 1);
    counted_anew(&bin).await;
    delete_big(&bin).await;
    gone(&bin).await;
    counted(&bin, 50_006.0).await;
    drop(bin);

    // Left by a process that stopped: the next one purges it.
    behind(&db, MANY).await;
    let bin = Binary::start(&env);
    let log = gone(&bin).await;
    assert!(log.contains("usage of deleted budgets found"), "{log}");
}

/// A usage count below 0 (edited by hand: calls "taken back") is counted
/// from 0, and the day's next check writes it right. Counted from as it
/// stood, a global row at -1 let every call of the day through (its 0
/// after a call was never written back), a budget with a global limit of
/// 0 included, and a visitor at -100 had 100 calls more.
#[tokio::test]
async fn a_usage_count_below_zero_is_counted_from_zero() {
    let app = spawn_app().await;
    app.budget("taken", 1, 2).await;
    app.budget("shut", 5, 0).await;
    app.budget("mend", 1, 5).await;
    let day = today_in("UTC", 0);
    for budget in ["taken", "shut", "mend"] {
        app.check(budget, "a", &day).await;
    }
    app.sql_behind("UPDATE budget_global_usage SET calls = -1")
        .await;
    app.sql_behind("UPDATE budget_visitor_usage SET calls = -100")
        .await;
    let allowed = |d: &Value| d["allowed"].as_bool().unwrap();
    // `shut` denies everything, whatever is stored.
    for visitor in ["b", "c", "d"] {
        let d = app.check("shut", visitor, &day).await;
        assert!(!allowed(&d), "{d}");
    }
    // `a` may make one call, and the day two.
    let d = app.check("taken", "a", &day).await;
    assert!(allowed(&d), "{d}");
    assert_eq!(
        (&d["visitor_calls"], &d["global_calls"]),
        (&json!(1), &json!(1))
    );
    let d = app.check("taken", "a", &day).await;
    assert!(!allowed(&d), "{d}");
    let d = app.check("taken", "b", &day).await;
    assert!(allowed(&d), "{d}");
    let d = app.check("taken", "c", &day).await;
    assert!(!allowed(&d), "{d}");
    assert_eq!(d["global_calls"], 3, "{d}");
    let usage = app.usage("taken", &format!("day={day}")).await;
    assert_eq!(usage["global_calls"], 3, "{usage}");
    // Written back even when no check reaches it (every one denied by the
    // visitor limit), so that it is not read below 0 again.
    app.budget("mend", 0, 5).await;
    let d = app.check("mend", "z", &day).await;
    assert_eq!(d["reason"], "visitor_limit", "{d}");
    let usage = app.usage("mend", &format!("day={day}")).await;
    assert_eq!(usage["global_calls"], 0, "{usage}");
    app.stop().await.unwrap();
}

/// The warning about a usage count below 0 names the budget and the day,
/// never the visitor: no log line names a visitor (ids are often e-mail
/// addresses).
#[tokio::test]
async fn the_warning_of_a_count_below_zero_names_no_visitor() {
    let dir = tempfile::tempdir().unwrap();
    let db = database_in(dir.path()).await;
    let bin = Binary::start(&[("TALLY_DATABASE", &db), ("TALLY_ADMIN_TOKEN", ADMIN)]);
    let client = reqwest::Client::new();
    let spec = json!({"visitor_limit": 5, "global_limit": 50, "timezone": "UTC"});
    put_budget(&client, &bin, "b", spec).await;
    let visitor = "alice.secret@example.com";
    let check = || {
        client
            .post(bin.url("/budgets/b/check"))
            .json(&json!({"visitor": visitor}))
            .send()
    };
    assert_eq!(check().await.unwrap().status(), StatusCode::OK);
    behind(&db, "UPDATE budget_visitor_usage SET calls = -2").await;
    assert_eq!(check().await.unwrap().status(), StatusCode::OK);
    bin.logs_within(
        "a stored usage count below 0",
        std::time::Duration::from_secs(10),
    )
    .await;
    let logs = bin.log_text();
    assert!(logs.contains("a visitor's"), "{logs}");
    assert!(!logs.contains(visitor), "{logs}");
}
