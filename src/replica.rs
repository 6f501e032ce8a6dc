//! Talking to Litestream over its control socket.
//!
//! Under `litestream replicate -exec tally`, tally starts before Litestream
//! has even looked at the database. A pod must never serve writes that have
//! no working backup, so before binding its listener tally asks Litestream
//! to sync and wait (`POST /sync` with `"wait": true`) until the answer
//! shows that the replica holds everything the database holds.

use std::{
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
        "the replica is unreachable: no confirmed sync through {socket} within {waited:?} \
         (last: {last}); refusing to serve without a working backup"
    )]
    Unreachable {
        socket: PathBuf,
        waited: Duration,
        last: String,
    },
}

/// One `POST /sync` over the unix socket at `socket`, bounded by `limit`.
pub async fn sync_once(
    socket: &Path,
    db: &Path,
    wait: Duration,
    limit: Duration,
) -> Result<SyncStatus, String> {
    let call = async {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
        let (mut sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake failed: {e}"))?;
        tokio::spawn(conn);
        let body = serde_json::json!({
            "path": db,
            "wait": true,
            "timeout": wait.as_secs().max(1),
        });
        let req = Request::post("/sync")
            .header("host", "litestream")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let status = res.status();
        let bytes = res
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading the answer failed: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "litestream answered {status}: {}",
                String::from_utf8_lossy(&bytes).trim()
            ));
        }
        serde_json::from_slice::<SyncStatus>(&bytes).map_err(|e| {
            format!(
                "unexpected answer {:?}: {e}",
                String::from_utf8_lossy(&bytes)
            )
        })
    };
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {limit:?}")))
}

/// Asks Litestream to sync until the replica has caught up, or `overall`
/// has passed. Each call waits at most `per_call` (plus a little slack).
pub async fn wait_for_replica(
    socket: &Path,
    db: &Path,
    overall: Duration,
    per_call: Duration,
) -> Result<SyncStatus, ReplicaError> {
    let started = Instant::now();
    let deadline = started + overall;
    let mut last = String::from("no attempt");
    let mut attempt = 0u32;
    while Instant::now() < deadline {
        attempt += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = per_call.min(left).max(Duration::from_secs(1));
        match sync_once(socket, db, wait, wait + Duration::from_secs(2)).await {
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
                last = format!(
                    "status {:?}, txid {}, replicated txid {}",
                    s.status, s.txid, s.replicated_txid
                );
                tracing::info!(attempt, txid = s.txid, replicated_txid = s.replicated_txid, status = %s.status, "replica not in sync yet");
            }
            Err(e) => {
                tracing::info!(attempt, error = %e, "waiting for litestream");
                last = e;
            }
        }
        let pause =
            Duration::from_millis(250).min(deadline.saturating_duration_since(Instant::now()));
        tokio::time::sleep(pause).await;
    }
    Err(ReplicaError::Unreachable {
        socket: socket.to_owned(),
        waited: started.elapsed(),
        last,
    })
}
