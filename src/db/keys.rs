//! Idempotency keys: a keyed write runs once; a retry with the same key
//! gets the first answer back. The key is claimed in the transaction that
//! applies the write ([`Store::claim_key`]), so the write and its key
//! commit together, and a retry running at the same time, in this process
//! or another, waits for the first and then replays its answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{
    Error, clock,
    command::{Cleared, Deleted},
    store::{Store, StoredKey},
};
use crate::meter::{Day, Decision, IdempotencyKey, Reason, replayed_timezone};
use serde::{Deserialize, Serialize};

/// How long a key is remembered unless configured
/// (`TALLY_IDEMPOTENCY_KEY_TTL`).
pub const DEFAULT_KEY_TTL: Duration = Duration::from_secs(24 * 3600);

/// Most keys one clean-up deletes (both engines' statements take this
/// share): one statement stays short however large the backlog, and the
/// writer runs the next share after its next batch.
pub const FORGET_SHARE: u64 = 10_000;

/// What is stored for `key`, or `None`: then the key is the transaction's
/// and [`remember`] stores the command's answer under it.
pub async fn claim(
    conn: &mut impl Store,
    key: &IdempotencyKey,
    fingerprint: &str,
) -> Result<Option<StoredKey>, Error> {
    let mut stored = claim_all(conn, &[(key.as_str(), fingerprint)]).await?;
    Ok(stored.pop().flatten())
}

/// [`claim`] for many `(key, fingerprint)` (keys distinct) in one
/// statement: what is stored for each, in order, or `None` for a key the
/// transaction now holds.
pub async fn claim_all(
    conn: &mut impl Store,
    keys: &[(&str, &str)],
) -> Result<Vec<Option<StoredKey>>, Error> {
    // Never stamped earlier than the clock without a step: a key stored
    // while the clock is behind would expire early once it is set right.
    let not_before = clock::expected().map_or(i64::MIN, |t| t.as_second());
    let stored = conn
        .claim_keys(keys, not_before)
        .await
        .map_err(Error::at_key)?;
    match stored.len() == keys.len() {
        true => Ok(stored),
        false => Err(Error::Internal(
            format!("{} keys claimed, {} answered", keys.len(), stored.len()).into(),
        )),
    }
}

/// [`remember`] for many `(key, encoded answer)` in one statement.
pub async fn remember_all(conn: &mut impl Store, answers: &[(&str, String)]) -> Result<(), Error> {
    match answers.is_empty() {
        true => Ok(()),
        false => conn.remember_keys(answers).await,
    }
}

/// Gives back keys this transaction claimed for commands that were
/// refused: like a savepoint rolled back, the key is free for a retry.
pub async fn give_back(conn: &mut impl Store, keys: &[&str]) -> Result<(), Error> {
    match keys.is_empty() {
        true => Ok(()),
        false => conn.unclaim_keys(keys).await,
    }
}

/// An answer an idempotency key keeps: how it is stored with the key and
/// read back. Counter values, decisions, deletes and resets are: only
/// increments, checks, deletes and resets take keys.
pub trait Kept: Sized {
    fn encode(&self) -> String;
    fn decode(stored: &str) -> Result<Self, String>;
}

impl Kept for i64 {
    fn encode(&self) -> String {
        self.to_string()
    }

    fn decode(stored: &str) -> Result<Self, String> {
        stored
            .parse()
            .map_err(|e: std::num::ParseIntError| e.to_string())
    }
}

impl Kept for Decision {
    fn encode(&self) -> String {
        encode_decision(self)
    }

    fn decode(stored: &str) -> Result<Self, String> {
        decode_decision(stored)
    }
}

/// A delete keeps that it happened: its retry answers the same `204`,
/// though the row is gone by then.
impl Kept for Deleted {
    fn encode(&self) -> String {
        "deleted".to_owned()
    }

    fn decode(stored: &str) -> Result<Self, String> {
        match stored {
            // A retry deletes nothing.
            "deleted" => Ok(Deleted { usage_rows: 0 }),
            other => Err(format!("`{other}` is no stored delete")),
        }
    }
}

/// A reset keeps the day it cleared and how many rows it deleted: its
/// retry answers the same, and clears nothing counted since.
impl Kept for Cleared {
    fn encode(&self) -> String {
        format!("{} {}", self.day, self.deleted_rows)
    }

    fn decode(stored: &str) -> Result<Self, String> {
        let bad = || format!("`{stored}` is no stored reset");
        let (day, rows) = stored.split_once(' ').ok_or_else(bad)?;
        Ok(Cleared {
            day: Day::parse(day).map_err(|_| bad())?,
            deleted_rows: rows.parse().map_err(|_| bad())?,
        })
    }
}

