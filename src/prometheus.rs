//! Prometheus metrics: the recorder, what every metric means, and the
//! numbers sampled at scrape time.
//!
//! Names follow Prometheus conventions: prefix `tally_`, base units
//! (`_seconds`, `_bytes`), `_total` for counters. Labels hold bounded sets
//! only: route templates (never raw paths), command kinds, budget names
//! (configured by the operator).

use std::{
    path::Path,
    sync::OnceLock,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::{db::Handle, meter::Reason};

/// Latency buckets, in seconds: from 100 µs (a cached read) to 10 s.
const SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];
/// Commands per batch, up to the largest sensible `TALLY_MAX_BATCH`.
const BATCH: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder (once; later calls return the same
/// handle) and describes every metric.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new().set_buckets(SECONDS).and_then(|b| {
                b.set_buckets_for_metric(Matcher::Full("tally_commit_batch_size".into()), BATCH)
            });
            let handle = match builder.map(|b| b.install_recorder()) {
                Ok(Ok(h)) => h,
                // Only a second global recorder can fail here, which this
                // OnceLock prevents; a recorder that renders nothing is the
                // safe fallback.
                _ => PrometheusBuilder::new().build_recorder().handle(),
            };
            describe();
            handle
        })
        .clone()
}

fn describe() {
    describe_counter!(
        "tally_http_requests_total",
        "HTTP requests answered, by route template and status."
    );
    describe_histogram!(
        "tally_http_request_duration_seconds",
        Unit::Seconds,
        "Time to answer an HTTP request, by route template."
    );
    describe_gauge!(
        "tally_write_queue_depth",
        "Commands waiting in the write queue."
    );
    describe_gauge!("tally_write_queue_capacity", "Capacity of the write queue.");
    describe_counter!(
        "tally_http_connection_errors_total",
        "Connections that ended with an error of hyper's, by listener and kind (malformed: a bare 400, or none to HTTP/2's preface, too_large: a bare 431 or 414, incomplete: the client closed before its answer, stalled: an answer the client took nothing of for the header timeout, other)."
    );
    describe_gauge!(
        "tally_write_batch_age_seconds",
        Unit::Seconds,
        "How long the writer has been on the batch it holds, or on its idle check of the database's files (0 between them); sampled at scrape."
    );
    describe_counter!(
        "tally_write_rejected_total",
        "Writes refused with 429 because the queue was full."
    );
    describe_counter!(
        "tally_write_refusal_pauses_total",
        "Refused writes that left tally's one core idle for a moment while a commit was late, so that the kernel could finish its flush (only when tally runs on one core, on SQLite)."
    );
    describe_gauge!(
        "tally_write_queue_closed",
        "1 once the write queue is closed (shutting down), else 0."
    );
    describe_counter!(
        "tally_write_commands_total",
        "Commands the writer finished, by command and result."
    );
    describe_histogram!(
        "tally_commit_duration_seconds",
        Unit::Seconds,
        "Time of each COMMIT, fsync included (for a batch of increments without idempotency keys, its whole transaction)."
    );
    describe_histogram!(
        "tally_commit_batch_size",
        Unit::Count,
        "Commands per committed transaction."
    );
    describe_histogram!(
        "tally_write_wait_seconds",
        Unit::Seconds,
        "From queueing a command to its reply."
    );
    describe_counter!(
        "tally_write_outcome_unknown_total",
        "Writes accepted whose outcome is unknown: the reply was lost, or the \
         database connection broke during COMMIT."
    );
    describe_gauge!(
        "tally_rows_held",
        "PostgreSQL: rows this process found held by another transaction past the lock \
         timeout and still takes for held (their writes are answered row-busy at once)."
    );
    describe_counter!(
        "tally_write_retries_total",
        "Batches run again after losing a race with another tally process \
         (PostgreSQL deadlock or serialization failure)."
    );
    describe_counter!(
        "tally_write_committed_caller_gone_total",
        "Writes that committed after their caller had gone."
    );
    describe_counter!(
        "tally_budget_prunes_total",
        "First calls of a day that deleted usage past retention."
    );
    describe_counter!(
        "tally_budget_pruned_rows_total",
        "Usage rows deleted, once committed: past retention (by a day's first call, a PUT, the writer's shares) and of deleted budgets (by the delete, the PUT creating one again, the writer's shares)."
    );
    describe_gauge!(
        "tally_budget_prunes_due",
        "Budgets whose usage past retention, or whose usage once deleted, the writer is still deleting a share at a time."
    );
    describe_counter!(
        "tally_clock_steps_total",
        "Steps of the wall clock the writer saw, by direction: each holds pruning and key expiry back."
    );
    describe_gauge!(
        "tally_db_size_bytes",
        Unit::Bytes,
        "Size of the database file."
    );
    describe_gauge!(
        "tally_db_wal_size_bytes",
        Unit::Bytes,
        "Size of the database's WAL file."
    );
    describe_gauge!(
        "tally_database_bytes",
        Unit::Bytes,
        "SQLite: disk space the database's files take (allocated blocks, as du counts them), by file: db, wal, shm. Measured about four times a second."
    );
    describe_gauge!(
        "tally_data_dir_bytes",
        Unit::Bytes,
        "SQLite: disk space the database's directory takes (allocated blocks, as du and the kubelet count them), Litestream's staging files included. Measured about four times a second."
    );
    describe_gauge!(
        "tally_database_free_bytes",
        Unit::Bytes,
        "SQLite: free pages inside the database file, which SQLite reuses before it grows the file."
    );
    describe_gauge!(
        "tally_storage_used_bytes",
        Unit::Bytes,
        "SQLite: what the storage limit measures: tally_data_dir_bytes, plus the database's pages not yet checkpointed into its file, less tally_database_free_bytes."
    );
    describe_gauge!(
        "tally_storage_limit_bytes",
        Unit::Bytes,
        "SQLite: the storage limit (TALLY_STORAGE_LIMIT); absent without one. Past it, writes that add data are answered 507."
    );
    describe_gauge!("tally_db_readers_in_use", "Read-only connections in use.");
    describe_gauge!("tally_db_readers_open", "Read-only connections open.");
    describe_gauge!(
        "tally_replica_wait_seconds",
        Unit::Seconds,
        "How long the startup gate waited for the first replica sync."
    );
    describe_gauge!(
        "tally_replica_txid",
        "Replicated transaction id Litestream confirmed at startup."
    );
    describe_gauge!(
        "tally_http_connections_open",
        "HTTP connections being served, by listener."
    );
    describe_gauge!(
        "tally_http_connections_max",
        "Most HTTP connections served at once, by listener (TALLY_MAX_CONNECTIONS for the API)."
    );
    describe_counter!(
        "tally_http_connections_refused_total",
        "Connections answered 503 too-many-connections and closed, by listener."
    );
    describe_counter!(
        "tally_http_header_timeouts_total",
        "Connections closed for sending no complete request header in time (idle keep-alive included), by listener."
    );
    describe_gauge!(
        "tally_database_new",
        "1 if this start created a new, empty database (nothing was there to open), else 0."
    );
    describe_gauge!(
        "tally_replica_up",
        "1 when the last question to Litestream's control socket was answered, else 0."
    );
    describe_gauge!(
        "tally_replica_local_txid",
        "Last transaction id Litestream has taken from the database."
    );
    describe_gauge!(
        "tally_replica_replicated_txid",
        "Last transaction id Litestream reports as held by the replica."
    );
    describe_gauge!(
        "tally_replica_lag_seconds",
        Unit::Seconds,
        "How long the replica has been behind: age of the oldest local transaction it lacks (from Litestream's last answer while it does not answer); 0 when caught up."
    );
    describe_counter!(
        "tally_replica_poll_errors_total",
        "Questions to Litestream's control socket that failed or timed out."
    );
    describe_gauge!(
        "tally_build_info",
        "Always 1; the labels say which build runs."
    );
    describe_gauge!(
        "tally_start_time_seconds",
        Unit::Seconds,
        "Start time of the process since the Unix epoch."
    );
}

