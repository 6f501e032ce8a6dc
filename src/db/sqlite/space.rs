//! What the database's directory uses on disk, and the storage limit.
//!
//! On Kubernetes the directory is an `emptyDir`, and the kubelet evicts the
//! pod once the volume's usage (`du`: allocated blocks, Litestream's
//! staging files included) passes its size limit: a crash that loses what
//! Litestream had not shipped, and the next pod restores the same database
//! into the same limit. So tally measures the directory the same way, and
//! with a storage limit (`TALLY_STORAGE_LIMIT`) answers writes that would
//! add data `507 storage-full` before the limit, as on a full disk.
//!
//! A sampler task walks the directory (bounded: at most [`MAX_ENTRIES`]
//! entries, on one device, and never more than about 5% of its time
//! walking) and asks a read-only connection how many pages inside the
//! database are free. The writer never waits for it: before each batch it
//! reads the last sample (a few atomic loads), adds what its own three
//! files have grown since (three `stat` calls, as cheap as the files check
//! after every commit), and what the batch may add ([`PER_BATCH`] and
//! [`PER_COMMAND`] a command). Only Litestream's staging files can grow
//! unseen, for a sample's interval.
//!
//! What the limit measures: the directory's usage, plus what the database
//! file grows by at the next checkpoint (its new pages, so far in the WAL
//! only), less the database's free pages. Deleted rows (expired idempotency keys, resets) do not shrink the
//! file, so the usage the kubelet sees stays, but SQLite reuses those pages
//! before it grows the file: they are room.

