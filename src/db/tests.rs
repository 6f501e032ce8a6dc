//! Model tests of the set-based SQL: a batch applied at once must answer,
//! and leave the rows, exactly as the same commands applied one at a time.

use jiff::{SignedDuration, Timestamp};
use sqlx::{Connection, SqliteConnection};

use super::{
    Database, DbOptions, Error,
    budgets::{self, CheckItem},
    clock, counters,
};
use crate::meter::{self, BudgetSpec, Counts, Day, Decision, Name, Refusal, VisitorId};

async fn fresh_db() -> SqliteConnection {
    let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
    sqlx::migrate!("./migrations/sqlite")
        .run(&mut conn)
        .await
        .unwrap();
    conn
}

/// A database whose counter `big` is 807 below the largest 64-bit integer.
async fn near_overflow() -> SqliteConnection {
    let mut conn = fresh_db().await;
    let big = "INSERT INTO counters (name, value) VALUES ('big', 9223372036854775000)";
    sqlx::raw_sql(big).execute(&mut conn).await.unwrap();
    conn
}

type Row = (String, String, String, i64);

/// Every usage row and counter, in one order; the same on both engines.
const DUMP: &str = "SELECT budget, day, visitor, calls FROM budget_visitor_usage
     UNION ALL SELECT budget, day, '*global*', calls FROM budget_global_usage
     UNION ALL SELECT name, '', '*counter*', value FROM counters
     ORDER BY 1, 2, 3";

async fn dump(conn: &mut SqliteConnection) -> Vec<Row> {
    sqlx::query_as(DUMP).fetch_all(&mut *conn).await.unwrap()
}

/// The reference the set-based SQL is held to: one increment, applied
/// the plainest way.
async fn reference_increment(conn: &mut SqliteConnection, name: &Name, by: i64) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO counters (name, value) VALUES (?1, ?2)
         ON CONFLICT (name) DO UPDATE SET value = value + excluded.value
         RETURNING value",
    )
    .bind(name.as_str())
    .bind(by)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// The reference for checks: one check, read, decided by the rule
/// ([`meter::decide`]) and written row by row, pruning on the day's first
/// global call.
async fn reference_check(
    conn: &mut SqliteConnection,
    item: &CheckItem<'_>,
    now: Timestamp,
) -> Result<Decision, String> {
    let rows = crate::db::sqlite::store::load_budgets(&mut *conn, &[item.budget.as_str()])
        .await
        .map_err(|e| e.to_string())?;
    let budget = budgets::one(rows, item.budget).map_err(|e| e.to_string())?;
    let day = budget
        .day(item.day, now)
        .map_err(|e| Error::from(e).to_string())?;
    let (b, d, v) = (item.budget.as_str(), day.to_string(), item.visitor.as_str());
    let (visitor, global): (i64, i64) = sqlx::query_as(
        "SELECT
           coalesce((SELECT calls FROM budget_visitor_usage
                     WHERE budget = ?1 AND day = ?2 AND visitor = ?3), 0),
           coalesce((SELECT calls FROM budget_global_usage WHERE budget = ?1 AND day = ?2), 0)",
    )
    .bind(b)
    .bind(&d)
    .bind(v)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let step = meter::decide(
        budget.spec.visitor_limit,
        budget.spec.global_limit,
        Counts { visitor, global },
    );
    sqlx::query("INSERT OR REPLACE INTO budget_visitor_usage VALUES (?1, ?2, ?3, ?4)")
        .bind(b)
        .bind(&d)
        .bind(v)
        .bind(step.after.visitor)
        .execute(&mut *conn)
        .await
        .unwrap();
    if step.after.global != global {
        sqlx::query("INSERT OR REPLACE INTO budget_global_usage VALUES (?1, ?2, ?3)")
            .bind(b)
            .bind(&d)
            .bind(step.after.global)
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    let mut decision = Decision::new(&budget, day, step, now);
    if step.first_of_day {
        // A day is pruned once it has been out of the window for longer
        // than an error of the clock no step is seen in.
        let cutoff = budget
            .spec
            .kept_days(now - clock::UNSEEN)
            .oldest
            .to_string();
        for sql in [
            "DELETE FROM budget_visitor_usage WHERE budget = ?1 AND day < ?2",
            "DELETE FROM budget_global_usage WHERE budget = ?1 AND day < ?2",
        ] {
            let r = sqlx::query(sql).bind(b).bind(&cutoff).execute(&mut *conn);
            decision.pruned_rows += r.await.unwrap().rows_affected();
        }
    }
    Ok(decision)
}

fn names(names: &[&str]) -> Vec<Name> {
    names.iter().map(|n| Name::parse(n).unwrap()).collect()
}

/// Random batches of checks and increments at a clock that moves on
/// (across midnights of three time zones and a change of clocks), applied
/// set-based to one database and one at a time, by the plain reference
/// above, to another: every answer and the final rows agree. Checks name today, days inside the window,
/// days just outside it and far-future days: those outside are refused
/// and never let a prune delete a kept day.
#[tokio::test]
async fn set_based_checks_answer_as_one_at_a_time_as_the_clock_moves() {
    set_based_agrees_with_one_at_a_time(9, false).await;
}

/// The same with every check of a batch on one budget's today, the batch
/// SQLite reads and writes with the budget and the day bound once
/// (`sqlite::store::read_one_day`, taken for such a batch as its own
/// tests show): visitors over their limit, a budget that denies every
/// check by its visitor limit (a day with no global row), days turning
/// over and prunes included.
#[tokio::test]
async fn set_based_checks_of_one_day_answer_as_one_at_a_time() {
    set_based_agrees_with_one_at_a_time(21, true).await;
}

async fn set_based_agrees_with_one_at_a_time(seed: u64, one_day: bool) {
    let mut batched = fresh_db().await;
    let mut single = fresh_db().await;
    let zones = ["UTC", "Pacific/Kiritimati", "America/New_York"];
    let mut budgets: Vec<(Name, BudgetSpec)> = zones
        .iter()
        .enumerate()
        .map(|(i, tz)| {
            let n = u32::try_from(i).unwrap();
            let spec = BudgetSpec::new(2 + n, 6 + 3 * n, Some(1 + n), Some(tz)).unwrap();
            (Name::parse(&format!("b{i}")).unwrap(), spec)
        })
        .collect();
    if one_day {
        // Every check over its visitor limit: a day with no global row.
        let spec = BudgetSpec::new(0, 5, Some(1), Some("UTC")).unwrap();
        budgets.push((Name::parse("zero").unwrap(), spec));
    }
    for (name, spec) in &budgets {
        for conn in [&mut batched, &mut single] {
            budgets::put(conn, name, spec, Timestamp::now())
                .await
                .unwrap();
        }
    }
    let visitors: Vec<VisitorId> = ["A", "B", "C", "*"]
        .iter()
        .map(|v| VisitorId::parse(v).unwrap())
        .collect();
    let counters = names(&["c0", "c1"]);

    let mut rng = fastrand::Rng::with_seed(seed);
    // A week before clocks change in New York (2000-04-02).
    let mut now: Timestamp = "2000-03-26T20:00:00Z".parse().unwrap();
    let (rounds, mut refused, mut prunes) = (200, 0, 0);
    for _ in 0..rounds {
        now += SignedDuration::from_mins(rng.i64(0..=8 * 60));
        let (incs, checks) = match one_day {
            false => random_batch(&mut rng, now, &budgets, &visitors, &counters),
            true => {
                let budget = &budgets[[0, budgets.len() - 1][rng.usize(..2)]].0;
                one_day_batch(&mut rng, budget, &visitors)
            }
        };
        let before = dump(&mut single).await;

        // One at a time.
        let mut want_values = Vec::new();
        for (name, by) in &incs {
            want_values.push(reference_increment(&mut single, name, *by).await);
        }
        let mut want = Vec::new();
        for c in &checks {
            want.push(reference_check(&mut single, c, now).await);
        }
        // Set-based, inside a transaction like the writer's.
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut batched)
            .await
            .unwrap();
        let values = counters::increment_many(&mut batched, &incs)
            .await
            .unwrap()
            .unwrap();
        let got: Vec<Result<Decision, String>> = budgets::check_many(&mut batched, &checks, now)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.map_err(|e| e.to_string()))
            .collect();
        sqlx::raw_sql("COMMIT").execute(&mut batched).await.unwrap();

        assert_eq!(values, want_values);
        prunes += want
            .iter()
            .filter(|d| d.as_ref().is_ok_and(|d| d.pruned_rows > 0))
            .count();
        refused += want.iter().filter(|d| d.is_err()).count();
        assert_eq!(got, want);
        let after = dump(&mut single).await;
        assert_eq!(dump(&mut batched).await, after);

        // No day a budget keeps lost a call, whatever days were named.
        for (name, spec) in &budgets {
            assert_kept_days_kept(name, spec, now, &before, &after);
            assert_retention_held(name, spec, now, &after);
        }
    }
    // The comparison covered pruning and refusals, and not only them.
    assert!(prunes > 0, "no prunes");
    match one_day {
        false => assert!(refused > 0 && refused < rounds * 10, "refused: {refused}"),
        true => assert_eq!(refused, 0),
    }
}

