//! Head mapping and rank pairing between a prefill (source) and a decode (destination) side.

use std::ops::Range;

use super::limits::{MAX_HEADS, MAX_PARALLEL};
use super::ModelKind;
use crate::error::{Error, Result};

/// Which heads one prefill rank sends to one decode rank, in local head units of each side:
/// source heads `[src_head_start, src_head_start + num_heads)` land in destination heads
/// `[dst_head_start, dst_head_start + num_heads)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct HeadSlice {
    pub src_head_start: u32,
    pub num_heads: u32,
    pub dst_head_start: u32,
}

impl HeadSlice {
    /// The slice of an MLA pair: the whole latent vector.
    pub const MLA: HeadSlice = HeadSlice { src_head_start: 0, num_heads: 1, dst_head_start: 0 };
}

fn check_size(name: &str, size: u32) -> Result<()> {
    if size == 0 || size > MAX_PARALLEL {
        return Err(Error::invalid_arg(name, format!("{size} is outside 1..={MAX_PARALLEL}")));
    }
    Ok(())
}

fn check_rank(name: &str, rank: u32, size_name: &str, size: u32) -> Result<()> {
    if rank >= size {
        return Err(Error::invalid_arg(name, format!("{rank} is not below {size_name} {size}")));
    }
    Ok(())
}

/// The larger of two parallel sizes must be a multiple of the smaller (pipeline stages).
fn check_ratio(src_name: &str, src: u32, dst_name: &str, dst: u32) -> Result<u32> {
    check_sizes(src_name, src, dst_name, dst)?;
    let (big, small) = if src >= dst { (src, dst) } else { (dst, src) };
    if big % small != 0 {
        return Err(Error::invalid_arg(
            if src >= dst { src_name } else { dst_name },
            format!("{src_name} {src} and {dst_name} {dst} are not multiples of one another"),
        ));
    }
    Ok(big / small)
}

fn check_sizes(src_name: &str, src: u32, dst_name: &str, dst: u32) -> Result<()> {
    check_size(src_name, src)?;
    check_size(dst_name, dst)
}

/// TP sizes pair whatever their ratio (P3→D2 as well as P4→D2): both must divide the head count
/// or be multiples of it.
fn check_tp(src_tp: u32, dst_tp: u32, total_heads: u32) -> Result<()> {
    check_sizes("src_tp", src_tp, "dst_tp", dst_tp)?;
    check_heads(total_heads, "src_tp", src_tp)?;
    check_heads(total_heads, "dst_tp", dst_tp)
}

/// The model's KV heads TP rank `rank` of `tp` holds: `H / tp` consecutive heads, or the one head
/// it replicates when `tp > H`.
pub fn held_heads(rank: u32, tp: u32, total_heads: u32) -> Range<u32> {
    let (r, tp, h) = (rank as u64, tp as u64, total_heads as u64);
    if tp <= h {
        (r * h / tp) as u32..((r + 1) * h / tp) as u32
    } else {
        let head = (r * h / tp) as u32;
        head..head + 1
    }
}

/// The ranks of a side of size `to` whose share of the model overlaps the share of rank `rank`
/// of size `from`: `[⌊rank·to/from⌋, ⌈(rank+1)·to/from⌉)`. Every TP rank holds the same fraction
/// of the heads, so this is the set of ranks it exchanges heads with, whatever the two sizes.
fn overlapping(rank: u32, from: u32, to: u32) -> Range<u32> {
    let (r, from, to) = (rank as u64, from as u64, to as u64);
    (r * to / from) as u32..((r + 1) * to).div_ceil(from) as u32
}

fn check_heads(total_heads: u32, tp_name: &str, tp: u32) -> Result<()> {
    if total_heads == 0 || total_heads > MAX_HEADS {
        return Err(Error::invalid_arg("total_kv_heads", format!("{total_heads} is outside 1..={MAX_HEADS}")));
    }
    if !total_heads.is_multiple_of(tp) && !tp.is_multiple_of(total_heads) {
        return Err(Error::invalid_arg(
            "total_kv_heads",
            format!("{total_heads} and {tp_name} {tp} do not divide each other"),
        ));
    }
    Ok(())
}