use std::{
    io,
    path::{Path, PathBuf},
    sync::{
        Arc, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use sqlx::SqlitePool;

use super::stat::stat;

/// How often the directory is measured, at most.
const INTERVAL: Duration = Duration::from_millis(250);

/// Most directory entries one walk looks at: a directory holding more than
/// tally and Litestream put there is counted in part (and said so, once).
const MAX_ENTRIES: usize = 100_000;

/// What the writer reckons a command that adds data may add on disk in its
/// batch: a keyed increment adds about 130 bytes to the database (its key,
/// shaped like a UUID) and more to the WAL. An overestimate only makes the
/// limit bite a batch early.
pub(super) const PER_COMMAND: u64 = 256;

/// And what a batch adds whatever its size: two pages of the WAL (a small
/// keyed batch writes three or four, but the WAL's pages are reused after
/// each checkpoint). The reckoning is good to a few pages: the limit is a
/// soft one, set well below the volume's.
pub(super) const PER_BATCH: u64 = 8192;

/// The size the WAL file is cut back to when a write starts it over after
/// a checkpoint (`journal_size_limit`): about what it reaches between two
/// of tally's own checkpoints (1,000 pages).
pub(super) const WAL_KEPT: u64 = 4 * 1024 * 1024;

/// The last sample, shared by the sampler and the writer.
#[derive(Default)]
struct Sampled {
    /// The directory's usage in allocated bytes.
    dir_bytes: AtomicU64,
    /// Bytes of free pages inside the database.
    free_bytes: AtomicU64,
    /// Bytes the database file will grow by at the next checkpoint: its
    /// pages that are in the WAL only.
    pending_bytes: AtomicU64,
    /// The database's three files' part of [`Self::dir_bytes`]: the writer
    /// measures their growth since.
    files_bytes: AtomicU64,
}

/// What one walk found, in allocated bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    dir: u64,
    /// The database, its `-wal` and its `-shm`.
    files: [u64; 3],
    /// Whether [`MAX_ENTRIES`] cut the walk short.
    truncated: bool,
}

/// The writer's side: the last sample and the limit.
pub(super) struct Space {
    sampled: Arc<Sampled>,
    limit: Option<Limit>,
}

struct Limit {
    bytes: u64,
    /// The database, its `-wal` and its `-shm`.
    files: [PathBuf; 3],
    /// Since when writes are refused, to log the start and the end, and
    /// whether the start was logged (see [`Space::admit`]).
    refusing_since: Option<(Instant, bool)>,
}

/// Refused for the storage limit: what the limit measured, and the limit.
#[derive(Debug, Clone, Copy)]
pub(super) struct OverLimit {
    pub used: u64,
    pub limit: u64,
}

impl Space {
    /// Measures the directory of `db` once (so the first batch already
    /// sees it), then keeps measuring it on a task of its own until the
    /// writer's `Space` is dropped or the read pool closes.
    pub async fn start(db: &Path, readers: SqlitePool, limit: Option<u64>) -> Space {
        let sampled = Arc::new(Sampled::default());
        if let Some(bytes) = limit {
            metrics::gauge!("tally_storage_limit_bytes").set(bytes as f64);
        }
        let mut sampler = Sampler {
            sampled: Arc::downgrade(&sampled),
            dir: super::data_dir(db).to_owned(),
            db: db.to_owned(),
            readers,
            said_truncated: false,
        };
        let _ = sampler.sample().await;
        tokio::spawn(async move {
            loop {
                let started = Instant::now();
                if sampler.sample().await.is_none() {
                    return;
                }
                // Walking a large directory costs at most a twentieth of the
                // time; tally's own directory takes microseconds.
                tokio::time::sleep(INTERVAL.max(started.elapsed() * 20)).await;
            }
        });
        let limit = limit.map(|bytes| Limit {
            bytes,
            files: db_files(db),
            refusing_since: None,
        });
        Space { sampled, limit }
    }

    /// Whether the limit is set and the WAL file is well past what it is
    /// cut back to ([`WAL_KEPT`]): its pages, once checkpointed, are room
    /// that only a write starting the WAL over gives back.
    pub fn wal_oversized(&self) -> bool {
        self.limit
            .as_ref()
            .is_some_and(|l| allocated_at(&l.files[1]) > WAL_KEPT + WAL_KEPT / 4)
    }

    /// Whether the limit admits `adding` commands that add data: `Ok` (and
    /// they are reckoned in), or what the limit measured. Always `Ok`
    /// without a limit.
    pub fn admit(&mut self, adding: usize) -> Result<(), OverLimit> {
        let Some(limit) = &mut self.limit else {
            return Ok(());
        };
        let dir = self.sampled.dir_bytes.load(Ordering::Relaxed);
        let free = self.sampled.free_bytes.load(Ordering::Relaxed);
        let then = self.sampled.files_bytes.load(Ordering::Relaxed);
        let now: u64 = limit.files.iter().map(|f| allocated_at(f)).sum();
        let pending = self.sampled.pending_bytes.load(Ordering::Relaxed);
        let mut used = (dir.saturating_add(now).saturating_add(pending))
            .saturating_sub(then)
            .saturating_sub(free);
        let adds = match adding {
            0 => 0,
            n => PER_BATCH + n as u64 * PER_COMMAND,
        };
        // Near the limit only (it reads the WAL's frame headers): a WAL
        // file larger than what it holds since it was last started over is
        // written over from its start before it grows, so what lies past
        // its frames, and past the 4 MiB it reaches between checkpoints, is
        // room, as the database's free pages are. Under Litestream, whose
        // own write starts the WAL over after its checkpoints, the file
        // keeps its largest size.
        if used.saturating_add(adds) > limit.bytes {
            used = used.saturating_sub(wal_room(&limit.files[1]));
        }
        if used.saturating_add(adds) > limit.bytes {
            // Under Litestream with a small limit, the WAL between two of
            // its checkpoints can reach the limit every second under load:
            // one start (and end) a minute is logged, with the starts held
            // back since.
            static STARTS: crate::telemetry::Throttle =
                crate::telemetry::Throttle::new(Duration::from_secs(60));
            if limit.refusing_since.is_none() {
                let told = STARTS.admit();
                limit.refusing_since = Some((Instant::now(), told.is_some()));
                if let Some(held_back) = told {
                    tracing::error!(
                        held_back,
                        used,
                        limit = limit.bytes,
                        wal = allocated_at(&limit.files[1]),
                        "the storage limit (TALLY_STORAGE_LIMIT) is reached: writes that add \
                         data are answered 507 until room is made (expired idempotency keys, \
                         resets, a WAL grown past 4 MiB written over once checkpointed) or the \
                         limit is raised (one such line a minute at most; held_back: times it \
                         was reached since the last, not logged)"
                    );
                }
            }
            return Err(OverLimit {
                used,
                limit: limit.bytes,
            });
        }
        // Near the limit a fresh sample lets a few writes in between
        // refusals: the end is logged once there is room again.
        if used < limit.bytes / 10 * 9
            && let Some((since, true)) = limit.refusing_since.take()
        {
            tracing::warn!(
                refused_for = ?since.elapsed(),
                used,
                limit = limit.bytes,
                "below 90% of the storage limit again: writes commit again"
            );
        }
        Ok(())
    }
}

struct Sampler {
    sampled: Weak<Sampled>,
    dir: PathBuf,
    db: PathBuf,
    readers: SqlitePool,
    said_truncated: bool,
}

impl Sampler {
    /// One sample, stored and exported; `None` once nobody needs it.
    async fn sample(&mut self) -> Option<()> {
        if self.sampled.strong_count() == 0 {
            return None;
        }
        let (dir, db) = (self.dir.clone(), self.db.clone());
        let usage = tokio::task::spawn_blocking(move || walk(&dir, &db))
            .await
            .ok()?;
        // The database as SQLite sees it (WAL included): its free pages,
        // and its size, which the file reaches at the next checkpoint.
        let (free, size) = match sqlx::query_as::<_, (i64, i64)>(
            "SELECT f.freelist_count * s.page_size, c.page_count * s.page_size \
             FROM pragma_freelist_count() AS f, pragma_page_count() AS c, \
             pragma_page_size() AS s",
        )
        .fetch_one(&self.readers)
        .await
        {
            Ok((free, size)) => (
                u64::try_from(free).unwrap_or(0),
                u64::try_from(size).unwrap_or(0),
            ),
            Err(sqlx::Error::PoolClosed) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the database's free pages");
                (0, 0)
            }
        };
        let pending = size.saturating_sub(usage.files[0]);
        if usage.truncated && !self.said_truncated {
            self.said_truncated = true;
            tracing::warn!(
                dir = %self.dir.display(),
                entries = MAX_ENTRIES,
                "the database's directory holds more entries than tally measures; its usage is \
                 counted in part: keep the database in a directory of its own"
            );
        }
        let sampled = self.sampled.upgrade()?;
        sampled.dir_bytes.store(usage.dir, Ordering::Relaxed);
        sampled.free_bytes.store(free, Ordering::Relaxed);
        sampled.pending_bytes.store(pending, Ordering::Relaxed);
        sampled
            .files_bytes
            .store(usage.files.iter().sum(), Ordering::Relaxed);
        for (file, bytes) in ["db", "wal", "shm"].into_iter().zip(usage.files) {
            metrics::gauge!("tally_database_bytes", "file" => file).set(bytes as f64);
        }
        metrics::gauge!("tally_data_dir_bytes").set(usage.dir as f64);
        metrics::gauge!("tally_database_free_bytes").set(free as f64);
        metrics::gauge!("tally_storage_used_bytes")
            .set((usage.dir + pending).saturating_sub(free) as f64);
        Some(())
    }
}

