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
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};
use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::db::{
    data_dir,
    restores::{self, Restored},
};

/// Where to find Litestream and its configuration.
#[derive(Debug, Clone)]
pub struct Litestream {
    pub binary: PathBuf,
    pub config: PathBuf,
    /// `-no-expand-env`: the configuration is read as written.
    pub no_expand_env: bool,
    /// Longest one call of Litestream may take.
    pub timeout: Duration,
}

impl Litestream {
    /// `litestream SUBCOMMAND -config C [-no-expand-env]`, killed when it
    /// is dropped; the caller adds the rest and runs it within `timeout`.
    pub(crate) fn command(&self, subcommand: &str) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .arg(subcommand)
            .arg("-config")
            .arg(&self.config)
            .args(self.no_expand_env.then_some("-no-expand-env"))
            .kill_on_drop(true);
        command
    }
}

/// The configuration file Litestream reads when given `given` (its
/// `-config`): else `LITESTREAM_CONFIG`, else `/etc/litestream.yml`.
pub fn config_path(given: Option<&Path>) -> PathBuf {
    given.map_or_else(
        || {
            std::env::var_os("LITESTREAM_CONFIG")
                .filter(|c| !c.is_empty())
                .map_or_else(|| PathBuf::from("/etc/litestream.yml"), PathBuf::from)
        },
        ToOwned::to_owned,
    )
}

/// What `restore-to` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A database was there already: nothing was restored (at every
    /// start only; by hand that is an error).
    DatabaseExists,
    /// The restore to this instant that an earlier run made is in place
    /// (that run stopped before it ended, or ended): nothing more to do.
    InPlace,
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
    /// The restored database file's identity ([`file_identity`]): a
    /// database put in its place since (a plain restore writes a new file)
    /// is not the restored one.
    #[serde(default)]
    pub file: Option<String>,
}

/// A file's inode and, where the file system keeps it, its birth time: an
/// inode number is reused as soon as its file is deleted.
fn file_identity(path: &Path) -> Option<String> {
    let m = std::fs::metadata(path).ok()?;
    let born = m
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos());
    Some(match born {
        Some(born) => format!("{}@{born}", m.ino()),
        None => m.ino().to_string(),
    })
}

/// `tally.db` -> `tally.db-restored.json`.
pub fn marker_path(db: &Path) -> PathBuf {
    let mut name = db.file_name().unwrap_or_default().to_os_string();
    name.push("-restored.json");
    db.with_file_name(name)
}

/// The marker beside `db`, if there is one that reads. A marker whose
/// database is gone describes a database that no longer exists: it is
/// removed (and said so), so that the new database started in its place is
/// never taken for the restored one.
pub fn marker(db: &Path) -> Option<Marker> {
    let path = marker_path(db);
    if !db.exists() {
        if path.exists() {
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::warn!(
                    marker = %path.display(),
                    "removed the marker of a restore whose database is gone"
                ),
                Err(e) => tracing::warn!(
                    marker = %path.display(),
                    error = %e,
                    "the marker of a restore whose database is gone could not be removed"
                ),
            }
        }
        return None;
    }
    let text = read_marker_file(&path)?;
    let marker: Marker = serde_json::from_str(&text).ok()?;
    if marker.file.is_some() && marker.file != file_identity(db) {
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(
                marker = %path.display(),
                target = marker.target,
                "removed the marker of a restore to a point in time: the database is not the \
                 file it restored (replaced since by a later restore, or copied)"
            ),
            Err(e) => tracing::warn!(
                marker = %path.display(),
                error = %e,
                "the marker of a restore whose database was replaced could not be removed"
            ),
        }
        return None;
    }
    Some(marker)
}

/// Says, once the database at `db` is open on `conn`, that it comes from
/// a restore to a point in time, if a marker says so and the database
/// bears it out: it records that very restore (instant, transaction and
/// time of the restore) inside itself. A marker the database does not bear
/// out is removed: one an earlier release wrote (naming no file) beside a
/// database put in place since, one beside a new file that took the
/// restored file's freed inode on a file system without birth times, one
/// beside a database overwritten in place.
pub async fn announce(db: &Path, conn: &mut sqlx::SqliteConnection) {
    let Some(m) = marker(db) else {
        return;
    };
    let recorded = match m.target.parse::<Timestamp>() {
        Ok(target) => match restores::recorded(conn, target).await {
            Ok(recorded) => recorded,
            // A line in the log is not worth a start: the marker is kept.
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    target = m.target,
                    "a marker names this database as restored to a point in time, but the \
                     restores it records could not be read: not confirmed (the marker is kept)"
                );
                return;
            }
        },
        Err(_) => None,
    };
    if recorded.is_some_and(|r| r.txid == m.txid && r.restored_at == m.restored_at) {
        tracing::info!(
            target = m.target,
            txid = m.txid,
            last_transaction_at = m.last_transaction_at,
            restored_at = m.restored_at,
            "the database comes from a restore to a point in time"
        );
        return;
    }
    let path = marker_path(db);
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!(
            marker = %path.display(),
            target = m.target,
            "removed the marker of a restore to a point in time: the database does not record \
             that restore (it was put in place, or overwritten, since)"
        ),
        Err(e) => tracing::warn!(
            marker = %path.display(),
            error = %e,
            "the marker of a restore the database does not record could not be removed"
        ),
    }
}

/// The text of the marker at `path`, if it is a plain file of a marker's
/// size: a pipe there would hold the start forever, a link to a device
/// would be read without end.
fn read_marker_file(path: &Path) -> Option<String> {
    let m = path.symlink_metadata().ok()?;
    if !m.is_file() || m.len() > 64 * 1024 {
        return None;
    }
    std::fs::read_to_string(path).ok()
}

