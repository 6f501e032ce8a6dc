//! The real binary failing to start, given a SQLite file path: a database
//! it cannot create, a bad setting, a port already in use; and `--help`.

#[tokio::test]
async fn startup_failures_exit_non_zero_with_a_message() {
    let mut bin = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .env_clear()
        .env("TALLY_DATABASE", "/dev/null/tally.db")
        .env("TALLY_LISTEN", "127.0.0.1:0")
        .output()
        .unwrap();
    assert_eq!(bin.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bin.stderr);
    assert!(err.contains("cannot create directory /dev/null"), "{err}");

    bin = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .env_clear()
        .env("TALLY_QUEUE_CAPACITY", "0")
        .output()
        .unwrap();
    assert_eq!(bin.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bin.stderr).contains("queue-capacity"));

    let help = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for env in [
        "TALLY_LISTEN",
        "TALLY_DATABASE",
        "TALLY_QUEUE_CAPACITY",
        "TALLY_SYNCHRONOUS",
        "TALLY_READERS",
        "TALLY_ADMIN_TOKEN",
        "TALLY_MAX_BATCH",
        "TALLY_DRAIN_TIMEOUT",
    ] {
        assert!(help.contains(env), "--help does not mention {env}");
    }
}

/// A port in use, for the API or for metrics, stops the start before the
/// database is opened: the listeners are bound only after the replica gate,
/// which can take minutes, and the address is tried first.
#[tokio::test]
async fn a_port_in_use_is_a_clear_startup_failure() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    let db = db.to_str().unwrap();
    for (name, said) in [
        ("TALLY_LISTEN", format!("cannot listen on {addr}")),
        (
            "TALLY_METRICS_LISTEN",
            format!("cannot listen on {addr} for metrics"),
        ),
    ] {
        let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db), (name, &addr)]);
        assert!(err.contains(&said), "{name}: {err}");
    }
    // One port for both, free: each alone could be bound.
    drop(taken);
    let wildcard = addr.replace("127.0.0.1", "0.0.0.0");
    let err = crate::helpers::failed_start(&[
        ("TALLY_DATABASE", db),
        ("TALLY_LISTEN", &wildcard),
        ("TALLY_METRICS_LISTEN", &addr),
    ]);
    assert!(err.contains("take the same port"), "{err}");
    assert!(!dir.path().join("t.db").exists(), "nothing was opened");
}

/// A log filter or format tally cannot use stops the start, with the
/// reason: a misspelt level (`warning`, which `RUST_LOG`'s syntax reads as
/// a target) used to start tally with no log at all, errors included, and
/// a misspelt format was ignored.
#[test]
fn log_settings_that_cannot_be_used_stop_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    let db = db.to_str().unwrap();
    for (name, value, said) in [
        ("TALLY_LOG", "warning", "names no level"),
        ("TALLY_LOG", "", "no directive"),
        ("TALLY_LOG", "warn,tally=loud", "names no level"),
        ("TALLY_LOG_FORMAT", "txt", "`json` or `text`"),
        ("TALLY_LOG_FORMAT", "JSON", "`json` or `text`"),
    ] {
        let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db), (name, value)]);
        assert!(
            err.contains(name) && err.contains(said),
            "{name}={value:?}: {err}"
        );
    }
    assert!(!dir.path().join("t.db").exists(), "nothing was opened");
}

/// A setting whose value is not UTF-8 is refused by name, before anything
/// is opened (clap's own refusal named no variable).
#[test]
fn a_setting_that_is_not_utf8_is_refused_by_name() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("t.db");
    for (name, value) in [
        ("TALLY_QUEUE_CAPACITY", &b"1\xff"[..]),
        ("TALLY_DATABASE", b"/tmp/\xfft.db"),
        ("TALLY_LOG", b"info\xc3"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .env_clear()
            .env("TALLY_LISTEN", "127.0.0.1:0")
            .env("TALLY_DATABASE", &db)
            .env(name, std::ffi::OsStr::from_bytes(value))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(
            err.contains(&format!("the value of {name} is not valid UTF-8")),
            "{name}: {err}"
        );
    }
    assert!(!db.exists(), "nothing was opened");
}

/// tally started on `env`'s database, with `kept` counted up to 1.
async fn kept_one(env: &[(&str, &str)]) -> crate::helpers::Binary {
    let bin = crate::helpers::Binary::start(env);
    let r = reqwest::Client::new()
        .post(bin.url("/counters/kept"))
        .send()
        .await;
    assert_eq!(r.unwrap().status(), reqwest::StatusCode::OK);
    bin
}

