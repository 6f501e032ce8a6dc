//! `tally restore-to`: fill an empty data directory with the database as it
//! was at an instant, from Litestream's replica, at most once per instant.
//!
//! A plain restore (`litestream restore -if-db-not-exists`) always brings
//! back the latest state. A restore to an instant undoes everything after
//! it, so the value that asks for it must not act twice: left set, every
//! later start on an empty volume (a new pod) would go back to the same
//! instant and silently lose everything written since. So the restore
//! records itself inside the database it restores
//! ([`crate::db::restores`]); the record is replicated with it, and a later
//! start finds it in the latest state and restores that instead.
//!
//! The steps, each with Litestream's own `restore`:
//! 1. the database exists: nothing (the same rule as a plain restore);
//! 2. the latest state, into a file beside the database: if it records a
//!    restore to this instant, it becomes the database (the value was left
//!    set; a warning says so);
//! 3. otherwise the restore to the instant, recorded in the database, and
//!    a marker file beside it that `tally serve` logs at its start.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};
use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::db::restores::{self, Restored};

/// Where to find Litestream and its configuration.
#[derive(Debug, Clone)]
pub struct Litestream {
    pub binary: PathBuf,
    pub config: PathBuf,
}

/// What `restore-to` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The database was there already: nothing was restored.
    DatabaseExists,
    /// The latest state already records this restore: it was restored
    /// instead (the value had been left set).
    AlreadyApplied(Restored),
    /// Restored to the instant.
    Restored(Restored),
}

/// The file beside the database that says it came from a restore to a
/// point in time; `tally serve` logs it once at its start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Marker {
    /// The instant asked for, RFC 3339 in UTC.
    pub target: String,
    /// Litestream's transaction id the database was restored to.
    pub txid: String,
    /// When the last restored transaction reached the replica.
    pub last_transaction_at: Option<String>,
    /// When the restore ran.
    pub restored_at: String,
}

/// `tally.db` -> `tally.db-restored.json`.
pub fn marker_path(db: &Path) -> PathBuf {
    let mut name = db.file_name().unwrap_or_default().to_os_string();
    name.push("-restored.json");
    db.with_file_name(name)
}