/// The marker of a restore stopped before it put its file in place, if
/// that is what the directory holds: no database (or an empty file), and
/// the marker naming the restored, recorded file still under its working
/// name. Started on as if empty, tally would begin a new database beside
/// the restore asked for (and, under Litestream, replicate it as the latest
/// state).
pub fn unfinished(db: &Path) -> Option<Marker> {
    // An empty file is no database (`sqlite3` leaves one when asked about
    // a database that is not there); `restore-to` removes it.
    if db
        .symlink_metadata()
        .is_ok_and(|m| !(m.is_file() && m.len() == 0))
    {
        return None;
    }
    let text = read_marker_file(&marker_path(db))?;
    let marker: Marker = serde_json::from_str(&text).ok()?;
    let restoring = file_identity(&restoring_path(db))?;
    (marker.file.as_deref() == Some(restoring.as_str())).then_some(marker)
}

/// Restores the database at `db` to `target` if the data directory has no
/// database yet (see the module's doc). `at_every_start`: run at every
/// start of a pod (the chart's init container), where a database already
/// there is taken as done, and a restore to this instant already made is
/// the latest state's to stand for, which is restored instead; by hand
/// both are errors, and nothing is put in place.
pub async fn restore_to(
    db: &Path,
    target: Timestamp,
    ls: &Litestream,
    at_every_start: bool,
) -> anyhow::Result<Outcome> {
    restore_into(db, target, ls, at_every_start)
        .await
        .map_err(|e| {
            let dir = data_dir(db);
            let text = format!("{e:#}");
            let writing_failed = OUT_OF_ROOM.iter().any(|said| text.contains(said));
            match room_left(dir) {
                Some(free) if writing_failed && free < FULL_BELOW => e.context(format!(
                    "the file system holding {} is full ({free} bytes free): a restore needs room \
                 for a whole copy of the database and its WAL. Make room, or give the data \
                 directory more (the chart's persistence.sizeLimit), and start again",
                    dir.display()
                )),
                _ => e,
            }
        })
}

/// Below this much room a restore that failed to write names its file
/// system as full: SQLite, out of room for the shared-memory file beside
/// the restored database, says only `disk I/O error`.
const FULL_BELOW: u64 = 1 << 20;

/// What a write that ran out of room says: SQLite's `SQLITE_IOERR` and
/// `SQLITE_FULL`, and Go's (Litestream's) and Rust's `ENOSPC`.
const OUT_OF_ROOM: [&str; 4] = [
    "disk I/O error",
    "database or disk is full",
    "no space left on device",
    "No space left on device",
];

/// The bytes an unprivileged writer can still put on the file system
/// holding `dir`.
pub(crate) fn room_left(dir: &Path) -> Option<u64> {
    let s = rustix::fs::statvfs(dir).ok()?;
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}