/// Up to 30 checks of `budget` on its today, no day named.
fn one_day_batch<'a>(
    rng: &mut fastrand::Rng,
    budget: &'a Name,
    visitors: &'a [VisitorId],
) -> (Vec<(&'a Name, i64)>, Vec<CheckItem<'a>>) {
    let checks = (0..rng.usize(1..30))
        .map(|_| CheckItem {
            budget,
            visitor: &visitors[rng.usize(..visitors.len())],
            day: None,
        })
        .collect();
    (Vec::new(), checks)
}

/// SQLite's two forms of the usage rows' read and write, the one for a
/// batch on one `(budget, day)` and the one for any days, agree: the same
/// rows written (visitors repeated, spelled with quotes, backslashes and
/// emoji, global row or none) and the same rows read back.
#[tokio::test]
async fn usage_of_one_day_reads_and_writes_as_of_any_days() {
    use super::sqlite::store::{read_any_days, read_one_day, write_any_days, write_one_day};
    let (mut one, mut any) = (fresh_db().await, fresh_db().await);
    let names = ["A", "b\\\"q\"", "🎉 ü", "*", "x'y"];
    let mut rng = fastrand::Rng::with_seed(4);
    for round in 0..300 {
        let budget = ["b0", "b1"][rng.usize(..2)];
        let day = ["2026-03-01", "2026-03-02"][rng.usize(..2)];
        let visitors: Vec<(&str, &str, &str, i64)> = (0..rng.usize(0..6))
            .map(|_| {
                (
                    budget,
                    day,
                    names[rng.usize(..names.len())],
                    rng.i64(0..1000),
                )
            })
            .collect();
        let global = rng.bool().then(|| rng.i64(0..1000));
        let globals: Vec<(&str, &str, i64)> =
            global.map(|c| (budget, day, c)).into_iter().collect();
        write_one_day(&mut one, budget, day, &visitors, global)
            .await
            .unwrap();
        write_any_days(&mut any, &visitors, &globals).await.unwrap();
        assert_eq!(dump(&mut one).await, dump(&mut any).await, "round {round}");

        let keys: Vec<(&str, &str, &str)> = (0..rng.usize(0..8))
            .map(|_| (budget, day, names[rng.usize(..names.len())]))
            .collect();
        let with_global = rng.bool();
        let global_keys: Vec<(&str, &str)> =
            with_global.then_some((budget, day)).into_iter().collect();
        let sorted = |rows: Vec<crate::db::store::UsageRow>| {
            let mut rows: Vec<_> = rows
                .into_iter()
                .map(|r| (r.budget, r.day, r.visitor, r.calls))
                .collect();
            rows.sort();
            rows
        };
        let got = read_one_day(&mut one, budget, day, &keys, with_global)
            .await
            .unwrap();
        let want = read_any_days(&mut one, &keys, &global_keys).await.unwrap();
        assert_eq!(sorted(got), sorted(want), "round {round}");
    }
}

/// A batch of up to 30 commands: a quarter increments, the rest checks of
/// the budgets (and now and then of one that does not exist), on no day,
/// far in the future, or from two days before the window to a day after.
fn random_batch<'a>(
    rng: &mut fastrand::Rng,
    now: Timestamp,
    budgets: &'a [(Name, BudgetSpec)],
    visitors: &'a [VisitorId],
    counters: &'a [Name],
) -> (Vec<(&'a Name, i64)>, Vec<CheckItem<'a>>) {
    static UNKNOWN: std::sync::LazyLock<Name> =
        std::sync::LazyLock::new(|| Name::parse("nope").unwrap());
    let mut incs = Vec::new();
    let mut checks = Vec::new();
    for _ in 0..rng.usize(1..30) {
        if rng.u8(..4) == 0 {
            incs.push((&counters[rng.usize(..counters.len())], rng.i64(1..=9)));
            continue;
        }
        let (budget, spec) = match rng.u8(..20) {
            0 => (&*UNKNOWN, &budgets[0].1),
            _ => {
                let (n, s) = &budgets[rng.usize(..budgets.len())];
                (n, s)
            }
        };
        let kept = spec.kept_days(now);
        let day = match rng.u8(..10) {
            0..=2 => None,
            3 => Some(Day::parse("2099-01-01").unwrap()),
            _ => Some(match rng.u32(0..=spec.retention_days + 2) {
                0 => Day::today_at(&spec.timezone, now + SignedDuration::from_hours(24)),
                back => kept.today.minus_days(back - 1),
            }),
        };
        checks.push(CheckItem {
            budget,
            visitor: &visitors[rng.usize(..visitors.len())],
            day,
        });
    }
    (incs, checks)
}

/// Every row of a day `budget` keeps at `now` still has at least its calls.
/// Once a call of a budget's today is counted, none of the days it no
/// longer keeps is left: retention holds for a budget whose visitor limit
/// is 0 too, none of whose calls reaches the global counter.
fn assert_retention_held(budget: &Name, spec: &BudgetSpec, now: Timestamp, after: &[Row]) {
    let kept = spec.kept_days(now);
    // The day the window left is kept till the next day's first call when
    // today's came just after midnight (`clock::UNSEEN`).
    let (today, oldest) = (
        kept.today.to_string(),
        kept.oldest.minus_days(1).to_string(),
    );
    let usage = || {
        after
            .iter()
            .filter(|r| r.0 == budget.as_str() && r.2 != "*counter*")
    };
    if !usage().any(|r| r.1 == today) {
        return;
    }
    if let Some(r) = usage().find(|r| r.1 < oldest) {
        panic!("{budget} keeps {r:?} at {now}, its oldest day kept being {oldest}");
    }
}

fn assert_kept_days_kept(
    budget: &Name,
    spec: &BudgetSpec,
    now: Timestamp,
    before: &[Row],
    after: &[Row],
) {
    let kept = spec.kept_days(now);
    for (b, d, v, calls) in before {
        let in_window = Day::parse(d).is_ok_and(|d| kept.contains(d));
        if b != budget.as_str() || !in_window {
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

#[tokio::test]
async fn increment_overflow_in_a_batch_is_applied_one_by_one() {
    let mut conn = near_overflow().await;
    let n = names(&["big", "small"]);
    let (big, small) = (&n[0], &n[1]);
    let exec = async |conn: &mut SqliteConnection, sql: &'static str| {
        sqlx::raw_sql(sql).execute(conn).await.unwrap();
    };
    // As the writer does: one transaction; the set-based attempt first.
    exec(&mut conn, "BEGIN IMMEDIATE").await;
    assert_eq!(counters::increment(&mut conn, small, 1).await.unwrap(), 1);
    // Each alone fits; together they overflow: only one by one tells who.
    let batch = [(small, 1), (big, 500), (big, 500)];
    let r = counters::increment_many(&mut conn, &batch).await;
    assert_eq!(r.unwrap(), None);
    // The failed statement changed nothing and left the transaction open:
    // one by one, each in a savepoint, the first fits, the second is
    // refused and rolled back to its savepoint.
    for (by, fits) in [(500, true), (500, false), (7, true)] {
        exec(&mut conn, "SAVEPOINT cmd").await;
        match counters::increment(&mut conn, big, by).await {
            Ok(_) => assert!(fits),
            Err(e) => {
                assert!(
                    !fits && matches!(e, Error::Refused(Refusal::Overflow(_))),
                    "{e}"
                );
                exec(&mut conn, "ROLLBACK TO cmd").await;
            }
        }
        exec(&mut conn, "RELEASE cmd").await;
    }
    exec(&mut conn, "COMMIT").await;
    let rows = dump(&mut conn).await;
    let value = |n: &str| rows.iter().find(|r| r.0 == n).map(|r| r.3);
    assert_eq!(value("big"), Some(9223372036854775000 + 507));
    assert_eq!(value("small"), Some(1));
}

#[tokio::test]
async fn one_trip_increment_batches_answer_as_one_at_a_time() {
    let mut batched = fresh_db().await;
    let mut single = fresh_db().await;
    let names = names(&["n0", "n1", "n2", "n3", "n4"]);
    let mut rng = fastrand::Rng::with_seed(11);
    for _ in 0..100 {
        let items: Vec<(&Name, i64)> = (0..rng.usize(1..50))
            .map(|_| (&names[rng.usize(..names.len())], rng.i64(1..=1_000_000)))
            .collect();
        let mut want = Vec::new();
        for (n, by) in &items {
            want.push(reference_increment(&mut single, n, *by).await);
        }
        let got = counters::increment_many_committed(&mut batched, &items, "BEGIN IMMEDIATE")
            .await
            .unwrap();
        assert_eq!(got, Some(want));
    }
    assert_eq!(dump(&mut batched).await, dump(&mut single).await);
}

#[tokio::test]
async fn a_one_trip_batch_that_overflows_commits_nothing() {
    let mut conn = near_overflow().await;
    let n = names(&["big", "small"]);
    let (big, small) = (&n[0], &n[1]);
    let r = counters::increment_many_committed(
        &mut conn,
        &[(small, 1), (big, 500), (big, 500)],
        "BEGIN IMMEDIATE",
    )
    .await
    .unwrap();
    assert_eq!(r, None);
    assert_eq!(
        dump(&mut conn).await,
        vec![(
            "big".into(),
            "".into(),
            "*counter*".into(),
            9223372036854775000
        )]
    );
    // No transaction was left open: the next one starts and commits.
    let r = counters::increment_many_committed(&mut conn, &[(small, 1)], "BEGIN IMMEDIATE")
        .await
        .unwrap();
    assert_eq!(r, Some(vec![1]));
}

/// A one-trip batch whose values cannot be read back after its COMMIT (a
/// counters table rebuilt without STRICT under a running tally, holding a
/// REAL) committed: its callers hear outcome-unknown, not "nothing was
/// written", on which a client would retry and count twice.
#[tokio::test]
async fn a_one_trip_batch_committed_but_unreadable_is_outcome_unknown() {
    let mut conn = fresh_db().await;
    sqlx::raw_sql(
        "DROP TABLE counters;
         CREATE TABLE counters (name TEXT NOT NULL PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
         INSERT INTO counters VALUES ('real', 1.5), ('fine', 1);",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let n = names(&["fine", "real"]);
    let r =
        counters::increment_many_committed(&mut conn, &[(&n[0], 1), (&n[1], 1)], "BEGIN IMMEDIATE")
            .await;
    assert!(matches!(r, Err(Error::OutcomeUnknown)), "{r:?}");
    let fine: i64 = sqlx::query_scalar("SELECT value FROM counters WHERE name = 'fine'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(fine, 2, "the batch committed");
}

/// A new database is made under a working name and put at its path whole:
/// what a start stopped while it created one left there is removed by the
/// next, which creates the database whole (under Litestream too, where a
/// table-less file at the path would be refused).
#[tokio::test]
async fn a_creation_stopped_half_way_is_made_again_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let working = |suffix: &str| dir.path().join(format!("t.db-creating{suffix}"));
    for suffix in ["", "-wal", "-shm"] {
        std::fs::write(working(suffix), b"half made").unwrap();
    }
    let opts = DbOptions {
        under_litestream: true,
        replica_empty: true,
        ..DbOptions::default()
    };
    let storage = crate::config::Storage::Sqlite(path.clone());
    let (handle, writer) = Database::open(&storage, &opts).await.unwrap();
    for suffix in ["", "-wal", "-shm"] {
        assert!(!working(suffix).exists(), "{suffix}");
    }
    assert!(dir.path().join(".t.db-replicated").exists());
    let mut conn = SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let (tables,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'counters'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(tables, 1);
    drop(conn);
    handle.close();
    let writer = writer.spawn().unwrap();
    let _ = writer.join().await;
    handle.close_readers().await;
    // Stopped once linked into place, before its working name was
    // removed: opened again as the existing database it is, the working
    // name (a second name of the file) removed.
    std::fs::hard_link(&path, working("")).unwrap();
    let (handle, _writer) = Database::open(&storage, &opts).await.unwrap();
    assert!(!working("").exists());
    assert!(path.exists());
    handle.close();
}

/// A WAL left at the path by a database that is no longer there (deleted
/// after tally was killed) is not replayed into the new database, which is
/// created empty and sound, as SQLite made it before new databases were made
/// under a working name.
#[tokio::test]
async fn a_wal_left_without_its_database_is_not_replayed_into_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let beside = |suffix: &str| dir.path().join(format!("t.db{suffix}"));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let mut old = SqliteConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "PRAGMA journal_mode=WAL; PRAGMA wal_autocheckpoint=0; \
         CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL); \
         INSERT INTO counters VALUES ('old', 41);",
    )
    .execute(&mut old)
    .await
    .unwrap();
    // The WAL as a killed process leaves it (a clean close would fold it
    // into the file and remove it).
    let wal = std::fs::read(beside("-wal")).unwrap();
    assert!(!wal.is_empty());
    drop(old);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(beside(suffix));
    }
    std::fs::write(beside("-wal"), &wal).unwrap();

    let storage = crate::config::Storage::Sqlite(path.clone());
    let (handle, _writer) = Database::open(&storage, &DbOptions::default())
        .await
        .unwrap();
    handle.close();
    let mut conn = SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let (integrity,): (String,) = sqlx::query_as("PRAGMA integrity_check")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(integrity, "ok");
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM counters")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 0, "the old database's writes came back");
}

/// A new database whose making fails (here: what is left beside the path
/// cannot be removed) leaves nothing behind, neither at the path nor under
/// its working name.
#[tokio::test]
async fn a_failed_creation_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    std::fs::create_dir(dir.path().join("t.db-wal")).unwrap();
    let storage = crate::config::Storage::Sqlite(path.clone());
    let Err(e) = Database::open(&storage, &DbOptions::default()).await else {
        panic!("a directory at t.db-wal cannot be removed as a file");
    };
    assert!(e.to_string().contains("t.db-wal"), "{e}");
    let mut left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["t.db-wal"]);
}

/// The handle's read pool (of one reader, by default) cannot write, not even by turning `query_only`
/// off: its connections are opened read-only too.
#[tokio::test]
async fn readers_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let storage = crate::config::Storage::Sqlite(dir.path().join("t.db"));
    let (_handle, _writer) = Database::open(&storage, &DbOptions::default())
        .await
        .unwrap();
    // The pool as `Database::open` opens it for the handle.
    let pool = &super::sqlite::open_readers(&dir.path().join("t.db"), 1)
        .await
        .unwrap();
    for sql in [
        "INSERT INTO counters (name, value) VALUES ('sneaky', 1)",
        "PRAGMA query_only = OFF; INSERT INTO counters (name, value) VALUES ('sneaky', 1)",
    ] {
        let err = sqlx::raw_sql(sql).execute(pool).await.unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("readonly") || msg.contains("read-only") || msg.contains("query_only"),
            "{msg}"
        );
    }
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(mode, "wal");
}

