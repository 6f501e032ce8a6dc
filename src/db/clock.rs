//! Steps of the wall clock, seen against the process's monotonic clock.
//!
//! Days, retention and idempotency keys' ages go by the wall clock (the
//! host's on SQLite, the database server's on PostgreSQL), and two things
//! done by it cannot be undone: pruning a budget's usage older than its
//! retention, and forgetting expired keys. A clock stepped forward by more
//! than a budget's retention would prune the real days' usage (their calls
//! allowed again once the clock is set right), and one stepped past the
//! keys' lifetime would forget keys a retry still needs.
//!
//! So the writer reads every wall time its batches go by against its
//! monotonic clock, which no step moves: a reading more than [`STEP`] away
//! from where the last one, run on by the monotonic clock, says the wall
//! clock should be is a step. For [`HOLD`] after a step, or until the
//! clock is back in step, pruning and keys' ages count back from the
//! earlier of the two times (the clock as it reads, and where it would be
//! without the step), and a time zone's change deletes only days after the
//! later of them: what is kept meanwhile is only kept longer. A key is
//! never stamped earlier than where the clock would be without a step
//! ([`expected`]), so one stored while the clock is behind does not expire
//! early once it is set right. A clock that stays where it stepped to is
//! trusted after [`HOLD`]. A step before the process started, it cannot
//! see.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use jiff::{SignedDuration, Timestamp};

/// How far a reading may be from where the last one says the clock should
/// be before it counts as a step. Above what a PostgreSQL batch can lag
/// between reading the server's clock (at its transaction's start) and
/// deciding by it, and what a clock kept by NTP drifts from the monotonic
/// clock between two readings hours apart.
pub const STEP: Duration = Duration::from_secs(120);

/// How long pruning and forgetting keys wait after a step: time for NTP,
/// or an operator paged by `TallyClockStepped`, to set a wrong clock right.
pub const HOLD: Duration = Duration::from_secs(6 * 3600);

/// The times a batch's clean-ups may count by, read at `now`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trusted {
    /// What days before retention, and keys' ages, count back from: never
    /// later than the clock without a step.
    pub earliest: Timestamp,
    /// What a day after today is counted from: never earlier than the
    /// clock without a step.
    pub latest: Timestamp,
}

impl Trusted {
    fn plain(now: Timestamp) -> Self {
        Trusted {
            earliest: now,
            latest: now,
        }
    }
}

/// The writer's watch over its wall clock.
#[derive(Default)]
pub struct StepWatch(Mutex<Watched>);

#[derive(Default)]
struct Watched {
    /// The last reading in step: the wall clock then, and the monotonic.
    anchor: Option<(Timestamp, Instant)>,
    /// The last reading of all, in step or not: a second step during a
    /// hold is one from here.
    last: Option<(Timestamp, Instant)>,
    /// Since a step: until when it holds clean-ups back.
    held_until: Option<Instant>,
}

/// Where the wall clock read as `wall` at `at` should be at `mono`, run on
/// by the monotonic clock.
fn run_on((wall, at): (Timestamp, Instant), mono: Instant) -> Option<Timestamp> {
    let run = SignedDuration::try_from(mono.saturating_duration_since(at)).ok()?;
    wall.checked_add(run).ok()
}

/// How far `now` is from where the reading `from` says it should be, if
/// that is a step.
fn step_from(from: (Timestamp, Instant), now: Timestamp, mono: Instant) -> Option<SignedDuration> {
    let off = now.duration_since(run_on(from, mono).unwrap_or(now));
    (off.unsigned_abs() >= STEP).then_some(off)
}

impl StepWatch {
    /// Where the clock should be now, by the last reading in step.
    fn expected(&self) -> Option<Timestamp> {
        let w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        run_on(w.anchor?, Instant::now())
    }

    /// Reads `now` against the monotonic clock.
    pub fn read(&self, now: Timestamp) -> Trusted {
        self.read_at(now, Instant::now())
    }

