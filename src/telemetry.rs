//! Structured logs: JSON lines when stderr is not a terminal (a log
//! pipeline), readable text when it is. Colours only on a terminal.

use std::{
    io::IsTerminal,
    sync::{
        LazyLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Installs the global subscriber. The filter comes from `TALLY_LOG`
/// (default `info`, see [`filter`]); the format from `TALLY_LOG_FORMAT`
/// (`json` or `text`, default by whether stderr is a terminal). A value
/// that cannot be used is an error: tally does not start with logs that
/// are not the ones asked for, or none at all.
pub fn init() -> Result<(), String> {
    let mut filter = match std::env::var("TALLY_LOG") {
        Err(std::env::VarError::NotPresent) => EnvFilter::new("info"),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err("TALLY_LOG is not UTF-8".to_owned());
        }
        Ok(spec) => filter(&spec).map_err(|e| format!("TALLY_LOG={spec:?}: {e}"))?,
    };
    // sqlx warns of a URL parameter it does not know with the parameter's
    // value, which can be a password (`sslpassword=...`).
    if let Ok(quiet) = "sqlx_postgres::options=error".parse() {
        filter = filter.add_directive(quiet);
    }
    let json = match std::env::var("TALLY_LOG_FORMAT") {
        Err(std::env::VarError::NotPresent) => !std::io::stderr().is_terminal(),
        Ok(f) if f == "json" => true,
        Ok(f) if f == "text" => false,
        _ => return Err("TALLY_LOG_FORMAT must be `json` or `text`".to_owned()),
    };
    // Escape sequences are for a terminal to draw; in a file or a log
    // pipeline they are noise in every line. NO_COLOR (no-color.org) turns
    // them off on a terminal too.
    let colours = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        registry
            .with(
                fmt::layer()
                    .json()
                    .with_ansi(false)
                    .with_writer(std::io::stderr),
            )
            .init();
    } else {
        registry
            .with(fmt::layer().with_ansi(colours).with_writer(std::io::stderr))
            .init();
    }
    Ok(())
}

/// An error and its causes, as `{:#}` writes them, but without a cause
/// its error already wrote: errors that show their source in their own
/// text (sqlx's, and tally's that wrap them) would otherwise repeat it,
/// the root cause three times over.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if text.is_empty() {
            text = said;
        } else if !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
    }
    text
}

/// The levels a filter may name.
const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

/// `TALLY_LOG`, read strictly: comma-separated directives, each a level
/// (`warn`) or `target=level` (`tally::request=debug`). `RUST_LOG`'s
/// syntax also takes a bare word as a target to log at every level, which
/// turns a misspelt level (`warning`) into a filter that writes nothing,
/// errors included; and an unparsable filter would fall back to another.
/// Both are refused here.
pub fn filter(spec: &str) -> Result<EnvFilter, String> {
    let directives: Vec<&str> = spec
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if directives.is_empty() {
        return Err("no directive: give a level (`info`), or leave TALLY_LOG unset".to_owned());
    }
    for d in &directives {
        let (target, level) = match d.rsplit_once('=') {
            Some((target, level)) => (Some(target), level),
            None => (None, *d),
        };
        if !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level)) {
            return Err(format!(
                "`{d}` names no level: each directive is a level ({}) or target=level",
                LEVELS.join(", ")
            ));
        }
        let target_ok = |t: &str| {
            !t.is_empty()
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_:-.".contains(&b))
        };
        if target.is_some_and(|t| !target_ok(t)) {
            return Err(format!(
                "`{d}`: a target is a module path such as `tally::request`"
            ));
        }
    }
    EnvFilter::builder()
        .parse(directives.join(","))
        .map_err(|e| e.to_string())
}

/// At most one log line per period from one place in the code, with how
/// many it held back. A failure that lasts (a table renamed under tally, a
/// role's rights revoked) fails every request, and a line for each would
/// flood the log at the request rate; every failed request is still
/// counted in the metrics, by route and status.
pub struct Throttle {
    every_ms: u64,
    /// When the next line may be written, in ms since [`START`].
    next_ms: AtomicU64,
    /// Lines held back since the last one written.
    held: AtomicU64,
}

static START: LazyLock<Instant> = LazyLock::new(Instant::now);

