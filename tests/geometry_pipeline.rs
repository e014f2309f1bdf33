//! End-to-end reshard on host memory: fill every prefill pool with a position-unique pattern,
//! gather on every prefill rank, assemble each decode rank's staging allocation from all writers,
//! scatter on every decode rank, and compare every byte of every decode pool with a reference
//! written here, per element, from first principles (which global heads a rank holds), sharing no
//! code with the engine. The staging allocation itself is also compared byte for byte with the
//! layout src/geometry/staging.rs documents, and the slice path is checked against the same reference.
//! Pipeline stages split the layers at random on both sides (uneven, interleaved), writers reach
//! the decode rank in random order (regions are placed in arrival order), the two sides' page
//! sizes differ, the chunk starts inside a prefill page and may end inside a decode page.

use kvstage::copy::{CopyEngine, HostCopyEngine};
use kvstage::geometry::{
    head_slice, plan_gather, plan_scatter, slice_plan, staging_layout, HeadSlice, KvLayout, MemoryKind, ModelKind, PageSpan, PoolShape,
};
use proptest::prelude::*;

// ---------------------------------------------------------------- reference (naive, independent)

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The byte every correct transfer must deliver for (layer, buffer, global head, sequence token,
/// element, byte within the element).
fn pattern(layer: u32, kv: u32, head: u32, token: u64, elem: u32, byte: u32) -> u8 {
    let key = ((layer as u64) << 56) ^ ((kv as u64) << 52) ^ ((head as u64) << 44) ^ (token << 20) ^ ((elem as u64) << 4) ^ byte as u64;
    (mix(key) >> 17) as u8
}

/// Filler for bytes nobody may touch (rank-specific so a wrong source shows up as a mismatch).
fn noise(tag: u64, pos: usize) -> u8 {
    (mix(tag.wrapping_mul(0x1_0000_0001) ^ pos as u64) >> 9) as u8
}

/// Global KV heads held by TP rank `rank` of `tp` for a model with `h` heads: a rank holds
/// max(1, h/tp) consecutive heads starting at floor(rank·h/tp) (with tp > h, consecutive ranks
/// share a head).
fn global_heads_of(kind: ModelKind, rank: u32, tp: u32, h: u32) -> Vec<u32> {
    match kind {
        ModelKind::Mla => vec![0],
        ModelKind::Mha => {
            let per = if h >= tp { h / tp } else { 1 };
            let first = (rank as u64 * h as u64 / tp as u64) as u32;
            (first..first + per).collect()
        }
    }
}

struct Cfg {
    kind: ModelKind,
    heads: u32,
    head_dim: u32,
    dtype: u32,
    src_page_size: u32,
    dst_page_size: u32,
    /// The chunk: tokens `[first_token, first_token + tokens)` of `src_pages` (list token `t` in
    /// slot `t mod ps` of `src_pages[t / ps]`), tokens `[0, tokens)` of `dst_pages`.
    first_token: u32,
    tokens: u32,
    src_tp: u32,
    dst_tp: u32,
    /// Layer ids of each pipeline stage (every layer in exactly one stage of each side).
    src_split: Vec<Vec<u32>>,
    dst_split: Vec<Vec<u32>>,
    /// Shuffles the order in which writers reach each decode rank.
    arrival_seed: u64,
    capacity: u32,
    src_pages: Vec<u32>,
    dst_pages: Vec<u32>,
    threads: u32,
    /// Non-temporal stores for every plan (else plain memcpy: these plans are small).
    streaming: bool,
}

impl std::fmt::Debug for Cfg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} H={} D={} b={} ps={}->{} tokens {}+{} P{}x{:?}->D{}x{:?} arrival={} cap={} src={:?} dst={:?} threads={} streaming={}",
            self.kind,
            self.heads,
            self.head_dim,
            self.dtype,
            self.src_page_size,
            self.dst_page_size,
            self.first_token,
            self.tokens,
            self.src_tp,
            self.src_split,
            self.dst_tp,
            self.dst_split,
            self.arrival_seed,
            self.capacity,
            self.src_pages,
            self.dst_pages,
            self.threads,
            self.streaming
        )
    }
}

/// Contiguous equal blocks of `all`, one per stage.
fn even_split(all: &[u32], pp: usize) -> Vec<Vec<u32>> {
    all.chunks(all.len() / pp).map(<[u32]>::to_vec).collect()
}

