//! The storage limit (`TALLY_STORAGE_LIMIT`) and the keys' lifetime
//! (`TALLY_IDEMPOTENCY_KEY_TTL`) on the real binary: keyed writes fill a
//! small limit, are answered `507` before the directory passes it (as `du`
//! measures it), and are taken again once the limit is raised or the keys
//! expire.

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{ADMIN, Binary, behind, problem, sample};

const MIB: u64 = 1 << 20;

/// How far past the limit the directory may go: the writer's reckoning
/// between two samples is good to a few pages of 4 KiB.
const PAGES: u64 = 16 * 4096;

/// What `du` says the directory takes, in bytes.
fn du(dir: &Path) -> u64 {
    let out = std::process::Command::new("du")
        .args(["-s", "-B1"])
        .arg(dir)
        .output()
        .expect("du runs");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("du prints a size")
}

async fn metrics(client: &Client, bin: &Binary) -> String {
    let r = client.get(bin.url("/metrics")).send().await.unwrap();
    r.text().await.unwrap()
}

/// A keyed increment with a fresh key (shaped like a UUID, as clients send).
async fn keyed(client: &Client, bin: &Binary, n: usize) -> reqwest::Response {
    let key = format!("{:08x}-0000-4000-8000-{:012x}", n, n * 7919);
    client
        .post(bin.url(&format!("/counters/c{}", n % 16)))
        .header("idempotency-key", key)
        .send()
        .await
        .unwrap()
}

/// Keyed writes from 16 clients until one is answered other than 200;
/// returns how many were acknowledged and that first other answer.
async fn fill(
    client: &Client,
    bin: &Binary,
    next: &Arc<AtomicUsize>,
) -> (usize, reqwest::Response) {
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (client, url, stop, acked, next) = (
            client.clone(),
            bin.url(""),
            Arc::clone(&stop),
            Arc::clone(&acked),
            Arc::clone(next),
        );
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let key = format!("{:08x}-0000-4000-8000-{:012x}", n, n * 7919);
                let r = client
                    .post(format!("{url}/counters/c{}", n % 16))
                    .header("idempotency-key", key)
                    .send()
                    .await
                    .unwrap();
                if r.status() == StatusCode::OK {
                    acked.fetch_add(1, Ordering::Relaxed);
                } else {
                    stop.store(true, Ordering::Relaxed);
                    return Some(r);
                }
            }
            None
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut first = None;
    for t in tasks {
        let left = deadline.saturating_duration_since(Instant::now());
        let r = tokio::time::timeout(left, t)
            .await
            .expect("the limit was never reached")
            .unwrap();
        first = first.or(r);
    }
    (acked.load(Ordering::Relaxed), first.unwrap())
}