    fn read_at(&self, now: Timestamp, mono: Instant) -> Trusted {
        // Poisoned only by a panic in here, with nothing half-changed.
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(anchor) = w.anchor else {
            w.anchor = Some((now, mono));
            w.last = w.anchor;
            return Trusted::plain(now);
        };
        let last = w.last.unwrap_or(anchor);
        w.last = Some((now, mono));
        match (w.held_until, step_from(anchor, now, mono)) {
            (None, None) => {}
            (Some(_), None) => {
                tracing::warn!("the wall clock is back in step: pruning and key expiry resume");
                w.held_until = None;
            }
            (None, Some(off)) => return w.step(off, anchor, now, mono),
            // Held: a second step (from the last reading) holds again.
            (Some(until), Some(_)) => match step_from(last, now, mono) {
                Some(off) => return w.step(off, anchor, now, mono),
                None if mono < until => return held(anchor, now, mono),
                None => {
                    tracing::warn!(
                        hours = HOLD.as_secs() / 3600,
                        "the wall clock stayed where it stepped: pruning and key expiry go by \
                         it again"
                    );
                    w.held_until = None;
                }
            },
        }
        w.anchor = Some((now, mono));
        Trusted::plain(now)
    }
}

impl Watched {
    /// A step of `off` seen at `now`: counted, logged, and held from here.
    fn step(
        &mut self,
        off: SignedDuration,
        anchor: (Timestamp, Instant),
        now: Timestamp,
        mono: Instant,
    ) -> Trusted {
        let direction = if off.is_negative() {
            "backward"
        } else {
            "forward"
        };
        metrics::counter!("tally_clock_steps_total", "direction" => direction).increment(1);
        tracing::warn!(
            direction,
            seconds = off.as_secs(),
            hold_hours = HOLD.as_secs() / 3600,
            "the wall clock stepped: pruning and key expiry count from the earlier of it and \
             where it would be without the step, until it is back in step or the hold ends"
        );
        self.held_until = Some(mono + HOLD);
        held(anchor, now, mono)
    }
}

/// The times a reading `now` during a hold may count by: it and where the
/// last reading in step says the clock should be.
fn held(anchor: (Timestamp, Instant), now: Timestamp, mono: Instant) -> Trusted {
    let expected = run_on(anchor, mono).unwrap_or(now);
    Trusted {
        earliest: now.min(expected),
        latest: now.max(expected),
    }
}

tokio::task_local! {
    /// The writer's watch, set around its batches and clean-ups: the rules
    /// (`budgets`, `keys`) read through [`trusted`] without every caller
    /// passing it down.
    static WATCH: Arc<StepWatch>;
}

/// Runs `f` with `watch` as the clock's watch.
pub fn watched<F: Future>(watch: Arc<StepWatch>, f: F) -> impl Future<Output = F::Output> {
    WATCH.scope(watch, f)
}

/// Where the writer's watch says the clock should be now: the last reading
/// in step, run on by the monotonic clock. `None` outside the writer, or
/// before its first reading.
pub fn expected() -> Option<Timestamp> {
    WATCH.try_with(|w| w.expected()).ok().flatten()
}

