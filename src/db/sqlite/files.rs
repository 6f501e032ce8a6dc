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
//!
//! The database file cut short in place (`truncate`, `: > tally.db`)
//! keeps its inode, and the commits go on into the WAL; but every page not
//! in the WAL is gone, reads of them fail, and the next checkpoint writes
//! the WAL's pages into the cut file, a database with holes. tally never
//! shrinks its database (it runs no `VACUUM`, and makes it without
//! `auto_vacuum`), so the file's length falling below the longest it was
//! seen at tells that apart. A database given `auto_vacuum` elsewhere
//! shrinks at checkpoints; its length is not watched.

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
    /// The database file never shrinks by itself (no `auto_vacuum`).
    never_shrinks: bool,
}

struct Tracked {
    path: PathBuf,
    /// `None` until the file has been seen: SQLite creates `-wal` and
    /// `-shm` with the first transaction, not when it opens the database.
    id: Option<FileId>,
    /// The longest the file was seen at; checked for the database only
    /// (the WAL is cut short by every truncating checkpoint).
    longest: u64,
}

/// What tells two files apart: the same path may name a new file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
}

impl DbFiles {
    /// Records the files now at `db`, `db-wal` and `db-shm`; `replicated`:
    /// Litestream replicates them; `never_shrinks`: the database has no
    /// `auto_vacuum`, so its file is never made shorter but from outside.
    pub fn record(db: &Path, replicated: bool, never_shrinks: bool) -> Self {
        let with_suffix = |suffix: &str| {
            let mut p = db.as_os_str().to_owned();
            p.push(suffix);
            PathBuf::from(p)
        };
        let files = [db.to_owned(), with_suffix("-wal"), with_suffix("-shm")].map(|path| {
            let seen = file_id(&path).ok().flatten();
            Tracked {
                path,
                id: seen.map(|(id, _)| id),
                longest: seen.map_or(0, |(_, len)| len),
            }
        });
        DbFiles {
            files,
            replicated,
            never_shrinks,
        }
    }

    /// Compares each recorded file with the file its path names now: one
    /// look per file ([`super::stat`]). A file not seen before is recorded now.
    pub fn check(&mut self) -> Result<(), Lost> {
        let replicated = self.replicated;
        let never_shrinks = self.never_shrinks;
        for (i, f) in self.files.iter_mut().enumerate() {
            // The index only: a lost `-shm` leaves the WAL, which holds
            // every commit, at its name.
            let shm = i == 2;
            let watch_length = i == 0 && never_shrinks;
            let lost = |what| Lost {
                path: Arc::from(f.path.as_path()),
                what,
                may_be_kept: replicated || shm,
            };
            match (f.id, file_id(&f.path)) {
                (None, Ok(now)) => {
                    f.id = now.map(|(id, _)| id);
                    f.longest = now.map_or(0, |(_, len)| len);
                }
                (Some(_), Ok(None)) => return Err(lost("deleted")),
                (Some(was), Ok(Some((now, _)))) if was != now => return Err(lost("replaced")),
                (Some(_), Ok(Some((_, len)))) if watch_length && len < f.longest => {
                    return Err(lost("cut short"));
                }
                (Some(_), Ok(Some((_, len)))) => f.longest = f.longest.max(len),
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

/// The identity and the length of the file at `path`, `None` if there is
/// none. Asks for nothing else, the times least of all (see
/// [`super::stat`]): this runs after every commit.
fn file_id(path: &Path) -> io::Result<Option<(FileId, u64)>> {
    Ok(super::stat::stat(path, true)?.map(|s| {
        (
            FileId {
                dev: s.dev,
                ino: s.ino,
            },
            s.size,
        )
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
        let mut files = DbFiles::record(&db, false, true);
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
        let mut files = DbFiles::record(&db, true, true);
        std::fs::remove_file(&db).unwrap();
        let lost = files.check().unwrap_err();
        assert_eq!((&*lost.path, lost.what), (db.as_path(), "deleted"));
        assert!(lost.may_be_kept);
        // Only `-shm` gone: the WAL still holds the commits.
        std::fs::write(&db, b"x").unwrap();
        let shm = dir.path().join("t.db-shm");
        std::fs::write(&shm, b"s").unwrap();
        let mut files = DbFiles::record(&db, false, true);
        std::fs::remove_file(&shm).unwrap();
        let lost = files.check().unwrap_err();
        assert_eq!((&*lost.path, lost.what), (shm.as_path(), "deleted"));
        assert!(lost.may_be_kept);
    }

    #[test]
    fn notices_the_database_cut_short_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        std::fs::write(&db, [0u8; 8192]).unwrap();
        let wal = dir.path().join("t.db-wal");
        std::fs::write(&wal, [0u8; 8192]).unwrap();
        let mut files = DbFiles::record(&db, false, true);
        // Growing is what checkpoints do; the WAL is cut short by them.
        std::fs::write(&db, [0u8; 12288]).unwrap();
        std::fs::File::create(&wal).unwrap();
        files.check().unwrap();
        // Cut short in place, to below the longest it was seen at, though
        // longer than when it was recorded.
        std::fs::File::options()
            .write(true)
            .open(&db)
            .unwrap()
            .set_len(8192)
            .unwrap();
        let lost = files.check().unwrap_err();
        assert_eq!((&*lost.path, lost.what), (db.as_path(), "cut short"));
        assert!(!lost.may_be_kept);
        // Emptied, as `: > t.db` does.
        let mut files = DbFiles::record(&db, true, true);
        std::fs::File::create(&db).unwrap();
        let lost = files.check().unwrap_err();
        assert_eq!(lost.what, "cut short");
        assert!(lost.may_be_kept);
        // A database with `auto_vacuum` shrinks by itself.
        std::fs::write(&db, [0u8; 8192]).unwrap();
        let mut files = DbFiles::record(&db, false, false);
        std::fs::File::create(&db).unwrap();
        files.check().unwrap();
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
        let mut files = DbFiles::record(&db, false, true);
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
