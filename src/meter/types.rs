use std::{fmt, str::FromStr};

use jiff::{
    Timestamp,
    civil::Date,
    tz::{TimeZone, TimeZoneDatabase},
};
use serde::{Deserialize, Serialize};

use super::Refusal;

/// Why an input was refused; the text is shown to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidInput(pub String);

/// A counter or budget name: 1 to 128 characters of `[A-Za-z0-9._:-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct Name(String);

impl Name {
    pub const MAX_LEN: usize = 128;

    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(InvalidInput(format!(
                "a name must be 1 to {} characters long",
                Self::MAX_LEN
            )));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
        {
            return Err(InvalidInput(format!(
                "a name may hold only letters, digits and `._:-`, not {c:?}"
            )));
        }
        Ok(Self(s.to_owned()))
    }
}

/// Who is calling a budget: 1 to 256 characters, no control characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct VisitorId(String);

impl VisitorId {
    pub const MAX_LEN: usize = 256;

    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let chars = s.chars().count();
        if chars == 0 || chars > Self::MAX_LEN {
            return Err(InvalidInput(format!(
                "a visitor id must be 1 to {} characters long",
                Self::MAX_LEN
            )));
        }
        if s.chars().any(char::is_control) {
            return Err(InvalidInput(
                "a visitor id must not contain control characters".into(),
            ));
        }
        Ok(Self(s.to_owned()))
    }
}

/// A client's idempotency key: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub const MAX_LEN: usize = 255;

    /// Parses the `Idempotency-Key` field value: a structured-field string
    /// (`"..."`), or the bare characters.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let s = s.trim();
        let inner = s
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix('"'))
            .unwrap_or(s);
        if inner.is_empty() || inner.len() > Self::MAX_LEN {
            return Err(InvalidInput(format!(
                "an Idempotency-Key must be 1 to {} characters long",
                Self::MAX_LEN
            )));
        }
        if !inner
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
        {
            return Err(InvalidInput(
                "an Idempotency-Key may hold only visible ASCII characters, no quotes or backslashes"
                    .into(),
            ));
        }
        Ok(Self(inner.to_owned()))
    }
}

/// A calendar day, written `YYYY-MM-DD` everywhere (API and database), so
/// that days sort as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Day(Date);

impl Day {
    /// The day `now` falls on in `tz`.
    pub fn today_at(tz: &TimeZone, now: Timestamp) -> Self {
        Self(now.to_zoned_datetime(tz.clone()).date())
    }

    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let bad = || InvalidInput(format!("`{s}` is not a day of the form YYYY-MM-DD"));
        let b = s.as_bytes();
        let shape_ok = b.len() == 10
            && b.iter().enumerate().all(|(i, c)| {
                if i == 4 || i == 7 {
                    *c == b'-'
                } else {
                    c.is_ascii_digit()
                }
            });
        if !shape_ok {
            return Err(bad());
        }
        let date = Date::from_str(s).map_err(|_| bad())?;
        if date.year() < 1 {
            return Err(bad());
        }
        Ok(Self(date))
    }

    /// The day `days` before this one, saturating at the earliest date.
    pub fn minus_days(self, days: u32) -> Self {
        let earliest = jiff::civil::date(1, 1, 1);
        // A span holds at most about 7.3 million days (`Span::days` panics
        // past it): any more reach back past the earliest date anyway.
        let Ok(span) = jiff::Span::new().try_days(i64::from(days)) else {
            return Self(earliest);
        };
        Self(self.0.checked_sub(span).unwrap_or(earliest).max(earliest))
    }

    /// `YYYY-MM-DD` written digit by digit into `buf`: every check writes
    /// its day two or three times (the usage rows' keys, the answer), and
    /// the formatting machinery cost more than the rest of the conversion.
    /// `None` for a year outside 0..=9999 (tally keeps no such day), which
    /// the callers write with `write!` instead.
    fn iso_text(self, buf: &mut [u8; 10]) -> Option<&str> {
        let year = u16::try_from(self.0.year()).ok().filter(|y| *y <= 9999)?;
        let digit = |n: u16| b'0' + (n % 10) as u8;
        let (month, day) = (
            u16::from(self.0.month().unsigned_abs()),
            u16::from(self.0.day().unsigned_abs()),
        );
        *buf = [
            digit(year / 1000),
            digit(year / 100),
            digit(year / 10),
            digit(year),
            b'-',
            digit(month / 10),
            digit(month),
            b'-',
            digit(day / 10),
            digit(day),
        ];
        std::str::from_utf8(buf).ok()
    }
}

