//! Bit-exactness cases for a device copy engine: run by the CPU tests through the kernel emulator
//! and by `kvstage-cuda check` on a GPU.
//!
//! Each case builds a prefill pool and a decode pool (random bytes, guard bytes and the gaps of
//! strided layouts included) on the device and mirrors them in host memory, plans one chunk with
//! the shared planner, and checks the device engine against a reference walk that computes every
//! row from (kv, layer, token, head) alone — the engine's own index formula for a named layout,
//! the strides' definition otherwise — never from the plan: gather into host staging (through the
//! scratch pieces) and into device staging, scatter from host staging and from device staging,
//! and direct mode's pool-to-pool copy (whole decode allocation compared, so a stray write
//! anywhere is caught). The host engine runs the same plans and must agree with the walk too.
//!
//! Two lists: [`standard_cases`] (token-major pools: TP pairs, MLA, odd rows, misaligned bases,
//! a PP stage) and [`layout_cases`] (strided pools: every [`LayoutPreset`] on both sides with TP
//! changes both ways and MLA, padded pages, direct copies between two different layouts, page
//! sizes that differ, chunks starting inside a page, 16-byte and narrower vectors).

use super::engine::{Backend, DeviceCopyEngine};
use crate::copy::{CopyEngine, HostCopyEngine};
use crate::error::{Error, Result};
use crate::geometry::{
    plan_gather, plan_scatter, staging_layout, KvLayout, LayoutPreset, MemoryKind, ModelKind, PoolShape, StagingLayout, Strides, WriterRegion,
};

/// Memory the device engine can address, as the cases need it.
pub trait TestMemory {
    /// `bytes` of device memory (256-byte aligned).
    fn alloc(&self, bytes: usize) -> Result<u64>;
    fn write(&self, at: u64, data: &[u8]) -> Result<()>;
    fn read(&self, at: u64, out: &mut [u8]) -> Result<()>;
}

/// How a case's pool lays out its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolLayout {
    /// Token-major buffers (sglang's strides), each in an allocation of its own.
    TokenMajor,
    /// An engine's layout: every buffer in one tensor where the preset places them.
    Preset(LayoutPreset),
    /// The preset's strides with the pages `pad` bytes further apart, each buffer in an
    /// allocation of its own.
    Padded(LayoutPreset, u64),
}

impl PoolLayout {
    /// The strides of the K (or latent) and V buffers of a pool of `shape` holding `capacity`
    /// pages.
    pub fn strides(self, shape: &PoolShape, capacity: u64) -> [Strides; 2] {
        match self {
            PoolLayout::TokenMajor => [Strides::token_major_of(shape, 0), Strides::token_major_of(shape, 1)],
            PoolLayout::Preset(p) => {
                let at = p.placement(shape, capacity);
                [at.strides, at.v_strides]
            }
            PoolLayout::Padded(p, pad) => {
                let at = p.placement(shape, capacity);
                [at.strides, at.v_strides].map(|s| Strides { page: s.page + pad, ..s })
            }
        }
    }

    pub fn name(self) -> String {
        match self {
            PoolLayout::TokenMajor => "token-major".into(),
            PoolLayout::Preset(p) => p.name().into(),
            PoolLayout::Padded(p, pad) => format!("{}+{pad}", p.name()),
        }
    }
}

/// One geometry: a prefill (src) rank, a decode (dst) rank, their layouts, the chunk's pages on
/// each side.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub src: PoolShape,
    pub dst: PoolShape,
    pub src_layout: PoolLayout,
    pub dst_layout: PoolLayout,
    /// Tokens of the chunk.
    pub tokens: u32,
    /// Slots of `src_pages[0]` before the chunk's first token (the decode side starts on a page).
    pub first_token: u32,
    pub src_pages: Vec<u32>,
    pub dst_pages: Vec<u32>,
    pub src_capacity: u64,
    pub dst_capacity: u64,
    /// Bytes added to every device base address (forces the narrow-vector paths when odd).
    pub misalign: u64,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// `n` distinct pages below `capacity`, in a random order with some runs of consecutive pages.
    fn pages(&mut self, n: usize, capacity: u64) -> Vec<u32> {
        let mut all: Vec<u32> = (0..capacity as u32).collect();
        // Shuffle blocks of 1..4 consecutive pages so both runs and jumps occur.
        let mut blocks: Vec<Vec<u32>> = Vec::new();
        let mut i = 0;
        while i < all.len() {
            let len = (1 + self.next() % 4) as usize;
            blocks.push(all[i..(i + len).min(all.len())].to_vec());
            i += len;
        }
        for k in (1..blocks.len()).rev() {
            let j = (self.next() % (k as u64 + 1)) as usize;
            blocks.swap(k, j);
        }
        all = blocks.concat();
        all.truncate(n);
        all
    }
}

