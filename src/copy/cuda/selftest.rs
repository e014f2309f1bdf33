//! Bit-exactness cases for a device copy engine against the host engine on the same plans:
//! run by the CPU tests through the kernel emulator and by `kvstage-cuda check` on a GPU.
//!
//! Each case builds a prefill pool and a decode pool (random bytes) on the device and mirrors
//! them in host memory, plans one chunk with the shared planner, and checks that the device engine
//! produces the host engine's bytes: gather into host staging (through the scratch pieces) and
//! into device staging, scatter from host staging and from device staging, and direct mode's
//! pool-to-pool copy (whole decode pool compared, so a stray write anywhere is caught).

use super::engine::{Backend, DeviceCopyEngine};
use crate::copy::{CopyEngine, HostCopyEngine};
use crate::error::{Error, Result};
use crate::geometry::{plan_gather, plan_scatter, staging_layout, KvLayout, MemoryKind, ModelKind, PoolShape};

/// Memory the device engine can address, as the cases need it.
pub trait TestMemory {
    /// `bytes` of device memory (256-byte aligned).
    fn alloc(&self, bytes: usize) -> Result<u64>;
    fn write(&self, at: u64, data: &[u8]) -> Result<()>;
    fn read(&self, at: u64, out: &mut [u8]) -> Result<()>;
}

/// One geometry: a prefill (src) rank, a decode (dst) rank, the chunk's pages on each side.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub src: PoolShape,
    pub dst: PoolShape,
    pub src_pages: Vec<u32>,
    pub dst_pages: Vec<u32>,
    pub capacity_pages: u64,
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

/// The standard cases: TP pairs both ways (contiguous and head-slice rows, head offsets), GQA
/// replication, MLA with page 1 and 64, odd row sizes (1-byte path), 8- and 4-byte rows,
/// misaligned bases, chunks that are not a multiple of the block tile, more slabs than a block
/// holds, a layer subset (pipeline stage).
pub fn standard_cases() -> Vec<Case> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut out = Vec::new();
    let mut push = |name: &str, src: PoolShape, dst: PoolShape, npages: usize, capacity: u64, misalign: u64, rng: &mut Rng| {
        let src_pages = rng.pages(npages, capacity);
        let dst_pages = rng.pages(npages, capacity);
        out.push(Case { name: name.to_owned(), src, dst, src_pages, dst_pages, capacity_pages: capacity, misalign });
    };
    push("P4->D2 bf16 H8 D128 ps16", mha(8, 128, 2, 16, 3, 3, 4), mha(8, 128, 2, 16, 3, 1, 2), 5, 12, 0, &mut rng);
    push("P2->D4 bf16 H8 D128 ps4", mha(8, 128, 2, 4, 2, 1, 2), mha(8, 128, 2, 4, 2, 3, 4), 9, 16, 0, &mut rng);
    push("P1->D4 replication H2 ps8", mha(2, 64, 2, 8, 2, 0, 1), mha(2, 64, 2, 8, 2, 2, 4), 6, 10, 0, &mut rng);
    push("P4->D1 H8 ps1", mha(8, 64, 2, 1, 2, 2, 4), mha(8, 64, 2, 1, 2, 0, 1), 70, 96, 0, &mut rng);
    push("equal TP2 ps16", mha(8, 128, 2, 16, 5, 1, 2), mha(8, 128, 2, 16, 5, 1, 2), 4, 8, 0, &mut rng);
    push(
        "MLA D576 ps1",
        PoolShape::new(ModelKind::Mla, 1, 576, 2, 1, 3).with_tp(1, 2),
        PoolShape::new(ModelKind::Mla, 1, 576, 2, 1, 3).with_tp(1, 4),
        45,
        64,
        0,
        &mut rng,
    );
    push(
        "MLA D576 ps64",
        PoolShape::new(ModelKind::Mla, 1, 576, 2, 64, 2),
        PoolShape::new(ModelKind::Mla, 1, 576, 2, 64, 2),
        3,
        5,
        0,
        &mut rng,
    );
    push("int8 D3 (odd rows) P2->D4", mha(4, 3, 1, 5, 2, 0, 2), mha(4, 3, 1, 5, 2, 1, 4), 7, 11, 0, &mut rng);
    push("fp32 D2 (8-byte rows) P2->D1", mha(2, 2, 4, 3, 3, 1, 2), mha(2, 2, 4, 3, 3, 0, 1), 11, 20, 0, &mut rng);
    push("fp16 D2 (4-byte rows) P1->D2", mha(2, 2, 2, 7, 2, 0, 1), mha(2, 2, 2, 7, 2, 1, 2), 5, 9, 0, &mut rng);
    push("misaligned +2 P4->D2", mha(8, 128, 2, 16, 2, 2, 4), mha(8, 128, 2, 16, 2, 1, 2), 3, 6, 2, &mut rng);
    push("misaligned +8 P2->D4", mha(8, 64, 2, 5, 2, 0, 2), mha(8, 64, 2, 5, 2, 1, 4), 7, 9, 8, &mut rng);
    push("misaligned +1 MLA", PoolShape::new(ModelKind::Mla, 1, 8, 1, 3, 2), PoolShape::new(ModelKind::Mla, 1, 8, 1, 3, 2), 6, 9, 1, &mut rng);
    let stage = mha(8, 128, 2, 4, 8, 0, 2).with_pp(1, 2, (4..8).collect());
    push("PP stage 1 of 2 -> D4", stage, mha(8, 128, 2, 4, 8, 0, 4), 6, 8, 0, &mut rng);
    out
}

/// A pool on the device with its host mirror.
struct Pool {
    mirror: Vec<u8>,
    device: KvLayout,
    host: KvLayout,
    dev_base: u64,
}

