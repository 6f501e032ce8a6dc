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
/// (`RUST_LOG` syntax, default `info`); the format from `TALLY_LOG_FORMAT`
/// (`json` or `text`, default by whether stderr is a terminal).
pub fn init() {
    let mut filter =
        EnvFilter::try_from_env("TALLY_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // sqlx warns of a URL parameter it does not know with the parameter's
    // value, which can be a password (`sslpassword=...`).
    if let Ok(quiet) = "sqlx_postgres::options=error".parse() {
        filter = filter.add_directive(quiet);
    }
    let json = match std::env::var("TALLY_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => !std::io::stderr().is_terminal(),
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

    /// [`Self::admit`] at `now`, in ms since [`START`].
    fn admit_at(&self, now: u64) -> Option<u64> {
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
        self.held.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // The clock as it is: the first line of a new throttle is written.
        assert_eq!(Throttle::new(Duration::from_secs(10)).admit(), Some(0));
    }
}
