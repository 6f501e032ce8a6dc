//! Opening a SQLite database: the one writable connection (WAL, the
//! chosen `synchronous`, migrations) and the pool of read-only ones.

use std::{path::Path, sync::Arc, time::Duration};

use sqlx::{
    ConnectOptions, SqliteConnection, SqlitePool,
    sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous},
};

use super::{SqliteReaders, SqliteWriter, files, replicated, space::Space};
use crate::{
    config::Synchronous,
    db::{DbOptions, OpenError, migrations, reads::Readers},
    restore::beside,
};

/// Below this much free space on its file system, a failure to open a
/// database is told as most likely the full disk's (a new database takes
/// about 200 KiB on its way, a WAL grows by megabytes).
const LOW_SPACE: u64 = 1 << 20;

/// The database at `path`, created if need be and migrated: its read pool
/// and its writer's engine.
pub async fn open(path: &Path, opts: &DbOptions) -> Result<(Readers, SqliteWriter), OpenError> {
    let opened = open_at(path, opts).await;
    opened.map_err(|e| {
        // Only what writing could have failed: a refusal is no want of
        // space, whatever the space.
        if !matches!(
            e,
            OpenError::Open { .. } | OpenError::Migrate { .. } | OpenError::CreateDir { .. }
        ) {
            return e;
        }
        let dir = super::data_dir(path);
        match crate::restore::room_left(dir) {
            Some(free) if free < LOW_SPACE => OpenError::SpaceLow {
                dir: dir.to_owned(),
                free,
                source: Box::new(e),
            },
            _ => e,
        }
    })
}

async fn open_at(path: &Path, opts: &DbOptions) -> Result<(Readers, SqliteWriter), OpenError> {
    {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| OpenError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        let open_err = |source| OpenError::Open {
            path: path.to_owned(),
            source,
        };
        // Whether tally's data was there before this start: a wrong replica
        // path makes a restore step skip quietly, and a first deploy looks
        // the same. Say which it was.
        let len = std::fs::metadata(path).ok().map(|m| m.len());
        let file_existed = len.is_some_and(|len| len > 0);
        // What `sqlite3` leaves when asked about a missing database, and
        // what a restore that skips existing files takes for one.
        let empty_file = len == Some(0);
        refuse_other_names(path)?;
        let short_beside_wal = refuse_cut_short(path, len)?;
        // Before SQLite creates a file there: a restore would skip it.
        if !file_existed {
            let found = match empty_file {
                true => replicated::Found::EmptyFile,
                false => replicated::Found::Nothing,
            };
            replicated::refuse_if_lost(path, found, opts.under_litestream, opts.replica_empty)?;
        }
        // A new database is made whole under a working name and then put
        // in place: the path never holds a database without tally's tables,
        // which a later start under Litestream refuses (Litestream may have
        // replicated it), as a start stopped half-way through creating one
        // at the path left.
        if !file_existed
            && !empty_file
            && let Err(e) = create_whole(path, opts).await
        {
            // What it left is of no use: a later start makes it anew.
            let _ = remove_with_wal(&creating_path(path));
            return Err(e);
        }
        let mut conn = open_writer(path, opts).await?;
        if let Some((len, said)) = short_beside_wal {
            refuse_unless_whole(path, &mut conn, len, said).await?;
        }
        let had_tables = file_existed && has_tables(&mut conn).await.map_err(open_err)?;
        if file_existed && !had_tables {
            replicated::refuse_if_lost(
                path,
                replicated::Found::NoTables,
                opts.under_litestream,
                opts.replica_empty,
            )?;
        }
        if had_tables {
            tracing::info!(path = %path.display(), "opened an existing database");
        } else {
            tracing::warn!(
                path = %path.display(),
                file_existed,
                empty_file,
                "created a new, empty database; if this is not the first start, a restore \
                 from the replica did not happen (with empty_file, an empty file was there, \
                 which a restore takes for a database and skips)"
            );
        }
        crate::restore::announce(path, &mut conn).await;
        metrics::gauge!("tally_database_new").set(if had_tables { 0.0 } else { 1.0 });
        let migrator = migrator();
        let applied: Vec<(i64, Vec<u8>, bool)> = match has_migrations(&mut conn).await {
            Ok(false) => Vec::new(),
            Ok(true) => sqlx::query_as("SELECT version, checksum, success FROM _sqlx_migrations")
                .fetch_all(&mut conn)
                .await
                .map_err(open_err)?,
            Err(e) => return Err(open_err(e)),
        };
        let standing = migrations::standing(&migrator, &applied);
        if let Err(reason) = standing.admit() {
            return Err(OpenError::Refused {
                path: path.to_owned(),
                reason,
            });
        }
        migrations::warn_of_newer(&standing.newer);
        migrate(&migrator, &mut conn, path).await?;
        let (missing, loose) = tables_amiss(&mut conn, &migrations::tables(&migrator))
            .await
            .map_err(open_err)?;
        migrations::admit_tables(&missing)
            .and_then(|()| admit_strict(&loose))
            .map_err(|reason| OpenError::Refused {
                path: path.to_owned(),
                reason,
            })?;
        if opts.under_litestream {
            replicated::record(path);
            sqlx::query(
                "INSERT INTO replica_starts (id, started_at) VALUES (1, ?) \
                 ON CONFLICT (id) DO UPDATE SET started_at = excluded.started_at",
            )
            .bind(jiff::Timestamp::now().to_string())
            .execute(&mut conn)
            .await
            .map_err(open_err)?;
        }
        let readers = open_readers(path, opts.readers.max(1))
            .await
            .map_err(open_err)?;
        let space = Space::start(path, readers.clone(), opts.storage_limit).await;
        let engine = SqliteWriter {
            conn,
            // After the migrations: by now SQLite has created -wal and -shm.
            files: files::DbFiles::record(path, opts.under_litestream),
            checkpoint_on_close: opts.checkpoints,
            space,
            wal_restarted_at: None,
        };
        Ok((Readers(Arc::new(SqliteReaders(readers))), engine))
    }
}