async fn restore_into(
    db: &Path,
    target: Timestamp,
    ls: &Litestream,
    at_every_start: bool,
) -> anyhow::Result<Outcome> {
    let target_ts = target;
    let target = target.to_string();
    // Litestream restores the latest state for an instant it has not seen
    // yet, and for its zero time (0001-01-01T00:00:00Z, which it reads as no
    // instant at all): recorded and logged as a restore to that instant, a
    // mistyped year or time zone would look like a mistake undone. No
    // replica holds anything from before 1970. Checked first: a mistyped
    // instant is an error whether or not there is a database to restore.
    if target_ts > Timestamp::now() {
        bail!(
            "the instant {target} is in the future: a restore to a point in time undoes what \
             was written after an instant before now (the latest state is a plain restore)"
        );
    }
    if target_ts < Timestamp::UNIX_EPOCH {
        bail!(
            "the instant {target} is before 1970: no replica holds anything from then (is the \
             year mistyped?)"
        );
    }
    if let Some(dir) = db.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let lock = lock_restores(db)?;
    // An empty file holds no database (`sqlite3` leaves one when it is
    // asked about a database that is not there): taken for one, nothing
    // would be restored, tally would start on it as new, and Litestream
    // would ship that empty database as the replica's latest state.
    if std::fs::metadata(db).is_ok_and(|m| m.is_file() && m.len() == 0) {
        tracing::warn!(
            database = %db.display(),
            "the database file is empty (0 bytes, as `sqlite3` leaves when it opens a \
             database that is not there): removed, to restore in its place"
        );
        remove_file(db)?;
    }
    match db.symlink_metadata() {
        Ok(m) if m.is_dir() => bail!(
            "{} is a directory, not a database (a volume mounted on a file that was not \
             there makes one): move it aside and run this again",
            db.display()
        ),
        Ok(m) if !m.is_file() && !m.is_symlink() => bail!(
            "{} is not a regular file (a pipe, a socket or a device): no database; move it \
             aside and run this again",
            db.display()
        ),
        Ok(m) if m.is_symlink() => bail!(
            "{} is a symbolic link: tally serves no database through one (the lock, \
             Litestream and SQLite's WAL would go by different names); give the file's own \
             path",
            db.display()
        ),
        _ => {}
    }
    if db.exists() {
        return Ok(match marker(db) {
            // Run again (stopped before it ended, or not).
            Some(m) if m.target == target => {
                tracing::info!(
                    target,
                    txid = m.txid,
                    database = %db.display(),
                    "the database is the restore to this instant that an earlier run put in \
                     place: nothing more to do"
                );
                Outcome::InPlace
            }
            _ if at_every_start => {
                tracing::warn!(
                    database = %db.display(),
                    target,
                    "the database exists: nothing restored (--at-every-start)"
                );
                Outcome::DatabaseExists
            }
            // By hand, a database left in place means the undo did not
            // happen: the old state would be served and replicated as if
            // it had.
            _ => bail!(
                "the database {} exists: nothing restored. A restore only fills an empty data \
                 directory: stop tally and its Litestream, move the database and everything \
                 beside it aside (the directory, or where it is a mount point its contents, \
                 dot files included), then run this again (--at-every-start, as a pod's init \
                 container runs it, takes it as done)",
                db.display()
            ),
        });
    }
    // What a database leaves beside it belongs to it: SQLite would replay a
    // WAL left there over the restored file (the undo silently undone), and
    // Litestream would take its own state there for the restored file's.
    let left = present_leftovers(db);
    if !left.is_empty() {
        bail!(
            "the database {} is gone but {} of it is still there: a restore beside them would \
             be mixed with the database they belong to. Move the whole data directory aside \
             (or delete those too) and run this again",
            db.display(),
            left.join(", ")
        );
    }
    // A marker with no database describes one that is gone; the latest
    // state restored below writes none. What an earlier run that failed
    // left under the working names goes first: on a volume short of room,
    // a stale copy would fail this run too.
    remove_file(&marker_path(db))?;
    remove_sqlite_files(&restoring_path(db))?;

    // 2. The latest state, to see whether it records this restore.
    let latest = latest_path(db);
    remove_sqlite_files(&latest)?;
    match litestream_into(ls, &[], &latest, db, &lock).await {
        Ok(_) => {}
        // Before any instant is asked for: a replica with no backup at all
        // is the wrong place (a mistyped bucket or path, a release renamed),
        // not an instant outside its history.
        Err(e) if format!("{e:#}").contains(NO_BACKUPS) => bail!(
            "the replica holds no backup of this database (bucket {:?}, path {:?}, as \
             litestream.yml reads LITESTREAM_BUCKET and LITESTREAM_PATH): check them (the \
             chart's replica.bucket and replica.path; the path defaults to \
             <namespace>/<release>). Do not just unset the restore: tally would start an empty database and \
             replicate it to that place. ({e:#})",
            std::env::var("LITESTREAM_BUCKET").unwrap_or_default(),
            std::env::var("LITESTREAM_PATH").unwrap_or_default(),
        ),
        Err(e) => {
            return Err(e.context(
                "restoring the latest state (to check that this restore has not been made)",
            ));
        }
    }
    if let Some(done) = restores::find(&latest, target_ts)
        .await
        .context("reading the restores recorded in the latest state")?
    {
        if !at_every_start {
            remove_sqlite_files(&latest)?;
            bail!(
                "a restore to {target} was made already (to transaction {}, at {}), and the \
                 latest state records it: this instant is taken as done, and nothing was put \
                 in place. To go back to it again, restore to an instant a second earlier",
                done.txid,
                done.restored_at
            );
        }
        put_in_place(&latest, db).context("moving the latest state into place")?;
        tidy(&latest);
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
    let plan = match litestream(ls, &["-dry-run", "-json", "-timestamp", &target], db, &lock).await
    {
        Ok(plan) => plan,
        Err(e) if killed(&e) => return Err(e.context("planning the restore")),
        Err(e) => {
            return Err(e.context(
                "planning the restore (is the instant within the replica's history? it holds \
                 backups, so an instant it has nothing before is older than the history it \
                 keeps)",
            ));
        }
    };
    let plan: Plan = serde_json::from_slice(&plan).context("reading Litestream's restore plan")?;
    let last_transaction_at = plan.files.last().map(|f| f.timestamp.clone());
    // Into a file beside the database, recorded there, and only then moved
    // into place: a restore that fails (or is killed) before it is recorded
    // leaves no database, so the next start restores again rather than
    // serving, and replicating, a restore no later start would know of.
    // (Cleared of an earlier run's copy as this one started.)
    let restoring = restoring_path(db);
    litestream_into(ls, &["-timestamp", &target], &restoring, db, &lock)
        .await
        .context("restoring to the instant")?;
    let restored = Restored {
        target: target.clone(),
        txid: plan.max_txid.clone(),
        restored_at: Timestamp::now().to_string(),
    };
    restores::record(&restoring, &restored)
        .await
        .context("recording the restore in the database")?;
    // SQLite keeps a WAL it could not checkpoint as it closed: without it
    // the file is not whole.
    if std::fs::metadata(beside(&restoring, "-wal")).is_ok_and(|m| m.len() > 0) {
        bail!(
            "recording the restore in the database: the record is still in the WAL after closing"
        );
    }
    // The marker first, naming the restored file (a link into place keeps
    // its identity): a restore stopped once the file is in place, before
    // it ends, still leaves it. One whose file never got there is removed
    // (by the next restore, or at the next start: its database is absent
    // or another).
    let marker = Marker {
        target,
        txid: restored.txid.clone(),
        last_transaction_at,
        restored_at: restored.restored_at.clone(),
        file: file_identity(&restoring),
    };
    let marker_at = marker_path(db);
    write_synced(&marker_at, &serde_json::to_vec(&marker)?)
        .context("writing the restore marker")?;
    if let Err(e) = put_in_place(&restoring, db) {
        if file_identity(db) != marker.file {
            let _ = std::fs::remove_file(&marker_at);
        }
        return Err(e.context("moving the restored database into place"));
    }
    tidy(&restoring);
    // The link and the marker's name, on disk before this says it is done:
    // a power cut after the restore ended would otherwise leave tally to
    // start on no database, or on one without its marker. (The file itself
    // was written whole, and synced, by Litestream and SQLite.)
    if let Err(e) = sync_dir(db) {
        tracing::warn!(
            error = %e,
            "the restore is in place, but its directory could not be synced (a power cut now \
             could leave the start without it, and the next start restores again)"
        );
    }
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

/// Litestream ended by a signal from outside (an operator's `kill`, the
/// kernel out of memory, a stop sent to the process group): not an answer
/// about the replica.
#[derive(Debug, thiserror::Error)]
#[error(
    "litestream restore {args} {}: nothing was restored in place{}",
    how_killed(*.signal),
    if .said.is_empty() { String::new() } else { format!(" (it said: {})", .said) }
)]
struct Killed {
    args: String,
    signal: i32,
    /// Its standard error, trimmed.
    said: String,
}

