//! Committed counter values, kept in memory, for the SQLite engine.
//!
//! On SQLite the writer is the only writer, so after each COMMIT it knows
//! every value it committed. It publishes them here before it answers
//! anyone, and a counter read finds the value here with no statement, no
//! hop to a database thread and no wake-up of another task: exactly as
//! fresh as reading the file, so a read after a `200` sees that write.
//!
//! Memory stays bounded: the names most recently written or read, up to a
//! fixed number, in least-recently-used order. A read of a name not here
//! goes to the database and offers what it read, which is kept only if no
//! commit can have come between the read and the offer (see
//! [`Committed::offer`]). While a batch runs, the names it may change are
//! not here ([`Committed::begin`]): reads of them go to the file until it
//! publishes. So no read answers a value older than one a read before it
//! answered.
//!
//! PostgreSQL, written by many processes, always reads the database.

use std::{
    hash::BuildHasher,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use hashlink::{DefaultHashBuilder, LruCache};

/// Independent parts, each behind a lock of its own, so that readers on
/// many threads rarely meet.
const SHARDS: usize = 16;

pub struct Committed {
    shards: Box<[Mutex<Shard>]>,
    /// Picks a name's shard. Seeded apart from the shards' own tables
    /// (each map seeds its own), so that the names of one shard do not
    /// also share the low bits of their hash within it.
    hasher: DefaultHashBuilder,
    /// The number of the last batch whose values are all published.
    seq: AtomicU64,
    /// The number of the last batch the writer began: past `seq` while a
    /// batch is between its start and its publication, when its COMMIT
    /// may be in the file and not yet here.
    begun: AtomicU64,
}

struct Shard {
    /// Name -> value.
    values: LruCache<Box<str>, i64>,
}

impl Committed {
    /// Keeps up to `capacity` names (at least one per shard).
    pub fn new(capacity: usize) -> Self {
        let per_shard = capacity.div_ceil(SHARDS).max(1);
        Self {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        values: LruCache::new(per_shard),
                    })
                })
                .collect(),
            hasher: DefaultHashBuilder::default(),
            seq: AtomicU64::new(0),
            begun: AtomicU64::new(0),
        }
    }

    fn shard(&self, name: &str) -> &Mutex<Shard> {
        let i = self.hasher.hash_one(name) as usize % SHARDS;
        &self.shards[i]
    }

    /// A counter's committed value, if it is kept.
    pub fn get(&self, name: &str) -> Option<i64> {
        let mut shard = self.shard(name).lock().ok()?;
        shard.values.get(name).copied()
    }

    /// The number to pass to [`Committed::offer`] for a database read that
    /// starts after this call.
    pub fn as_of(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    /// A batch that may change the counters `names` begins: called by the
    /// writer only, before anything of it can reach the file, and followed
    /// by [`Committed::publish`] once it has ended, committed or not. The
    /// names are let go until then: between its COMMIT and its publication
    /// a read from the file may already find the batch's values, and a
    /// later read must not answer an older one from here.
    pub fn begin<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        self.begun.fetch_add(1, Ordering::SeqCst);
        for name in names {
            if let Ok(mut shard) = self.shard(name).lock() {
                shard.values.remove(name);
            }
        }
    }

    /// Publishes the values the batch begun last left (none if it did not
    /// commit), before any caller of it is answered. A counter deleted in
    /// the batch is published as 0, what a read of it answers.
    pub fn publish<'a>(&self, values: impl IntoIterator<Item = (&'a str, i64)>) {
        for (name, value) in values {
            let Ok(mut shard) = self.shard(name).lock() else {
                continue;
            };
            shard.put(name, value);
        }
        self.seq
            .store(self.begun.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// A value a read found in the database, in a snapshot that began after
    /// [`Committed::as_of`] returned `as_of`. Kept only if the name is not
    /// kept already (a published value is never replaced by a read) and no
    /// batch has begun since, nor was under way then: then the snapshot
    /// missed no commit, and the value is the name's committed one. A batch
    /// that begins after this check publishes what it touches after it.
    /// (Otherwise a read whose snapshot came just before a commit would
    /// keep the old value here, and later reads would answer it after
    /// others had already read the new one from the file.)
    pub fn offer(&self, name: &str, value: i64, as_of: u64) {
        let Ok(mut shard) = self.shard(name).lock() else {
            return;
        };
        if self.begun.load(Ordering::SeqCst) == as_of && !shard.values.contains_key(name) {
            shard.put(name, value);
        }
    }
}

impl Shard {
    fn put(&mut self, name: &str, value: i64) {
        if let Some(kept) = self.values.get_mut(name) {
            *kept = value;
            return;
        }
        if self.values.len() >= self.values.capacity() {
            self.values.remove_lru();
        }
        self.values.insert(name.into(), value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One batch, begun and published, as the writer runs it.
    fn commit<'a>(c: &Committed, values: impl IntoIterator<Item = (&'a str, i64)> + Clone) {
        c.begin(values.clone().into_iter().map(|(name, _)| name));
        c.publish(values);
    }

    #[test]
    fn published_values_are_read_back() {
        let c = Committed::new(64);
        assert_eq!(c.get("a"), None);
        commit(&c, [("a", 1), ("b", 2), ("a", 3)]);
        assert_eq!(c.get("a"), Some(3));
        assert_eq!(c.get("b"), Some(2));
    }

    #[test]
    fn a_read_never_replaces_a_published_value() {
        let c = Committed::new(64);
        let as_of = c.as_of();
        // The read's snapshot missed the commit that published 5.
        commit(&c, [("a", 5)]);
        c.offer("a", 4, as_of);
        assert_eq!(c.get("a"), Some(5));
    }

    #[test]
    fn a_read_older_than_a_value_let_go_is_not_kept() {
        // One name per shard: every new name lets the shard's last one go.
        let c = Committed::new(1);
        let as_of = c.as_of();
        commit(&c, [("a", 7)]);
        // Enough other names that "a" is let go from its shard.
        let names: Vec<String> = (0..200).map(|i| format!("n{i}")).collect();
        commit(&c, names.iter().map(|n| (n.as_str(), 1)));
        assert_eq!(c.get("a"), None);
        // A read that began before "a" became 7 may have seen an older
        // value: not kept.
        c.offer("a", 6, as_of);
        assert_eq!(c.get("a"), None);
        // A read that began after it is.
        c.offer("a", 7, c.as_of());
        assert_eq!(c.get("a"), Some(7));
    }

    /// A read whose snapshot came just before a commit landed in the file,
    /// offered after, while the batch is not yet published: before, it was
    /// kept, and reads answered 1 after others had read 2 from the file.
    #[test]
    fn a_read_a_commit_may_have_overtaken_is_not_kept() {
        let c = Committed::new(64);
        let as_of = c.as_of();
        // A batch begins and commits "a" = 2; the read saw the file before.
        c.begin(["a"]);
        c.offer("a", 1, as_of);
        assert_eq!(c.get("a"), None);
        // Nor is a read begun while that batch is under way, whatever it saw.
        let during = c.as_of();
        c.offer("a", 2, during);
        assert_eq!(c.get("a"), None);
        c.publish([("a", 2)]);
        assert_eq!(c.get("a"), Some(2));
        // A batch that did not commit publishes nothing and ends all the same.
        c.begin(["b"]);
        c.publish([]);
        c.offer("b", 3, c.as_of());
        assert_eq!(c.get("b"), Some(3));
    }

    /// A value kept before a batch that changes it is let go while the
    /// batch runs: once its COMMIT is in the file, a read from the file
    /// finds the new value, and a read after that must not find the old
    /// one here. Before, the old value stayed until the batch published.
    #[test]
    fn a_value_a_batch_changes_is_not_answered_while_it_commits() {
        let c = Committed::new(64);
        commit(&c, [("a", 1)]);
        assert_eq!(c.get("a"), Some(1));
        c.begin(["a"]);
        assert_eq!(c.get("a"), None, "the old value while the batch commits");
        c.publish([("a", 2)]);
        assert_eq!(c.get("a"), Some(2));
        // Names the batch does not change stay.
        commit(&c, [("b", 5)]);
        c.begin(["a"]);
        assert_eq!(c.get("b"), Some(5));
        c.publish([]);
    }

    #[test]
    fn memory_stays_bounded() {
        let c = Committed::new(100);
        let names: Vec<String> = (0..10_000).map(|i| format!("n{i}")).collect();
        commit(&c, names.iter().map(|n| (n.as_str(), 1)));
        let kept: usize = c
            .shards
            .iter()
            .map(|s| s.lock().unwrap().values.len())
            .sum();
        assert!(kept <= 100 + SHARDS, "{kept}");
    }
}