/// A delete in a batch is applied in queue order with the checks and
/// increments of the same name, whichever way the rest of the batch would
/// run: a check before the delete of its budget is counted (and its calls
/// go with the budget), one after it finds no budget, and a budget created
/// again starts with no usage; an increment after the delete of its
/// counter starts from 0.
#[tokio::test]
async fn a_delete_in_a_batch_keeps_queue_order_with_checks_and_increments() {
    use super::{
        command::{Command, Deleted, Queued, Reply},
        txn::{apply_batch, lock_key},
    };
    use tokio::sync::oneshot::Receiver;

    let mut conn = fresh_db().await;
    let b = Name::parse("b").unwrap();
    let other = Name::parse("b-other").unwrap();
    let c = Name::parse("c").unwrap();
    let spec = BudgetSpec::new(100, 100, None, None).unwrap();
    for name in [&b, &other] {
        budgets::put(&mut conn, name, &spec, Timestamp::now())
            .await
            .unwrap();
    }
    let visitor = VisitorId::parse("v").unwrap();
    let queued = |command| Queued {
        command,
        key: None,
        request_id: None,
        queued_at: std::time::Instant::now(),
    };
    let check = |budget: &Name| {
        let (reply, rx) = Reply::new();
        let command = Command::Check {
            budget: budget.clone(),
            visitor: visitor.clone(),
            day: None,
            reply,
        };
        (queued(command), rx)
    };
    type Answer<T> = Receiver<super::command::Answer<T>>;
    async fn decided(rx: Answer<Decision>) -> Result<i64, Error> {
        rx.await.unwrap().result.map(|d| d.global_calls)
    }
    async fn deleted(rx: Answer<Deleted>) -> Result<Deleted, Error> {
        rx.await.unwrap().result
    }

    // Each batch applied whole, and as the writer applies it: in the
    // transactions `txn::transactions` splits it into, one after another.
    let rounds = [(false, false), (true, false), (false, true), (true, true)];
    for (round, (keyed, split)) in (1..).zip(rounds) {
        // Checks of `b` around its delete, a check of another budget, and
        // increments of `c` around its delete; `b` created again last.
        let (q1, before) = check(&b);
        let (q2, before_other) = check(&other);
        let (reply, delete_b) = Reply::new();
        let q3 = queued(Command::DeleteBudget {
            name: b.clone(),
            reply,
        });
        let (q4, after) = check(&b);
        let (reply, inc_before) = Reply::new();
        let q5 = queued(Command::Increment {
            name: c.clone(),
            by: 5,
            reply,
        });
        let (reply, delete_c) = Reply::new();
        let q6 = queued(Command::DeleteCounter {
            name: c.clone(),
            reply,
        });
        let (reply, inc_after) = Reply::new();
        let q7 = queued(Command::Increment {
            name: c.clone(),
            by: 2,
            reply,
        });
        let (reply, put) = Reply::new();
        let q8 = queued(Command::PutBudget {
            name: b.clone(),
            spec: spec.clone(),
            reply,
        });
        let (q9, recreated) = check(&b);
        let mut batch = vec![q1, q2, q3, q4, q5, q6, q7, q8, q9];
        if keyed {
            for (i, q) in batch.iter_mut().enumerate() {
                q.key =
                    Some(crate::meter::IdempotencyKey::parse(&format!("k{round}-{i}")).unwrap());
            }
        }
        let parts = match split {
            false => vec![batch],
            true => super::txn::transactions(batch),
        };
        // `b-other` apart, then `b` and `c` in seven runs of one kind.
        assert_eq!(parts.len(), if split { 8 } else { 1 });
        if split {
            let first: Vec<_> = parts[0].iter().map(|q| lock_key(&q.command)).collect();
            assert_eq!(first, [(1, "b-other")]);
        }
        for mut part in parts {
            apply_batch(&mut conn, &mut part).await.unwrap();
            for mut q in part {
                q.command.send(&Ok(()));
            }
        }
        // After the first round, `b` holds the round before's last check.
        assert_eq!(
            decided(before).await.unwrap(),
            round.min(2),
            "round {round}"
        );
        assert_eq!(decided(before_other).await.unwrap(), round);
        assert!(matches!(deleted(delete_b).await, Ok(Deleted { .. })));
        assert!(matches!(
            decided(after).await,
            Err(Error::Refused(Refusal::UnknownBudget(_)))
        ));
        assert_eq!(inc_before.await.unwrap().result.unwrap(), 5);
        assert_eq!(deleted(delete_c).await.unwrap(), Deleted { usage_rows: 0 });
        assert_eq!(inc_after.await.unwrap().result.unwrap(), 2);
        put.await.unwrap().result.unwrap();
        // The first check's call went with the deleted budget.
        assert_eq!(decided(recreated).await.unwrap(), 1);
        // Deleting the counter again in a later batch: it was written
        // again, so it exists; deleting twice in a row does not.
        let rows = dump(&mut conn).await;
        let counter = rows.iter().find(|r| r.0 == "c").map(|r| r.3);
        assert_eq!(counter, Some(2));
        sqlx::raw_sql("DELETE FROM counters")
            .execute(&mut conn)
            .await
            .unwrap();
    }
    // Deleting what is not there is refused and changes nothing.
    let (reply, gone) = Reply::new();
    let mut batch = vec![queued(Command::DeleteCounter {
        name: c.clone(),
        reply,
    })];
    let before = dump(&mut conn).await;
    apply_batch(&mut conn, &mut batch).await.unwrap();
    batch[0].command.send(&Ok(()));
    assert!(matches!(
        deleted(gone).await,
        Err(Error::Refused(Refusal::UnknownCounter(_)))
    ));
    assert_eq!(dump(&mut conn).await, before);
}

/// A key shared by an operator's command and a write on another name
/// goes to the first in queue order: the write is tied to the operator's
/// command, and so is every command on its name, which keeps its queue
/// order. Only the write on a name nothing ties runs apart, first.
#[tokio::test]
async fn a_key_ties_a_write_to_the_operators_command_before_it() {
    use super::{
        command::{Command, Queued, Reply},
        txn::{apply_batch, lock_key, transactions},
    };
    let mut conn = fresh_db().await;
    let [a, b, c] = ["a", "b", "c"].map(|n| Name::parse(n).unwrap());
    counters::increment(&mut conn, &a, 7).await.unwrap();
    let key = || Some(crate::meter::IdempotencyKey::parse("shared").unwrap());
    let queued = |command, key| Queued {
        command,
        key,
        request_id: None,
        queued_at: std::time::Instant::now(),
    };
    let increment = |name: &Name, key| {
        let (reply, rx) = Reply::new();
        let command = Command::Increment {
            name: name.clone(),
            by: 1,
            reply,
        };
        (queued(command, key), rx)
    };
    let (reply, deleted) = Reply::new();
    let delete = queued(
        Command::DeleteCounter {
            name: a.clone(),
            reply,
        },
        key(),
    );
    let (apart, apart_rx) = increment(&c, None);
    let (keyed, keyed_rx) = increment(&b, key());
    let (after, after_rx) = increment(&b, None);
    let parts = transactions(vec![delete, apart, keyed, after]);
    let names: Vec<Vec<_>> = parts
        .iter()
        .map(|p| p.iter().map(|q| lock_key(&q.command).1).collect())
        .collect();
    assert_eq!(names, [vec!["c"], vec!["a"], vec!["b", "b"]]);
    for mut part in parts {
        apply_batch(&mut conn, &mut part).await.unwrap();
        for mut q in part {
            q.command.send(&Ok(()));
        }
    }
    deleted.await.unwrap().result.unwrap();
    assert!(matches!(
        keyed_rx.await.unwrap().result,
        Err(Error::Refused(Refusal::KeyReused))
    ));
    assert_eq!(after_rx.await.unwrap().result.unwrap(), 1);
    assert_eq!(apart_rx.await.unwrap().result.unwrap(), 1);
}

/// A batch with idempotency keys, applied set-based (keys claimed in one
/// statement and stored in another), answers every command as the same
/// commands applied command by command, each in a savepoint with its key,
/// and leaves the same rows and the same stored keys: a key stored before
/// is replayed (or refused, reused by another command) and its command
/// does not run; a refused command's key is given back, so its retry
/// runs. A key sent more than once in a batch runs once
/// (`txn::firsts_and_repeats`): the reference applies each key's first
/// occurrence in queue order with the unkeyed commands, then the repeats.
#[tokio::test]
async fn keyed_batches_answer_as_command_by_command() {
    let (mut batched, mut single) = (fresh_db().await, fresh_db().await);
    keyed_batches_agree(&mut batched, &mut single).await;
    assert_eq!(dump(&mut batched).await, dump(&mut single).await);
    let stored = async |conn: &mut SqliteConnection| -> Vec<(String, String, String)> {
        sqlx::query_as("SELECT key, fingerprint, result FROM idempotency_keys ORDER BY key")
            .fetch_all(conn)
            .await
            .unwrap()
    };
    let kept = stored(&mut batched).await;
    assert_eq!(kept, stored(&mut single).await);
    assert!(kept.len() > 30, "{}", kept.len());
}

