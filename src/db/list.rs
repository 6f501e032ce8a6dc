//! Listing budgets and counters a page at a time, by name in byte order.
//!
//! Pages are keyed by name, not numbered: a page asks for the names after
//! the last one the previous page ended with. A name that exists all along
//! is on exactly one page however many are written or deleted meanwhile,
//! and a page costs one range scan of the primary key whichever page it is.
//!
//! A prefix is a range of names too, `[prefix, successor(prefix))`: no
//! `LIKE`, whose `_` would match any character (`a_` would list `a-b`).

use crate::meter::{InvalidInput, Name};

/// A page of a list, as the client asked for it.
#[derive(Debug, Clone)]
pub struct PageRequest {
    /// Only names starting with these bytes.
    pub prefix: Option<Name>,
    /// Only names after this one: the last name of the previous page.
    pub after: Option<Name>,
    /// At most this many, [`PageRequest::MAX_LIMIT`] at most.
    pub limit: u32,
}

impl PageRequest {
    pub const DEFAULT_LIMIT: u32 = 100;
    pub const MAX_LIMIT: u32 = 1000;

    /// A request with a limit of 1 to [`Self::MAX_LIMIT`]
    /// ([`Self::DEFAULT_LIMIT`] when left out).
    pub fn new(
        prefix: Option<Name>,
        after: Option<Name>,
        limit: Option<u32>,
    ) -> Result<Self, InvalidInput> {
        let limit = limit.unwrap_or(Self::DEFAULT_LIMIT);
        if !(1..=Self::MAX_LIMIT).contains(&limit) {
            return Err(InvalidInput(format!(
                "limit: must be 1 to {}, got {limit}",
                Self::MAX_LIMIT
            )));
        }
        Ok(Self {
            prefix,
            after,
            limit,
        })
    }

    /// The names this page may hold, as one range of the primary key, and
    /// one row more than the page: whether that row exists tells whether
    /// there is a next page.
    pub(super) fn range(&self) -> KeyRange {
        let prefix = self.prefix.as_ref().map_or("", Name::as_str);
        // The higher of the two lower bounds is the whole of it: past
        // `after` and at least `prefix`.
        let (from, inclusive) = match &self.after {
            Some(after) if after.as_str() >= prefix => (after.as_str().to_owned(), false),
            _ => (prefix.to_owned(), true),
        };
        KeyRange {
            from,
            inclusive,
            below: successor(prefix).unwrap_or_else(|| ABOVE_ALL.to_owned()),
            take: i64::from(self.limit) + 1,
        }
    }

    /// The page from rows read for [`Self::range`]: at most `limit` of
    /// them, and `next` (the last name of this page) only if a row
    /// followed it.
    pub(super) fn page<T>(&self, mut items: Vec<T>, name: impl Fn(&T) -> &Name) -> Page<T> {
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        let next = match items.len() > limit {
            true => {
                items.truncate(limit);
                items.last().map(|i| name(i).clone())
            }
            false => None,
        };
        Page { items, next }
    }
}

/// One page, and where the next one starts (`None` on the last).
#[derive(Debug)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub next: Option<Name>,
}

/// Rows with `from <= name` (`from < name` if not `inclusive`) and
/// `name < below`, in byte order, `take` at most: what each engine's read
/// runs as `WHERE name >= $1 AND name < $2 ORDER BY name LIMIT $3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyRange {
    pub from: String,
    pub inclusive: bool,
    pub below: String,
    pub take: i64,
}

/// Above every name in byte order: names are ASCII, and no string of
/// UTF-8 that does not start with U+10FFFF sorts after it.
const ABOVE_ALL: &str = "\u{10FFFF}";

/// The least string above every string that starts with `prefix`: the
/// prefix with its last character raised by one (UTF-8's byte order is
/// the order of code points), or `None` when nothing is above (an empty
/// prefix).
fn successor(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        let next = (u32::from(last) + 1..=u32::from(char::MAX)).find_map(char::from_u32);
        if let Some(next) = next {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Name {
        Name::parse(s).unwrap()
    }

    fn request(prefix: Option<&str>, after: Option<&str>, limit: u32) -> PageRequest {
        PageRequest::new(prefix.map(name), after.map(name), Some(limit)).unwrap()
    }

    #[test]
    fn limits() {
        assert_eq!(PageRequest::new(None, None, None).unwrap().limit, 100);
        for ok in [1, 1000] {
            assert!(PageRequest::new(None, None, Some(ok)).is_ok());
        }
        for bad in [0, 1001, u32::MAX] {
            assert!(PageRequest::new(None, None, Some(bad)).is_err());
        }
    }

    #[test]
    fn successors() {
        assert_eq!(successor(""), None);
        assert_eq!(successor("a").as_deref(), Some("b"));
        assert_eq!(successor("a_").as_deref(), Some("a`"));
        assert_eq!(successor("az").as_deref(), Some("a{"));
        assert_eq!(successor("a\u{D7FF}").as_deref(), Some("a\u{E000}"));
        assert_eq!(successor("a\u{10FFFF}").as_deref(), Some("b"));
        assert_eq!(successor("\u{10FFFF}"), None);
    }

    /// The range holds exactly the names a plain filter over a sorted list
    /// would keep, for every prefix and `after` drawn from the names.
    #[test]
    fn a_range_is_the_prefix_and_after_filter() {
        let names = [
            "0", "A", "B", "Z", "_", "a", "a-", "a-b", "a.b", "a0", "a:b", "aZ", "a_", "a_b", "ab",
            "az", "azz", "b", "z", "zz",
        ];
        let mut bytes: Vec<&str> = names.to_vec();
        bytes.sort_unstable();
        for prefix in names.iter().map(Some).chain([None]) {
            for after in names.iter().map(Some).chain([None]) {
                let r = request(prefix.copied(), after.copied(), 5).range();
                let inside = |n: &str| {
                    (if r.inclusive {
                        n >= r.from.as_str()
                    } else {
                        n > r.from.as_str()
                    }) && n < r.below.as_str()
                };
                let want: Vec<&str> = bytes
                    .iter()
                    .copied()
                    .filter(|n| prefix.is_none_or(|p| n.starts_with(p)))
                    .filter(|n| after.is_none_or(|a| *n > *a))
                    .collect();
                let got: Vec<&str> = bytes.iter().copied().filter(|n| inside(n)).collect();
                assert_eq!(got, want, "prefix {prefix:?} after {after:?}");
                assert_eq!(r.take, 6);
            }
        }
    }

    #[test]
    fn next_only_when_a_row_followed() {
        let r = request(None, None, 2);
        let rows = |n: &[&str]| n.iter().map(|s| name(s)).collect::<Vec<_>>();
        let page = r.page(rows(&["a", "b", "c"]), |n| n);
        assert_eq!(page.items, rows(&["a", "b"]));
        assert_eq!(page.next, Some(name("b")));
        let page = r.page(rows(&["a", "b"]), |n| n);
        assert_eq!(page.next, None);
        let page = r.page(rows(&[]), |n| n);
        assert!(page.items.is_empty() && page.next.is_none());
    }
}
