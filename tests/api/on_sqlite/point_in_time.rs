//! Undoing a mistake from the replica: `tally restore-to` under the real
//! Litestream 0.5.17 and S3 server (moto) on loopback. The database comes
//! back exactly as it was at the instant; what is written after it reaches
//! the next plain restore; and the same restore asked for again (the value
//! left set) restores the latest state instead of going back again.

use std::{collections::BTreeMap, path::Path, time::Duration};

use nix::sys::signal::Signal;
use reqwest::{Client, StatusCode};
use serde_json::json;
use sqlx::{ConnectOptions, Connection, sqlite::SqliteConnectOptions};

use crate::{
    helpers::ADMIN,
    on_sqlite::replica_env::{Deployment, Running, S3, ended_within},
    replica,
};

/// Every counter and every budget usage row: the whole state a mistake can
/// change.
#[derive(Debug, PartialEq, Eq)]
struct State {
    counters: BTreeMap<String, i64>,
    usage: BTreeMap<String, i64>,
}

async fn state_of(path: &Path) -> State {
    let mut conn = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .connect()
        .await
        .unwrap();
    let integrity: String = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(integrity, "ok");
    let counters: Vec<(String, i64)> = sqlx::query_as("SELECT name, value FROM counters")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    let usage: Vec<(String, i64)> =
        sqlx::query_as("SELECT budget || '/' || day, calls FROM budget_global_usage")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    State {
        counters: counters.into_iter().collect(),
        usage: usage.into_iter().collect(),
    }
}

