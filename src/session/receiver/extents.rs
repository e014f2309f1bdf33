//! The byte ranges of a writer's region that landed. Writes may come in any order (a sender may
//! send each slab as soon as it is ready) but never overlap: the region is complete when they
//! cover it, each byte exactly once.

/// Separate ranges a region may hold at once: far more than an honest sender makes (one per slab
/// in flight, adjacent ones merge), few enough that a peer sending tiny scattered writes cannot
/// make each insert slow or the list large.
pub const MAX_RANGES: usize = 4096;

/// Landed ranges `[start, end)`, sorted, disjoint, adjacent ones merged.
#[derive(Clone, Debug, Default)]
pub struct Extents {
    ranges: Vec<(u64, u64)>,
    total: u64,
}

impl Extents {
    /// Bytes landed.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Whether the landed bytes are exactly `[start, end)`.
    pub fn covers_exactly(&self, start: u64, end: u64) -> bool {
        self.ranges.as_slice() == [(start, end)] || (start == end && self.ranges.is_empty())
    }

    /// Whether `[start, end)` landed whole.
    pub fn contains(&self, start: u64, end: u64) -> bool {
        // Merged ranges: only the first one ending after `start` can hold it.
        let i = self.ranges.partition_point(|&(_, e)| e <= start);
        start >= end || self.ranges.get(i).is_some_and(|&(s, e)| s <= start && end <= e)
    }

    /// Whether recording `[start, end)` would leave more than [`MAX_RANGES`] separate ranges.
    pub fn too_fragmented(&self, start: u64, end: u64) -> bool {
        let touches = self.ranges.iter().any(|&(s, e)| e == start || s == end);
        self.ranges.len() >= MAX_RANGES && !touches && start < end
    }

    /// A landed range that overlaps `[start, end)`, if any (an empty range overlaps nothing).
    pub fn overlap(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        if start >= end {
            return None;
        }
        // The first range ending after `start` is the only one that can overlap first.
        let i = self.ranges.partition_point(|&(_, e)| e <= start);
        self.ranges.get(i).copied().filter(|&(s, _)| s < end)
    }

    /// Records `[start, end)`, which must not overlap a landed range (check with
    /// [`overlap`](Self::overlap) first). Empty ranges change nothing.
    pub fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        debug_assert!(self.overlap(start, end).is_none(), "[{start}, {end}) overlaps {:?}", self.ranges);
        self.total += end - start;
        let i = self.ranges.partition_point(|&(_, e)| e < start);
        let joins_left = i < self.ranges.len() && self.ranges[i].1 == start;
        let right = if joins_left { i + 1 } else { i };
        let joins_right = right < self.ranges.len() && self.ranges[right].0 == end;
        match (joins_left, joins_right) {
            (true, true) => {
                self.ranges[i].1 = self.ranges[right].1;
                self.ranges.remove(right);
            }
            (true, false) => self.ranges[i].1 = end,
            (false, true) => self.ranges[right].0 = start,
            (false, false) => self.ranges.insert(i, (start, end)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a byte map: a write is refused exactly when it overlaps a landed byte, a range
        /// is contained exactly when all its bytes landed, the total is the number of landed
        /// bytes; the ranges stay sorted, disjoint and merged.
        #[test]
        fn matches_a_byte_map(writes in proptest::collection::vec((0u64..64, 0u64..16), 0..40)) {
            let mut e = Extents::default();
            let mut map = [false; 80];
            for (start, len) in writes {
                let end = start + len;
                let taken = (start..end).any(|b| map[b as usize]);
                prop_assert_eq!(e.overlap(start, end).is_some(), taken, "[{}, {}) vs {:?}", start, end, e.ranges);
                let whole = (start..end).all(|b| map[b as usize]);
                prop_assert_eq!(e.contains(start, end), whole, "contains [{}, {}) of {:?}", start, end, e.ranges);
                if !taken {
                    e.insert(start, end);
                    (start..end).for_each(|b| map[b as usize] = true);
                }
                prop_assert_eq!(e.total(), map.iter().filter(|&&b| b).count() as u64);
                prop_assert!(e.ranges.windows(2).all(|w| w[0].1 < w[1].0), "{:?}", e.ranges);
                prop_assert!(e.ranges.iter().all(|&(s, t)| s < t));
            }
        }
    }

    #[test]
    fn scattered_tiny_writes_are_bounded() {
        let mut e = Extents::default();
        for i in 0..MAX_RANGES as u64 {
            e.insert(2 * i, 2 * i + 1);
        }
        let end = 2 * MAX_RANGES as u64;
        assert!(e.too_fragmented(end + 1, end + 2), "one range more than the bound");
        assert!(!e.too_fragmented(end - 1, end), "a write that joins a range adds none");
        assert!(!e.too_fragmented(1, 2), "a write that fills a gap removes one");
        assert!(!e.covers_exactly(0, end));
    }

    #[test]
    fn halves_in_either_order_cover_the_region_once() {
        let mut e = Extents::default();
        e.insert(50, 100);
        assert_eq!(e.overlap(0, 51), Some((50, 100)));
        assert_eq!(e.overlap(0, 50), None);
        e.insert(0, 50);
        assert_eq!((e.total(), e.ranges.as_slice()), (100, &[(0, 100)][..]));
        assert!(e.covers_exactly(0, 100) && !e.covers_exactly(0, 99));
    }
}