fn mha(h: u32, d: u32, b: u32, ps: u32, layers: u32, rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mha, h, d, b, ps, layers).with_tp(rank, tp)
}

fn mla(d: u32, b: u32, ps: u32, layers: u32, rank: u32, tp: u32) -> PoolShape {
    PoolShape::new(ModelKind::Mla, 1, d, b, ps, layers).with_tp(rank, tp)
}

/// What a case is made of before its pages are drawn.
struct Spec<'a> {
    name: &'a str,
    src: (PoolShape, PoolLayout),
    dst: (PoolShape, PoolLayout),
    tokens: u32,
    first_token: u32,
    /// Pages of each pool (at least what the chunk needs on either side).
    capacity: u64,
    misalign: u64,
}

impl Spec<'_> {
    /// The case with its page lists drawn (src first, then dst).
    fn draw(self, rng: &mut Rng) -> Case {
        let need = |ps: u32, first: u32| (first as u64 + self.tokens as u64).div_ceil(ps as u64);
        let (sn, dn) = (need(self.src.0.page_size, self.first_token), need(self.dst.0.page_size, 0));
        let (src_capacity, dst_capacity) = (self.capacity.max(sn), self.capacity.max(dn));
        let src_pages = rng.pages(sn as usize, src_capacity);
        let dst_pages = rng.pages(dn as usize, dst_capacity);
        Case {
            name: self.name.to_owned(),
            src: self.src.0,
            dst: self.dst.0,
            src_layout: self.src.1,
            dst_layout: self.dst.1,
            tokens: self.tokens,
            first_token: self.first_token,
            src_pages,
            dst_pages,
            src_capacity,
            dst_capacity,
            misalign: self.misalign,
        }
    }
}

/// The standard cases (token-major pools): TP pairs both ways (contiguous and head-slice rows,
/// head offsets), GQA replication, MLA with page 1 and 64, odd row sizes (1-byte path), 8- and
/// 4-byte rows, misaligned bases, chunks that are not a multiple of the block tile, more slabs
/// than a block holds, a layer subset (pipeline stage).
pub fn standard_cases() -> Vec<Case> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut out = Vec::new();
    let tm = PoolLayout::TokenMajor;
    let mut push = |name: &str, src: PoolShape, dst: PoolShape, npages: u32, capacity: u64, misalign: u64, rng: &mut Rng| {
        let tokens = npages * src.page_size;
        out.push(Spec { name, src: (src, tm), dst: (dst, tm), tokens, first_token: 0, capacity, misalign }.draw(rng));
    };
    push("P4->D2 bf16 H8 D128 ps16", mha(8, 128, 2, 16, 3, 3, 4), mha(8, 128, 2, 16, 3, 1, 2), 5, 12, 0, &mut rng);
    push("P2->D4 bf16 H8 D128 ps4", mha(8, 128, 2, 4, 2, 1, 2), mha(8, 128, 2, 4, 2, 3, 4), 9, 16, 0, &mut rng);
    push("P1->D4 replication H2 ps8", mha(2, 64, 2, 8, 2, 0, 1), mha(2, 64, 2, 8, 2, 2, 4), 6, 10, 0, &mut rng);
    push("P4->D1 H8 ps1", mha(8, 64, 2, 1, 2, 2, 4), mha(8, 64, 2, 1, 2, 0, 1), 70, 96, 0, &mut rng);
    push("equal TP2 ps16", mha(8, 128, 2, 16, 5, 1, 2), mha(8, 128, 2, 16, 5, 1, 2), 4, 8, 0, &mut rng);
    push("MLA D576 ps1", mla(576, 2, 1, 3, 1, 2), mla(576, 2, 1, 3, 1, 4), 45, 64, 0, &mut rng);
    push("MLA D576 ps64", mla(576, 2, 64, 2, 0, 1), mla(576, 2, 64, 2, 0, 1), 3, 5, 0, &mut rng);
    push("int8 D3 (odd rows) P2->D4", mha(4, 3, 1, 5, 2, 0, 2), mha(4, 3, 1, 5, 2, 1, 4), 7, 11, 0, &mut rng);
    push("fp32 D2 (8-byte rows) P2->D1", mha(2, 2, 4, 3, 3, 1, 2), mha(2, 2, 4, 3, 3, 0, 1), 11, 20, 0, &mut rng);
    push("fp16 D2 (4-byte rows) P1->D2", mha(2, 2, 2, 7, 2, 0, 1), mha(2, 2, 2, 7, 2, 1, 2), 5, 9, 0, &mut rng);
    push("misaligned +2 P4->D2", mha(8, 128, 2, 16, 2, 2, 4), mha(8, 128, 2, 16, 2, 1, 2), 3, 6, 2, &mut rng);
    push("misaligned +8 P2->D4", mha(8, 64, 2, 5, 2, 0, 2), mha(8, 64, 2, 5, 2, 1, 4), 7, 9, 8, &mut rng);
    push("misaligned +1 MLA", mla(8, 1, 3, 2, 0, 1), mla(8, 1, 3, 2, 0, 1), 6, 9, 1, &mut rng);
    let stage = mha(8, 128, 2, 4, 8, 0, 2).with_pp(1, 2, (4..8).collect());
    push("PP stage 1 of 2 -> D4", stage, mha(8, 128, 2, 4, 8, 0, 4), 6, 8, 0, &mut rng);
    out
}

