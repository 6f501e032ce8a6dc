//! Budgets in SQLite: configuration, daily usage, checks and resets. A
//! check reads the rows it touches, decides in memory with
//! [`meter::decide`] in queue order, and writes the final rows back, so a
//! batch of checks costs a few statements, not a few per check.

use std::collections::HashMap;

use jiff::Timestamp;
use sqlx::{Executor, Sqlite, SqliteConnection, SqlitePool};

use super::{Error, to_json};
use crate::meter::{
    self, Budget, BudgetSpec, Counts, Day, Decision, Name, Refusal, Step, Usage, VisitorId,
};

/// Creates or replaces a budget's configuration. Usage is kept.
pub async fn put(
    conn: &mut SqliteConnection,
    name: &Name,
    spec: &BudgetSpec,
) -> Result<Budget, Error> {
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

/// The named budgets that exist, by name, in one statement.
async fn load<'c>(
    db: impl Executor<'c, Database = Sqlite>,
    names: &[&str],
) -> Result<HashMap<String, Budget>, Error> {
    let rows: Vec<(String, u32, u32, u32, String)> = sqlx::query_as(
        "SELECT name, visitor_limit, global_limit, retention_days, timezone
         FROM budgets WHERE name IN (SELECT value FROM json_each(?1))",
    )
    .bind(to_json(names))
    .fetch_all(db)
    .await?;
    let mut budgets = HashMap::with_capacity(rows.len());
    for (name, visitor_limit, global_limit, retention_days, timezone_name) in rows {
        let timezone = meter::load_timezone(&timezone_name).map_err(|e| {
            Error::Internal(format!("stored budget `{name}` has a bad time zone: {e}").into())
        })?;
        let budget = Budget {
            name: Name::parse(&name)
                .map_err(|e| Error::Internal(format!("stored budget name: {e}").into()))?,
            spec: BudgetSpec {
                visitor_limit,
                global_limit,
                retention_days,
                timezone,
                timezone_name,
            },
        };
        budgets.insert(name, budget);
    }
    Ok(budgets)
}

/// One budget, or [`Refusal::UnknownBudget`].
pub async fn get<'c>(
    db: impl Executor<'c, Database = Sqlite>,
    name: &Name,
) -> Result<Budget, Error> {
    load(db, &[name.as_str()])
        .await?
        .remove(name.as_str())
        .ok_or_else(|| Refusal::UnknownBudget(name.clone()).into())
}

/// One budget check of a batch.
#[derive(Clone, Copy)]
pub struct CheckItem<'a> {
    pub budget: &'a Name,
    pub visitor: &'a VisitorId,
    pub day: Option<Day>,
}

/// One budget check, inside the caller's transaction (or savepoint).
pub async fn check(
    conn: &mut SqliteConnection,
    item: CheckItem<'_>,
    now: Timestamp,
) -> Result<Decision, Error> {
    let mut decisions = check_many(conn, &[item], now).await?;
    decisions
        .pop()
        .unwrap_or_else(|| Err(Error::Internal("a check produced no decision".into())))
}

