//! `stat` for the database's files that leaves their times alone.
//!
//! On Linux 6.13 and later (multigrain timestamps: ext4, XFS, btrfs,
//! tmpfs), a `stat` that asks for a file's change or modification time
//! marks its times as seen, and the next write to the file then stamps a
//! fine-grained time even within the clock tick in which the coarse one
//! would have stayed as it was. That dirties the inode, and the commit's
//! `fsync` then writes the inode as well as the data: a second write the
//! flush waits for. tally looks at its files around every commit
//! (`files`: still the files it opened? `space`: how much do they take?),
//! so those looks ask `statx` for what they use, not the times (an
//! occasional full `stat`, as a metrics scrape's, costs one commit an
//! inode write). Measured on ext4: a 4 KiB write and its `fsync` took
//! 184-239 us at the median with no `stat` before each write or with one
//! asking for the inode number only (61-87 us of CPU a flush), and
//! 295-355 us (90-128 us of CPU) after a full `stat`.

use std::{io, path::Path};

/// What tally uses of a file's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    /// The device and inode: what tells two files apart.
    pub dev: u64,
    pub ino: u64,
    /// Allocated 512-byte blocks, as `du` counts them.
    pub blocks: u64,
    /// The length in bytes.
    pub size: u64,
    pub is_dir: bool,
}

impl Seen {
    /// What the file takes on disk (a sparse or preallocated file differs
    /// from its length).
    pub fn allocated(&self) -> u64 {
        self.blocks * 512
    }
}

/// What [`stat`] asks `statx` for: no times.
#[cfg(target_os = "linux")]
const ASKED: rustix::fs::StatxFlags = rustix::fs::StatxFlags::TYPE
    .union(rustix::fs::StatxFlags::INO)
    .union(rustix::fs::StatxFlags::BLOCKS)
    .union(rustix::fs::StatxFlags::SIZE);

/// The file at `path` (its link, unless `follow`), `None` if there is none.
#[cfg(target_os = "linux")]
pub(super) fn stat(path: &Path, follow: bool) -> io::Result<Option<Seen>> {
    use rustix::{
        fs::{AtFlags, CWD, FileType, StatxFlags},
        io::Errno,
    };
    let flags = match follow {
        true => AtFlags::empty(),
        false => AtFlags::SYMLINK_NOFOLLOW,
    };
    match rustix::fs::statx(CWD, path, flags, ASKED) {
        Ok(s) if StatxFlags::from_bits_retain(s.stx_mask).contains(ASKED) => Ok(Some(Seen {
            dev: rustix::fs::makedev(s.stx_dev_major, s.stx_dev_minor),
            ino: s.stx_ino,
            blocks: s.stx_blocks,
            size: s.stx_size,
            is_dir: FileType::from_raw_mode(s.stx_mode.into()) == FileType::Directory,
        })),
        Err(Errno::NOENT) => Ok(None),
        // No `statx` (Linux before 4.11, some sandboxes), or a file system
        // that did not answer all that was asked: the portable way.
        Ok(_) | Err(Errno::NOSYS) => portable(path, follow),
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn stat(path: &Path, follow: bool) -> io::Result<Option<Seen>> {
    portable(path, follow)
}

fn portable(path: &Path, follow: bool) -> io::Result<Option<Seen>> {
    let found = match follow {
        true => std::fs::metadata(path),
        false => std::fs::symlink_metadata(path),
    };
    match found {
        Ok(m) => Ok(Some(seen(&m))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(unix)]
fn seen(m: &std::fs::Metadata) -> Seen {
    use std::os::unix::fs::MetadataExt;
    Seen {
        dev: m.dev(),
        ino: m.ino(),
        blocks: m.blocks(),
        size: m.len(),
        is_dir: m.is_dir(),
    }
}

/// Without inodes only a deleted file can be told apart, and the length
/// stands for the allocation.
#[cfg(not(unix))]
fn seen(m: &std::fs::Metadata) -> Seen {
    Seen {
        dev: 0,
        ino: 0,
        blocks: m.len().div_ceil(512),
        size: m.len(),
        is_dir: m.is_dir(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same answers as the standard library's `stat`, without asking
    /// for the times.
    #[test]
    fn agrees_with_std() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, vec![1u8; 10_000]).unwrap();
        let link = dir.path().join("l");
        #[cfg(unix)]
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let top = dir.path().to_owned();
        let mut cases = vec![(&file, true), (&file, false), (&top, false)];
        if cfg!(unix) {
            cases.extend([(&link, true), (&link, false)]);
        }
        for (path, follow) in cases {
            let ours = stat(path, follow).unwrap().unwrap();
            let std = portable(path, follow).unwrap().unwrap();
            assert_eq!(ours, std, "{}", path.display());
        }
        #[cfg(unix)]
        {
            let l = stat(&link, false).unwrap().unwrap();
            assert_ne!(l.ino, stat(&file, true).unwrap().unwrap().ino);
            assert!(!l.is_dir);
        }
        assert!(stat(&file, true).unwrap().unwrap().allocated() >= 10_000);
        assert_eq!(stat(&file, true).unwrap().unwrap().size, 10_000);
        assert!(stat(dir.path(), true).unwrap().unwrap().is_dir);
        assert_eq!(stat(&dir.path().join("none"), true).unwrap(), None);
    }

    /// The file system under the tests answers all that [`stat`] asks
    /// `statx` for, so the way without the times is the one taken (a
    /// fallback would pass the test above and quietly bring the cost back).
    #[cfg(target_os = "linux")]
    #[test]
    fn statx_answers_what_is_asked() {
        use rustix::fs::{AtFlags, CWD, StatxFlags};
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let s = rustix::fs::statx(CWD, &file, AtFlags::empty(), ASKED).unwrap();
        assert!(StatxFlags::from_bits_retain(s.stx_mask).contains(ASKED));
    }
}
