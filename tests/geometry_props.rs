//! Properties of the pure geometry functions against naive references written here.

use kvstage::geometry::{
    decode_ranks_for_prefill, grid_tokens, head_slice, plan_gather, prefill_ranks_for_decode, split_grid, staging_layout, staging_layout_stages,
    sends_its_heads, tp_writers_of, writers_per_chunk, Fingerprint, GridPiece, ModelKind, PoolShape,
};
use kvstage::Status;
use proptest::prelude::*;

/// TP sizes, some of which divide one another and some not (3 and 2, 6 and 4, 12 and 8).
const SIZES: [u32; 8] = [1, 2, 3, 4, 6, 8, 12, 16];
const HEADS: [u32; 7] = [1, 2, 4, 6, 8, 12, 32];

/// Whether a model of `h` KV heads splits over TP `tp`: one divides the other.
fn splits(h: u32, tp: u32) -> bool {
    h.is_multiple_of(tp) || tp.is_multiple_of(h)
}

/// Global heads of TP rank `r` of `tp`: floor(r·h/tp) + [0, max(1, h/tp)).
fn heads_of(r: u32, tp: u32, h: u32) -> Vec<u32> {
    let first = r * h / tp;
    (first..first + (h / tp).max(1)).collect()
}

/// The distinct sets of heads prefill ranks of `src_tp` hold that share a head with `dst_heads`:
/// the head groups a decode rank holding them must hear from, one writer each.
fn head_groups(h: u32, src_tp: u32, dst_heads: &[u32]) -> usize {
    let groups: std::collections::BTreeSet<Vec<u32>> = (0..src_tp).map(|r| heads_of(r, src_tp, h)).filter(|g| g.iter().any(|x| dst_heads.contains(x))).collect();
    groups.len()
}

/// Every TP pair (whether or not one size divides the other), every head count, every rank pair:
/// the slice copies identical global heads, the writers that send cover each head of a decode
/// rank exactly once (prefill-side replication sends one copy), and unpaired ranks are refused.
#[test]
fn head_mapping_moves_the_right_heads_for_every_tp_pair() {
    for &h in &HEADS {
        for &src_tp in &SIZES {
            for &dst_tp in &SIZES {
                if !splits(h, src_tp) || !splits(h, dst_tp) {
                    let e = head_slice(src_tp, dst_tp, 0, 0, h).unwrap_err();
                    assert!(e.message().contains("`total_kv_heads`"), "H={h} P{src_tp}->D{dst_tp}: {}", e.message());
                    continue;
                }
                let per_rank: Vec<u32> = (0..dst_tp).map(|d| tp_writers_of(d, src_tp, dst_tp, h).unwrap()).collect();
                match writers_per_chunk(ModelKind::Mha, h, src_tp, dst_tp, 1, 1) {
                    Ok(w) => assert!(per_rank.iter().all(|&c| c == w), "H={h} P{src_tp}->D{dst_tp}: {w} vs {per_rank:?}"),
                    Err(e) => {
                        assert!(per_rank.iter().any(|&c| c != per_rank[0]), "H={h} P{src_tp}->D{dst_tp}: {}", e.message());
                        assert!(!src_tp.is_multiple_of(dst_tp) && !dst_tp.is_multiple_of(src_tp));
                    }
                }
                for d in 0..dst_tp {
                    let writers = per_rank[d as usize];
                    let dst_heads = heads_of(d, dst_tp, h);
                    let feeders = prefill_ranks_for_decode(d, src_tp, dst_tp).unwrap();
                    let mut covered = vec![0u32; dst_heads.len()];
                    let mut sending = 0;
                    for rs in 0..src_tp {
                        let paired = feeders.contains(&rs);
                        assert_eq!(decode_ranks_for_prefill(rs, src_tp, dst_tp).unwrap().contains(&d), paired);
                        let hs = match head_slice(src_tp, dst_tp, rs, d, h) {
                            Ok(hs) => hs,
                            Err(e) => {
                                assert!(!paired, "H={h} P{src_tp}->D{dst_tp} {rs}->{d}: {}", e.message());
                                assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
                                continue;
                            }
                        };
                        assert!(paired, "H={h} P{src_tp}->D{dst_tp}: unpaired {rs}->{d} accepted");
                        let src_heads = heads_of(rs, src_tp, h);
                        let n = hs.num_heads as usize;
                        assert!(hs.src_head_start as usize + n <= src_heads.len());
                        assert!(hs.dst_head_start as usize + n <= dst_heads.len());
                        for k in 0..n {
                            assert_eq!(
                                src_heads[hs.src_head_start as usize + k],
                                dst_heads[hs.dst_head_start as usize + k],
                                "H={h} P{src_tp}->D{dst_tp} {rs}->{d} head {k}"
                            );
                            if sends_its_heads(rs, d, src_tp, dst_tp, h) {
                                covered[hs.dst_head_start as usize + k] += 1;
                            }
                        }
                        sending += sends_its_heads(rs, d, src_tp, dst_tp, h) as u32;
                    }
                    assert!(covered.iter().all(|&c| c == 1), "H={h} P{src_tp}->D{dst_tp} decode {d}: copies per head {covered:?}");
                    assert_eq!(sending, writers, "H={h} P{src_tp}->D{dst_tp} decode {d}");
                    assert_eq!(sending as usize, head_groups(h, src_tp, &dst_heads), "H={h} P{src_tp}->D{dst_tp} decode {d}: one writer per head group");
                }
            }
        }
    }
}