impl fmt::Display for Day {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.iso_text(&mut [0; 10]) {
            Some(text) => f.write_str(text),
            None => write!(
                f,
                "{:04}-{:02}-{:02}",
                self.0.year(),
                self.0.month(),
                self.0.day()
            ),
        }
    }
}

impl Serialize for Day {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.iso_text(&mut [0; 10]) {
            Some(text) => s.serialize_str(text),
            None => s.collect_str(self),
        }
    }
}

/// Text parsed with the type's own `parse`, so that a name, visitor or day
/// in a path, a query or a body is checked once, where it arrives, and its
/// error text is what the client reads.
macro_rules! deserialize_by_parse {
    ($($t:ty),*) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = std::borrow::Cow::<'de, str>::deserialize(d)?;
                Self::parse(&text).map_err(serde::de::Error::custom)
            }
        }
    )*};
}
deserialize_by_parse!(Name, VisitorId, Day, IdempotencyKey);

/// The checked text of a name, visitor or key.
macro_rules! text {
    ($($t:ty),*) => {$(
        impl $t {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    )*};
}
text!(Name, VisitorId, IdempotencyKey);

/// A budget as an operator configures it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetSpec {
    pub visitor_limit: u32,
    pub global_limit: u32,
    pub retention_days: u32,
    pub timezone: TimeZone,
    pub timezone_name: String,
}

impl BudgetSpec {
    pub const DEFAULT_RETENTION_DAYS: u32 = 7;
    pub const MAX_RETENTION_DAYS: u32 = 3650;

    pub fn new(
        visitor_limit: u32,
        global_limit: u32,
        retention_days: Option<u32>,
        timezone: Option<&str>,
    ) -> Result<Self, InvalidInput> {
        let retention_days = retention_days.unwrap_or(Self::DEFAULT_RETENTION_DAYS);
        if !(1..=Self::MAX_RETENTION_DAYS).contains(&retention_days) {
            return Err(InvalidInput(format!(
                "retention_days must be between 1 and {}",
                Self::MAX_RETENTION_DAYS
            )));
        }
        let (timezone, timezone_name) = parse_timezone_name(timezone.unwrap_or("UTC"))?;
        Ok(Self {
            visitor_limit,
            global_limit,
            retention_days,
            timezone,
            timezone_name,
        })
    }

    /// The days whose usage the budget keeps, seen at `now`: today in its
    /// time zone and the `retention_days` days before it. Pruning deletes
    /// every day before the [`KeptDays::oldest`] of four minutes earlier
    /// (`db::clock::Trusted::prune_from`).
    pub fn kept_days(&self, now: Timestamp) -> KeptDays {
        KeptDays::at(&self.timezone, self.retention_days, now)
    }
}

/// The window of days a budget keeps at some instant, both ends included.
/// A client may name only these days: a later one does not exist yet, and
/// an earlier one is pruned (or about to be).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptDays {
    pub oldest: Day,
    pub today: Day,
}

impl KeptDays {
    /// What a budget in `tz` keeping `retention_days` keeps at `now`.
    pub fn at(tz: &TimeZone, retention_days: u32, now: Timestamp) -> Self {
        let today = Day::today_at(tz, now);
        Self {
            oldest: today.minus_days(retention_days),
            today,
        }
    }

    pub fn contains(&self, day: Day) -> bool {
        (self.oldest..=self.today).contains(&day)
    }
}

/// A client's time zone name and its canonical spelling (`utc` is `UTC`).
///
/// Only names of the database compiled into tally count: the host's
/// database also answers to names that depend on the machine (`localtime`,
/// `posixrules`, `posix/...`), so the same budget would count other days on
/// another host. `Factory` (a placeholder for "no zone configured") and
/// `Etc/Unknown` (jiff's "unknown zone", which has no name to store) are in
/// the bundle or answered by it but are no places.
fn parse_timezone_name(name: &str) -> Result<(TimeZone, String), InvalidInput> {
    let refuse = || {
        InvalidInput(format!(
            "`{name}` is not an IANA time zone name (such as `Europe/Berlin` or `UTC`)"
        ))
    };
    let tz = TimeZoneDatabase::bundled()
        .get(name)
        .map_err(|_| refuse())?;
    let canonical = tz.iana_name().ok_or_else(refuse)?;
    if tz.is_unknown() || canonical.eq_ignore_ascii_case("Factory") {
        return Err(refuse());
    }
    let canonical = canonical.to_owned();
    Ok((tz, canonical))
}