/// The same on PostgreSQL (the test command's server, two databases of the
/// test's own).
#[tokio::test]
async fn keyed_batches_answer_as_command_by_command_on_postgres() {
    use sqlx::PgConnection;
    let mut dbs = Vec::new();
    let mut conns = Vec::new();
    for i in 0..2 {
        let db = FreshPostgres::new(&format!("keyed_{i}")).await;
        conns.push(PgConnection::connect(&db.url).await.unwrap());
        dbs.push(db);
    }
    let [mut batched, mut single] = <[PgConnection; 2]>::try_from(conns).ok().unwrap();
    keyed_batches_agree(&mut batched, &mut single).await;
    let dump = async |conn: &mut PgConnection| -> (Vec<Row>, Vec<(String, String, String)>) {
        let rows = sqlx::query_as(DUMP).fetch_all(&mut *conn).await.unwrap();
        let keys = sqlx::query_as(
            "SELECT key, fingerprint, result FROM idempotency_keys ORDER BY key COLLATE \"C\"",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        (rows, keys)
    };
    let kept = dump(&mut batched).await;
    assert_eq!(kept, dump(&mut single).await);
    assert!(kept.1.len() > 30, "{}", kept.1.len());
    drop((batched, single));
    for db in dbs {
        db.drop().await;
    }
}

/// One of [`keyed_batches_agree`]'s commands: what (0-2 an increment of
/// that counter, 3-5 a check), the step or the visitor, and the key.
type Spec = (usize, i64, Option<String>);

/// `specs` without the repeats of a key that differ from its first
/// occurrence (first as the batch claims keys: counters before budgets,
/// each by name) when that first is a check refused whatever the counts
/// (an unknown budget, a day not kept). Command by command such a repeat
/// runs, its key given back; set-based it is refused as reusing the key
/// (`a_different_request_beside_a_refused_first_try_reuses_its_key`).
fn without_other_requests_beside_a_refusal(specs: Vec<Spec>) -> Vec<Spec> {
    let refused = |(what, by, _): &Spec| (*what == 5 && *by == 1) || (*what == 4 && *by == 3);
    let lock_key = |(what, by, _): &Spec| match what {
        0..=2 => (0, format!("n{what}")),
        5 if *by == 1 => (1, "none".to_owned()),
        _ => (1, "b".to_owned()),
    };
    let mut by_lock: Vec<usize> = (0..specs.len()).collect();
    by_lock.sort_by_key(|&i| lock_key(&specs[i]));
    let mut first = std::collections::HashMap::new();
    for i in by_lock {
        if let Some(k) = &specs[i].2 {
            first.entry(k.clone()).or_insert(i);
        }
    }
    specs
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            let Some(key) = &s.2 else { return true };
            let f = &specs[first[key]];
            first[key] == *i || !refused(f) || (f.0, f.1) == (s.0, s.1)
        })
        .map(|(_, s)| s.clone())
        .collect()
}

/// A different request with the key of a refused check, in the same
/// batch, is refused as reusing the key and counts nothing; the same
/// request again hears the same refusal; sent later, alone, the other
/// request runs.
#[tokio::test]
async fn a_different_request_beside_a_refused_first_try_reuses_its_key() {
    use super::{
        command::{Command, Queued, Reply},
        txn::apply_batch,
    };
    use crate::meter::IdempotencyKey;

    let mut conn = fresh_db().await;
    let key = || Some(IdempotencyKey::parse("k").unwrap());
    let unknown = Name::parse("none").unwrap();
    let counter = Name::parse("c").unwrap();
    let visitor = VisitorId::parse("v").unwrap();
    let check = || {
        let (reply, rx) = Reply::new();
        let command = Command::Check {
            budget: unknown.clone(),
            visitor: visitor.clone(),
            day: None,
            reply,
        };
        (command, rx)
    };
    let increment = || {
        let (reply, rx) = Reply::new();
        let command = Command::Increment {
            name: counter.clone(),
            by: 1,
            reply,
        };
        (command, rx)
    };
    let queued = |command| Queued {
        command,
        key: key(),
        request_id: None,
        queued_at: std::time::Instant::now(),
    };
    // Keys are claimed in lock order (budgets by name): the check of
    // `none`, which does not exist, is the key's first try; `zz` exists,
    // and command by command its check would run and count.
    let spec = BudgetSpec::new(10, 10, None, None).unwrap();
    let zz = Name::parse("zz").unwrap();
    budgets::put(&mut conn, &zz, &spec, Timestamp::now())
        .await
        .unwrap();
    let (first, first_rx) = check();
    let (same, same_rx) = check();
    let (other, other_rx) = {
        let (reply, rx) = Reply::new();
        let command = Command::Check {
            budget: zz.clone(),
            visitor: visitor.clone(),
            day: None,
            reply,
        };
        (command, rx)
    };
    let mut batch = vec![queued(first), queued(other), queued(same)];
    apply_batch(&mut conn, &mut batch).await.unwrap();
    for q in &mut batch {
        q.command.send(&Ok(()));
    }
    let unknown_budget =
        |r: Result<Decision, Error>| matches!(r, Err(Error::Refused(Refusal::UnknownBudget(_))));
    let a = first_rx.await.unwrap();
    assert!(unknown_budget(a.result) && !a.replayed);
    let a = other_rx.await.unwrap();
    assert!(
        matches!(a.result, Err(Error::Refused(Refusal::KeyReused))),
        "{:?}",
        a.result
    );
    let a = same_rx.await.unwrap();
    assert!(unknown_budget(a.result) && !a.replayed);
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys, 0);
    assert_eq!(dump(&mut conn).await, vec![]);
    // Alone, later: the key is free.
    let (inc, inc_rx) = increment();
    let mut batch = vec![queued(inc)];
    apply_batch(&mut conn, &mut batch).await.unwrap();
    batch[0].command.send(&Ok(()));
    let a = inc_rx.await.unwrap();
    assert_eq!(a.result.unwrap(), 1);
    assert!(!a.replayed);
}

/// 300 random batches of increments and checks, keyed or not (keys drawn
/// from 40, so that many are stored already and some come twice in a
/// batch), applied set-based to `batched` and command by command to
/// `single`: every answer the same.
async fn keyed_batches_agree<C: super::store::Store>(batched: &mut C, single: &mut C) {
    use super::{
        command::{Command, Queued, Reply},
        txn::{OnHeld, Pass, apply_by, apply_set_based, firsts_and_repeats},
    };
    use crate::meter::IdempotencyKey;

    type Answer<T> = tokio::sync::oneshot::Receiver<super::command::Answer<T>>;
    enum Rx {
        Value(Answer<i64>),
        Decision(Answer<Decision>),
    }
    #[derive(Debug, PartialEq)]
    enum Seen {
        Value(Result<i64, String>, bool),
        Decision(Result<(String, String, i64, i64), String>, bool),
    }
    let spec = BudgetSpec::new(3, 20, Some(2), Some("UTC")).unwrap();
    let budget = Name::parse("b").unwrap();
    for conn in [&mut *batched, &mut *single] {
        budgets::put(conn, &budget, &spec, Timestamp::now())
            .await
            .unwrap();
    }
    let counters = names(&["n0", "n1", "n2"]);
    let unknown = Name::parse("none").unwrap();
    let visitors: Vec<VisitorId> = ["A", "B", "C"]
        .iter()
        .map(|v| VisitorId::parse(v).unwrap())
        .collect();
    let long_ago = Day::parse("2000-01-01").unwrap();
    let mut rng = fastrand::Rng::with_seed(20);
    let mut repeated = 0;
    for round in 0..300 {
        // (command, step or visitor, key); the same draws make both batches.
        let specs: Vec<Spec> = (0..rng.usize(1..12))
            .map(|_| {
                // Half of them new to the batch and one of three: repeats
                // of a key no batch has stored, whose first occurrence
                // runs; the others of 40 stored across batches.
                let key = rng.bool().then(|| match rng.bool() {
                    true => format!("r{round}-{}", rng.usize(..3)),
                    false => format!("k{}", rng.usize(..40)),
                });
                (rng.usize(..6), rng.i64(1..4), key)
            })
            .collect();
        let specs = without_other_requests_beside_a_refusal(specs);
        let repeats = specs
            .iter()
            .filter_map(|s| s.2.as_ref())
            .collect::<std::collections::HashSet<_>>()
            .len()
            < specs.iter().filter(|s| s.2.is_some()).count();
        repeated += usize::from(repeats);
        // The reference's order: the first occurrences, then the repeats
        // (`txn::firsts_and_repeats`).
        let mut order: Option<Vec<usize>> = None;
        let mut seen = Vec::new();
        for (conn, pass) in [(&mut *batched, Pass::Batch), (&mut *single, Pass::Probe)] {
            let positions: Vec<usize> = match &order {
                Some(order) => order.clone(),
                None => (0..specs.len()).collect(),
            };
            let mut answers = Vec::new();
            let mut batch: Vec<Queued> = positions
                .iter()
                .map(|&i| {
                    let (what, by, key) = &specs[i];
                    let command = match what {
                        0..=2 => {
                            let (reply, rx) = Reply::new();
                            answers.push((i, Rx::Value(rx)));
                            Command::Increment {
                                name: counters[*what].clone(),
                                by: *by,
                                reply,
                            }
                        }
                        _ => {
                            let (reply, rx) = Reply::new();
                            answers.push((i, Rx::Decision(rx)));
                            Command::Check {
                                // An unknown budget, and a day the budget
                                // does not keep: refused, nothing counted.
                                budget: match what {
                                    5 if *by == 1 => unknown.clone(),
                                    _ => budget.clone(),
                                },
                                visitor: visitors[usize::try_from(*by).unwrap() - 1].clone(),
                                day: (*what == 4 && *by == 3).then_some(long_ago),
                                reply,
                            }
                        }
                    };
                    Queued {
                        command,
                        key: key.as_deref().map(|k| IdempotencyKey::parse(k).unwrap()),
                        request_id: None,
                        queued_at: std::time::Instant::now(),
                    }
                })
                .collect();
            if pass == Pass::Batch {
                let (firsts, repeats) = firsts_and_repeats(&batch);
                order = Some([firsts, repeats].concat());
            }
            match pass {
                // Set-based it must be, not one by one after a failed try.
                Pass::Batch => apply_set_based(conn, &mut batch, pass)
                    .await
                    .expect("applied set-based")
                    .unwrap(),
                _ => apply_by(conn, &mut batch, pass, OnHeld::OneByOne)
                    .await
                    .unwrap(),
            }
            for q in &mut batch {
                q.command.send(&Ok(()));
            }
            let mut got = Vec::new();
            for (i, rx) in answers {
                got.push((
                    i,
                    match rx {
                        Rx::Value(rx) => {
                            let a = rx.await.unwrap();
                            Seen::Value(a.result.map_err(|e| e.to_string()), a.replayed)
                        }
                        Rx::Decision(rx) => {
                            let a = rx.await.unwrap();
                            let d = a.result.map(|d| {
                                (
                                    format!("{:?}", d.reason),
                                    d.day.to_string(),
                                    d.visitor_calls,
                                    d.global_calls,
                                )
                            });
                            Seen::Decision(d.map_err(|e| e.to_string()), a.replayed)
                        }
                    },
                ));
            }
            got.sort_by_key(|(i, _)| *i);
            seen.push(got);
        }
        assert_eq!(seen[0], seen[1], "round {round}: {specs:?}");
    }
    // Many batches held a key more than once.
    assert!(repeated > 80, "{repeated}");
}