async fn increment(client: &Client, run: &Running, counter: &str, by: u32) {
    let r = client
        .post(run.url(&format!("/counters/{counter}")))
        .json(&json!({ "by": by }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

async fn check(client: &Client, run: &Running, n: usize) {
    for i in 0..n {
        let r = client
            .post(run.url("/budgets/api/check"))
            .json(&json!({ "visitor": format!("v{i}") }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}

async fn stop_cleanly(mut run: Running) {
    run.signal(Signal::SIGTERM);
    let status = run.wait(Duration::from_secs(40)).await;
    assert_eq!(status.code(), Some(0), "litestream: {}", run.log_text());
}

fn ok(out: std::process::Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    text
}

/// Waits until Litestream logs a level-1 compaction, so that what was
/// written after a restore has gone through compaction, not only into
/// level 0.
async fn wait_compaction_past(run: &Running, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    let start = run.logs.lock().unwrap().len();
    loop {
        let seen = run.logs.lock().unwrap()[start..]
            .iter()
            .any(|(_, l)| l.contains("compaction complete") && l.contains("\"level\":1"));
        if seen {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no level-1 compaction within {limit:?}: {}",
            run.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_to_an_instant_undoes_a_reset_and_bad_writes_once() {
    let s3 = S3::start().await;
    s3.create_bucket("pitr").await;
    let d = Deployment::new(&s3.endpoint, "pitr");
    let client = Client::new();

    // State A.
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    let metrics = run.url("/metrics");
    let before = replica::caught_up(&metrics, 0.0).await;
    let r = client
        .put(run.url("/budgets/api"))
        .bearer_auth(ADMIN)
        .json(&json!({"visitor_limit": 100, "global_limit": 100000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    increment(&client, &run, "orders", 40).await;
    increment(&client, &run, "signups", 7).await;
    check(&client, &run, 25).await;
    // The instant once the replica has all of A, well before the mistake.
    replica::holds_all_since(&metrics, before).await;
    let at = jiff::Timestamp::now().to_string();
    tokio::time::sleep(Duration::from_millis(2000)).await;

    // The mistake: a budget reset and ten minutes' worth of garbage.
    let r = client
        .post(run.url("/budgets/api/reset"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    for _ in 0..5 {
        increment(&client, &run, "orders", 1000).await;
        increment(&client, &run, "garbage", 1).await;
    }
    check(&client, &run, 3).await;
    stop_cleanly(run).await;
    d.wipe();
    ok(d.restore());
    let wrong = state_of(&d.db()).await;
    d.wipe();

    // The restore to the instant, into a directory where the operator
    // looked for the database with `sqlite3` (which leaves an empty file):
    // exactly A. Taken for a database, the empty file restored nothing,
    // and tally and Litestream made it the replica's latest state.
    std::fs::create_dir_all(d.db().parent().unwrap()).unwrap();
    std::fs::write(d.db(), b"").unwrap();
    let log = ok(d.restore_to(&at));
    assert!(log.contains("the database file is empty"), "{log}");
    assert!(log.contains("restored to a point in time"), "{log}");
    assert!(log.contains(&at), "{log}");
    assert!(log.contains("\"txid\""), "{log}");
    let a = state_of(&d.db()).await;
    let today = a.usage.keys().next().expect("a usage row in A").clone();
    assert_eq!(
        a,
        State {
            counters: [("orders".to_owned(), 40), ("signups".to_owned(), 7)].into(),
            usage: [(today.clone(), 25)].into(),
        },
        "the mistake's state was {wrong:?}"
    );
    let marker: serde_json::Value = serde_json::from_slice(
        &std::fs::read(d.db().with_file_name("tally.db-restored.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(marker["target"], at.as_str());

    // tally starts on it and says so; new writes after the restore.
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    assert!(
        run.line_of("the database comes from a restore to a point in time")
            .is_some(),
        "{}",
        run.log_text()
    );
    increment(&client, &run, "after", 3).await;
    check(&client, &run, 2).await;
    // Through a level-1 compaction: the replica's older, newer-numbered
    // history must not come back with it.
    wait_compaction_past(&run, Duration::from_secs(45)).await;
    stop_cleanly(run).await;
    let expected = State {
        counters: [
            ("orders".to_owned(), 40),
            ("signups".to_owned(), 7),
            ("after".to_owned(), 3),
        ]
        .into(),
        usage: [(today, 27)].into(),
    };

    // A plain restore of the latest state: A plus the new writes.
    d.wipe();
    ok(d.restore());
    assert_eq!(state_of(&d.db()).await, expected);

    // The same restore asked for again by hand: refused, nothing put in
    // place (going on to serve would serve the latest state as if it were
    // the undo).
    d.wipe();
    let by_hand = d.restore_to_by_hand(&at);
    let err = String::from_utf8_lossy(&by_hand.stderr);
    assert_eq!(by_hand.status.code(), Some(1), "{err}");
    assert!(
        err.lines()
            .last()
            .unwrap()
            .contains(&format!("a restore to {at} was made already"))
            && err.contains("nothing was put in place"),
        "{err}"
    );
    assert!(!d.db().exists());
    // And as the init container asks for it again (the value left set):
    // the latest state, not a second trip back in time.
    let log = ok(d.restore_to(&at));
    assert!(log.contains("was made already"), "{log}");
    assert_eq!(state_of(&d.db()).await, expected);
    assert!(!d.db().with_file_name("tally.db-restored.json").exists());

    // On a database that exists, nothing happens: the init container
    // (run again in the same pod) takes it as done, while by hand it
    // means the database was not moved aside, and the undo did not happen.
    let log = ok(d.restore_to(&at));
    assert!(log.contains("nothing restored (--at-every-start)"), "{log}");
    assert_eq!(state_of(&d.db()).await, expected);
    let by_hand = d.restore_to_by_hand(&at);
    let err = String::from_utf8_lossy(&by_hand.stderr);
    assert_eq!(by_hand.status.code(), Some(1), "{err}");
    assert!(
        err.lines().last().unwrap().starts_with(&format!(
            "tally: the database {} exists: nothing restored. A restore only fills an empty \
             data directory",
            d.db().display()
        )),
        "{err}"
    );
    assert_eq!(state_of(&d.db()).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_to_an_instant_before_any_backup_fails_and_leaves_nothing() {
    let s3 = S3::start().await;
    s3.create_bucket("pitr-early").await;
    let d = Deployment::new(&s3.endpoint, "pitr-early");
    let before = jiff::Timestamp::now().to_string();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let run = d.replicate();
    run.wait_serving(Duration::from_secs(30)).await;
    increment(&Client::new(), &run, "x", 1).await;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    stop_cleanly(run).await;
    d.wipe();
    let out = d.restore_to(&before);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("planning the restore"), "{err}");
    assert!(!d.db().exists(), "a failed restore must leave no database");
}

/// A restore stopped while Litestream waits on an object store that never
/// answers (the pod deleted during its init container, its terminal
/// closed, Ctrl-\\) ends at once, not at the end of the grace period, and
/// the Litestream it ran goes with it: none is left to write into the data
/// directory later, or to hold the restore's lock. (Left to its default, a
/// SIGHUP or SIGQUIT ended tally alone.)
#[tokio::test]
async fn a_stopped_restore_ends_at_once_and_takes_litestream_with_it() {
    for signal in [Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT] {
        let (mut restore, stderr, litestream_pid, dir) = stopped_restore(signal, &[]).await;
        let status = ends_within(&mut restore, Duration::from_secs(5), signal).await;
        let stderr = stderr.join().unwrap();
        assert_eq!(status.code(), Some(1), "{signal}: {stderr}");
        assert!(
            stderr.contains(&format!("stopped by {signal} while restoring")),
            "{stderr}"
        );
        let data = dir.path().join("data");
        assert!(!data.join("tally.db").exists());
        // Gone as the restore ends: a restore run again at once is not
        // refused for the lock the killed Litestream (or what it left) held.
        let lock = std::fs::File::open(data.join("tally.db.lock")).unwrap();
        lock.try_lock()
            .expect("the lock is free once the restore has ended");
        drop(lock);
        ended_within(litestream_pid, Duration::from_secs(5), "litestream").await;
    }
}

/// A restore run by hand under `nohup` goes on when its terminal closes:
/// a SIGHUP it was started ignoring is not taken for a stop.
#[tokio::test]
async fn a_restore_under_nohup_goes_on_through_a_hangup() {
    let (mut restore, stderr, litestream_pid, _dir) =
        stopped_restore(Signal::SIGHUP, &["nohup"]).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        restore.try_wait().unwrap().is_none(),
        "a SIGHUP under nohup stopped the restore"
    );
    nix::sys::signal::kill(litestream_pid, None).expect("its Litestream still runs");
    let tally = nix::unistd::Pid::from_raw(restore.id() as i32);
    nix::sys::signal::kill(tally, Signal::SIGTERM).unwrap();
    let status = ends_within(&mut restore, Duration::from_secs(5), Signal::SIGTERM).await;
    let stderr = stderr.join().unwrap();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("stopped by SIGTERM while restoring"),
        "{stderr}"
    );
    ended_within(litestream_pid, Duration::from_secs(5), "litestream").await;
}

/// A restore (started through `prefix`, which execs it) waiting on a
/// Litestream that never ends, sent `signal` once that Litestream runs:
/// the restore, its standard error as it will read once it ends, the
/// Litestream's pid and the directory it all lives in.
async fn stopped_restore(
    signal: Signal,
    prefix: &[&str],
) -> (
    std::process::Child,
    std::thread::JoinHandle<String>,
    nix::unistd::Pid,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    // As `waiting_litestream`, and what it leaves behind holds its
    // standard input, the restore's lock, for half a second more.
    let pid_file = dir.path().join("litestream.pid");
    let script = format!(
        "exec 3<&0\nsleep 0.5 <&3 &\necho $$ > {}\nexec sleep 120\n",
        pid_file.display()
    );
    let fake = fake_litestream(dir.path(), &script);
    let db = dir.path().join("data").join("tally.db");
    let restore = restore_to_with(&db, &fake);
    let mut command = match prefix.split_first() {
        Some((program, args)) => {
            let mut c = std::process::Command::new(program);
            c.args(args)
                .arg(restore.get_program())
                .args(restore.get_args())
                .envs(restore.get_envs().filter_map(|(k, v)| Some((k, v?))));
            c
        }
        None => restore,
    };
    let mut restore = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = restore.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
        text
    });
    let litestream_pid = started_litestream(&pid_file).await;
    let tally = nix::unistd::Pid::from_raw(restore.id() as i32);
    nix::sys::signal::kill(tally, signal).unwrap();
    (restore, stderr, litestream_pid, dir)
}

/// How `process` ended, failing unless it did within `limit` of `signal`.
async fn ends_within(
    process: &mut std::process::Child,
    limit: Duration,
    signal: Signal,
) -> std::process::ExitStatus {
    let stopped = std::time::Instant::now();
    loop {
        if let Some(status) = process.try_wait().unwrap() {
            return status;
        }
        assert!(stopped.elapsed() < limit, "{signal} ignored");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A Litestream that writes its pid to the file given back and waits two
/// minutes, as one does on an object store that never answers.
fn waiting_litestream(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let pid_file = dir.join("litestream.pid");
    let script = format!("echo $$ > {}\nexec sleep 120\n", pid_file.display());
    (fake_litestream(dir, &script), pid_file)
}

/// The pid [`waiting_litestream`] wrote, once it runs (within 10 s).
async fn started_litestream(pid_file: &Path) -> nix::unistd::Pid {
    let waited = std::time::Instant::now();
    loop {
        if let Ok(pid) = std::fs::read_to_string(pid_file)
            && let Ok(pid) = pid.trim().parse::<i32>()
        {
            return nix::unistd::Pid::from_raw(pid);
        }
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "litestream never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A stand-in for Litestream: a shell script at `dir/litestream`.
fn fake_litestream(dir: &Path, script: &str) -> std::path::PathBuf {
    let fake = dir.join("litestream");
    tally::testing::script(&fake, script);
    fake
}

/// A stand-in for Litestream that plans a restore of one file (with
/// `-dry-run`) and otherwise runs `then`, with `$out` the file to restore
/// into and `$ts` the instant asked for (empty for the latest state).
fn planning_litestream(dir: &Path, then: &str) -> std::path::PathBuf {
    fake_litestream(
        dir,
        &format!(
            r#"out=""; ts=""; prev=""
for a in "$@"; do
  case "$prev" in -o) out="$a";; -timestamp) ts="$a";; esac
  case "$a" in -dry-run) echo '{{"max_txid":"0000000000000003","files":[{{"timestamp":"2026-05-01T10:03:00Z"}}]}}'; exit 0;; esac
  prev="$a"
done
{then}"#
        ),
    )
}

/// `tally restore-to` into `db` with `litestream` as Litestream.
fn restore_to_with(db: &Path, litestream: &Path) -> std::process::Command {
    restore_to_at(db, litestream, "2026-05-01T10:04:00Z")
}

/// [`restore_to_with`] to the instant `timestamp`.
fn restore_to_at(db: &Path, litestream: &Path, timestamp: &str) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_tally"));
    c.env_clear()
        .env("TALLY_DATABASE", db)
        .args(["restore-to", "--timestamp", timestamp, "--litestream"])
        .arg(litestream);
    c
}

/// A tally started while a restore fills its directory is refused (before,
/// it started on an empty database, which the restore then replaced
/// underneath it, WAL left beside); and a restore is refused while a tally
/// serves the database.
#[tokio::test]
async fn a_restore_and_a_tally_never_share_a_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (fake, pid_file) = waiting_litestream(dir.path());
    let db = dir.path().join("data").join("tally.db");
    let mut restore = restore_to_with(&db, &fake)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let litestream = started_litestream(&pid_file).await;
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(
        err.contains("another process is using the database") && err.contains("tally.db.lock"),
        "{err}"
    );
    assert!(!db.exists(), "the refused start created no database");
    // Killed with SIGKILL, the restore leaves its Litestream running, and
    // that holds the lock until it ends too.
    restore.kill().unwrap();
    restore.wait().unwrap();
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(
        err.contains("another process is using the database"),
        "{err}"
    );
    nix::sys::signal::kill(litestream, Signal::SIGKILL).unwrap();
    ended_within(litestream, Duration::from_secs(5), "litestream").await;
    let bin = crate::helpers::Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    let out = restore_to_with(&db, &fake).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("a tally serving that database"), "{err}");
    let second = crate::helpers::failed_start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(
        second.contains("another process is using the database"),
        "{second}"
    );
    drop(bin);
}

/// A database that appears while the restore runs (a process that takes no
/// lock: an older tally, a tool) is left as it is: the restore fails and
/// says where the restored file is, instead of renaming it over the other.
#[tokio::test]
async fn a_database_that_appears_during_a_restore_is_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("data").join("tally.db");
    // The latest state and the restore: an empty file (an empty SQLite
    // database); the plan: one file. During the restore to the instant a
    // database appears in place.
    let fake = planning_litestream(
        dir.path(),
        &format!(
            r#": > "$out"
if [ -n "$ts" ]; then echo other > {}; fi
"#,
            db.display()
        ),
    );
    let out = restore_to_with(&db, &fake).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("a database appeared at"), "{err}");
    assert_eq!(std::fs::read_to_string(&db).unwrap(), "other\n");
    assert!(
        !db.with_file_name("tally.db-restored.json").exists(),
        "no marker for a restore that was not put in place"
    );
}

/// A restore stopped after it recorded the restored file and wrote its
/// marker, before it put the file in place: a start refuses to begin a new
/// database beside it (under Litestream, replicated as the latest state)
/// and says how to finish it; `restore-to` run again does.
#[tokio::test]
async fn a_start_after_a_restore_stopped_short_of_its_link_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("data").join("tally.db");
    let fake = planning_litestream(dir.path(), r#": > "$out""#);
    ok(restore_to_with(&db, &fake).output().unwrap());
    // The file back under its working name (a rename keeps the identity
    // the marker names): as a restore stopped just before its link leaves
    // the directory.
    let restoring = db.with_file_name("tally.db-restoring");
    std::fs::rename(&db, &restoring).unwrap();
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(
        err.contains("was stopped before it put the restored database in place")
            && err.contains("tally restore-to --timestamp 2026-05-01T10:04:00Z"),
        "{err}"
    );
    assert!(!db.exists(), "no database was begun");
    // Nor in an empty file there (what `sqlite3` leaves when asked about
    // a database that is not there), which no database is either.
    std::fs::write(&db, b"").unwrap();
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(
        err.contains("was stopped before it put the restored database in place"),
        "{err}"
    );
    assert_eq!(
        std::fs::metadata(&db).unwrap().len(),
        0,
        "no database was begun"
    );
    ok(restore_to_with(&db, &fake).output().unwrap());
    let bin = crate::helpers::Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(
        bin.log_text()
            .contains("the database comes from a restore to a point in time")
    );
}

/// A start says the database comes from a restore only where the database
/// bears the marker out: it records that restore inside itself. A marker
/// an earlier release wrote (naming no file) beside a database put in
/// place since, or one beside a database overwritten in place, is
/// removed, and nothing is said of a restore.
#[tokio::test]
async fn a_marker_the_database_does_not_record_is_removed_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("data").join("tally.db");
    let marker = db.with_file_name("tally.db-restored.json");
    let fake = planning_litestream(dir.path(), r#": > "$out""#);
    let says_restored = "the database comes from a restore to a point in time";
    let removed = "the database does not record that restore";
    let env = [("TALLY_DATABASE", db.to_str().unwrap())];
    // A start that removes the marker and says nothing of a restore.
    let start_removes_it = || {
        let bin = crate::helpers::Binary::start(&env);
        let log = bin.log_text();
        assert!(
            log.contains(removed) && !log.contains(says_restored),
            "{log}"
        );
        assert!(!marker.exists());
    };

    // An earlier release's marker beside a new database.
    ok(restore_to_with(&db, &fake).output().unwrap());
    let mut old: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&marker).unwrap()).unwrap();
    old.as_object_mut().unwrap().remove("file");
    std::fs::remove_file(&db).unwrap();
    std::fs::write(&marker, old.to_string()).unwrap();
    start_removes_it();

    // The restored file itself, its record dropped in place (as a
    // database copied over it by `sqlite3 .restore` leaves it).
    std::fs::remove_dir_all(db.parent().unwrap()).unwrap();
    ok(restore_to_with(&db, &fake).output().unwrap());
    let bin = crate::helpers::Binary::start(&env);
    assert!(bin.log_text().contains(says_restored));
    drop(bin);
    crate::helpers::behind(db.to_str().unwrap(), "DELETE FROM point_in_time_restores").await;
    assert!(marker.exists());
    start_removes_it();

    // A record that cannot be read (a value of the wrong type) does not
    // keep tally from starting: the marker is kept, unconfirmed.
    std::fs::remove_dir_all(db.parent().unwrap()).unwrap();
    ok(restore_to_with(&db, &fake).output().unwrap());
    crate::helpers::behind(
        db.to_str().unwrap(),
        "INSERT INTO point_in_time_restores VALUES (x'00', 'x', 'y')",
    )
    .await;
    let bin = crate::helpers::Binary::start(&env);
    let log = bin.log_text();
    assert!(
        log.contains("not confirmed") && !log.contains(says_restored),
        "{log}"
    );
    assert!(marker.exists());
}

/// A restore that runs out of room says so: the file system holding the
/// data directory is named as full, beside what failed (SQLite, writing
/// the record into the restored file's WAL, says only `disk I/O error`).
/// Nothing is put in place, so the next start, with room, restores again.
#[tokio::test]
async fn a_restore_on_a_full_disk_says_the_disk_is_full() {
    let disk = super::storage_faults::Tmpfs::mount("2m");
    let db = disk.path().join("data").join("tally.db");
    std::fs::create_dir_all(db.parent().unwrap()).unwrap();
    let tools = tempfile::tempdir().unwrap();
    let template = restored_template(tools.path()).await;
    // The restore to the instant fills the disk once its file is written,
    // as a database as large as the room left would.
    let filler = disk.path().join("filler");
    let full = tools.path().join("full");
    std::fs::write(&full, "").unwrap();
    let fake = planning_litestream(
        tools.path(),
        &format!(
            r#"cp {template} "$out" || exit 1
if [ -n "$ts" ] && [ -e {full} ]; then cat /dev/zero > {filler} 2>/dev/null; fi
exit 0
"#,
            template = template.display(),
            full = full.display(),
            filler = filler.display(),
        ),
    );
    let out = restore_to_with(&db, &fake).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "the file system holding {} is full",
            db.parent().unwrap().display()
        )),
        "{err}"
    );
    assert!(!db.exists(), "nothing put in place");
    // A refusal that wrote nothing is not put down to the disk.
    let out = restore_to_at(&db, &fake, "2999-01-01T00:00:00Z")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is in the future") && !err.contains("is full"),
        "{err}"
    );
    // With room again, the same restore goes through.
    std::fs::remove_file(&full).unwrap();
    std::fs::remove_file(&filler).unwrap();
    let out = restore_to_with(&db, &fake).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(db.exists());
}

/// However little room a restore leaves, what it puts in place is whole:
/// one that runs out of room while recording itself fails and puts
/// nothing in place. Before, with a few pages free, the checkpoint of the
/// record failed unseen as the connection closed, the WAL holding the rest
/// of it was deleted, and a damaged database was put in place with exit
/// 0: every start failed on it, and `restore-to` again, finding a
/// database, did nothing.
#[tokio::test]
async fn a_restore_short_of_room_never_puts_a_damaged_database_in_place() {
    let disk = super::storage_faults::Tmpfs::mount("2m");
    let data = disk.path().join("data");
    let db = data.join("tally.db");
    let tools = tempfile::tempdir().unwrap();
    let template = restored_template(tools.path()).await;
    // The restore to the instant leaves `room` bytes free.
    let (filler, room) = (disk.path().join("filler"), tools.path().join("room"));
    let fake = planning_litestream(
        tools.path(),
        &format!(
            r#"cp {template} "$out" || exit 1
if [ -n "$ts" ]; then cat /dev/zero > {filler} 2>/dev/null; truncate -s -"$(cat {room})" {filler}; fi
exit 0
"#,
            template = template.display(),
            filler = filler.display(),
            room = room.display(),
        ),
    );
    let mut restored = Vec::new();
    for kib in (0..=128).step_by(4) {
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(&room, (kib * 1024).to_string()).unwrap();
        let out = restore_to_with(&db, &fake).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => {
                let mut conn = SqliteConnectOptions::new()
                    .filename(&db)
                    .connect()
                    .await
                    .unwrap();
                let check: String = sqlx::query_scalar("PRAGMA integrity_check")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap_or_else(|e| panic!("{kib} KiB free: {e}; {err}"));
                assert_eq!(check, "ok", "{kib} KiB free: {err}");
                let records: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM point_in_time_restores")
                        .fetch_one(&mut conn)
                        .await
                        .unwrap();
                assert_eq!(records, 1, "{kib} KiB free");
                conn.close().await.unwrap();
            }
            // Named as what it is, whichever write found no room.
            Some(1) => assert!(
                !db.exists() && err.contains("is full"),
                "{kib} KiB free: {err}"
            ),
            other => panic!("{kib} KiB free: exit {other:?}: {err}"),
        }
        restored.push(out.status.success());
        std::fs::remove_dir_all(&data).unwrap();
        std::fs::remove_file(&filler).unwrap();
    }
    // The sweep crosses the edge: from too little room to enough.
    assert_eq!(
        (restored.first(), restored.last()),
        (Some(&false), Some(&true)),
        "{restored:?}"
    );
}

/// What Litestream restores, in `dir`: a database in WAL mode with some
/// rows.
async fn restored_template(dir: &Path) -> std::path::PathBuf {
    let template = dir.join("restored.db");
    let mut conn = SqliteConnectOptions::new()
        .filename(&template)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .connect()
        .await
        .unwrap();
    sqlx::query("CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2000)
         INSERT INTO counters SELECT 'c' || i, i FROM n",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    template
}