/// Starts tally on a new database, counts `kept` up to 1 and stops it;
/// runs `harm` on the database, after which a start must fail saying
/// `refusal`; then `mend`, after which tally serves `kept` at 1 again.
async fn refused_until_mended(harm: &'static str, refusal: &str, mend: &'static str) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let env = [("TALLY_DATABASE", db.to_str().unwrap())];
    let mut bin = kept_one(&env).await;
    bin.sigterm();
    bin.wait(std::time::Duration::from_secs(20)).await;
    drop(bin);

    let path = db.to_str().unwrap();
    crate::helpers::behind(path, harm).await;
    let stderr = crate::helpers::failed_start(&env);
    assert!(stderr.contains(refusal), "{stderr}");
    crate::helpers::behind(path, mend).await;
    let bin = crate::helpers::Binary::start(&env);
    let r = reqwest::get(bin.url("/counters/kept")).await.unwrap();
    assert_eq!(crate::helpers::json(r).await["value"], 1);
}

/// A database whose migrations are recorded but one of whose tables is
/// gone (dropped or renamed by hand) is refused at start, naming it:
/// before, tally started, said it was ready, and answered every request
/// that needed it 500. Put back, the data is served again.
#[tokio::test]
async fn a_database_missing_a_table_of_tallys_is_refused_at_start() {
    refused_until_mended(
        "ALTER TABLE counters RENAME TO counters_kept",
        "tally's table `counters` is missing",
        "ALTER TABLE counters_kept RENAME TO counters",
    )
    .await;
}

/// A table of tally's rebuilt without STRICT (by another tool) is refused
/// at start, named. Served, it took a REAL into a counter (one past the
/// largest integer, or written by hand), and every batch holding that
/// counter then committed and was answered `500` "nothing was written":
/// a client retrying on that counted twice.
#[tokio::test]
async fn a_table_rebuilt_without_strict_is_refused_at_start() {
    refused_until_mended(
        "CREATE TABLE loose (name TEXT NOT NULL PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
         INSERT INTO loose SELECT * FROM counters;
         ALTER TABLE counters RENAME TO counters_strict;
         ALTER TABLE loose RENAME TO counters;",
        "tally's table `counters` is not STRICT",
        "DROP TABLE counters; ALTER TABLE counters_strict RENAME TO counters;",
    )
    .await;
}

/// A reader outside tally holding a snapshot at the stop (an operator's
/// `sqlite3` session) holds up the final checkpoint a second, not the 5 s
/// writes wait: the stop is clean, says the WAL stays, and keeps well
/// within `TALLY_WRITER_DRAIN_TIMEOUT`. It waited 5 s, and the writer's
/// drain, also 5 s by default, was cut off and logged as a writer that
/// did not finish.
#[tokio::test]
async fn a_reader_outside_holds_the_final_checkpoint_a_second_only() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let env = [("TALLY_DATABASE", db.to_str().unwrap())];
    let mut bin = kept_one(&env).await;
    let reader = crate::helpers::reader_outside(&db).await;
    let started = std::time::Instant::now();
    bin.sigterm();
    let status = bin.wait(std::time::Duration::from_secs(20)).await;
    let took = started.elapsed();
    let log = bin.log_text();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(
        log.contains("final WAL checkpoint was blocked by a reader"),
        "{log}"
    );
    assert!(log.contains("stopped cleanly"), "{log}");
    assert!(took < std::time::Duration::from_millis(4500), "{took:?}");
    drop(reader);
}

/// A database a newer tally migrated (a rollback after an upgrade that
/// brought a migration) is served, with a warning naming what this tally
/// does not know; before, every start failed on it, and a rollback
/// crash-looped.
#[tokio::test]
async fn a_database_a_newer_tally_migrated_is_served() {
    use sqlx::{ConnectOptions, sqlite::SqliteConnectOptions};
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let env = [("TALLY_DATABASE", db.to_str().unwrap())];
    let bin = crate::helpers::Binary::start(&env);
    let r = reqwest::Client::new()
        .post(bin.url("/counters/kept"))
        .send()
        .await;
    assert_eq!(r.unwrap().status(), reqwest::StatusCode::OK);
    bin.sigterm();
    drop(bin);

    let mut conn = SqliteConnectOptions::new()
        .filename(&db)
        .connect()
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (99, 'a newer release', 1, x'00', 1)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    drop(conn);

    let bin = crate::helpers::Binary::start(&env);
    let v: serde_json::Value = reqwest::get(bin.url("/counters/kept"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["value"], 1);
    let logs = bin.log_text();
    assert!(
        logs.contains("migrations this tally does not know") && logs.contains("99"),
        "{logs}"
    );
    let mut bin = bin;
    bin.sigterm();
    bin.wait(std::time::Duration::from_secs(20)).await;

    // One that failed part way left a state no release was written for.
    crate::helpers::behind(
        db.to_str().unwrap(),
        "UPDATE _sqlx_migrations SET success = 0 WHERE version = 99",
    )
    .await;
    let stderr = crate::helpers::failed_start(&env);
    assert!(
        stderr.contains("migrations [99] of a newer tally failed part way"),
        "{stderr}"
    );
}
