//! File descriptors: the open-files limit raised where allowed, and the
//! connection cap fitted under it with room for what the open database
//! needs (SQLite keeps files per connection, PostgreSQL a socket), the
//! metrics listener and the rest, so that connections can never take the
//! descriptors the database needs.

use std::io;

use crate::{
    config::{Settings, Storage},
    server::{LINGERING_REFUSALS, METRICS_MAX_CONNECTIONS},
};

/// Descriptors kept free besides HTTP connections and the database's: stdio, the
/// runtime's epoll and wake-up descriptors, both listeners, Litestream's
/// control socket, and slack for what the process opens now and then.
const RESERVED_FDS: u64 = 64;
/// Descriptors per SQLite connection (the database file and its WAL; the
/// shared-memory file is opened once per process), rounded up for temp files.
const FDS_PER_SQLITE_CONNECTION: u64 = 3;
/// Descriptors per PostgreSQL connection: its socket.
const FDS_PER_POSTGRES_CONNECTION: u64 = 1;
/// Default cap when the open-files limit allows more: a partial head can
/// hold `server::HARD_HEAD_BYTES` per connection, so this bounds that memory to
/// 256 MiB. More than a single-writer service behind a proxy needs; set
/// `TALLY_MAX_CONNECTIONS` for more.
pub const DEFAULT_MAX_CONNECTIONS_CEILING: usize = 4096;
/// The smallest cap tally starts with, whatever the limit says.
const MIN_MAX_CONNECTIONS: usize = 16;
/// What a soft limit is raised to when the hard limit is "unlimited"
/// (Linux's default `fs.nr_open`; a soft limit cannot be infinite).
const NOFILE_WHEN_UNLIMITED: u64 = 1 << 20;

/// The open-files limit, after trying to raise it.
#[derive(Debug, Clone, Copy)]
pub struct OpenFiles {
    /// The soft limit tally found.
    pub was: u64,
    /// The soft limit now in force.
    pub soft: u64,
    pub hard: u64,
}

/// Raises the soft open-files limit to the hard one, where allowed.
/// Runtimes and service managers often start processes at a soft 1024 with
/// a far higher hard limit, expecting servers to raise it themselves.
pub fn raise_open_files_limit() -> io::Result<OpenFiles> {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit, setrlimit};
    let (was, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io::Error::from)?;
    let target = if hard == RLIM_INFINITY {
        NOFILE_WHEN_UNLIMITED.max(was)
    } else {
        hard
    };
    let mut soft = was;
    if target > was {
        match setrlimit(Resource::RLIMIT_NOFILE, target, hard) {
            Ok(()) => soft = target,
            Err(e) => {
                tracing::warn!(error = %e, soft = was, hard, "cannot raise the open-files limit")
            }
        }
    }
    Ok(OpenFiles { was, soft, hard })
}

/// Descriptors to keep free of API connections, for the database (writer
/// and `readers`), lingering refusals, the metrics listener's connections
/// and the rest.
pub fn reserved_fds(storage: &Storage, readers: u32, metrics_listener: bool) -> u64 {
    let per_connection = match storage {
        Storage::Sqlite(_) => FDS_PER_SQLITE_CONNECTION,
        Storage::Postgres(_) => FDS_PER_POSTGRES_CONNECTION,
    };
    RESERVED_FDS
        + LINGERING_REFUSALS as u64
        + per_connection * (u64::from(readers) + 1)
        + if metrics_listener {
            METRICS_MAX_CONNECTIONS as u64
        } else {
            0
        }
}

/// The connection cap: `configured` when it fits under the open-files
/// limit `soft` with `reserved` descriptors to spare, else what fits
/// (at most [`DEFAULT_MAX_CONNECTIONS_CEILING`] when not configured).
/// Returns the cap and whether `configured` had to be lowered.
pub fn connection_cap(configured: Option<u32>, soft: u64, reserved: u64) -> (usize, bool) {
    let fits = usize::try_from(soft.saturating_sub(reserved))
        .unwrap_or(usize::MAX)
        .max(MIN_MAX_CONNECTIONS);
    match configured {
        Some(n) if n as usize > fits => (fits, true),
        Some(n) => (n as usize, false),
        None => (fits.min(DEFAULT_MAX_CONNECTIONS_CEILING), false),
    }
}

/// Raises the open-files limit and fits the connection cap under it, so
/// that connections can never take the descriptors the database, the
/// readers and the metrics listener need; logs the numbers.
pub fn cap_connections(settings: &Settings) -> usize {
    let reserved = reserved_fds(
        &settings.database,
        settings.readers,
        settings.metrics_listen.is_some(),
    );
    let files = match raise_open_files_limit() {
        Ok(files) => files,
        Err(e) => {
            // Without the limit, trust the operator's cap, or a modest one.
            tracing::warn!(error = %e, "cannot read the open-files limit");
            let cap = settings.max_connections.map_or(1024, |n| n as usize);
            return cap;
        }
    };
    let (cap, lowered) = connection_cap(settings.max_connections, files.soft, reserved);
    if lowered {
        tracing::warn!(
            configured = settings.max_connections,
            max_connections = cap,
            open_files_limit = files.soft,
            reserved,
            "TALLY_MAX_CONNECTIONS does not fit under the open-files limit; lowered"
        );
    }
    tracing::info!(
        open_files_limit = files.soft,
        open_files_limit_was = files.was,
        open_files_hard_limit = files.hard,
        reserved,
        max_connections = cap,
        configured = settings.max_connections.is_some(),
        "connection limit"
    );
    cap
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_room_for_the_database_and_the_rest() {
        let sqlite = Storage::Sqlite("x.db".into());
        let reserved = reserved_fds(&sqlite, 4, true);
        assert_eq!(reserved, 64 + 32 + 15 + 16);
        let postgres: Storage = "postgres://db/x".parse().unwrap();
        assert_eq!(reserved_fds(&postgres, 4, true), 64 + 32 + 5 + 16);
        // A soft limit of 1024, as many runtimes start processes.
        assert_eq!(connection_cap(None, 1024, reserved), (897, false));
        // A generous limit: the memory ceiling applies.
        assert_eq!(
            connection_cap(None, 1 << 20, reserved),
            (DEFAULT_MAX_CONNECTIONS_CEILING, false)
        );
        // What the operator asks for, when it fits; more is lowered.
        assert_eq!(connection_cap(Some(500), 1024, reserved), (500, false));
        assert_eq!(connection_cap(Some(5000), 1024, reserved), (897, true));
        assert_eq!(connection_cap(Some(5000), 1 << 20, reserved), (5000, false));
        // A tiny limit still serves a few.
        assert_eq!(
            connection_cap(None, 50, reserved),
            (MIN_MAX_CONNECTIONS, false)
        );
    }
}
