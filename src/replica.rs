//! Talking to Litestream over its control socket.
//!
//! Under `litestream replicate -exec tally`, tally starts before Litestream
//! has even looked at the database. A pod must never serve writes that have
//! no working backup, so before binding its listener tally asks Litestream
//! a few times a second how far the replica is (`POST /sync` without
//! waiting: Litestream makes a wait's time limit the deadline of the upload
//! itself) until the answer shows that the replica holds everything the
//! database holds.
//!
//! Once serving, [`watch`] keeps asking (a sync without waiting answers the
//! local and the replicated transaction ids) and exports how far, and for
//! how long, the replica is behind. Litestream 0.5 exports no such number,
//! and a hanging object store shows in none of its error counters.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, client::conn::http1};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::UnixStream;

/// What Litestream answered to a sync.
#[derive(Debug, Clone, Deserialize)]
pub struct SyncStatus {
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub txid: u64,
    #[serde(default)]
    pub replicated_txid: u64,
}

impl SyncStatus {
    /// The replica has caught up with a database that has a position.
    pub fn is_replicated(&self) -> bool {
        self.txid > 0 && self.replicated_txid == self.txid
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error(
        "the replica is unreachable: no confirmed sync through {socket} within {waited:.1?} \
         (last: {last}); refusing to serve without a working backup ({why})"
    )]
    Unreachable {
        socket: PathBuf,
        waited: Duration,
        last: String,
        /// What the last failure points at.
        why: &'static str,
    },
}

/// Why one call to Litestream's control socket brought no status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncError {
    /// No answer within the call's limit: it says nothing of Litestream
    /// but that it was slow or stuck.
    NoAnswer(Duration),
    /// The control socket could not be connected to: nothing was asked
    /// of Litestream, let alone of the object store.
    NoSocket(String),
    /// Litestream answered with an error status: its words (an object
    /// store's error, or its own, such as a database its configuration
    /// does not name).
    Refused(String),
    /// What went wrong in the HTTP exchange, or an answer that is not a
    /// status.
    Failed(String),
}

impl std::fmt::Display for SyncError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SyncError::NoAnswer(limit) => write!(f, "no answer within {limit:.1?}"),
            SyncError::NoSocket(why) | SyncError::Refused(why) | SyncError::Failed(why) => {
                f.write_str(why)
            }
        }
    }
}

/// One `POST /sync` over the unix socket at `socket`, bounded by `limit`:
/// Litestream's local sync (the database's new transactions taken into its
/// own files), answered with the local and the replicated transaction ids.
/// It never asks Litestream to wait for the replica (see
/// [`wait_for_replica`]).
pub async fn sync_once(socket: &Path, db: &Path, limit: Duration) -> Result<SyncStatus, SyncError> {
    let deadline = tokio::time::Instant::now() + limit;
    let stream = match tokio::time::timeout_at(deadline, UnixStream::connect(socket)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Err(SyncError::NoSocket(no_socket(socket, &e))),
        Err(_) => return Err(SyncError::NoAnswer(limit)),
    };
    let call = async {
        let (mut sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| SyncError::Failed(format!("HTTP handshake failed: {e}")))?;
        tokio::spawn(conn);
        let body = serde_json::json!({
            "path": db,
            "wait": false,
            "timeout": limit.as_secs().max(1),
        });
        let req = Request::post("/sync")
            .header("host", "litestream")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| SyncError::Failed(e.to_string()))?;
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| SyncError::Failed(format!("request failed: {e}")))?;
        let status = res.status();
        let bytes = res
            .into_body()
            .collect()
            .await
            .map_err(|e| SyncError::Failed(format!("reading the answer failed: {e}")))?
            .to_bytes();
        if !status.is_success() {
            return Err(SyncError::Refused(format!(
                "litestream answered {status}: {}",
                String::from_utf8_lossy(&bytes).trim()
            )));
        }
        serde_json::from_slice::<SyncStatus>(&bytes).map_err(|e| {
            SyncError::Failed(format!(
                "unexpected answer {:?}: {e}",
                String::from_utf8_lossy(&bytes)
            ))
        })
    };
    match tokio::time::timeout_at(deadline, call).await {
        Ok(answer) => answer,
        Err(_) => Err(SyncError::NoAnswer(limit)),
    }
}