/// `txn::transactions` over random batches of every kind of command, on a
/// few names and keys: its parts hold every command once, each part in
/// queue order and of one kind (set-based or command by command); taken
/// one after another, commands on one name keep their queue order; and
/// the first part holding a key holds its first command in queue order.
#[test]
fn a_split_batch_keeps_every_command_once_and_each_name_in_order() {
    use super::{
        command::{Command, Queued, Reply},
        txn::{set_based, transactions},
    };
    let names = ["a", "b", "c", "d"].map(|n| Name::parse(n).unwrap());
    let spec = BudgetSpec::new(5, 5, None, None).unwrap();
    let visitor = VisitorId::parse("v").unwrap();
    let mut rng = fastrand::Rng::with_seed(7);
    for round in 0..20_000 {
        let batch: Vec<Queued> = (0..rng.usize(1..14))
            .map(|i| {
                let name = names[rng.usize(..names.len())].clone();
                let command = match rng.u8(..8) {
                    0 | 1 => Command::Increment {
                        name,
                        by: 1,
                        reply: Reply::new().0,
                    },
                    2 | 3 => Command::Check {
                        budget: name,
                        visitor: visitor.clone(),
                        day: None,
                        reply: Reply::new().0,
                    },
                    4 => Command::DeleteCounter {
                        name,
                        reply: Reply::new().0,
                    },
                    5 => Command::DeleteBudget {
                        name,
                        reply: Reply::new().0,
                    },
                    6 => Command::PutBudget {
                        name,
                        spec: spec.clone(),
                        reply: Reply::new().0,
                    },
                    _ => Command::Reset {
                        budget: name,
                        day: None,
                        visitor: None,
                        reply: Reply::new().0,
                    },
                };
                numbered(i, command, rng.bool().then(|| rng.u8(..3)))
            })
            .collect();
        let len = batch.len();
        let what = names_and_keys(&batch);
        let parts: Vec<Vec<(usize, bool)>> = transactions(batch)
            .iter()
            .map(|p| {
                p.iter()
                    .map(|q| {
                        let i = number(q);
                        (i, set_based(&q.command))
                    })
                    .collect()
            })
            .collect();
        let at = format!("round {round}: {what:?} -> {parts:?}");
        let order: Vec<usize> = parts.iter().flatten().map(|(i, _)| *i).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..len).collect::<Vec<_>>(), "{at}");
        for p in &parts {
            assert!(!p.is_empty(), "{at}");
            assert!(p.windows(2).all(|w| w[0].0 < w[1].0), "{at}");
            assert!(p.iter().all(|(_, kind)| *kind == p[0].1), "{at}");
        }
        for (x, &i) in order.iter().enumerate() {
            for &j in &order[x + 1..] {
                assert!(what[i].0 != what[j].0 || i < j, "{at}");
            }
        }
        for key in what.iter().filter_map(|(_, k)| k.as_ref()) {
            let first = what.iter().position(|(_, k)| k.as_ref() == Some(key));
            let holds =
                |p: &&Vec<(usize, bool)>| p.iter().any(|(i, _)| what[*i].1.as_ref() == Some(key));
            let part = parts.iter().find(holds).unwrap();
            assert!(part.iter().any(|(i, _)| Some(*i) == first), "{at}: {key}");
        }
    }
}

/// 20,000 random batches of increments and checks over a few names and
/// keys, cut in halves as a batch that met a held row is: the halves hold
/// every command once, share no name and no key, keep each name's (and
/// key's) commands in queue order, and are cut as near the middle as a
/// boundary between groups is; a batch of one group is not cut.
#[test]
fn a_batch_cut_in_halves_keeps_each_name_and_key_on_one_side_in_order() {
    use super::{
        command::{Command, Queued, Reply},
        txn::{divisible, groups, halves},
    };
    let names = ["a", "b", "c", "d", "e", "f"].map(|n| Name::parse(n).unwrap());
    let visitor = VisitorId::parse("v").unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    let (mut cut, mut whole) = (0, 0);
    for round in 0..20_000 {
        let mut batch: Vec<Queued> = (0..rng.usize(1..16))
            .map(|i| {
                let name = names[rng.usize(..names.len())].clone();
                let command = match rng.bool() {
                    true => Command::Increment {
                        name,
                        by: 1,
                        reply: Reply::new().0,
                    },
                    false => Command::Check {
                        budget: name,
                        visitor: visitor.clone(),
                        day: None,
                        reply: Reply::new().0,
                    },
                };
                numbered(i, command, (rng.u8(..4) == 0).then(|| rng.u8(..3)))
            })
            .collect();
        let len = batch.len();
        let what = names_and_keys(&batch);
        let groups = groups(&batch);
        let can = divisible(&groups);
        let at = halves(&mut batch, &groups);
        let order: Vec<usize> = batch.iter().map(number).collect();
        let seen = format!("round {round}: {what:?} -> {order:?}, cut at {at:?}");
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..len).collect::<Vec<_>>(), "{seen}");
        assert_eq!(can, at.is_some(), "{seen}");
        let Some(at) = at else {
            whole += 1;
            continue;
        };
        cut += 1;
        assert!(0 < at && at < len, "{seen}");
        let (first, second) = order.split_at(at);
        for &i in first {
            for &j in second {
                assert_ne!(what[i].0, what[j].0, "{seen}");
                assert!(what[i].1.is_none() || what[i].1 != what[j].1, "{seen}");
            }
        }
        // Within each side, a name's commands in queue order.
        for side in [first, second] {
            for (x, &i) in side.iter().enumerate() {
                for &j in &side[x + 1..] {
                    assert!(what[i].0 != what[j].0 || i < j, "{seen}");
                }
            }
        }
        // No boundary between groups nearer the middle: each side cut
        // again at any nearer point would split a group.
        let middle = len / 2;
        for nearer in 1..len {
            if nearer.abs_diff(middle) < at.abs_diff(middle) {
                let (a, b) = order.split_at(nearer);
                let shares = a.iter().any(|&i| {
                    b.iter().any(|&j| {
                        what[i].0 == what[j].0 || (what[i].1.is_some() && what[i].1 == what[j].1)
                    })
                });
                assert!(shares, "{seen}: {nearer} is a nearer boundary");
            }
        }
    }
    assert!(cut > 5_000 && whole > 1_000, "{cut} cut, {whole} whole");
}

/// Command `i` of a random batch, its number as its request id, with key
/// `k{key}` if any.
fn numbered(i: usize, command: super::command::Command, key: Option<u8>) -> super::command::Queued {
    super::command::Queued {
        command,
        key: key.map(|k| crate::meter::IdempotencyKey::parse(&format!("k{k}")).unwrap()),
        request_id: Some(i.to_string().into()),
        queued_at: std::time::Instant::now(),
    }
}

/// The number [`numbered`] gave a command.
fn number(q: &super::command::Queued) -> usize {
    q.request_id.as_deref().unwrap().parse().unwrap()
}

/// Each command's lock key (kind and name) and idempotency key, owned.
fn names_and_keys(batch: &[super::command::Queued]) -> Vec<((u8, String), Option<String>)> {
    batch
        .iter()
        .map(|q| {
            let (kind, name) = super::txn::lock_key(&q.command);
            let key = q.key.as_ref().map(|k| k.as_str().to_owned());
            ((kind, name.to_owned()), key)
        })
        .collect()
}

/// A migrated database of the test's own on the test command's
/// PostgreSQL (`TALLY_TEST_POSTGRES`).
pub(crate) struct FreshPostgres {
    pub url: String,
    name: String,
    admin: sqlx::PgConnection,
}

impl FreshPostgres {
    pub async fn new(tag: &str) -> Self {
        use sqlx::Connection;
        let server = std::env::var("TALLY_TEST_POSTGRES").expect(
            "TALLY_TEST_POSTGRES is not set: run ./scripts/test, which starts a PostgreSQL",
        );
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let name = format!("tally_{tag}_{}_{unique}", std::process::id());
        let mut admin = sqlx::PgConnection::connect(&server).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let mut url = url::Url::parse(&server).unwrap();
        url.set_path(&name);
        let mut conn = sqlx::PgConnection::connect(url.as_str()).await.unwrap();
        sqlx::migrate!("./migrations/postgres")
            .run(&mut conn)
            .await
            .unwrap();
        FreshPostgres {
            url: url.to_string(),
            name,
            admin,
        }
    }

    pub async fn drop(mut self) {
        let drop = format!("DROP DATABASE {} WITH (FORCE)", self.name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut self.admin)
            .await
            .unwrap();
    }
}

/// A day the budget's window had left may still be stored: usage is pruned
/// by a day's first call. A PUT whose window reaches back over it (a longer
/// retention, a time zone moved west) must not bring its old counts back:
/// the day reads the same whether or not a call pruned it first.
#[tokio::test]
async fn a_new_window_never_brings_back_a_day_the_old_one_had_left() {
    let name = Name::parse("b").unwrap();
    let visitor = VisitorId::parse("a").unwrap();
    let other = VisitorId::parse("other").unwrap();
    let left = Day::parse("2026-03-09").unwrap();
    // (old spec, when its calls were made, new spec, when it is put)
    let cases = [
        // Retention 1 to 7: 03-09 left the window on 03-11.
        (
            BudgetSpec::new(5, 5, Some(1), Some("UTC")).unwrap(),
            "2026-03-10T12:00:00Z",
            BudgetSpec::new(5, 5, Some(7), Some("UTC")).unwrap(),
            "2026-03-12T12:00:00Z",
        ),
        // From UTC+14 to UTC: at 10:30 UTC it is 03-11 in Kiritimati
        // (window 03-10..03-11) and 03-10 in UTC (window 03-09..03-10).
        (
            BudgetSpec::new(5, 5, Some(1), Some("Pacific/Kiritimati")).unwrap(),
            "2026-03-10T09:00:00Z",
            BudgetSpec::new(5, 5, Some(1), Some("UTC")).unwrap(),
            "2026-03-10T10:30:00Z",
        ),
    ];
    for (old, calls_at, new, put_at) in cases {
        let (calls_at, put_at): (Timestamp, Timestamp) =
            (calls_at.parse().unwrap(), put_at.parse().unwrap());
        let mut read = Vec::new();
        for pruned_first in [false, true] {
            let mut conn = fresh_db().await;
            budgets::put(&mut conn, &name, &old, calls_at)
                .await
                .unwrap();
            for _ in 0..2 {
                let item = CheckItem {
                    budget: &name,
                    visitor: &visitor,
                    day: Some(left),
                };
                budgets::check(&mut conn, item, calls_at).await.unwrap();
            }
            if pruned_first {
                // Today's first call prunes the day the window left.
                let item = CheckItem {
                    budget: &name,
                    visitor: &other,
                    day: None,
                };
                budgets::check(&mut conn, item, put_at).await.unwrap();
            }
            budgets::put(&mut conn, &name, &new, put_at).await.unwrap();
            let item = CheckItem {
                budget: &name,
                visitor: &visitor,
                day: Some(left),
            };
            let d = budgets::check(&mut conn, item, put_at).await.unwrap();
            read.push((d.visitor_calls, d.global_calls));
        }
        assert_eq!(read, [(1, 1), (1, 1)], "{}", new.timezone_name);
    }
}

