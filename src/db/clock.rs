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
//! see; but a hold is kept in the database ([`KeptHold`]), and a process
//! started during one takes it over ([`StepWatch::start`]): a restart, or
//! on PostgreSQL a new replica, holds as the process that saw the step.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use jiff::{SignedDuration, Timestamp};

/// The wall clock as a timestamp, or why tally cannot go by it: before
/// 1970 (HTTP's `Date` cannot be written, and days before it are none a
/// budget keeps) or so close to the end of the year 9999 that a day, its
/// end and the window of days kept around it cannot all be told.
pub fn wall_clock() -> Result<Timestamp, String> {
    let latest = Timestamp::MAX - SignedDuration::from_hours(24 * 366);
    let now = std::time::SystemTime::now();
    let reads = match Timestamp::try_from(now) {
        Ok(t) if (Timestamp::UNIX_EPOCH..latest).contains(&t) => return Ok(t),
        Ok(t) => t.to_string(),
        Err(_) if now > std::time::UNIX_EPOCH => "a time past the year 9999".to_owned(),
        Err(_) => "a time before the year -9999".to_owned(),
    };
    Err(format!(
        "the wall clock reads {reads}, outside what tally can count days in (1970 to {}): set \
         the host's clock right",
        latest.strftime("%Y-%m-%d")
    ))
}

/// How far a reading may be from where the last one says the clock should
/// be before it counts as a step. Above what a PostgreSQL batch can lag
/// between reading the server's clock (at its transaction's start) and
/// deciding by it, and what a clock kept by NTP drifts from the monotonic
/// clock between two readings hours apart.
pub const STEP: Duration = Duration::from_secs(120);

/// The largest error of the clock no step is seen in: just under a
/// [`STEP`] from one reading to the next, and a clock that creeps, under a
/// step and the drift allowed on top of it (at most another step, see
/// [`DRIFT_PPM`]).
pub const UNSEEN: Duration = Duration::from_secs(2 * STEP.as_secs());

/// How far apart the wall clock and the monotonic clock may drift, in
/// parts per million of the time since the two were last found in step
/// (up to one [`STEP`] more), before the readings in between, each under a
/// step from the last, add up to a step (a time source that moves the
/// clock a little at a time, a clock that runs fast). Both clocks follow
/// NTP's rate corrections; a clock kept by nothing drifts by tens of parts
/// per million (at 100, a step in about four weeks: a hold, and the
/// alert).
pub const DRIFT_PPM: u32 = 1000;

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

    /// What a prune counts the days it deletes back from: [`earliest`]
    /// less [`UNSEEN`], so that a day is deleted only once it has been out
    /// of the window by more than an error of the clock that no step is
    /// seen in. Counted from the clock as it reads, a clock a little fast
    /// at a budget's midnight, set right, brought the day that midnight's
    /// first call had pruned back into the window, read empty (a visitor
    /// at its limit on that day allowed again). A first call of the day
    /// within [`UNSEEN`] of its midnight leaves the day the window left to
    /// the next day's first call: one more day stored, never read while
    /// outside the window. (Keys' ages count from [`earliest`] itself: a
    /// key's lifetime is to be set past the retries it is for by more
    /// than such an error, see `TALLY_IDEMPOTENCY_KEY_TTL`.)
    ///
    /// [`earliest`]: Trusted::earliest
    pub fn prune_from(&self) -> Timestamp {
        let unseen = SignedDuration::try_from(UNSEEN).unwrap_or(SignedDuration::ZERO);
        self.earliest.checked_sub(unseen).unwrap_or(self.earliest)
    }
}

/// A hold as the database keeps it, for a process started during it:
/// the reading that showed the step, where the clock would have been
/// without it, and when the hold ends by the stepped clock (a hold ended
/// early, the clock back in step, ends at the reading that saw it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeptHold {
    pub stepped_to: Timestamp,
    pub expected: Timestamp,
    pub until: Timestamp,
    /// An early end's: the hold it ends (its `stepped_to`), kept only while
    /// that hold is the one kept, so that an end written late (after a
    /// failed try) never ends a newer hold another process kept.
    pub ends: Option<Timestamp>,
}

