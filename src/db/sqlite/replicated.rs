//! A start under Litestream that finds no database of tally's refuses
//! where a database was served, rather than create an empty one.
//!
//! Under Litestream a new, empty database does not stay local: it is
//! replicated, and becomes the replica's latest state, which the next new
//! pod restores. A pod's first start finds nothing and creates the
//! database (a first deploy), and so would a container restarted in place
//! after the database file was deleted underneath it (tally exits at once
//! on that, and the kubelet restarts the container in the same pod, whose
//! volume keeps everything else and whose init container, the restore,
//! does not run again), or a new pod whose restore skipped over an empty
//! file left at the database's path: before, those starts served an empty
//! database and replicated it over the data.
//!
//! The mark (`.tally.db-replicated`) is written once a database was opened
//! under Litestream, and stays with the volume; its name starts with a dot,
//! so `rm tally.db*` and `rm -rf /data/*` leave it. Where it is, a start
//! without tally's database is refused. Where it is not, a file at the path
//! that is not tally's database is refused at once, and where there is no
//! file the replica itself is asked (`litestream ltx`): one that holds a
//! database, or cannot be asked, refuses the start; an empty one is a first
//! deploy.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{db::OpenError, restore::Litestream};

/// The mark beside `db`.
pub fn path(db: &Path) -> PathBuf {
    let mut name = std::ffi::OsString::from(".");
    name.push(db.file_name().unwrap_or_default());
    name.push("-replicated");
    db.with_file_name(name)
}

/// What a start found at the database's path instead of tally's database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// No file.
    Nothing,
    /// An empty file: what `sqlite3` leaves when asked about a missing
    /// database, and what a restore takes for a database and skips.
    EmptyFile,
    /// A file with no table of tally's: not a database tally served.
    NoTables,
}

/// Refuses, under Litestream, to start without tally's database where one
/// served under Litestream was (the mark says so), or where a file that is
/// not tally's database is at the path: Litestream, which starts first,
/// replicates whatever database is at the path (it makes one of an empty
/// file within a second), so tally must not make one of it. Where there is
/// no file and no mark, the replica was asked before
/// ([`ask_before_creating`]): without its answer that it holds nothing
/// (`replica_empty`), a missing database is refused too.
pub fn refuse_if_lost(
    db: &Path,
    found: Found,
    under_litestream: bool,
    replica_empty: bool,
) -> Result<(), OpenError> {
    if !under_litestream {
        return Ok(());
    }
    let what = what(found);
    let mark = path(db);
    if mark.exists() {
        return Err(refused_with_repair(
            db,
            format!(
                "{what}, but a database served under Litestream was here ({} says so)",
                mark.display()
            ),
        ));
    }
    if found == Found::Nothing {
        if replica_empty {
            return Ok(());
        }
        return Err(OpenError::Refused {
            path: db.to_owned(),
            reason: format!(
                "{what}, and the replica was not asked whether it holds a database: the file \
                 was there when this start looked, and is gone now (something else uses this \
                 directory). Start again once nothing else does: a start that finds no file \
                 asks the replica"
            ),
        });
    }
    Err(OpenError::Refused {
        path: db.to_owned(),
        reason: format!(
            "{what}, and Litestream, which started before tally, replicates whatever database \
             is at the path: tally does not make one of it, which could replace the replica's \
             data as its latest state. Look at what it is, remove it and start again (in \
             Kubernetes, delete the pod: a new volume has no such file, and the new pod's init \
             container restores the latest state; if Litestream had replicated this file, \
             restore to an instant before it with the chart's restore.timestamp instead): a \
             start that finds no file asks the replica whether it holds a database, and \
             creates one only where it holds none"
        ),
    })
}