/// The allocated bytes under `dir` (not following symbolic links, not
/// leaving its device), and those of the database's three files.
fn walk(dir: &Path, db: &Path) -> Usage {
    let mut usage = Usage::default();
    for (bytes, path) in usage.files.iter_mut().zip(&db_files(db)) {
        *bytes = allocated_at(path);
    }
    let Ok(Some(root)) = stat(dir, false) else {
        return usage;
    };
    usage.dir = root.allocated();
    let mut pending = vec![dir.to_owned()];
    let mut entries = 0;
    while let Some(d) = pending.pop() {
        let Ok(list) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in list.flatten() {
            entries += 1;
            if entries > MAX_ENTRIES {
                usage.truncated = true;
                return usage;
            }
            // A file deleted meanwhile (a checkpoint, Litestream's
            // clean-up) is simply no longer there.
            let path = entry.path();
            let Ok(Some(m)) = stat(&path, false) else {
                continue;
            };
            if m.dev != root.dev {
                continue;
            }
            usage.dir += m.allocated();
            if m.is_dir {
                pending.push(path);
            }
        }
    }
    usage
}

/// What the WAL file at `path` takes on disk past the frames it holds
/// since it was last started over and past [`WAL_KEPT`], which it is
/// counted as taking whatever it holds (0 if it cannot be read): SQLite writes
/// the WAL from its start after a checkpoint, under a header with new
/// salts, and each frame it writes carries them, so the frames of the
/// current generation are the ones from the start whose salts match the
/// header's, and those past them are old. Found by bisection: a few reads.
fn wal_room(path: &Path) -> u64 {
    wal_live_bytes(path).map_or(0, |live| {
        allocated_at(path).saturating_sub(live.max(WAL_KEPT))
    })
}