fn make_pool(mem: &dyn TestMemory, shape: &PoolShape, capacity: u64, misalign: u64, rng: &mut Rng) -> Result<Pool> {
    let nb = (shape.buffers_per_layer() * shape.layer_count()) as usize;
    let buffer_bytes = (capacity * shape.page_bytes()) as usize;
    let stride = (buffer_bytes + misalign as usize).next_multiple_of(256) + 256;
    let mut mirror = vec![0u8; nb * stride];
    rng.fill(&mut mirror);
    let dev_base = mem.alloc(mirror.len())?;
    mem.write(dev_base, &mirror)?;
    let host_base = mirror.as_ptr() as usize;
    let bases = |base: usize| (0..nb).map(|i| base + i * stride + misalign as usize).collect::<Vec<usize>>();
    let device = KvLayout::new(shape.clone(), capacity, MemoryKind::Cuda, bases(dev_base as usize));
    let host = KvLayout::new(shape.clone(), capacity, MemoryKind::Host, bases(host_base));
    Ok(Pool { mirror, device, host, dev_base })
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
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

fn mismatch(case: &Case, what: &str, at: usize) -> Error {
    Error::internal(format!("case `{}`: {what} differs from the host engine at byte {at}", case.name))
}

/// Runs one case; `Ok(bytes moved)` or an error naming the case and the first differing byte.
pub fn run_case<B: Backend>(engine: &DeviceCopyEngine<B>, mem: &dyn TestMemory, case: &Case, seed: u64) -> Result<u64> {
    let mut rng = Rng(seed | 1);
    let tokens = case.src_pages.len() as u32 * case.src.page_size;
    let st = staging_layout(&case.src, &case.dst, tokens)?;
    let region = st.region_of(&case.src)?.ok_or_else(|| Error::internal(format!("case `{}`: src rank is not a writer", case.name)))?;
    let region = &region;
    let host_engine = HostCopyEngine::new(1);

    // Gather.
    let src = make_pool(mem, &case.src, case.capacity_pages, case.misalign, &mut rng)?;
    let g = plan_gather(&case.src, &case.src_pages, 0, &st, region)?;
    let mut want = vec![0u8; region.bytes as usize];
    // SAFETY: the mirror holds every buffer; `want` is the writer region.
    unsafe { host_engine.gather(&g, &src.host, want.as_mut_ptr()) }?;
    let mut got = vec![0xA5u8; want.len()];
    // SAFETY: device pool and host staging of the region's size.
    unsafe { engine.gather(&g, &src.device, got.as_mut_ptr()) }?;
    if let Some(at) = first_difference(&want, &got) {
        return Err(mismatch(case, "gather into host staging", at));
    }
    let dev_staging = mem.alloc(want.len() + 256)? + case.misalign;
    // SAFETY: device staging of the region's size.
    unsafe { engine.gather(&g, &src.device, dev_staging as *mut u8) }?;
    got.fill(0);
    mem.read(dev_staging, &mut got)?;
    if let Some(at) = first_difference(&want, &got) {
        return Err(mismatch(case, "gather into device staging", at));
    }
    // The source pool is untouched.
    if let Some(at) = first_difference(&src.mirror, &src.read_device(mem)?) {
        return Err(mismatch(case, "source pool after gather", at));
    }

    // Scatter.
    let dst = make_pool(mem, &case.dst, case.capacity_pages, case.misalign, &mut rng)?;
    let before = dst.mirror.clone();
    let s = plan_scatter(&case.dst, &case.dst_pages, &st, region)?;
    // SAFETY: the mirror holds every buffer; `want` is the writer region.
    unsafe { host_engine.scatter(&s, &dst.host, want.as_ptr()) }?;
    // SAFETY: device pool, host staging.
    unsafe { engine.scatter(&s, &dst.device, want.as_ptr()) }?;
    if let Some(at) = first_difference(&dst.mirror, &dst.read_device(mem)?) {
        return Err(mismatch(case, "decode pool after scatter from host staging", at));
    }
    dst.reset_device(mem, &before)?;
    // SAFETY: device pool, device staging holding the gathered bytes.
    unsafe { engine.scatter(&s, &dst.device, dev_staging as *const u8) }?;
    if let Some(at) = first_difference(&dst.mirror, &dst.read_device(mem)?) {
        return Err(mismatch(case, "decode pool after scatter from device staging", at));
    }
    // Direct mode: the prefill pool's rows straight into the decode pool, no staging between.
    dst.reset_device(mem, &before)?;
    // SAFETY: both pools are device memory of the case; the plans are of one region.
    unsafe { engine.copy_across(&g, &src.device, &s, &dst.device, &crate::deadline::Deadline::after(None)) }?;
    if let Some(at) = first_difference(&dst.mirror, &dst.read_device(mem)?) {
        return Err(mismatch(case, "decode pool after the direct copy", at));
    }
    Ok(g.bytes() + 2 * s.bytes())
}

/// Runs every standard case; returns (cases, bytes moved per engine pass).
pub fn run_all<B: Backend>(engine: &DeviceCopyEngine<B>, mem: &dyn TestMemory, log: &mut dyn FnMut(&str)) -> Result<(usize, u64)> {
    let cases = standard_cases();
    let mut bytes = 0;
    for (i, case) in cases.iter().enumerate() {
        let t = std::time::Instant::now();
        let moved = run_case(engine, mem, case, 0x5EED + i as u64)?;
        log(&format!("ok   {:<32} {moved:>9} bytes {:>8.1} ms", case.name, t.elapsed().as_secs_f64() * 1e3));
        bytes += moved;
    }
    Ok((cases.len(), bytes))
}
