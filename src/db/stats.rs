//! Numbers the writer shares with handlers without taking a lock.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Queue state that handlers read on every write and `/ready` reads on every probe.
#[derive(Debug, Default)]
pub struct QueueStats {
    depth: AtomicUsize,
    closed: AtomicBool,
}

impl QueueStats {
    pub fn set_depth(&self, depth: usize) {
        self.depth.store(depth, Ordering::Relaxed);
    }

    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }

    pub fn mark_closed(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}