/// Stores `answer` for the key, in the command's savepoint: the write and
/// its key land together or not at all.
pub async fn remember(
    conn: &mut impl Store,
    key: &IdempotencyKey,
    answer: &impl Kept,
) -> Result<(), Error> {
    conn.remember_keys(&[(key.as_str(), answer.encode())]).await
}

/// The answer stored for a key.
pub fn replay<T: Kept>(stored: &StoredKey) -> Result<T, Error> {
    T::decode(&stored.result)
        .map_err(|e| Error::Internal(format!("stored idempotent answer: {e}").into()))
}

/// Forgets one share of the keys older than `ttl` (how long a key is
/// remembered, `TALLY_IDEMPOTENCY_KEY_TTL`); returns how many. Their age
/// is counted from a time no step of the clock has moved on ([`clock`]):
/// a clock stepped past `ttl` would forget keys a retry still needs.
pub async fn forget_expired(conn: &mut impl Store, ttl: Duration) -> Result<u64, Error> {
    let from = clock::trusted(conn.now().await?).earliest;
    conn.forget_keys_stored_before(expired_before(from, ttl))
        .await
}

/// The stamp (unix seconds, rounded down) before which a key stored is
/// older than `ttl` at `now`. A part of a second of `ttl` counts as a
/// whole one: `1.9s` counted as 1 forgot keys 1.1 s after they were
/// stored.
fn expired_before(now: jiff::Timestamp, ttl: Duration) -> i64 {
    let ttl = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    now.as_second()
        .saturating_sub(i64::try_from(ttl).unwrap_or(i64::MAX))
}

/// This process's clock in unix seconds: the keys' clock on SQLite, where
/// one process is the only writer.
pub(super) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A decision as stored for its key.
#[derive(Serialize, Deserialize)]
struct StoredDecision {
    reason: Reason,
    day: String,
    visitor_calls: i64,
    global_calls: i64,
    visitor_limit: u32,
    global_limit: u32,
    timezone: String,
}

fn encode_decision(d: &Decision) -> String {
    let stored = StoredDecision {
        reason: d.reason,
        day: d.day.to_string(),
        visitor_calls: d.visitor_calls,
        global_calls: d.global_calls,
        visitor_limit: d.visitor_limit,
        global_limit: d.global_limit,
        timezone: d.timezone.iana_name().unwrap_or("UTC").to_owned(),
    };
    serde_json::to_string(&stored).unwrap_or_default()
}

fn decode_decision(s: &str) -> Result<Decision, String> {
    let d: StoredDecision = serde_json::from_str(s).map_err(|e| e.to_string())?;
    Ok(Decision {
        reason: d.reason,
        day: Day::parse(&d.day).map_err(|e| e.0)?,
        visitor_calls: d.visitor_calls,
        global_calls: d.global_calls,
        visitor_limit: d.visitor_limit,
        global_limit: d.global_limit,
        pruned_rows: 0,
        timezone: replayed_timezone(&d.timezone),
        decided_at: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored answer is replayed whatever its zone has become: one the
    /// budget can no longer be read with, or one no database knows.
    #[test]
    fn a_stored_answer_is_replayed_whatever_its_zone() {
        for zone in ["Europe/Berlin", "localtime", "Mars/Olympus"] {
            let stored = format!(
                r#"{{"reason":"ok","day":"2026-12-05","visitor_calls":1,"global_calls":2,"visitor_limit":3,"global_limit":4,"timezone":"{zone}"}}"#
            );
            let d = decode_decision(&stored).unwrap_or_else(|e| panic!("{zone}: {e}"));
            assert_eq!((d.visitor_calls, d.global_calls), (1, 2), "{zone}");
        }
    }

    /// No key is forgotten before it is `ttl` old, whatever part of a
    /// second it was stored at and however `ttl` ends.
    #[test]
    fn a_key_is_kept_for_its_whole_ttl() {
        let base = jiff::Timestamp::from_second(1_800_000_000).unwrap();
        for ttl_ms in [1_000, 1_500, 1_900, 2_000, 90_000, 86_400_000] {
            let ttl = Duration::from_millis(ttl_ms);
            for stored_ms in (0..1_000).step_by(50) {
                let stored = base + jiff::SignedDuration::from_millis(stored_ms);
                let stamp = stored.as_second();
                // The last seconds of it (a later `now` forgets more).
                let mut now = (stored + ttl - Duration::from_secs(3)).max(stored);
                while now < stored + ttl {
                    assert!(
                        stamp >= expired_before(now, ttl),
                        "ttl {ttl:?}: stored at {stored}, forgotten at {now}"
                    );
                    now += jiff::SignedDuration::from_millis(10);
                }
                // And forgotten within a second or two after it.
                let late = stored + ttl + Duration::from_secs(2);
                assert!(stamp < expired_before(late, ttl), "ttl {ttl:?}");
            }
        }
    }
}