/// The strided-pool cases:
/// - every preset on both sides, MHA with TP P1->D2 (the gather reads a head slice: heads
///   adjacent in sglang's pool, one piece per head in vLLM's cells and head-major pages, a chunk
///   starting inside a page) and P2->D1 (the scatter writes a head slice), and MLA P2->D4;
/// - padded pages (page stride larger than the page: segments stop at every page);
/// - direct copies between two different layouts (vllm-lbhnc → trtllm, trtllm → sglang,
///   sglang → vllm-blnhc, …), some with different page sizes, GQA replication, a PP stage;
/// - 16-byte vectors throughout but for misaligned bases (+2, +8, +1) and 8-, 4- and 1-byte heads;
/// - pages of one slot whose page stride is not the token stride (head-major, padded).
///
/// All with random page lists (runs and jumps), chunks longer than a block tile and more slabs
/// than a block holds.
pub fn layout_cases() -> Vec<Case> {
    use LayoutPreset as L;
    use PoolLayout::{Padded, Preset};
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut out = Vec::new();
    for p in LayoutPreset::ALL {
        let n = p.name();
        let same = |src: PoolShape, dst: PoolShape| ((src, Preset(p)), (dst, Preset(p)));
        let (src, dst) = same(mha(4, 32, 2, 4, 3, 0, 1), mha(4, 32, 2, 4, 3, 1, 2));
        out.push(Spec { name: &format!("{n} P1->D2 ps4"), src, dst, tokens: 43, first_token: 1, capacity: 16, misalign: 0 }.draw(&mut rng));
        let (src, dst) = same(mha(4, 32, 2, 8, 3, 1, 2), mha(4, 32, 2, 8, 3, 0, 1));
        out.push(Spec { name: &format!("{n} P2->D1 ps8"), src, dst, tokens: 40, first_token: 0, capacity: 8, misalign: 0 }.draw(&mut rng));
        let (src, dst) = same(mla(40, 2, 5, 2, 1, 2), mla(40, 2, 5, 2, 3, 4));
        out.push(Spec { name: &format!("{n} MLA D40 P2->D4 ps5"), src, dst, tokens: 35, first_token: 0, capacity: 10, misalign: 0 }.draw(&mut rng));
    }
    let mut push = |name: &str, src: (PoolShape, PoolLayout), dst: (PoolShape, PoolLayout), tokens: u32, first_token: u32, capacity: u64, misalign: u64| {
        out.push(Spec { name, src, dst, tokens, first_token, capacity, misalign }.draw(&mut rng));
    };
    // Padded pages.
    push("sglang+48 -> vllm-lbnhc P2->D1", (mha(4, 32, 2, 4, 3, 1, 2), Padded(L::Sglang, 48)), (mha(4, 32, 2, 4, 3, 0, 1), Preset(L::VllmLbnhc)), 36, 0, 12, 0);
    push("trtllm+16 -> vllm-blhnc+32 P1->D2", (mha(4, 32, 2, 8, 3, 0, 1), Padded(L::Trtllm, 16)), (mha(4, 32, 2, 8, 3, 1, 2), Padded(L::VllmBlhnc, 32)), 45, 3, 8, 0);
    push("vllm-lbnhc+64 -> sglang MLA", (mla(40, 2, 4, 2, 0, 1), Padded(L::VllmLbnhc, 64)), (mla(40, 2, 4, 2, 0, 1), Preset(L::Sglang)), 40, 0, 14, 0);
    // Direct copies between different layouts (and page sizes).
    push("vllm-lbhnc ps4 -> trtllm ps16 P2->D4", (mha(8, 32, 2, 4, 3, 1, 2), Preset(L::VllmLbhnc)), (mha(8, 32, 2, 16, 3, 2, 4), Preset(L::Trtllm)), 48, 0, 16, 0);
    push("trtllm ps16 -> sglang ps1 P4->D2", (mha(8, 32, 2, 16, 3, 3, 4), Preset(L::Trtllm)), (mha(8, 32, 2, 1, 3, 1, 2), Preset(L::Sglang)), 45, 2, 64, 0);
    push("sglang ps8 -> vllm-blnhc ps4 P1->D2", (mha(4, 32, 2, 8, 3, 0, 1), Preset(L::Sglang)), (mha(4, 32, 2, 4, 3, 1, 2), Preset(L::VllmBlnhc)), 44, 0, 12, 0);
    push("vllm-bhlnc -> vllm-lhbnc equal TP", (mha(4, 32, 2, 8, 3, 0, 1), Preset(L::VllmBhlnc)), (mha(4, 32, 2, 8, 3, 0, 1), Preset(L::VllmLhbnc)), 40, 5, 8, 0);
    push("vllm-lhbnc -> sglang replication H2 P1->D4", (mha(2, 32, 2, 4, 3, 0, 1), Preset(L::VllmLhbnc)), (mha(2, 32, 2, 4, 3, 3, 4), Preset(L::Sglang)), 36, 0, 12, 0);
    push("trtllm ps16 -> vllm-lbnhc ps1 MLA", (mla(40, 2, 16, 3, 0, 1), Preset(L::Trtllm)), (mla(40, 2, 1, 3, 0, 1), Preset(L::VllmLbnhc)), 40, 7, 48, 0);
    let stage = mha(4, 32, 2, 4, 8, 0, 1).with_pp(1, 2, (4..8).collect());
    push("PP stage trtllm -> vllm-blhnc", (stage, Preset(L::Trtllm)), (mha(4, 32, 2, 4, 8, 1, 2), Preset(L::VllmBlhnc)), 36, 0, 10, 0);
    // Vector widths below 16.
    push("misaligned +2 sglang -> trtllm P2->D1", (mha(4, 32, 2, 4, 2, 1, 2), Preset(L::Sglang)), (mha(4, 32, 2, 4, 2, 0, 1), Preset(L::Trtllm)), 36, 0, 10, 2);
    push("misaligned +8 vllm-lbnhc -> vllm-bhlnc", (mha(4, 32, 2, 4, 2, 0, 1), Preset(L::VllmLbnhc)), (mha(4, 32, 2, 4, 2, 1, 2), Preset(L::VllmBhlnc)), 36, 1, 10, 8);
    push("misaligned +1 trtllm+8 -> sglang MLA", (mla(8, 1, 3, 2, 0, 1), Padded(L::Trtllm, 8)), (mla(8, 1, 3, 2, 0, 1), Preset(L::Sglang)), 33, 0, 14, 1);
    push("int8 D3 trtllm -> vllm-blhnc P2->D4", (mha(4, 3, 1, 5, 2, 0, 2), Preset(L::Trtllm)), (mha(4, 3, 1, 5, 2, 1, 4), Preset(L::VllmBlhnc)), 34, 2, 11, 0);
    push("fp32 D2 vllm-lbhnc -> trtllm P1->D2", (mha(4, 2, 4, 3, 3, 0, 1), Preset(L::VllmLbhnc)), (mha(4, 2, 4, 3, 3, 1, 2), Preset(L::Trtllm)), 35, 1, 20, 0);
    push("fp16 D2 trtllm -> sglang P4->D1", (mha(4, 2, 2, 7, 2, 1, 4), Preset(L::Trtllm)), (mha(4, 2, 2, 7, 2, 0, 1), Preset(L::Sglang)), 35, 0, 9, 0);
    // V heads of another size than K's (`head_dim_v`): K and V slabs of their own row sizes, a
    // launch per kind.
    let dv = |s: PoolShape, v: u32| s.with_head_dim_v(v);
    push("Dv 16 vllm-lbhnc -> sglang P1->D2", (dv(mha(4, 32, 2, 4, 3, 0, 1), 16), Preset(L::VllmLbhnc)), (dv(mha(4, 32, 2, 4, 3, 1, 2), 16), Preset(L::Sglang)), 38, 1, 12, 0);
    push("Dv 48 trtllm -> vllm-blnhc P2->D1", (dv(mha(4, 32, 2, 8, 2, 1, 2), 48), Preset(L::Trtllm)), (dv(mha(4, 32, 2, 8, 2, 0, 1), 48), Preset(L::VllmBlnhc)), 40, 0, 8, 0);
    push("Dv 8 sglang -> trtllm+16 P4->D2 misaligned +2", (dv(mha(8, 24, 2, 4, 2, 3, 4), 8), Preset(L::Sglang)), (dv(mha(8, 24, 2, 4, 2, 1, 2), 8), Padded(L::Trtllm, 16)), 36, 0, 12, 2);
    // Pages of one slot whose page stride is not the token stride: not evenly spaced slots.
    push("sglang ps4 -> vllm-lbhnc ps1 P2->D1", (mha(4, 32, 2, 4, 2, 1, 2), Preset(L::Sglang)), (mha(4, 32, 2, 1, 2, 0, 1), Preset(L::VllmLbhnc)), 36, 0, 48, 0);
    push("trtllm ps1 -> sglang+32 ps1 P1->D2", (mha(4, 32, 2, 1, 2, 0, 1), Preset(L::Trtllm)), (mha(4, 32, 2, 1, 2, 1, 2), Padded(L::Sglang, 32)), 36, 0, 48, 0);
    out
}