/// Records the facts of this process that never change.
pub fn record_start(queue_capacity: usize, engine: &'static str) {
    gauge!("tally_build_info", "version" => env!("CARGO_PKG_VERSION"), "engine" => engine).set(1.0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    gauge!("tally_start_time_seconds").set(now.as_secs_f64());
    gauge!("tally_write_queue_capacity").set(queue_capacity as f64);
    gauge!("tally_write_queue_closed").set(0.0);
    gauge!("tally_budget_prunes_due").set(0.0);
    zero_known_series();
}

/// Exports every counter whose label sets are known in advance at 0, so
/// that its first event is an increase a rate or an alert can see, and a
/// dashboard shows 0 rather than "no data".
fn zero_known_series() {
    use metrics::counter;
    for name in [
        "tally_write_rejected_total",
        "tally_write_refusal_pauses_total",
        "tally_write_outcome_unknown_total",
        "tally_write_retries_total",
        "tally_budget_prunes_total",
        "tally_budget_pruned_rows_total",
        "tally_replica_poll_errors_total",
    ] {
        counter!(name).increment(0);
    }
    for &(command, results) in crate::db::WRITE_RESULTS {
        for &result in results {
            counter!("tally_write_commands_total", "command" => command, "result" => result)
                .increment(0);
        }
        counter!("tally_write_committed_caller_gone_total", "command" => command).increment(0);
    }
    for direction in ["forward", "backward"] {
        counter!("tally_clock_steps_total", "direction" => direction).increment(0);
    }
}

/// Samples what is cheaper to read when asked than to keep current: queue
/// depth, readers, file sizes.
pub fn sample(db: &Handle, path: Option<&Path>) {
    gauge!("tally_write_queue_depth").set(db.queue_depth() as f64);
    gauge!("tally_write_batch_age_seconds").set(db.batch_age().as_secs_f64());
    gauge!("tally_write_queue_closed").set(if db.accepts_writes() { 0.0 } else { 1.0 });
    let (open, busy) = db.readers_open_and_busy();
    gauge!("tally_db_readers_open").set(f64::from(open));
    gauge!("tally_db_readers_in_use").set(f64::from(busy));
    let Some(path) = path else { return };
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len() as f64).unwrap_or(0.0);
    gauge!("tally_db_size_bytes").set(size(path));
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    gauge!("tally_db_wal_size_bytes").set(size(Path::new(&wal)));
}