fn local_heads(c: &Cfg, tp: u32) -> u32 {
    match c.kind {
        ModelKind::Mla => 1,
        ModelKind::Mha => (c.heads / tp).max(1),
    }
}

fn shape(c: &Cfg, page_size: u32, tp_rank: u32, tp: u32, pp_rank: usize, split: &[Vec<u32>]) -> PoolShape {
    PoolShape {
        kind: c.kind,
        page_size,
        local_heads: local_heads(c, tp),
        global_heads: c.heads,
        head_dim: c.head_dim,
        head_dim_v: c.head_dim,
        dtype_bytes: c.dtype,
        tp_rank,
        tp_size: tp,
        pp_rank: pp_rank as u32,
        pp_size: split.len() as u32,
        layer_ids: split[pp_rank].clone(),
    }
}

fn buffers_per_layer(c: &Cfg) -> u32 {
    if c.kind == ModelKind::Mla {
        1
    } else {
        2
    }
}

/// A rank's pool: one Vec holding every buffer back to back.
struct Pool {
    mem: Vec<u8>,
    layout: KvLayout,
    buffer_bytes: usize,
    slot_bytes: usize,
}

fn new_pool(c: &Cfg, shape: PoolShape, fill: impl Fn(usize) -> u8) -> Pool {
    let slot_bytes = (shape.local_heads * c.head_dim * c.dtype) as usize;
    let buffer_bytes = c.capacity as usize * shape.page_size as usize * slot_bytes;
    let nbuf = buffers_per_layer(c) as usize * shape.layer_ids.len();
    let mut mem: Vec<u8> = (0..buffer_bytes * nbuf).map(fill).collect();
    let base = mem.as_mut_ptr() as usize;
    let layout = KvLayout::new(shape, c.capacity as u64, MemoryKind::Host, (0..nbuf).map(|i| base + i * buffer_bytes).collect());
    Pool { mem, layout, buffer_bytes, slot_bytes }
}

