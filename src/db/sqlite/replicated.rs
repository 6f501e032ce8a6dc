//! The mark a database served under Litestream leaves beside it
//! (`tally.db-replicated`), so that a start which finds the mark but not
//! the database refuses instead of starting empty.
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

use std::path::{Path, PathBuf};

use crate::db::OpenError;

/// The mark beside `db`.
pub fn path(db: &Path) -> PathBuf {
    let mut name = db.file_name().unwrap_or_default().to_os_string();
    name.push("-replicated");
    db.with_file_name(name)
}

/// Refuses to create a database where one served under Litestream was
/// (`found` says whether a database file with content is there).
pub fn refuse_if_lost(db: &Path, found: bool) -> Result<(), OpenError> {
    let mark = path(db);
    if found || !mark.exists() {
        return Ok(());
    }
    Err(OpenError::Refused {
        path: db.to_owned(),
        reason: format!(
            "it is gone, but a database served under Litestream was here ({} says so): a new, \
             empty one would be replicated in its place and become the replica's latest state. \
             Put the database back from the replica first: in Kubernetes delete the pod (a new \
             pod's init container restores it into a new volume); elsewhere restore it with \
             `litestream restore` (or `tally restore-to`) and start again. To start empty on \
             purpose, remove {}",
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
         tally refuses to start: a new, empty database would be replicated in its place.\n",
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
    fn a_start_refuses_only_where_the_mark_is_and_the_database_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        assert!(refuse_if_lost(&db, false).is_ok(), "a first start");
        record(&db);
        let mark = std::fs::read_to_string(path(&db)).unwrap();
        assert!(mark.contains("tally.db under Litestream"), "{mark}");
        assert!(refuse_if_lost(&db, true).is_ok(), "the database is there");
        let Err(OpenError::Refused { reason, .. }) = refuse_if_lost(&db, false) else {
            panic!("a lost database must be refused");
        };
        assert!(reason.contains("tally.db-replicated"), "{reason}");
        // Written once: a second record leaves it as it was.
        std::fs::write(path(&db), "kept").unwrap();
        record(&db);
        assert_eq!(std::fs::read_to_string(path(&db)).unwrap(), "kept");
    }
}