/// Every case [`run_all`] runs: the standard ones, then the strided-pool ones.
pub fn all_cases() -> Vec<Case> {
    let mut out = standard_cases();
    out.extend(layout_cases());
    out
}

/// Bytes before the first buffer of a pool allocation and after its last (compared, never
/// written).
const GUARD: usize = 256;

/// A pool on the device with its host mirror.
struct Pool {
    mirror: Vec<u8>,
    device: KvLayout,
    host: KvLayout,
    dev_base: u64,
    layout: PoolLayout,
    /// Offsets of the buffers in the allocation (`bases` less the allocation's address).
    offsets: Vec<u64>,
}

fn make_pool(mem: &dyn TestMemory, shape: &PoolShape, layout: PoolLayout, capacity: u64, misalign: u64, rng: &mut Rng) -> Result<Pool> {
    let nb = (shape.buffers_per_layer() * shape.layer_count()) as usize;
    let strides = layout.strides(shape, capacity);
    let first = (GUARD as u64) + misalign;
    let (offsets, bytes): (Vec<u64>, u64) = match layout {
        PoolLayout::Preset(p) => {
            let offsets = p.bases(shape, capacity, first as usize).into_iter().map(|b| b as u64).collect();
            (offsets, first + p.tensor_bytes(shape, capacity))
        }
        PoolLayout::TokenMajor | PoolLayout::Padded(..) => {
            let buffer = KvLayout::new(shape.clone(), capacity, MemoryKind::Host, Vec::new()).with_strides(strides[0]).with_v_strides(strides[1]).max_buffer_bytes();
            let stride = (buffer + misalign).next_multiple_of(256) + 256;
            ((0..nb as u64).map(|i| first + i * stride).collect(), first + nb as u64 * stride)
        }
    };
    let mut mirror = vec![0u8; bytes as usize + GUARD];
    rng.fill(&mut mirror);
    let dev_base = mem.alloc(mirror.len())?;
    mem.write(dev_base, &mirror)?;
    let bases = |at: u64| offsets.iter().map(|o| (at + o) as usize).collect::<Vec<usize>>();
    let device = KvLayout::new(shape.clone(), capacity, MemoryKind::Cuda, bases(dev_base)).with_strides(strides[0]).with_v_strides(strides[1]);
    let host = KvLayout::new(shape.clone(), capacity, MemoryKind::Host, bases(mirror.as_ptr() as u64)).with_strides(strides[0]).with_v_strides(strides[1]);
    device.validate().map_err(|e| e.context(format!("{} pool", layout.name())))?;
    Ok(Pool { mirror, device, host, dev_base, layout, offsets })
}

