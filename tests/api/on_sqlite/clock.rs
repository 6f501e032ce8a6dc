//! The wall clock stepped under a running tally and set right again:
//! libfaketime moves the binary's clock (read from a file, so the test
//! steps it while tally runs) and leaves its monotonic clock alone, as a
//! step of the host's clock does. On SQLite the host's clock is the one
//! days and keys' ages go by.

use std::{path::Path, time::Duration};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{
    ADMIN, Binary, failed_start, faketime_library, json, put_budget, sample, set_clock,
};

/// tally with its clock read from `clock` (libfaketime's offset, as
/// `+10d`), which starts in step.
fn stepped_binary(dir: &Path, clock: &Path, extra: &[(&str, &str)]) -> Binary {
    set_clock(clock, "+0");
    binary_on(dir, clock, extra)
}

/// The environment of a tally on `db` whose wall clock libfaketime (the
/// `library`) reads from `clock`.
fn clocked_env<'a>(db: &'a Path, library: &'a Path, clock: &'a Path) -> Vec<(&'a str, &'a str)> {
    vec![
        ("TALLY_DATABASE", db.to_str().unwrap()),
        ("TALLY_ADMIN_TOKEN", ADMIN),
        ("LD_PRELOAD", library.to_str().unwrap()),
        ("FAKETIME_TIMESTAMP_FILE", clock.to_str().unwrap()),
        // Read at every call: the step lands at once.
        ("FAKETIME_NO_CACHE", "1"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ]
}

/// tally with its clock read from `clock`, as it is set.
fn binary_on(dir: &Path, clock: &Path, extra: &[(&str, &str)]) -> Binary {
    let library = faketime_library();
    let db = dir.join("tally.db");
    let mut env = clocked_env(&db, &library, clock);
    env.extend_from_slice(extra);
    // The environment holds borrowed strings: start before they go.
    Binary::start(&env)
}

async fn check(client: &Client, bin: &Binary, visitor: &str) -> Value {
    check_of(client, bin, "b", visitor).await
}

async fn check_of(client: &Client, bin: &Binary, budget: &str, visitor: &str) -> Value {
    let r = client
        .post(bin.url(&format!("/budgets/{budget}/check")))
        .json(&json!({"visitor": visitor}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    json(r).await
}

/// Visitor `v` of budget `b` (a visitor limit of 2) at its limit today:
/// two calls allowed, the third denied, whose answer this is.
async fn at_its_limit(client: &Client, bin: &Binary) -> Value {
    for _ in 0..2 {
        assert_eq!(check(client, bin, "v").await["allowed"], true);
    }
    let today = check(client, bin, "v").await;
    assert_eq!(today["allowed"], false, "{today}");
    today
}

/// A clock stepped ten days ahead and set right: the first call of the
/// stepped day would prune every day before its retention, the real today
/// among them, and a visitor at its limit would be allowed again. The
/// step holds pruning back; the visitor stays denied, and the step is
/// counted and logged. The same after a restart, with the step before the
/// first write: the writer reads the clock as it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_ahead_and_back_prunes_nothing_of_today() {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let mut bin = stepped_binary(dir.path(), &clock, &[]);
    let client = Client::new();
    put_budget(
        &client,
        &bin,
        "b",
        json!({"visitor_limit": 2, "global_limit": 1000, "retention_days": 1}),
    )
    .await;
    let today = at_its_limit(&client, &bin).await;

    set_clock(&clock, "+10d");
    let stepped = check(&client, &bin, "w").await;
    assert_ne!(
        stepped["day"], today["day"],
        "the step moved the day: {stepped}"
    );
    set_clock(&clock, "+0");

    let after = check(&client, &bin, "v").await;
    assert_eq!(after["day"], today["day"]);
    assert_eq!(
        after["allowed"], false,
        "today's calls were pruned: {after}"
    );
    let usage = json(
        client
            .get(bin.url("/budgets/b/usage"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    // The two allowed (a denied call counts nothing).
    assert_eq!(usage["global_calls"], 2, "{usage}");

    let metrics = bin.metrics().await;
    let steps = |direction: &str| {
        sample(
            &metrics,
            &format!("tally_clock_steps_total{{direction=\"{direction}\"}}"),
        )
    };
    assert_eq!(steps("forward"), Some(1.0), "{metrics}");
    assert_eq!(steps("backward"), Some(0.0));
    assert_eq!(sample(&metrics, "tally_budget_prunes_total"), Some(0.0));
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
    let logs = bin.log_text();
    assert!(logs.contains("the wall clock stepped"), "{logs}");
    assert!(logs.contains("the wall clock is back in step"), "{logs}");

    // A day of its own: the first call of the day above pruned already.
    let mut bin = stepped_binary(dir.path(), &clock, &[]);
    // Once the writer has read the clock as it starts (before its first
    // batch, so a write it answered says so): a step before that reading
    // no process can see, and the test would be of nothing.
    let r = client
        .post(bin.url("/counters/started"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    set_clock(&clock, "+20d");
    let stepped = check(&client, &bin, "w").await;
    assert_ne!(stepped["day"], today["day"]);
    set_clock(&clock, "+0");
    let after = check(&client, &bin, "v").await;
    assert_eq!(
        after["allowed"], false,
        "after a restart, today's calls were pruned: {after}"
    );
    let metrics = bin.metrics().await;
    assert_eq!(sample(&metrics, "tally_budget_prunes_total"), Some(0.0));
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
}

/// A process started while the clock is stepped ahead (a restart during
/// the hold) took the stepped clock for the real one: the first call of
/// the stepped day pruned every day before its retention, the real today
/// among them, and once the clock was set right a visitor at its limit was
/// allowed again. The hold the first process saw is kept in the database,
/// and the next takes it over: it prunes nothing, counts the step, and
/// takes the clock set right as back in step, not as a step back; the end
/// of the hold is kept too, and a third process trusts the clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_started_during_a_hold_holds_too() {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let mut bin = stepped_binary(dir.path(), &clock, &[]);
    let client = Client::new();
    let spec = json!({"visitor_limit": 2, "global_limit": 1000, "retention_days": 1});
    put_budget(&client, &bin, "b", spec.clone()).await;
    put_budget(&client, &bin, "other", spec).await;
    let today = at_its_limit(&client, &bin).await;

    // Seen by a check of another budget: `b` has no call on the stepped day.
    set_clock(&clock, "+10d");
    check_of(&client, &bin, "other", "w").await;
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
    let logs = bin.log_text();
    assert!(logs.contains("the wall clock stepped"), "{logs}");

    let mut bin = binary_on(dir.path(), &clock, &[]);
    let stepped = check(&client, &bin, "w").await;
    assert_ne!(stepped["day"], today["day"], "{stepped}");
    set_clock(&clock, "+0");
    let after = check(&client, &bin, "v").await;
    assert_eq!(after["day"], today["day"]);
    assert_eq!(
        after["allowed"], false,
        "the process started during the hold pruned today's calls: {after}"
    );
    let metrics = bin.metrics().await;
    let steps = |metrics: &str, direction: &str| {
        sample(
            metrics,
            &format!("tally_clock_steps_total{{direction=\"{direction}\"}}"),
        )
    };
    assert_eq!(steps(&metrics, "forward"), Some(1.0), "{metrics}");
    assert_eq!(steps(&metrics, "backward"), Some(0.0), "{metrics}");
    assert_eq!(sample(&metrics, "tally_budget_prunes_total"), Some(0.0));
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
    let logs = bin.log_text();
    assert!(
        logs.contains("the wall clock stepped before this process started"),
        "{logs}"
    );
    assert!(logs.contains("the wall clock is back in step"), "{logs}");

    // The clock set right and the hold's end kept: nothing held.
    let mut bin = binary_on(dir.path(), &clock, &[]);
    assert_eq!(check(&client, &bin, "v").await["allowed"], false);
    let metrics = bin.metrics().await;
    assert_eq!(steps(&metrics, "forward"), Some(0.0), "{metrics}");
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
}

/// A step before a stop, on a process that served increments alone
/// (which go by no time): it never read the clock, kept no hold, and the
/// process after it, started with the clock still ahead, forgot a key
/// stored a moment before (its retry counted twice). The writer reads the
/// clock once a second and as it stops: the step is kept and taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_before_a_stop_is_kept_whatever_was_served() {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let ttl = [("TALLY_IDEMPOTENCY_KEY_TTL", "120s")];
    let mut bin = stepped_binary(dir.path(), &clock, &ttl);
    let client = Client::new();
    let increment = async |bin: &Binary, name: &str, key: &str| {
        let r = client
            .post(bin.url(&format!("/counters/{name}")))
            .header("Idempotency-Key", key)
            .json(&json!({"by": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        r
    };
    increment(&bin, "a", "k0").await;
    set_clock(&clock, "+1h");
    let r = client.post(bin.url("/counters/b")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;

    let mut bin = binary_on(dir.path(), &clock, &ttl);
    // The keys' clean-up runs after this process's first batch.
    increment(&bin, "c", "k1").await;
    increment(&bin, "c", "k2").await;
    set_clock(&clock, "+0");
    let retry = increment(&bin, "a", "k0").await;
    assert_eq!(
        retry
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true"),
        "the key was forgotten: {}",
        bin.log_text()
    );
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
}

/// Steps under two minutes each, with a reading between them (a time
/// source that moves the clock a little at a time), moved it a day ahead
/// unseen: each was compared with the reading before it only. The first
/// call of the day they reached pruned the real today, and once the
/// clock was set right a visitor at its limit was allowed again. They add
/// up to a step from where the clock was last in step: held as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_under_two_minutes_add_up_to_a_step() {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let mut bin = stepped_binary(dir.path(), &clock, &[]);
    let client = Client::new();
    let spec = json!({"visitor_limit": 2, "global_limit": 100_000, "retention_days": 1});
    put_budget(&client, &bin, "b", spec.clone()).await;
    put_budget(&client, &bin, "other", spec).await;
    let today = at_its_limit(&client, &bin).await;

    // 100 s at a time, a reading after each: 50 hours ahead, past the
    // day before (which a one-day retention keeps too).
    for i in 1..=1800 {
        set_clock(&clock, &format!("+{}", 100 * i));
        check_of(&client, &bin, "other", &format!("w{i}")).await;
    }
    let stepped = check(&client, &bin, "w").await;
    assert_ne!(stepped["day"], today["day"], "{stepped}");
    set_clock(&clock, "+0");
    let after = check(&client, &bin, "v").await;
    assert_eq!(after["day"], today["day"]);
    assert_eq!(
        after["allowed"], false,
        "today's calls were pruned: {after}"
    );
    let metrics = bin.metrics().await;
    assert_eq!(
        sample(&metrics, "tally_clock_steps_total{direction=\"forward\"}"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(sample(&metrics, "tally_budget_prunes_total"), Some(0.0));
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
    let logs = bin.log_text();
    assert!(logs.contains("the wall clock is back in step"), "{logs}");
}

/// A clock stepped past the keys' lifetime and set right: the writer's
/// clean-up would forget a key stored a moment before, and its retry
/// would run again. During the step the clean-up counts keys' ages from
/// the clock without the step: the retry replays, and a key expired by
/// that clock too is forgotten all the same (it may make room past the
/// storage limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepped_past_the_keys_lifetime_forgets_no_key() {
    keys_across_a_step("+0", "+1h").await;
}

/// A clock stepped back and set right: a key stored while it was behind
/// was stamped with its time, so once it was set right the clean-up took
/// the key for as old as the step and forgot it, and its retry ran again.
/// A key is stamped no earlier than where the clock would be without the
/// step: the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_stored_while_the_clock_is_behind_is_kept_its_lifetime() {
    keys_across_a_step("-1h", "+0").await;
}

/// Key `k0` stored, then `k1` half a lifetime later with the clock at
/// `for_k1`, then the clean-up a lifetime after `k0` with the clock at
/// `for_clean_up`, then the clock set right: `k1`, a few seconds old by
/// the real clock, replays; `k0`, past its lifetime, runs again.
async fn keys_across_a_step(for_k1: &str, for_clean_up: &str) {
    const TTL: Duration = Duration::from_secs(10);
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let mut bin = stepped_binary(dir.path(), &clock, &[("TALLY_IDEMPOTENCY_KEY_TTL", "10s")]);
    let client = Client::new();
    let increment = |name: &'static str, key: &'static str| {
        client
            .post(bin.url(&format!("/counters/{name}")))
            .header("Idempotency-Key", key)
            .json(&json!({"by": 1}))
            .send()
    };
    // The writer cleans up after a batch, once its answers are sent, and
    // before it takes the next: a write answered after it has cleaned up.
    let cleaned_up = || async {
        let r = client.post(bin.url("/counters/d")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    };
    // The clean-up runs at most once per lifetime: the first runs now,
    // the next is due a lifetime later.
    assert_eq!(increment("a", "k0").await.unwrap().status(), StatusCode::OK);
    cleaned_up().await;
    let first = std::time::Instant::now();
    // Half a lifetime on: the next clean-up, due a lifetime after the
    // first (which ran a moment before `first`, or seconds before it on a
    // stalled host), is not due at k1's batch.
    tokio::time::sleep(TTL / 2).await;
    set_clock(&clock, for_k1);
    assert_eq!(increment("b", "k1").await.unwrap().status(), StatusCode::OK);
    set_clock(&clock, for_clean_up);
    // Ages are counted in whole seconds: k0 a second past its lifetime.
    let due = first + TTL + Duration::from_millis(1500);
    tokio::time::sleep(due.saturating_duration_since(std::time::Instant::now())).await;
    // Due now: the clean-up runs after this batch.
    assert_eq!(increment("c", "k2").await.unwrap().status(), StatusCode::OK);
    cleaned_up().await;
    set_clock(&clock, "+0");

    let retry = increment("b", "k1").await.unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    assert_eq!(
        retry
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true"),
        "the key was forgotten"
    );
    let value = json(client.get(bin.url("/counters/b")).send().await.unwrap()).await;
    assert_eq!(value["value"], 1, "{value}");
    let retry = increment("a", "k0").await.unwrap();
    assert!(retry.headers().get("idempotent-replayed").is_none());
    let value = json(client.get(bin.url("/counters/a")).send().await.unwrap()).await;
    assert_eq!(value["value"], 2, "{value}");
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
}

/// The offset, for libfaketime, that sets the clock to `at` (unix seconds).
fn offset_to(at: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    format!("{:+}s", at - now)
}

/// A host clock tally cannot count days by: before 1970 (no HTTP `Date`
/// can be written there: tally said it served, and every connection
/// failed) or at the end of the year 9999 (the writer panicked reading
/// it). Refused at start, saying why; stepped there while serving, checks
/// are denied (`503 meter_error`, failing closed) and the writer lives on,
/// counting again once the clock is set right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_outside_what_days_can_be_counted_in_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let library = faketime_library();
    let db = dir.path().join("tally.db");
    // 1969-12-31T00:00:00Z, and 9999-12-31T00:00:00Z.
    let (before, after) = (-86_400, 253_402_214_400);
    for at in [before, after] {
        set_clock(&clock, &offset_to(at));
        let stderr = failed_start(&clocked_env(&db, &library, &clock));
        let last = stderr.lines().last().unwrap();
        assert!(
            last.starts_with("tally: the wall clock reads ")
                && last.contains("outside what tally can count days in (1970 to 9998-12-29)"),
            "{stderr}"
        );
    }

    let mut bin = stepped_binary(dir.path(), &clock, &[]);
    let client = Client::new();
    put_budget(
        &client,
        &bin,
        "b",
        json!({"visitor_limit": 10, "global_limit": 100}),
    )
    .await;
    assert_eq!(check(&client, &bin, "v").await["allowed"], true);
    set_clock(&clock, &offset_to(after));
    let r = client
        .post(bin.url("/budgets/b/check"))
        .json(&json!({"visitor": "v"}))
        .send()
        .await
        .unwrap();
    let body = crate::helpers::problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(
        (&body["reason"], &body["allowed"]),
        (&json!("meter_error"), &json!(false))
    );
    set_clock(&clock, "+0");
    let back = check(&client, &bin, "v").await;
    assert_eq!(back["allowed"], true);
    // The denied check counted nothing.
    assert_eq!(back["visitor_calls"], 2, "{back}");
    assert!(!bin.log_text().contains("panicked"), "{}", bin.log_text());
    bin.sigterm();
    assert_eq!(bin.wait(Duration::from_secs(20)).await.code(), Some(0));
}