/// Runs the checks in order, as if each ran alone at its place in the
/// queue: each decided by [`meter::decide`] from the counts the checks
/// before it left. A check naming an unknown budget or a day its budget
/// does not keep ([`Budget::day`]) is refused and counts nothing.
///
/// The first call of a day that reaches the global counter prunes its
/// budget's usage older than retention, counted back from the budget's
/// real today, never from a day a client named. Every day a check counts
/// on is one its budget keeps, so no prune can delete a row the batch
/// writes, and pruning before the write-back is the same as pruning in
/// queue order.
pub async fn check_many(
    conn: &mut SqliteConnection,
    items: &[CheckItem<'_>],
    now: Timestamp,
) -> Result<Vec<Result<Decision, Error>>, Error> {
    let mut names: Vec<&str> = items.iter().map(|i| i.budget.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let budgets = load(&mut *conn, &names).await?;
    let days: Vec<Result<(&Budget, Day), Error>> = items
        .iter()
        .map(|i| {
            let b = budgets
                .get(i.budget.as_str())
                .ok_or_else(|| Refusal::UnknownBudget(i.budget.clone()))?;
            Ok((b, b.day(i.day, now)?))
        })
        .collect();

    let mut usage = DayUsage::read(conn, items, &days).await?;
    let mut decisions = Vec::with_capacity(items.len());
    let mut prunes = Vec::new();
    for (i, (item, day)) in items.iter().zip(days).enumerate() {
        let (budget, day) = match day {
            Ok(d) => d,
            Err(e) => {
                decisions.push(Err(e));
                continue;
            }
        };
        let step = usage.step(item, day, budget);
        if step.first_of_day {
            prunes.push((i, budget.spec.kept_days(now).oldest));
        }
        decisions.push(Ok(Decision::new(budget, day, step)));
    }
    if usage.is_empty() {
        return Ok(decisions);
    }
    for (i, cutoff) in prunes {
        let pruned = prune(conn, items[i].budget, cutoff).await?;
        if let Some(Ok(d)) = decisions.get_mut(i) {
            d.pruned_rows = pruned;
        }
    }
    usage.write(conn).await?;
    Ok(decisions)
}

/// The usage rows a batch of checks touches: read once, counted in memory,
/// written back once.
struct DayUsage {
    /// (budget, day, visitor) -> calls
    visitors: HashMap<(String, String, String), i64>,
    /// (budget, day) -> calls
    globals: HashMap<(String, String), i64>,
}

impl DayUsage {
    async fn read(
        conn: &mut SqliteConnection,
        items: &[CheckItem<'_>],
        days: &[Result<(&Budget, Day), Error>],
    ) -> Result<Self, Error> {
        let mut usage = DayUsage {
            visitors: HashMap::new(),
            globals: HashMap::new(),
        };
        let mut visitor_keys = Vec::new();
        let mut global_keys = Vec::new();
        for (item, day) in items.iter().zip(days) {
            if let Ok((_, day)) = day {
                let d = day.to_string();
                // Tuples serialize as the JSON arrays `->> 0`, `->> 1` read.
                visitor_keys.push((item.budget.as_str(), d.clone(), item.visitor.as_str()));
                global_keys.push((item.budget.as_str(), d));
            }
        }
        if visitor_keys.is_empty() {
            return Ok(usage);
        }
        // Both kinds of rows in one statement: every statement is a round
        // trip to the connection's thread. A global row has no visitor.
        let rows: Vec<(String, String, Option<String>, i64)> = sqlx::query_as(
            "SELECT u.budget, u.day, u.visitor, u.calls
             FROM json_each(?1) AS k
             JOIN budget_visitor_usage AS u
               ON u.budget = k.value ->> 0 AND u.day = k.value ->> 1 AND u.visitor = k.value ->> 2
             UNION ALL
             SELECT g.budget, g.day, NULL, g.calls
             FROM json_each(?2) AS k
             JOIN budget_global_usage AS g
               ON g.budget = k.value ->> 0 AND g.day = k.value ->> 1",
        )
        .bind(to_json(&visitor_keys))
        .bind(to_json(&global_keys))
        .fetch_all(&mut *conn)
        .await?;
        for (b, d, v, c) in rows {
            match v {
                Some(v) => usage.visitors.insert((b, d, v), c),
                None => usage.globals.insert((b, d), c),
            };
        }
        Ok(usage)
    }

    fn is_empty(&self) -> bool {
        self.visitors.is_empty() && self.globals.is_empty()
    }

    /// Decides a check on `day` from the counts it sees, and keeps the
    /// counts it leaves for the checks after it.
    fn step(&mut self, item: &CheckItem<'_>, day: Day, budget: &Budget) -> Step {
        let (b, d) = (item.budget.as_str().to_owned(), day.to_string());
        let visitor = self
            .visitors
            .entry((b.clone(), d.clone(), item.visitor.as_str().to_owned()))
            .or_default();
        let global = self.globals.entry((b, d)).or_default();
        let step = meter::decide(
            budget.spec.visitor_limit,
            budget.spec.global_limit,
            Counts {
                visitor: *visitor,
                global: *global,
            },
        );
        (*visitor, *global) = (step.after.visitor, step.after.global);
        step
    }

    /// Both write-backs as one script, one round trip. A day whose checks
    /// were all denied by the visitor limit gets no global row.
    async fn write(self, conn: &mut SqliteConnection) -> Result<(), Error> {
        let visitor_rows: Vec<_> = self
            .visitors
            .into_iter()
            .map(|((b, d, v), c)| (b, d, v, c))
            .collect();
        let global_rows: Vec<_> = self
            .globals
            .into_iter()
            .filter(|(_, c)| *c > 0)
            .map(|((b, d), c)| (b, d, c))
            .collect();
        sqlx::query(
            "INSERT INTO budget_visitor_usage (budget, day, visitor, calls)
             SELECT value ->> 0, value ->> 1, value ->> 2, value ->> 3 FROM json_each(?1) WHERE true
             ON CONFLICT (budget, day, visitor) DO UPDATE SET calls = excluded.calls;
             INSERT INTO budget_global_usage (budget, day, calls)
             SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?2) WHERE true
             ON CONFLICT (budget, day) DO UPDATE SET calls = excluded.calls;",
        )
        .bind(to_json(&visitor_rows))
        .bind(to_json(&global_rows))
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// Deletes the budget's usage on days before `cutoff`, in one round trip.
async fn prune(conn: &mut SqliteConnection, budget: &Name, cutoff: Day) -> Result<u64, Error> {
    let deleted = sqlx::query(
        "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day < ?2;
         DELETE FROM budget_global_usage WHERE budget = ?1 AND day < ?2;",
    )
    .bind(budget.as_str())
    .bind(cutoff.to_string())
    .execute(conn)
    .await?;
    Ok(deleted.rows_affected())
}

/// Clears one day's usage ([`Budget::day`]): one visitor's row, or the
/// whole day. Returns the day and the number of rows deleted.
pub async fn reset(
    conn: &mut SqliteConnection,
    budget: &Name,
    day: Option<Day>,
    visitor: Option<&VisitorId>,
    now: Timestamp,
) -> Result<(Day, u64), Error> {
    let day = get(&mut *conn, budget).await?.day(day, now)?;
    let (b, d) = (budget.as_str(), day.to_string());
    let deleted =
        match visitor {
            Some(v) => sqlx::query(
                "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day = ?2 AND visitor = ?3",
            )
            .bind(b)
            .bind(d)
            .bind(v.as_str())
            .execute(conn)
            .await?,
            None => {
                sqlx::query(
                    "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day = ?2;
                 DELETE FROM budget_global_usage WHERE budget = ?1 AND day = ?2;",
                )
                .bind(b)
                .bind(d)
                .execute(conn)
                .await?
            }
        };
    Ok((day, deleted.rows_affected()))
}

/// A budget's usage on a day it keeps (its today by default), read in one
/// statement, so the two numbers come from the same snapshot. Days without
/// usage read as 0.
pub async fn usage(
    pool: &SqlitePool,
    budget: &Name,
    day: Option<Day>,
    visitor: Option<&VisitorId>,
) -> Result<Usage, Error> {
    let day = get(pool, budget).await?.day(day, Timestamp::now())?;
    let (global_calls, visitor_calls): (i64, Option<i64>) = sqlx::query_as(
        "SELECT
           coalesce((SELECT calls FROM budget_global_usage WHERE budget = ?1 AND day = ?2), 0),
           CASE WHEN ?3 IS NOT NULL THEN coalesce((SELECT calls FROM budget_visitor_usage
             WHERE budget = ?1 AND day = ?2 AND visitor = ?3), 0) END",
    )
    .bind(budget.as_str())
    .bind(day.to_string())
    .bind(visitor.map(VisitorId::as_str))
    .fetch_one(pool)
    .await?;
    Ok(Usage {
        day,
        global_calls,
        visitor_calls,
    })
}
