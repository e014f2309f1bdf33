//! Per-request state items (Mamba/GDN conv and SSM states, one slot per request per layer) under a
//! TP change: which bytes of a prefill rank's slot go where in a decode rank's slot. Pure.
//!
//! An item is `outer` rows of `dim` elements. Sharded, each TP rank holds a contiguous share of
//! every row: `dim` may be a concatenation of groups (a conv state's key, key, value) each sharded
//! on its own, so rank `r` of `tp` holds, per row, `[r·g/tp, (r+1)·g/tp)` of every group `g`,
//! groups back to back. A replicated item is whole on every rank and goes once, to decode rank `d`
//! from prefill TP rank `⌊d · prefill_tp / decode_tp⌋`: the first prefill rank feeding `d` (the
//! one that sends its first head group, with which a request's parts travel).

use crate::error::{Error, Result};

/// Largest `outer`, group count and group size accepted (a plan is at most `outer × groups`
/// ranges, before merging).
pub const MAX_OUTER: u32 = 1 << 20;
pub const MAX_GROUPS: usize = 64;
/// Largest item (all ranks' shares together).
pub const MAX_SLOT_BYTES: u64 = 1 << 40;

/// The shape of one state item (one slot of one layer), the same on both sides but for the TP
/// rank's share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateItem {
    /// Rows of the item.
    pub outer: u32,
    /// Global elements of each group of a row (one group: the whole `dim`).
    pub groups: Vec<u32>,
    pub dtype_bytes: u32,
    /// Whole on every rank (nothing to shard).
    pub replicated: bool,
}

/// `len` bytes at `src` in the prefill slot go to `dst` in the decode slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

fn check_tp(name: &str, tp: u32, rank_name: &str, rank: u32) -> Result<()> {
    if tp == 0 {
        return Err(Error::invalid_arg(name, "is 0"));
    }
    if rank >= tp {
        return Err(Error::invalid_arg(rank_name, format!("{rank} is not below {name} {tp}")));
    }
    Ok(())
}