/// The time zone of a budget as stored. A name stored by an earlier version
/// that only the host's database knows still loads, so that an existing
/// budget keeps working; new names must pass [`parse_timezone_name`]. But
/// not `localtime`, whichever zone each host is set to: processes on two
/// hosts sharing one database would count the same call on two days (a
/// visitor allowed once a day, allowed on both).
pub fn load_timezone(name: &str) -> Result<TimeZone, InvalidInput> {
    if name
        .trim_start_matches('/')
        .eq_ignore_ascii_case("localtime")
    {
        return Err(InvalidInput(format!(
            "`{name}` is whatever zone the host is set to, so processes on other hosts \
             would count on other days; put the budget again with an IANA name"
        )));
    }
    look_up_timezone(name)
}

/// The time zone a stored answer's headers are told in when it is
/// replayed. A replay answers what was decided, whatever has become of the
/// budget: a zone a budget can no longer be read with (`localtime`, which
/// the first release stored) is looked up as it was then, and one nowhere
/// to be found any more tells the headers in UTC, rather than deny the
/// retry of a call that was counted.
pub fn replayed_timezone(name: &str) -> TimeZone {
    look_up_timezone(name).unwrap_or(TimeZone::UTC)
}

/// A zone by name: in the database compiled into tally, else in the
/// host's.
fn look_up_timezone(name: &str) -> Result<TimeZone, InvalidInput> {
    parse_timezone_name(name)
        .map(|(tz, _)| tz)
        .or_else(|e| TimeZone::get(name).map_err(|_| e))
}

/// A stored budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub name: Name,
    pub spec: BudgetSpec,
}

impl Budget {
    /// The day a command on this budget means, seen at `now`: its today
    /// when the command names none, else the day named if the budget keeps
    /// it (today in its time zone or one of the `retention_days` days
    /// before it, exactly what pruning keeps). A later day does not exist
    /// yet and an earlier one is pruned (or about to be), so naming one is
    /// refused, and nothing is counted, read or deleted for it.
    pub fn day(&self, day: Option<Day>, now: Timestamp) -> Result<Day, Refusal> {
        let kept = self.spec.kept_days(now);
        match day {
            None => Ok(kept.today),
            Some(day) if kept.contains(day) => Ok(day),
            Some(day) => Err(Refusal::DayOutsideWindow {
                budget: self.name.clone(),
                day,
                kept,
                timezone: self.spec.timezone_name.clone(),
                retention_days: self.spec.retention_days,
            }),
        }
    }
}

/// Why a check was allowed or denied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    Ok,
    VisitorLimit,
    GlobalLimit,
}

impl Reason {
    /// As the answer's `reason` and the `reason` label of
    /// `tally_budget_decisions_total` spell it.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Ok => "ok",
            Reason::VisitorLimit => "visitor_limit",
            Reason::GlobalLimit => "global_limit",
        }
    }
}

/// The answer to a budget check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub reason: Reason,
    pub day: Day,
    /// Calls by this visitor on `day`, this one included (denied calls count too).
    pub visitor_calls: i64,
    /// Calls that reached the global counter on `day`, this one included when it did.
    pub global_calls: i64,
    pub visitor_limit: u32,
    pub global_limit: u32,
    /// Usage rows deleted because they fell out of the retention window.
    pub pruned_rows: u64,
    /// The budget's time zone, which `day` is a day of.
    pub timezone: TimeZone,
    /// When the check was decided (or its stored decision replayed), by
    /// the clock that chose `day`: the database's (PostgreSQL's, for every
    /// process alike; SQLite's is tally's own). The rate-limit headers
    /// count the day's window from it, so that a process whose clock is
    /// off neither tells a client the day is over nor to wait a year.
    /// `None` for a decision read back from storage and not yet replayed.
    pub decided_at: Option<Timestamp>,
}

impl Decision {
    pub fn allowed(&self) -> bool {
        self.reason == Reason::Ok
    }
}

/// Usage of a budget on one day.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub day: Day,
    pub global_calls: i64,
    pub visitor_calls: Option<i64>,
}

