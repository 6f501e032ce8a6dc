//! The SQL behind every command and read. Write functions take the writer's
//! connection (inside the transaction the writer opened for them); read
//! functions take the read-only pool.

use jiff::Timestamp;
use sqlx::{Row, SqliteConnection, SqlitePool, sqlite::SqliteRow};

use super::{
    Budget, BudgetSpec, Day, Decision, MeterError, Name, Reason, ResetScope, Usage, VisitorId,
    types::load_timezone,
};

/// Adds `by` to the counter `name` (created at 0) and returns the new value,
/// in one statement. The `WHERE` refuses an update that would overflow.
pub async fn increment(
    conn: &mut SqliteConnection,
    name: &Name,
    by: i64,
) -> Result<i64, MeterError> {
    let value: Option<i64> = sqlx::query_scalar(
        "INSERT INTO counters (name, value) VALUES (?1, ?2)
         ON CONFLICT (name) DO UPDATE SET value = value + excluded.value
             WHERE value <= 9223372036854775807 - excluded.value
         RETURNING value",
    )
    .bind(name.as_str())
    .bind(by)
    .fetch_optional(&mut *conn)
    .await?;
    value.ok_or_else(|| MeterError::Overflow(name.clone()))
}

/// The current values of many counters in one statement; names never
/// written are absent from the map.
pub async fn read_counters(
    pool: &SqlitePool,
    names: &[&str],
) -> Result<std::collections::HashMap<String, i64>, MeterError> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT name, value FROM counters
         WHERE name IN (SELECT value FROM json_each(?1))",
    )
    .bind(super::to_json(&names))
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Creates or replaces a budget's configuration. Usage is kept.
pub async fn put_budget(
    conn: &mut SqliteConnection,
    name: &Name,
    spec: &BudgetSpec,
) -> Result<Budget, MeterError> {
    sqlx::query(
        "INSERT INTO budgets (name, visitor_limit, global_limit, retention_days, timezone, updated_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT (name) DO UPDATE SET
             visitor_limit = excluded.visitor_limit,
             global_limit = excluded.global_limit,
             retention_days = excluded.retention_days,
             timezone = excluded.timezone,
             updated_at = excluded.updated_at",
    )
    .bind(name.as_str())
    .bind(spec.visitor_limit)
    .bind(spec.global_limit)
    .bind(spec.retention_days)
    .bind(&spec.timezone_name)
    .bind(Timestamp::now().to_string())
    .execute(&mut *conn)
    .await?;
    Ok(Budget {
        name: name.clone(),
        spec: spec.clone(),
    })
}

const SELECT_BUDGET: &str = "SELECT visitor_limit, global_limit, retention_days, timezone
                             FROM budgets WHERE name = ?1";

fn budget_from_row(name: &Name, row: &SqliteRow) -> Result<Budget, MeterError> {
    let tz: String = row.try_get("timezone")?;
    let timezone = load_timezone(&tz).map_err(|e| {
        MeterError::from(sqlx::Error::Decode(
            format!("stored budget `{name}` has a bad time zone: {e}").into(),
        ))
    })?;
    Ok(Budget {
        name: name.clone(),
        spec: BudgetSpec {
            visitor_limit: row.try_get("visitor_limit")?,
            global_limit: row.try_get("global_limit")?,
            retention_days: row.try_get("retention_days")?,
            timezone,
            timezone_name: tz,
        },
    })
}

/// A budget's configuration, read from the pool.
pub async fn get_budget(pool: &SqlitePool, name: &Name) -> Result<Budget, MeterError> {
    let row = sqlx::query(SELECT_BUDGET)
        .bind(name.as_str())
        .fetch_optional(pool)
        .await?
        .ok_or_else(|| MeterError::UnknownBudget(name.clone()))?;
    budget_from_row(name, &row)
}

async fn load_budget(conn: &mut SqliteConnection, name: &Name) -> Result<Budget, MeterError> {
    let row = sqlx::query(SELECT_BUDGET)
        .bind(name.as_str())
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| MeterError::UnknownBudget(name.clone()))?;
    budget_from_row(name, &row)
}

/// One call against a budget. The caller runs it inside one transaction (or
/// savepoint): either all of its writes land or none do.
///
/// The visitor's row is counted first; a visitor over its limit is denied
/// without touching the global counter. Otherwise the global counter is
/// counted, and the call is denied if that puts it over the global limit.
/// Denied calls stay counted: a client that keeps calling while denied keeps
/// using its day's quota up, so hammering never buys a later allowance.
///
/// The first call that reaches the global counter on a day prunes the
/// budget's usage older than its retention. The cutoff counts back from the
/// budget's real today (in its time zone, from the clock), never from
/// `day`: a client naming a far-future day must not make today's usage
/// look old. Whether a client may name `day` at all is the caller's rule
/// (see [`super::BudgetSpec::kept_days`]); whatever it is, this never
/// deletes a day the budget keeps.
pub async fn check(
    conn: &mut SqliteConnection,
    budget: &Name,
    visitor: &VisitorId,
    day: Option<Day>,
) -> Result<Decision, MeterError> {
    check_at(conn, budget, visitor, day, Timestamp::now()).await
}

