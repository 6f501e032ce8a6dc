//! Numbers the writer shares with handlers without taking a lock.

use std::{
    path::Path,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

/// Weight of the newest batch in the commit-rate average.
const RATE_ALPHA: f64 = 0.2;
/// Longest `Retry-After` tally ever asks for, in seconds.
pub const MAX_RETRY_AFTER_SECS: u64 = 30;

/// Writes waiting (the newest included) at which, when tally runs on one
/// core, a handler gives that core to the writer's threads (see
/// [`QueueStats::yield_to_writer`]): a batch this large spreads a commit's
/// fixed cost (measured at about 185 us of CPU, some fourteen answers'
/// worth) thin.
const YIELD_AT_QUEUED: usize = 24;

/// A commit during which the process kept its core busy less than this
/// share of the commit's wall time left the core idle.
const IDLE_BELOW: f64 = 0.9;

/// The ages of a commit in this process at which a refused write leaves
/// the core idle for a moment (see [`QueueStats::pause_refusal`]), in us:
/// under a flood of refusals a batch's transaction normally takes 0.7-1.0
/// ms on one core, and 1.2-4.3 ms while its flush is held up. Past the
/// upper bound the commit waits for something a pause cannot help (a
/// frozen disk), and refusals only yield.
const LATE_COMMIT_US: std::ops::Range<u64> = 1_500..20_000;

/// What such a refusal asks to sleep. With the kernel's default timer
/// slack (50 us) and the wake-up it lasts about 135 us. (Asking for the
/// shortest sleep, 50-100 us in effect, from 2 ms, left runs in a middle
/// state: 5 of 18, with about 10% fewer writes and a median write 3.5
/// times slower.)
pub const REFUSAL_PAUSE: Duration = Duration::from_micros(50);

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
    /// Set by the writer when the core went idle during its last commit
    /// (only when tally runs on one core and commits in this process).
    core_idled: AtomicBool,
    /// When the writer took the batch it is on, in ms since [`EPOCH`] plus
    /// one; 0 between batches.
    batch_taken: AtomicU64,
    /// When the transaction in flight began, in us since [`EPOCH`] plus
    /// one, while a [`CommitClock`] times it (tally on one core, the
    /// engine committing in this process); 0 otherwise.
    commit_began: AtomicU64,
    /// The millisecond since [`EPOCH`], plus one, in which a refused write
    /// last left the core idle (see [`QueueStats::pause_refusal`]); 0 =
    /// never.
    refusal_paused: AtomicU64,
    /// Batches the writer slowed by the test hook has taken: a test in the
    /// same process knows from it that the writer holds one.
    #[cfg(feature = "test-hooks")]
    pub(crate) batches_held: std::sync::atomic::AtomicUsize,
}

/// What [`QueueStats::batch_taken`] counts from.
static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

/// The process's CPU time and the wall clock at a commit's start.
pub struct CommitClock {
    cpu: Duration,
    wall: Instant,
}

impl CommitClock {
    /// Starts timing a commit, when tally runs on one core (its CPU
    /// affinity holds one); elsewhere the commit's threads do not share a
    /// core with the HTTP threads, and there is nothing to time.
    fn start() -> Option<Self> {
        if !pinned_to_one_core() {
            return None;
        }
        Some(Self {
            cpu: process_cpu()?,
            wall: Instant::now(),
        })
    }
}

impl QueueStats {
    /// The writer took a batch (`true`), or is done with it and its
    /// clean-up (`false`).
    pub fn set_on_batch(&self, on: bool) {
        let at = match on {
            true => EPOCH.elapsed().as_millis() as u64 + 1,
            false => 0,
        };
        self.batch_taken.store(at, Ordering::Relaxed);
    }