/// The bytes of the WAL file at `path` up to the end of its last frame of
/// the current generation (see [`wal_room`]); `None` if it is not a WAL.
fn wal_live_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    const HEADER: u64 = 32;
    const FRAME_HEADER: u64 = 24;
    let file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let mut header = [0u8; HEADER as usize];
    file.read_exact_at(&mut header, 0).ok()?;
    let word = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    if word(0) & !1 != 0x377f_0682 {
        return None;
    }
    let page = match word(8) {
        1 => 65_536,
        n => u64::from(n),
    };
    let frame = page + FRAME_HEADER;
    let salts = &header[16..24];
    let current = |k: u64| {
        let mut h = [0u8; FRAME_HEADER as usize];
        file.read_exact_at(&mut h, HEADER + k * frame).is_ok() && &h[8..16] == salts
    };
    // Frames 0..n are the current generation's, the rest not.
    let (mut lo, mut hi) = (0, len.saturating_sub(HEADER) / frame);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if current(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    Some(HEADER + lo * frame)
}

/// The database's three files.
fn db_files(db: &Path) -> [PathBuf; 3] {
    ["", "-wal", "-shm"].map(|suffix| {
        let mut p = db.as_os_str().to_owned();
        p.push(suffix);
        PathBuf::from(p)
    })
}

/// What the file at `path` takes on disk; 0 if there is none. Asks for
/// nothing else, the times least of all (see [`super::stat`]): the
/// storage limit checks the database's files before every batch.
fn allocated_at(path: &Path) -> u64 {
    stat(path, false)
        .ok()
        .flatten()
        .map_or(0, |s| s.allocated())
}

