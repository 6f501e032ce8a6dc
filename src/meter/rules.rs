//! The rule of a budget check, as one pure function. The database applies
//! it both to a whole batch of checks at once and to one check at a time;
//! both call [`decide`], so the rule cannot drift between them.

use super::{Budget, Day, Decision, Reason};

/// A budget's calls on one day: one visitor's, and all visitors' together
/// (the global counter).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub visitor: i64,
    pub global: i64,
}

/// What one call does to its day.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub reason: Reason,
    /// The day's counts after the call.
    pub after: Counts,
    /// The call was the day's first to reach the global counter, or, when
    /// none has, a visitor's first (in a budget whose visitor limit is 0
    /// no call ever reaches it): it prunes the budget's usage past
    /// retention.
    pub first_of_day: bool,
}

/// Decides one call from the day's counts before it.
///
/// The visitor's count goes up first; a visitor over its limit is denied
/// without touching the global counter. Otherwise the global counter goes
/// up, and the call is denied if that puts it over the global limit.
/// Denied calls stay counted: a client that keeps calling while denied
/// keeps using its day's quota up, so hammering never buys a later
/// allowance.
pub fn decide(visitor_limit: u32, global_limit: u32, before: Counts) -> Step {
    let visitor = before.visitor.saturating_add(1);
    if visitor > i64::from(visitor_limit) {
        return Step {
            reason: Reason::VisitorLimit,
            after: Counts {
                visitor,
                global: before.global,
            },
            first_of_day: before == Counts::default(),
        };
    }
    let global = before.global.saturating_add(1);
    Step {
        reason: if global > i64::from(global_limit) {
            Reason::GlobalLimit
        } else {
            Reason::Ok
        },
        after: Counts { visitor, global },
        first_of_day: global == 1,
    }
}

impl Decision {
    /// The answer to a call on `budget` that took `step` on `day`.
    pub fn new(budget: &Budget, day: Day, step: Step, now: jiff::Timestamp) -> Self {
        Decision {
            reason: step.reason,
            day,
            visitor_calls: step.after.visitor,
            global_calls: step.after.global,
            visitor_limit: budget.spec.visitor_limit,
            global_limit: budget.spec.global_limit,
            pruned_rows: 0,
            timezone: budget.spec.timezone.clone(),
            decided_at: Some(now),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Random days of calls by a few visitors against random limits (0
    /// included): exactly the calls the limits allow are admitted, in
    /// order, and every call is counted.
    #[test]
    fn admits_exactly_what_the_limits_allow() {
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..2_000 {
            let (visitor_limit, global_limit) = (rng.u32(0..6), rng.u32(0..12));
            let visitors = rng.usize(1..5);
            let mut counts: HashMap<usize, i64> = HashMap::new();
            let mut global = 0;
            let (mut admitted, mut admitted_by) = (0, HashMap::<usize, u32>::new());
            let mut reached_global = 0;
            for call in 0..rng.usize(0..40) {
                let v = rng.usize(..visitors);
                let before = Counts {
                    visitor: counts.get(&v).copied().unwrap_or(0),
                    global,
                };
                let step = decide(visitor_limit, global_limit, before);
                // Every call counts for its visitor; the global counter
                // moves only for calls within the visitor's limit.
                assert_eq!(step.after.visitor, before.visitor + 1);
                let within_visitor = step.after.visitor <= i64::from(visitor_limit);
                assert_eq!(step.after.global, global + i64::from(within_visitor));
                assert_eq!(
                    step.first_of_day,
                    before.global == 0 && (within_visitor || before.visitor == 0),
                    "call {call}"
                );
                reached_global += u32::from(within_visitor);
                counts.insert(v, step.after.visitor);
                global = step.after.global;
                if step.reason == Reason::Ok {
                    admitted += 1;
                    *admitted_by.entry(v).or_default() += 1;
                }
                // Visitor first: a visitor over its limit is told so even
                // when the global limit is spent too.
                if !within_visitor {
                    assert_eq!(step.reason, Reason::VisitorLimit);
                }
            }
            assert!(admitted_by.values().all(|&n| n <= visitor_limit));
            assert_eq!(admitted, reached_global.min(global_limit));
        }
    }

    #[test]
    fn counts_saturate_instead_of_wrapping() {
        let step = decide(
            u32::MAX,
            u32::MAX,
            Counts {
                visitor: i64::MAX,
                global: i64::MAX,
            },
        );
        assert_eq!(step.reason, Reason::VisitorLimit);
        assert_eq!(step.after.visitor, i64::MAX);
    }
}