/// The head slice prefill rank `src_rank` (of `src_tp`) sends to decode rank `dst_rank` (of
/// `dst_tp`) for a model with `total_heads` KV heads (docs/GEOMETRY.md, "Head mapping"): the
/// heads both hold ([`held_heads`]), in each side's local units. The TP sizes need not divide one
/// another (P3→D2 with 12 heads: prefill rank 1 sends its heads 0..2 to decode rank 0's 4..6 and
/// its 2..4 to decode rank 1's 0..2).
///
/// Errors (`KVSTAGE_E_INVALID_ARG`, naming the argument): zero or huge sizes, ranks not below their
/// size, head counts that do not divide a TP size (either way), and a rank pair that does not
/// exchange data (`src_rank` is not a writer of `dst_rank`).
pub fn head_slice(src_tp: u32, dst_tp: u32, src_rank: u32, dst_rank: u32, total_heads: u32) -> Result<HeadSlice> {
    check_tp(src_tp, dst_tp, total_heads)?;
    check_rank("src_rank", src_rank, "src_tp", src_tp)?;
    check_rank("dst_rank", dst_rank, "dst_tp", dst_tp)?;
    let feeders = overlapping(dst_rank, dst_tp, src_tp);
    if !feeders.contains(&src_rank) {
        return Err(if feeders.len() > 1 {
            Error::invalid_arg(
                "src_rank",
                format!("prefill rank {src_rank} does not write to decode rank {dst_rank} (its writers are prefill ranks {}..{})", feeders.start, feeders.end),
            )
        } else {
            Error::invalid_arg("dst_rank", format!("decode rank {dst_rank} reads prefill rank {}, not prefill rank {src_rank}", feeders.start))
        });
    }
    let (src, dst) = (held_heads(src_rank, src_tp, total_heads), held_heads(dst_rank, dst_tp, total_heads));
    let start = src.start.max(dst.start);
    Ok(HeadSlice { src_head_start: start - src.start, num_heads: src.end.min(dst.end) - start, dst_head_start: start - dst.start })
}

/// Whether MHA prefill rank `src_rank`, one of decode rank `dst_rank`'s TP sources, sends its
/// heads. With prefill-side GQA replication (`src_tp > total_heads`) `src_tp / total_heads`
/// consecutive prefill ranks hold the same head; of those feeding one decode rank only the first
/// sends it (each head crosses the wire once), the others have nothing to send there.
pub fn sends_its_heads(src_rank: u32, dst_rank: u32, src_tp: u32, dst_tp: u32, total_heads: u32) -> bool {
    let first = overlapping(dst_rank, dst_tp, src_tp).start;
    src_rank == first || src_rank == 0 || held_heads(src_rank - 1, src_tp, total_heads) != held_heads(src_rank, src_tp, total_heads)
}

/// TP writers of MHA decode rank `dst_rank`: the prefill ranks feeding it
/// ([`prefill_ranks_for_decode`]) that send their heads, one per distinct head group
/// ([`sends_its_heads`]).
pub fn tp_writers_of(dst_rank: u32, src_tp: u32, dst_tp: u32, total_heads: u32) -> Result<u32> {
    check_tp(src_tp, dst_tp, total_heads)?;
    check_rank("dst_rank", dst_rank, "dst_tp", dst_tp)?;
    Ok(senders(dst_rank, src_tp, dst_tp, total_heads))
}

/// [`tp_writers_of`] for arguments already checked.
fn senders(dst_rank: u32, src_tp: u32, dst_tp: u32, total_heads: u32) -> u32 {
    overlapping(dst_rank, dst_tp, src_tp).filter(|&rs| sends_its_heads(rs, dst_rank, src_tp, dst_tp, total_heads)).count() as u32
}

