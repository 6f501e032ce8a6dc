//! What tally's metrics say of the replica Litestream keeps, for tests that
//! need the replica to hold a state before they go on (a restore to an
//! instant just after it, say).

use std::time::{Duration, Instant};

/// Litestream's local and replicated transaction ids, as tally last had
/// them from it (its watch asks every 2 s, a sync first), from the
/// Prometheus exposition at `url`.
pub async fn txids(url: &str) -> Option<(f64, f64)> {
    let text = reqwest::get(url).await.ok()?.text().await.ok()?;
    let sample = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    };
    Some((
        sample("tally_replica_local_txid")?,
        sample("tally_replica_replicated_txid")?,
    ))
}

/// Waits (60 s at most) until the replica holds all Litestream has taken
/// in locally, and that is past `after`; the local transaction id then.
pub async fn caught_up(url: &str, after: f64) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let txids = txids(url).await;
        if let Some((local, replicated)) = txids
            && local > after
            && replicated >= local
        {
            return local;
        }
        assert!(
            Instant::now() < deadline,
            "replica not caught up past {after}: {txids:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the replica holds every write acknowledged before the call,
/// `before` being the local transaction id before the first of them (on a
/// loaded host Litestream may ship them seconds late, after an instant
/// taken at a fixed delay): caught up past `before`, then again once
/// tally's watch has had Litestream take in whatever it had not (a sync in
/// the middle of the writes would have shipped only part of them).
pub async fn holds_all_since(url: &str, before: f64) {
    let synced = caught_up(url, before).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    caught_up(url, synced - 1.0).await;
}