impl StateItem {
    /// Checks the item against both TP sizes: every group divides among the ranks of each side.
    pub fn validate(&self, src_tp: u32, dst_tp: u32) -> Result<()> {
        if self.outer == 0 || self.outer > MAX_OUTER {
            return Err(Error::invalid_arg("outer", format!("{} is outside 1..={MAX_OUTER}", self.outer)));
        }
        if self.dtype_bytes == 0 || self.dtype_bytes > 64 {
            return Err(Error::invalid_arg("dtype_bytes", format!("{} is outside 1..=64", self.dtype_bytes)));
        }
        if self.groups.is_empty() || self.groups.len() > MAX_GROUPS {
            return Err(Error::invalid_arg("num_groups", format!("{} is outside 1..={MAX_GROUPS}", self.groups.len())));
        }
        let elements: u64 = self.groups.iter().map(|&g| g as u64).sum();
        if self.outer as u64 * elements * self.dtype_bytes as u64 > MAX_SLOT_BYTES {
            return Err(Error::invalid_arg("outer", format!("{} rows of {elements} elements of {} bytes exceed {MAX_SLOT_BYTES} bytes", self.outer, self.dtype_bytes)));
        }
        for (i, &g) in self.groups.iter().enumerate() {
            if g == 0 {
                return Err(Error::invalid_arg(&format!("group_dims[{i}]"), "is 0"));
            }
            if self.replicated {
                continue;
            }
            for (side, tp) in [("src_tp", src_tp), ("dst_tp", dst_tp)] {
                if !g.is_multiple_of(tp) {
                    return Err(Error::invalid_arg(
                        &format!("group_dims[{i}]"),
                        format!("{g} elements do not split among {side} {tp} ranks (a sharded group must be a multiple of both TP sizes)"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Elements of one row on a rank of `tp` (the whole row when replicated).
    pub fn local_dim(&self, tp: u32) -> u64 {
        let share = if self.replicated { 1 } else { tp as u64 };
        self.groups.iter().map(|&g| g as u64 / share).sum()
    }

    /// Bytes of one slot on a rank of `tp`.
    pub fn slot_bytes(&self, tp: u32) -> u64 {
        self.outer as u64 * self.local_dim(tp) * self.dtype_bytes as u64
    }
}

/// The prefill rank that sends a replicated item to decode rank `dst_rank`.
pub(crate) fn replica_source(src_tp: u32, dst_tp: u32, dst_rank: u32) -> u32 {
    (dst_rank as u64 * src_tp as u64 / dst_tp as u64) as u32
}

/// What prefill rank `src_rank` of `src_tp` sends of its slot into decode rank `dst_rank`'s slot
/// (of `dst_tp`): byte ranges in row order, adjacent ones merged. Empty when the two ranks share
/// no element (a sharded item whose shares do not overlap, or a replicated item this prefill rank
/// is not the designated sender of).
pub fn state_slice(item: &StateItem, src_tp: u32, dst_tp: u32, src_rank: u32, dst_rank: u32) -> Result<Vec<ByteRange>> {
    check_tp("src_tp", src_tp, "src_rank", src_rank)?;
    check_tp("dst_tp", dst_tp, "dst_rank", dst_rank)?;
    item.validate(src_tp, dst_tp)?;
    let b = item.dtype_bytes as u64;
    if item.replicated {
        if replica_source(src_tp, dst_tp, dst_rank) != src_rank {
            return Ok(Vec::new());
        }
        return Ok(vec![ByteRange { src: 0, dst: 0, len: item.slot_bytes(1) }]);
    }
    let (src_row, dst_row) = (item.local_dim(src_tp), item.local_dim(dst_tp));
    let mut out: Vec<ByteRange> = Vec::new();
    for row in 0..item.outer as u64 {
        let (mut src_group, mut dst_group) = (0u64, 0u64);
        for &g in &item.groups {
            let g = g as u64;
            let (src_share, dst_share) = (g / src_tp as u64, g / dst_tp as u64);
            let (src_lo, dst_lo) = (src_rank as u64 * src_share, dst_rank as u64 * dst_share);
            let (lo, hi) = (src_lo.max(dst_lo), (src_lo + src_share).min(dst_lo + dst_share));
            if lo < hi {
                let range = ByteRange {
                    src: (row * src_row + src_group + lo - src_lo) * b,
                    dst: (row * dst_row + dst_group + lo - dst_lo) * b,
                    len: (hi - lo) * b,
                };
                match out.last_mut() {
                    Some(last) if last.src + last.len == range.src && last.dst + last.len == range.dst => last.len += range.len,
                    _ => out.push(range),
                }
            }
            src_group += src_share;
            dst_group += dst_share;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The naive reference, element by element from the global item: for every element, the
    /// (rank, byte offset) holding it on each side; the pairs of `src_rank` and `dst_rank`.
    fn reference(item: &StateItem, src_tp: u32, dst_tp: u32, src_rank: u32, dst_rank: u32) -> Vec<(u64, u64)> {
        let dim: u64 = item.groups.iter().map(|&g| g as u64).sum();
        // Where global element `e` of a row sits on a side of `tp` ranks: (rank, index in its row).
        let place = |e: u64, tp: u32| -> (u32, u64) {
            if item.replicated {
                return (u32::MAX, e);
            }
            let (mut start, mut local_start) = (0u64, 0u64);
            for &g in &item.groups {
                let g = g as u64;
                let share = g / tp as u64;
                if e < start + g {
                    let within = e - start;
                    return ((within / share) as u32, local_start + within % share);
                }
                start += g;
                local_start += share;
            }
            unreachable!("element {e} past the row")
        };
        let b = item.dtype_bytes as u64;
        let mut pairs = Vec::new();
        // The first prefill rank whose share of a sharded item overlaps the decode rank's.
        let sends_replica = (0..src_tp).find(|&r| r * dst_tp + dst_tp > dst_rank * src_tp) == Some(src_rank);
        for row in 0..item.outer as u64 {
            for e in 0..dim {
                let (sr, si) = place(e, src_tp);
                let (dr, di) = place(e, dst_tp);
                let ours = if item.replicated { sends_replica } else { sr == src_rank && dr == dst_rank };
                if ours {
                    let (src_row, dst_row) = (item.local_dim(src_tp), item.local_dim(dst_tp));
                    for byte in 0..b {
                        pairs.push(((row * src_row + si) * b + byte, (row * dst_row + di) * b + byte));
                    }
                }
            }
        }
        pairs.sort_unstable();
        pairs
    }

    fn expand(ranges: &[ByteRange]) -> Vec<(u64, u64)> {
        let mut pairs: Vec<(u64, u64)> = ranges.iter().flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i))).collect();
        pairs.sort_unstable();
        pairs
    }

    fn tp() -> impl Strategy<Value = u32> {
        prop_oneof![Just(1u32), Just(2), Just(4), Just(8), Just(16)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// Every TP pair in {1, 2, 4, 8, 16} either way, rows, groups, element sizes, replication:
        /// the plan moves exactly the bytes the element-wise reference says, each once; every
        /// decode byte comes from exactly one prefill rank, every prefill byte goes somewhere.
        #[test]
        fn the_plan_matches_the_element_wise_reference(
            src_tp in tp(),
            dst_tp in tp(),
            outer in 1u32..4,
            group_units in proptest::collection::vec(1u32..4, 1..4),
            dtype_bytes in prop_oneof![Just(1u32), Just(2), Just(4)],
            replicated in prop::bool::weighted(0.2),
            ranks in (any::<u32>(), any::<u32>()),
        ) {
            let unit = src_tp.max(dst_tp);
            let item = StateItem { outer, groups: group_units.iter().map(|u| u * unit).collect(), dtype_bytes, replicated };
            let (src_rank, dst_rank) = (ranks.0 % src_tp, ranks.1 % dst_tp);
            let plan = state_slice(&item, src_tp, dst_tp, src_rank, dst_rank).unwrap();
            prop_assert_eq!(expand(&plan), reference(&item, src_tp, dst_tp, src_rank, dst_rank));
            for r in &plan {
                prop_assert!(r.src + r.len <= item.slot_bytes(src_tp) && r.dst + r.len <= item.slot_bytes(dst_tp));
            }
            // Assembled from every prefill rank, a decode slot is covered exactly once.
            let mut covered = vec![0u8; item.slot_bytes(dst_tp) as usize];
            for rs in 0..src_tp {
                for r in state_slice(&item, src_tp, dst_tp, rs, dst_rank).unwrap() {
                    for i in r.dst..r.dst + r.len {
                        covered[i as usize] += 1;
                    }
                }
            }
            prop_assert!(covered.iter().all(|&c| c == 1), "decode slot coverage {:?}", covered);
        }
    }

    #[test]
    fn equal_tp_is_one_copy_and_groups_shard_separately() {
        let conv = StateItem { outer: 4, groups: vec![8, 8, 16], dtype_bytes: 2, replicated: false };
        assert_eq!(state_slice(&conv, 2, 2, 1, 1).unwrap(), vec![ByteRange { src: 0, dst: 0, len: conv.slot_bytes(2) }]);
        // Prefill TP 2 → decode TP 1: rank 1 holds elements 4..8, 12..16 and 24..32 of each row.
        let plan = state_slice(&conv, 2, 1, 1, 0).unwrap();
        assert_eq!(plan.len(), 4 * 3);
        assert_eq!(plan[0], ByteRange { src: 0, dst: 4 * 2, len: 4 * 2 });
        assert_eq!(plan[2], ByteRange { src: 8 * 2, dst: 24 * 2, len: 8 * 2 });
        // Decode TP 4 from prefill TP 2: decode rank 3 takes the second half of rank 1's shares.
        assert!(state_slice(&conv, 2, 4, 0, 3).unwrap().is_empty());
        assert_eq!(state_slice(&conv, 2, 4, 1, 3).unwrap()[0], ByteRange { src: 2 * 2, dst: 0, len: 2 * 2 });
    }

    #[test]
    fn a_replicated_item_goes_once_and_bad_shapes_name_the_field() {
        let ssm = StateItem { outer: 2, groups: vec![6], dtype_bytes: 4, replicated: true };
        assert_eq!(state_slice(&ssm, 4, 8, 2, 5).unwrap(), vec![ByteRange { src: 0, dst: 0, len: 48 }]);
        assert!(state_slice(&ssm, 4, 8, 1, 5).unwrap().is_empty());
        assert_eq!(state_slice(&ssm, 8, 2, 4, 1).unwrap().len(), 1);
        let odd = StateItem { outer: 2, groups: vec![8, 6], dtype_bytes: 2, replicated: false };
        let e = state_slice(&odd, 4, 2, 0, 0).unwrap_err();
        assert!(e.message().contains("group_dims[1]") && e.message().contains("6 elements") && e.message().contains("src_tp 4"), "{}", e.message());
        assert!(state_slice(&odd, 2, 2, 2, 0).unwrap_err().message().contains("`src_rank`"));
    }
}