/// TP writers per MHA decode rank when every decode rank has as many:
/// `max(1, (src_tp / dst_tp) / max(1, src_tp / total_heads))` when one size divides the other.
/// Where neither does, decode ranks can differ (P2→D3 with 12 heads: 1, 2, 1); that is refused,
/// naming the counts: the layout of a decode rank ([`tp_writers_of`]) has its own.
pub fn tp_writers(src_tp: u32, dst_tp: u32, total_heads: u32) -> Result<u32> {
    check_tp(src_tp, dst_tp, total_heads)?;
    let counts: Vec<u32> = (0..dst_tp).map(|d| senders(d, src_tp, dst_tp, total_heads)).collect();
    if counts.iter().any(|&c| c != counts[0]) {
        return Err(Error::invalid_arg(
            "dst_tp",
            format!(
                "src_tp {src_tp} and dst_tp {dst_tp} with {total_heads} KV heads: decode ranks take {counts:?} head groups (neither TP size divides the other); ask the staging layout of each decode rank"
            ),
        ));
    }
    Ok(counts[0])
}

/// PP writers per decode rank: `src_pp / dst_pp` when prefill has more stages, else 1.
pub fn pp_writers(src_pp: u32, dst_pp: u32) -> Result<u32> {
    let ratio = check_ratio("src_pp", src_pp, "dst_pp", dst_pp)?;
    Ok(if src_pp > dst_pp { ratio } else { 1 })
}

/// Writers expected per chunk on a decode rank: `tp_writers × pp_writers` for MHA, `pp_writers`
/// for MLA (one designated TP writer, see [`mla_source_rank`]).
pub fn writers_per_chunk(kind: ModelKind, total_heads: u32, src_tp: u32, dst_tp: u32, src_pp: u32, dst_pp: u32) -> Result<u32> {
    let tw = tp_writers(src_tp, dst_tp, total_heads)?; // checks the TP sizes for MLA too
    let tw = if kind == ModelKind::Mla { 1 } else { tw };
    Ok(tw * pp_writers(src_pp, dst_pp)?)
}

/// Prefill TP ranks that write to MHA decode rank `dst_rank`: those whose heads overlap its heads,
/// `[⌊d·src_tp/dst_tp⌋, ⌈(d+1)·src_tp/dst_tp⌉)`: `[d·r, (d+1)·r)` when prefill is larger by a ratio
/// `r`, the single rank `d / r` when smaller, and one or two ranks where neither size divides the
/// other (P3→D2: decode rank 0 reads prefill ranks 0 and 1).
pub fn prefill_ranks_for_decode(dst_rank: u32, src_tp: u32, dst_tp: u32) -> Result<Range<u32>> {
    check_sizes("src_tp", src_tp, "dst_tp", dst_tp)?;
    check_rank("dst_rank", dst_rank, "dst_tp", dst_tp)?;
    Ok(overlapping(dst_rank, dst_tp, src_tp))
}

/// Decode TP ranks MHA prefill rank `src_rank` writes to (the inverse of
/// [`prefill_ranks_for_decode`]).
pub fn decode_ranks_for_prefill(src_rank: u32, src_tp: u32, dst_tp: u32) -> Result<Range<u32>> {
    check_sizes("src_tp", src_tp, "dst_tp", dst_tp)?;
    check_rank("src_rank", src_rank, "src_tp", src_tp)?;
    Ok(overlapping(src_rank, src_tp, dst_tp))
}

/// Prefill PP ranks that write to decode PP rank `dst_pp_rank` (same rule as TP: stages are split
/// into contiguous layer blocks on both sides).
pub fn prefill_pp_ranks_for_decode(dst_pp_rank: u32, src_pp: u32, dst_pp: u32) -> Result<Range<u32>> {
    check_ratio("src_pp", src_pp, "dst_pp", dst_pp)?;
    check_rank("dst_pp_rank", dst_pp_rank, "dst_pp", dst_pp)?;
    Ok(overlapping(dst_pp_rank, dst_pp, src_pp))
}