/// A budget day as a time window: how long it lasts (23 or 25 hours on the
/// days clocks change) and how long until it ends, in whole seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DayWindow {
    pub length_secs: i64,
    /// 0 once the day is over.
    pub resets_in_secs: i64,
}

impl Day {
    /// This day in `tz`, seen at `now`.
    pub fn window(self, tz: &TimeZone, now: Timestamp) -> Option<DayWindow> {
        let start = self
            .0
            .to_zoned_datetime(tz.clone())
            .ok()?
            .start_of_day()
            .ok()?;
        let end = self
            .0
            .tomorrow()
            .ok()?
            .to_zoned_datetime(tz.clone())
            .ok()?
            .start_of_day()
            .ok()?;
        let (start, end) = (start.timestamp(), end.timestamp());
        let left = end.duration_since(now);
        // Round up: a client told "0" while the day still runs would retry
        // too early.
        let resets_in_secs = if left.is_negative() {
            0
        } else {
            left.as_secs() + i64::from(left.subsec_nanos() > 0)
        };
        Some(DayWindow {
            length_secs: end.duration_since(start).as_secs(),
            resets_in_secs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["a", "A-z_0.9:x", &"n".repeat(128)] {
            assert!(Name::parse(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a/b", "é", "a\n", &"n".repeat(129), "*"] {
            assert!(Name::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn days_are_written_as_parsed() {
        // Every day of some years, the ends of the range a day can have,
        // and years the digit-by-digit writer leaves to `write!`.
        let mut day = jiff::civil::date(2023, 12, 25);
        let mut days = vec![jiff::civil::date(1, 1, 1), jiff::civil::date(9999, 12, 31)];
        for _ in 0..(3 * 366) {
            days.push(day);
            day = day.tomorrow().unwrap();
        }
        for date in days {
            let text = Day(date).to_string();
            let expected = format!("{:04}-{:02}-{:02}", date.year(), date.month(), date.day());
            assert_eq!(text, expected);
            // Written digit by digit, not by the fallback.
            assert_eq!(Day(date).iso_text(&mut [0; 10]), Some(expected.as_str()));
            assert_eq!(Day::parse(&text).unwrap(), Day(date));
            assert_eq!(
                serde_json::to_string(&Day(date)).unwrap(),
                format!("\"{expected}\"")
            );
        }
        for year in [-1, -9999] {
            let date = jiff::civil::date(year, 3, 7);
            assert!(Day(date).iso_text(&mut [0; 10]).is_none());
            let expected = format!("{:04}-03-07", year);
            assert_eq!(Day(date).to_string(), expected);
            assert_eq!(
                serde_json::to_string(&Day(date)).unwrap(),
                format!("\"{expected}\"")
            );
        }
    }

    #[test]
    fn visitors() {
        for ok in ["*", "A", "ünïcødé 🎉", &"é".repeat(256)] {
            assert!(VisitorId::parse(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a\tb", "a\u{7f}", "x\u{0}", &"v".repeat(257)] {
            assert!(VisitorId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn idempotency_keys() {
        for ok in [
            "a",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "\"quoted-key\"",
            &"k".repeat(255),
        ] {
            assert!(IdempotencyKey::parse(ok).is_ok(), "{ok}");
        }
        assert_eq!(IdempotencyKey::parse("\"abc\"").unwrap().as_str(), "abc");
        for bad in [
            "",
            "\"\"",
            "a b",
            "é",
            "a\"b",
            &"k".repeat(256),
            "tab\there",
        ] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn days() {
        assert_eq!(Day::parse("2000-03-01").unwrap().to_string(), "2000-03-01");
        assert_eq!(Day::parse("2024-02-29").unwrap().to_string(), "2024-02-29");
        for bad in [
            "2023-02-29",
            "2000-3-01",
            "20000-03-01",
            "2000-13-01",
            "2000-03-1",
            "2000/03/01",
            "0000-01-01",
            "",
            "2000-03-01T00:00",
            " 2000-03-01",
        ] {
            assert!(Day::parse(bad).is_err(), "{bad:?}");
        }
        let d = Day::parse("2000-03-08").unwrap();
        assert_eq!(d.minus_days(7).to_string(), "2000-03-01");
        assert_eq!(
            Day::parse("0001-01-05")
                .unwrap()
                .minus_days(3650)
                .to_string(),
            "0001-01-01"
        );
        // More days than a span holds: the earliest date, not a panic.
        for days in [7_304_485, u32::MAX] {
            assert_eq!(d.minus_days(days).to_string(), "0001-01-01");
        }
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

    #[test]
    fn budget_specs() {
        assert!(BudgetSpec::new(1, 1, None, None).is_ok());
        assert!(BudgetSpec::new(0, 0, Some(3650), Some("Europe/Berlin")).is_ok());
        assert!(BudgetSpec::new(1, 1, Some(0), None).is_err());
        assert!(BudgetSpec::new(1, 1, Some(3651), None).is_err());
        assert!(BudgetSpec::new(1, 1, None, Some("Mars/Olympus")).is_err());
        assert!(BudgetSpec::new(1, 1, None, Some("")).is_err());
    }

    #[test]
    fn time_zones_are_bundled_iana_names() {
        for (given, stored) in [
            ("UTC", "UTC"),
            ("utc", "UTC"),
            ("europe/berlin", "Europe/Berlin"),
            ("Etc/GMT-14", "Etc/GMT-14"),
        ] {
            let spec = BudgetSpec::new(1, 1, None, Some(given)).unwrap();
            assert_eq!(spec.timezone_name, stored);
            assert_eq!(spec.timezone.iana_name(), Some(stored));
        }
        for bad in [
            "localtime",
            "posixrules",
            "Factory",
            "factory",
            "Etc/Unknown",
            "posix/Europe/Berlin",
            "right/UTC",
            "+05:00",
            "EST5EDT,M3.2.0,M11.1.0",
            "/usr/share/zoneinfo/UTC",
        ] {
            assert!(BudgetSpec::new(1, 1, None, Some(bad)).is_err(), "{bad}");
        }
        // A name stored before the rule, known to the host only, still loads.
        assert!(load_timezone("Europe/Berlin").is_ok());
        assert!(load_timezone("Mars/Olympus").is_err());
        // Not one that names the host's own setting.
        for host in ["localtime", "LocalTime"] {
            let e = load_timezone(host).unwrap_err();
            assert!(
                e.0.contains("whatever zone the host is set to"),
                "{host}: {}",
                e.0
            );
        }
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn windows_follow_the_budget_time_zone() {
        let ny = TimeZone::get("America/New_York").unwrap();
        let day = Day::parse("2024-06-20").unwrap();
        // 23:59:59 in New York is 03:59:59 UTC the next calendar day.
        let w = day.window(&ny, at("2024-06-21T03:59:59Z")).unwrap();
        assert_eq!(
            w,
            DayWindow {
                length_secs: 86_400,
                resets_in_secs: 1
            }
        );
        let w = day.window(&ny, at("2024-06-21T03:59:59.5Z")).unwrap();
        assert_eq!(w.resets_in_secs, 1);
        // Midnight in New York: the day is over.
        let w = day.window(&ny, at("2024-06-21T04:00:00Z")).unwrap();
        assert_eq!(w.resets_in_secs, 0);
        // Start of the day: the whole day is left.
        let w = day.window(&ny, at("2024-06-20T04:00:00Z")).unwrap();
        assert_eq!(w.resets_in_secs, 86_400);
        // The same instant is another day in UTC.
        let utc = TimeZone::UTC;
        let w = Day::parse("2024-06-21")
            .unwrap()
            .window(&utc, at("2024-06-21T03:59:59Z"))
            .unwrap();
        assert_eq!(w.resets_in_secs, 20 * 3600 + 1);
    }

    #[test]
    fn days_when_clocks_change_are_shorter_or_longer() {
        let ny = TimeZone::get("America/New_York").unwrap();
        let spring = Day::parse("2024-03-10").unwrap();
        let w = spring.window(&ny, at("2024-03-10T05:00:00Z")).unwrap();
        assert_eq!(
            w,
            DayWindow {
                length_secs: 23 * 3600,
                resets_in_secs: 23 * 3600
            }
        );
        let autumn = Day::parse("2024-11-03").unwrap();
        let w = autumn.window(&ny, at("2024-11-03T04:00:00Z")).unwrap();
        assert_eq!(
            w,
            DayWindow {
                length_secs: 25 * 3600,
                resets_in_secs: 25 * 3600
            }
        );
    }

    #[test]
    fn future_days_reset_at_their_end() {
        let w = Day::parse("2024-06-22")
            .unwrap()
            .window(&TimeZone::UTC, at("2024-06-21T00:00:00Z"))
            .unwrap();
        assert_eq!(w.resets_in_secs, 2 * 86_400);
    }
}