impl Pool {
    fn read_device(&self, mem: &dyn TestMemory) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.mirror.len()];
        mem.read(self.dev_base, &mut out)?;
        Ok(out)
    }

    fn reset_device(&self, mem: &dyn TestMemory, from: &[u8]) -> Result<()> {
        mem.write(self.dev_base, from)
    }

    /// Offset in the allocation of head `head` of slot `slot` of page `page` of buffer `kv` of
    /// the pool's layer `li`: by the engine's own index formula for a named layout (as in its
    /// source, whole tensor), by the strides' definition for the others. Never through a plan.
    fn head_at(&self, kv: u64, li: u64, page: u64, slot: u64, head: u64) -> usize {
        let shape = &self.device.shape;
        let (h, n, l, cap) = (shape.local_heads as u64, shape.page_size as u64, shape.layer_count() as u64, self.device.capacity_pages);
        let kvn = shape.buffers_per_layer() as u64;
        let (hk, hv) = (shape.head_bytes_of(0), if kvn == 2 { shape.head_bytes_of(1) } else { 0 });
        let hb = if kv == 0 { hk } else { hv };
        let cell = hk + hv; // a vLLM cell: K‖V of one (head, token)
        let v = kv * hk; // V's place in the cell
        let (b, s, hd) = (page, slot, head);
        let at = match self.layout {
            PoolLayout::Preset(p) => {
                // From the start of the tensor (the first buffer's offset: layer 0's K).
                self.offsets[0]
                    + match p {
                        LayoutPreset::Sglang => kv * l * cap * n * h * hk + (li * cap * n + b * n + s) * h * hb + hd * hb,
                        LayoutPreset::VllmLbhnc => (((li * cap + b) * h + hd) * n + s) * cell + v,
                        LayoutPreset::VllmLbnhc => (((li * cap + b) * n + s) * h + hd) * cell + v,
                        LayoutPreset::VllmLhbnc => (((li * h + hd) * cap + b) * n + s) * cell + v,
                        LayoutPreset::VllmBlhnc => (((b * l + li) * h + hd) * n + s) * cell + v,
                        LayoutPreset::VllmBlnhc => (((b * l + li) * n + s) * h + hd) * cell + v,
                        LayoutPreset::VllmBhlnc => (((b * h + hd) * l + li) * n + s) * cell + v,
                        LayoutPreset::Trtllm => (b * l + li) * h * n * cell + kv * h * n * hk + (hd * n + s) * hb,
                    }
            }
            PoolLayout::TokenMajor | PoolLayout::Padded(..) => {
                let st = self.device.strides_of(kv as u32);
                self.offsets[(kv * l + li) as usize] + b * st.page + s * st.token + hd * st.head
            }
        };
        at as usize
    }
}