/// Drains histogram buffers now and then, so memory stays flat between
/// scrapes.
pub async fn upkeep(handle: PrometheusHandle, every: Duration) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        handle.run_upkeep();
    }
}

/// A label-less counter or histogram, registered on first use and then
/// kept: looking a metric up in the registry by its key, for every command,
/// costs more than the command's own bookkeeping. Use only after
/// [`install`] (the handle found first is kept for good).
#[macro_export]
macro_rules! kept {
    (counter $name:literal) => {{
        static KEPT: std::sync::LazyLock<metrics::Counter> =
            std::sync::LazyLock::new(|| metrics::counter!($name));
        &*KEPT
    }};
    (histogram $name:literal) => {{
        static KEPT: std::sync::LazyLock<metrics::Histogram> =
            std::sync::LazyLock::new(|| metrics::histogram!($name));
        &*KEPT
    }};
}

/// `tally_write_commands_total` of one command kind and result.
pub fn write_commands(kind: &'static str, result: &'static str) -> metrics::Counter {
    type Kept = std::collections::HashMap<(&'static str, &'static str), metrics::Counter>;
    static KEPT: std::sync::LazyLock<std::sync::RwLock<Kept>> =
        std::sync::LazyLock::new(Default::default);
    if let Some(c) = KEPT
        .read()
        .ok()
        .and_then(|k| k.get(&(kind, result)).cloned())
    {
        return c;
    }
    let c = metrics::counter!("tally_write_commands_total", "command" => kind, "result" => result);
    if let Ok(mut k) = KEPT.write() {
        k.insert((kind, result), c.clone());
    }
    c
}

/// `tally_budget_decisions_total`, kept here rather than in the recorder,
/// which cannot remove a series: a deleted budget's would stay for as long
/// as the process runs (5,000 budgets created, checked and deleted grew
/// `/metrics` from 47 KB to 437 KB). Rendered after the recorder's text
/// ([`render`]). A budget's series go when this process deletes it or
/// finds it gone; those of one another process deleted stay until then.
struct Decisions {
    /// Per budget, by [`Reason`] (as [`reason_index`] orders them).
    by_budget: std::sync::RwLock<std::collections::HashMap<Box<str>, Counts>>,
    /// Checks denied because the database failed, with an empty budget:
    /// whether the budget exists is unknown then, and bad input must not
    /// grow the labels.
    meter_error: std::sync::atomic::AtomicU64,
}