/// `now` read by the writer's watch; outside the writer (tests of the
/// rules, with times of their own) `now` as it is.
pub fn trusted(now: Timestamp) -> Trusted {
    WATCH
        .try_with(|w| w.read(now))
        .unwrap_or_else(|_| Trusted::plain(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn at(t0: Timestamp, secs: i64) -> Timestamp {
        t0 + SignedDuration::from_secs(secs)
    }

    fn plain(r: Trusted) -> bool {
        r.earliest == r.latest
    }

    #[test]
    fn a_clock_in_step_is_trusted_as_it_reads() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        // Each within a step of the last run on: 100 s ahead, then back.
        for (wall, mono) in [(0, 0), (60, 60), (3700, 3600), (7200, 7200)] {
            let r = w.read_at(at(t0, wall), m0 + Duration::from_secs(mono as u64));
            assert_eq!(r, Trusted::plain(at(t0, wall)), "at {wall} s by the wall");
        }
    }

    #[test]
    fn a_step_forward_holds_pruning_back_until_the_clock_is_back_in_step() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.read_at(t0, m0);
        // Ten days ahead, a minute later.
        let ahead = at(t0, 10 * 86_400 + 60);
        let r = w.read_at(ahead, m0 + MINUTE);
        assert_eq!((r.earliest, r.latest), (at(t0, 60), ahead));
        // Still ahead an hour later: the earliest time runs on with it.
        let r = w.read_at(at(ahead, 3600), m0 + MINUTE * 61);
        assert_eq!((r.earliest, r.latest), (at(t0, 3660), at(ahead, 3600)));
        // Set right: trusted again, and a step again if it jumps.
        let r = w.read_at(at(t0, 3720), m0 + MINUTE * 62);
        assert_eq!(r, Trusted::plain(at(t0, 3720)));
        assert!(!plain(w.read_at(at(t0, 7200), m0 + MINUTE * 63)));
    }

    #[test]
    fn a_step_back_holds_for_the_days_after_today() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.read_at(t0, m0);
        let behind = at(t0, -86_400);
        let r = w.read_at(behind, m0 + MINUTE);
        assert_eq!((r.earliest, r.latest), (behind, at(t0, 60)));
    }

    #[test]
    fn a_clock_that_stays_where_it_stepped_is_trusted_after_the_hold() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.read_at(t0, m0);
        let step = 30 * 86_400;
        assert!(!plain(w.read_at(at(t0, step), m0)));
        let hold = HOLD.as_secs() as i64;
        let second = Duration::from_secs(1);
        assert!(!plain(
            w.read_at(at(t0, step + hold - 1), m0 + HOLD - second)
        ));
        let r = w.read_at(at(t0, step + hold), m0 + HOLD);
        assert_eq!(r, Trusted::plain(at(t0, step + hold)));
        // The new clock is the anchor now.
        assert!(plain(
            w.read_at(at(t0, step + hold + 60), m0 + HOLD + MINUTE)
        ));
    }

    /// A step a hold is already on (a host resumed five minutes late,
    /// then a wrong time source ten days ahead) holds again from itself:
    /// before, the first step's hold ran out and the second was trusted.
    #[test]
    fn a_second_step_during_a_hold_holds_again() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.read_at(t0, m0);
        assert!(!plain(w.read_at(at(t0, 300), m0)));
        let later = HOLD - MINUTE;
        let hold = later.as_secs() as i64;
        assert!(!plain(w.read_at(at(t0, 300 + hold), m0 + later)));
        let wrong = at(t0, 300 + hold + 10 * 86_400);
        let r = w.read_at(wrong, m0 + later);
        assert_eq!((r.earliest, r.latest), (at(t0, hold), wrong));
        // Past the first step's hold, the second's still holds.
        let r = w.read_at(at(wrong, 120), m0 + later + MINUTE * 2);
        assert_eq!(r.earliest, at(t0, hold + 120));
    }

    #[test]
    fn small_steps_and_slow_drift_are_no_step() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.read_at(t0, m0);
        let under = STEP.as_secs() as i64 - 1;
        // Just under a step ahead, then, an hour on, just under one back.
        assert!(plain(w.read_at(at(t0, 60 + under), m0 + MINUTE)));
        let hour_on = at(t0, 60 + under + 3600 - under);
        assert!(plain(w.read_at(hour_on, m0 + MINUTE * 61)));
    }

    #[tokio::test]
    async fn the_rules_read_the_writers_watch_only_inside_its_scope() {
        let t0 = Timestamp::now();
        let watch = Arc::new(StepWatch::default());
        let ahead = at(t0, 86_400);
        let r = watched(Arc::clone(&watch), async move {
            trusted(t0);
            trusted(ahead)
        })
        .await;
        assert!(r.earliest < ahead);
        assert_eq!(trusted(ahead), Trusted::plain(ahead));
    }
}
