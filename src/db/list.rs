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
    /// Only names after this text: the last name of the previous page. Any
    /// text, not only a name: a page may end on a stored name tally cannot
    /// read (see [`Unreadable`]), and the next page starts after it.
    pub after: Option<String>,
    /// At most this many, [`PageRequest::MAX_LIMIT`] at most.
    pub limit: u32,
}

impl PageRequest {
    pub const DEFAULT_LIMIT: u32 = 100;
    pub const MAX_LIMIT: u32 = 1000;

    /// A request with a limit of 1 to [`Self::MAX_LIMIT`]
    /// ([`Self::DEFAULT_LIMIT`] when left out), after any text: the `next`
    /// of a page is the stored name it ended on, which may be empty, or
    /// on SQLite hold a NUL, when written by hand.
    pub fn new(
        prefix: Option<Name>,
        after: Option<String>,
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
            Some(after) if after.as_str() >= prefix => (after.clone(), false),
            _ => (prefix.to_owned(), true),
        };
        KeyRange {
            from,
            inclusive,
            below: successor(prefix),
            take: i64::from(self.limit) + 1,
        }
    }

    /// The page from rows read for [`Self::range`]: at most `limit` of
    /// them, each `read` into an item or, if tally cannot read it back (a
    /// row edited by hand), named among the page's [`Unreadable`] rows;
    /// and `next` (the last stored name of this page, read or not) only if
    /// a row followed it. An unreadable row takes its place on the page
    /// like any other, so that no page is longer than `limit` and paging
    /// goes past it.
    pub(super) fn page<R, T>(
        &self,
        mut rows: Vec<R>,
        name: impl Fn(&R) -> &str,
        read: impl Fn(R) -> Result<T, String>,
    ) -> Page<T> {
        let limit = usize::try_from(self.limit).unwrap_or(usize::MAX);
        let next = match rows.len() > limit {
            true => {
                rows.truncate(limit);
                rows.last().map(|r| name(r).to_owned())
            }
            false => None,
        };
        let mut page = Page {
            items: Vec::with_capacity(rows.len()),
            unreadable: Vec::new(),
            next,
        };
        for row in rows {
            let stored = name(&row).to_owned();
            match read(row) {
                Ok(item) => page.items.push(item),
                Err(problem) => page.unreadable.push(Unreadable {
                    name: stored,
                    problem,
                }),
            }
        }
        page
    }
}

/// One page, and where the next one starts (`None` on the last).
#[derive(Debug)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Rows of the page tally cannot read back, in name order.
    pub unreadable: Vec<Unreadable>,
    pub next: Option<String>,
}

/// A stored row tally cannot read back: a name it would refuse, a time
/// zone it does not know, a limit out of range (edited by hand, or left by
/// a tz database that has since dropped the zone). It is listed by name
/// with why, so that one such row neither fails every page it falls on
/// nor hides the names after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub name: String,
    pub problem: String,
}

/// Rows with `from <= name` (`from < name` if not `inclusive`) and
/// `name < below` if there is a `below` (a prefix's end; without a prefix
/// every name after `from`, those written by hand at U+10FFFF and above
/// too), in byte order, `take` at most: what each engine's read runs as
/// `WHERE name >= $1 AND name < $2 ORDER BY name LIMIT $3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyRange {
    pub from: String,
    pub inclusive: bool,
    pub below: Option<String>,
    pub take: i64,
}

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
        PageRequest::new(prefix.map(name), after.map(str::to_owned), Some(limit)).unwrap()
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
    /// would keep, for every prefix and `after` drawn from the names, and
    /// for stored names no name's rule allows.
    #[test]
    fn a_range_is_the_prefix_and_after_filter() {
        let names = [
            "0", "A", "B", "Z", "_", "a", "a-", "a-b", "a.b", "a0", "a:b", "aZ", "a_", "a_b", "ab",
            "az", "azz", "b", "z", "zz",
        ];
        // Stored by hand, no names: listed (as unreadable) all the same.
        let odd = [
            "a b",
            " ",
            "a\u{e9}",
            "~",
            "\u{10FFFF}",
            "\u{10FFFF}a",
            "",
            "a\0",
        ];
        let mut bytes: Vec<&str> = names.iter().chain(&odd).copied().collect();
        bytes.sort_unstable();
        for prefix in names.iter().map(Some).chain([None]) {
            for after in names.iter().chain(&odd).map(Some).chain([None]) {
                let r = request(prefix.copied(), after.copied(), 5).range();
                let inside = |n: &str| {
                    (if r.inclusive {
                        n >= r.from.as_str()
                    } else {
                        n > r.from.as_str()
                    }) && r.below.as_deref().is_none_or(|b| n < b)
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

    fn read(row: &'static str) -> Result<Name, String> {
        Name::parse(row).map_err(|e| e.0)
    }

    #[test]
    fn next_only_when_a_row_followed() {
        let r = request(None, None, 2);
        let page = r.page(vec!["a", "b", "c"], |n| n, read);
        assert_eq!(page.items, vec![name("a"), name("b")]);
        assert_eq!(page.next.as_deref(), Some("b"));
        let page = r.page(vec!["a", "b"], |n| n, read);
        assert_eq!(page.next, None);
        let page = r.page(vec![], |n| n, read);
        assert!(page.items.is_empty() && page.unreadable.is_empty() && page.next.is_none());
    }

    /// A row that cannot be read is named with why, counts towards the
    /// page's limit like any other, and may end the page: `next` is then
    /// its stored name, which a request takes as `after`, so the walk goes
    /// on past it rather than stopping or going round.
    #[test]
    fn an_unreadable_row_is_named_and_paged_past() {
        let rows = ["a", "a b", "c", "d"];
        let r = request(None, None, 2);
        let page = r.page(rows[..3].to_vec(), |n| n, read);
        assert_eq!(page.items, vec![name("a")]);
        assert_eq!(page.unreadable.len(), 1);
        assert_eq!(page.unreadable[0].name, "a b");
        assert!(
            page.unreadable[0].problem.contains("' '"),
            "{:?}",
            page.unreadable
        );
        assert_eq!(page.next.as_deref(), Some("a b"));
        let r = request(None, page.next.as_deref(), 2);
        assert_eq!(
            (r.range().from.as_str(), r.range().inclusive),
            ("a b", false)
        );
        let page = r.page(rows[2..].to_vec(), |n| n, read);
        assert_eq!(page.items, vec![name("c"), name("d")]);
        assert!(page.unreadable.is_empty() && page.next.is_none());
    }

    #[test]
    fn after_is_any_text() {
        for ok in ["a", "a b", "\u{e9}", "/", "\u{10FFFF}", "", "a\0b"] {
            assert!(
                PageRequest::new(None, Some(ok.into()), None).is_ok(),
                "{ok:?}"
            );
        }
    }
}