/// A clock a little fast at a budget's midnight (less than a step from
/// one reading to the next, or creeping there: `clock::UNSEEN`) is no
/// step, and is held for by no hold: the day's first call, or a `PUT` made
/// again, by that clock, and then the clock set right, must leave the day
/// the window had not yet left reading what it counted (its visitor at the
/// limit stays there), not empty. Past `UNSEEN` after midnight, a day's
/// first call prunes the day the window left, and a `PUT` too.
#[tokio::test]
async fn a_clock_a_little_fast_at_midnight_prunes_no_kept_day() {
    let name = Name::parse("b").unwrap();
    let (a, other) = (
        VisitorId::parse("a").unwrap(),
        VisitorId::parse("o").unwrap(),
    );
    let spec = BudgetSpec::new(2, 50, Some(1), Some("UTC")).unwrap();
    let at = |s: &str| s.parse::<Timestamp>().unwrap();
    let oldest = Day::parse("2026-03-09").unwrap();
    let check = async |conn: &mut SqliteConnection, visitor, day, now| {
        let item = CheckItem {
            budget: &name,
            visitor,
            day,
        };
        budgets::check(conn, item, now).await.unwrap()
    };
    for by_put in [false, true] {
        let mut conn = fresh_db().await;
        budgets::put(&mut conn, &name, &spec, at("2026-03-10T12:00:00Z"))
            .await
            .unwrap();
        // `a` uses up its limit on 03-09, the oldest day 03-10 keeps.
        for _ in 0..2 {
            check(&mut conn, &a, Some(oldest), at("2026-03-10T23:58:00Z")).await;
        }
        // The clock 230 s fast: it reads 03-11, whose window has left
        // 03-09.
        let fast = at("2026-03-11T00:02:10Z");
        match by_put {
            false => {
                let d = check(&mut conn, &other, None, fast).await;
                assert_eq!(
                    (d.day.to_string().as_str(), d.pruned_rows),
                    ("2026-03-11", 0)
                );
            }
            true => {
                let put = budgets::put(&mut conn, &name, &spec, fast).await.unwrap();
                assert_eq!(put.pruned_rows, 0);
            }
        }
        // Set right: 03-09 is kept again, and `a` is still at its limit
        // (a call denied by the visitor's limit reaches no global count).
        let d = check(&mut conn, &a, Some(oldest), at("2026-03-10T23:58:30Z")).await;
        assert_eq!(
            (d.allowed(), d.visitor_calls, d.global_calls),
            (false, 3, 2),
            "by a PUT: {by_put}"
        );
    }

    // Past `UNSEEN`: the first call of 03-11, and a `PUT`, prune 03-09.
    for by_put in [false, true] {
        let mut conn = fresh_db().await;
        budgets::put(&mut conn, &name, &spec, at("2026-03-10T12:00:00Z"))
            .await
            .unwrap();
        check(&mut conn, &a, Some(oldest), at("2026-03-10T23:58:00Z")).await;
        let late = at("2026-03-11T00:04:01Z");
        let pruned = match by_put {
            false => check(&mut conn, &other, None, late).await.pruned_rows,
            true => {
                budgets::put(&mut conn, &name, &spec, late)
                    .await
                    .unwrap()
                    .pruned_rows
            }
        };
        assert_eq!(
            pruned, 2,
            "the visitor's row and the day's global row, by a PUT: {by_put}"
        );
    }
}

/// On PostgreSQL an operator's transaction that resets a budget's day and
/// then replaces or deletes the budget (one batch of admin commands, run
/// command by command) never deadlocks with a check on another process:
/// the check holds the budget's share lock and waits for the day, which
/// the reset has locked. Were the reset to read the budget with a share
/// lock too, the `PUT` or delete after it would wait for the check's, and
/// each would wait for the other until PostgreSQL broke one.
#[tokio::test]
async fn a_reset_then_a_change_of_its_budget_never_deadlocks_with_a_check() {
    use sqlx::PgConnection;

    use super::store::Store;
    let name = Name::parse("b").unwrap();
    let spec = BudgetSpec::new(5, 50, Some(1), Some("UTC")).unwrap();
    let now = Timestamp::now();
    let today = spec.kept_days(now).today.to_string();
    for delete in [false, true] {
        let db = FreshPostgres::new("reset_then_change").await;
        let mut admin = PgConnection::connect(&db.url).await.unwrap();
        let mut check = PgConnection::connect(&db.url).await.unwrap();
        budgets::put(&mut admin, &name, &spec, now).await.unwrap();

        // The check, as another process's writer runs it: the budget's
        // share lock first, then its day.
        sqlx::raw_sql("BEGIN").execute(&mut check).await.unwrap();
        assert_eq!(check.load_budgets(&["b"]).await.unwrap().len(), 1);
        let operator = tokio::spawn({
            let (name, spec) = (name.clone(), spec.clone());
            async move {
                sqlx::raw_sql("BEGIN").execute(&mut admin).await.unwrap();
                budgets::reset(&mut admin, &name, None, None, now).await?;
                match delete {
                    true => budgets::delete(&mut admin, &name).await.map(drop)?,
                    false => budgets::put(&mut admin, &name, &spec, now)
                        .await
                        .map(drop)?,
                }
                sqlx::raw_sql("COMMIT").execute(&mut admin).await.unwrap();
                Ok::<_, super::Error>(())
            }
        });
        // Long enough for the operator's transaction to reach its wait.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let day = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            check.lock_days(&[("b", &today)]),
        )
        .await
        .expect("the check waited 20 s for its day");
        day.expect("the check's day");
        sqlx::raw_sql("COMMIT").execute(&mut check).await.unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(20), operator)
            .await
            .expect("the operator's transaction waited 20 s")
            .unwrap()
            .unwrap_or_else(|e| panic!("delete {delete}: {e}"));
        drop(check);
        db.drop().await;
    }
}

/// An answer the writer sent to a request that went away before reading
/// it (timed out, its client gone, in the same instant) is counted as a
/// write whose caller had gone, once; one never sent is left to the writer,
/// which counts it when its send finds no one.
#[test]
fn an_answer_sent_and_never_read_is_accounted_for_once() {
    use super::{Unread, command::Answer};
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let unread = |rx| Unread::<i64> {
            rx: Some(rx),
            kind: "increment",
            request_id: Some("r-1".into()),
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = unread(rx);
        tx.send(Answer {
            result: Ok(7),
            replayed: false,
        })
        .unwrap();
        drop(sent);
        let (tx, rx) = tokio::sync::oneshot::channel::<Answer<i64>>();
        drop(unread(rx));
        assert!(tx.is_closed(), "the writer finds no one, and counts it");
    });
    let text = handle.render();
    assert!(
        text.contains("tally_write_committed_caller_gone_total{command=\"increment\"} 1\n"),
        "{text}"
    );
}

/// A `PUT` that changes nothing, decided at an instant just before the
/// budget's midnight while checks already count on the new day (on
/// PostgreSQL: a transaction whose time was read before midnight, then
/// waiting for the row's lock; anywhere: a clock stepped back), keeps what
/// they counted. It used to delete every day after its today, as if the
/// time zone had moved west, and the visitor's limit started over.
#[tokio::test]
async fn a_put_that_changes_nothing_keeps_what_was_counted_after_midnight() {
    let mut conn = fresh_db().await;
    let b = Name::parse("b").unwrap();
    let spec = BudgetSpec::new(3, 100, None, None).unwrap();
    let before: Timestamp = "2026-12-03T23:59:59Z".parse().unwrap();
    let after: Timestamp = "2026-12-04T00:00:01Z".parse().unwrap();
    budgets::put(&mut conn, &b, &spec, before).await.unwrap();
    let v = VisitorId::parse("v").unwrap();
    let item = CheckItem {
        budget: &b,
        visitor: &v,
        day: None,
    };
    for _ in 0..3 {
        assert!(
            budgets::check(&mut conn, item, after)
                .await
                .unwrap()
                .allowed()
        );
    }
    budgets::put(&mut conn, &b, &spec, before).await.unwrap();
    let fourth = budgets::check(&mut conn, item, after).await.unwrap();
    assert_eq!(
        (fourth.visitor_calls, fourth.allowed()),
        (4, false),
        "the visitor's 4th call of 2026-12-04 is denied: {fourth:?}"
    );
    // Moving the time zone west still deletes the days it has not begun:
    // at 00:00:01 UTC it is still 2026-12-03 in New York.
    let west = BudgetSpec::new(3, 100, None, Some("America/New_York")).unwrap();
    budgets::put(&mut conn, &b, &west, after).await.unwrap();
    let usage = budgets::check(&mut conn, item, after).await.unwrap();
    assert_eq!(usage.day.to_string(), "2026-12-03");
    assert_eq!(usage.visitor_calls, 1, "{usage:?}");
    let later = usage_rows_after(&mut conn, "2026-12-03").await;
    assert_eq!(later, 0, "the day New York has not begun is gone");

    // A zone moved west by a PUT decided a moment before midnight (both
    // zones still on 2026-12-03 by its clock), while checks in the old
    // zone already counted on 2026-12-04: under the new zone that day has
    // not begun, and goes.
    let tokyo = BudgetSpec::new(3, 100, None, Some("Asia/Tokyo")).unwrap();
    let before_tokyo: Timestamp = "2026-12-03T14:59:59Z".parse().unwrap();
    let after_tokyo: Timestamp = "2026-12-03T15:00:01Z".parse().unwrap();
    budgets::put(&mut conn, &b, &tokyo, before_tokyo)
        .await
        .unwrap();
    let counted = budgets::check(&mut conn, item, after_tokyo).await.unwrap();
    assert_eq!(counted.day.to_string(), "2026-12-04");
    budgets::put(&mut conn, &b, &spec, before_tokyo)
        .await
        .unwrap();
    let later = usage_rows_after(&mut conn, "2026-12-03").await;
    assert_eq!(later, 0, "Tokyo's 2026-12-04 has not begun in UTC");
}

