//! The mark a database served under Litestream leaves beside it
//! (`.tally.db-replicated`), so that a start under Litestream which finds
//! the mark but no database of tally's refuses instead of starting empty.
//!
//! Under Litestream a new, empty database does not stay local: it is
//! replicated, and becomes the replica's latest state, which the next new
//! pod restores. A pod's first start finds nothing and creates the
//! database (a first deploy), and so would a container restarted in place
//! after the database file was deleted underneath it (tally exits at once
//! on that, and the kubelet restarts the container in the same pod, whose
//! volume keeps everything else and whose init container, the restore,
//! does not run again): before the mark, that start served an empty
//! database and replicated it over the data. The mark tells the two apart.
//! It is written once a database was opened under Litestream, and stays
//! with the volume; a new pod's volume has none, and its restore has run.
//! Its name starts with a dot, so `rm tally.db*` and `rm -rf /data/*` leave
//! it; what removes every file of the directory removes it too.

use std::path::{Path, PathBuf};

use crate::db::OpenError;

/// The mark beside `db`.
pub fn path(db: &Path) -> PathBuf {
    let mut name = std::ffi::OsString::from(".");
    name.push(db.file_name().unwrap_or_default());
    name.push("-replicated");
    db.with_file_name(name)
}

/// What a start found at the database's path instead of tally's database.
#[derive(Debug, Clone, Copy)]
pub enum Found {
    /// No file, or an empty one.
    Nothing,
    /// A file with no table of tally's: not a database tally served.
    NoTables,
}

/// Refuses, under Litestream, to start without tally's database where one
/// served under Litestream was.
pub fn refuse_if_lost(db: &Path, found: Found, under_litestream: bool) -> Result<(), OpenError> {
    let mark = path(db);
    if !under_litestream || !mark.exists() {
        return Ok(());
    }
    let what = match found {
        Found::NoTables => {
            "it holds no table of tally's (another file took its place), but a database served \
             under Litestream was here"
        }
        Found::Nothing => {
            "it is missing (or an empty file), but a database served under Litestream was here"
        }
    };
    Err(OpenError::Refused {
        path: db.to_owned(),
        reason: format!(
            "{what} ({} says so): a new, empty one would be replicated in its place and become \
             the replica's latest state. Put the database back from the replica first (the \
             runbook of TallyWriteErrors says how): in Kubernetes restore to the instant of \
             the loss (the chart's restore.timestamp) or delete the pod (a new pod's init \
             container restores the latest state into a new volume); elsewhere stop \
             Litestream, remove what is left at the database's path (a restore skips an \
             existing file, even an empty one), restore it with `tally restore-to` (or \
             `litestream restore`) and start again. To start empty on purpose, remove {}",
            mark.display(),
            mark.display()
        ),
    })
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
         its place.\n",
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
    use super::*;

    #[test]
    fn a_start_under_litestream_refuses_only_where_the_mark_is_and_the_database_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        assert_eq!(path(&db), dir.path().join(".tally.db-replicated"));
        assert!(
            refuse_if_lost(&db, Found::Nothing, true).is_ok(),
            "a first start"
        );
        record(&db);
        let mark = std::fs::read_to_string(path(&db)).unwrap();
        assert!(mark.contains("tally.db under Litestream"), "{mark}");
        assert!(
            refuse_if_lost(&db, Found::Nothing, false).is_ok(),
            "without Litestream an empty start replaces no replica"
        );
        for (found, says) in [
            (Found::Nothing, "it is missing"),
            (Found::NoTables, "no table of tally's"),
        ] {
            let Err(OpenError::Refused { reason, .. }) = refuse_if_lost(&db, found, true) else {
                panic!("{found:?} must be refused");
            };
            assert!(reason.contains(says), "{reason}");
            assert!(reason.contains(".tally.db-replicated"), "{reason}");
        }
        // Written once: a second record leaves it as it was.
        std::fs::write(path(&db), "kept").unwrap();
        record(&db);
        assert_eq!(std::fs::read_to_string(path(&db)).unwrap(), "kept");
    }
}
