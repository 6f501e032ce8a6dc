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
//! goes to the database and offers what it read, which is kept only if it
//! cannot be older than a value already published (see [`Committed::offer`]).
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
}

struct Shard {
    /// Name -> (value, the batch number it is known as of).
    values: LruCache<Box<str>, (i64, u64)>,
    /// The newest batch number of any value this shard let go: a value
    /// read from the database as of an older batch may be older than one
    /// that was published and then let go, so it is not kept.
    floor: u64,
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
                        floor: 0,
                    })
                })
                .collect(),
            hasher: DefaultHashBuilder::default(),
            seq: AtomicU64::new(0),
        }
    }

    fn shard(&self, name: &str) -> &Mutex<Shard> {
        let i = self.hasher.hash_one(name) as usize % SHARDS;
        &self.shards[i]
    }

    /// A counter's committed value, if it is kept.
    pub fn get(&self, name: &str) -> Option<i64> {
        let mut shard = self.shard(name).lock().ok()?;
        shard.values.get(name).map(|&(value, _)| value)
    }

    /// The number to pass to [`Committed::offer`] for a database read that
    /// starts after this call.
    pub fn as_of(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    /// Publishes the values one committed batch left, before any caller of
    /// that batch is answered. Called by the writer only, once per batch,
    /// after its COMMIT; a counter deleted in the batch is published as 0,
    /// what a read of it answers.
    pub fn publish<'a>(&self, values: impl IntoIterator<Item = (&'a str, i64)>) {
        let seq = self.seq.load(Ordering::Relaxed) + 1;
        for (name, value) in values {
            let Ok(mut shard) = self.shard(name).lock() else {
                continue;
            };
            shard.put(name, value, seq);
        }
        self.seq.store(seq, Ordering::Release);
    }

    /// A value a read found in the database, in a snapshot that began after
    /// [`Committed::as_of`] returned `as_of`. Kept only if the name is not
    /// kept already (a published value is never replaced by a read) and no
    /// value this shard let go is newer than `as_of`: then no commit the
    /// snapshot may have missed touched the name, since every commit
    /// publishes what it touched.
    pub fn offer(&self, name: &str, value: i64, as_of: u64) {
        let Ok(mut shard) = self.shard(name).lock() else {
            return;
        };
        if shard.floor <= as_of && !shard.values.contains_key(name) {
            shard.put(name, value, as_of);
        }
    }
}

impl Shard {
    fn put(&mut self, name: &str, value: i64, seq: u64) {
        if let Some(kept) = self.values.get_mut(name) {
            *kept = (value, seq);
            return;
        }
        if self.values.len() >= self.values.capacity()
            && let Some((_, (_, gone))) = self.values.remove_lru()
        {
            self.floor = self.floor.max(gone);
        }
        self.values.insert(name.into(), (value, seq));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_values_are_read_back() {
        let c = Committed::new(64);
        assert_eq!(c.get("a"), None);
        c.publish([("a", 1), ("b", 2), ("a", 3)]);
        assert_eq!(c.get("a"), Some(3));
        assert_eq!(c.get("b"), Some(2));
    }

    #[test]
    fn a_read_never_replaces_a_published_value() {
        let c = Committed::new(64);
        let as_of = c.as_of();
        // The read's snapshot missed the commit that published 5.
        c.publish([("a", 5)]);
        c.offer("a", 4, as_of);
        assert_eq!(c.get("a"), Some(5));
    }

    #[test]
    fn a_read_older_than_a_value_let_go_is_not_kept() {
        // One name per shard: every new name lets the shard's last one go.
        let c = Committed::new(1);
        let as_of = c.as_of();
        c.publish([("a", 7)]);
        // Enough other names that "a" is let go from its shard.
        let names: Vec<String> = (0..200).map(|i| format!("n{i}")).collect();
        c.publish(names.iter().map(|n| (n.as_str(), 1)));
        assert_eq!(c.get("a"), None);
        // A read that began before "a" became 7 may have seen an older
        // value: not kept.
        c.offer("a", 6, as_of);
        assert_eq!(c.get("a"), None);
        // A read that began after it is.
        c.offer("a", 7, c.as_of());
        assert_eq!(c.get("a"), Some(7));
    }

    #[test]
    fn memory_stays_bounded() {
        let c = Committed::new(100);
        let names: Vec<String> = (0..10_000).map(|i| format!("n{i}")).collect();
        c.publish(names.iter().map(|n| (n.as_str(), 1)));
        let kept: usize = c
            .shards
            .iter()
            .map(|s| s.lock().unwrap().values.len())
            .sum();
        assert!(kept <= 100 + SHARDS, "{kept}");
    }
}