/// What a signal that ended Litestream says of who sent it.
fn how_killed(signal: i32) -> String {
    match signal {
        9 => "was killed (SIGKILL) from outside this restore: by hand, or by the kernel out of \
              memory (in a pod, the init container's memory limit)"
            .to_owned(),
        2 | 15 => format!(
            "was stopped by {} (sent to it, or to its process group: Ctrl-C, the container \
             stopping)",
            if signal == 2 { "SIGINT" } else { "SIGTERM" }
        ),
        4 | 6 | 7 | 8 | 11 => format!("crashed (signal {signal})"),
        _ => format!("was killed by signal {signal} from outside this restore"),
    }
}

/// Whether `e` is a Litestream killed from outside ([`Killed`]).
fn killed(e: &anyhow::Error) -> bool {
    e.chain().any(|e| e.is::<Killed>())
}

/// `litestream restore -o OUT ...`, which must leave a file at `out`: one
/// that says it succeeded and wrote nothing (another program under its
/// name, a configuration that names another database) is said to have.
async fn litestream_into(
    ls: &Litestream,
    args: &[&str],
    out: &Path,
    db: &Path,
    lock: &std::fs::File,
) -> anyhow::Result<()> {
    let mut all = args.to_vec();
    all.extend(["-o", path_str(out)?]);
    litestream(ls, &all, db, lock).await?;
    if !out.is_file() {
        bail!(
            "litestream restore {} said it succeeded but wrote no file at {}: is {} \
             Litestream, and does {} name this database ({})?",
            all.join(" "),
            out.display(),
            ls.binary.display(),
            ls.config.display(),
            db.display()
        );
    }
    Ok(())
}

/// What Litestream says when the replica holds nothing for the database.
const NO_BACKUPS: &str = "no matching backup files available";

/// The lock file beside `db` that one process at a time holds: `tally
/// serve` for as long as it runs, and `tally restore-to` for as long as it
/// or a Litestream it started runs. Two restores into one directory would
/// remove each other's files, and one could move the other's half-restored
/// file into place; a tally started during a restore would have its
/// database replaced underneath it; and two tallies on one file would each
/// answer reads from the values it committed itself. The file stays:
/// removed, a process that had opened it would hold a lock nobody else
/// takes. `None` when another process holds it.
pub fn lock_database(db: &Path) -> anyhow::Result<Option<std::fs::File>> {
    let path = lock_path(db);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}

/// Where a restore to an instant writes the database before it is moved
/// into place: `tally.db` -> `tally.db-restoring`.
fn restoring_path(db: &Path) -> PathBuf {
    beside(db, "-restoring")
}

/// Where a restore writes the replica's latest state, moved into place
/// when it records the restore asked for: `tally.db` -> `tally.db-latest`.
fn latest_path(db: &Path) -> PathBuf {
    beside(db, "-latest")
}

/// The names a restore moves into place as `db` ([`put_in_place`]: a
/// link, then the old name removed): a restore stopped between the two
/// leaves one of them on the database.
pub fn names_moved_into_place(db: &Path) -> [PathBuf; 2] {
    [restoring_path(db), latest_path(db)]
}

/// `tally.db` -> `tally.db.lock`.
pub fn lock_path(db: &Path) -> PathBuf {
    beside(db, ".lock")
}

fn lock_restores(db: &Path) -> anyhow::Result<std::fs::File> {
    match lock_database(db)? {
        Some(lock) => Ok(lock),
        None => bail!(
            "another process is using {} (it holds {}): a tally serving that database, \
             another `tally restore-to`, or a `litestream restore` one started and that \
             outlived it (a tally killed with SIGKILL leaves it running). A restore fills an \
             empty data directory with no tally running: stop the tally, or wait for the \
             restore to end, and run this again",
            db.display(),
            lock_path(db).display()
        ),
    }
}

