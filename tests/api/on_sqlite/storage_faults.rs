//! The disk under tally failing for real: a database file deleted or
//! replaced underneath the running binary, and a full file system (a small
//! tmpfs mounted by the test, which needs root). Each test is bounded in
//! time and cleans up (kills tally, unmounts) even when it fails.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

use tally::testing::cut;

use crate::helpers::{ADMIN, Binary, failed_start, problem};

/// A size-limited tmpfs on a fresh directory, unmounted when dropped.
pub(crate) struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    pub(crate) fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tally-test"])
            .arg(dir.path())
            .output()
            .expect("mount runs");
        assert!(
            out.status.success(),
            "cannot mount a tmpfs (these tests need root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { dir }
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a file until the file system is full; returns its path.
    pub(crate) fn fill(&self) -> PathBuf {
        let path = self.path().join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        for chunk in [1 << 16, 4096, 1] {
            let buf = vec![0u8; chunk];
            loop {
                match f.write(&buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                    Err(e) => panic!("filling the tmpfs: {e}"),
                }
            }
        }
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let umount = |lazy: bool| {
            let mut c = Command::new("umount");
            if lazy {
                c.arg("-l");
            }
            c.arg(self.dir.path()).status().is_ok_and(|s| s.success())
        };
        if !umount(false) {
            umount(true);
        }
    }
}

/// The database's three files.
pub fn db_files(db: &Path) -> [PathBuf; 3] {
    ["", "-wal", "-shm"].map(|s| {
        let mut p = db.as_os_str().to_owned();
        p.push(s);
        PathBuf::from(p)
    })
}

fn rm_database(db: &Path) {
    for f in db_files(db) {
        assert!(f.exists(), "{} should exist while tally runs", f.display());
        std::fs::remove_file(&f).unwrap();
    }
}

async fn increment(client: &Client, bin: &Binary, name: &str) -> reqwest::Response {
    client
        .post(bin.url(&format!("/counters/{name}")))
        .send()
        .await
        .unwrap()
}