    /// How long the writer has been on the batch it holds; zero between
    /// batches. A writer stuck on one (a flush that never returns, a lock
    /// held elsewhere) shows here while everything else it would update
    /// stands still.
    pub fn batch_age(&self) -> Duration {
        match self.batch_taken.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            at => EPOCH
                .elapsed()
                .saturating_sub(Duration::from_millis(at - 1)),
        }
    }

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

    /// Starts timing a transaction the writer is about to run in this
    /// process, when tally runs on one core ([`CommitClock::start`]); hand
    /// the clock back to [`Self::record_commit_cpu`] when it is done.
    pub fn begin_commit(&self) -> Option<CommitClock> {
        let clock = CommitClock::start()?;
        self.commit_began
            .store(micros_since(EPOCH.elapsed()) + 1, Ordering::Relaxed);
        Some(clock)
    }

    /// Records whether the core went idle during the commit `clock` timed
    /// (left as it was if the process's CPU time cannot be read).
    pub fn record_commit_cpu(&self, clock: CommitClock) {
        self.commit_began.store(0, Ordering::Relaxed);
        if let Some(now) = process_cpu() {
            let cpu = now.saturating_sub(clock.cpu);
            self.core_idled
                .store(idled(cpu, clock.wall.elapsed()), Ordering::Relaxed);
        }
    }

    /// Whether a handler that has just queued a write, `queued` now
    /// waiting, should give up its core to the writer's threads.
    ///
    /// With tally on one core, the HTTP thread, once it runs, answers a
    /// finished batch and reads the next requests for up to a time slice
    /// (0.7-0.9 ms measured) while the next batch's statement waits for the
    /// core; that batch's flush then runs with the core idle, the HTTP work
    /// done. So once a batch worth committing waits, and only if the core
    /// idled during the last commit, the handler yields, and the commit and
    /// its flush start while the HTTP thread still has requests to read
    /// (measured +6-17% of durable writes at 64 connections). Where the
    /// core stayed busy through the last commit (more connections), a yield
    /// would only shrink batches, and the flag is off. Answers, their order
    /// and durability do not change; a yield delays, by the writer's turn
    /// on the core, what else the HTTP thread was about to do.
    pub fn yield_to_writer(&self, queued: usize) -> bool {
        queued >= YIELD_AT_QUEUED && self.core_idled.load(Ordering::Relaxed)
    }

    /// Whether a write refused for a full queue should sleep for
    /// [`REFUSAL_PAUSE`], leaving the core idle, instead of only giving up
    /// its turn.
    ///
    /// With tally on one core and clients that send their next write the
    /// moment their `429` arrives, the HTTP thread can answer refusals with
    /// the core never idle. The kernel's block-layer worker bound to that
    /// core (`kworker/N:*H-kblockd`, which passes part of a commit's flush
    /// to the disk) then waited for the core for most of the wall time
    /// although it needed about 1% of it, even with every refusal giving up
    /// its thread's turn (the yields did not give it the core): each flush
    /// took 2-4 ms instead of 0.4, the queue stayed full and the refusals
    /// kept the core until the end of the load. Measured with 512 such
    /// connections and a queue of 64, in 19 runs of 43 (and 8 of 34 on
    /// another day). Sleeping is what leaves the core to that worker; so
    /// while a transaction of this process's own ([`Self::begin_commit`]:
    /// SQLite, whose flush runs on this core) has run for 1.5 to 20 ms
    /// ([`LATE_COMMIT_US`]), one refusal in each millisecond of the clock
    /// sleeps: 1 run of 19 fell behind, part of the way, with 67-151
    /// pauses a second (from 2 ms, 4 of 43; see docs/performance.md).
    /// The sleep holds up whatever else the HTTP thread was about to do,
    /// by about 135 us, at most once a millisecond (13% of the time at
    /// most, for as long as a commit stays within those bounds). Every
    /// refusal is still a `429`.
    pub fn pause_refusal(&self) -> bool {
        let began = self.commit_began.load(Ordering::Relaxed);
        began != 0 && self.refusal_pause_due(began, micros_since(EPOCH.elapsed()))
    }

    /// [`Self::pause_refusal`]'s rule: a commit that began at `began` (us
    /// since [`EPOCH`], plus one), at `now` (us since [`EPOCH`]); it takes
    /// the millisecond `now` is in, if no refusal took it yet.
    fn refusal_pause_due(&self, began: u64, now: u64) -> bool {
        if !LATE_COMMIT_US.contains(&now.saturating_sub(began - 1)) {
            return false;
        }
        let slot = now / 1_000 + 1;
        let last = self.refusal_paused.load(Ordering::Relaxed);
        slot > last
            && self
                .refusal_paused
                .compare_exchange(last, slot, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
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

/// Whether a commit that took `wall` while the process used `cpu` left
/// the core idle.
fn idled(cpu: Duration, wall: Duration) -> bool {
    cpu.as_secs_f64() < IDLE_BELOW * wall.as_secs_f64()
}

/// Whether tally's CPU affinity holds a single core (as `taskset -c N` or
/// a CPU manager's exclusive core sets it), read once. A CPU quota is not
/// counted: under a quota the threads still run on several cores at once.
fn pinned_to_one_core() -> bool {
    static ONE: OnceLock<bool> = OnceLock::new();
    *ONE.get_or_init(|| {
        nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).is_ok_and(|set| {
            (0..nix::sched::CpuSet::count())
                .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
                .count()
                == 1
        })
    })
}

/// `d` in whole microseconds.
fn micros_since(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// CPU time of the whole process (every thread) so far.
fn process_cpu() -> Option<Duration> {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .ok()
        .map(Duration::from)
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
    fn yields_only_after_an_idle_commit_and_with_a_batch_waiting() {
        let s = QueueStats::default();
        // Nothing measured yet: never.
        assert!(!s.yield_to_writer(YIELD_AT_QUEUED * 10));
        // A commit that took 50 ms of wall time while this test used next
        // to no CPU: the core idled.
        let clock = CommitClock {
            cpu: process_cpu().expect("the process's CPU clock"),
            wall: Instant::now() - Duration::from_millis(50),
        };
        s.record_commit_cpu(clock);
        assert!(!s.yield_to_writer(YIELD_AT_QUEUED - 1));
        assert!(s.yield_to_writer(YIELD_AT_QUEUED));
        // A commit during which the process used more CPU than wall time
        // (several threads busy): the core did not idle.
        let clock = CommitClock {
            cpu: Duration::ZERO,
            wall: Instant::now(),
        };
        s.record_commit_cpu(clock);
        assert!(!s.yield_to_writer(YIELD_AT_QUEUED * 10));
    }

    #[test]
    fn a_refusal_pauses_only_on_a_late_commit_and_once_a_millisecond() {
        let s = QueueStats::default();
        // No commit timed (between commits, on PostgreSQL, or tally not on
        // one core): never.
        assert!(!s.pause_refusal());
        // A commit that began at 100.5 ms (stored plus one).
        let began = 100_500 + 1;
        // 1.499 ms into it: not late.
        assert!(!s.refusal_pause_due(began, 101_999));
        // 1.5 ms: one refusal pauses; the next in the same millisecond of
        // the clock does not; one in the next millisecond does.
        assert!(s.refusal_pause_due(began, 102_000));
        assert!(!s.refusal_pause_due(began, 102_999));
        assert!(s.refusal_pause_due(began, 103_000));
        // An earlier reading, from a thread that lost the race: no.
        assert!(!s.refusal_pause_due(began, 102_800));
        // 19.999 ms into it: still; 20 ms and on, a commit a pause cannot
        // help: never again.
        assert!(s.refusal_pause_due(began, 120_499));
        assert!(!s.refusal_pause_due(began, 120_500));
        assert!(!s.refusal_pause_due(began, 10_000_000));
        // A commit timed and done: none in flight.
        s.commit_began.store(began, Ordering::Relaxed);
        s.record_commit_cpu(CommitClock {
            cpu: Duration::ZERO,
            wall: Instant::now(),
        });
        assert!(!s.pause_refusal());
    }

    #[test]
    fn one_refusal_of_many_at_once_pauses() {
        let s = QueueStats::default();
        // A commit that began at 0: 3 to 17 ms into it, a millisecond at
        // a time.
        let began = 1;
        for ms in 0..15u64 {
            let now = 3_000 + ms * 1_000;
            let paused = std::sync::atomic::AtomicUsize::new(0);
            std::thread::scope(|scope| {
                for _ in 0..8 {
                    scope.spawn(|| {
                        for _ in 0..50 {
                            if s.refusal_pause_due(began, now) {
                                paused.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            assert_eq!(paused.into_inner(), 1, "millisecond {ms}");
        }
    }

    #[test]
    fn an_idle_core_is_one_busy_less_than_nine_tenths_of_a_commit() {
        let ms = Duration::from_millis;
        assert!(idled(ms(5), ms(10)));
        assert!(idled(ms(0), ms(10)));
        assert!(!idled(Duration::from_micros(9_100), ms(10)));
        assert!(!idled(ms(12), ms(10)));
        // A commit too short to measure is not idle.
        assert!(!idled(Duration::ZERO, Duration::ZERO));
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