/// The marker beside `db`, if there is one that reads.
pub fn marker(db: &Path) -> Option<Marker> {
    let text = std::fs::read_to_string(marker_path(db)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Restores the database at `db` to `target` if the data directory has no
/// database yet (see the module's doc).
pub async fn restore_to(db: &Path, target: Timestamp, ls: &Litestream) -> anyhow::Result<Outcome> {
    let target_ts = target;
    let target = target.to_string();
    if db.exists() {
        tracing::info!(
            database = %db.display(),
            target,
            "the database exists: nothing restored (a restore only fills an empty data directory)"
        );
        return Ok(Outcome::DatabaseExists);
    }
    // Litestream restores the latest state for an instant it has not seen
    // yet: recorded and logged as a restore to that instant, a mistyped
    // year or time zone would look like a mistake undone.
    if target_ts > Timestamp::now() {
        bail!(
            "the instant {target} is in the future: a restore to a point in time undoes what \
             was written after an instant before now (the latest state is a plain restore)"
        );
    }
    if let Some(dir) = db.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }

    // 2. The latest state, to see whether it records this restore.
    let latest = beside(db, "-latest");
    remove_sqlite_files(&latest)?;
    litestream(ls, &["-o", path_str(&latest)?], db)
        .context("restoring the latest state (to check that this restore has not been made)")?;
    if let Some(done) = restores::find(&latest, &target)
        .await
        .context("reading the restores recorded in the latest state")?
    {
        std::fs::rename(&latest, db).context("moving the latest state into place")?;
        remove_sqlite_files(&latest)?;
        tracing::warn!(
            target = done.target,
            txid = done.txid,
            restored_at = done.restored_at,
            "this restore to a point in time was made already, and the database has changed \
             since: restored the latest state instead. Unset the restore timestamp \
             (restore.timestamp in the chart)"
        );
        return Ok(Outcome::AlreadyApplied(done));
    }
    remove_sqlite_files(&latest)?;

    // 3. The restore to the instant: what it will bring back, then do it.
    let plan: Plan = serde_json::from_slice(
        &litestream(ls, &["-dry-run", "-json", "-timestamp", &target], db)
            .context("planning the restore (is the instant within the replica's history?)")?,
    )
    .context("reading Litestream's restore plan")?;
    let last_transaction_at = plan.files.last().map(|f| f.timestamp.clone());
    // Into a file beside the database, recorded there, and only then moved
    // into place: a restore that fails (or is killed) before it is recorded
    // leaves no database, so the next start restores again rather than
    // serving, and replicating, a restore no later start would know of.
    let restoring = beside(db, "-restoring");
    remove_sqlite_files(&restoring)?;
    litestream(
        ls,
        &["-timestamp", &target, "-o", path_str(&restoring)?],
        db,
    )
    .context("restoring to the instant")?;
    let restored = Restored {
        target: target.clone(),
        txid: plan.max_txid.clone(),
        restored_at: Timestamp::now().to_string(),
    };
    restores::record(&restoring, &restored)
        .await
        .context("recording the restore in the database")?;
    std::fs::rename(&restoring, db).context("moving the restored database into place")?;
    remove_sqlite_files(&restoring)?;
    let marker = Marker {
        target,
        txid: restored.txid.clone(),
        last_transaction_at,
        restored_at: restored.restored_at.clone(),
    };
    std::fs::write(marker_path(db), serde_json::to_vec(&marker)?)
        .context("writing the restore marker")?;
    tracing::info!(
        target = marker.target,
        txid = marker.txid,
        last_transaction_at = marker.last_transaction_at,
        database = %db.display(),
        "restored to a point in time"
    );
    Ok(Outcome::Restored(restored))
}

/// Litestream's `restore -dry-run -json`, the parts used here.
#[derive(Deserialize)]
struct Plan {
    max_txid: String,
    files: Vec<PlanFile>,
}

#[derive(Deserialize)]
struct PlanFile {
    timestamp: String,
}

/// `litestream restore -config C ARGS DB`; its standard output, or an
/// error carrying what it said.
fn litestream(ls: &Litestream, args: &[&str], db: &Path) -> anyhow::Result<Vec<u8>> {
    // Litestream says nothing while the object store does not answer, and
    // waits for it: without this line a stuck restore leaves an empty log.
    tracing::info!(
        args = %args.join(" "),
        "asking Litestream for the replica; this waits until the object store answers"
    );
    let out = Command::new(&ls.binary)
        .arg("restore")
        .arg("-config")
        .arg(&ls.config)
        .args(args)
        .arg(db)
        .output()
        .with_context(|| format!("running {}", ls.binary.display()))?;
    if !out.status.success() {
        bail!(
            "litestream restore {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim(),
        );
    }
    Ok(out.stdout)
}

fn beside(db: &Path, suffix: &str) -> PathBuf {
    let mut name = db.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    db.with_file_name(name)
}

fn remove_sqlite_files(db: &Path) -> anyhow::Result<()> {
    for path in [
        db.to_path_buf(),
        beside(db, "-wal"),
        beside(db, "-shm"),
        beside(db, ".tmp"),
    ] {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", path.display()));
            }
            _ => {}
        }
    }
    Ok(())
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not UTF-8", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_sits_beside_the_database() {
        assert_eq!(
            marker_path(Path::new("/data/tally.db")),
            Path::new("/data/tally.db-restored.json")
        );
    }

    /// A stand-in for Litestream whose restore to an instant leaves a file
    /// that is not a database, so that recording the restore fails.
    fn failing_litestream(dir: &Path) -> Litestream {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join("litestream");
        std::fs::write(
            &script,
            r#"#!/bin/sh
out=""; ts=""; dry=""; last=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    -timestamp) ts="$2"; shift ;;
    -dry-run) dry=1 ;;
  esac
  last="$1"; shift
done
[ -n "$out" ] || out="$last"
if [ -n "$dry" ]; then echo '{"max_txid":"0000000000000002","files":[]}'; exit 0; fi
if [ -n "$ts" ]; then echo 'not a database at all, not even its header' > "$out"; exit 0; fi
: > "$out"
"#,
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        Litestream {
            binary: script,
            config: dir.join("litestream.yml"),
        }
    }

    /// A restore that cannot be recorded leaves no database: the next
    /// start tries again, instead of finding a database that is there and
    /// serving a restore no later start would know had been made.
    #[tokio::test]
    async fn a_restore_that_is_not_recorded_leaves_no_database() {
        let dir = tempfile::tempdir().unwrap();
        let ls = failing_litestream(dir.path());
        let db = dir.path().join("data").join("tally.db");
        let target: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        for _ in 0..2 {
            let e = restore_to(&db, target, &ls).await.unwrap_err();
            assert!(format!("{e:#}").contains("recording the restore"), "{e:#}");
            assert!(!db.exists(), "an unrecorded restore was left in place");
            assert!(marker(&db).is_none());
        }
    }

    /// An instant not reached yet is refused before anything is restored:
    /// Litestream would bring back the latest state, and it would be
    /// recorded and logged as a restore to that instant.
    #[tokio::test]
    async fn an_instant_in_the_future_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ls = failing_litestream(dir.path());
        let db = dir.path().join("data").join("tally.db");
        let target = Timestamp::now() + jiff::SignedDuration::from_hours(24 * 365);
        let e = restore_to(&db, target, &ls).await.unwrap_err();
        assert!(format!("{e:#}").contains("is in the future"), "{e:#}");
        assert!(!db.exists());
    }

    #[test]
    fn an_instant_is_named_once_in_utc() {
        let a: Timestamp = "2026-05-01T12:04:00+02:00".parse().unwrap();
        let b: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        assert_eq!(a.to_string(), b.to_string());
        assert_eq!(b.to_string(), "2026-05-01T10:04:00Z");
    }
}
