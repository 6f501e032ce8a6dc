//! Set-based execution of a whole batch of increments and checks in a few
//! statements, instead of a few statements per command.
//!
//! The writer holds the write lock for the whole transaction, so it may read
//! the rows a batch touches, work the commands out in memory one after the
//! other (exactly as if each ran alone, in queue order), and write the final
//! rows back. Every caller gets the answer it would have got from running
//! alone at its place in the queue. When the in-memory result could differ
//! from that (an overflowing counter, a prune that would cut into another
//! command's day), these functions return `Ok(None)` and the writer replays
//! the batch command by command instead.

use std::collections::HashMap;

use jiff::Timestamp;
use sqlx::SqliteConnection;

use super::{
    Day, Decision, MeterError, Name, Reason, VisitorId, to_json,
    types::{KeptDays, load_timezone},
};

/// Adds each `(name, by)` in order. Increments of one name are summed into
/// one upsert; caller `i` gets the value its increment would have produced
/// had the batch run one command at a time. `None` when a counter would
/// overflow: which caller overflows is for the one-by-one path to tell.
pub async fn increment_many(
    conn: &mut SqliteConnection,
    items: &[(&Name, i64)],
) -> Result<Option<Vec<i64>>, MeterError> {
    let totals = totals(items);
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "INSERT INTO counters (name, value)
         SELECT key, value FROM json_each(?1) WHERE true
         ON CONFLICT (name) DO UPDATE SET value = value + excluded.value
             WHERE value <= 9223372036854775807 - excluded.value
         RETURNING name, value",
    )
    .bind(to_json(&totals))
    .fetch_all(&mut *conn)
    .await?;
    Ok(values_in_order(items, &totals, rows))
}

/// A whole transaction of increments in one round trip to SQLite: `BEGIN`,
/// the upsert and `COMMIT` go as one script. An overflowing sum makes
/// SQLite produce a REAL, which the STRICT table refuses, so the script
/// stops before `COMMIT`: then the open transaction is rolled back here and
/// the answer is `None`. On any other error the caller rolls back (the
/// transaction may still be open) and must treat the batch as failed.
pub async fn increment_many_committed(
    conn: &mut SqliteConnection,
    items: &[(&Name, i64)],
) -> Result<Option<Vec<i64>>, MeterError> {
    let totals = totals(items);
    let rows = sqlx::query_as::<_, (String, i64)>(
        "BEGIN IMMEDIATE;
         INSERT INTO counters (name, value)
         SELECT key, value FROM json_each(?1) WHERE true
         ON CONFLICT (name) DO UPDATE SET value = value + excluded.value
         RETURNING name, value;
         COMMIT;",
    )
    .bind(to_json(&totals))
    .fetch_all(&mut *conn)
    .await;
    match rows {
        Ok(rows) => match values_in_order(items, &totals, rows) {
            Some(values) => Ok(Some(values)),
            // Cannot happen: every name of the batch is upserted. It has
            // committed, so say so rather than replay it.
            None => Err(MeterError::from(sqlx::Error::Protocol(
                "the upsert returned fewer rows than names".into(),
            ))),
        },
        Err(e) if is_datatype_error(&e) => {
            sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// SQLITE_CONSTRAINT_DATATYPE: a STRICT column refused a value.
fn is_datatype_error(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "3091")
}

fn totals<'a>(items: &[(&'a Name, i64)]) -> HashMap<&'a str, i64> {
    let mut totals: HashMap<&str, i64> = HashMap::new();
    for (name, by) in items {
        let t = totals.entry(name.as_str()).or_default();
        *t = t.saturating_add(*by);
    }
    totals
}

/// Each caller's value: the name's value before the batch, counted up in
/// queue order. `None` if a name has no row (its update was refused).
fn values_in_order(
    items: &[(&Name, i64)],
    totals: &HashMap<&str, i64>,
    rows: Vec<(String, i64)>,
) -> Option<Vec<i64>> {
    if rows.len() != totals.len() {
        return None;
    }
    let mut running: HashMap<String, i64> = rows
        .into_iter()
        .map(|(name, value)| {
            let before = value - totals.get(name.as_str()).copied().unwrap_or(0);
            (name, before)
        })
        .collect();
    let mut values = Vec::with_capacity(items.len());
    for (name, by) in items {
        let v = running.get_mut(name.as_str())?;
        *v += by;
        values.push(*v);
    }
    Some(values)
}

/// One budget check of a batch.
pub struct CheckItem<'a> {
    pub budget: &'a Name,
    pub visitor: &'a VisitorId,
    pub day: Option<Day>,
}

struct Config {
    visitor_limit: u32,
    global_limit: u32,
    timezone: jiff::tz::TimeZone,
    /// The budget's window at the batch's one instant: every command of the
    /// batch sees the same today, as it would running a moment apart.
    kept: KeptDays,
}