/// Decode PP ranks prefill PP rank `src_pp_rank` writes to.
pub fn decode_pp_ranks_for_prefill(src_pp_rank: u32, src_pp: u32, dst_pp: u32) -> Result<Range<u32>> {
    check_ratio("src_pp", src_pp, "dst_pp", dst_pp)?;
    check_rank("src_pp_rank", src_pp_rank, "src_pp", src_pp)?;
    Ok(overlapping(src_pp_rank, src_pp, dst_pp))
}

/// The one prefill TP rank that writes to MLA decode rank `dst_rank` (the latent is replicated on
/// every TP rank, so one copy suffices): `dst_rank mod src_tp`. Other prefill ranks send nothing.
pub fn mla_source_rank(dst_rank: u32, src_tp: u32, dst_tp: u32) -> Result<u32> {
    check_sizes("src_tp", src_tp, "dst_tp", dst_tp)?;
    check_rank("dst_rank", dst_rank, "dst_tp", dst_tp)?;
    Ok(dst_rank % src_tp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    fn hs(src_tp: u32, dst_tp: u32, rs: u32, rd: u32, h: u32) -> HeadSlice {
        head_slice(src_tp, dst_tp, rs, rd, h).unwrap()
    }

    #[test]
    fn geometry_md_examples() {
        // P4→D2, H=8: n=2; dst_start for prefill ranks 0..3 = [0, 2, 0, 2].
        let starts: Vec<u32> = (0..4).map(|rs| hs(4, 2, rs, rs / 2, 8).dst_head_start).collect();
        assert_eq!(starts, [0, 2, 0, 2]);
        assert!((0..4).all(|rs| hs(4, 2, rs, rs / 2, 8).num_heads == 2 && hs(4, 2, rs, rs / 2, 8).src_head_start == 0));
        // P2→D4, H=8: n=2; src_start for decode ranks 0..3 = [0, 2, 0, 2].
        let starts: Vec<u32> = (0..4).map(|rd| hs(2, 4, rd / 2, rd, 8).src_head_start).collect();
        assert_eq!(starts, [0, 2, 0, 2]);
        assert!((0..4).all(|rd| hs(2, 4, rd / 2, rd, 8).num_heads == 2));
        // P1→D4, H=2 (replication): n=1; src_start for decode ranks 0..3 = [0, 0, 1, 1].
        let starts: Vec<u32> = (0..4).map(|rd| hs(1, 4, 0, rd, 2).src_head_start).collect();
        assert_eq!(starts, [0, 0, 1, 1]);
        assert!((0..4).all(|rd| hs(1, 4, 0, rd, 2).num_heads == 1));
        // Equal TP: (0, H/tp, 0).
        for tp in [1, 2, 4, 8] {
            for r in 0..tp {
                assert_eq!(hs(tp, tp, r, r, 8), HeadSlice { src_head_start: 0, num_heads: 8 / tp, dst_head_start: 0 });
            }
        }
    }

    #[test]
    fn replication_divides_rather_than_takes_modulo() {
        // P8→D2 with H=4: prefill ranks 0..3 feed decode rank 0 (heads 0,1), two ranks per head.
        let starts: Vec<u32> = (0..4).map(|rs| hs(8, 2, rs, 0, 4).dst_head_start).collect();
        assert_eq!(starts, [0, 0, 1, 1]);
        // P2→D8 with H=4: decode ranks 0..3 read prefill 0 (heads 0,1), two decode ranks per head.
        let starts: Vec<u32> = (0..4).map(|rd| hs(2, 8, 0, rd, 4).src_head_start).collect();
        assert_eq!(starts, [0, 0, 1, 1]);
    }

    #[test]
    fn pairing_and_writers() {
        assert_eq!(writers_per_chunk(ModelKind::Mha, 8, 4, 2, 1, 1).unwrap(), 2);
        assert_eq!(writers_per_chunk(ModelKind::Mha, 8, 2, 4, 1, 1).unwrap(), 1);
        assert_eq!(writers_per_chunk(ModelKind::Mha, 8, 8, 2, 4, 2).unwrap(), 8);
        assert_eq!(writers_per_chunk(ModelKind::Mha, 8, 8, 2, 1, 2).unwrap(), 4);
        assert_eq!(prefill_ranks_for_decode(1, 4, 2).unwrap(), 2..4);
        assert_eq!(prefill_ranks_for_decode(3, 2, 4).unwrap(), 1..2);
        assert_eq!(prefill_ranks_for_decode(3, 4, 4).unwrap(), 3..4);
        assert_eq!(decode_ranks_for_prefill(3, 4, 2).unwrap(), 1..2);
        assert_eq!(decode_ranks_for_prefill(1, 2, 4).unwrap(), 2..4);
        assert_eq!(prefill_pp_ranks_for_decode(1, 4, 2).unwrap(), 2..4);
        assert_eq!(prefill_pp_ranks_for_decode(1, 1, 2).unwrap(), 0..1);
        assert_eq!(decode_pp_ranks_for_prefill(0, 1, 2).unwrap(), 0..2);
        assert_eq!(decode_pp_ranks_for_prefill(3, 4, 2).unwrap(), 1..2);
        assert_eq!(mla_source_rank(5, 4, 8).unwrap(), 1);
        assert_eq!(mla_source_rank(1, 8, 2).unwrap(), 1);
        // Prefill-side replication: TP 8 with 4 KV heads into TP 2 sends each head once.
        assert_eq!(writers_per_chunk(ModelKind::Mha, 4, 8, 2, 1, 1).unwrap(), 2);
        let senders: Vec<u32> = (4..8).filter(|&rs| sends_its_heads(rs, 1, 8, 2, 4)).collect();
        assert_eq!(senders, [4, 6]);
        // TP 8 with 2 heads into TP 4: each decode rank holds one head, fed by two copies of it.
        assert_eq!(writers_per_chunk(ModelKind::Mha, 2, 8, 4, 1, 1).unwrap(), 1);
        assert_eq!((2..4).filter(|&rs| sends_its_heads(rs, 1, 8, 4, 2)).collect::<Vec<_>>(), [2]);
        assert_eq!(writers_per_chunk(ModelKind::Mla, 1, 8, 2, 2, 1).unwrap(), 2);
    }

    #[test]
    fn tp_sizes_that_do_not_divide_one_another() {
        // P3→D2, 12 heads: prefill ranks hold 0..4, 4..8, 8..12; decode ranks 0..6, 6..12.
        assert_eq!(prefill_ranks_for_decode(0, 3, 2).unwrap(), 0..2);
        assert_eq!(prefill_ranks_for_decode(1, 3, 2).unwrap(), 1..3);
        assert_eq!(decode_ranks_for_prefill(1, 3, 2).unwrap(), 0..2);
        assert_eq!(hs(3, 2, 0, 0, 12), HeadSlice { src_head_start: 0, num_heads: 4, dst_head_start: 0 });
        assert_eq!(hs(3, 2, 1, 0, 12), HeadSlice { src_head_start: 0, num_heads: 2, dst_head_start: 4 });
        assert_eq!(hs(3, 2, 1, 1, 12), HeadSlice { src_head_start: 2, num_heads: 2, dst_head_start: 0 });
        assert_eq!(hs(3, 2, 2, 1, 12), HeadSlice { src_head_start: 0, num_heads: 4, dst_head_start: 2 });
        assert_eq!(writers_per_chunk(ModelKind::Mha, 12, 3, 2, 1, 1).unwrap(), 2);
        // P2→D3, 12 heads: decode rank 1 (heads 4..8) reads both prefill ranks, the others one.
        assert_eq!((0..3).map(|d| tp_writers_of(d, 2, 3, 12).unwrap()).collect::<Vec<_>>(), [1, 2, 1]);
        assert_eq!(hs(2, 3, 0, 1, 12), HeadSlice { src_head_start: 4, num_heads: 2, dst_head_start: 0 });
        assert_eq!(hs(2, 3, 1, 1, 12), HeadSlice { src_head_start: 0, num_heads: 2, dst_head_start: 2 });
        // Replication on both sides, P8→D12 with 4 heads: decode rank 4 holds head 1, which
        // prefill ranks 2 and 3 both hold; rank 2 sends it.
        assert_eq!(prefill_ranks_for_decode(4, 8, 12).unwrap(), 2..4);
        assert_eq!((2..4).filter(|&rs| sends_its_heads(rs, 4, 8, 12, 4)).collect::<Vec<_>>(), [2]);
        assert_eq!(hs(8, 12, 3, 4, 4), HeadSlice { src_head_start: 0, num_heads: 1, dst_head_start: 0 });
        // MLA: decode rank d reads prefill rank d mod src_tp, whatever the sizes.
        assert_eq!(mla_source_rank(2, 3, 4).unwrap(), 2);
        assert_eq!(mla_source_rank(3, 3, 4).unwrap(), 0);
    }

    fn bad(r: Result<impl std::fmt::Debug>, name: &str, text: &str) {
        let e = r.expect_err("should fail");
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(e.message().contains(&format!("`{name}`")), "{} does not name {name}", e.message());
        assert!(e.message().contains(text), "{} lacks {text}", e.message());
    }

    #[test]
    fn every_head_slice_error_names_its_argument() {
        bad(head_slice(0, 2, 0, 0, 8), "src_tp", "0 is outside");
        bad(head_slice(2, 0, 0, 0, 8), "dst_tp", "0 is outside");
        bad(head_slice(1 << 17, 1, 0, 0, 8), "src_tp", "is outside");
        bad(head_slice(6, 4, 0, 0, 8), "total_kv_heads", "8 and src_tp 6 do not divide");
        bad(head_slice(4, 6, 0, 0, 8), "total_kv_heads", "8 and dst_tp 6 do not divide");
        bad(head_slice(3, 2, 2, 0, 12), "src_rank", "prefill rank 2 does not write to decode rank 0 (its writers are prefill ranks 0..2)");
        bad(head_slice(2, 3, 1, 0, 12), "dst_rank", "decode rank 0 reads prefill rank 0, not prefill rank 1");
        bad(writers_per_chunk(ModelKind::Mha, 12, 2, 3, 1, 1), "dst_tp", "decode ranks take [1, 2, 1] head groups");
        bad(head_slice(4, 2, 4, 0, 8), "src_rank", "4 is not below src_tp 4");
        bad(head_slice(4, 2, 0, 2, 8), "dst_rank", "2 is not below dst_tp 2");
        bad(head_slice(4, 2, 0, 0, 0), "total_kv_heads", "0 is outside");
        bad(head_slice(4, 2, 0, 0, 6), "total_kv_heads", "6 and src_tp 4 do not divide");
        bad(head_slice(1, 4, 0, 0, 6), "total_kv_heads", "6 and dst_tp 4 do not divide");
        bad(head_slice(4, 2, 2, 0, 8), "src_rank", "prefill rank 2 does not write to decode rank 0 (its writers are prefill ranks 0..2)");
        bad(head_slice(2, 4, 0, 2, 8), "dst_rank", "decode rank 2 reads prefill rank 1, not prefill rank 0");
        bad(writers_per_chunk(ModelKind::Mha, 8, 4, 2, 3, 2), "src_pp", "src_pp 3 and dst_pp 2");
        bad(prefill_ranks_for_decode(2, 4, 2), "dst_rank", "2 is not below dst_tp 2");
        bad(decode_ranks_for_prefill(4, 4, 2), "src_rank", "4 is not below src_tp 4");
        bad(mla_source_rank(2, 4, 2), "dst_rank", "2 is not below");
    }
}