/// The writer's watch over its wall clock.
#[derive(Default)]
pub struct StepWatch(Mutex<Watched>);

#[derive(Default, Clone)]
struct Watched {
    /// The last reading in step: the wall clock then, and the monotonic.
    anchor: Option<(Timestamp, Instant)>,
    /// The last reading of all, in step or not: a second step during a
    /// hold is one from here.
    last: Option<(Timestamp, Instant)>,
    /// Where the clocks were last found in step (the start, the end of a
    /// hold): readings each in step with the last add up to a step from
    /// here ([`crept_from`]).
    origin: Option<(Timestamp, Instant)>,
    /// Since a step: until when it holds clean-ups back.
    held_until: Option<Instant>,
    /// A hold begun or ended, for the database ([`StepWatch::to_keep`]).
    to_keep: Option<KeptHold>,
    /// The hold in effect, begun here or taken over: its `stepped_to`.
    holding: Option<Timestamp>,
    /// The hold the database keeps, for the first reading when the start
    /// had none ([`StepWatch::start`]).
    kept_at_start: Option<KeptHold>,
    /// The holds begun here (their `stepped_to`, in microseconds as the
    /// database keeps it), the latest few: a hold read late that is one of
    /// them is this process's own, ended or not, not one to take over.
    begun_here: Vec<i64>,
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

/// How far `now` is from where the clocks last found in step say it
/// should be, if that is more than a step and the drift allowed since
/// ([`DRIFT_PPM`]).
fn crept_from(
    origin: (Timestamp, Instant),
    now: Timestamp,
    mono: Instant,
) -> Option<SignedDuration> {
    let off = now.duration_since(run_on(origin, mono)?);
    // At most a step more: past that, a creeping clock would forget keys
    // early by the allowance (a day's uptime allows 86 s).
    let drift = (mono.saturating_duration_since(origin.1) / 1_000_000 * DRIFT_PPM).min(STEP);
    (off.unsigned_abs() >= STEP + drift).then_some(off)
}

impl StepWatch {
    /// The first reading, `now`, with the hold the database keeps: taken
    /// over if `now` is inside it, so that this process holds as the one
    /// that saw the step would (and takes the clock set right as back in
    /// step, not as a step of its own). Outside it (past its end, or before
    /// the time the clock stepped to: set right since) `now` is trusted.
    /// Whether it was taken over.
    /// With no reading (the clock could not be read), the first reading
    /// of a batch is the start.
    pub fn start(&self, now: Option<Timestamp>, kept: Option<KeptHold>) -> bool {
        match now {
            Some(now) => self.start_at(now, kept, Instant::now()),
            None => {
                self.0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .kept_at_start = kept;
                false
            }
        }
    }

    fn start_at(&self, now: Timestamp, kept: Option<KeptHold>, mono: Instant) -> bool {
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        w.start(now, kept, mono)
    }

    /// The hold the database keeps, read after the start because reading
    /// it then failed, with a reading `now` of the clock: taken over as
    /// [`Self::start`] takes it, unless this process has begun or taken
    /// over a hold of its own since (the newer word), or it is one this
    /// process began (ended since, its end not yet kept). When it is not
    /// taken over, nothing changes. Whether it was.
    pub fn start_late(&self, now: Timestamp, kept: Option<KeptHold>) -> bool {
        self.start_late_at(now, kept, Instant::now())
    }