impl Throttle {
    pub const fn new(every: Duration) -> Self {
        Self {
            every_ms: every.as_millis() as u64,
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when a line may be
    /// written now; `None` (and one more held back) when not.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(START.elapsed().as_millis() as u64)
    }

    /// [`Self::admit`] for a line held back before and asked for again
    /// (an outage whose start was held back, still going on): a refusal
    /// holds back no further line, and the lines held back it answers
    /// leave out its own.
    pub fn admit_held(&self) -> Option<u64> {
        self.admit_held_at(START.elapsed().as_millis() as u64)
    }

    /// The lines held back and never told, once a line may be written
    /// (`Some(n)`, n > 0; the count starts again): for a place whose
    /// failures have stopped, so that the last of them held back are told
    /// too. `None` while none is held back or the period runs.
    pub fn untold(&self) -> Option<u64> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.due_at(START.elapsed().as_millis() as u64)
            .filter(|&held| held > 0)
    }

    fn admit_held_at(&self, now: u64) -> Option<u64> {
        self.due_at(now).map(|held| held.saturating_sub(1))
    }

    /// [`Self::admit`] at `now`, in ms since [`START`].
    fn admit_at(&self, now: u64) -> Option<u64> {
        let admitted = self.due_at(now);
        if admitted.is_none() {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
        admitted
    }

    /// `Some(lines held back)` if a line may be written at `now`, which
    /// it then is.
    fn due_at(&self, now: u64) -> Option<u64> {
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now + self.every_ms,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.held.swap(0, Ordering::Relaxed));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open {path}: {source}")]
    struct Shows {
        path: &'static str,
        source: std::io::Error,
    }

    #[test]
    fn an_error_says_each_cause_once() {
        let full = || std::io::Error::other("database or disk is full");
        // A cause shown in its error's own text, then wrapped by context.
        let e = anyhow::Error::new(Shows {
            path: "tally.db",
            source: full(),
        })
        .context("serving");
        assert_eq!(
            error_text(&e),
            "serving: cannot open tally.db: database or disk is full"
        );
        // Causes not shown in their error's text are all kept, as `{:#}`.
        let e = anyhow::Error::new(full())
            .context("opening")
            .context("serving");
        assert_eq!(error_text(&e), format!("{e:#}"));
    }

    #[test]
    fn a_throttle_writes_one_line_a_period_and_counts_the_rest() {
        let t = Throttle::new(Duration::from_secs(10));
        assert_eq!(t.admit_at(0), Some(0), "the first line is written");
        for ms in [1, 5_000, 9_999] {
            assert_eq!(t.admit_at(ms), None);
        }
        assert_eq!(
            t.admit_at(10_000),
            Some(3),
            "the next says how many it held back"
        );
        assert_eq!(t.admit_at(10_001), None);
        assert_eq!(t.admit_at(25_000), Some(1));
        assert_eq!(t.admit_at(25_000), None);
        // A line held back (at 25 s, above) asked for again: no more held
        // back while it waits, and written in its period, not counted.
        for ms in [25_001, 30_000, 34_999] {
            assert_eq!(t.admit_held_at(ms), None);
        }
        assert_eq!(t.admit_at(34_999), None);
        assert_eq!(t.admit_held_at(35_000), Some(1), "the one at 34.999 s");
        assert_eq!(t.admit_at(45_000), Some(0));
        // The clock as it is: the first line of a new throttle is written.
        assert_eq!(Throttle::new(Duration::from_secs(10)).admit(), Some(0));
    }

    /// A filter that would log nothing, or something else than asked, is
    /// refused; what `RUST_LOG` users write for levels and targets is
    /// taken, white space around directives included.
    #[test]
    fn a_log_filter_is_a_level_or_target_level_pairs() {
        for ok in [
            "info",
            "WARN",
            "off",
            "debug ",
            "warn,tally=debug",
            "info, tally::request=debug ,sqlx=warn",
            "info,,tally=trace",
            "tally-bench=info",
        ] {
            assert!(filter(ok).is_ok(), "{ok:?}: {:?}", filter(ok).err());
        }
        for (bad, why) in [
            ("", "no directive"),
            (" , ", "no directive"),
            ("warning", "names no level"),
            ("err", "names no level"),
            ("tally", "names no level"),
            ("warn,tally=loud", "names no level"),
            ("info;sqlx=warn", "module path"),
            ("=info", "module path"),
            ("a=b=info", "module path"),
            ("tally[span]=debug", "module path"),
        ] {
            let e = filter(bad).err().unwrap_or_else(|| panic!("{bad:?} taken"));
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