/// Why the control socket at `socket` could not be connected to, with what
/// an operator can do about it.
fn no_socket(socket: &Path, e: &std::io::Error) -> String {
    // Litestream does not create the socket's directory: it logs a
    // warning, and goes on without a control socket. The directory may
    // exist by now (tally makes the database's), which does not give
    // Litestream its socket back.
    // Told only when it surely does not: a directory on the path that
    // tally may not search answers neither yes nor no.
    let no_dir = socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .is_some_and(|d| matches!(d.try_exists(), Ok(false)));
    let not_a_socket = std::fs::metadata(socket)
        .is_ok_and(|m| !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
    let hint = match e.kind() {
        std::io::ErrorKind::PermissionDenied => {
            " (tally may not open it: the permissions of the socket, or of a directory on \
             its path)"
        }
        _ if no_dir => {
            " (its directory does not exist, so Litestream has no control socket: create \
             it before Litestream starts, or put the socket in an existing one)"
        }
        std::io::ErrorKind::NotFound => {
            " (Litestream has no control socket there: its log says why it could not \
             make one, most often a directory that did not exist when it started, which \
             tally has made since: start Litestream again; or litestream.yml's socket.path \
             is not TALLY_LITESTREAM_SOCKET)"
        }
        _ if not_a_socket => {
            " (what is at that path is not a socket: TALLY_LITESTREAM_SOCKET must name \
             litestream.yml's socket.path)"
        }
        std::io::ErrorKind::ConnectionRefused => {
            " (nothing listens on it: a socket file left by a Litestream that is gone, or \
             one that has not started its control server yet)"
        }
        _ => "",
    };
    format!("cannot connect to {}: {e}{hint}", socket.display())
}

/// Asks Litestream, a few times a second, how far the replica is, until it
/// has caught up or `overall` has passed. Each call waits at most
/// `per_call` for an answer, and none runs past `overall`. The calls ask
/// for Litestream's local sync only, not for its wait: Litestream makes a
/// call's time limit the deadline of the uploads (and the download of the
/// replica's latest file) it waits for, so a call that waited cut them off
/// at its limit, and each started again from nothing; its own replication
/// loop makes them, with no deadline, and the answers show when they
/// land.
pub async fn wait_for_replica(
    socket: &Path,
    db: &Path,
    overall: Duration,
    per_call: Duration,
) -> Result<SyncStatus, ReplicaError> {
    let started = Instant::now();
    let deadline = started + overall;
    // The answer the wait will be told by if it ends unmet.
    let mut last: Option<Result<SyncStatus, SyncError>> = None;
    let mut attempt = 0u32;
    // Asked a few times a second; said every 10 s at most.
    let mut said_at: Option<Instant> = None;
    let mut may_say = || {
        let now = Instant::now();
        let due = said_at.is_none_or(|at| now.duration_since(at) >= PROGRESS_EVERY);
        if due {
            said_at = Some(now);
        }
        due
    };
    while Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now());
        attempt += 1;
        // Cut at the deadline, which an answer after it would miss anyway.
        let limit = per_call.min(left);
        match sync_once(socket, db, limit).await {
            Ok(s) if s.is_replicated() => {
                tracing::info!(
                    txid = s.txid,
                    replicated_txid = s.replicated_txid,
                    attempt,
                    waited = ?started.elapsed(),
                    "replica confirmed in sync"
                );
                return Ok(s);
            }
            Ok(s) => {
                if may_say() {
                    tracing::info!(attempt, txid = s.txid, replicated_txid = s.replicated_txid, status = %s.status, "replica not in sync yet");
                }
                last = Some(Ok(s));
            }
            Err(e) => {
                if may_say() {
                    tracing::info!(attempt, error = %e, "waiting for litestream");
                }
                // A call cut short by the deadline says less than what
                // Litestream answered before it, which stays the reason.
                // A failure to reach the socket does not stand: the
                // socket was reached since.
                let stands = !matches!(last, Some(Err(SyncError::NoSocket(_))));
                if !(matches!(e, SyncError::NoAnswer(_)) && attempt > 1 && stands) {
                    last = Some(Err(e));
                }
            }
        }
        let pause =
            Duration::from_millis(250).min(deadline.saturating_duration_since(Instant::now()));
        tokio::time::sleep(pause).await;
    }
    let why = match &last {
        Some(Err(SyncError::NoSocket(_))) => {
            "Litestream's control socket could not be reached, see `last`: the object store was \
             not asked"
        }
        Some(Err(SyncError::Refused(_))) => {
            "Litestream answered with an error, see `last`: the object store's, or its own"
        }
        _ => {
            "the object store does not answer, or answers too slowly for the database's size \
             within TALLY_REPLICA_WAIT_TIMEOUT"
        }
    };
    let last = match last {
        None => String::from("no attempt"),
        Some(Ok(s)) => format!(
            "status {:?}, txid {}, replicated txid {}",
            s.status, s.txid, s.replicated_txid
        ),
        Some(Err(e)) => e.to_string(),
    };
    Err(ReplicaError::Unreachable {
        socket: socket.to_owned(),
        waited: started.elapsed(),
        last,
        why,
    })
}