/// The refusal of a database file cut short, found as `found`.
fn cut_short(path: &Path, found: String) -> OpenError {
    OpenError::Refused {
        path: path.to_owned(),
        reason: format!(
            "{found}: it has lost pages. Restore it from the replica (in Kubernetes, delete the \
             pod) or a backup, with everything beside it moved aside first (see the runbooks)"
        ),
    }
}

/// Refuses a database file cut short in place (truncated, or copied over
/// while in use): it has lost pages, which SQLite would read as zeros, and
/// a checkpoint would write the WAL's pages into it, a database with
/// holes. Either a tally that served it saw it cut and left its mark
/// ([`files::cut_short_mark`]), or, with no WAL to replay, the file is
/// shorter than its own header says. With a WAL beside it, it may be (a
/// checkpoint stopped half-way by a crash leaves pages only the WAL
/// holds): the length and what the header says are returned, for
/// [`refuse_unless_whole`] once the WAL is open. `len`: the file's length,
/// if there is one.
fn refuse_cut_short(path: &Path, len: Option<u64>) -> Result<Option<(u64, u64)>, OpenError> {
    let refused = |found: String| cut_short(path, found);
    let mark = files::cut_short_mark(path);
    if let Ok(said) = std::fs::read_to_string(&mark) {
        return Err(refused(format!(
            "it was found cut short while tally served it ({}; the mark {} says so: remove \
             the mark only to serve what is left of it)",
            said.trim(),
            mark.display()
        )));
    }
    let Some(len) = len else {
        return Ok(None);
    };
    let wal_empty = std::fs::metadata(beside(path, "-wal")).map_or(true, |m| m.len() == 0);
    // SQLite never leaves its database empty beside a WAL (tally makes its
    // own whole), and would delete the WAL, the evidence, as it opened it.
    if len == 0 && !wal_empty {
        return Err(refused(
            "the file is empty, with a WAL beside it: it was cut short (truncated, or copied \
             over while in use)"
                .to_owned(),
        ));
    }
    match files::header(path) {
        Ok(files::Header::NotADatabase) if len > 0 && len < 100 => Err(refused(format!(
            "the file is {len} bytes long, too short for the header every SQLite database \
             begins with: it was cut short (truncated, or copied over while in use), or is no \
             database"
        ))),
        // SQLite writes whole pages only (a header is read from 100 bytes
        // or more: the file is not empty).
        Ok(files::Header::Length { page, .. }) if len % page != 0 => Err(refused(format!(
            "the file is {len} bytes long, not a whole number of its {page}-byte pages: it \
                 was cut short (truncated, or copied over while in use)"
        ))),
        Ok(files::Header::Length { bytes, .. }) if bytes > len => match wal_empty {
            true => Err(refused(format!(
                "the file is shorter than its own header says ({len} of {bytes} bytes), \
                     with no WAL beside it: it was cut short (truncated, or copied over while \
                     in use)"
            ))),
            false => Ok(Some((len, bytes))),
        },
        _ => Ok(None),
    }
}