/// How many visitors' usage rows are on days after `day`.
async fn usage_rows_after(conn: &mut SqliteConnection, day: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM budget_visitor_usage WHERE day > ?1")
        .bind(day)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A day of more visitors than a prune's share is pruned a share at a
/// time: the day's first call deletes one share (every global row before
/// the window, and [`budgets::PRUNE_SHARE`] visitors' rows), the writer's
/// next shares ([`budgets::prune_more`]) the rest, each saying whether
/// more may be left; the days the budget keeps lose nothing, and a budget
/// deleted meanwhile has nothing left to prune.
#[tokio::test]
async fn a_day_of_many_visitors_is_pruned_a_share_at_a_time() {
    let share = i64::try_from(budgets::PRUNE_SHARE).unwrap();
    let name = Name::parse("big").unwrap();
    let spec = BudgetSpec::new(5, 1_000_000, Some(1), Some("UTC")).unwrap();
    let now = Timestamp::now();
    let kept = spec.kept_days(now);
    let mut conn = fresh_db().await;
    budgets::put(&mut conn, &name, &spec, now).await.unwrap();
    // Yesterday, which the budget keeps, and a day it has left holding
    // two shares and a half of visitors.
    let yesterday = CheckItem {
        budget: &name,
        visitor: &VisitorId::parse("kept").unwrap(),
        day: Some(kept.oldest),
    };
    budgets::check(&mut conn, yesterday, now).await.unwrap();
    let left = share * 5 / 2;
    sqlx::query(
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1)
         INSERT INTO budget_visitor_usage SELECT 'big', '2000-01-01', 'v' || i, 1 FROM g",
    )
    .bind(left)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::raw_sql("INSERT INTO budget_global_usage VALUES ('big', '2000-01-01', 1)")
        .execute(&mut conn)
        .await
        .unwrap();
    let cutoff = kept.oldest.to_string();
    // Today's first call: one share and the global row.
    let today = CheckItem {
        budget: &name,
        visitor: &VisitorId::parse("a").unwrap(),
        day: None,
    };
    let d = budgets::check(&mut conn, today, now).await.unwrap();
    assert_eq!(d.pruned_rows, budgets::PRUNE_SHARE + 1);
    assert_eq!(old_rows(&mut conn, &cutoff).await, left - share);

    // A PUT that changes nothing (a configuration tool applying it
    // again) takes one more share, not the rest.
    budgets::put(&mut conn, &name, &spec, now).await.unwrap();
    assert_eq!(old_rows(&mut conn, &cutoff).await, left - 2 * share);

    // The writer's shares: the rest, then nothing.
    let more = budgets::prune_more(&mut conn, "big", &mut None)
        .await
        .unwrap();
    assert_eq!(more, (u64::try_from(left - 2 * share).unwrap(), false));
    assert_eq!(old_rows(&mut conn, &cutoff).await, 0);
    assert_eq!(
        budgets::prune_more(&mut conn, "big", &mut None)
            .await
            .unwrap(),
        (0, false)
    );
    // Yesterday's call and today's are still counted.
    let kept_rows: Vec<Row> = dump(&mut conn).await;
    assert_eq!(kept_rows.len(), 4, "{kept_rows:?}");

    // A budget deleted with a prune under way: all its usage goes, kept
    // days and all (a deleted budget's purge).
    sqlx::raw_sql(
        "INSERT INTO budget_visitor_usage VALUES ('gone', '2000-01-01', 'v', 1), ('gone', '2999-01-01', 'v', 1)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        budgets::prune_more(&mut conn, "gone", &mut None)
            .await
            .unwrap(),
        (2, false)
    );
}

/// Keys stored as text that is not UTF-8 (by hand: SQLite does not check
/// what `CAST(X'..' AS TEXT)` makes) stop neither the prune of the days
/// that hold them, nor with it the budget's checks, nor the search for
/// deleted budgets' usage, which leaves out only the name it cannot read.
#[tokio::test]
async fn keys_that_are_not_utf8_stop_no_prune_and_no_search() {
    use super::store::Store;
    let share = i64::try_from(budgets::PRUNE_SHARE).unwrap();
    let name = Name::parse("big").unwrap();
    let spec = BudgetSpec::new(5, 1_000_000, Some(1), Some("UTC")).unwrap();
    let now = Timestamp::now();
    let cutoff = spec.kept_days(now).oldest.to_string();
    let mut conn = fresh_db().await;
    budgets::put(&mut conn, &name, &spec, now).await.unwrap();
    // A day the window has left, of more than a share of visitors, every
    // one of them not UTF-8: the share ends on such a row.
    sqlx::query(
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1)
         INSERT INTO budget_visitor_usage
         SELECT 'big', '2000-01-01', CAST(X'FF' AS TEXT) || i, 1 FROM g",
    )
    .bind(share + 5)
    .execute(&mut conn)
    .await
    .unwrap();
    let check = CheckItem {
        budget: &name,
        visitor: &VisitorId::parse("a").unwrap(),
        day: None,
    };
    let d = budgets::check(&mut conn, check, now).await.unwrap();
    assert_eq!((d.visitor_calls, d.global_calls), (1, 1));
    assert!(d.pruned_rows > 0, "{d:?}");
    let more = budgets::prune_more(&mut conn, "big", &mut None)
        .await
        .unwrap();
    assert!(more.0 > 0, "{more:?}");
    assert_eq!(old_rows(&mut conn, &cutoff).await, 0);

    // A deleted budget's usage beside one stored under a name that is not
    // UTF-8: the first is found, the second left out.
    sqlx::raw_sql(
        "INSERT INTO budget_visitor_usage VALUES ('gone', '2000-01-01', 'v', 1),
             (CAST(X'62FF' AS TEXT), '2000-01-01', 'v', 1);
         INSERT INTO budget_global_usage VALUES (CAST(X'63FF' AS TEXT), '2000-01-01', 1)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(conn.orphaned_usage().await.unwrap(), ["gone"]);
}

/// Usage rows stored for days before `cutoff`.
async fn old_rows(conn: &mut SqliteConnection, cutoff: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM budget_visitor_usage WHERE day < ?1)
              + (SELECT count(*) FROM budget_global_usage WHERE day < ?1)",
    )
    .bind(cutoff)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// A deleted budget's usage goes a share at a time: the delete takes one
/// (and every global row), the writer's next shares the rest; while some
/// is left it is found as a deleted budget's, and a `PUT` that creates the
/// budget again first deletes what is left, so the new budget starts
/// empty. A budget that exists is never purged.
#[tokio::test]
async fn a_deleted_budgets_usage_goes_a_share_at_a_time() {
    use super::store::Store;
    let share = i64::try_from(budgets::PRUNE_SHARE).unwrap();
    let name = Name::parse("big").unwrap();
    let spec = BudgetSpec::new(5, 1_000_000, Some(7), Some("UTC")).unwrap();
    let now = Timestamp::now();
    let today = spec.kept_days(now).today.to_string();
    let mut conn = fresh_db().await;
    for other in ["a", "z"] {
        let other = Name::parse(other).unwrap();
        budgets::put(&mut conn, &other, &spec, now).await.unwrap();
    }
    let many = |n: i64, budget: &'static str| {
        sqlx::query(
            "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1)
             INSERT INTO budget_visitor_usage SELECT ?2, ?3, 'v' || i, 1 FROM g;
             INSERT INTO budget_global_usage VALUES (?2, ?3, ?1);",
        )
        .bind(n)
        .bind(budget)
        .bind(today.clone())
    };
    let rows_of = async |conn: &mut SqliteConnection, budget: &str| -> i64 {
        sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM budget_visitor_usage WHERE budget = ?1)
                  + (SELECT count(*) FROM budget_global_usage WHERE budget = ?1)",
        )
        .bind(budget)
        .fetch_one(conn)
        .await
        .unwrap()
    };
    budgets::put(&mut conn, &name, &spec, now).await.unwrap();
    let left = share * 5 / 2;
    many(left, "big").execute(&mut conn).await.unwrap();
    many(3, "a").execute(&mut conn).await.unwrap();
    many(3, "z").execute(&mut conn).await.unwrap();

    // An existing budget's usage is not a deleted one's.
    assert_eq!(
        budgets::purge(&mut conn, "big", None).await.unwrap(),
        (0, false)
    );
    assert!(conn.orphaned_usage().await.unwrap().is_empty());

    budgets::delete(&mut conn, &name).await.unwrap();
    assert_eq!(rows_of(&mut conn, "big").await, left - share);
    assert_eq!(conn.orphaned_usage().await.unwrap(), ["big"]);
    // Created again with more than a share left: refused, having deleted
    // nothing (no work for the writer's savepoint to take back).
    match budgets::put(&mut conn, &name, &spec, now).await {
        Err(Error::Purging(n)) => assert_eq!(n, name),
        other => panic!("{other:?}"),
    }
    assert_eq!(rows_of(&mut conn, "big").await, left - share);
    let more = budgets::prune_more(&mut conn, "big", &mut None)
        .await
        .unwrap();
    assert_eq!(more, (budgets::PRUNE_SHARE, true));
    assert_eq!(rows_of(&mut conn, "big").await, left - 2 * share);

    // Created again with a share or less left: it starts empty.
    budgets::put(&mut conn, &name, &spec, now).await.unwrap();
    assert_eq!(rows_of(&mut conn, "big").await, 0);
    assert!(conn.orphaned_usage().await.unwrap().is_empty());
    let check = CheckItem {
        budget: &name,
        visitor: &VisitorId::parse("v1").unwrap(),
        day: None,
    };
    let d = budgets::check(&mut conn, check, now).await.unwrap();
    assert_eq!((d.visitor_calls, d.global_calls), (1, 1));
    // The other budgets lost nothing.
    assert_eq!(rows_of(&mut conn, "a").await, 4);
    assert_eq!(rows_of(&mut conn, "z").await, 4);
}

