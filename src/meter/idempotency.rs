//! Idempotency keys: a keyed write runs once; a retry with the same key
//! gets the first answer back. The writer serialises all writes, so two
//! requests with one key never race: the second finds the first's answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sqlx::SqliteConnection;

use super::{Day, Decision, InvalidInput, MeterError, Reason, types::load_timezone};

/// How long a key is remembered.
pub const KEY_TTL: Duration = Duration::from_secs(24 * 3600);

/// A client's idempotency key: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub const MAX_LEN: usize = 255;

    /// Parses the `Idempotency-Key` field value: a structured-field string
    /// (`"..."`), or the bare characters.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let s = s.trim();
        let inner = s
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix('"'))
            .unwrap_or(s);
        if inner.is_empty() || inner.len() > Self::MAX_LEN {
            return Err(InvalidInput(format!(
                "an Idempotency-Key must be 1 to {} characters long",
                Self::MAX_LEN
            )));
        }
        if !inner
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
        {
            return Err(InvalidInput(
                "an Idempotency-Key may hold only visible ASCII characters, no quotes or backslashes"
                    .into(),
            ));
        }
        Ok(Self(inner.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What was stored for a key.
pub struct Stored {
    pub fingerprint: String,
    pub result: String,
}

pub async fn lookup(
    conn: &mut SqliteConnection,
    key: &IdempotencyKey,
) -> Result<Option<Stored>, MeterError> {
    let row: Option<(String, String)> =
        sqlx::query_as("SELECT fingerprint, result FROM idempotency_keys WHERE key = ?1")
            .bind(key.as_str())
            .fetch_optional(&mut *conn)
            .await?;
    Ok(row.map(|(fingerprint, result)| Stored {
        fingerprint,
        result,
    }))
}

pub async fn remember(
    conn: &mut SqliteConnection,
    key: &IdempotencyKey,
    fingerprint: &str,
    result: &str,
) -> Result<(), MeterError> {
    sqlx::query(
        "INSERT INTO idempotency_keys (key, fingerprint, result, created_at)
         VALUES (?1, ?2, ?3, ?4)",
    )
    .bind(key.as_str())
    .bind(fingerprint)
    .bind(result)
    .bind(unix_now())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Forgets keys older than [`KEY_TTL`]; returns how many.
pub async fn forget_expired(conn: &mut SqliteConnection) -> Result<u64, MeterError> {
    let cutoff = unix_now() - KEY_TTL.as_secs() as i64;
    Ok(
        sqlx::query("DELETE FROM idempotency_keys WHERE created_at < ?1")
            .bind(cutoff)
            .execute(&mut *conn)
            .await?
            .rows_affected(),
    )
}

fn unix_now() -> i64 {
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

pub fn encode_decision(d: &Decision) -> String {
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

pub fn decode_decision(s: &str) -> Result<Decision, MeterError> {
    let bad = |e: String| MeterError::from(sqlx::Error::Decode(e.into()));
    let d: StoredDecision = serde_json::from_str(s).map_err(|e| bad(e.to_string()))?;
    Ok(Decision {
        reason: d.reason,
        day: Day::parse(&d.day).map_err(|e| bad(e.0))?,
        visitor_calls: d.visitor_calls,
        global_calls: d.global_calls,
        visitor_limit: d.visitor_limit,
        global_limit: d.global_limit,
        pruned_rows: 0,
        timezone: load_timezone(&d.timezone).map_err(|e| bad(e.0))?,
    })
}

pub fn decode_value(s: &str) -> Result<i64, MeterError> {
    s.parse().map_err(|e: std::num::ParseIntError| {
        MeterError::from(sqlx::Error::Decode(e.to_string().into()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        for ok in [
            "a",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "\"quoted-key\"",
            &"k".repeat(255),
        ] {
            assert!(IdempotencyKey::parse(ok).is_ok(), "{ok}");
        }
        assert_eq!(IdempotencyKey::parse("\"abc\"").unwrap().as_str(), "abc");
        for bad in [
            "",
            "\"\"",
            "a b",
            "é",
            "a\"b",
            &"k".repeat(256),
            "tab\there",
        ] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
    }
}