/// Under Litestream, where there is no file at `db` and no mark: asks the
/// replica (`litestream ltx`, with the configuration Litestream replicates
/// with) whether it holds a database, before one is created. One that
/// holds a database refuses the start, and so does one that cannot be
/// asked (a directory emptied of every file, the mark too); an empty one
/// is a first start (`true`: a database may be created). Anywhere else
/// the opening decides ([`refuse_if_lost`]), and this answers `false`.
pub async fn ask_before_creating(
    db: &Path,
    litestream: impl FnOnce() -> Litestream,
) -> Result<bool, OpenError> {
    if std::fs::symlink_metadata(db).is_ok() || path(db).exists() {
        return Ok(false);
    }
    let ls = &litestream();
    let what = what(Found::Nothing);
    tracing::info!(
        path = %db.display(),
        config = %ls.config.display(),
        timeout = ?ls.timeout,
        "no database here: asking the replica whether it holds one before creating one; this \
         waits until the object store answers"
    );
    match replica_holds(db, ls).await {
        Ok(None) => Ok(true),
        Ok(Some(held)) => Err(refused_with_repair(
            db,
            format!("{what}, but the replica holds a database ({held})"),
        )),
        Err(e) => Err(OpenError::Refused {
            path: db.to_owned(),
            reason: format!(
                "{what}, and whether the replica holds a database cannot be told: {e}. Under \
                 Litestream tally asks before it creates a database (with the configuration \
                 its parent Litestream was given, and TALLY_LITESTREAM): a new, empty one \
                 would be replicated over the replica's data and become its latest state"
            ),
        }),
    }
}

fn what(found: Found) -> &'static str {
    match found {
        Found::Nothing => "it is missing",
        Found::EmptyFile => "it is an empty file",
        Found::NoTables => "it holds no table of tally's (another file took its place)",
    }
}

/// The refusal of a start where a database was lost: `why`, and how to put
/// it back.
fn refused_with_repair(db: &Path, why: String) -> OpenError {
    let mark = path(db);
    let and_mark = if mark.exists() {
        format!(", and remove {}", mark.display())
    } else {
        String::new()
    };
    OpenError::Refused {
        path: db.to_owned(),
        reason: format!(
            "{why}: a new, empty one would be replicated in its place and become the \
             replica's latest state. Put the database back from the replica first (the \
             runbook of TallyWriteErrors says how): in Kubernetes restore to the instant of \
             the loss (the chart's restore.timestamp) or delete the pod (a new pod's init \
             container restores the latest state into a new volume); elsewhere stop \
             Litestream, remove what is left at the database's path (a restore skips an \
             existing file, even an empty one), restore it with `tally restore-to` (or \
             `litestream restore`) and start again. To start empty on purpose, give \
             Litestream a replica path that holds nothing (LITESTREAM_PATH; the chart's \
             replica.path){and_mark}"
        ),
    }
}

/// One file of the replica, as `litestream ltx -json` lists it.
#[derive(Debug, Deserialize)]
struct LtxFile {
    max_txid: String,
    #[serde(default)]
    timestamp: String,
}

/// At most this much of what Litestream said goes into a refusal.
const SAID: usize = 1000;

/// What Litestream said, cut to [`SAID`] bytes.
fn said(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    match text.char_indices().nth(SAID) {
        Some((at, _)) => format!("{} (cut)", &text[..at]),
        None => text.to_owned(),
    }
}

/// What the replica of `db` holds, said in a few words (how many files,
/// the last transaction, when the newest was written); `None` when it holds
/// nothing.
async fn replica_holds(db: &Path, ls: &Litestream) -> Result<Option<String>, String> {
    let mut command = ls.command("ltx");
    command
        .args(["-level", "all", "-json", "--"])
        .arg(db)
        .stdin(std::process::Stdio::null());
    let out = tokio::time::timeout(ls.timeout, command.output())
        .await
        .map_err(|_| {
            format!(
                "`litestream ltx` gave no answer within {:?} (TALLY_REPLICA_WAIT_TIMEOUT): is the \
                 object store reachable?",
                ls.timeout
            )
        })?
        .map_err(|e| format!("cannot run {}: {e}", ls.binary.display()))?;
    if !out.status.success() {
        return Err(format!(
            "`litestream ltx -config {}` failed ({}): {}",
            ls.config.display(),
            out.status,
            said(&out.stderr)
        ));
    }
    let files: Vec<LtxFile> = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "`litestream ltx -json` answered what is not its list of files ({e}): {}",
            said(&out.stdout)
        )
    })?;
    // Litestream writes both as fixed-width text (hexadecimal, and UTC
    // RFC 3339), which sort as they compare.
    let last = files.iter().map(|f| f.max_txid.as_str()).max();
    let newest = files.iter().map(|f| f.timestamp.as_str()).max();
    Ok(last.map(|last| {
        format!(
            "{} files, up to transaction {last}, the newest written at {}",
            files.len(),
            newest.unwrap_or_default()
        )
    }))
}