/// Where chunk token `t` lives: (page, slot) in a page list of `page_size` starting `first` slots
/// into its first page.
fn token_slot(pages: &[u32], page_size: u32, first: u32, t: u64) -> (u64, u64) {
    let (at, ps) = (first as u64 + t, page_size as u64);
    (pages[(at / ps) as usize] as u64, at % ps)
}

/// Every (staging offset, pool offset, bytes) head of the region, in region order: slab (kv,
/// layer of the region), token, head of the row.
fn region_heads(st: &StagingLayout, region: &WriterRegion, pool: &Pool, pages: &[u32], first: u32, head_start: u32) -> Result<Vec<(usize, usize, usize)>> {
    let shape = &pool.device.shape;
    let n = region.heads.num_heads;
    let mut out = Vec::with_capacity(region.layer_ids.len() * st.buffers_per_layer as usize * st.tokens as usize * n as usize);
    for kv in 0..st.buffers_per_layer {
        let hb = shape.head_bytes_of(kv);
        let row = n as u64 * hb;
        if row != st.row_bytes(n, kv) {
            return Err(Error::internal(format!("staging rows of {} bytes: not {} heads of {hb} bytes", st.row_bytes(n, kv), n)));
        }
        for (l, &id) in region.layer_ids.iter().enumerate() {
            let li = shape.layer_index(id).ok_or_else(|| Error::internal(format!("layer {id} is not in the pool")))? as u64;
            let slab = st.slab_in_region(n, region.layers, kv, l as u32);
            for t in 0..st.tokens as u64 {
                let (page, slot) = token_slot(pages, shape.page_size, first, t);
                for j in 0..n as u64 {
                    out.push(((slab + t * row + j * hb) as usize, pool.head_at(kv as u64, li, page, slot, head_start as u64 + j), hb as usize));
                }
            }
        }
    }
    Ok(out)
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

fn mismatch(case: &Case, what: &str, at: usize) -> Error {
    Error::internal(format!("case `{}`: {what} differs from the reference walk at byte {at}", case.name))
}

/// The staging byte `at` of the region, named: slab (kv, layer), token, head, byte.
fn region_byte(st: &StagingLayout, region: &WriterRegion, at: usize) -> String {
    let at = at as u64;
    let n = region.heads.num_heads;
    let k_bytes = region.layers as u64 * st.slab_bytes(n, 0);
    let (kv, within_kind) = if at < k_bytes { (0, at) } else { (1, at - k_bytes) };
    let slab = st.slab_bytes(n, kv).max(1);
    let (l, within) = (within_kind / slab, within_kind % slab);
    let row = st.row_bytes(n, kv).max(1);
    let hb = (row / n.max(1) as u64).max(1);
    let layer = region.layer_ids.get(l as usize).copied().unwrap_or(u32::MAX);
    let (t, r) = (within / row, within % row);
    format!("(kv {kv}, layer {layer}, token {t}, head {} of the row, byte {})", r / hb, r % hb)
}

/// Runs one case; `Ok(bytes moved)` or an error naming the case and the first differing byte.
pub fn run_case<B: Backend>(engine: &DeviceCopyEngine<B>, mem: &dyn TestMemory, case: &Case, seed: u64) -> Result<u64> {
    let mut rng = Rng(seed | 1);
    let st = staging_layout(&case.src, &case.dst, case.tokens)?;
    let region = st.region_of(&case.src)?.ok_or_else(|| Error::internal(format!("case `{}`: src rank is not a writer", case.name)))?;
    let region = &region;
    let host_engine = HostCopyEngine::new(1);
    let in_region = |what: &str, at: usize| {
        Error::internal(format!("case `{}`: {what} differs from the reference walk at byte {at} {}", case.name, region_byte(&st, region, at)))
    };

    // Gather: the reference walk, the host engine, the device engine into host and device staging.
    let src = make_pool(mem, &case.src, case.src_layout, case.src_capacity, case.misalign, &mut rng)?;
    let g = plan_gather(&src.device, &case.src_pages, case.first_token, &st, region)?;
    let src_heads = region_heads(&st, region, &src, &case.src_pages, case.first_token, region.heads.src_head_start)?;
    let mut want = vec![0x5Au8; region.bytes as usize];
    for &(stage, pool, hb) in &src_heads {
        want[stage..stage + hb].copy_from_slice(&src.mirror[pool..pool + hb]);
    }
    let mut host = vec![0xC3u8; want.len()];
    // SAFETY: the mirror holds every buffer; `host` is the writer region.
    unsafe { host_engine.gather(&g, &src.host, host.as_mut_ptr()) }?;
    if let Some(at) = first_difference(&want, &host) {
        return Err(in_region("the host engine's gather", at));
    }
    let mut got = vec![0xA5u8; want.len()];
    // SAFETY: device pool and host staging of the region's size.
    unsafe { engine.gather(&g, &src.device, got.as_mut_ptr()) }?;
    if let Some(at) = first_difference(&want, &got) {
        return Err(in_region("gather into host staging", at));
    }
    let dev_staging = mem.alloc(want.len() + 256)? + case.misalign;
    // SAFETY: device staging of the region's size.
    unsafe { engine.gather(&g, &src.device, dev_staging as *mut u8) }?;
    got.fill(0);
    mem.read(dev_staging, &mut got)?;
    if let Some(at) = first_difference(&want, &got) {
        return Err(in_region("gather into device staging", at));
    }
    // The source pool is untouched.
    if let Some(at) = first_difference(&src.mirror, &src.read_device(mem)?) {
        return Err(mismatch(case, "source pool after gather", at));
    }

    // Scatter: the walk writes the region's heads over the decode pool's bytes.
    let mut dst = make_pool(mem, &case.dst, case.dst_layout, case.dst_capacity, case.misalign, &mut rng)?;
    let before = dst.mirror.clone();
    let s = plan_scatter(&dst.device, &case.dst_pages, &st, region)?;
    let mut expected = before.clone();
    for &(stage, pool, hb) in &region_heads(&st, region, &dst, &case.dst_pages, 0, region.heads.dst_head_start)? {
        expected[pool..pool + hb].copy_from_slice(&want[stage..stage + hb]);
    }
    // SAFETY: the mirror holds every buffer; `want` is the writer region.
    unsafe { host_engine.scatter(&s, &dst.host, want.as_ptr()) }?;
    if let Some(at) = first_difference(&expected, &dst.mirror) {
        return Err(mismatch(case, "the decode pool after the host engine's scatter", at));
    }
    // SAFETY: device pool, host staging.
    unsafe { engine.scatter(&s, &dst.device, want.as_ptr()) }?;
    if let Some(at) = first_difference(&expected, &dst.read_device(mem)?) {
        return Err(mismatch(case, "decode pool after scatter from host staging", at));
    }
    dst.reset_device(mem, &before)?;
    // SAFETY: device pool, device staging holding the gathered bytes.
    unsafe { engine.scatter(&s, &dst.device, dev_staging as *const u8) }?;
    if let Some(at) = first_difference(&expected, &dst.read_device(mem)?) {
        return Err(mismatch(case, "decode pool after scatter from device staging", at));
    }

    // Direct mode: the prefill pool's rows straight into the decode pool, no staging between; the
    // host engine's direct copy of the mirrors too.
    let deadline = crate::deadline::Deadline::after(None);
    dst.mirror.copy_from_slice(&before);
    // SAFETY: both mirrors are host memory holding every buffer; the plans are of one region.
    unsafe { host_engine.copy_across(&g, &src.host, &s, &dst.host, &deadline) }?;
    if let Some(at) = first_difference(&expected, &dst.mirror) {
        return Err(mismatch(case, "the decode pool after the host engine's direct copy", at));
    }
    dst.reset_device(mem, &before)?;
    // SAFETY: both pools are device memory of the case; the plans are of one region.
    unsafe { engine.copy_across(&g, &src.device, &s, &dst.device, &deadline) }?;
    if let Some(at) = first_difference(&expected, &dst.read_device(mem)?) {
        return Err(mismatch(case, "decode pool after the direct copy", at));
    }
    if let Some(at) = first_difference(&src.mirror, &src.read_device(mem)?) {
        return Err(mismatch(case, "source pool after the direct copy", at));
    }
    Ok(g.bytes() + 2 * s.bytes())
}

/// Runs `cases`; returns (cases, bytes moved per engine pass).
pub fn run_cases<B: Backend>(engine: &DeviceCopyEngine<B>, mem: &dyn TestMemory, cases: &[Case], log: &mut dyn FnMut(&str)) -> Result<(usize, u64)> {
    let mut bytes = 0;
    for (i, case) in cases.iter().enumerate() {
        let t = std::time::Instant::now();
        let moved = run_case(engine, mem, case, 0x5EED + i as u64)?;
        log(&format!("ok   {:<32} {moved:>9} bytes {:>8.1} ms", case.name, t.elapsed().as_secs_f64() * 1e3));
        bytes += moved;
    }
    Ok((cases.len(), bytes))
}

/// Runs every case ([`all_cases`]); returns (cases, bytes moved per engine pass).
pub fn run_all<B: Backend>(engine: &DeviceCopyEngine<B>, mem: &dyn TestMemory, log: &mut dyn FnMut(&str)) -> Result<(usize, u64)> {
    run_cases(engine, mem, &all_cases(), log)
}
