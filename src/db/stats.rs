//! Numbers the writer shares with handlers without taking a lock.

use std::{
    path::Path,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

/// Weight of the newest batch in the commit-rate average.
const RATE_ALPHA: f64 = 0.2;
/// Longest `Retry-After` tally ever asks for, in seconds.
pub const MAX_RETRY_AFTER_SECS: u64 = 30;

/// The writer's commit rate, which handlers read on every refused write.
#[derive(Debug, Default)]
pub struct QueueStats {
    /// Commands committed per second while the writer is busy, as an
    /// exponentially weighted average over batches; `f64` bits, 0 = unknown.
    rate_bits: AtomicU64,
    /// Set by the writer when the database files were deleted or replaced:
    /// why the queue closed, so that a write refused at the door hears the
    /// same answer as those the writer refused.
    storage_lost: OnceLock<Arc<Path>>,
}

impl QueueStats {
    /// Folds one batch (its size and how long it took to run and commit)
    /// into the commit rate. Only the writer calls this, so a plain
    /// load-then-store cannot lose an update.
    pub fn record_batch(&self, commands: usize, took: Duration) {
        let secs = took.as_secs_f64().max(1e-6);
        let sample = commands as f64 / secs;
        let old = self.commit_rate();
        let new = if old > 0.0 {
            RATE_ALPHA * sample + (1.0 - RATE_ALPHA) * old
        } else {
            sample
        };
        self.rate_bits.store(new.to_bits(), Ordering::Relaxed);
    }

    /// Records that the database files are gone (the first report wins).
    pub fn set_storage_lost(&self, path: Arc<Path>) {
        let _ = self.storage_lost.set(path);
    }

    /// The lost database file, once the writer has found it gone.
    pub fn storage_lost(&self) -> Option<&Arc<Path>> {
        self.storage_lost.get()
    }

    /// Commands per second the writer commits while busy; 0 before the
    /// first batch.
    pub fn commit_rate(&self) -> f64 {
        f64::from_bits(self.rate_bits.load(Ordering::Relaxed))
    }
}

/// Seconds a client refused for a full queue should wait: the time the
/// writer needs to work off the queue ahead of it at its recent commit rate,
/// rounded up, at least 1 and at most [`MAX_RETRY_AFTER_SECS`]. With no rate
/// measured yet, 1.
pub fn retry_after_secs(depth: usize, commit_rate: f64) -> u64 {
    if !(commit_rate.is_finite() && commit_rate > 0.0) {
        return 1;
    }
    let secs = (depth as f64 / commit_rate).ceil();
    (secs as u64).clamp(1, MAX_RETRY_AFTER_SECS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_formula() {
        // Unknown or nonsensical rates: the minimum.
        assert_eq!(retry_after_secs(1000, 0.0), 1);
        assert_eq!(retry_after_secs(1000, f64::NAN), 1);
        assert_eq!(retry_after_secs(1000, -5.0), 1);
        // A queue that drains within a second: 1.
        assert_eq!(retry_after_secs(1024, 50_000.0), 1);
        assert_eq!(retry_after_secs(0, 10.0), 1);
        // Rounded up.
        assert_eq!(retry_after_secs(1024, 1000.0), 2);
        assert_eq!(retry_after_secs(1000, 100.0), 10);
        assert_eq!(retry_after_secs(1001, 100.0), 11);
        // Capped.
        assert_eq!(retry_after_secs(1024, 1.0), MAX_RETRY_AFTER_SECS);
        assert_eq!(retry_after_secs(usize::MAX, 1e-300), MAX_RETRY_AFTER_SECS);
    }

    #[test]
    fn commit_rate_is_a_moving_average() {
        let s = QueueStats::default();
        assert_eq!(s.commit_rate(), 0.0);
        s.record_batch(100, Duration::from_millis(10)); // 10 000/s
        assert!((s.commit_rate() - 10_000.0).abs() < 1e-6);
        s.record_batch(10, Duration::from_millis(10)); // 1 000/s
        assert!((s.commit_rate() - 8_200.0).abs() < 1e-6);
        s.record_batch(1, Duration::ZERO); // never divides by zero
        assert!(s.commit_rate().is_finite());
    }
}