async fn read(client: &Client, bin: &Binary, name: &str) -> i64 {
    let r = client
        .get(bin.url(&format!("/counters/{name}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.json::<Value>().await.unwrap()["value"].as_i64().unwrap()
}

/// The sample of `metric` whose labels include every one of `labels`.
async fn metric(client: &Client, bin: &Binary, metric: &str, labels: &[&str]) -> Option<f64> {
    let text = client
        .get(bin.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(metric))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The JSON log lines whose message starts with `message`.
fn logged(bin: &Binary, message: &str) -> Vec<Value> {
    bin.log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(message))
        })
        .collect()
}

/// [`logged`], once the line is there: the log reader may still be
/// catching up with a process that has just exited.
async fn logged_soon(bin: &Binary, message: &str) -> Vec<Value> {
    for _ in 0..250 {
        let lines = logged(bin, message);
        if !lines.is_empty() {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Vec::new()
}

/// Starts tally on `db` and says how it found the database: the log line
/// and `tally_database_new`.
async fn start_and_see_how_it_opened(db: &str, client: &Client) -> (Binary, bool) {
    let bin = Binary::start(&[("TALLY_DATABASE", db)]);
    let created = logged(&bin, "created a new, empty database");
    let opened = logged(&bin, "opened an existing database");
    assert_eq!(created.len() + opened.len(), 1, "{}", bin.log_text());
    let line = created.first().or(opened.first()).unwrap();
    assert_eq!(line["fields"]["path"], db);
    let new = !created.is_empty();
    assert_eq!(line["level"], if new { "WARN" } else { "INFO" });
    let gauge = metric(client, &bin, "tally_database_new", &[]).await;
    assert_eq!(gauge, Some(if new { 1.0 } else { 0.0 }));
    (bin, new)
}

/// `rm tally.db*` under a running tally: the next write is refused with
/// `503 storage-lost` (never a 200 into the unlinked file), readiness goes,
/// the error names the path, and tally exits non-zero so it is restarted.
/// The restart says plainly that it started empty.
#[tokio::test]
async fn a_deleted_database_refuses_writes_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let client = Client::new();

    let (bin, new) = start_and_see_how_it_opened(db_str, &client).await;
    assert!(new, "a first start creates the database");
    drop(bin);
    let (mut bin, new) = start_and_see_how_it_opened(db_str, &client).await;
    assert!(!new, "the second start finds the first one's database");

    for i in 1..=5 {
        let r = increment(&client, &bin, "gone").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.json::<Value>().await.unwrap()["value"], i);
    }
    rm_database(&db);
    let r = increment(&client, &bin, "gone").await;
    let retry_after = r.headers().get("retry-after").cloned();
    let body = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(body["type"], "/problems/storage-lost", "{body}");
    assert_eq!(retry_after.unwrap(), "5");
    // From here on tally is on its way out: whatever answers is not a 200.
    for path in ["/ready", "/counters/gone"] {
        let answer = match path {
            "/ready" => client.get(bin.url(path)).send().await,
            _ => client.post(bin.url(path)).send().await,
        };
        if let Ok(r) = answer {
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
        }
    }
    let status = bin.wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(1), "{}", bin.log_text());
    let lost = logged_soon(&bin, "the database file was deleted underneath tally").await;
    assert_eq!(lost.len(), 1, "{}", bin.log_text());
    assert_eq!(lost[0]["level"], "ERROR");
    assert_eq!(lost[0]["fields"]["path"], db_str);
    assert_eq!(
        logged_soon(&bin, "the writer stopped; shutting down")
            .await
            .len(),
        1
    );

    // What was in the deleted file is gone with it; the restart says that
    // it starts empty, and holds nothing answered after the delete.
    let (bin, new) = start_and_see_how_it_opened(db_str, &client).await;
    assert!(new, "the restart must say it created a new database");
    assert_eq!(read(&client, &bin, "gone").await, 0);
}