/// The error a command refused for the limit is answered with: the one a
/// full disk gives (`Error::StorageFull`, 507), saying which limit.
pub(super) fn refusal(over: OverLimit) -> io::Error {
    io::Error::new(
        io::ErrorKind::StorageFull,
        format!(
            "the data directory uses {} bytes of its storage limit of {} (TALLY_STORAGE_LIMIT)",
            over.used, over.limit
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A WAL's frames since it was last started over are found by their
    /// salts: all of a WAL written once, and after a checkpoint and a
    /// write that starts it over, only that write's, the file keeping its
    /// size (what lies past them is room).
    #[tokio::test]
    async fn a_wals_live_frames_are_told_from_the_old_ones() {
        use sqlx::{ConnectOptions, Executor};
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        let wal = dir.path().join("t.db-wal");
        let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&db)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .pragma("wal_autocheckpoint", "0")
            .connect()
            .await
            .unwrap();
        conn.execute(
            "CREATE TABLE t (x BLOB);
             WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 300)
             INSERT INTO t SELECT randomblob(3000) FROM g;",
        )
        .await
        .unwrap();
        let written = std::fs::metadata(&wal).unwrap().len();
        assert!(written > 300 * 4096, "{written}");
        assert_eq!(wal_live_bytes(&wal), Some(written));
        assert!(wal_room(&wal) < 4096, "a block at most: {}", wal_room(&wal));

        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            .await
            .unwrap();
        conn.execute("INSERT INTO t VALUES (1)").await.unwrap();
        assert_eq!(std::fs::metadata(&wal).unwrap().len(), written);
        let live = wal_live_bytes(&wal).unwrap();
        assert!(live > 32 && live <= 32 + 4 * (4096 + 24), "{live}");
        // Room past the 4 MiB a WAL is counted as at least.
        assert_eq!(wal_room(&wal), 0, "a WAL under 4 MiB has none");
        assert_eq!(wal_live_bytes(&db), None, "not a WAL");
        // Past 4 MiB: what lies past the frames and past 4 MiB.
        conn.execute(
            "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 2500)
             INSERT INTO t SELECT randomblob(3000) FROM g;",
        )
        .await
        .unwrap();
        let big = allocated_at(&wal);
        assert!(big > 2 * WAL_KEPT, "{big}");
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            .await
            .unwrap();
        conn.execute("INSERT INTO t VALUES (1)").await.unwrap();
        assert_eq!(wal_room(&wal), big - WAL_KEPT);
    }

    /// The walk counts allocated blocks, nested directories and the
    /// database's files, as `du` would.
    #[test]
    fn the_walk_counts_what_du_counts() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        std::fs::write(&db, vec![1u8; 100_000]).unwrap();
        std::fs::write(dir.path().join("t.db-wal"), vec![1u8; 10_000]).unwrap();
        let staging = dir.path().join(".t.db-litestream/ltx/0");
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::write(staging.join("a.ltx"), vec![1u8; 50_000]).unwrap();
        // Sparse: a length of 10 MB takes next to nothing.
        let sparse = std::fs::File::create(dir.path().join("sparse")).unwrap();
        sparse.set_len(10_000_000).unwrap();

        let usage = walk(dir.path(), &db);
        assert!(!usage.truncated);
        assert!(usage.files[0] >= 100_000, "{usage:?}");
        assert!(usage.files[1] >= 10_000, "{usage:?}");
        assert_eq!(usage.files[2], 0, "{usage:?}");
        assert!(usage.dir >= 160_000, "{usage:?}");
        assert!(
            usage.dir < 1_000_000,
            "the sparse file counted whole: {usage:?}"
        );
        let du = std::process::Command::new("du")
            .args(["-s", "-B1"])
            .arg(dir.path())
            .output();
        if let Some(out) = du.ok().filter(|o| o.status.success()) {
            let du: u64 = String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(usage.dir, du, "{usage:?}");
        }
    }

    #[test]
    fn the_walk_stops_at_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let many = dir.path().join("many");
        std::fs::create_dir(&many).unwrap();
        for i in 0..=MAX_ENTRIES {
            std::fs::File::create(many.join(i.to_string())).unwrap();
        }
        let started = Instant::now();
        let usage = walk(dir.path(), &dir.path().join("t.db"));
        assert!(usage.truncated);
        println!("a walk of {MAX_ENTRIES} entries: {:?}", started.elapsed());
    }

    #[test]
    fn the_limit_counts_free_pages_as_room_and_sees_its_files_grow() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        std::fs::write(&db, vec![1u8; 8192]).unwrap();
        let sampled = Arc::new(Sampled::default());
        let limit = 100_000;
        let mut space = Space {
            sampled: Arc::clone(&sampled),
            limit: Some(Limit {
                bytes: limit,
                files: db_files(&db),
                refusing_since: None,
            }),
        };
        let sample = |dir: u64, free: u64| {
            let usage = walk(dir_of(&db), &db);
            sampled.dir_bytes.store(dir, Ordering::Relaxed);
            sampled.free_bytes.store(free, Ordering::Relaxed);
            sampled
                .files_bytes
                .store(usage.files.iter().sum(), Ordering::Relaxed);
        };
        sample(limit - PER_BATCH - 10 * PER_COMMAND, 0);
        // A batch of 10 fits, 11 do not.
        space.admit(10).unwrap();
        let over = space.admit(11).unwrap_err();
        assert_eq!(
            (over.used, over.limit),
            (limit - PER_BATCH - 10 * PER_COMMAND, limit)
        );
        // Nothing that adds data always passes.
        space.admit(0).unwrap();
        // The WAL grew since the sample: that counts at once.
        std::fs::write(dir.path().join("t.db-wal"), vec![1u8; 8192]).unwrap();
        let over = space.admit(1).unwrap_err();
        assert!(
            over.used >= limit - PER_BATCH - 10 * PER_COMMAND + 8192,
            "{over:?}"
        );
        // Full: refused until free pages make room.
        sample(limit, 0);
        assert!(space.admit(1).is_err());
        sample(limit, 20_000);
        space.admit(1).unwrap();
        // Without a limit everything is admitted.
        let mut unlimited = Space {
            sampled,
            limit: None,
        };
        unlimited.admit(1_000_000).unwrap();
    }

    fn dir_of(db: &Path) -> &Path {
        db.parent().unwrap()
    }
}