/// Fills an 8 MiB limit (the smallest tally takes) with keyed writes: `507 storage-full` with
/// `Retry-After` before `du` says the directory passed it; reads, readiness
/// and resets still work, checks fail closed as on a full disk. A restart
/// with a bigger limit takes writes again; a restart with the old limit
/// and a short key lifetime takes them again once the keys have expired.
/// Every acknowledged write is there at the end. Prints what a key costs.
#[tokio::test]
async fn keyed_writes_stop_at_the_limit_and_resume_when_it_is_raised_or_keys_expire() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let limit = 8 * MIB;
    let env = |limit: &'static str, ttl: &'static str| {
        vec![
            ("TALLY_DATABASE", db_str),
            ("TALLY_ADMIN_TOKEN", ADMIN),
            ("TALLY_STORAGE_LIMIT", limit),
            ("TALLY_IDEMPOTENCY_KEY_TTL", ttl),
        ]
    };
    let limit_static: &'static str = Box::leak(limit.to_string().into_boxed_str());
    let client = Client::new();
    let mut bin = Binary::start(&env(limit_static, "1h"));
    let m = metrics(&client, &bin).await;
    assert_eq!(sample(&m, "tally_storage_limit_bytes"), Some(limit as f64));
    for file in ["db", "wal", "shm"] {
        let series = format!("tally_database_bytes{{file=\"{file}\"}}");
        assert!(sample(&m, &series).is_some(), "{series}: {m}");
    }
    let used = sample(&m, "tally_storage_used_bytes").unwrap();
    assert!(used > 0.0 && used < limit as f64, "{used}");
    let r = client
        .put(bin.url("/budgets/b"))
        .bearer_auth(ADMIN)
        .json(&json!({"visitor_limit": 100, "global_limit": 1000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = client
        .post(bin.url("/budgets/b/check"))
        .header("idempotency-key", "check-before-the-limit")
        .json(&json!({"visitor": "v"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let check_before = r.text().await.unwrap();
    let r = client
        .post(bin.url("/counters/kept"))
        .header("idempotency-key", "increment-before-the-limit")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let increment_before = r.text().await.unwrap();
    bin.sigterm();
    assert_eq!(bin.wait(Duration::from_secs(20)).await.code(), Some(0));
    // After a clean stop the WAL is checkpointed into the file.
    let db_before = std::fs::metadata(&db).unwrap().len();
    let bin = Binary::start(&env(limit_static, "1h"));

    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let (mut acked, r) = fill(&client, &bin, &next).await;
    let took = started.elapsed();
    let at_refusal = du(dir.path());
    assert_eq!(r.headers()["retry-after"], "5");
    let body = problem(r, StatusCode::INSUFFICIENT_STORAGE).await;
    assert_eq!(body["type"], "/problems/storage-full", "{body}");
    assert!(
        at_refusal <= limit + PAGES,
        "refused only at {at_refusal} bytes, past the limit of {limit}"
    );
    assert!(
        at_refusal > limit * 3 / 4,
        "refused at {at_refusal} bytes, long before the limit of {limit}"
    );
    println!(
        "{acked} keyed writes in {took:?} filled the directory to {at_refusal} bytes (du) of \
         {limit}"
    );

    // Writes one at a time until they are refused for a whole second (four
    // samples): near the limit the writer's reckoning errs high, and a
    // fresh sample may let a few more in, but the directory never passes
    // the limit.
    let mut refused_in_a_row = 0;
    let mut refused = 0;
    for _ in 0..20_000 {
        let r = keyed(&client, &bin, next.fetch_add(1, Ordering::Relaxed)).await;
        match r.status() {
            StatusCode::OK => {
                acked += 1;
                refused_in_a_row = 0;
            }
            s => {
                assert_eq!(s, StatusCode::INSUFFICIENT_STORAGE);
                refused += 1;
                refused_in_a_row += 1;
                if refused_in_a_row == 20 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert_eq!(refused_in_a_row, 20, "writes kept being taken at the limit");
    let after = du(dir.path());
    assert!(
        after <= limit + PAGES,
        "{after} bytes, past the limit of {limit}"
    );
    println!("at the limit: {refused} refused, {after} bytes (du) of {limit}");
    // Retries of writes that committed before the limit are answered with
    // what they answered then: they write nothing, and a 507 would tell
    // their client that nothing had been written.
    for (path, key, body, before) in [
        (
            "/budgets/b/check",
            "check-before-the-limit",
            Some(json!({"visitor": "v"})),
            &check_before,
        ),
        (
            "/counters/kept",
            "increment-before-the-limit",
            None,
            &increment_before,
        ),
    ] {
        let mut req = client.post(bin.url(path)).header("idempotency-key", key);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{path} retried past the limit");
        assert_eq!(r.headers()["idempotent-replayed"], "true");
        assert_eq!(&r.text().await.unwrap(), before);
    }
    // Reads and readiness are not writes; a reset only deletes, so it runs;
    // a check cannot be counted, so it is denied (as on a full disk).
    let counter = client.get(bin.url("/counters/c0")).send().await.unwrap();
    assert_eq!(counter.status(), StatusCode::OK);
    let ready = client.get(bin.url("/ready")).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    let r = client
        .post(bin.url("/budgets/b/check"))
        .json(&json!({"visitor": "v"}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_server_error(), "{}", r.status());
    assert_eq!(r.json::<Value>().await.unwrap()["allowed"], false);
    // A check that could never be counted still hears why, not a refusal
    // a retry could get past.
    for (path, body, status, kind) in [
        (
            "/budgets/nobody/check",
            json!({"visitor": "v"}),
            StatusCode::NOT_FOUND,
            "/problems/not-found",
        ),
        (
            "/budgets/b/check",
            json!({"visitor": "v", "day": "2020-01-01"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "/problems/day-outside-window",
        ),
    ] {
        let r = client.post(bin.url(path)).json(&body).send().await.unwrap();
        assert!(r.headers().get("retry-after").is_none(), "{path}");
        let p = problem(r, status).await;
        assert_eq!(p["type"], kind, "{p}");
        assert_eq!(p["allowed"], false, "{p}");
    }
    // Still past the limit: a check that could be counted is still denied.
    let r = client
        .post(bin.url("/budgets/b/check"))
        .json(&json!({"visitor": "v"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let r = client
        .post(bin.url("/budgets/b/reset"))
        .bearer_auth(ADMIN)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK, "a reset past the limit");
    let m = metrics(&client, &bin).await;
    let counted = sample(
        &m,
        "tally_write_commands_total{command=\"increment\",result=\"storage_full\"}",
    );
    assert!(counted.is_some_and(|n| n >= 20.0), "{counted:?}");
    let logged = bin
        .log_text()
        .matches("the storage limit (TALLY_STORAGE_LIMIT) is reached")
        .count();
    assert_eq!(logged, 1, "logged once: {}", bin.log_text());
    // Killed, as an eviction would: the WAL stays as it was.
    drop(bin);
    let (pages, free, page_size): (i64, i64, i64) = {
        let peek = sqlx::SqlitePool::connect(&format!("sqlite://{db_str}?mode=ro"))
            .await
            .unwrap();
        let row = sqlx::query_as(
            "SELECT c.page_count, f.freelist_count, s.page_size FROM pragma_page_count() AS c, \
             pragma_freelist_count() AS f, pragma_page_size() AS s",
        )
        .fetch_one(&peek)
        .await
        .unwrap();
        peek.close().await;
        row
    };
    let db_full = ((pages - free) * page_size) as u64;
    println!(
        "database in use: {db_before} bytes before, {db_full} after {acked} keys: {} bytes a key",
        (db_full - db_before) / acked as u64
    );

    // A restart makes no room but what the WAL takes past 4 MiB (it is
    // checkpointed, then written over from its start): the limit refuses
    // again at once or after a few writes, the directory still within it.
    let bin = Binary::start(&env(limit_static, "1h"));
    let (more, r) = fill(&client, &bin, &next).await;
    acked += more;
    problem(r, StatusCode::INSUFFICIENT_STORAGE).await;
    let after = du(dir.path());
    assert!(
        after <= limit + PAGES,
        "{after} bytes after a restart, past the limit of {limit}"
    );
    drop(bin);

    // A bigger limit: writes are taken again at once.
    let bin = Binary::start(&env("10Mi", "1h"));
    for _ in 0..20 {
        let r = keyed(&client, &bin, next.fetch_add(1, Ordering::Relaxed)).await;
        assert_eq!(r.status(), StatusCode::OK, "with the limit raised");
        acked += 1;
    }
    drop(bin);
    // Filled again at the old limit: the WAL a kill leaves is written over
    // from its start after a restart, so what it takes past its frames is
    // room, and once the limit refuses again the keys are what fill it.
    let bin = Binary::start(&env(limit_static, "1h"));
    let (more, _) = fill(&client, &bin, &next).await;
    acked += more;
    drop(bin);

    // The old limit again, and a key lifetime every key has outlived: the
    // first writes are refused and clean the keys up, a share at a time;
    // once their pages are free, writes are taken again without a restart.
    // Writes without a key: before, only a keyed batch cleaned up, and
    // clients that send none were refused for good.
    let bin = Binary::start(&env(limit_static, "2s"));
    let started = Instant::now();
    let mut refused = 0;
    loop {
        let n = next.fetch_add(1, Ordering::Relaxed);
        let r = client
            .post(bin.url(&format!("/counters/c{}", n % 16)))
            .send()
            .await
            .unwrap();
        if r.status() == StatusCode::OK {
            acked += 1;
            break;
        }
        assert_eq!(r.status(), StatusCode::INSUFFICIENT_STORAGE);
        refused += 1;
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "still refused after the keys expired: {}",
            bin.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "with expired keys: {refused} refused, writes taken again after {:?}",
        started.elapsed()
    );
    assert!(refused >= 1, "the limit was not full");
    assert!(bin.log_text().contains("forgot expired idempotency keys"));
    for _ in 0..50 {
        let r = keyed(&client, &bin, next.fetch_add(1, Ordering::Relaxed)).await;
        assert_eq!(r.status(), StatusCode::OK, "after the keys expired");
        acked += 1;
    }
    // Every acknowledged write is there; nothing refused is.
    let mut total = 0;
    for c in 0..16 {
        let r = client
            .get(bin.url(&format!("/counters/c{c}")))
            .send()
            .await
            .unwrap();
        total += r.json::<Value>().await.unwrap()["value"].as_i64().unwrap();
    }
    assert_eq!(total, acked as i64);
}

/// A limit tally cannot keep is refused at start, with a message that
/// says why; so is a key lifetime out of range.
/// A reader outside tally (an operator's `sqlite3` session) holding a
/// snapshot while writes go on keeps the WAL from being written over from
/// its start, so it grows until the limit refuses writes. Once the reader
/// has gone, writes are taken again at once: the writer lets its
/// checkpoint take the WAL in and starts it over, cut back to 4 MiB.
/// Before, SQLite kept the WAL at its largest and the refused writes never
/// started it over: every write was `507` until a restart.
#[tokio::test]
async fn a_wal_grown_by_a_reader_outside_is_cut_back_once_it_has_gone() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let wal = dir.path().join("tally.db-wal");
    let env = [
        ("TALLY_DATABASE", db.to_str().unwrap()),
        ("TALLY_STORAGE_LIMIT", "12Mi"),
    ];
    let client = Client::new();
    let bin = Binary::start(&env);
    let r = keyed(&client, &bin, 0).await;
    assert_eq!(r.status(), StatusCode::OK);
    let reader = crate::helpers::reader_outside(&db).await;
    let next = Arc::new(AtomicUsize::new(1));
    let (acked, refused) = fill(&client, &bin, &next).await;
    let refused = problem(refused, StatusCode::INSUFFICIENT_STORAGE).await;
    assert_eq!(refused["type"], "/problems/storage-full", "{refused}");
    let grown = std::fs::metadata(&wal).unwrap().len();
    assert!(grown > 8 * MIB, "the WAL is what fills the limit: {grown}");
    // While the reader holds the WAL, refused writes write nothing: no
    // attempt to cut it back grows it.
    for n in 0..25 {
        let r = keyed(&client, &bin, 1_000_000 + n).await;
        assert_eq!(r.status(), StatusCode::INSUFFICIENT_STORAGE);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(std::fs::metadata(&wal).unwrap().len(), grown);
    drop(reader);

    let mut n = next.load(Ordering::Relaxed) + 100;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = keyed(&client, &bin, n).await;
        if r.status() == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still refused: {}",
            bin.log_text()
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let kept = std::fs::metadata(&wal).unwrap().len();
    assert!(kept <= 5 * MIB, "the WAL was not cut back: {kept}");
    assert!(
        bin.log_text().contains("the WAL was cut back to 4 MiB"),
        "{}",
        bin.log_text()
    );
    // Every acknowledged write, and nothing refused.
    let mut total = 0;
    for c in 0..16 {
        let r = client.get(bin.url(&format!("/counters/c{c}"))).send().await;
        let v: Value = r.unwrap().json().await.unwrap();
        total += v["value"].as_u64().unwrap();
    }
    assert_eq!(total, acked as u64 + 2);
}

#[tokio::test]
async fn bad_limits_and_lifetimes_are_refused_at_start() {
    let tally = env!("CARGO_BIN_EXE_tally");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    for (var, value, says) in [
        ("TALLY_STORAGE_LIMIT", "10GB", "is not a size"),
        ("TALLY_STORAGE_LIMIT", "1000", "at least 8Mi"),
        ("TALLY_IDEMPOTENCY_KEY_TTL", "0", "between 1s and 30d"),
        ("TALLY_IDEMPOTENCY_KEY_TTL", "1 day", "is not a duration"),
    ] {
        let out = std::process::Command::new(tally)
            .env_clear()
            .env("TALLY_DATABASE", &db)
            .env("TALLY_LISTEN", "127.0.0.1:0")
            .env(var, value)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {err}");
        assert!(err.contains(says), "{var}={value}: {err}");
    }
}

/// Past the limit every check is refused, the day's first call among
/// them, and it is that call that prunes a budget's days past retention:
/// a budget whose old days filled the room would never make any. The
/// writer prunes the old days of a budget whose check the limit refused,
/// a share at a time, and checks are counted again once the pages freed
/// are room (a kept day losing nothing).
#[tokio::test]
async fn past_the_limit_a_refused_checks_budget_prunes_its_old_days_to_make_room() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let client = Client::new();
    let check = async |bin: &Binary, visitor: &str| {
        client
            .post(bin.url("/budgets/b/check"))
            .json(&json!({"visitor": visitor}))
            .send()
            .await
            .unwrap()
    };
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str), ("TALLY_ADMIN_TOKEN", ADMIN)]);
    let r = client
        .put(bin.url("/budgets/b"))
        .bearer_auth(ADMIN)
        .json(&json!({"visitor_limit": 100, "global_limit": 100_000, "retention_days": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(check(&bin, "kept").await.status(), StatusCode::OK);
    bin.sigterm();
    assert_eq!(bin.wait(Duration::from_secs(20)).await.code(), Some(0));
    // A day long gone holding 12 MB of visitors: past an 8 MiB limit.
    behind(
        db_str,
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 300000)
         INSERT INTO budget_visitor_usage SELECT 'b', '2000-01-01', 'visitor-' || i, 1 FROM g;
         PRAGMA wal_checkpoint(TRUNCATE);",
    )
    .await;
    assert!(du(dir.path()) > 8 * MIB, "{}", du(dir.path()));

    let bin = Binary::start(&[
        ("TALLY_DATABASE", db_str),
        ("TALLY_ADMIN_TOKEN", ADMIN),
        ("TALLY_STORAGE_LIMIT", "8Mi"),
    ]);
    let r = check(&bin, "v").await;
    assert_eq!(r.headers()["retry-after"], "5");
    let body = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(body["reason"], "meter_error", "{body}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let d: Value = loop {
        let r = check(&bin, "kept").await;
        if r.status() == StatusCode::OK {
            break r.json().await.unwrap();
        }
        assert!(Instant::now() < deadline, "checks still refused after 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(d["visitor_calls"], 2, "{d}");
    // And the rest of the old day goes too.
    loop {
        let m = metrics(&client, &bin).await;
        if sample(&m, "tally_budget_pruned_rows_total") == Some(300_000.0) {
            break;
        }
        assert!(Instant::now() < deadline, "{m}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