/// Expected content of a pool of TP rank `tp_rank` holding `layers` after the transfer, byte by
/// byte: slot `t` of `pages[i]` holds sequence token `token_of(i·ps + t)` (none: it keeps
/// `filler`) with this rank's global heads; every other byte keeps `filler`.
#[allow(clippy::too_many_arguments)]
fn expected_pool(
    c: &Cfg,
    page_size: u32,
    tp_rank: u32,
    tp: u32,
    layers: &[u32],
    pages: &[u32],
    token_of: &dyn Fn(u64) -> Option<u64>,
    filler: &dyn Fn(usize) -> u8,
) -> Vec<u8> {
    let heads = global_heads_of(c.kind, tp_rank, tp, c.heads);
    let slot = heads.len() * (c.head_dim * c.dtype) as usize;
    let buffer = c.capacity as usize * page_size as usize * slot;
    let nbuf = buffers_per_layer(c) as usize * layers.len();
    let mut out: Vec<u8> = (0..buffer * nbuf).map(filler).collect();
    for kv in 0..buffers_per_layer(c) {
        for (li, &layer) in layers.iter().enumerate() {
            let b = kv as usize * layers.len() + li;
            for (i, &page) in pages.iter().enumerate() {
                for t in 0..page_size {
                    let Some(token) = token_of(i as u64 * page_size as u64 + t as u64) else { continue };
                    let slot_idx = page as usize * page_size as usize + t as usize;
                    for (hl, &g) in heads.iter().enumerate() {
                        for e in 0..c.head_dim {
                            for y in 0..c.dtype {
                                let at = b * buffer + slot_idx * slot + (hl * c.head_dim as usize + e as usize) * c.dtype as usize + y as usize;
                                out[at] = pattern(layer, kv, g, token, e, y);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// The regions of decode rank (d, q), in the order their prefill ranks (TP rank, stage) arrive:
/// (prefill TP rank, the decode layers it carries, the global heads it carries). Ranks that
/// write nothing here (other heads, a replica of heads an earlier rank sends, no shared layer)
/// have none.
fn expected_regions(c: &Cfg, d: u32, q: usize, arrivals: &[(u32, usize)]) -> Vec<(u32, Vec<u32>, Vec<u32>)> {
    // TP writers, in writer order, and the global heads each carries (prefill-side replicas of
    // heads another writer carries send nothing).
    let tp_srcs: Vec<u32> = match c.kind {
        ModelKind::Mla => vec![d % c.src_tp],
        ModelKind::Mha if c.src_tp > c.dst_tp => {
            // Each head crosses once: a feeding rank writes unless an earlier one holds its heads.
            let r = c.src_tp / c.dst_tp;
            let mut seen: Vec<Vec<u32>> = Vec::new();
            (d * r..(d + 1) * r)
                .filter(|&rs| {
                    let heads = global_heads_of(c.kind, rs, c.src_tp, c.heads);
                    let first = !seen.contains(&heads);
                    seen.push(heads);
                    first
                })
                .collect()
        }
        ModelKind::Mha => vec![d / (c.dst_tp / c.src_tp)],
    };
    let carried = |rs: u32| -> Vec<u32> {
        if c.kind == ModelKind::Mha && c.src_tp > c.dst_tp {
            global_heads_of(c.kind, rs, c.src_tp, c.heads) // the prefill rank's heads, all of them
        } else {
            global_heads_of(c.kind, d, c.dst_tp, c.heads) // the decode rank's heads, all of them
        }
    };
    // Each arriving writer's region: the decode rank's layers its stage holds, ascending.
    let dst_layers = &c.dst_split[q];
    arrivals
        .iter()
        .filter(|(rs, _)| tp_srcs.contains(rs))
        .map(|&(rs, j)| (rs, dst_layers.iter().copied().filter(|l| c.src_split[j].contains(l)).collect::<Vec<u32>>(), carried(rs)))
        .filter(|(_, block, _)| !block.is_empty())
        .collect()
}

/// The staging allocation of decode rank (d, q) as the staging layout specifies it, from scratch:
/// the regions back to back in arrival order, each `[K_l … | V_l …]` over its layers, a slab per
/// (buffer, layer) of tokens × heads × elements.
fn expected_staging(c: &Cfg, d: u32, q: usize, arrivals: &[(u32, usize)]) -> Vec<u8> {
    let tokens = c.first_token as u64..c.first_token as u64 + c.tokens as u64;
    let mut out = Vec::new();
    for (_, block, heads) in expected_regions(c, d, q, arrivals) {
        for kv in 0..buffers_per_layer(c) {
            for &layer in &block {
                for tok in tokens.clone() {
                    for &g in &heads {
                        for e in 0..c.head_dim {
                            for y in 0..c.dtype {
                                out.push(pattern(layer, kv, g, tok, e, y));
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

// ---------------------------------------------------------------- the pipeline under test

fn run(c: &Cfg) -> Result<(), TestCaseError> {
    let engine = HostCopyEngine::new(c.threads)
        .with_min_parallel_bytes(0)
        .with_streaming_min_bytes(if c.streaming { 0 } else { u64::MAX });
    // Prefill pools: pattern in the request's pages, noise everywhere else.
    let mut prefill = Vec::new();
    for j in 0..c.src_split.len() {
        for r in 0..c.src_tp {
            let s = shape(c, c.src_page_size, r, c.src_tp, j, &c.src_split);
            let tag = 1000 + (j as u32 * c.src_tp + r) as u64;
            let want = expected_pool(c, c.src_page_size, r, c.src_tp, &c.src_split[j], &c.src_pages, &Some, &|p| noise(tag, p));
            let mut pool = new_pool(c, s, |_| 0);
            pool.mem.copy_from_slice(&want);
            prefill.push(pool);
        }
    }
    let any_src = prefill[0].layout.shape.clone();
    let tokens = c.tokens;
    let src_span = PageSpan { pages: &c.src_pages, first_token: c.first_token, tokens: tokens as u64 };
    let dst_span = PageSpan { pages: &c.dst_pages, first_token: 0, tokens: tokens as u64 };
    // Decode slot `j` of the chunk's pages holds list token `first_token + j` of the prefill pages.
    let dst_token = |j: u64| (j < tokens as u64).then_some(c.first_token as u64 + j);
    for q in 0..c.dst_split.len() {
        for d in 0..c.dst_tp {
            let dst_shape = shape(c, c.dst_page_size, d, c.dst_tp, q, &c.dst_split);
            let tag = 5000 + (q as u32 * c.dst_tp + d) as u64;
            let mut st = staging_layout(&any_src, &dst_shape, tokens).map_err(|e| TestCaseError::fail(e.chain()))?;
            // Prefill ranks reach the decode rank in a random order; each one that writes here
            // is placed, gathers, and "writes" into the allocation.
            let mut order: Vec<&Pool> = prefill.iter().collect();
            let mut x = c.arrival_seed ^ (q as u64) << 32 ^ d as u64;
            for i in (1..order.len()).rev() {
                x = mix(x);
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let arrivals: Vec<(u32, usize)> = order.iter().map(|p| (p.layout.shape.tp_rank, p.layout.shape.pp_rank as usize)).collect();
            let mut alloc = vec![0xA5u8; st.total_bytes as usize];
            let mut slice_pool = new_pool(c, dst_shape.clone(), |p| noise(tag, p));
            for src in order {
                if st.region_of(&src.layout.shape).map_err(|e| TestCaseError::fail(e.chain()))?.is_none() {
                    continue;
                }
                let w = st.place(&src.layout.shape).map_err(|e| TestCaseError::fail(e.chain()))?;
                let region = st.writers[w as usize].clone();
                let plan = plan_gather(&src.layout, &c.src_pages, c.first_token, &st, &region).map_err(|e| TestCaseError::fail(e.chain()))?;
                let mut buf = vec![0u8; plan.staging_bytes as usize];
                unsafe { engine.gather(&plan, &src.layout, buf.as_mut_ptr()) }.map_err(|e| TestCaseError::fail(e.chain()))?;
                let at = plan.region_offset as usize;
                alloc[at..at + buf.len()].copy_from_slice(&buf);

                // The slice path for the same pair, applied op by op.
                let s = &src.layout.shape;
                let hs = match c.kind {
                    ModelKind::Mla => HeadSlice::MLA,
                    ModelKind::Mha => head_slice(s.tp_size, c.dst_tp, s.tp_rank, d, c.heads).map_err(|e| TestCaseError::fail(e.chain()))?,
                };
                let ops = slice_plan(s, &dst_shape, &hs, &src_span, &dst_span).map_err(|e| TestCaseError::fail(e.chain()))?;
                let common = s.layer_ids.iter().filter(|l| dst_shape.layer_ids.contains(l)).count();
                prop_assert_eq!(ops.len(), buffers_per_layer(c) as usize * common * tokens as usize);
                for op in &ops {
                    let from = op.src_buffer as usize * src.buffer_bytes + op.src_offset as usize;
                    let to = op.dst_buffer as usize * slice_pool.buffer_bytes + op.dst_offset as usize;
                    let len = op.len as usize;
                    prop_assert!(op.src_offset as usize + len <= src.buffer_bytes && op.dst_offset as usize + len <= slice_pool.buffer_bytes);
                    prop_assert!(len <= src.slot_bytes && len <= slice_pool.slot_bytes);
                    slice_pool.mem[to..to + len].copy_from_slice(&src.mem[from..from + len]);
                }
            }
            // The writers, their layers and the order they were placed in, against the reference.
            let placed: Vec<(u32, Vec<u32>)> = st.writers.iter().map(|w| (w.src_tp_rank, w.layer_ids.clone())).collect();
            let want: Vec<(u32, Vec<u32>)> = expected_regions(c, d, q, &arrivals).into_iter().map(|(rs, block, _)| (rs, block)).collect();
            prop_assert_eq!(placed, want, "regions of decode rank ({}, {})", d, q);
            prop_assert!(st.complete(), "every (head group, layer) of decode rank ({}, {}) arrived", d, q);
            let want_staging = expected_staging(c, d, q, &arrivals);
            prop_assert_eq!(alloc.len(), want_staging.len(), "allocation size");
            if let Some(i) = alloc.iter().zip(&want_staging).position(|(a, b)| a != b) {
                prop_assert!(false, "decode rank ({}, {}): staging byte {} differs ({} != {})", d, q, i, alloc[i], want_staging[i]);
            }

            // Scatter every writer region into the decode pool.
            let pool = new_pool(c, dst_shape.clone(), |p| noise(tag, p));
            for region in &st.writers {
                let plan = plan_scatter(&pool.layout, &c.dst_pages, &st, region).map_err(|e| TestCaseError::fail(e.chain()))?;
                let region = unsafe { alloc.as_ptr().add(plan.region_offset as usize) };
                unsafe { engine.scatter(&plan, &pool.layout, region) }.map_err(|e| TestCaseError::fail(e.chain()))?;
            }
            let want = expected_pool(c, c.dst_page_size, d, c.dst_tp, &c.dst_split[q], &c.dst_pages, &dst_token, &|p| noise(tag, p));
            for (what, got) in [("staged", &pool.mem), ("slice path", &slice_pool.mem)] {
                if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                    let (buf, off) = (i / pool.buffer_bytes, i % pool.buffer_bytes);
                    prop_assert!(
                        false,
                        "{}: decode rank ({}, {}) buffer {} byte {} (slot {}, byte {} of the slot) = {} != {}",
                        what, d, q, buf, off, off / pool.slot_bytes, off % pool.slot_bytes, got[i], want[i]
                    );
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- strategies

/// Page lists of `n` distinct pages below `cap`: consecutive runs, fully random, or a sorted
/// random subset (partial runs).
fn pages(n: u32, cap: u32) -> impl Strategy<Value = Vec<u32>> {
    let all: Vec<u32> = (0..cap).collect();
    (0u8..3, Just(all).prop_shuffle(), 0..=cap - n).prop_map(move |(mode, shuffled, start)| match mode {
        0 => (start..start + n).collect(),
        1 => shuffled[..n as usize].to_vec(),
        _ => {
            let mut v = shuffled[..n as usize].to_vec();
            v.sort_unstable();
            v
        }
    })
}

/// `layers` split among `pp` non-empty stages: the first `pp` of `shuffled` open one stage each,
/// every other layer goes to stage `picks[i] % pp` (uneven, interleaved or contiguous splits).
fn split(layers: &[u32], pp: usize, shuffled: &[u32], picks: &[usize]) -> Vec<Vec<u32>> {
    let pp = pp.min(layers.len());
    let mut stages = vec![Vec::new(); pp];
    for (i, &l) in shuffled.iter().enumerate() {
        stages[if i < pp { i } else { picks[i] % pp }].push(l);
    }
    for s in &mut stages {
        s.sort_unstable();
    }
    stages
}

/// A pipeline split of `layers` into 1..=3 stages.
fn split_strategy(layers: Vec<u32>) -> impl Strategy<Value = Vec<Vec<u32>>> {
    let n = layers.len();
    (1usize..=3, Just(layers.clone()).prop_shuffle(), prop::collection::vec(0usize..3, n))
        .prop_map(move |(pp, shuffled, picks)| split(&layers, pp, &shuffled, &picks))
}

fn cfg() -> impl Strategy<Value = Cfg> {
    let tp = prop::sample::select(vec![1u32, 2, 4, 8, 16]);
    let kind = prop_oneof![4 => Just(ModelKind::Mha), 1 => Just(ModelKind::Mla)];
    let page_size = prop::sample::select(vec![1u32, 4, 16, 64]);
    (
        kind,
        prop::sample::select(vec![1u32, 2, 4, 8, 32]),
        (tp.clone(), tp),
        prop::sample::subsequence((0u32..8).collect::<Vec<_>>(), 1..=6).prop_flat_map(|layers| (split_strategy(layers.clone()), split_strategy(layers))),
        (page_size.clone(), page_size),
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(vec![1u32, 2, 3, 8]),
        (1u32..=3, any::<bool>(), any::<u64>()),
    )
        .prop_flat_map(|(kind, heads, (src_tp, dst_tp), (src_split, dst_split), (src_ps, dst_ps), dtype, head_dim, (threads, streaming, arrival_seed))| {
            // Fewer pages for big pages keep each case small. The chunk fills its decode pages
            // but possibly the last one's tail (a request's last chunk), and starts anywhere in
            // the first prefill page.
            let max_pages: u32 = if dst_ps == 64 { 3 } else { 5 };
            (1..=max_pages, 0..dst_ps, 0..src_ps, 0u32..4).prop_flat_map(move |(n, short, first_token, extra)| {
                let tokens = n * dst_ps - short;
                let src_n = (first_token + tokens).div_ceil(src_ps);
                let (src_cap, dst_cap) = (src_n + extra, n + extra);
                let (src_split, dst_split) = (src_split.clone(), dst_split.clone());
                (pages(src_n, src_cap), pages(n, dst_cap + 1)).prop_map(move |(src_pages, dst_pages)| {
                    let (heads, head_dim) = match kind {
                        ModelKind::Mha => (heads, head_dim),
                        ModelKind::Mla => (1, head_dim * 3), // latent width
                    };
                    Cfg {
                        kind,
                        heads,
                        head_dim,
                        dtype,
                        src_page_size: src_ps,
                        dst_page_size: dst_ps,
                        first_token,
                        tokens,
                        src_tp,
                        dst_tp,
                        src_split: src_split.clone(),
                        dst_split: dst_split.clone(),
                        arrival_seed,
                        capacity: src_cap.max(dst_cap) + 1,
                        src_pages,
                        dst_pages,
                        threads,
                        streaming,
                    }
                })
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn reshard_is_bit_exact(c in cfg()) {
        run(&c)?;
    }
}

// ---------------------------------------------------------------- fixed cases worth keeping

fn fixed(kind: ModelKind, heads: u32, src_tp: u32, dst_tp: u32, page_size: u32, src_pages: Vec<u32>, dst_pages: Vec<u32>) -> Cfg {
    Cfg {
        kind,
        heads,
        head_dim: if kind == ModelKind::Mla { 9 } else { 4 },
        dtype: 2,
        src_page_size: page_size,
        dst_page_size: page_size,
        first_token: 0,
        tokens: dst_pages.len() as u32 * page_size,
        src_tp,
        dst_tp,
        src_split: vec![vec![0, 1, 3]],
        dst_split: vec![vec![0, 1, 3]],
        arrival_seed: 0,
        capacity: 8,
        src_pages,
        dst_pages,
        threads: 2,
        streaming: page_size != 4,
    }
}

#[test]
fn gqa_replication_on_both_sides_and_mla() {
    let cases = [
        fixed(ModelKind::Mha, 8, 4, 2, 4, vec![1, 2, 3], vec![6, 0, 7]),   // P4→D2
        fixed(ModelKind::Mha, 8, 2, 4, 4, vec![5, 6, 7], vec![0, 1, 2]),   // P2→D4
        fixed(ModelKind::Mha, 2, 1, 4, 1, vec![3, 1, 2], vec![2, 3, 4]),   // decode-side replication
        fixed(ModelKind::Mha, 2, 8, 2, 16, vec![0, 4], vec![7, 3]),        // prefill-side replication
        fixed(ModelKind::Mha, 4, 16, 8, 1, vec![0, 1], vec![1, 0]),        // replication on both sides
        fixed(ModelKind::Mha, 8, 4, 4, 64, vec![2, 3], vec![3, 2]),        // equal TP
        fixed(ModelKind::Mla, 1, 2, 8, 4, vec![0, 5, 6], vec![7, 4, 5]),   // MLA, decode larger
        fixed(ModelKind::Mla, 1, 8, 2, 16, vec![3], vec![1]),              // MLA, prefill larger
    ];
    for c in &cases {
        run(c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}

#[test]
fn pipeline_stages_on_both_sides() {
    let layers = [0, 2, 3, 6];
    let seven: Vec<u32> = (0..7).collect();
    let splits = [
        (even_split(&layers, 2), even_split(&layers, 1)),
        (even_split(&layers, 1), even_split(&layers, 2)),
        (even_split(&layers, 2), even_split(&layers, 2)),
        // 4 + 3 layers into one decode rank; 3 stages into 2; interleaved ids.
        (vec![seven[..4].to_vec(), seven[4..].to_vec()], vec![seven.clone()]),
        (vec![vec![0, 1, 2], vec![3, 4], vec![5, 6]], vec![vec![0, 1, 2, 3], vec![4, 5, 6]]),
        (vec![vec![0, 2, 4, 6], vec![1, 3, 5]], vec![vec![0, 1, 2], vec![3, 4, 5, 6]]),
    ];
    for (seed, (src_split, dst_split)) in splits.into_iter().enumerate() {
        let mut c = fixed(ModelKind::Mha, 8, 4, 2, 4, vec![1, 2], vec![5, 3]);
        (c.src_split, c.dst_split, c.arrival_seed) = (src_split, dst_split, seed as u64);
        run(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
        c.kind = ModelKind::Mla;
        c.heads = 1;
        run(&c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}
