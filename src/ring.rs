//! The receiver's staging ring: FIFO allocation with overcommit and a watermark.
//!
//! The ring always grants (except for an allocation larger than the ring): a grant in round `r` may
//! overlap live data of round `r - 1`, and the *writer* waits until the watermark says that data is
//! gone ([`Watermark::permits`]). Freeing the oldest allocation advances the watermark; an empty ring
//! starts a new round at offset 0 so a large allocation can never wait on space that is already free.

use std::collections::VecDeque;

/// `(round, offset)` of the oldest live allocation, or `(round, 0)` of a fresh round when empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Watermark {
    pub round: u64,
    pub offset: u64,
}

impl Watermark {
    /// Whether a region of `round` ending at `end` may be written under this watermark.
    pub fn permits(&self, round: u64, end: u64) -> bool {
        round == 0 || round - 1 < self.round || (round - 1 == self.round && end <= self.offset)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub id: u64,
    pub round: u64,
    pub offset: u64,
    pub len: u64,
}

impl Grant {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("allocation of {requested} bytes exceeds the staging ring of {capacity} bytes")]
pub struct Oversized {
    pub requested: u64,
    pub capacity: u64,
}

#[derive(Debug)]
pub struct Ring {
    capacity: u64,
    head: u64,
    round: u64,
    next_id: u64,
    live: VecDeque<Grant>,
    watermark: Watermark,
}

impl Ring {
    pub fn new(capacity: u64) -> Ring {
        Ring { capacity, head: 0, round: 0, next_id: 1, live: VecDeque::new(), watermark: Watermark::default() }
    }