    fn start_late_at(&self, now: Timestamp, kept: Option<KeptHold>, mono: Instant) -> bool {
        let Some(kept) = kept else { return false };
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if w.holding.is_some() || w.begun_here.contains(&kept.stepped_to.as_microsecond()) {
            return false;
        }
        if w.anchor.is_none() {
            // No reading yet: the first takes it over, as at the start.
            w.kept_at_start = Some(kept);
            return false;
        }
        let before = w.clone();
        let taken = w.start(now, Some(kept), mono);
        if !taken {
            *w = before;
        }
        taken
    }

    /// A hold begun or ended early since the last call, for the database
    /// to keep ([`KeptHold`]); taken once.
    pub fn to_keep(&self) -> Option<KeptHold> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .to_keep
            .take()
    }

    /// `hold` could not be kept: kept at the next try, unless a newer one
    /// has come since.
    pub fn keep_again(&self, hold: KeptHold) {
        let mut w = self.0.lock().unwrap_or_else(|e| e.into_inner());
        w.to_keep.get_or_insert(hold);
    }

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
            let kept = w.kept_at_start.take();
            return match w.start(now, kept, mono) {
                true => w.anchor.map_or(Trusted::plain(now), |a| held(a, now, mono)),
                false => Trusted::plain(now),
            };
        };
        let last = w.last.unwrap_or(anchor);
        w.last = Some((now, mono));
        match (w.held_until, step_from(anchor, now, mono)) {
            // In step with the last reading; steps under a step each, with
            // readings between them, may add up to one.
            (None, None) => {
                if let Some(origin) = w.origin
                    && let Some(off) = crept_from(origin, now, mono)
                {
                    w.anchor = Some(origin);
                    return w.step(off, origin, now, mono);
                }
            }
            (Some(_), None) => {
                tracing::warn!("the wall clock is back in step: pruning and key expiry resume");
                w.held_until = None;
                w.origin = Some((now, mono));
                w.to_keep = Some(KeptHold {
                    stepped_to: now,
                    expected: now,
                    until: now,
                    ends: w.holding.take(),
                });
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
                    w.holding = None;
                    w.origin = Some((now, mono));
                }
            },
        }
        w.anchor = Some((now, mono));
        Trusted::plain(now)
    }
}

impl Watched {
    /// See [`StepWatch::start`].
    fn start(&mut self, now: Timestamp, kept: Option<KeptHold>, mono: Instant) -> bool {
        self.last = Some((now, mono));
        self.anchor = self.last;
        self.origin = self.last;
        let Some(k) = kept else { return false };
        let stepped_from = k.stepped_to.checked_sub(STEP).unwrap_or(k.stepped_to);
        let left = Duration::try_from(k.until.duration_since(now)).unwrap_or_default();
        if now < stepped_from || left.is_zero() {
            return false;
        }
        let off = k.stepped_to.duration_since(k.expected);
        let Ok(expected) = now.checked_sub(off) else {
            return false;
        };
        self.anchor = Some((expected, mono));
        self.origin = self.anchor;
        self.holding = Some(k.stepped_to);
        self.held_until = Some(mono + left.min(HOLD));
        let direction = direction(off);
        metrics::counter!("tally_clock_steps_total", "direction" => direction).increment(1);
        tracing::warn!(
            direction,
            seconds = off.as_secs(),
            hold_minutes = left.min(HOLD).as_secs() / 60,
            "the wall clock stepped before this process started, as the database keeps: \
             pruning and key expiry count from the earlier of it and where it would be \
             without the step, until it is back in step or the hold ends"
        );
        true
    }