/// Leaves the mark beside `db`, if it is not there yet, on disk before
/// tally serves. A mark that cannot be written is said and otherwise
/// ignored: it only protects a later start.
pub fn record(db: &Path) {
    let mark = path(db);
    if mark.exists() {
        return;
    }
    let text = format!(
        "tally served {} under Litestream. While this file is here and that database is not, \
         tally under Litestream refuses to start: a new, empty database would be replicated in \
         its place. (Where this file is gone too, tally asks the replica, and refuses where it \
         holds a database.)\n",
        db.file_name().unwrap_or_default().to_string_lossy()
    );
    let written = crate::restore::write_synced(&mark, text.as_bytes())
        .and_then(|()| crate::restore::sync_dir(db));
    if let Err(e) = written {
        tracing::warn!(
            error = %e,
            path = %mark.display(),
            "cannot leave the mark of a replicated database: a start that finds it gone would \
             create an empty one"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::restore::tests::litestream_that;

    fn refusal<T: std::fmt::Debug>(refused: Result<T, OpenError>) -> String {
        match refused {
            Err(OpenError::Refused { reason, .. }) => reason,
            other => panic!("must be refused: {other:?}"),
        }
    }

    /// A stand-in for Litestream that notes each call's arguments in
    /// `asked` and then runs `body`.
    fn noting(dir: &Path, body: &str) -> (Litestream, std::path::PathBuf) {
        let asked = dir.join("asked");
        let ls = litestream_that(dir, &format!("echo \"$@\" >> {}\n{body}", asked.display()));
        (ls, asked)
    }

    const FOUND: [(Found, &str); 3] = [
        (Found::Nothing, "it is missing"),
        (Found::EmptyFile, "it is an empty file"),
        (Found::NoTables, "no table of tally's"),
    ];

    /// Where the mark is, the start is refused, and the replica is not
    /// asked; without Litestream nothing is refused.
    #[tokio::test]
    async fn a_start_under_litestream_refuses_where_the_mark_is_and_the_database_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        assert_eq!(path(&db), dir.path().join(".tally.db-replicated"));
        let (mut ls, asked) = noting(dir.path(), "echo '[]'");
        ls.no_expand_env = true;
        assert!(
            ask_before_creating(&db, || ls.clone()).await.unwrap(),
            "a first start: the replica holds nothing"
        );
        assert!(refuse_if_lost(&db, Found::Nothing, true, true).is_ok());
        // Without the replica's answer (the file was there when the start
        // looked, and is gone at the opening), a missing database is not
        // created.
        let reason = refusal(refuse_if_lost(&db, Found::Nothing, true, false));
        assert!(reason.contains("the replica was not asked"), "{reason}");
        assert_eq!(
            std::fs::read_to_string(&asked).unwrap().trim(),
            format!(
                "ltx -config {} -no-expand-env -level all -json -- {}",
                ls.config.display(),
                db.display()
            )
        );
        std::fs::remove_file(&asked).unwrap();
        record(&db);
        let mark = std::fs::read_to_string(path(&db)).unwrap();
        assert!(mark.contains("tally.db under Litestream"), "{mark}");
        assert!(
            !ask_before_creating(&db, || ls.clone()).await.unwrap(),
            "the opening decides"
        );
        assert!(
            !asked.exists(),
            "the mark is enough: the replica is not asked"
        );
        for (found, says) in FOUND {
            assert!(
                refuse_if_lost(&db, found, false, false).is_ok(),
                "without Litestream an empty start replaces no replica"
            );
            let reason = refusal(refuse_if_lost(&db, found, true, true));
            assert!(reason.contains(says), "{reason}");
            assert!(reason.contains(".tally.db-replicated says so"), "{reason}");
            assert!(reason.contains("and remove"), "{reason}");
        }
        // Written once: a second record leaves it as it was.
        std::fs::write(path(&db), "kept").unwrap();
        record(&db);
        assert_eq!(std::fs::read_to_string(path(&db)).unwrap(), "kept");
    }

    /// Without the mark, a file that is not tally's database is refused,
    /// and the replica is not asked about it.
    #[tokio::test]
    async fn without_the_mark_a_file_that_is_not_a_database_of_tallys_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        let (ls, asked) = noting(dir.path(), "echo '[]'");
        std::fs::write(&db, "").unwrap();
        assert!(!ask_before_creating(&db, || ls.clone()).await.unwrap());
        assert!(!asked.exists(), "a file there: the replica is not asked");
        for (found, says) in &FOUND[1..] {
            let reason = refusal(refuse_if_lost(&db, *found, true, false));
            assert!(reason.contains(says), "{reason}");
            assert!(
                reason.contains("replicates whatever database is at the path"),
                "{reason}"
            );
        }
    }

    /// Without the mark and without a file (a directory emptied of every
    /// file), a replica that holds a database refuses the start, and so
    /// does one that cannot be asked.
    #[tokio::test]
    async fn without_the_mark_the_replica_is_asked_and_what_it_holds_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        let ls = litestream_that(
            dir.path(),
            r#"echo '[{"level":0,"min_txid":"0000000000000001","max_txid":"000000000000002a","size":567,"timestamp":"2026-12-05T04:39:11Z"},
{"level":9,"min_txid":"0000000000000001","max_txid":"0000000000000009","size":567,"timestamp":"2026-12-05T04:39:12Z"}]'"#,
        );
        let reason = refusal(ask_before_creating(&db, || ls.clone()).await);
        assert!(
            reason.contains(
                "it is missing, but the replica holds a database (2 files, up to transaction \
                 000000000000002a, the newest written at 2026-12-05T04:39:12Z)"
            ),
            "{reason}"
        );
        assert!(reason.contains("replica.path"), "{reason}");
        assert!(!reason.contains("and remove"), "{reason}");
        assert!(!path(&db).exists());

        let long = "x".repeat(5000);
        for (body, says) in [
            (
                "echo 'Error: config file not found: /etc/litestream.yml' >&2; exit 1".to_owned(),
                "failed (exit status: 1): Error: config file not found".to_owned(),
            ),
            (
                "echo 'Litestream v9'".to_owned(),
                "not its list of files".to_owned(),
            ),
            (
                format!("echo {long} >&2; exit 2"),
                format!("{} (cut)", &long[..SAID]),
            ),
            ("sleep 30".to_owned(), "gave no answer within 1s".to_owned()),
        ] {
            let mut ls = litestream_that(dir.path(), &body);
            ls.timeout = Duration::from_secs(1);
            let reason = refusal(ask_before_creating(&db, || ls.clone()).await);
            assert!(reason.contains(&says), "{reason}");
            assert!(reason.len() < 3 * SAID, "{reason}");
            assert!(
                reason.contains("whether the replica holds a database cannot be told"),
                "{reason}"
            );
        }
        let ls = Litestream {
            binary: dir.path().join("no-such-litestream"),
            config: dir.path().join("litestream.yml"),
            no_expand_env: false,
            timeout: Duration::from_secs(1),
        };
        let reason = refusal(ask_before_creating(&db, || ls.clone()).await);
        assert!(reason.contains("cannot run"), "{reason}");
    }
}