/// How often the gate says how the wait for the replica goes.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// How far the replica is behind, from successive answers of Litestream.
#[derive(Debug, Default)]
pub struct Lag {
    /// Transaction ids seen locally and not yet replicated, oldest first,
    /// with when each was first seen.
    pending: VecDeque<(u64, Instant)>,
    /// When Litestream last answered.
    answered: Option<Instant>,
    /// Whether a question went unanswered since that answer: transactions
    /// first seen after such a gap may be as old as the gap.
    silent: bool,
}

impl Lag {
    /// Takes one answer seen at `now` and returns how long the replica has
    /// been behind: the age of the oldest local transaction it does not
    /// hold yet, 0 when it holds them all.
    pub fn observe(&mut self, status: &SyncStatus, now: Instant) -> Duration {
        let seen = match self.silent {
            true => self.answered.unwrap_or(now),
            false => now,
        };
        self.answered = Some(now);
        self.silent = false;
        if self.pending.back().is_none_or(|&(t, _)| status.txid > t) {
            self.pending.push_back((status.txid, seen));
        }
        while self
            .pending
            .front()
            .is_some_and(|&(t, _)| t <= status.replicated_txid)
        {
            self.pending.pop_front();
        }
        self.pending.front().map_or(Duration::ZERO, |&(_, seen)| {
            now.saturating_duration_since(seen)
        })
    }

    /// The lag when Litestream does not answer: it cannot be confirmed to
    /// ship anything, so the replica is taken to be behind since its last
    /// answer (a hanging object store hangs the control socket too).
    pub fn unanswered(&mut self, now: Instant) -> Duration {
        self.silent = true;
        let oldest = self.pending.front().map(|&(_, seen)| seen);
        oldest
            .into_iter()
            .chain(self.answered)
            .min()
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }
}