type Counts = std::sync::Arc<[std::sync::atomic::AtomicU64; 3]>;

static DECISIONS: std::sync::LazyLock<Decisions> = std::sync::LazyLock::new(|| Decisions {
    by_budget: Default::default(),
    meter_error: Default::default(),
});

const REASONS: [Reason; 3] = [Reason::Ok, Reason::VisitorLimit, Reason::GlobalLimit];

fn reason_index(reason: Reason) -> usize {
    match reason {
        Reason::Ok => 0,
        Reason::VisitorLimit => 1,
        Reason::GlobalLimit => 2,
    }
}

/// Counts one check of `budget` decided for `reason`. Budget names are
/// the operator's (a check of an unknown budget decides nothing). Without
/// `new`, only in series already there: a replayed answer may be of a
/// budget deleted since.
pub fn budget_decided(budget: &str, reason: Reason, new: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    let found = DECISIONS
        .by_budget
        .read()
        .ok()
        .and_then(|b| b.get(budget).cloned());
    let counts = match found {
        Some(c) => c,
        None if !new => return,
        None => match DECISIONS.by_budget.write() {
            Ok(mut b) => b.entry(budget.into()).or_default().clone(),
            Err(_) => return,
        },
    };
    counts[reason_index(reason)].fetch_add(1, Relaxed);
}

/// Counts one check denied because the database failed.
pub fn budget_meter_error() {
    DECISIONS
        .meter_error
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Drops `budget`'s series: deleted, or found gone.
pub fn budget_gone(budget: &str) {
    let known = DECISIONS
        .by_budget
        .read()
        .is_ok_and(|b| b.contains_key(budget));
    if known && let Ok(mut b) = DECISIONS.by_budget.write() {
        b.remove(budget);
    }
}

/// The recorder's text, then `tally_budget_decisions_total`'s.
pub fn render(handle: &PrometheusHandle) -> String {
    use std::{fmt::Write, sync::atomic::Ordering::Relaxed};
    let mut out = handle.render();
    let name = "tally_budget_decisions_total";
    let _ = write!(
        out,
        "# HELP {name} Budget check answers, by budget and reason.\n# TYPE {name} counter\n\
         {name}{{budget=\"\",reason=\"meter_error\"}} {}\n",
        DECISIONS.meter_error.load(Relaxed)
    );
    let mut budgets: Vec<(Box<str>, Counts)> = DECISIONS
        .by_budget
        .read()
        .map(|b| b.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    budgets.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (budget, counts) in budgets {
        for reason in REASONS {
            let n = counts[reason_index(reason)].load(Relaxed);
            // A name is `[A-Za-z0-9._:-]` (`Name`): nothing to escape.
            if n > 0 {
                let _ = writeln!(
                    out,
                    "{name}{{budget=\"{budget}\",reason=\"{}\"}} {n}",
                    reason.label()
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A budget's decisions are rendered by reason, only those that
    /// happened, and are gone once the budget is.
    #[test]
    fn a_budgets_decisions_go_with_it() {
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let series = |reason: &str| {
            format!(r#"tally_budget_decisions_total{{budget="unit-gone",reason="{reason}"}}"#)
        };
        budget_decided("unit-gone", Reason::Ok, true);
        budget_decided("unit-gone", Reason::Ok, false);
        budget_decided("unit-gone", Reason::GlobalLimit, true);
        let text = render(&handle);
        assert!(text.contains(&format!("{} 2\n", series("ok"))), "{text}");
        assert!(
            text.contains(&format!("{} 1\n", series("global_limit"))),
            "{text}"
        );
        assert!(!text.contains(&series("visitor_limit")), "{text}");
        assert_eq!(
            text.matches("# TYPE tally_budget_decisions_total").count(),
            1
        );
        budget_gone("unit-gone");
        assert!(!render(&handle).contains("unit-gone"));
        // A replay of an answer given before the budget went: not back.
        budget_decided("unit-gone", Reason::Ok, false);
        assert!(!render(&handle).contains("unit-gone"));
        budget_decided("unit-gone", Reason::VisitorLimit, true);
        let text = render(&handle);
        assert!(
            text.contains(&format!("{} 1\n", series("visitor_limit"))),
            "{text}"
        );
        assert!(!text.contains(&series("ok")), "{text}");
    }
}
