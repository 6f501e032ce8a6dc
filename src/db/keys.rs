//! Idempotency keys: a keyed write runs once; a retry with the same key
//! gets the first answer back. The key is claimed in the transaction that
//! applies the write ([`Store::claim_key`]), so the write and its key
//! commit together, and a retry running at the same time, in this process
//! or another, waits for the first and then replays its answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{
    Error,
    command::{Command, Outcome},
    store::Store,
};
use crate::meter::{Day, Decision, IdempotencyKey, Reason, load_timezone};
use serde::{Deserialize, Serialize};

/// How long a key is remembered.
pub const KEY_TTL: Duration = Duration::from_secs(24 * 3600);

/// What was stored for a key: the command it was first used for, and that
/// command's answer.
pub struct Stored {
    pub fingerprint: String,
    result: String,
}

/// What is stored for `key`, or `None`: then the key is the transaction's
/// and [`remember`] stores the command's answer under it.
pub async fn claim(
    conn: &mut impl Store,
    key: &IdempotencyKey,
    fingerprint: &str,
) -> Result<Option<Stored>, Error> {
    let stored = conn.claim_key(key.as_str(), fingerprint).await?;
    Ok(stored.map(|(fingerprint, result)| Stored {
        fingerprint,
        result,
    }))
}

/// Stores `outcome` for the key, in the command's savepoint: the write and
/// its key land together or not at all. Only counter values and decisions
/// are ever stored: only increments and checks take keys.
pub async fn remember(
    conn: &mut impl Store,
    key: &IdempotencyKey,
    fingerprint: &str,
    outcome: &Outcome,
) -> Result<(), Error> {
    let result = match outcome {
        Outcome::Value(v) => v.to_string(),
        Outcome::Decision(d) => encode_decision(d),
        Outcome::Budget(_) | Outcome::Reset { .. } => return Ok(()),
    };
    conn.remember_key(key.as_str(), fingerprint, &result).await
}

/// The answer stored for `command`'s key, as that command answers.
pub fn replay(command: &Command, stored: &Stored) -> Result<Outcome, Error> {
    let bad = |e: String| Error::Internal(format!("stored idempotent answer: {e}").into());
    match command {
        Command::Increment { .. } => stored
            .result
            .parse()
            .map(Outcome::Value)
            .map_err(|e: std::num::ParseIntError| bad(e.to_string())),
        Command::Check { .. } => decode_decision(&stored.result)
            .map(Outcome::Decision)
            .map_err(bad),
        Command::PutBudget { .. } | Command::Reset { .. } => {
            Err(bad(format!("{} takes no key", command.kind())))
        }
    }
}

/// Forgets keys older than [`KEY_TTL`]; returns how many.
pub async fn forget_expired(conn: &mut impl Store) -> Result<u64, Error> {
    conn.forget_keys_older_than(KEY_TTL).await
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
        timezone: load_timezone(&d.timezone).map_err(|e| e.0)?,
    })
}