/// Asks Litestream every `every` for the local and replicated transaction
/// ids, and exports them with the replica's lag (see [`Lag`]). A call that
/// fails or hangs is counted, and the lag grows from Litestream's last
/// answer ([`Lag::unanswered`]).
pub async fn watch(socket: PathBuf, db: PathBuf, every: Duration) {
    let mut lag = Lag::default();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = Instant::now();
        match sync_once(&socket, &db, every.max(Duration::from_secs(1))).await {
            Ok(s) => {
                metrics::gauge!("tally_replica_up").set(1.0);
                metrics::gauge!("tally_replica_local_txid").set(s.txid as f64);
                metrics::gauge!("tally_replica_replicated_txid").set(s.replicated_txid as f64);
                let behind = lag.observe(&s, now);
                metrics::gauge!("tally_replica_lag_seconds").set(behind.as_secs_f64());
            }
            Err(e) => {
                metrics::gauge!("tally_replica_up").set(0.0);
                metrics::counter!("tally_replica_poll_errors_total").increment(1);
                metrics::gauge!("tally_replica_lag_seconds").set(lag.unanswered(now).as_secs_f64());
                tracing::warn!(error = %e, "cannot ask litestream how far the replica is");
            }
        }
    }
}

/// What `litestream replicate` was given that another Litestream command
/// reading the same replica must be given too.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Replicating {
    /// Its `-config`; `None`: it read `LITESTREAM_CONFIG`, else
    /// `/etc/litestream.yml` (see [`crate::restore::config_path`]).
    pub config: Option<PathBuf>,
    /// Its `-no-expand-env`.
    pub no_expand_env: bool,
}

/// The name process `pid` runs as (its executable's, cut to 15 bytes).
pub fn process_name(pid: u32) -> Option<String> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim_end().to_owned())
}

/// Whether a process of that name is Litestream.
pub fn is_litestream(name: &str) -> bool {
    name == "litestream"
}