/// `: > tally.db` under a running tally: the file keeps its inode, and
/// SQLite would go on committing into the WAL beside a file whose pages
/// are gone (reads of them failed, and the next checkpoint would write a
/// database with holes). The next write is refused with `503
/// storage-lost`, and tally exits non-zero; nothing acknowledged after the
/// cut is answered as kept, and the restart does not serve what is left.
/// Cut short while no tally ran (the WAL checkpointed away), it is
/// refused at start too.
#[tokio::test]
async fn a_database_cut_short_in_place_refuses_writes_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let client = Client::new();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    for i in 1..=5 {
        let r = increment(&client, &bin, "cut").await;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.json::<Value>().await.unwrap()["value"], i);
    }
    assert!(std::fs::metadata(&db).unwrap().len() > 0);
    std::fs::File::create(&db).unwrap();
    let r = increment(&client, &bin, "cut").await;
    let body = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(body["type"], "/problems/storage-lost", "{body}");
    let status = bin.wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(1), "{}", bin.log_text());
    let lost = logged_soon(&bin, "the database file was cut short underneath tally").await;
    assert_eq!(lost.len(), 1, "{}", bin.log_text());
    assert_eq!(lost[0]["fields"]["path"], db_str);
    let stderr = failed_start(&[("TALLY_DATABASE", db_str)]);
    assert!(
        stderr.contains("it was found cut short while tally served it"),
        "{stderr}"
    );

    // Cut while stopped: a database of some pages, closed cleanly (its WAL
    // checkpointed into it and emptied), then cut in half.
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    for i in 0..300 {
        let r = increment(&client, &bin, &format!("name-of-some-length-{i}")).await;
        assert_eq!(r.status(), StatusCode::OK);
    }
    bin.sigterm();
    assert_eq!(bin.wait(Duration::from_secs(20)).await.code(), Some(0));
    let len = std::fs::metadata(&db).unwrap().len();
    assert!(len >= 4 * 4096, "{len}");
    let whole = dir.path().join("whole.db");
    std::fs::copy(&db, &whole).unwrap();
    cut(&db, len / 2);
    let stderr = failed_start(&[("TALLY_DATABASE", db_str)]);
    assert!(
        stderr.contains("the file is shorter than its own header says"),
        "{stderr}"
    );

    // Cut after a crash, with a WAL left beside it: shorter than its
    // header says is no proof then (a checkpoint stopped by a crash leaves
    // pages only the WAL holds), so every page is read, and the cut found.
    std::fs::copy(&whole, &db).unwrap();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    assert_eq!(
        increment(&client, &bin, "after").await.status(),
        StatusCode::OK
    );
    bin.signal(nix::sys::signal::Signal::SIGKILL);
    bin.wait(Duration::from_secs(10)).await;
    let wal = dir.path().join("tally.db-wal");
    assert!(std::fs::metadata(&wal).unwrap().len() > 0);
    let len = std::fs::metadata(&db).unwrap().len();
    let kept = [dir.path().join("db.kept"), dir.path().join("wal.kept")];
    std::fs::copy(&db, &kept[0]).unwrap();
    std::fs::copy(&wal, &kept[1]).unwrap();
    // Half of it: quick_check's own lines, or its error on a malformed
    // image; a byte, or two: not whole pages (quick_check passed those, and
    // a counter read wrong); into its header; all of it (SQLite would have
    // deleted the WAL as it made a new database in the empty file).
    for (cut_to, said) in [
        (
            len / 2,
            format!(
                "the file is shorter than its own header says ({} of",
                len / 2
            ),
        ),
        (
            len - 1,
            format!("the file is {} bytes long, not a whole number", len - 1),
        ),
        (
            len - 2,
            format!("the file is {} bytes long, not a whole number", len - 2),
        ),
        (
            50,
            "the file is 50 bytes long, too short for the header".to_owned(),
        ),
        (0, "the file is empty, with a WAL beside it".to_owned()),
    ] {
        std::fs::copy(&kept[0], &db).unwrap();
        std::fs::copy(&kept[1], &wal).unwrap();
        cut(&db, cut_to);
        let stderr = failed_start(&[("TALLY_DATABASE", db_str)]);
        let last = stderr.lines().last().unwrap();
        assert!(
            last.contains(&said) && last.contains("it has lost pages. Restore it"),
            "cut to {cut_to}: {stderr}"
        );
        if cut_to == len / 2 {
            assert!(
                last.contains("the WAL beside it does not make up for it")
                    || last.contains("cannot be read whole"),
                "{stderr}"
            );
        }
    }
    // Whole again, it is served, with every write.
    std::fs::copy(&kept[0], &db).unwrap();
    std::fs::copy(&kept[1], &wal).unwrap();
    let bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    assert_eq!(read(&client, &bin, "after").await, 1);
    assert_eq!(read(&client, &bin, "name-of-some-length-299").await, 1);
}

