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
//! the WAL's pages into the cut file, a database with holes. So the
//! writer also watches the database file's length: when it falls below
//! the longest it was seen at, the file's own header says whether it was
//! made shorter by SQLite (a `VACUUM` from another connection, or
//! `auto_vacuum`, checkpointed: the header's page count fits the new
//! length) or cut (the header is gone, or counts pages the file no longer
//! has). A file copied over the database in place, to the same length or
//! longer between two looks, is not seen.

use std::{
    io,
    mem::ManuallyDrop,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::db::writer::Lost;

/// The three files SQLite uses in WAL mode, as the writer opened them.
pub(super) struct DbFiles {
    files: [Tracked; 3],
    /// Litestream replicates them ([`Lost::may_be_kept`]).
    replicated: bool,
    /// The database file, opened once to read its header, and never
    /// closed: on Linux, closing any descriptor of a file drops every
    /// POSIX lock the process holds on it, SQLite's too, and another
    /// process's connection, closing as if it were the last, would then
    /// checkpoint and delete the WAL under tally.
    db_file: ManuallyDrop<Option<std::fs::File>>,
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
    /// Litestream replicates them.
    pub fn record(db: &Path, replicated: bool) -> Self {
        let beside = |suffix| crate::restore::beside(db, suffix);
        let files = [db.to_owned(), beside("-wal"), beside("-shm")].map(|path| {
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
            db_file: ManuallyDrop::new(std::fs::File::open(db).ok()),
        }
    }

    /// Compares each recorded file with the file its path names now: one
    /// look per file ([`super::stat`]). A file not seen before is recorded now.
    pub fn check(&mut self) -> Result<(), Lost> {
        let replicated = self.replicated;
        if self.db_file.is_none() {
            // Not opened when recorded (out of descriptors, say): kept
            // once it is, never closed either.
            *self.db_file = std::fs::File::open(&self.files[0].path).ok();
        }
        let db_file = self.db_file.as_ref();
        for (i, f) in self.files.iter_mut().enumerate() {
            // The index only: a lost `-shm` leaves the WAL, which holds
            // every commit, at its name.
            let shm = i == 2;
            let db = i == 0;
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
                (Some(_), Ok(Some((_, len)))) if db && len < f.longest => {
                    match db_file.map(header_of) {
                        // Made shorter by SQLite: its header was written first.
                        Some(Ok(Header::Length { bytes, .. })) if bytes <= len => f.longest = len,
                        Some(Ok(Header::Unknown)) => f.longest = len,
                        // No way to read it without closing a descriptor
                        // of it: not a verdict.
                        None => {
                            tracing::warn!(
                                path = %f.path.display(),
                                "the database file is shorter than before, and cannot be opened \
                                 to tell whether SQLite or something else made it so"
                            );
                            f.longest = len;
                        }
                        _ => {
                            leave_cut_short_mark(&f.path, f.longest, len);
                            return Err(lost("cut short"));
                        }
                    }
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

/// The mark beside the database `db` that a tally which saw it cut short
/// leaves, so that the next start does not serve what is left of it.
pub(super) fn cut_short_mark(db: &Path) -> PathBuf {
    crate::restore::beside(db, "-cut-short")
}

fn leave_cut_short_mark(db: &Path, was: u64, is: u64) {
    let said = format!(
        "at {}, {is} bytes long after {was}\n",
        jiff::Timestamp::try_from(std::time::SystemTime::now())
            .map_or_else(|_| "an unknown time".to_owned(), |t| t.to_string())
    );
    if let Err(e) = std::fs::write(cut_short_mark(db), said) {
        tracing::error!(
            path = %cut_short_mark(db).display(),
            error = %e,
            "cannot leave the mark that keeps the next start off a database cut short"
        );
    }
}

/// What a database file's header says of its length.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Header {
    /// Its pages times their size (`bytes`), and the size of a page:
    /// SQLite keeps the file at least as long (a checkpoint writes page 1
    /// before it truncates the file), and writes whole pages only.
    Length { bytes: u64, page: u64 },
    /// Not a SQLite database: too short for a header, or not one.
    NotADatabase,
    /// A header whose page count is not kept (by a writer older than
    /// SQLite 3.7.0): the file's length is all there is to go by.
    Unknown,
}

/// The header of the database file at `path` (its first 100 bytes, as
/// the file format describes them). Opens and closes the file: only where
/// no connection of this process has it open (see [`DbFiles`]).
pub(super) fn header(path: &Path) -> io::Result<Header> {
    header_of(&std::fs::File::open(path)?)
}

/// The header of the database file `file`.
fn header_of(file: &std::fs::File) -> io::Result<Header> {
    use std::os::unix::fs::FileExt;
    let mut h = [0u8; 100];
    match file.read_exact_at(&mut h, 0) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(Header::NotADatabase),
        Err(e) => return Err(e),
    }
    if &h[..16] != b"SQLite format 3\0" {
        return Ok(Header::NotADatabase);
    }
    let u32_at = |at: usize| u32::from_be_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
    // A power of two from 512 to 65536 (1 stands for 65536); any other
    // value is no database SQLite would open.
    let page_size = match u16::from_be_bytes([h[16], h[17]]) {
        1 => 65536,
        n if n >= 512 && n.is_power_of_two() => u64::from(n),
        _ => return Ok(Header::NotADatabase),
    };
    let (changes, pages, valid_for) = (u32_at(24), u32_at(28), u32_at(92));
    Ok(match pages != 0 && changes == valid_for {
        true => Header::Length {
            bytes: u64::from(pages) * page_size,
            page: page_size,
        },
        false => Header::Unknown,
    })
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
    use crate::testing::cut;

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

    /// A database file whose header says it has `pages` pages of 4 KiB,
    /// `len` bytes long.
    fn database_file(path: &Path, pages: u32, len: u64) {
        let mut h = vec![0u8; 100];
        h[..16].copy_from_slice(b"SQLite format 3\0");
        h[16..18].copy_from_slice(&4096u16.to_be_bytes());
        h[24..28].copy_from_slice(&7u32.to_be_bytes());
        h[28..32].copy_from_slice(&pages.to_be_bytes());
        h[92..96].copy_from_slice(&7u32.to_be_bytes());
        std::fs::write(path, &h).unwrap();
        cut(path, len);
    }

    /// A page size SQLite cannot have is no database: it divided a
    /// length by 0 at start.
    #[test]
    fn a_header_with_a_page_size_sqlite_cannot_have_is_no_database() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        database_file(&db, 2, 8192);
        let with_page = |size: u16| {
            let mut h = std::fs::read(&db).unwrap();
            h[16..18].copy_from_slice(&size.to_be_bytes());
            std::fs::write(&db, h).unwrap();
            header(&db).unwrap()
        };
        for bad in [0, 3, 256, 511, 1000, 4097, 65535] {
            assert!(matches!(with_page(bad), Header::NotADatabase), "{bad}");
        }
        for (field, page) in [(512, 512), (4096, 4096), (32768, 32768), (1, 65536)] {
            let bytes = 2 * page;
            assert!(
                matches!(with_page(field), Header::Length { bytes: b, page: p } if (b, p) == (bytes, page)),
                "{field}"
            );
        }
    }

    #[test]
    fn notices_the_database_cut_short_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        database_file(&db, 2, 8192);
        let wal = dir.path().join("t.db-wal");
        std::fs::write(&wal, [0u8; 8192]).unwrap();
        let mut files = DbFiles::record(&db, false);
        // Growing is what checkpoints do; the WAL is cut short by them.
        database_file(&db, 3, 12288);
        std::fs::File::create(&wal).unwrap();
        files.check().unwrap();
        // Cut short in place, to below the longest it was seen at, though
        // as long as when it was recorded: its header counts 3 pages.
        cut(&db, 8192);
        let lost = files.check().unwrap_err();
        assert_eq!((&*lost.path, lost.what), (db.as_path(), "cut short"));
        assert!(!lost.may_be_kept);
        // The mark that keeps the next start off it.
        let said = std::fs::read_to_string(cut_short_mark(&db)).unwrap();
        assert!(said.ends_with(", 8192 bytes long after 12288\n"), "{said}");
        // Emptied, as `: > t.db` does, or cut inside its header.
        for len in [0, 50] {
            database_file(&db, 3, 12288);
            let mut files = DbFiles::record(&db, true);
            cut(&db, len);
            let lost = files.check().unwrap_err();
            assert_eq!(lost.what, "cut short", "cut to {len}");
            assert!(lost.may_be_kept);
        }
        // Made shorter by SQLite (a VACUUM, `auto_vacuum`): the header,
        // written first, fits the new length; and from there on the
        // shorter length is the one watched.
        database_file(&db, 3, 12288);
        let mut files = DbFiles::record(&db, false);
        database_file(&db, 1, 4096);
        files.check().unwrap();
        database_file(&db, 1, 2048);
        assert_eq!(files.check().unwrap_err().what, "cut short");
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
