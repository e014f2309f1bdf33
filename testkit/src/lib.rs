//! Support for the demo, the benchmark and the tests: host pools filled with a position-unique
//! pattern, and a verifier that recomputes the expected decode bytes from first principles
//! (global head, layer, token position) — independently of the planner it checks; and
//! [`cluster`], a prefill and a decode process on one machine.
//!
//! A crate of its own (`kvstage-testkit`): none of it is compiled into `libkvstage`. The tools
//! (`tools/`) depend on it, and the root package's integration tests as a dev-dependency.

use kvstage::geometry::{KvLayout, MemoryKind, ModelKind, PoolShape};

/// A model shape preset (per-token bytes match docs/GEOMETRY.md, "Sizes").
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub name: &'static str,
    pub kind: ModelKind,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
}

pub const MODELS: [Model; 4] = [
    Model { name: "llama3-8b", kind: ModelKind::Mha, layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 },
    Model { name: "qwen3-32b", kind: ModelKind::Mha, layers: 64, kv_heads: 8, head_dim: 128, dtype_bytes: 2 },
    Model { name: "llama3-70b", kind: ModelKind::Mha, layers: 80, kv_heads: 8, head_dim: 128, dtype_bytes: 2 },
    Model { name: "deepseek-v3", kind: ModelKind::Mla, layers: 61, kv_heads: 1, head_dim: 576, dtype_bytes: 2 },
];

pub fn model(name: &str) -> Option<Model> {
    MODELS.iter().copied().find(|m| m.name == name)
}

impl Model {
    pub fn shape(&self, page_size: u32, tp_rank: u32, tp_size: u32) -> PoolShape {
        PoolShape::new(self.kind, self.kv_heads, self.head_dim, self.dtype_bytes, page_size, self.layers)
            .with_tp(tp_rank, tp_size)
    }
}

/// A pool's memory: the heap, or an allocation a same-host sender can map (direct mode).
enum PoolMemory {
    Heap(Vec<u8>),
    Shared(*mut u8, usize),
}

impl std::ops::Deref for PoolMemory {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            PoolMemory::Heap(v) => v,
            // SAFETY: a live allocation of `len` bytes, owned by this value.
            PoolMemory::Shared(ptr, len) => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl std::ops::DerefMut for PoolMemory {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            PoolMemory::Heap(v) => v,
            // SAFETY: as above, borrowed mutably through this value.
            PoolMemory::Shared(ptr, len) => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }
}

impl Drop for PoolMemory {
    fn drop(&mut self) {
        if let PoolMemory::Shared(ptr, _) = self {
            let _ = kvstage::transport::shm::pool::free(*ptr);
        }
    }
}

// SAFETY: plain memory owned by the pool.
unsafe impl Send for PoolMemory {}
unsafe impl Sync for PoolMemory {}

/// One rank's KV pool in host memory (one allocation, buffers side by side).
pub struct HostPool {
    memory: PoolMemory,
    pub layout: KvLayout,
}

impl HostPool {
    pub fn new(shape: PoolShape, capacity_pages: u64) -> HostPool {
        Self::with_memory(shape, capacity_pages, false)
    }

    /// A pool in memory of `kvstage_shared_alloc`: a same-host sender can write it directly.
    pub fn shared(shape: PoolShape, capacity_pages: u64) -> HostPool {
        Self::with_memory(shape, capacity_pages, true)
    }

    fn with_memory(shape: PoolShape, capacity_pages: u64, shared: bool) -> HostPool {
        let buffer = (capacity_pages * shape.page_size as u64 * shape.token_bytes()) as usize;
        let count = (shape.buffers_per_layer() as usize) * shape.layer_ids.len();
        let mut memory = if shared {
            let len = buffer * count;
            PoolMemory::Shared(kvstage::transport::shm::pool::alloc(len).expect("a shared pool allocation"), len)
        } else {
            PoolMemory::Heap(vec![0u8; buffer * count])
        };
        // Written, not just calloc'd: a real pool is resident, and first-touch page faults would
        // otherwise be measured as copy time.
        for i in (0..memory.len()).step_by(4096) {
            // SAFETY: in bounds; volatile so the store into calloc'd (known-zero) memory stays.
            unsafe { std::ptr::write_volatile(memory.as_mut_ptr().add(i), 0) };
        }
        let base = memory.as_mut_ptr() as usize;
        let bases = (0..count).map(|i| base + i * buffer).collect();
        HostPool { memory, layout: KvLayout::new(shape, capacity_pages, MemoryKind::Host, bases) }
    }

    pub fn bytes(&self) -> usize {
        self.memory.len()
    }

    /// Bytes of the pool that are not zero (a fresh pool has none).
    pub fn bytes_nonzero(&self) -> usize {
        self.memory.iter().filter(|&&b| b != 0).count()
    }

    /// Byte range of token slot `slot` of buffer `buffer`.
    fn slot(&self, buffer: usize, slot: u64) -> std::ops::Range<usize> {
        let tb = self.layout.shape.token_bytes() as usize;
        let start = self.layout.bases[buffer] - self.memory.as_ptr() as usize + slot as usize * tb;
        start..start + tb
    }