/// Naive grid split: walk page by page, chunk = (page − prefix pages) / pages per chunk.
fn naive_split(start: usize, end: usize, ps: u32, prefix: u64, chunk_tokens: u32) -> Vec<GridPiece> {
    let per = ((chunk_tokens / ps).max(1)) as usize;
    let prefix_pages = (prefix / ps as u64) as usize;
    let mut out: Vec<GridPiece> = Vec::new();
    for p in start..end {
        let c = ((p - prefix_pages) / per) as u32;
        match out.last_mut() {
            Some(last) if last.chunk_index == c => last.pages.end = p + 1,
            _ => out.push(GridPiece { chunk_index: c, pages: p..p + 1, chunk_page_offset: ((p - prefix_pages) % per) as u32 }),
        }
    }
    if out.is_empty() {
        let c = ((start - prefix_pages) / per) as u32;
        out.push(GridPiece { chunk_index: c, pages: start..start, chunk_page_offset: ((start - prefix_pages) % per) as u32 });
    }
    out
}

fn shape_strategy() -> impl Strategy<Value = PoolShape> {
    (
        prop_oneof![Just(ModelKind::Mha), Just(ModelKind::Mla)],
        prop::sample::select(HEADS.to_vec()),
        prop::sample::select(SIZES.to_vec()),
        1u32..1000,
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(vec![1u32, 4, 16, 64]),
        prop::sample::subsequence((0u32..100).collect::<Vec<_>>(), 1..20),
        (0u32..16, 1u32..4),
    )
        .prop_map(|(kind, h, tp, d, b, ps, layers, (rank, pp))| {
            // A head count that splits over the TP size (12 heads over TP 8 do not: 8 over TP 8).
            let h = if kind == ModelKind::Mla { 1 } else if splits(h, tp) { h } else { tp };
            let s = PoolShape::new(kind, h, d, b, ps, 1).with_tp(rank % tp, tp);
            s.with_pp(rank % pp, pp, layers)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn grid_split_matches_a_page_walk(
        ps in prop::sample::select(vec![1u32, 4, 16, 64]),
        chunk_tokens in prop::sample::select(vec![1u32, 16, 64, 100, 8192, 8200]),
        prefix_pages in 0usize..40,
        start_off in 0usize..300,
        len in 0usize..300,
    ) {
        let start = prefix_pages + start_off;
        let pieces = split_grid(start, start + len, ps, prefix_pages as u64 * ps as u64, chunk_tokens).unwrap();
        prop_assert_eq!(&pieces, &naive_split(start, start + len, ps, prefix_pages as u64 * ps as u64, chunk_tokens));
        let g = grid_tokens(chunk_tokens, ps);
        prop_assert_eq!(g % ps, 0);
        prop_assert!(g >= ps && (g <= chunk_tokens || g == ps));
        for p in &pieces {
            prop_assert!(p.chunk_page_offset as usize + p.pages.len() <= (g / ps) as usize);
        }
    }

    #[test]
    fn fingerprint_round_trips(s in shape_strategy()) {
        s.validate().unwrap();
        let fp = Fingerprint::of(&s);
        let bytes = fp.encode();
        prop_assert_eq!(Fingerprint::decode(&bytes).unwrap(), fp.clone());
        prop_assert!(fp.diff(&fp).is_empty());
        // Every truncation is a protocol error, never a panic.
        for cut in 0..bytes.len() {
            prop_assert_eq!(Fingerprint::decode(&bytes[..cut]).unwrap_err().code(), Status::KVSTAGE_E_PROTOCOL);
        }
    }

    #[test]
    fn fingerprint_decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..80), flip in any::<(usize, u8)>(), s in shape_strategy()) {
        if let Err(e) = Fingerprint::decode(&bytes) {
            prop_assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL);
        }
        let mut enc = Fingerprint::of(&s).encode();
        let i = flip.0 % enc.len();
        enc[i] ^= flip.1 | 1;
        match Fingerprint::decode(&enc) {
            Ok(fp) => prop_assert!(fp.shape.validate().is_ok()),
            Err(e) => prop_assert_eq!(e.code(), Status::KVSTAGE_E_PROTOCOL),
        }
    }

    #[test]
    fn fingerprint_diff_names_exactly_the_changed_fields(s in shape_strategy(), which in 0usize..3, page_size in prop::sample::select(vec![1u32, 16, 64])) {
        let mut t = s.clone();
        t.page_size = page_size; // page sizes may differ: never a difference
        let field = match which {
            0 => { t.head_dim += 1; "head_dim" }
            1 => { t.dtype_bytes = if t.dtype_bytes == 4 { 2 } else { 4 }; "dtype_bytes" }
            _ => { t.kind = if t.kind == ModelKind::Mha { ModelKind::Mla } else { ModelKind::Mha }; "model_kind" }
        };
        let list = Fingerprint::of(&s).diff(&Fingerprint::of(&t));
        prop_assert_eq!(list.len(), 1);
        prop_assert_eq!(&list[0].field, field);
    }

    /// Staging sizes against the closed form (the decode rank's distinct heads, once), and the
    /// plan's coalescing against a naive run count.
    #[test]
    fn staging_sizes_and_plan_runs(
        h in prop::sample::select(HEADS.to_vec()),
        src_tp in prop::sample::select(SIZES.to_vec()),
        dst_tp in prop::sample::select(SIZES.to_vec()),
        d in 1u32..300,
        b in prop::sample::select(vec![1u32, 2, 4]),
        ps in prop::sample::select(vec![1u32, 4, 16, 64]),
        layers in 1u32..100,
        pages in prop::collection::vec(0u32..64, 0..40),
    ) {
        prop_assume!(splits(h, src_tp) && splits(h, dst_tp));
        let base = PoolShape::new(ModelKind::Mha, h, d, b, ps, layers);
        let dst = base.clone().with_tp(dst_tp - 1, dst_tp);
        let src_rank = prefill_ranks_for_decode(dst_tp - 1, src_tp, dst_tp).unwrap().start;
        let src = base.with_tp(src_rank, src_tp);
        let tokens = pages.len() as u32 * ps;
        let st = staging_layout_stages(std::slice::from_ref(&src), &dst, tokens).unwrap();
        prop_assert_eq!(staging_layout(&src, &dst, tokens).unwrap().total_bytes, st.total_bytes);
        // One writer per distinct head group: prefill-side replication sends each head once.
        prop_assert_eq!(st.writers.len(), head_groups(h, src_tp, &heads_of(dst_tp - 1, dst_tp, h)));
        // The wire carries the decode rank's distinct heads, no more.
        prop_assert_eq!(st.total_bytes, tokens as u64 * dst.local_heads as u64 * d as u64 * b as u64 * layers as u64 * 2);
        let slab = |n: u32| tokens as u64 * n as u64 * d as u64 * b as u64;
        let mut offset = 0;
        for (i, r) in st.writers.iter().enumerate() {
            let n = r.heads.num_heads;
            prop_assert_eq!((r.offset, r.bytes), (offset, slab(n) * layers as u64 * 2));
            prop_assert_eq!(st.slab_offset(i as u32, 1, layers - 1), r.offset + r.bytes - slab(n));
            offset += r.bytes;
        }
        prop_assert_eq!(st.writers.iter().map(|r| r.heads.num_heads).sum::<u32>(), dst.local_heads);
        let writer = st.writer_for(&src).unwrap().unwrap();
        let plan = plan_gather(&src, &pages, 0, &st, &st.writers[writer as usize]).unwrap();
        let runs = pages.windows(2).filter(|p| p[1] != p[0].wrapping_add(1)).count() + usize::from(!pages.is_empty());
        prop_assert_eq!(plan.run_count(), runs * 2 * layers as usize);
        let region = &st.writers[writer as usize];
        prop_assert_eq!(plan.rows[0].contiguous(), region.heads.num_heads == src.local_heads);
        prop_assert_eq!(plan.bytes(), region.bytes);
        let all_rows: u64 = plan.runs().map(|r| r.rows * r.row_bytes()).sum();
        prop_assert_eq!(all_rows, region.bytes);
    }
}