/// A `VACUUM` from another process shortens the database file at its
/// checkpoint: tally tells that from a cut by the file's header, and
/// reading the header must not drop SQLite's locks (on Linux, closing any
/// descriptor of a file drops every POSIX lock the process holds on it),
/// or the next outside connection to close takes itself for the last, and
/// checkpoints and deletes the WAL under tally.
#[tokio::test]
async fn a_vacuum_from_outside_is_no_cut_and_leaves_tally_its_locks() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    let client = Client::new();
    assert_eq!(
        increment(&client, &bin, "kept").await.status(),
        StatusCode::OK
    );
    // Another process (each step one, its connection closed as it ends):
    // half a megabyte more in the file, seen by tally's idle look, then
    // freed and given back by a VACUUM, checkpointed.
    let script = "import sqlite3, sys\n\
                  c = sqlite3.connect(sys.argv[1])\n\
                  c.executescript(sys.argv[2])\n\
                  print(c.execute('SELECT count(*) FROM counters').fetchone()[0])\n\
                  c.close()\n";
    let outside = |sql: &str| {
        let out = Command::new(crate::loopback::tool("python3"))
            .args(["-c", script])
            .arg(&db)
            .arg(sql)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    outside(
        "CREATE TABLE junk AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n \
         WHERE i < 500) SELECT randomblob(1000) AS b FROM n; PRAGMA wal_checkpoint(FULL);",
    );
    let longest = std::fs::metadata(&db).unwrap().len();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    outside("DROP TABLE junk; VACUUM; PRAGMA wal_checkpoint(FULL);");
    assert!(std::fs::metadata(&db).unwrap().len() < longest / 4);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // One more that only reads: were tally's locks gone, it would take
    // itself for the last connection, and checkpoint and delete the WAL.
    assert_eq!(outside(""), "1");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = increment(&client, &bin, "kept").await;
    assert_eq!(r.status(), StatusCode::OK, "{}", bin.log_text());
    assert_eq!(read(&client, &bin, "kept").await, 2);
    assert!(
        !bin.log_text().contains("underneath tally"),
        "{}",
        bin.log_text()
    );
    bin.sigterm();
    assert_eq!(bin.wait(Duration::from_secs(20)).await.code(), Some(0));
}

/// A second name of the database file (a hard link) escapes the lock
/// beside the first name and the WAL too: a tally started on it, beside
/// one serving the first, kept its writes in a WAL of its own, lost once
/// both stopped. A file with other names is refused at start, whichever.
#[tokio::test]
async fn a_database_file_with_another_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let client = Client::new();
    let bin = Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert_eq!(increment(&client, &bin, "a").await.status(), StatusCode::OK);
    let other = dir.path().join("other.db");
    std::fs::hard_link(&db, &other).unwrap();
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", other.to_str().unwrap())]);
    assert!(err.contains("2 names (hard links)"), "{err}");
    assert_eq!(increment(&client, &bin, "a").await.status(), StatusCode::OK);
    drop(bin);
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(err.contains("2 names (hard links)"), "{err}");
    std::fs::remove_file(&other).unwrap();
    // The name a restore stopped as it moved its file into place leaves
    // (`tally.db-restoring`, or `tally.db-latest`) is removed, as the
    // restore would have.
    for left in ["tally.db-restoring", "tally.db-latest"] {
        let left = dir.path().join(left);
        std::fs::hard_link(&db, &left).unwrap();
        let bin = Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
        assert_eq!(read(&client, &bin, "a").await, 2);
        assert!(!left.exists());
    }
    // A symbolic link is no name of the file's own: never the one removed
    // (it would remove the only copy), and a database reached through one
    // is refused (the lock and Litestream would go by the link's name,
    // SQLite's WAL by the file's).
    let moved = dir.path().join("tally.db-restoring");
    std::fs::rename(&db, &moved).unwrap();
    std::os::unix::fs::symlink(&moved, &db).unwrap();
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert!(err.contains("is a symbolic link"), "{err}");
    assert!(moved.exists());
    std::fs::remove_file(&db).unwrap();
    std::fs::rename(&moved, &db).unwrap();
    // A directory's links are not a file's names.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let err = crate::helpers::failed_start(&[("TALLY_DATABASE", sub.to_str().unwrap())]);
    assert!(err.contains("names a directory"), "{err}");
    let bin = Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    assert_eq!(read(&client, &bin, "a").await, 2);
}