    /// Writes the pattern for request tokens `first_token..` into `pages` (token order).
    pub fn fill(&mut self, pages: &[u32], first_token: u64) {
        let s = self.layout.shape.clone();
        let head_bytes = (s.head_dim * s.dtype_bytes) as usize;
        for (layer_idx, &layer) in s.layer_ids.iter().enumerate() {
            for kv in 0..s.buffers_per_layer() {
                let buffer = kv as usize * s.layer_ids.len() + layer_idx;
                for (i, &page) in pages.iter().enumerate() {
                    for t in 0..s.page_size as u64 {
                        let token = first_token + i as u64 * s.page_size as u64 + t;
                        let range = self.slot(buffer, page as u64 * s.page_size as u64 + t);
                        let slot = &mut self.memory[range];
                        for lh in 0..s.local_heads {
                            let g = global_head(&s, lh);
                            pattern(layer, kv, token, g, &mut slot[lh as usize * head_bytes..][..head_bytes]);
                        }
                    }
                }
            }
        }
    }

    /// Counts bytes of `pages` that differ from the pattern for request tokens `first_token..`;
    /// returns the count and a description of the first difference.
    pub fn verify(&self, pages: &[u32], first_token: u64) -> (u64, Option<String>) {
        self.verify_layers(pages, first_token, |_| true)
    }

    /// As [`verify`](Self::verify), for the model layers `checked` selects only.
    pub fn verify_layers(&self, pages: &[u32], first_token: u64, checked: impl Fn(u32) -> bool) -> (u64, Option<String>) {
        self.verify_where(pages, first_token, u64::MAX, checked)
    }

    /// As [`verify`](Self::verify) for the first `count` slots of `pages` (a request that ends
    /// inside its last page); the slots after them must still hold zeros (as a fresh pool does).
    pub fn verify_tokens(&self, pages: &[u32], first_token: u64, count: u64) -> (u64, Option<String>) {
        self.verify_where(pages, first_token, count, |_| true)
    }

    fn verify_where(&self, pages: &[u32], first_token: u64, count: u64, checked: impl Fn(u32) -> bool) -> (u64, Option<String>) {
        let s = &self.layout.shape;
        let head_bytes = (s.head_dim * s.dtype_bytes) as usize;
        let mut expected = vec![0u8; head_bytes];
        let (mut bad, mut first) = (0u64, None);
        for (layer_idx, &layer) in s.layer_ids.iter().enumerate().filter(|(_, &l)| checked(l)) {
            for kv in 0..s.buffers_per_layer() {
                let buffer = kv as usize * s.layer_ids.len() + layer_idx;
                for (i, &page) in pages.iter().enumerate() {
                    for t in 0..s.page_size as u64 {
                        let index = i as u64 * s.page_size as u64 + t;
                        let token = first_token + index;
                        let slot = &self.memory[self.slot(buffer, page as u64 * s.page_size as u64 + t)];
                        for lh in 0..s.local_heads {
                            let g = global_head(s, lh);
                            if index < count {
                                pattern(layer, kv, token, g, &mut expected);
                            } else {
                                expected.fill(0);
                            }
                            let got = &slot[lh as usize * head_bytes..][..head_bytes];
                            let diff = got.iter().zip(&expected).filter(|(a, b)| a != b).count() as u64;
                            if diff > 0 && first.is_none() {
                                let past = if index < count { "" } else { " (past the last token: must be untouched)" };
                                first = Some(format!(
                                    "layer {layer} kv {kv} token {token} local head {lh} (global {g}) page {page}{past}: {diff} bytes differ"
                                ));
                            }
                            bad += diff;
                        }
                    }
                }
            }
        }
        (bad, first)
    }
}

/// The model-global head a rank's local head holds, from the TP partition alone: heads split
/// evenly, or with more ranks than heads each head replicated on `tp / H` consecutive ranks.
fn global_head(s: &PoolShape, local: u32) -> u32 {
    match s.kind {
        ModelKind::Mla => 0,
        ModelKind::Mha if s.tp_size <= s.global_heads => s.tp_rank * (s.global_heads / s.tp_size) + local,
        ModelKind::Mha => s.tp_rank / (s.tp_size / s.global_heads),
    }
}

/// Position-unique bytes for (layer, K/V, token, global head): any misplaced copy shows.
fn pattern(layer: u32, kv: u32, token: u64, head: u32, out: &mut [u8]) {
    let mut x = (layer as u64) << 48 ^ (kv as u64) << 44 ^ token << 12 ^ head as u64;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    for chunk in out.chunks_mut(8) {
        x ^= x >> 29;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 32;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// A deterministic page table: `n` distinct pages of a pool of `capacity`, shuffled by `seed`
/// but keeping runs of adjacent pages (as real allocators do) when `runs` is set.
pub fn page_table(n: usize, capacity: u64, seed: u64, runs: bool) -> Vec<u32> {
    let mut pages: Vec<u32> = (0..capacity as u32).collect();
    let mut x = seed.wrapping_add(0x2545_F491_4F6C_DD1D);
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    if runs {
        let start = (next() % (capacity - n as u64 + 1)) as usize;
        return pages[start..start + n].to_vec();
    }
    for i in (1..pages.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        pages.swap(i, j);
    }
    pages.truncate(n);
    pages
}

pub mod cluster;
pub mod parts;