/// Links the file at `from` into place as `db` (its name `from` is removed
/// after, by [`tidy`]), unless something has put a database there since
/// the start of the restore (or left its WAL there): a process that does
/// not take the lock (an older tally, a tool). A link fails where a rename
/// would replace.
fn put_in_place(from: &Path, db: &Path) -> anyhow::Result<()> {
    let left = present_leftovers(db);
    if !left.is_empty() {
        bail!(
            "{} appeared beside the database during the restore: something else uses this \
             directory. Nothing was put in place; the restored file is left at {}",
            left.join(", "),
            from.display()
        );
    }
    match std::fs::hard_link(from, db) {
        Ok(()) => {
            #[cfg(test)]
            if tests::STOP_AFTER_LINK.get() {
                bail!("stopped after the link, as a test asked");
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => bail!(
            "a database appeared at {} during the restore: something else (a tally started \
             meanwhile?) uses this directory. It was left as it is; the restored file is at {}",
            db.display(),
            from.display()
        ),
        Err(e) => Err(e).with_context(|| format!("moving {} into place", from.display())),
    }
}

/// `litestream restore -config C ARGS DB`; its standard output, or an
/// error carrying what it said. It is killed when this is dropped (a stop)
/// or takes longer than the timeout. A tally killed with SIGKILL leaves it
/// running, as any process leaves its children (in a container, the
/// container's end takes it too): it is given the restore `lock`, so that
/// no other restore runs into the same directory until it has ended.
async fn litestream(
    ls: &Litestream,
    args: &[&str],
    db: &Path,
    lock: &std::fs::File,
) -> anyhow::Result<Vec<u8>> {
    // Its standard input, which a restore never reads: a descriptor of the
    // lock's own open file, it holds the lock for as long as Litestream
    // (or anything it leaves behind) has it open, and no other process
    // gets it.
    let held = lock.try_clone().context("handing the restore lock on")?;
    // Litestream says nothing while the object store does not answer, and
    // waits for it: without this line a stuck restore leaves an empty log.
    tracing::info!(
        args = %args.join(" "),
        timeout = ?ls.timeout,
        "asking Litestream for the replica; this waits until the object store answers"
    );
    let mut command = ls.command("restore");
    command.args(args).arg(db).stdin(held);
    let out = tokio::time::timeout(ls.timeout, command.output())
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "litestream restore {} took longer than {:?} (TALLY_RESTORE_TIMEOUT): is the \
                 object store answering, and without errors (Litestream retries a 500 or 503 \
                 quietly)? Nothing was restored in place",
                args.join(" "),
                ls.timeout
            )
        })?
        .with_context(|| format!("running {}", ls.binary.display()))?;
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&out.status) {
        return Err(Killed {
            args: args.join(" "),
            signal,
            said: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        }
        .into());
    }
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

/// Writes `bytes` to a new file at `path`, on disk before it returns.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Syncs the directory holding `db`: the names made and removed in it.
pub(crate) fn sync_dir(db: &Path) -> std::io::Result<()> {
    std::fs::File::open(data_dir(db))?.sync_all()
}

pub(crate) fn beside(db: &Path, suffix: &str) -> PathBuf {
    let mut name = db.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    db.with_file_name(name)
}

/// Removes the working name `from` a file was put in place under, and what
/// SQLite left beside it. The database is in place by then: a name that
/// cannot be removed is said, and left to the next start (which removes a
/// second name of its database left by a restore).
fn tidy(from: &Path) {
    if let Err(e) = remove_sqlite_files(from) {
        tracing::warn!(
            error = format!("{e:#}"),
            "the restored database is in place, but its working name could not be removed \
             (the next start removes it)"
        );
    }
}

fn remove_sqlite_files(db: &Path) -> anyhow::Result<()> {
    for path in [
        db.to_path_buf(),
        beside(db, "-wal"),
        beside(db, "-shm"),
        beside(db, ".tmp"),
    ] {
        remove_file(&path)?;
    }
    Ok(())
}

/// What a database at `db` leaves beside it: SQLite's WAL and its index,
/// and Litestream's local state (`.NAME-litestream`).
fn leftovers(db: &Path) -> [PathBuf; 3] {
    let mut state = std::ffi::OsString::from(".");
    state.push(db.file_name().unwrap_or_default());
    state.push("-litestream");
    [
        beside(db, "-wal"),
        beside(db, "-shm"),
        db.with_file_name(state),
    ]
}

/// Those of [`leftovers`] that are there, by path.
fn present_leftovers(db: &Path) -> Vec<String> {
    leftovers(db)
        .into_iter()
        // A symbolic link counts even when it leads nowhere: SQLite and
        // Litestream would follow it.
        .filter(|p| p.symlink_metadata().is_ok())
        .map(|p| p.display().to_string())
        .collect()
}