/// Runs the checks in order with the rules of [`super::check`]: visitor
/// first, then global; denied calls counted; the first call of a day that
/// reaches the global counter prunes the budget's usage past retention,
/// counted back from the budget's real today.
pub async fn check_many(
    conn: &mut SqliteConnection,
    items: &[CheckItem<'_>],
) -> Result<Option<Vec<Result<Decision, MeterError>>>, MeterError> {
    check_many_at(conn, items, Timestamp::now()).await
}

/// [`check_many`] as seen at `now`.
pub(crate) async fn check_many_at(
    conn: &mut SqliteConnection,
    items: &[CheckItem<'_>],
    now: Timestamp,
) -> Result<Option<Vec<Result<Decision, MeterError>>>, MeterError> {
    // 1. The budgets named, with their configuration.
    let mut names: Vec<&str> = items.iter().map(|i| i.budget.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let rows: Vec<(String, u32, u32, u32, String)> = sqlx::query_as(
        "SELECT name, visitor_limit, global_limit, retention_days, timezone
         FROM budgets WHERE name IN (SELECT value FROM json_each(?1))",
    )
    .bind(to_json(&names))
    .fetch_all(&mut *conn)
    .await?;
    let mut configs = HashMap::new();
    for (name, visitor_limit, global_limit, retention_days, tz) in rows {
        let timezone = load_timezone(&tz).map_err(|e| {
            MeterError::from(sqlx::Error::Decode(
                format!("stored budget `{name}` has a bad time zone: {e}").into(),
            ))
        })?;
        configs.insert(
            name,
            Config {
                visitor_limit,
                global_limit,
                kept: KeptDays::at(&timezone, retention_days, now),
                timezone,
            },
        );
    }

    // 2. Each known command's day, and the usage rows they touch.
    let days: Vec<Option<Day>> = items
        .iter()
        .map(|i| {
            configs
                .get(i.budget.as_str())
                .map(|c| i.day.unwrap_or(c.kept.today))
        })
        .collect();
    let mut visitor_keys = Vec::new();
    let mut global_keys = Vec::new();
    for (item, day) in items.iter().zip(&days) {
        if let Some(day) = day {
            let d = day.to_string();
            // Tuples serialize as the JSON arrays `->> 0`, `->> 1` read.
            visitor_keys.push((item.budget.as_str(), d.clone(), item.visitor.as_str()));
            global_keys.push((item.budget.as_str(), d));
        }
    }
    if visitor_keys.is_empty() {
        return Ok(Some(
            items
                .iter()
                .map(|i| Err(MeterError::UnknownBudget(i.budget.clone())))
                .collect(),
        ));
    }
    // Both kinds of rows in one statement: every statement is a round trip
    // to the connection's thread. A global row has no visitor.
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
    let mut visitors: HashMap<(String, String, String), i64> = HashMap::new();
    let mut globals: HashMap<(String, String), i64> = HashMap::new();
    for (b, d, v, c) in rows {
        match v {
            Some(v) => visitors.insert((b, d, v), c),
            None => globals.insert((b, d), c),
        };
    }

    // 3. Each command in order, in memory.
    let mut results = Vec::with_capacity(items.len());
    let mut prunes: Vec<(usize, &Name, Day)> = Vec::new();
    for (i, (item, day)) in items.iter().zip(&days).enumerate() {
        let (Some(day), Some(cfg)) = (day, configs.get(item.budget.as_str())) else {
            results.push(Err(MeterError::UnknownBudget(item.budget.clone())));
            continue;
        };
        let d = day.to_string();
        let b = item.budget.as_str().to_owned();
        let v = visitors
            .entry((b.clone(), d.clone(), item.visitor.as_str().to_owned()))
            .or_default();
        *v += 1;
        let visitor_calls = *v;
        let mut decision = Decision {
            reason: Reason::Ok,
            day: *day,
            visitor_calls,
            global_calls: 0,
            visitor_limit: cfg.visitor_limit,
            global_limit: cfg.global_limit,
            pruned_rows: 0,
            timezone: cfg.timezone.clone(),
        };
        let g = globals.entry((b, d)).or_default();
        if visitor_calls > i64::from(cfg.visitor_limit) {
            decision.reason = Reason::VisitorLimit;
            decision.global_calls = *g;
        } else {
            *g += 1;
            decision.global_calls = *g;
            if *g == 1 {
                prunes.push((i, item.budget, cfg.kept.oldest));
            }
            if decision.global_calls > i64::from(cfg.global_limit) {
                decision.reason = Reason::GlobalLimit;
            }
        }
        results.push(Ok(decision));
    }

    // 4. Prunes. Run before the write-back, which is only the same as
    // running them in queue order when no command of the batch writes a day
    // that a prune of its budget would delete.
    for (_, budget, cutoff) in &prunes {
        let cut_into = items
            .iter()
            .zip(&days)
            .any(|(it, d)| it.budget == *budget && d.is_some_and(|d| d < *cutoff));
        if cut_into {
            return Ok(None);
        }
    }
    for (i, budget, cutoff) in prunes {
        let pruned = super::sql::prune(conn, budget, cutoff).await?;
        if let Some(Ok(d)) = results.get_mut(i) {
            d.pruned_rows = pruned;
        }
    }

    // 5. Write the final counts back.
    let visitor_rows: Vec<_> = visitors
        .into_iter()
        .map(|((b, d, v), c)| (b, d, v, c))
        .collect();
    let global_rows: Vec<_> = globals
        .into_iter()
        .filter(|(_, c)| *c > 0)
        .map(|((b, d), c)| (b, d, c))
        .collect();
    // Both write-backs as one script, one round trip.
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
    Ok(Some(results))
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use jiff::{SignedDuration, Timestamp};
    use sqlx::{ConnectOptions, SqliteConnection, sqlite::SqliteConnectOptions};

    use super::{CheckItem, check_many_at, increment_many};
    use crate::meter::{BudgetSpec, Day, Decision, Name, VisitorId, put_budget, sql::check_at};

    async fn fresh_db() -> SqliteConnection {
        let mut conn = SqliteConnectOptions::from_str("sqlite::memory:")
            .unwrap()
            .connect()
            .await
            .unwrap();
        sqlx::migrate!("./migrations").run(&mut conn).await.unwrap();
        conn
    }

    type Row = (String, String, String, i64);

    fn tomorrow(d: Day) -> Day {
        Day::parse(&d.date().tomorrow().unwrap().to_string()).unwrap()
    }

    async fn dump(conn: &mut SqliteConnection) -> Vec<Row> {
        sqlx::query_as(
            "SELECT budget, day, visitor, calls FROM budget_visitor_usage
             UNION ALL SELECT budget, day, '*global*', calls FROM budget_global_usage
             UNION ALL SELECT name, '', '*counter*', value FROM counters
             ORDER BY 1, 2, 3",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap()
    }

    /// Random batches of checks and increments at a clock that moves on
    /// (across midnights of three time zones and a change of clocks),
    /// applied set-based to one database (falling back to one by one when
    /// asked, as the writer does) and one at a time to another: every answer
    /// and the final rows agree. Checks name today, days inside the window,
    /// days just outside it and far-future days (which the API refuses, but
    /// the domain must still never let them prune a kept day).
    #[tokio::test]
    async fn set_based_checks_answer_as_one_at_a_time_as_the_clock_moves() {
        let mut batched = fresh_db().await;
        let mut single = fresh_db().await;
        let zones = ["UTC", "Pacific/Kiritimati", "America/New_York"];
        let budgets: Vec<(Name, BudgetSpec)> = zones
            .iter()
            .enumerate()
            .map(|(i, tz)| {
                let n = u32::try_from(i).unwrap();
                let spec = BudgetSpec::new(2 + n, 6 + 3 * n, Some(1 + n), Some(tz)).unwrap();
                (Name::parse(&format!("b{i}")).unwrap(), spec)
            })
            .collect();
        for (name, spec) in &budgets {
            for conn in [&mut batched, &mut single] {
                put_budget(conn, name, spec).await.unwrap();
            }
        }
        let unknown = Name::parse("nope").unwrap();
        let visitors: Vec<VisitorId> = ["A", "B", "C", "*"]
            .iter()
            .map(|v| VisitorId::parse(v).unwrap())
            .collect();
        let counters: Vec<Name> = ["c0", "c1"]
            .iter()
            .map(|n| Name::parse(n).unwrap())
            .collect();
        let far_future = Day::parse("2099-01-01").unwrap();

        let mut rng = fastrand::Rng::with_seed(9);
        // A week before clocks change in New York (2000-04-02).
        let mut now: Timestamp = "2000-03-26T20:00:00Z".parse().unwrap();
        let (rounds, mut replays, mut prunes) = (200, 0, 0);
        for _ in 0..rounds {
            now += SignedDuration::from_mins(rng.i64(0..=8 * 60));
            let mut incs: Vec<(&Name, i64)> = Vec::new();
            let mut checks: Vec<CheckItem> = Vec::new();
            for _ in 0..rng.usize(1..30) {
                if rng.u8(..4) == 0 {
                    incs.push((&counters[rng.usize(..counters.len())], rng.i64(1..=9)));
                    continue;
                }
                let (budget, spec) = match rng.u8(..20) {
                    0 => (&unknown, &budgets[0].1),
                    _ => {
                        let (n, s) = &budgets[rng.usize(..budgets.len())];
                        (n, s)
                    }
                };
                let kept = spec.kept_days(now);
                let day = match rng.u8(..10) {
                    0..=2 => None,
                    3 => Some(far_future),
                    // From two days before the window to a day after it.
                    _ => {
                        let back = rng.u32(0..=spec.retention_days + 2);
                        Some(match back {
                            0 => tomorrow(kept.today),
                            b => kept.today.minus_days(b - 1),
                        })
                    }
                };
                checks.push(CheckItem {
                    budget,
                    visitor: &visitors[rng.usize(..visitors.len())],
                    day,
                });
            }
            let before = dump(&mut single).await;

            // One by one.
            let mut want_values = Vec::new();
            for (name, by) in &incs {
                want_values.push(
                    super::super::increment(&mut single, name, *by)
                        .await
                        .unwrap(),
                );
            }
            let mut want = Vec::new();
            for c in &checks {
                want.push(
                    check_at(&mut single, c.budget, c.visitor, c.day, now)
                        .await
                        .map_err(|e| e.to_string()),
                );
            }
            // Set-based, inside a transaction like the writer's.
            sqlx::raw_sql("BEGIN IMMEDIATE")
                .execute(&mut batched)
                .await
                .unwrap();
            let values = increment_many(&mut batched, &incs).await.unwrap().unwrap();
            let got = match check_many_at(&mut batched, &checks, now).await.unwrap() {
                Some(d) => d
                    .into_iter()
                    .map(|r| r.map_err(|e| e.to_string()))
                    .collect(),
                None => {
                    replays += 1;
                    let mut d = Vec::new();
                    for c in &checks {
                        d.push(
                            check_at(&mut batched, c.budget, c.visitor, c.day, now)
                                .await
                                .map_err(|e| e.to_string()),
                        );
                    }
                    d
                }
            };
            sqlx::raw_sql("COMMIT").execute(&mut batched).await.unwrap();

            assert_eq!(values, want_values);
            prunes += want
                .iter()
                .filter(|d| d.as_ref().is_ok_and(|d| d.pruned_rows > 0))
                .count();
            // Which command of a batch reports the prune may differ.
            let strip = |d: Vec<Result<Decision, String>>| {
                d.into_iter()
                    .map(|r| {
                        r.map(|d| Decision {
                            pruned_rows: 0,
                            ..d
                        })
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(strip(got), strip(want));
            let after = dump(&mut single).await;
            assert_eq!(dump(&mut batched).await, after);

            // No day a budget keeps lost a call, whatever days were named.
            for (name, spec) in &budgets {
                let kept = spec.kept_days(now);
                for (b, d, v, calls) in &before {
                    let in_window = Day::parse(d).is_ok_and(|d| kept.contains(d));
                    if b != name.as_str() || !in_window {
                        continue;
                    }
                    let now_calls = after
                        .iter()
                        .find(|r| (&r.0, &r.1, &r.2) == (b, d, v))
                        .map(|r| r.3);
                    assert!(
                        now_calls.is_some_and(|c| c >= *calls),
                        "{b} {d} {v} lost calls at {now}"
                    );
                }
            }
        }
        // The comparison covered pruning and the replay path, and not only it.
        assert!(prunes > 0, "no prunes");
        assert!(replays > 0 && replays < rounds, "replays: {replays}");
    }

    /// The window follows the budget's own midnight.
    #[test]
    fn kept_days_follow_the_budget_time_zone() {
        let spec = BudgetSpec::new(1, 1, Some(2), Some("Pacific/Kiritimati")).unwrap();
        let at = |s: &str| spec.kept_days(s.parse().unwrap());
        // 09:59 UTC is 23:59 in Kiritimati (+14); a minute later it is tomorrow.
        let k = at("2024-06-20T09:59:00Z");
        assert_eq!(
            (k.oldest.to_string(), k.today.to_string()),
            ("2024-06-18".into(), "2024-06-20".into())
        );
        let k = at("2024-06-20T10:00:00Z");
        assert_eq!(
            (k.oldest.to_string(), k.today.to_string()),
            ("2024-06-19".into(), "2024-06-21".into())
        );
        assert!(k.contains(Day::parse("2024-06-19").unwrap()));
        assert!(!k.contains(Day::parse("2024-06-18").unwrap()));
        assert!(!k.contains(Day::parse("2024-06-22").unwrap()));
        let utc = BudgetSpec::new(1, 1, Some(2), None).unwrap();
        let u = utc.kept_days("2024-06-20T10:00:00Z".parse().unwrap());
        assert_eq!(u.today.to_string(), "2024-06-20");
    }
}