    /// An empty ring whose first round is `round` (a ring replacing another continues its rounds).
    pub fn starting_at(capacity: u64, round: u64) -> Ring {
        let w = Watermark { round, offset: 0 };
        Ring { capacity, head: 0, round, next_id: 1, live: VecDeque::new(), watermark: w }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn watermark(&self) -> Watermark {
        self.watermark
    }

    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Live allocations, oldest first.
    pub fn live(&self) -> impl Iterator<Item = &Grant> {
        self.live.iter()
    }

    /// Bytes of the ring held by live allocations: from the oldest live one to the end of the
    /// newest (the head), wrap-around included, at most the capacity (an overcommitted grant
    /// overlaps space already counted). Holes freed out of order count: nothing reuses them before
    /// the watermark passes. Live allocations two or more rounds apart (overcommit) span a whole
    /// round at least: the capacity.
    pub fn occupied(&self) -> u64 {
        let Some(oldest) = self.live.front() else { return 0 };
        let span = match self.round.saturating_sub(oldest.round) {
            0 => self.head.saturating_sub(oldest.offset),
            1 => (self.capacity - oldest.offset).saturating_add(self.head),
            _ => self.capacity,
        };
        span.min(self.capacity)
    }

    pub fn assign(&mut self, len: u64) -> Result<Grant, Oversized> {
        if len > self.capacity {
            return Err(Oversized { requested: len, capacity: self.capacity });
        }
        let offset = if self.head + len <= self.capacity {
            self.head
        } else {
            self.round += 1;
            0
        };
        let grant = Grant { id: self.next_id, round: self.round, offset, len };
        self.next_id += 1;
        self.head = offset + len;
        self.live.push_back(grant);
        Ok(grant)
    }

    /// Frees a grant; returns the new watermark when it changed. Unknown ids are ignored (idempotent).
    pub fn free(&mut self, id: u64) -> Option<Watermark> {
        let pos = self.live.iter().position(|g| g.id == id)?;
        self.live.remove(pos);
        let before = self.watermark;
        self.watermark = match self.live.front() {
            Some(oldest) => Watermark { round: oldest.round, offset: oldest.offset },
            None => {
                self.round += 1;
                self.head = 0;
                Watermark { round: self.round, offset: 0 }
            }
        };
        (self.watermark != before).then_some(self.watermark)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps_into_a_new_round_and_waits_for_the_watermark() {
        let mut ring = Ring::new(100);
        let a = ring.assign(60).unwrap();
        let b = ring.assign(60).unwrap();
        assert_eq!((a.round, a.offset), (0, 0));
        assert_eq!((b.round, b.offset), (1, 0));
        assert!(ring.watermark().permits(a.round, a.end()));
        assert!(!ring.watermark().permits(b.round, b.end()));
        assert_eq!(ring.free(a.id), Some(Watermark { round: 1, offset: 0 }));
        assert!(ring.watermark().permits(b.round, b.end()));
    }

    #[test]
    fn occupied_spans_the_oldest_to_the_head_within_the_capacity() {
        let mut ring = Ring::new(100);
        assert_eq!(ring.occupied(), 0);
        let a = ring.assign(40).unwrap();
        let b = ring.assign(30).unwrap();
        assert_eq!(ring.occupied(), 70);
        ring.free(a.id);
        assert_eq!(ring.occupied(), 30, "from b's start to the head");
        let c = ring.assign(35).unwrap();
        assert_eq!((c.round, c.offset), (1, 0));
        assert_eq!(ring.occupied(), 100 - 40 + 35, "wraps: b's round from b on, plus c");
        let d = ring.assign(10).unwrap();
        assert_eq!((d.round, d.offset), (1, 35));
        assert_eq!(ring.occupied(), 100, "d overlaps b (overcommit): at most the capacity");
        ring.free(b.id);
        assert_eq!(ring.occupied(), 45, "from c to the head");
        ring.free(c.id);
        ring.free(d.id);
        assert_eq!(ring.occupied(), 0);
    }

    #[test]
    fn occupied_is_the_capacity_when_live_allocations_are_two_rounds_apart() {
        let mut ring = Ring::new(100);
        let a = ring.assign(90).unwrap();
        let b = ring.assign(10).unwrap();
        ring.free(a.id);
        assert_eq!((b.round, b.offset), (0, 90));
        let c = ring.assign(60).unwrap();
        let d = ring.assign(50).unwrap();
        assert_eq!((c.round, c.offset, d.round, d.offset), (1, 0, 2, 0));
        // b (round 0) to the head (round 2): a whole round and more, not (100 - 90) + 50.
        assert_eq!(ring.occupied(), 100);
        ring.free(b.id);
        assert_eq!(ring.occupied(), 100, "c (round 1) to the head (round 2), overcommitted");
        ring.free(c.id);
        assert_eq!(ring.occupied(), 50, "d alone");
        ring.free(d.id);
        assert_eq!(ring.occupied(), 0);
    }

    #[test]
    fn empty_ring_starts_a_new_round_at_zero() {
        let mut ring = Ring::new(100);
        let a = ring.assign(70).unwrap();
        ring.free(a.id);
        // Without the round bump, 70 bytes would wrap behind a watermark that never moves.
        let b = ring.assign(70).unwrap();
        assert_eq!(b.offset, 0);
        assert!(ring.watermark().permits(b.round, b.end()));
    }

    #[test]
    fn a_ring_that_replaces_another_continues_its_rounds() {
        let mut old = Ring::new(100);
        let a = old.assign(60).unwrap();
        old.free(a.id);
        let seen = old.watermark();
        let mut ring = Ring::starting_at(100, seen.round + 1);
        let (g1, g2) = (ring.assign(60).unwrap(), ring.assign(60).unwrap());
        assert!(g1.round > seen.round);
        // A sender holding the old ring's watermark may write neither the first nor the overlap.
        assert!(!seen.permits(g2.round, g2.end()));
        assert!(ring.watermark().permits(g1.round, g1.end()) && !ring.watermark().permits(g2.round, g2.end()));
    }

    #[test]
    fn oversized_and_idempotent_free() {
        let mut ring = Ring::new(10);
        assert_eq!(ring.assign(11), Err(Oversized { requested: 11, capacity: 10 }));
        let a = ring.assign(10).unwrap();
        assert!(ring.free(a.id).is_some());
        assert_eq!(ring.free(a.id), None);
        assert_eq!(ring.live_count(), 0);
    }

    /// Shadow model: bytes owned by live allocations that have been written. A writer may write only
    /// when the watermark permits; it must never overwrite bytes of another live allocation.
    fn check_ops(capacity: u64, ops: Vec<(bool, u64, usize)>) {
        let mut ring = Ring::new(capacity);
        let mut owner: Vec<Option<u64>> = vec![None; capacity as usize];
        let mut pending: Vec<Grant> = Vec::new(); // granted, not yet written
        let mut written: Vec<Grant> = Vec::new();
        for (alloc, len, pick) in ops {
            if alloc {
                match ring.assign(len) {
                    Ok(g) => pending.push(g),
                    Err(e) => assert!(len > capacity, "{e}"),
                }
            } else if !written.is_empty() {
                let g = written.remove(pick % written.len());
                for b in &mut owner[g.offset as usize..g.end() as usize] {
                    if *b == Some(g.id) {
                        *b = None;
                    }
                }
                ring.free(g.id);
            }
            // Write every pending grant the watermark permits, checking the shadow model.
            let wm = ring.watermark();
            let (ready, still): (Vec<_>, Vec<_>) = pending.drain(..).partition(|g| wm.permits(g.round, g.end()));
            pending = still;
            for g in ready {
                for b in &mut owner[g.offset as usize..g.end() as usize] {
                    assert!(b.is_none(), "grant {g:?} would overwrite live allocation {b:?}");
                    *b = Some(g.id);
                }
                written.push(g);
            }
        }
        // Drain: free everything written; pending grants must all become writable in FIFO order.
        while !written.is_empty() || !pending.is_empty() {
            assert!(!written.is_empty(), "pending grants {pending:?} can never be written");
            let g = written.remove(0);
            ring.free(g.id);
            let wm = ring.watermark();
            let (ready, still): (Vec<_>, Vec<_>) = pending.drain(..).partition(|p| wm.permits(p.round, p.end()));
            pending = still;
            written.extend(ready);
        }
        assert_eq!(ring.live_count(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn watermark_never_lets_a_writer_overwrite_live_data(
            capacity in 1u64..64,
            ops in proptest::collection::vec((any::<bool>(), 1u64..80, any::<usize>()), 1..60),
        ) {
            check_ops(capacity, ops);
        }
    }
}