/// Under load: no write sent after the files were deleted is acknowledged.
#[tokio::test]
async fn under_load_no_write_sent_after_the_delete_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let mut bin = Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    let deleted_at = Arc::new(std::sync::OnceLock::<Instant>::new());
    let acked = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (url, deleted_at, acked) =
                (bin.url("/counters/load"), deleted_at.clone(), acked.clone());
            tokio::spawn(async move {
                let client = Client::new();
                // (sent after the delete, status) of every answered request.
                let mut answers = Vec::new();
                let until = Instant::now() + Duration::from_secs(15);
                while Instant::now() < until {
                    let after = deleted_at.get().is_some();
                    match client.post(&url).send().await {
                        Ok(r) => {
                            if r.status() == StatusCode::OK {
                                acked.fetch_add(1, Ordering::Relaxed);
                            }
                            answers.push((after, r.status()));
                        }
                        Err(_) => break,
                    }
                }
                answers
            })
        })
        .collect();
    // Deleted in the middle of the load, however slow the machine is.
    let loaded = Instant::now() + Duration::from_secs(10);
    while acked.load(Ordering::Relaxed) < 100 && Instant::now() < loaded {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rm_database(&db);
    deleted_at.set(Instant::now()).unwrap();
    let status = bin.wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(1), "{}", bin.log_text());
    let mut answers = Vec::new();
    for c in clients {
        answers.extend(c.await.unwrap());
    }
    let ok_before = answers
        .iter()
        .filter(|(after, s)| !after && *s == StatusCode::OK)
        .count();
    let ok_after = answers
        .iter()
        .filter(|(after, s)| *after && *s == StatusCode::OK)
        .count();
    let refused = answers
        .iter()
        .filter(|(_, s)| *s == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    assert!(
        ok_before > 50,
        "too little load before the delete: {ok_before}"
    );
    assert_eq!(
        ok_after, 0,
        "writes sent after the delete were acknowledged"
    );
    assert!(refused > 0, "no write was refused: {answers:?}");
}

/// Nothing written, and the file is replaced (a restore over a running
/// tally): the idle writer notices it within seconds and tally exits.
#[tokio::test]
async fn an_idle_tally_notices_its_database_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let mut bin = Binary::start(&[("TALLY_DATABASE", db.to_str().unwrap())]);
    let copy = dir.path().join("copy.db");
    std::fs::copy(&db, &copy).unwrap();
    std::fs::rename(&copy, &db).unwrap();
    let started = Instant::now();
    let status = bin.wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(1), "{}", bin.log_text());
    assert!(started.elapsed() < Duration::from_secs(5));
    let lost = logged_soon(&bin, "the database file was replaced underneath tally").await;
    assert_eq!(lost.len(), 1, "{}", bin.log_text());
}