/// [`check`] as seen at `now`.
pub(crate) async fn check_at(
    conn: &mut SqliteConnection,
    budget: &Name,
    visitor: &VisitorId,
    day: Option<Day>,
    now: Timestamp,
) -> Result<Decision, MeterError> {
    let b = load_budget(conn, budget).await?;
    let kept = b.spec.kept_days(now);
    let day = day.unwrap_or(kept.today);
    let day_text = day.to_string();

    let visitor_calls: i64 = sqlx::query_scalar(
        "INSERT INTO budget_visitor_usage (budget, day, visitor, calls) VALUES (?1, ?2, ?3, 1)
         ON CONFLICT (budget, day, visitor) DO UPDATE SET calls = calls + 1
         RETURNING calls",
    )
    .bind(budget.as_str())
    .bind(&day_text)
    .bind(visitor.as_str())
    .fetch_one(&mut *conn)
    .await?;

    let mut decision = Decision {
        reason: Reason::Ok,
        day,
        visitor_calls,
        global_calls: 0,
        visitor_limit: b.spec.visitor_limit,
        global_limit: b.spec.global_limit,
        pruned_rows: 0,
        timezone: b.spec.timezone.clone(),
    };

    if visitor_calls > i64::from(b.spec.visitor_limit) {
        decision.reason = Reason::VisitorLimit;
        decision.global_calls = global_calls(conn, budget, &day_text).await?;
        return Ok(decision);
    }

    decision.global_calls = sqlx::query_scalar(
        "INSERT INTO budget_global_usage (budget, day, calls) VALUES (?1, ?2, 1)
         ON CONFLICT (budget, day) DO UPDATE SET calls = calls + 1
         RETURNING calls",
    )
    .bind(budget.as_str())
    .bind(&day_text)
    .fetch_one(&mut *conn)
    .await?;

    if decision.global_calls == 1 {
        decision.pruned_rows = prune(conn, budget, kept.oldest).await?;
    }
    if decision.global_calls > i64::from(b.spec.global_limit) {
        decision.reason = Reason::GlobalLimit;
    }
    Ok(decision)
}

async fn global_calls(
    conn: &mut SqliteConnection,
    budget: &Name,
    day: &str,
) -> Result<i64, MeterError> {
    let calls: Option<i64> =
        sqlx::query_scalar("SELECT calls FROM budget_global_usage WHERE budget = ?1 AND day = ?2")
            .bind(budget.as_str())
            .bind(day)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(calls.unwrap_or(0))
}

/// Deletes the budget's usage on days before `cutoff`.
pub(super) async fn prune(
    conn: &mut SqliteConnection,
    budget: &Name,
    cutoff: Day,
) -> Result<u64, MeterError> {
    let cutoff = cutoff.to_string();
    let mut rows = 0;
    for sql in [
        "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day < ?2",
        "DELETE FROM budget_global_usage WHERE budget = ?1 AND day < ?2",
    ] {
        rows += sqlx::query(sql)
            .bind(budget.as_str())
            .bind(&cutoff)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    Ok(rows)
}

/// Clears usage of one day: one visitor's row, or the whole day.
/// Returns the number of rows deleted.
pub async fn reset(
    conn: &mut SqliteConnection,
    budget: &Name,
    scope: &ResetScope,
) -> Result<u64, MeterError> {
    load_budget(conn, budget).await?;
    let day = scope.day.to_string();
    let rows = match &scope.visitor {
        Some(visitor) => sqlx::query(
            "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day = ?2 AND visitor = ?3",
        )
        .bind(budget.as_str())
        .bind(&day)
        .bind(visitor.as_str())
        .execute(&mut *conn)
        .await?
        .rows_affected(),
        None => {
            let mut rows = 0;
            for sql in [
                "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day = ?2",
                "DELETE FROM budget_global_usage WHERE budget = ?1 AND day = ?2",
            ] {
                rows += sqlx::query(sql)
                    .bind(budget.as_str())
                    .bind(&day)
                    .execute(&mut *conn)
                    .await?
                    .rows_affected();
            }
            rows
        }
    };
    Ok(rows)
}

/// A budget's usage on `day` (today in its time zone by default), read from
/// the pool. Days without usage, pruned ones included, read as 0.
pub async fn read_usage(
    pool: &SqlitePool,
    budget: &Name,
    day: Option<Day>,
    visitor: Option<&VisitorId>,
) -> Result<Usage, MeterError> {
    let b = get_budget(pool, budget).await?;
    let day = day.unwrap_or_else(|| Day::today(&b.spec.timezone));
    let day_text = day.to_string();
    // One read transaction, so the two numbers come from the same snapshot.
    let mut tx = pool.begin().await?;
    let global: Option<i64> =
        sqlx::query_scalar("SELECT calls FROM budget_global_usage WHERE budget = ?1 AND day = ?2")
            .bind(budget.as_str())
            .bind(&day_text)
            .fetch_optional(&mut *tx)
            .await?;
    let visitor_calls = match visitor {
        Some(v) => Some(
            sqlx::query_scalar(
                "SELECT calls FROM budget_visitor_usage
                 WHERE budget = ?1 AND day = ?2 AND visitor = ?3",
            )
            .bind(budget.as_str())
            .bind(&day_text)
            .bind(v.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .unwrap_or(0),
        ),
        None => None,
    };
    tx.rollback().await?;
    Ok(Usage {
        day,
        global_calls: global.unwrap_or(0),
        visitor_calls,
    })
}