    /// A step of `off` seen at `now`: counted, logged, and held from here.
    fn step(
        &mut self,
        off: SignedDuration,
        anchor: (Timestamp, Instant),
        now: Timestamp,
        mono: Instant,
    ) -> Trusted {
        let direction = direction(off);
        metrics::counter!("tally_clock_steps_total", "direction" => direction).increment(1);
        tracing::warn!(
            direction,
            seconds = off.as_secs(),
            hold_hours = HOLD.as_secs() / 3600,
            "the wall clock stepped: pruning and key expiry count from the earlier of it and \
             where it would be without the step, until it is back in step or the hold ends"
        );
        self.held_until = Some(mono + HOLD);
        let trusted = held(anchor, now, mono);
        self.to_keep = Some(KeptHold {
            stepped_to: now,
            expected: run_on(anchor, mono).unwrap_or(now),
            until: now.checked_add(HOLD).unwrap_or(now),
            ends: None,
        });
        self.holding = Some(now);
        if self.begun_here.len() == 8 {
            self.begun_here.remove(0);
        }
        self.begun_here.push(now.as_microsecond());
        trusted
    }
}

/// A step's direction, as the metric and the log name it.
fn direction(off: SignedDuration) -> &'static str {
    if off.is_negative() {
        "backward"
    } else {
        "forward"
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

    /// A restart during a hold: the new process takes over the hold the
    /// database keeps, holds as the one that saw the step, and takes the
    /// clock set right as back in step (not as a step back of its own).
    #[test]
    fn a_process_started_during_a_hold_takes_it_over() {
        let (seen, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        seen.start_at(t0, None, m0);
        assert_eq!(seen.to_keep(), None);
        let ahead = at(t0, 10 * 86_400 + 60);
        seen.read_at(ahead, m0 + MINUTE);
        let kept = seen.to_keep().expect("a step is kept");
        assert_eq!(
            (kept.stepped_to, kept.expected),
            (ahead, at(t0, 60)),
            "{kept:?}"
        );
        assert_eq!(kept.until, ahead.checked_add(HOLD).unwrap());
        assert_eq!(seen.to_keep(), None, "taken once");

        // An hour later, by a new process's monotonic clock.
        let (next, m1) = (StepWatch::default(), m0 + MINUTE * 600);
        assert!(next.start_at(at(ahead, 3600), Some(kept), m1));
        let r = next.read_at(at(ahead, 3660), m1 + MINUTE);
        assert_eq!((r.earliest, r.latest), (at(t0, 3720), at(ahead, 3660)));
        assert_eq!(next.to_keep(), None, "taken over, not begun again");
        // Set right: back in step, and the end is kept.
        let right = at(t0, 3780);
        assert_eq!(next.read_at(right, m1 + MINUTE * 2), Trusted::plain(right));
        let ended = next.to_keep().expect("the end is kept");
        assert_eq!((ended.stepped_to, ended.until), (right, right));
        assert_eq!(
            ended.ends,
            Some(kept.stepped_to),
            "ends the hold taken over"
        );
        // A process started after that trusts the clock.
        let (last, m2) = (StepWatch::default(), m1 + MINUTE * 3);
        assert!(!last.start_at(at(right, 60), Some(ended), m2));
        assert!(plain(last.read_at(at(right, 120), m2 + MINUTE)));
    }

    /// A hold whose end has passed, or a clock read well before the time
    /// it stepped to (set right since, the end not kept: the process that
    /// saw it stopped first), is not taken over; the hold's rest is
    /// counted from its end as kept, never longer than a whole hold.
    #[test]
    fn a_kept_hold_is_taken_over_only_while_it_lasts() {
        let (t0, m0) = (Timestamp::now(), Instant::now());
        let kept = KeptHold {
            stepped_to: at(t0, 86_400),
            expected: t0,
            until: at(t0, 86_400 + HOLD.as_secs() as i64),
            ends: None,
        };
        let hold = HOLD.as_secs() as i64;
        let w = StepWatch::default();
        assert!(!w.start_at(at(t0, 86_400 + hold), Some(kept), m0));
        assert!(plain(w.read_at(at(t0, 86_400 + hold + 60), m0 + MINUTE)));
        let w = StepWatch::default();
        assert!(!w.start_at(at(t0, 600), Some(kept), m0));
        assert!(plain(w.read_at(at(t0, 660), m0 + MINUTE)));
        // Five hours into it: held for the hour left.
        let w = StepWatch::default();
        assert!(w.start_at(at(t0, 86_400 + 5 * 3600), Some(kept), m0));
        let hour = Duration::from_secs(3600);
        assert!(!plain(w.read_at(
            at(t0, 86_400 + 5 * 3600 + 3599),
            m0 + hour - Duration::from_secs(1)
        )));
        let r = w.read_at(
            at(t0, 86_400 + 6 * 3600 + 1),
            m0 + hour + Duration::from_secs(1),
        );
        assert_eq!(r, Trusted::plain(at(t0, 86_400 + 6 * 3600 + 1)));
    }

    /// A process whose read of the kept hold failed at its start, and
    /// that read it later: it takes it over then if the clock is still
    /// inside it, and changes nothing if not, or if it holds already.
    #[test]
    fn a_hold_read_late_is_taken_over_as_at_the_start() {
        let (t0, m0) = (Timestamp::now(), Instant::now());
        let ahead = at(t0, 10 * 86_400);
        let kept = KeptHold {
            stepped_to: ahead,
            expected: t0,
            until: ahead.checked_add(HOLD).unwrap(),
            ends: None,
        };
        // Started inside the hold without it: the stepped clock trusted.
        let w = StepWatch::default();
        w.start_at(at(ahead, 60), None, m0);
        assert!(plain(w.read_at(at(ahead, 120), m0 + MINUTE)));
        assert!(w.start_late_at(at(ahead, 180), Some(kept), m0 + MINUTE * 2));
        let r = w.read_at(at(ahead, 240), m0 + MINUTE * 3);
        assert_eq!((r.earliest, r.latest), (at(t0, 240), at(ahead, 240)));
        assert_eq!(w.to_keep(), None, "taken over, not begun again");
        assert!(!w.start_late_at(at(ahead, 300), Some(kept), m0 + MINUTE * 4));
        // Nothing kept, or a hold over: nothing changes (a step from the
        // last reading is still one).
        for late in [None, Some(KeptHold { until: t0, ..kept })] {
            let w = StepWatch::default();
            w.start_at(t0, None, m0);
            assert!(!w.start_late_at(at(t0, 600), late, m0 + MINUTE));
            // Ten minutes ahead a minute later is a step from the start,
            // as it was (from the late reading, it would be none).
            assert!(!plain(w.read_at(at(t0, 660), m0 + MINUTE * 2)));
        }
        // A hold of its own since the start is the newer word.
        let w = StepWatch::default();
        w.start_at(t0, None, m0);
        w.read_at(ahead, m0 + MINUTE);
        let own = w.to_keep().unwrap();
        assert!(!w.start_late_at(at(ahead, 60), Some(kept), m0 + MINUTE * 2));
        assert_eq!(w.to_keep(), None);
        let r = w.read_at(at(ahead, 120), m0 + MINUTE * 3);
        assert_eq!(r.earliest, at(own.expected, 120));
        // No reading yet: the first reading takes it over.
        let w = StepWatch::default();
        w.start(None, None);
        assert!(!w.start_late_at(at(ahead, 60), Some(kept), m0));
        let r = w.read_at(at(ahead, 120), m0 + MINUTE);
        assert!(!plain(r), "{r:?}");
    }

    #[test]
    fn a_hold_not_kept_is_kept_at_the_next_try_unless_a_newer_came() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.start_at(t0, None, m0);
        w.read_at(at(t0, 86_400), m0 + MINUTE);
        let first = w.to_keep().unwrap();
        w.keep_again(first);
        assert_eq!(w.to_keep(), Some(first));
        w.read_at(at(t0, 3 * 86_400), m0 + MINUTE * 2);
        let second = w.to_keep().unwrap();
        w.read_at(at(t0, 5 * 86_400), m0 + MINUTE * 3);
        let third = w.to_keep().unwrap();
        w.keep_again(third);
        w.keep_again(second);
        assert_eq!(w.to_keep(), Some(third));
    }

    /// Steps under a step each, with a reading between them, moved the
    /// clock by any amount unseen: each was compared with the last reading
    /// only. They add up to a step from where the clocks were last in
    /// step, which holds as one step would.
    #[test]
    fn steps_under_a_step_add_up_to_one() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.start_at(t0, None, m0);
        let second = Duration::from_secs(1);
        assert!(plain(w.read_at(at(t0, 101), m0 + second)));
        let r = w.read_at(at(t0, 202), m0 + second * 2);
        assert_eq!((r.earliest, r.latest), (at(t0, 2), at(t0, 202)));
        let kept = w.to_keep().expect("kept as a step");
        assert_eq!((kept.stepped_to, kept.expected), (at(t0, 202), at(t0, 2)));
        // On, a step's worth each time: still held from where it began.
        let r = w.read_at(at(t0, 303), m0 + second * 3);
        assert_eq!(r.earliest, at(t0, 3));
        // Set right: back in step, and in step from there.
        assert_eq!(
            w.read_at(at(t0, 4), m0 + second * 4),
            Trusted::plain(at(t0, 4))
        );
        assert!(plain(w.read_at(at(t0, 105), m0 + second * 5)));
    }

    /// A clock that runs fast, twice the monotonic clock's rate, read
    /// every ten seconds: held once it is a step ahead of where it began.
    /// A clock drifting at 500 parts per million for two days is not.
    #[test]
    fn a_clock_running_fast_is_a_step_once_it_is_a_step_ahead() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.start_at(t0, None, m0);
        let held = (1..=20)
            .find(|&i| !plain(w.read_at(at(t0, 20 * i), m0 + Duration::from_secs(10 * i as u64))))
            .expect("held");
        assert_eq!(held, 13, "first past a step (and the drift allowed) ahead");
        // 500 parts per million, read every hour for two days.
        let (w, hour) = (StepWatch::default(), Duration::from_secs(3600));
        w.start_at(t0, None, m0);
        for i in 1..=48 {
            let wall = at(t0, 3600 * i + 3600 * i / 2000);
            assert!(plain(w.read_at(wall, m0 + hour * i as u32)), "hour {i}");
        }
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

    /// The start's read of the kept hold failed; the process then saw a
    /// step back of its own, kept it, and saw the clock set right, the
    /// end's write failing. Read late, the hold it finds is its own, ended:
    /// not taken over again as a step made before the start.
    #[test]
    fn a_hold_read_late_is_not_the_processs_own_ended_hold() {
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.start_at(t0, None, m0);
        assert!(!plain(w.read_at(at(t0, 60 - 3600), m0 + MINUTE)));
        let own = w.to_keep().unwrap();
        assert_eq!(own.ends, None);
        assert!(
            plain(w.read_at(at(t0, 120), m0 + MINUTE * 2)),
            "back in step"
        );
        let end = w.to_keep().unwrap();
        w.keep_again(end);
        assert!(!w.start_late_at(at(t0, 180), Some(own), m0 + MINUTE * 3));
        assert!(plain(w.read_at(at(t0, 240), m0 + MINUTE * 4)));
        // Another process's hold, read late, is still taken over: the
        // clock stepped two days ahead a minute before this start.
        let (w, t0, m0) = (StepWatch::default(), Timestamp::now(), Instant::now());
        w.start_at(t0, None, m0);
        assert!(!plain(w.read_at(at(t0, 60 - 3600), m0 + MINUTE)));
        assert!(plain(w.read_at(at(t0, 120), m0 + MINUTE * 2)));
        let theirs = KeptHold {
            stepped_to: at(t0, -60),
            expected: at(t0, -60 - 2 * 86_400),
            until: at(t0, -60 + 6 * 3600),
            ends: None,
        };
        assert!(w.start_late_at(at(t0, 180), Some(theirs), m0 + MINUTE * 3));
    }
}