/// A full file system: writes answer `507 storage-full` with `Retry-After`
/// and are counted; reads and readiness stay; budget checks fail closed;
/// once space is freed writes succeed again without a restart, and every
/// acknowledged write is there (and nothing refused is), also after one.
#[tokio::test]
async fn a_full_disk_answers_507_and_recovers_when_space_is_freed() {
    let fs = Tmpfs::mount("16m");
    let db = fs.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str), ("TALLY_ADMIN_TOKEN", ADMIN)]);
    let client = Client::new();
    let r = client
        .put(bin.url("/budgets/b"))
        .bearer_auth(ADMIN)
        .json(&json!({"visitor_limit": 100, "global_limit": 1000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let mut acked = 0;
    for _ in 0..10 {
        assert_eq!(
            increment(&client, &bin, "full").await.status(),
            StatusCode::OK
        );
        acked += 1;
    }

    let filler = fs.fill();
    // The WAL's last page may still take a frame or two.
    let mut full = None;
    for _ in 0..100 {
        let r = increment(&client, &bin, "full").await;
        match r.status() {
            StatusCode::OK => acked += 1,
            _ => {
                full = Some(r);
                break;
            }
        }
    }
    let r = full.expect("writes kept succeeding on a full disk");
    assert_eq!(r.headers()["retry-after"], "5");
    let body = problem(r, StatusCode::INSUFFICIENT_STORAGE).await;
    assert_eq!(body["type"], "/problems/storage-full", "{body}");
    for _ in 0..5 {
        let r = increment(&client, &bin, "full").await;
        match r.status() {
            StatusCode::OK => acked += 1,
            _ => {
                problem(r, StatusCode::INSUFFICIENT_STORAGE).await;
            }
        }
    }
    // Reads and readiness are not writes.
    assert_eq!(read(&client, &bin, "full").await, acked);
    let ready = client.get(bin.url("/ready")).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    // A check cannot be counted, so it is denied.
    let r = client
        .post(bin.url("/budgets/b/check"))
        .json(&json!({"visitor": "v"}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_server_error(), "{}", r.status());
    assert_eq!(r.json::<Value>().await.unwrap()["allowed"], false);
    let counted = metric(
        &client,
        &bin,
        "tally_write_commands_total",
        &["command=\"increment\"", "result=\"storage_full\""],
    )
    .await;
    assert!(counted.is_some_and(|n| n >= 1.0), "{counted:?}");
    logged_soon(&bin, "the disk is full").await;
    assert_eq!(
        logged(&bin, "the disk is full").len(),
        1,
        "logged once, not per batch: {}",
        bin.log_text()
    );

    std::fs::remove_file(&filler).unwrap();
    // Said to be over once writes have met no full disk for 5 s (a full
    // disk fails only the writes that need room).
    let ended = "no write has met a full disk for 5 s";
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while logged(&bin, ended).is_empty() {
        let r = increment(&client, &bin, "full").await;
        assert_eq!(r.status(), StatusCode::OK, "after freeing space");
        acked += 1;
        assert!(std::time::Instant::now() < deadline, "{}", bin.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(read(&client, &bin, "full").await, acked);
    assert_eq!(logged(&bin, ended).len(), 1);
    assert_eq!(logged(&bin, "the disk is full").len(), 1);
    bin.sigterm();
    assert_eq!(bin.wait(Duration::from_secs(20)).await.code(), Some(0));

    let bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    assert_eq!(read(&client, &bin, "full").await, acked);
}

/// A new database on a disk too full to hold it: the start fails saying
/// so, once (SQLite itself says "disk is full" or, when the WAL's index
/// cannot grow, "disk I/O error"), and leaves nothing of the database (its lock file aside),
/// whichever step the space ran out at; never a database without tally's
/// tables at the path, which a start under Litestream refuses for good.
/// With space, the next start makes it whole and serves.
#[tokio::test]
async fn a_new_database_on_a_full_disk_leaves_nothing_half_made() {
    let fs = Tmpfs::mount("4m");
    let db = fs.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let filler = fs.fill();
    let full = std::fs::metadata(&filler).unwrap().len();
    // Space for nothing; for the file but not its tables; for the tables
    // but not the checkpoint that puts them into the file (a new database
    // takes about 190 KiB on its way).
    for free in [0, 16 << 10, 96 << 10, 160 << 10] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&filler)
            .unwrap()
            .set_len(full - free)
            .unwrap();
        let stderr = failed_start(&[("TALLY_DATABASE", db_str)]);
        let last = stderr.lines().last().unwrap();
        assert!(
            // All of it free again: what the attempt made is gone, and
            // no longer held open either.
            last.starts_with(&format!(
                "tally: the file system holding {} has {free} bytes free, too little for the \
                 database: free space there, then start again: ",
                fs.path().display()
            )),
            "with {free} bytes free: {stderr}"
        );
        for said in [
            "too little for the database",
            "database or disk is full",
            "disk I/O error",
        ] {
            assert!(last.matches(said).count() <= 1, "said once: {last}");
        }
        let mut left: Vec<String> = std::fs::read_dir(fs.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["filler", "tally.db.lock"], "with {free} bytes free");
    }
    // A refusal on that disk is no want of space, and is not told as one.
    std::fs::create_dir(&db).unwrap();
    let stderr = failed_start(&[("TALLY_DATABASE", db_str)]);
    assert!(
        stderr.contains("the database path names a directory"),
        "{stderr}"
    );
    assert!(!stderr.contains("too little for the database"), "{stderr}");
    std::fs::remove_dir(&db).unwrap();

    std::fs::remove_file(&filler).unwrap();
    let bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    assert_eq!(logged(&bin, "created a new, empty database").len(), 1);
    let client = Client::new();
    assert_eq!(
        increment(&client, &bin, "made").await.status(),
        StatusCode::OK
    );
    assert_eq!(read(&client, &bin, "made").await, 1);
}

/// SIGTERM while the disk is full: every accepted write is answered, the
/// final checkpoint cannot write its pages and is logged, and the exit is
/// still 0 (under Litestream a non-zero exit skips the final sync). Nothing
/// acknowledged is lost: it is all in the WAL.
#[tokio::test]
async fn sigterm_on_a_full_disk_logs_the_failed_checkpoint_and_exits_0() {
    let fs = Tmpfs::mount("16m");
    let db = fs.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    let client = Client::new();
    // New rows on new pages, so that the checkpoint has to grow the file.
    let names: Vec<String> = (0..300).map(|i| format!("{i:0>128}")).collect();
    for name in &names {
        assert_eq!(
            increment(&client, &bin, name).await.status(),
            StatusCode::OK
        );
    }
    let filler = fs.fill();
    let r = increment(&client, &bin, "one-more").await;
    let refused = r.status() == StatusCode::INSUFFICIENT_STORAGE;

    bin.sigterm();
    let status = bin.wait(Duration::from_secs(20)).await;
    assert_eq!(status.code(), Some(0), "{}", bin.log_text());
    assert_eq!(logged_soon(&bin, "stopped cleanly").await.len(), 1);
    let failed = logged(&bin, "final WAL checkpoint failed");
    assert_eq!(failed.len(), 1, "{}", bin.log_text());
    assert_eq!(failed[0]["level"], "ERROR");

    std::fs::remove_file(&filler).unwrap();
    let bin = Binary::start(&[("TALLY_DATABASE", db_str)]);
    for name in &names {
        assert_eq!(read(&client, &bin, name).await, 1, "{name}");
    }
    assert_eq!(
        read(&client, &bin, "one-more").await,
        if refused { 0 } else { 1 }
    );
}

/// A failure that lasts (here, tables dropped behind tally's back) fails
/// every request, each with its problem, but is logged once per place and
/// period with how many like lines were held back, not once per request.
#[tokio::test]
async fn a_lasting_database_failure_is_logged_once_not_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tally.db");
    let db_str = db.to_str().unwrap();
    let mut bin = Binary::start(&[("TALLY_DATABASE", db_str), ("TALLY_ADMIN_TOKEN", ADMIN)]);
    let client = Client::new();
    let r = client
        .put(bin.url("/budgets/b"))
        .bearer_auth(ADMIN)
        .json(&json!({"visitor_limit": 100, "global_limit": 100}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    crate::helpers::behind(
        db_str,
        "DROP TABLE budget_visitor_usage; DROP TABLE counters",
    )
    .await;
    let started = Instant::now();
    for i in 0..40 {
        let r = client
            .post(bin.url("/budgets/b/check"))
            .json(&json!({"visitor": format!("v{i}")}))
            .send()
            .await
            .unwrap();
        let p = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(
            (&p["allowed"], &p["reason"]),
            (&json!(false), &json!("meter_error"))
        );
        let r = client.post(bin.url("/counters/c")).send().await.unwrap();
        let p = problem(r, StatusCode::INTERNAL_SERVER_ERROR).await;
        assert_eq!(p["reason"], "database_error", "{p}");
    }
    // One line a place per 10 s began: on a slow machine the 80 requests
    // may span more than one.
    let most = 1 + (started.elapsed().as_secs() / 10) as usize;
    bin.sigterm();
    bin.wait(Duration::from_secs(20)).await;
    let log = bin.log_text();
    for line in [
        "\"message\":\"budget check failed; denying",
        "\"message\":\"database error",
    ] {
        let n = log.matches(line).count();
        assert!((1..=most).contains(&n), "{line}: {n} lines in\n{log}");
    }
}