/// A database file shorter than its header says, with a WAL beside it:
/// whole if the WAL holds the pages the file lacks, which SQLite's
/// `quick_check` (a read of every page, the cost of this rare case) tells.
async fn refuse_unless_whole(
    path: &Path,
    conn: &mut SqliteConnection,
    len: u64,
    said: u64,
) -> Result<(), OpenError> {
    tracing::warn!(
        path = %path.display(),
        len,
        said,
        "the database file is shorter than its header says, with a WAL beside it (a checkpoint \
         stopped by a crash leaves that, and so does a file cut short): checking every page"
    );
    let found: Result<Vec<String>, _> = sqlx::query_scalar("PRAGMA quick_check")
        .fetch_all(&mut *conn)
        .await;
    match found {
        Ok(lines) if lines == ["ok"] => Ok(()),
        Ok(lines) => Err(cut_short(
            path,
            format!(
                "the file is shorter than its own header says ({len} of {said} bytes), and the \
                 WAL beside it does not make up for it (quick_check: {})",
                lines
                    .join("; ")
                    .replace('\n', " ")
                    .chars()
                    .take(300)
                    .collect::<String>()
            ),
        )),
        Err(e) => Err(cut_short(
            path,
            format!(
                "the file is shorter than its own header says ({len} of {said} bytes), and \
                 cannot be read whole ({e})"
            ),
        )),
    }
}

/// tally's migrations of a SQLite database.
fn migrator() -> sqlx::migrate::Migrator {
    migrations::tolerant(sqlx::migrate!("./migrations/sqlite"))
}

/// Runs `migrator` on the database at `path`.
async fn migrate(
    migrator: &sqlx::migrate::Migrator,
    conn: &mut SqliteConnection,
    path: &Path,
) -> Result<(), OpenError> {
    migrator
        .run(conn)
        .await
        .map_err(|source| OpenError::Migrate {
            path: path.to_owned(),
            source,
        })
}

/// Where a new database is made before it is put in place:
/// `tally.db` -> `tally.db-creating`.
fn creating_path(db: &Path) -> std::path::PathBuf {
    beside(db, "-creating")
}

