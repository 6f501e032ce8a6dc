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
    /// Since when writes are refused, to log the start and the end.
    refusing_since: Option<Instant>,
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
        let used = (dir.saturating_add(now).saturating_add(pending))
            .saturating_sub(then)
            .saturating_sub(free);
        let adds = match adding {
            0 => 0,
            n => PER_BATCH + n as u64 * PER_COMMAND,
        };
        if used.saturating_add(adds) > limit.bytes {
            if limit.refusing_since.is_none() {
                limit.refusing_since = Some(Instant::now());
                tracing::error!(
                    used,
                    limit = limit.bytes,
                    "the storage limit (TALLY_STORAGE_LIMIT) is reached: writes that add data \
                     are answered 507 until room is made (expired idempotency keys, resets) \
                     or the limit is raised"
                );
            }
            return Err(OverLimit {
                used,
                limit: limit.bytes,
            });
        }
        // Near the limit a fresh sample lets a few writes in between
        // refusals: the end is logged once there is room again.
        if used < limit.bytes / 10 * 9
            && let Some(since) = limit.refusing_since.take()
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