/// What process `pid` was given, if it is `litestream replicate` (as
/// tally's parent is under `-exec`): read from its command line, so that
/// tally asks the very replica its parent replicates to, whatever
/// configuration tally was told of.
pub fn replicating(pid: u32) -> Option<Replicating> {
    if !is_litestream(&process_name(pid)?) {
        return None;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<std::ffi::OsString> = cmdline
        .split(|b| *b == 0)
        .map(std::os::unix::ffi::OsStrExt::from_bytes)
        .map(std::ffi::OsStr::to_owned)
        .collect();
    let mut given = replicate_args(args.get(1..)?)?;
    // Relative to Litestream's own working directory.
    if let Some(config) = given.config.as_mut().filter(|c| c.is_relative())
        && let Ok(cwd) = std::fs::read_link(format!("/proc/{pid}/cwd"))
    {
        *config = cwd.join(&*config);
    }
    Some(given)
}

/// `replicate`'s flags, as Go's flag package reads them (`-f v`, `-f=v`,
/// `--f v`, `--f=v`, up to the first argument that is not a flag or `--`).
fn replicate_args(args: &[std::ffi::OsString]) -> Option<Replicating> {
    let (first, flags) = args.split_first()?;
    if first != "replicate" {
        return None;
    }
    let mut given = Replicating::default();
    let mut flags = flags.iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(arg) = flags.next() {
        if arg == "--" || !arg.starts_with('-') {
            break;
        }
        let (name, value) = match arg.trim_start_matches('-').split_once('=') {
            Some((name, value)) => (name.to_owned(), Some(value.to_owned())),
            None => (arg.trim_start_matches('-').to_owned(), None),
        };
        match name.as_str() {
            // Go's strconv.ParseBool; any other value stops Litestream.
            "no-expand-env" => {
                given.no_expand_env = value.is_none_or(|v| {
                    !matches!(v.as_str(), "0" | "f" | "F" | "false" | "FALSE" | "False")
                });
            }
            // Boolean flags take no value of their own.
            "once" | "force-snapshot" | "enforce-retention" | "restore-if-db-not-exists" => {}
            _ => {
                let value = value.or_else(|| flags.next());
                if name == "config" {
                    given.config = value.map(PathBuf::from);
                }
            }
        }
    }
    Some(given)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(txid: u64, replicated_txid: u64) -> SyncStatus {
        SyncStatus {
            status: String::new(),
            txid,
            replicated_txid,
        }
    }

    #[tokio::test]
    async fn a_socket_that_cannot_be_reached_is_named_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tally.db");
        let limit = Duration::from_secs(1);
        let missing = dir.path().join("nowhere/litestream.sock");
        let e = sync_once(&missing, &db, limit).await.unwrap_err();
        let e = e.to_string();
        assert!(e.contains("its directory does not exist"), "{e}");
        // A directory that exists, with no socket in it (made by tally
        // after Litestream failed to make its socket there): that hint.
        let absent = dir.path().join("litestream.sock");
        let e = sync_once(&absent, &db, limit).await.unwrap_err();
        assert!(matches!(e, SyncError::NoSocket(_)), "{e}");
        let e = e.to_string();
        assert!(e.starts_with("cannot connect to"), "{e}");
        assert!(!e.contains("directory does not exist"), "{e}");
        assert!(e.contains("start Litestream again"), "{e}");
        // The whole wait says the object store was not asked, rather than
        // blaming it.
        let e = wait_for_replica(&absent, &db, limit, limit)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("the object store was not asked"), "{e}");
        assert!(!e.contains("the object store does not answer"), "{e}");
        // A socket file nothing listens on.
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        let e = sync_once(&stale, &db, limit).await.unwrap_err().to_string();
        assert!(e.contains("nothing listens on it"), "{e}");
        // A regular file, or a directory, at the path.
        let file = dir.path().join("file.sock");
        std::fs::write(&file, b"").unwrap();
        for path in [&file, &dir.path().to_path_buf()] {
            let e = sync_once(path, &db, limit).await.unwrap_err().to_string();
            assert!(e.contains("is not a socket"), "{e}");
        }
    }

    /// A socket missing at the first try that then takes calls and never
    /// answers: the wait ends blaming the object store (Litestream was
    /// reached), not the socket.
    #[tokio::test]
    async fn a_socket_found_late_is_not_blamed_for_the_silence_after() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("litestream.sock");
        let db = dir.path().join("tally.db");
        let late = socket.clone();
        let held = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(400)).await;
            let listener = tokio::net::UnixListener::bind(&late).unwrap();
            let mut open = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                open.push(stream);
            }
        });
        let limit = Duration::from_secs(2);
        let e = wait_for_replica(&socket, &db, limit, limit)
            .await
            .unwrap_err()
            .to_string();
        held.abort();
        assert!(e.contains("the object store does not answer"), "{e}");
        assert!(e.contains("(last: no answer within"), "{e}");
    }

    #[tokio::test]
    async fn the_wait_for_a_silent_litestream_ends_at_its_deadline() {
        // A control socket that takes the call and never answers, as a
        // Litestream whose object store hangs.
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("litestream.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                open.push(stream);
            }
        });
        let db = dir.path().join("tally.db");
        let overall = Duration::from_secs(2);
        let started = Instant::now();
        let e = wait_for_replica(&socket, &db, overall, Duration::from_secs(10))
            .await
            .unwrap_err();
        let took = started.elapsed();
        held.abort();
        assert!(matches!(e, ReplicaError::Unreachable { .. }), "{e}");
        // A call given Litestream's slack past the deadline would end at
        // 4 s.
        assert!(
            took >= overall && took < Duration::from_millis(3500),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn the_wait_ends_on_what_litestream_last_said() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // Each call answered with an error after 1.5 s, as an object store
        // that fails slowly: a call begun with less than that left would
        // only time out, and its timeout would stand as the reason.
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("litestream.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let server = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    let _ = stream.read(&mut request).await;
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 16\r\n\r\n\
                              ListObjectsV2 ??",
                        )
                        .await;
                });
            }
        });
        let db = dir.path().join("tally.db");
        let e = wait_for_replica(
            &socket,
            &db,
            Duration::from_millis(2600),
            Duration::from_secs(10),
        )
        .await
        .unwrap_err();
        server.abort();
        let text = e.to_string();
        assert!(
            text.contains(
                "(last: litestream answered 500 Internal Server Error: ListObjectsV2 ??)"
            ),
            "{text}"
        );
    }

    #[test]
    fn lag_is_the_age_of_the_oldest_unreplicated_transaction() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut lag = Lag::default();
        assert_eq!(lag.observe(&at(5, 5), s(0)), Duration::ZERO);
        // 6 appears at 1 s and is not shipped until 4 s; 7 appears at 2 s.
        assert_eq!(lag.observe(&at(6, 5), s(1)), Duration::ZERO);
        assert_eq!(lag.observe(&at(7, 5), s(2)), Duration::from_secs(1));
        assert_eq!(lag.observe(&at(7, 5), s(3)), Duration::from_secs(2));
        // 6 is shipped: what is left is 7, first seen at 2 s.
        assert_eq!(lag.observe(&at(7, 6), s(4)), Duration::from_secs(2));
        assert_eq!(lag.observe(&at(7, 7), s(5)), Duration::ZERO);
        assert!(lag.pending.is_empty());
        // Litestream stops answering: behind since its last answer.
        assert_eq!(lag.unanswered(s(9)), Duration::from_secs(4));
        // It answers again, not caught up: what it shows first may date
        // from the silence, so its age counts from the last answer.
        assert_eq!(lag.observe(&at(8, 7), s(10)), Duration::from_secs(5));
        assert_eq!(lag.observe(&at(8, 8), s(11)), Duration::ZERO);
    }

    #[test]
    fn a_restarted_litestream_with_lower_ids_does_not_wedge_the_lag() {
        let t0 = Instant::now();
        let mut lag = Lag::default();
        lag.observe(&at(9, 3), t0);
        assert_eq!(
            lag.observe(&at(4, 9), t0 + Duration::from_secs(1)),
            Duration::ZERO
        );
    }

    fn args(line: &str) -> Vec<std::ffi::OsString> {
        line.split(' ').map(Into::into).collect()
    }

    #[test]
    fn the_configuration_litestream_replicates_with_is_read_from_its_arguments() {
        let cases = [
            (
                "replicate -config /etc/litestream/litestream.yml -exec tally",
                Some("/etc/litestream/litestream.yml"),
                false,
            ),
            (
                "replicate --config=ls.yml -exec tally",
                Some("ls.yml"),
                false,
            ),
            (
                "replicate -exec tally -config=/x.yml",
                Some("/x.yml"),
                false,
            ),
            (
                "replicate -no-expand-env -log-level debug --config /y.yml",
                Some("/y.yml"),
                true,
            ),
            (
                "replicate -no-expand-env=F -config=/y.yml",
                Some("/y.yml"),
                false,
            ),
            (
                "replicate -no-expand-env=0 -config=/y.yml",
                Some("/y.yml"),
                false,
            ),
            (
                "replicate -no-expand-env=True -config=/y.yml",
                Some("/y.yml"),
                true,
            ),
            ("replicate -exec tally", None, false),
            (
                "replicate -restore-if-db-not-exists -config /z.yml",
                Some("/z.yml"),
                false,
            ),
            // Past the first argument that is not a flag, nothing is a flag.
            ("replicate db.sqlite s3://b/p -config /no.yml", None, false),
            ("replicate -- -config /no.yml", None, false),
        ];
        for (line, config, no_expand_env) in cases {
            assert_eq!(
                replicate_args(&args(line)),
                Some(Replicating {
                    config: config.map(PathBuf::from),
                    no_expand_env,
                }),
                "{line}"
            );
        }
        assert_eq!(replicate_args(&args("restore -config /a.yml db")), None);
        assert_eq!(replicating(std::process::id()), None, "not Litestream");
    }
}