/// Removes the file at `path`, if there is one. A directory there is not
/// one of the restore's files: never removed, and said so.
fn remove_file(path: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(path) {
        Err(_) if path.symlink_metadata().is_ok_and(|m| m.is_dir()) => bail!(
            "{} is a directory: the restore keeps its own files under that name. Move the \
             directory aside (or out of the data directory) and run this again",
            path.display()
        ),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not UTF-8", p.display()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Makes [`put_in_place`] stop right after its link, as a restore
        /// killed there would (on this thread: a test's runtime).
        pub(super) static STOP_AFTER_LINK: std::cell::Cell<bool> =
            const { std::cell::Cell::new(false) };
    }

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
        let binary = dir.join("litestream");
        crate::testing::script(
            &binary,
            r#"out=""; ts=""; dry=""; last=""
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
        );
        Litestream {
            binary,
            config: dir.join("litestream.yml"),
            no_expand_env: false,
            timeout: Duration::from_secs(30),
        }
    }

    /// A stand-in for Litestream that runs `body` (a shell script).
    pub(crate) fn litestream_that(dir: &Path, body: &str) -> Litestream {
        let binary = dir.join("litestream");
        crate::testing::script(&binary, body);
        Litestream {
            binary,
            config: dir.join("litestream.yml"),
            no_expand_env: false,
            timeout: Duration::from_secs(30),
        }
    }

    /// One restore into a directory at a time: a second started while the
    /// first's Litestream runs is refused at once and touches nothing; once
    /// the first has ended, the next runs.
    #[tokio::test]
    async fn a_second_restore_into_one_directory_is_refused_while_the_first_runs() {
        let dir = tempfile::tempdir().unwrap();
        let (started, release) = (dir.path().join("started"), dir.path().join("release"));
        let ls = litestream_that(
            dir.path(),
            &format!(
                "touch {}; while [ ! -e {} ]; do sleep 0.02; done; exit 1",
                started.display(),
                release.display()
            ),
        );
        let db = dir.path().join("data").join("tally.db");
        let at: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        let first = tokio::spawn({
            let (db, ls) = (db.clone(), ls.clone());
            async move { restore_to(&db, at, &ls, true).await }
        });
        while !started.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let e = restore_to(&db, at, &ls, true).await.unwrap_err();
        assert!(
            format!("{e:#}").contains("another process is using"),
            "{e:#}"
        );
        std::fs::write(&release, b"").unwrap();
        let e = first.await.unwrap().unwrap_err();
        assert!(format!("{e:#}").contains("litestream restore"), "{e:#}");
        let e = restore_to(&db, at, &ls, true).await.unwrap_err();
        assert!(format!("{e:#}").contains("litestream restore"), "{e:#}");
    }

    /// A Litestream that outlives its restore (its tally killed with
    /// SIGKILL; here a process it left behind) holds the directory's lock
    /// until it ends: no other restore writes beside it meanwhile.
    #[tokio::test]
    async fn a_litestream_left_running_keeps_its_directory_locked() {
        let dir = tempfile::tempdir().unwrap();
        // What it leaves behind holds its standard input (a shell gives an
        // asynchronous list /dev/null for it, hence the copy).
        let ls = litestream_that(dir.path(), "exec 3<&0; (sleep 2 >/dev/null 2>&1) & exit 1");
        let db = dir.path().join("data").join("tally.db");
        let at: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        let e = restore_to(&db, at, &ls, true).await.unwrap_err();
        assert!(format!("{e:#}").contains("litestream restore"), "{e:#}");
        let e = restore_to(&db, at, &ls, true).await.unwrap_err();
        assert!(
            format!("{e:#}").contains("another process is using"),
            "{e:#}"
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let e = restore_to(&db, at, &ls, true).await.unwrap_err();
            if format!("{e:#}").contains("litestream restore") {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{e:#}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An object store that takes the connection and never answers holds
    /// Litestream forever: the restore gives up at its timeout, says what
    /// to look at, and leaves no database.
    #[tokio::test]
    async fn a_restore_that_never_ends_gives_up_at_its_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let mut ls = litestream_that(dir.path(), "exec sleep 60");
        ls.timeout = Duration::from_millis(300);
        let db = dir.path().join("data").join("tally.db");
        let started = std::time::Instant::now();
        let e = restore_to(&db, "2026-05-01T10:04:00Z".parse().unwrap(), &ls, true)
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(format!("{e:#}").contains("TALLY_RESTORE_TIMEOUT"), "{e:#}");
        assert!(!db.exists());
    }

    /// A replica with no backup at all is the wrong place, not an instant
    /// outside its history: said so, with where it looked, before any
    /// instant is asked for.
    #[tokio::test]
    async fn an_empty_replica_is_named_as_the_wrong_place() {
        let dir = tempfile::tempdir().unwrap();
        let ls = litestream_that(
            dir.path(),
            "echo 'Error: no matching backup files available' >&2; exit 1",
        );
        let db = dir.path().join("data").join("tally.db");
        let e = restore_to(&db, "2026-05-01T10:04:00Z".parse().unwrap(), &ls, true)
            .await
            .unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains("holds no backup of this database"), "{e}");
        assert!(
            e.contains("LITESTREAM_PATH") && e.contains("Do not just unset"),
            "{e}"
        );
        assert!(!db.exists());
    }

    /// A mistyped instant is an error even where there is nothing to
    /// restore: by hand, "nothing restored" would read as done.
    #[tokio::test]
    async fn a_bad_instant_is_refused_beside_a_database_too() {
        let dir = tempfile::tempdir().unwrap();
        let ls = failing_litestream(dir.path());
        let db = dir.path().join("tally.db");
        std::fs::write(&db, b"a database").unwrap();
        let future = Timestamp::now() + jiff::SignedDuration::from_hours(24);
        let e = restore_to(&db, future, &ls, true).await.unwrap_err();
        assert!(format!("{e:#}").contains("is in the future"), "{e:#}");
        let past: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        assert_eq!(
            restore_to(&db, past, &ls, true).await.unwrap(),
            Outcome::DatabaseExists
        );
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
            let e = restore_to(&db, target, &ls, true).await.unwrap_err();
            assert!(format!("{e:#}").contains("recording the restore"), "{e:#}");
            assert!(!db.exists(), "an unrecorded restore was left in place");
            assert!(marker(&db).is_none());
        }
    }

    /// A stand-in for Litestream whose restores leave an empty file (an
    /// empty database to SQLite); `then` runs after the restore to the
    /// instant, with `$db` the database's path.
    fn empty_litestream(dir: &Path, then: &str) -> Litestream {
        litestream_that(
            dir,
            &format!(
                r#"out=""; ts=""; dry=""; db=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    -timestamp) ts="$2"; shift ;;
    -dry-run) dry=1 ;;
    -config) shift ;;
    *) db="$1" ;;
  esac
  shift
done
if [ -n "$dry" ]; then echo '{{"max_txid":"0000000000000002","files":[]}}'; exit 0; fi
: > "$out"
if [ -n "$ts" ]; then
{then}
fi
exit 0"#
            ),
        )
    }

    /// The marker names the restored file, so it is the database's once the
    /// file is in place (it is written before, and a restore stopped between
    /// the two still leaves it); a restore whose file could not be put in
    /// place (a database appeared meanwhile) leaves no marker beside that
    /// other database.
    #[tokio::test]
    async fn the_marker_names_the_restored_file_and_only_it() {
        let dir = tempfile::tempdir().unwrap();
        let target: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        let db = dir.path().join("a").join("tally.db");
        let ls = empty_litestream(dir.path(), ":");
        let Outcome::Restored(r) = restore_to(&db, target, &ls, true).await.unwrap() else {
            panic!("not restored")
        };
        let m = marker(&db).expect("a marker");
        assert_eq!((m.txid, m.file), (r.txid, file_identity(&db)));

        // Stopped before the link (here: the link undone): the directory
        // says so, until a rerun finishes the restore.
        let db = dir.path().join("d").join("tally.db");
        STOP_AFTER_LINK.set(true);
        let stopped = restore_to(&db, target, &ls, true).await;
        STOP_AFTER_LINK.set(false);
        assert!(stopped.is_err());
        assert!(unfinished(&db).is_none(), "the file is in place");
        std::fs::remove_file(&db).unwrap();
        let m = unfinished(&db).expect("an unfinished restore");
        assert_eq!(m.target, target.to_string());
        assert!(matches!(
            restore_to(&db, target, &ls, true).await.unwrap(),
            Outcome::Restored(_)
        ));
        assert!(unfinished(&db).is_none());
        assert!(marker(&db).is_some());

        // Stopped right after the link, before its working name is removed
        // or it returns: the marker is there already and names the
        // database; run again, the restore finds it in place.
        let db = dir.path().join("c").join("tally.db");
        STOP_AFTER_LINK.set(true);
        let stopped = restore_to(&db, target, &ls, true).await;
        STOP_AFTER_LINK.set(false);
        assert!(stopped.is_err());
        let m = marker(&db).expect("a marker as the file is put in place");
        assert_eq!(m.file, file_identity(&db));
        assert_eq!(m.file, file_identity(&restoring_path(&db)));
        assert_eq!(
            restore_to(&db, target, &ls, true).await.unwrap(),
            Outcome::InPlace
        );
        assert!(marker(&db).is_some());

        let db = dir.path().join("b").join("tally.db");
        let ls = empty_litestream(dir.path(), r#"echo another > "$db""#);
        let e = restore_to(&db, target, &ls, true).await.unwrap_err();
        assert!(format!("{e:#}").contains("a database appeared"), "{e:#}");
        assert_eq!(std::fs::read(&db).unwrap(), b"another\n");
        assert!(!marker_path(&db).exists());
    }

    /// A directory under one of the names the restore works with is
    /// nobody's file to remove: the restore stops, says which, and leaves
    /// it as it is.
    #[tokio::test]
    async fn a_directory_under_a_working_name_is_named_and_left() {
        for name in [
            "tally.db-latest",
            "tally.db-restoring",
            "tally.db-restored.json",
        ] {
            let dir = tempfile::tempdir().unwrap();
            let ls = empty_litestream(dir.path(), ":");
            let db = dir.path().join("tally.db");
            let there = dir.path().join(name);
            std::fs::create_dir(&there).unwrap();
            std::fs::write(there.join("kept"), b"x").unwrap();
            let target: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
            let e = restore_to(&db, target, &ls, true).await.unwrap_err();
            let e = format!("{e:#}");
            assert!(e.contains(&format!("{name} is a directory")), "{e}");
            assert!(there.join("kept").exists());
            assert!(!db.exists());
        }
        // At the database's own name (a volume mounted on a file that was
        // not there): not "the database exists, nothing restored".
        let dir = tempfile::tempdir().unwrap();
        let ls = empty_litestream(dir.path(), ":");
        let db = dir.path().join("tally.db");
        std::fs::create_dir(&db).unwrap();
        let target: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        let e = format!(
            "{:#}",
            restore_to(&db, target, &ls, true).await.unwrap_err()
        );
        assert!(e.contains("tally.db is a directory, not a database"), "{e}");
    }

    /// A Litestream killed from outside is said to have been, not taken
    /// for an answer about the replica (an instant outside its history);
    /// one that says it succeeded and wrote nothing is named, not left to
    /// SQLite's "unable to open database file".
    #[tokio::test]
    async fn a_litestream_killed_or_writing_nothing_is_said_so() {
        let target: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        let ls = litestream_that(
            dir.path(),
            r#"case "$*" in *-dry-run*) kill -9 $$ ;; esac
out=""; while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
: > "$out""#,
        );
        let e = format!(
            "{:#}",
            restore_to(&db, target, &ls, true).await.unwrap_err()
        );
        assert!(
            e.contains("planning the restore: litestream restore -dry-run")
                && e.contains("was killed (SIGKILL) from outside"),
            "{e}"
        );
        assert!(!e.contains("history"), "{e}");
        assert!(!db.exists());
        let ls = litestream_that(dir.path(), "kill -TERM $$");
        let e = format!(
            "{:#}",
            restore_to(&db, target, &ls, true).await.unwrap_err()
        );
        assert!(e.contains("was stopped by SIGTERM"), "{e}");
        assert!(!e.contains("memory"), "{e}");
        let ls = litestream_that(dir.path(), "echo 'panic: out of range' >&2; kill -SEGV $$");
        let e = format!(
            "{:#}",
            restore_to(&db, target, &ls, true).await.unwrap_err()
        );
        assert!(
            e.contains("crashed (signal 11)") && e.contains("it said: panic: out of range"),
            "{e}"
        );

        let ls = litestream_that(dir.path(), "exit 0");
        let e = format!(
            "{:#}",
            restore_to(&db, target, &ls, true).await.unwrap_err()
        );
        assert!(e.contains("said it succeeded but wrote no file at"), "{e}");
        assert!(e.contains("tally.db-latest"), "{e}");
        assert!(!db.exists());
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
        let e = restore_to(&db, target, &ls, true).await.unwrap_err();
        assert!(format!("{e:#}").contains("is in the future"), "{e:#}");
        assert!(!db.exists());
    }

    /// Litestream reads its zero time as no instant, and restores the
    /// latest state: every instant before 1970 is refused before it is
    /// asked.
    #[tokio::test]
    async fn an_instant_before_1970_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ls = failing_litestream(dir.path());
        let db = dir.path().join("data").join("tally.db");
        for t in [
            "0001-01-01T00:00:00Z",
            "0001-01-01T05:00:00+05:00",
            "1969-12-31T23:59:59Z",
        ] {
            let e = restore_to(&db, t.parse().unwrap(), &ls, true)
                .await
                .unwrap_err();
            assert!(format!("{e:#}").contains("before 1970"), "{t}: {e:#}");
            assert!(!db.exists());
        }
    }

    /// A WAL, its index or Litestream's state left by a database that is
    /// gone stops the restore, and is left as it was: SQLite would replay
    /// the WAL over the restored file.
    #[tokio::test]
    async fn what_a_gone_database_left_stops_the_restore() {
        for left in ["tally.db-wal", "tally.db-shm", ".tally.db-litestream"] {
            let dir = tempfile::tempdir().unwrap();
            let ls = failing_litestream(dir.path());
            let data = dir.path().join("data");
            std::fs::create_dir(&data).unwrap();
            let db = data.join("tally.db");
            let path = data.join(left);
            match left.ends_with("-litestream") {
                true => std::fs::create_dir(&path).unwrap(),
                false => std::fs::write(&path, b"the old database's").unwrap(),
            }
            let target: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
            let e = restore_to(&db, target, &ls, true).await.unwrap_err();
            let e = format!("{e:#}");
            assert!(
                e.contains(left) && e.contains("Move the whole data directory"),
                "{e}"
            );
            assert!(!db.exists(), "{left}: restored beside it");
            assert!(path.exists(), "{left} was touched");
            // A symbolic link there counts, even one that leads nowhere
            // (SQLite and Litestream would follow it).
            if path.is_dir() {
                std::fs::remove_dir(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
            std::os::unix::fs::symlink(dir.path().join("nowhere"), &path).unwrap();
            let e = format!(
                "{:#}",
                restore_to(&db, target, &ls, true).await.unwrap_err()
            );
            assert!(e.contains(left), "{left} as a dangling link: {e}");
        }
    }

    /// Not a regular file at the database's path, or at the marker's: no
    /// "database exists" for a pipe, and no start or restore held forever
    /// reading one as the marker.
    #[tokio::test]
    async fn a_pipe_is_no_database_and_no_marker() {
        let dir = tempfile::tempdir().unwrap();
        let ls = empty_litestream(dir.path(), ":");
        let db = dir.path().join("tally.db");
        let target: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        let fifo = |path: &Path| {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                path,
                rustix::fs::FileType::Fifo,
                rustix::fs::Mode::from_raw_mode(0o600),
                0,
            )
            .unwrap();
        };
        fifo(&db);
        let e = format!(
            "{:#}",
            restore_to(&db, target, &ls, true).await.unwrap_err()
        );
        assert!(e.contains("is not a regular file"), "{e}");
        std::fs::remove_file(&db).unwrap();
        std::fs::write(&db, b"a database").unwrap();
        fifo(&marker_path(&db));
        assert!(marker(&db).is_none());
        std::fs::remove_file(&db).unwrap();
        assert!(unfinished(&db).is_none());
    }

    /// A marker whose database is gone is not reported, and is removed: a
    /// new database made in its place is not the restored one.
    #[test]
    fn a_marker_without_its_database_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        let m = Marker {
            target: "2026-05-01T10:04:00Z".into(),
            txid: "0000000000000002".into(),
            last_transaction_at: None,
            restored_at: "2026-05-01T11:00:00Z".into(),
            file: None,
        };
        std::fs::write(marker_path(&db), serde_json::to_vec(&m).unwrap()).unwrap();
        std::fs::write(&db, b"").unwrap();
        assert_eq!(marker(&db).map(|m| m.txid), Some(m.txid.clone()));
        std::fs::remove_file(&db).unwrap();
        assert!(marker(&db).is_none());
        assert!(!marker_path(&db).exists());
    }

    /// A database put in the restored one's place since (a plain restore,
    /// which writes a new file) is not the restored one: its marker is
    /// removed, and not reported.
    #[test]
    fn a_marker_of_a_replaced_database_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        std::fs::write(&db, b"restored").unwrap();
        let m = Marker {
            target: "2026-05-01T10:04:00Z".into(),
            txid: "0000000000000002".into(),
            last_transaction_at: None,
            restored_at: "2026-05-01T11:00:00Z".into(),
            file: file_identity(&db),
        };
        std::fs::write(marker_path(&db), serde_json::to_vec(&m).unwrap()).unwrap();
        // Written to in place: still the restored database.
        std::fs::write(&db, b"restored, then written").unwrap();
        assert!(marker(&db).is_some());
        let next = dir.path().join("next.db");
        std::fs::write(&next, b"another").unwrap();
        std::fs::rename(&next, &db).unwrap();
        assert!(marker(&db).is_none());
        assert!(!marker_path(&db).exists());
        // Deleted and made again, where its inode number may come back:
        // told apart by its birth time, where the file system keeps one.
        let m = Marker {
            file: file_identity(&db),
            ..m
        };
        std::fs::write(marker_path(&db), serde_json::to_vec(&m).unwrap()).unwrap();
        std::fs::remove_file(&db).unwrap();
        std::fs::write(&db, b"made again").unwrap();
        if std::fs::metadata(&db).unwrap().created().is_ok() {
            assert!(marker(&db).is_none());
        }
    }

    #[test]
    fn an_instant_is_named_once_in_utc() {
        let a: Timestamp = "2026-05-01T12:04:00+02:00".parse().unwrap();
        let b: Timestamp = "2026-05-01T10:04:00Z".parse().unwrap();
        assert_eq!(a.to_string(), b.to_string());
        assert_eq!(b.to_string(), "2026-05-01T10:04:00Z");
    }
}