/// Removes the file at `db` and what SQLite leaves beside it (`-wal`,
/// `-shm`), those that are there.
fn remove_with_wal(db: &Path) -> std::io::Result<()> {
    for file in [db.to_owned(), beside(db, "-wal"), beside(db, "-shm")] {
        match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Makes a new database at `path`, migrated, under a working name beside
/// it, and links it into place once it is whole and on disk (a link, where
/// a rename would replace a database that appeared at the path meanwhile),
/// then removes the working name. What a stopped creation left under the
/// working name is removed first (and, once linked, by
/// [`refuse_other_names`]).
async fn create_whole(path: &Path, opts: &DbOptions) -> Result<(), OpenError> {
    let working = creating_path(path);
    let failed = |source: std::io::Error| OpenError::Open {
        path: working.clone(),
        source: sqlx::Error::Io(source),
    };
    remove_with_wal(&working).map_err(failed)?;
    let mut conn = open_writer(&working, opts).await?;
    let made = async {
        migrate(&migrator(), &mut conn, &working).await?;
        // Everything into the file itself, which alone is linked into place.
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut conn)
            .await
            .map_err(|source| OpenError::Open {
                path: working.clone(),
                source,
            })?;
        Ok(())
    }
    .await;
    // Closed here, failed or not: dropped, it would close later, on its
    // own thread, holding the files (and their space) until then.
    let closed = sqlx::Connection::close(conn)
        .await
        .map_err(|source| OpenError::Open {
            path: working.clone(),
            source,
        });
    made?;
    closed?;
    std::fs::File::open(&working)
        .and_then(|f| f.sync_all())
        .map_err(failed)?;
    // A WAL (and its index) left at the path without its database would
    // be replayed into the new one, which, unlike the empty file SQLite
    // made at the path before, has pages: the deleted database's last
    // writes, or a malformed image. SQLite removed them; so does this.
    for stale in [beside(path, "-wal"), beside(path, "-shm")] {
        if std::fs::symlink_metadata(&stale).is_ok() {
            tracing::warn!(
                path = %stale.display(),
                "removing what a database no longer there left beside it, before a new one is \
                 put in place"
            );
            std::fs::remove_file(&stale).map_err(|source| OpenError::Open {
                path: stale.clone(),
                source: sqlx::Error::Io(source),
            })?;
        }
    }
    if let Err(e) = std::fs::hard_link(&working, path) {
        return Err(OpenError::Open {
            path: path.to_owned(),
            source: sqlx::Error::Io(match e.kind() {
                std::io::ErrorKind::AlreadyExists => std::io::Error::new(
                    e.kind(),
                    "a database appeared here while a new one was made: something else uses \
                     this directory. It was left as it is, and the new one removed",
                ),
                _ => e,
            }),
        });
    }
    remove_with_wal(&working).map_err(failed)?;
    crate::restore::sync_dir(path).map_err(|source| OpenError::Open {
        path: path.to_owned(),
        source: sqlx::Error::Io(source),
    })
}

/// Refuses a database file that has other names (hard links): the lock
/// that keeps a second tally off a database is the file beside its name
/// (`tally.db.lock`), and SQLite's WAL is the file beside it too, so a
/// tally started on another name took neither, and each kept writes in a
/// WAL of its own, where the other's reads and checkpoints missed them:
/// writes answered `200` were lost. (A copy is safe to keep.)
///
/// A name is left by a restore stopped right after it moved its file into
/// place (a link made, the restore's own name not yet removed): that one is
/// removed here, as the restore would have (this process holds the lock, so
/// no restore runs).
fn refuse_other_names(path: &Path) -> Result<(), OpenError> {
    use std::os::unix::fs::MetadataExt;
    let refused = |reason: String| OpenError::Refused {
        path: path.to_owned(),
        reason,
    };
    // The path's own entry, not what a symbolic link points to.
    let Ok(db) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if db.file_type().is_symlink() {
        // The lock and Litestream go by the link's name, SQLite's WAL by
        // the file's: two tallies, one on each name, both served.
        return Err(refused(
            "the database path is a symbolic link: give the file's own path (the lock beside \
             it, Litestream and SQLite's WAL would each go by a different name)"
                .into(),
        ));
    }
    if db.is_dir() {
        return Err(refused(
            "the database path names a directory: give the SQLite file's path in it (such as \
             /data/tally.db)"
                .into(),
        ));
    }
    let moved = crate::restore::names_moved_into_place(path);
    for left in moved.into_iter().chain([creating_path(path)]) {
        // Only a plain file that is the database itself: never through a
        // link, where removing the name would remove the only copy.
        if let Ok(other) = std::fs::symlink_metadata(&left)
            && other.is_file()
            && (db.dev(), db.ino()) == (other.dev(), other.ino())
        {
            tracing::info!(
                path = %left.display(),
                "removing the name a restore, or the making of a new database, left on the \
                 database as it moved it into place"
            );
            std::fs::remove_file(&left).map_err(|source| OpenError::Open {
                path: left.clone(),
                source: sqlx::Error::Io(source),
            })?;
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.nlink() > 1 => Err(refused(format!(
            "the file has {} names (hard links): a tally started on another of them would take \
             neither this one's lock nor its WAL, and writes would be lost; remove the other \
             names (`find DIR -samefile FILE` lists them; keep a copy instead: `cp`, or \
             `sqlite3 ... .backup`)",
            m.nlink()
        ))),
        _ => Ok(()),
    }
}

/// The one writable connection, in WAL mode (or an error).
async fn open_writer(path: &Path, opts: &DbOptions) -> Result<SqliteConnection, OpenError> {
    let open_err = |source| OpenError::Open {
        path: path.to_owned(),
        source,
    };
    let synchronous = match opts.synchronous {
        Synchronous::Full => SqliteSynchronous::Full,
        Synchronous::Normal => SqliteSynchronous::Normal,
    };
    let mut conn = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(synchronous)
        .busy_timeout(Duration::from_secs(5))
        // Litestream's guidance: the app must not checkpoint behind its
        // back, or WAL frames can be lost to the replica.
        .pragma(
            "wal_autocheckpoint",
            if opts.checkpoints { "1000" } else { "0" },
        )
        // SQLite keeps the WAL file at the largest size it ever reached
        // (a reader outside tally holding a snapshot, a large reset, a
        // burst between Litestream's checkpoints can take it to hundreds
        // of MB) and writes over it from the start after a checkpoint: the
        // disk the kubelet counts, and the storage limit with it, stayed
        // that high until tally closed. Now the write that starts the WAL
        // over truncates it to this.
        .pragma("journal_size_limit", super::space::WAL_KEPT.to_string())
        .connect()
        .await
        .map_err(open_err)?;
    let (journal_mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(&mut conn)
        .await
        .map_err(open_err)?;
    let (sync_level,): (i64,) = sqlx::query_as("PRAGMA synchronous")
        .fetch_one(&mut conn)
        .await
        .map_err(open_err)?;
    if !journal_mode.eq_ignore_ascii_case("wal") {
        return Err(OpenError::NotWal {
            path: path.to_owned(),
            mode: journal_mode,
        });
    }
    tracing::info!(
        path = %path.display(),
        journal_mode,
        synchronous = sync_level,
        checkpoints = opts.checkpoints,
        "database open"
    );
    Ok(conn)
}

/// Whether the file already holds tally's tables.
async fn has_migrations(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_one(conn)
    .await?;
    Ok(n > 0)
}

async fn has_tables(conn: &mut SqliteConnection) -> Result<bool, sqlx::Error> {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'counters'",
    )
    .fetch_one(conn)
    .await?;
    Ok(n > 0)
}

/// Which of `tables` the database does not hold, and which it holds not
/// STRICT, each in their order (SQLite's names are the same in any case),
/// in one statement. Every table of tally's is created STRICT; one rebuilt
/// without it (by another tool) takes a value of any type into any column,
/// such as a counter that overflowed turned into a REAL, which tally then
/// cannot read back.
async fn tables_amiss(
    conn: &mut SqliteConnection,
    tables: &[String],
) -> Result<(Vec<String>, Vec<String>), sqlx::Error> {
    let rows: Vec<(String, Option<i64>)> = sqlx::query_as(
        "SELECT j.value, t.strict FROM json_each(?1) AS j
         LEFT JOIN pragma_table_list AS t
           ON t.schema = 'main' AND t.type = 'table' AND lower(t.name) = lower(j.value)
         WHERE t.strict IS NOT 1
         ORDER BY j.key",
    )
    .bind(serde_json::to_string(tables).unwrap_or_default())
    .fetch_all(conn)
    .await?;
    let (missing, loose): (Vec<_>, Vec<_>) = rows.into_iter().partition(|(_, s)| s.is_none());
    let names = |rows: Vec<(String, Option<i64>)>| rows.into_iter().map(|(t, _)| t).collect();
    Ok((names(missing), names(loose)))
}

/// Whether tally may run with its tables `loose` not STRICT: not.
fn admit_strict(loose: &[String]) -> Result<(), String> {
    match loose {
        [] => Ok(()),
        loose => {
            let migrations::Named {
                s,
                names,
                are,
                them,
            } = migrations::Named::new(loose);
            Err(format!(
                "tally's table{s} {names} {are} not STRICT (rebuilt by another tool?): SQLite \
                 would then store values of any type in {them}, such as a counter past the \
                 largest integer turned into a REAL, which tally cannot read back (writes it \
                 committed would be answered as failed). Rebuild {them} as tally's migrations \
                 create {them} (`CREATE TABLE ... STRICT`, see migrations/sqlite/), copying the \
                 rows over, then start tally again",
            ))
        }
    }
}

/// The read-only pool: opened read-only *and* with `query_only`.
pub(crate) async fn open_readers(path: &Path, readers: u32) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(readers)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(5))
        // sqlx logs every read that waited over 2 s for a connection: under
        // a burst of reads, a line per request. The wait shows in the
        // request duration; past the timeout the read is answered `503`.
        .acquire_slow_threshold(Duration::from_secs(3600))
        // A local file does not drop connections; a ping before every read
        // would be one more round trip to the connection's thread.
        .test_before_acquire(false)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .read_only(true)
                .pragma("query_only", "ON")
                .busy_timeout(Duration::from_secs(5)),
        )
        .await
}