/// A `PUT` that shortens a budget's retention deletes the days it leaves
/// a share at a time, as a prune does: one share in its transaction, the
/// writer the rest. A `PUT` that lengthens it again before the rest is
/// gone deletes the rest first, so the days it brings back read empty.
#[tokio::test]
async fn a_shorter_retention_goes_a_share_at_a_time_and_never_comes_back() {
    let share = i64::try_from(budgets::PRUNE_SHARE).unwrap();
    let name = Name::parse("big").unwrap();
    let long = BudgetSpec::new(5, 1_000_000, Some(30), Some("UTC")).unwrap();
    let short = BudgetSpec::new(5, 1_000_000, Some(1), Some("UTC")).unwrap();
    let now = Timestamp::now();
    let kept = short.kept_days(now);
    // Inside the long window, outside the short one.
    let past = long.kept_days(now).today.minus_days(10);
    let mut conn = fresh_db().await;
    budgets::put(&mut conn, &name, &long, now).await.unwrap();
    let past_text = past.to_string();
    let cutoff = kept.oldest.to_string();
    let many = share * 5 / 2;
    sqlx::query(
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < ?1)
         INSERT INTO budget_visitor_usage SELECT 'big', ?2, 'v' || i, 1 FROM g;
         INSERT INTO budget_global_usage VALUES ('big', ?2, ?1);",
    )
    .bind(many)
    .bind(&past_text)
    .execute(&mut conn)
    .await
    .unwrap();
    let item = CheckItem {
        budget: &name,
        visitor: &VisitorId::parse("kept").unwrap(),
        day: None,
    };
    budgets::check(&mut conn, item, now).await.unwrap();

    budgets::put(&mut conn, &name, &short, now).await.unwrap();
    assert_eq!(old_rows(&mut conn, &cutoff).await, many - share);
    let more = budgets::prune_more(&mut conn, "big", &mut None)
        .await
        .unwrap();
    assert_eq!(more, (budgets::PRUNE_SHARE, true));

    // Longer again with a share left: the day it brings back is empty.
    budgets::put(&mut conn, &name, &long, now).await.unwrap();
    assert_eq!(old_rows(&mut conn, &cutoff).await, 0);
    let item = CheckItem {
        budget: &name,
        visitor: &VisitorId::parse("v1").unwrap(),
        day: Some(past),
    };
    let d = budgets::check(&mut conn, item, now).await.unwrap();
    assert_eq!((d.visitor_calls, d.global_calls), (1, 1));
    // Today's call is kept through all of it.
    let item = CheckItem {
        budget: &name,
        visitor: &VisitorId::parse("kept").unwrap(),
        day: None,
    };
    let d = budgets::check(&mut conn, item, now).await.unwrap();
    assert_eq!((d.visitor_calls, d.global_calls), (2, 2));
}

/// On PostgreSQL the writer's shares go on from where the last one ended
/// (rows deleted stay in the index while an older snapshot may see them,
/// and walking over them again would cost every share more than the
/// last): with a transaction holding a snapshot open throughout, shares
/// of a deleted budget's usage and of a day past retention each delete
/// one share, to the last row, and keep every row of a kept day.
#[tokio::test]
async fn on_postgres_shares_go_on_from_where_the_last_one_ended() {
    use sqlx::{Connection, PgConnection};
    let db = FreshPostgres::new("shares").await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let mut reader = PgConnection::connect(&db.url).await.unwrap();
    let now = Timestamp::now();
    let spec = BudgetSpec::new(5, 1_000_000, Some(1), Some("UTC")).unwrap();
    let kept = spec.kept_days(now).today.to_string();
    for name in ["pruned", "deleted"] {
        let name = Name::parse(name).unwrap();
        budgets::put(&mut conn, &name, &spec, now).await.unwrap();
    }
    let fill = "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < $1::int8)
         INSERT INTO budget_visitor_usage SELECT $2, $3, 'v' || i, 1 FROM g";
    let share = i64::try_from(budgets::PRUNE_SHARE).unwrap();
    let rows = share * 5 / 2;
    for (budget, day) in [
        ("pruned", "2000-01-01"),
        ("pruned", "2000-01-02"),
        ("deleted", "2000-01-01"),
    ] {
        let q = sqlx::query(fill).bind(rows / 2).bind(budget).bind(day);
        q.execute(&mut conn).await.unwrap();
    }
    sqlx::query(fill)
        .bind(7_i64)
        .bind("pruned")
        .bind(&kept)
        .execute(&mut conn)
        .await
        .unwrap();
    budgets::delete(&mut conn, &Name::parse("deleted").unwrap())
        .await
        .unwrap();
    // A snapshot held open: the rows each share deletes stay in the index.
    sqlx::raw_sql(
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM budget_visitor_usage",
    )
    .execute(&mut reader)
    .await
    .unwrap();
    let count = async |conn: &mut PgConnection, budget: &str| -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM budget_visitor_usage WHERE budget = $1")
            .bind(budget)
            .fetch_one(conn)
            .await
            .unwrap()
    };
    for (budget, left) in [("pruned", rows), ("deleted", rows / 2 - share)] {
        let mut after = None;
        let mut shares = 0;
        loop {
            let (deleted, more) = budgets::prune_more(&mut conn, budget, &mut after)
                .await
                .unwrap();
            assert!(deleted <= budgets::PRUNE_SHARE, "{budget}: {deleted}");
            shares += 1;
            if !more {
                break;
            }
        }
        assert_eq!(
            shares,
            (left + share - 1) / share + i64::from(left % share == 0),
            "{budget}"
        );
    }
    assert_eq!(count(&mut conn, "pruned").await, 7);
    assert_eq!(count(&mut conn, "deleted").await, 0);
    sqlx::raw_sql("COMMIT").execute(&mut reader).await.unwrap();
    drop((conn, reader));
    db.drop().await;
}

/// A usage read takes the budget, then the day's counts. A delete that
/// commits between the two leaves the budget gone and its usage part
/// deleted (the global row and a share of visitors; the rest goes after):
/// the counts, read in one statement with the budget's existence, answer
/// that the budget is gone, never a day whose global count is below a
/// visitor's.
#[tokio::test]
async fn a_usage_read_straddling_a_delete_finds_the_budget_gone() {
    let dir = tempfile::tempdir().unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("t.db"))
        .create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    sqlx::migrate!("./migrations/sqlite")
        .run(&pool)
        .await
        .unwrap();
    let name = Name::parse("big").unwrap();
    let spec = BudgetSpec::new(5, 1_000_000, Some(7), Some("UTC")).unwrap();
    let now = Timestamp::now();
    let today = spec.kept_days(now).today.to_string();
    let mut conn = pool.acquire().await.unwrap();
    budgets::put(&mut *conn, &name, &spec, now).await.unwrap();
    sqlx::query(
        "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 25000)
         INSERT INTO budget_visitor_usage SELECT 'big', ?1, 'v' || i, 1 FROM g;
         INSERT INTO budget_global_usage VALUES ('big', ?1, 25000);",
    )
    .bind(&today)
    .execute(&mut *conn)
    .await
    .unwrap();
    let read = async || {
        super::sqlite::store::usage_counts(&pool, "big", &today, Some("v9999"))
            .await
            .unwrap()
    };
    assert_eq!(read().await, Some((25_000, Some(1))));
    budgets::delete(&mut *conn, &name).await.unwrap();
    // v9999 sorts past the first share: its row is still there.
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM budget_visitor_usage WHERE visitor = 'v9999'")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert_eq!(left, 1);
    assert_eq!(read().await, None);
}

/// What the clock's hold row keeps ([`super::clock::KeptHold`]), on both
/// engines: a hold replaces whatever is kept; an early end replaces only
/// the hold it ends, so that one written late (after a failed try, while
/// another process kept a newer hold) ends nothing it should not.
async fn clock_hold_row_takes_an_end_only_of_its_own_hold(conn: &mut impl super::store::Store) {
    use super::clock::KeptHold;
    let t = |s: i64| Timestamp::from_second(1_800_000_000 + s).unwrap();
    let hold = |s: i64| KeptHold {
        stepped_to: t(s),
        expected: t(0),
        until: t(s + 21_600),
        ends: None,
    };
    let end = |s: i64, ends: i64| KeptHold {
        stepped_to: t(s),
        expected: t(s),
        until: t(s),
        ends: Some(t(ends)),
    };
    let plain = |k: KeptHold| KeptHold { ends: None, ..k };
    assert_eq!(conn.clock_hold().await.unwrap(), None);
    // An end with nothing kept keeps nothing.
    conn.keep_clock_hold(&end(10, 5)).await.unwrap();
    assert_eq!(conn.clock_hold().await.unwrap(), None);
    conn.keep_clock_hold(&hold(100)).await.unwrap();
    assert_eq!(conn.clock_hold().await.unwrap(), Some(hold(100)));
    conn.keep_clock_hold(&hold(200)).await.unwrap();
    // The end of the hold before: late, and of no effect.
    conn.keep_clock_hold(&end(300, 100)).await.unwrap();
    assert_eq!(conn.clock_hold().await.unwrap(), Some(hold(200)));
    conn.keep_clock_hold(&end(400, 200)).await.unwrap();
    assert_eq!(conn.clock_hold().await.unwrap(), Some(plain(end(400, 200))));
}

#[tokio::test]
async fn on_sqlite_the_clock_hold_row_takes_an_end_only_of_its_own_hold() {
    clock_hold_row_takes_an_end_only_of_its_own_hold(&mut fresh_db().await).await;
}

#[tokio::test]
async fn on_postgres_the_clock_hold_row_takes_an_end_only_of_its_own_hold() {
    use sqlx::{Connection, PgConnection};
    let db = FreshPostgres::new("clock_hold").await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    clock_hold_row_takes_an_end_only_of_its_own_hold(&mut conn).await;
    drop(conn);
    db.drop().await;
}

/// tally's connections run READ COMMITTED whatever the database's or the
/// role's default: a database set to SERIALIZABLE (or REPEATABLE READ)
/// failed reads with serialization errors, answered 500.
#[tokio::test]
async fn connections_run_read_committed_whatever_the_databases_default() {
    let db = FreshPostgres::new("isolation").await;
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let mut admin = super::postgres::connect(&db.url.parse().unwrap())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {name} SET default_transaction_isolation = 'serializable'"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    drop(admin);
    let isolation = async |options: &sqlx::postgres::PgConnectOptions| -> String {
        let mut conn = super::postgres::connect(options).await.unwrap();
        sqlx::query_scalar("SELECT current_setting('transaction_isolation')")
            .fetch_one(&mut conn)
            .await
            .unwrap()
    };
    assert_eq!(isolation(&db.url.parse().unwrap()).await, "serializable");
    let tallys =
        super::postgres::connect_options(&db.url, std::time::Duration::from_secs(2)).unwrap();
    assert_eq!(isolation(&tallys).await, "read committed");
    db.drop().await;
}

/// PostgreSQL's errors are told with their SQLSTATE, not with sqlx's
/// `at line N` (a line of the server's C source, which an operator took
/// for one of a migration's).
#[tokio::test]
async fn postgres_errors_are_told_with_their_sqlstate() {
    use sqlx::{Connection, PgConnection};
    let db = FreshPostgres::new("sqlstate").await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let e = sqlx::raw_sql("SELECT * FROM no_such_table")
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(e.to_string().contains(" at line "), "sqlx's own words: {e}");
    let told = super::postgres::error(e).to_string();
    assert_eq!(
        told,
        "database error: error returned from database: relation \"no_such_table\" does not \
         exist (SQLSTATE 42P01)"
    );
    drop(conn);
    db.drop().await;
}
