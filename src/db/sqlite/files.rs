//! Noticing that the database file is no longer the one at its path.
//!
//! SQLite keeps writing through the file descriptors it opened. If the
//! database, its `-wal` or its `-shm` is deleted (`rm tally.db*`) or
//! replaced (a restore over a running tally), every commit still succeeds,
//! into a file no other process will ever open again, and is lost when
//! tally exits (under Litestream, which reads the WAL by its name, a commit
//! it shipped before the loss comes back from the replica).
//! So the writer remembers which files it opened (device and
//! inode) and compares them with what the paths name now, after every
//! commit before any caller is answered, and now and then while idle.

use std::{
    io,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::db::writer::Lost;

/// The three files SQLite uses in WAL mode, as the writer opened them.
pub(super) struct DbFiles {
    files: [Tracked; 3],
    /// Litestream replicates them ([`Lost::may_be_kept`]).
    replicated: bool,
}

struct Tracked {
    path: PathBuf,
    /// `None` until the file has been seen: SQLite creates `-wal` and
    /// `-shm` with the first transaction, not when it opens the database.
    id: Option<FileId>,
}

/// What tells two files apart: the same path may name a new file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

impl DbFiles {
    /// Records the files now at `db`, `db-wal` and `db-shm`; `replicated`:
    /// Litestream replicates them.
    pub fn record(db: &Path, replicated: bool) -> Self {
        let with_suffix = |suffix: &str| {
            let mut p = db.as_os_str().to_owned();
            p.push(suffix);
            PathBuf::from(p)
        };
        let files = [db.to_owned(), with_suffix("-wal"), with_suffix("-shm")].map(|path| {
            let id = file_id(&path).ok().flatten();
            Tracked { path, id }
        });
        DbFiles { files, replicated }
    }

    /// Compares each recorded file with the file its path names now: one
    /// look per file ([`super::stat`]). A file not seen before is recorded now.
    pub fn check(&mut self) -> Result<(), Lost> {
        let replicated = self.replicated;
        for (i, f) in self.files.iter_mut().enumerate() {
            // The index only: a lost `-shm` leaves the WAL, which holds
            // every commit, at its name.
            let shm = i == 2;
            let lost = |what| Lost {
                path: Arc::from(f.path.as_path()),
                what,
                may_be_kept: replicated || shm,
            };
            match (f.id, file_id(&f.path)) {
                (None, Ok(now)) => f.id = now,
                (Some(_), Ok(None)) => return Err(lost("deleted")),
                (Some(was), Ok(Some(now))) if was != now => return Err(lost("replaced")),
                (Some(_), Ok(Some(_))) => {}
                // Not a verdict: a path that cannot be looked at (a
                // permission changed) is not known to name another file.
                (_, Err(e)) => {
                    tracing::warn!(path = %f.path.display(), error = %e, "cannot stat a database file");
                }
            }
        }
        Ok(())
    }
}

/// The identity of the file at `path`, `None` if there is none. Asks for
/// nothing else, the times least of all (see [`super::stat`]): this runs
/// after every commit.
fn file_id(path: &Path) -> io::Result<Option<FileId>> {
    Ok(super::stat::stat(path, true)?.map(|s| FileId {
        dev: s.dev,
        ino: s.ino,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_deleted_and_replaced_files() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        std::fs::write(&db, b"x").unwrap();
        let mut files = DbFiles::record(&db, false);
        files.check().unwrap();
        // A -wal that appears later is recorded, not reported.
        let wal = dir.path().join("t.db-wal");
        std::fs::write(&wal, b"w").unwrap();
        files.check().unwrap();
        // Replaced: a new file renamed over the old path.
        let new = dir.path().join("new");
        std::fs::write(&new, b"w").unwrap();
        std::fs::rename(&new, &wal).unwrap();
        let lost = files.check().unwrap_err();
        assert_eq!((&*lost.path, lost.what), (wal.as_path(), "replaced"));
        assert!(!lost.may_be_kept);

        // Under Litestream, what was committed may have been shipped.
        let mut files = DbFiles::record(&db, true);
        std::fs::remove_file(&db).unwrap();
        let lost = files.check().unwrap_err();
        assert_eq!((&*lost.path, lost.what), (db.as_path(), "deleted"));
        assert!(lost.may_be_kept);
        // Only `-shm` gone: the WAL still holds the commits.
        std::fs::write(&db, b"x").unwrap();
        let shm = dir.path().join("t.db-shm");
        std::fs::write(&shm, b"s").unwrap();
        let mut files = DbFiles::record(&db, false);
        std::fs::remove_file(&shm).unwrap();
        let lost = files.check().unwrap_err();
        assert_eq!((&*lost.path, lost.what), (shm.as_path(), "deleted"));
        assert!(lost.may_be_kept);
    }

    /// What the check costs: three `stat` calls, against what every batch
    /// already pays, an fsync in the same directory, measured in the same
    /// run. Printed, for the record
    /// (`cargo test --lib stat_cost -- --nocapture`); the bound only
    /// catches a pathological file system.
    #[test]
    fn stat_cost() {
        use std::{io::Write, time::Instant};
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        for suffix in ["", "-wal", "-shm"] {
            std::fs::write(dir.path().join(format!("t.db{suffix}")), b"x").unwrap();
        }
        let mut files = DbFiles::record(&db, false);
        let n = 20_000;
        let started = Instant::now();
        for _ in 0..n {
            files.check().unwrap();
        }
        let check = started.elapsed() / n;

        let mut f = std::fs::File::create(dir.path().join("fsync")).unwrap();
        let n = 200;
        let started = Instant::now();
        for _ in 0..n {
            f.write_all(b"x").unwrap();
            f.sync_data().unwrap();
        }
        let fsync = started.elapsed() / n;
        println!(
            "one check (3 stat calls): {check:?}; one write+fsync: {fsync:?}; ratio {:.3}",
            check.as_secs_f64() / fsync.as_secs_f64()
        );
        assert!(check < std::time::Duration::from_millis(1), "{check:?}");
    }
}
