//! Support for the demo, the benchmark and the tests: host pools filled with a position-unique
//! pattern, and a verifier that recomputes the expected decode bytes from first principles
//! (global head, layer, token position) — independently of the planner it checks; pools in any
//! engine's layout ([`HostPool::with_layout`]), their rows addressed through each engine's own
//! index formula ([`Reference`]) — independently of the library's strides; and [`cluster`], a
//! prefill and a decode process on one machine.
//!
//! A crate of its own (`kvstage-testkit`): none of it is compiled into `libkvstage`. The tools
//! (`tools/`) depend on it, and the root package's integration tests as a dev-dependency.

use kvstage::geometry::{KvLayout, LayoutPreset, MemoryKind, ModelKind, PoolShape};

/// A model shape preset (per-token bytes match docs/GEOMETRY.md, "Sizes").
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub name: &'static str,
    pub kind: ModelKind,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Elements per V head where they differ from K's; 0 = `head_dim`.
    pub head_dim_v: u32,
    pub dtype_bytes: u32,
}

pub const MODELS: [Model; 4] = [
    Model { name: "llama3-8b", kind: ModelKind::Mha, layers: 32, kv_heads: 8, head_dim: 128, head_dim_v: 0, dtype_bytes: 2 },
    Model { name: "qwen3-32b", kind: ModelKind::Mha, layers: 64, kv_heads: 8, head_dim: 128, head_dim_v: 0, dtype_bytes: 2 },
    Model { name: "llama3-70b", kind: ModelKind::Mha, layers: 80, kv_heads: 8, head_dim: 128, head_dim_v: 0, dtype_bytes: 2 },
    Model { name: "deepseek-v3", kind: ModelKind::Mla, layers: 61, kv_heads: 1, head_dim: 576, head_dim_v: 0, dtype_bytes: 2 },
];

pub fn model(name: &str) -> Option<Model> {
    MODELS.iter().copied().find(|m| m.name == name)
}

impl Model {
    pub fn shape(&self, page_size: u32, tp_rank: u32, tp_size: u32) -> PoolShape {
        let v = if self.head_dim_v == 0 { self.head_dim } else { self.head_dim_v };
        PoolShape::new(self.kind, self.kv_heads, self.head_dim, self.dtype_bytes, page_size, self.layers).with_head_dim_v(v).with_tp(tp_rank, tp_size)
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

/// Where an engine puts the rows of a pool, computed here from each engine's own axis order
/// (outermost first), never through the library's [`Strides`](kvstage::geometry::Strides) or
/// `slot_offset`: a wrong stride in the library cannot agree with it. Offsets are from the start
/// of the one allocation holding every buffer.
///
/// Padding: every page (block) row, the bytes from the page axis inwards, is followed by `pad`
/// bytes nothing addresses, so the page stride grows by `pad` in every layout and every axis
/// outside the page grows with it: sglang's buffers (`[pages][page + pad]` each, back to back),
/// vLLM's layer-first orders (the layer and, for LHBNC, the head stride). In the block-first
/// layouts (vLLM's B… orders, TensorRT-LLM) the block is the outermost axis and nothing else
/// moves.
#[derive(Clone, Debug)]
pub struct Reference {
    pub preset: LayoutPreset,
    pub pad: u64,
    /// Layers of the pool (its stage's), capacity in pages, tokens per page, local heads, bytes
    /// of one K (or latent) head's row and of one V head's row (0 for MLA), buffers per layer
    /// (2: K and V; 1: MLA's latent).
    layers: u64,
    cap: u64,
    ps: u64,
    heads: u64,
    hk: u64,
    hv: u64,
    kvn: u64,
}

impl Reference {
    pub fn new(shape: &PoolShape, capacity_pages: u64, preset: LayoutPreset, pad: u64) -> Reference {
        Reference {
            preset,
            pad,
            layers: shape.layer_ids.len() as u64,
            cap: capacity_pages,
            ps: shape.page_size as u64,
            heads: shape.local_heads as u64,
            hk: shape.head_dim as u64 * shape.dtype_bytes as u64,
            hv: if shape.kind == ModelKind::Mla { 0 } else { shape.head_dim_v as u64 * shape.dtype_bytes as u64 },
            kvn: if shape.kind == ModelKind::Mla { 1 } else { 2 },
        }
    }

    /// Bytes of one head's row of buffer `kv` (0: K or the latent, 1: V).
    pub fn head_bytes(&self, kv: u64) -> u64 {
        if kv == 0 {
            self.hk
        } else {
            self.hv
        }
    }

    /// vLLM's cell: K‖V of one (head, token), `D + Dv` elements (MLA: the latent alone).
    fn cell(&self) -> u64 {
        self.hk + self.hv
    }

    /// Bytes of one page (block) row before its padding (sglang: of a K buffer; [`Self::v_page_row`]).
    fn page_row(&self) -> u64 {
        let (l, h, n, c) = (self.layers, self.heads, self.ps, self.cell());
        match self.preset {
            // One buffer's page: [token][head][D].
            LayoutPreset::Sglang => n * h * self.hk,
            // [L][B][H][N][C], [L][B][N][H][C]: one layer's block.
            LayoutPreset::VllmLbhnc | LayoutPreset::VllmLbnhc => h * n * c,
            // [L][H][B][N][C]: one (layer, head)'s block.
            LayoutPreset::VllmLhbnc => n * c,
            // [B][L][H][N][C], [B][L][N][H][C], [B][H][L][N][C]: a block of every layer.
            LayoutPreset::VllmBlhnc | LayoutPreset::VllmBlnhc | LayoutPreset::VllmBhlnc => l * h * n * c,
            // [block][layer][K/V][head][token][dim] (V's dim its own).
            LayoutPreset::Trtllm => l * h * n * c,
        }
    }

    /// sglang: bytes of one V buffer's page before its padding.
    fn v_page_row(&self) -> u64 {
        self.ps * self.heads * self.hv
    }

    /// Whether the page (block) is the outermost axis of the whole tensor (vLLM's B… orders,
    /// TensorRT-LLM): the layers, K and V lie inside each block.
    pub fn block_first(&self) -> bool {
        matches!(self.preset, LayoutPreset::VllmBlhnc | LayoutPreset::VllmBlnhc | LayoutPreset::VllmBhlnc | LayoutPreset::Trtllm)
    }

    /// Bytes of the allocation holding every buffer (padding after the last page included).
    pub fn total_bytes(&self) -> u64 {
        let pr = self.page_row() + self.pad;
        match self.preset {
            LayoutPreset::Sglang => self.layers * self.cap * (pr + if self.kvn == 2 { self.v_page_row() + self.pad } else { 0 }),
            LayoutPreset::VllmLbhnc | LayoutPreset::VllmLbnhc => self.layers * self.cap * pr,
            LayoutPreset::VllmLhbnc => self.layers * self.heads * self.cap * pr,
            _ => self.cap * pr,
        }
    }

    /// Byte offset of the row of local head `h` of token slot `s` of page `b`, buffer `kv`
    /// (0: K or the latent, 1: V) of the pool's layer `li` (an index into its `layer_ids`): the
    /// engine's own index arithmetic in its axis order.
    pub fn row(&self, li: u64, kv: u64, b: u64, s: u64, h: u64) -> u64 {
        let (l, cap, hs, n, hb, c) = (self.layers, self.cap, self.heads, self.ps, self.head_bytes(kv), self.cell());
        let pr = self.page_row() + self.pad;
        let v = kv * self.hk; // V's place in a vLLM cell
        match self.preset {
            LayoutPreset::Sglang if kv == 0 => (li * cap + b) * pr + (s * hs + h) * hb,
            LayoutPreset::Sglang => l * cap * pr + (li * cap + b) * (self.v_page_row() + self.pad) + (s * hs + h) * hb,
            LayoutPreset::VllmLbhnc => (li * cap + b) * pr + (h * n + s) * c + v,
            LayoutPreset::VllmLbnhc => (li * cap + b) * pr + (s * hs + h) * c + v,
            LayoutPreset::VllmLhbnc => ((li * hs + h) * cap + b) * pr + s * c + v,
            LayoutPreset::VllmBlhnc => b * pr + ((li * hs + h) * n + s) * c + v,
            LayoutPreset::VllmBlnhc => b * pr + ((li * n + s) * hs + h) * c + v,
            LayoutPreset::VllmBhlnc => b * pr + ((h * l + li) * n + s) * c + v,
            LayoutPreset::Trtllm => b * pr + li * hs * n * c + kv * hs * n * self.hk + (h * n + s) * hb,
        }
    }

    /// The row holding byte `at`, as (layer index, kv, page, token slot, local head, byte of the
    /// row); `None` for padding or a gap no row covers.
    pub fn locate(&self, at: u64) -> Option<(u64, u64, u64, u64, u64, u64)> {
        for li in 0..self.layers {
            for kv in 0..self.kvn {
                for b in 0..self.cap {
                    for s in 0..self.ps {
                        for h in 0..self.heads {
                            let row = self.row(li, kv, b, s, h);
                            if (row..row + self.head_bytes(kv)).contains(&at) {
                                return Some((li, kv, b, s, h, at - row));
                            }
                        }
                    }
                }
            }
        }
        None
    }
}

/// The layout a pool of `preset` registers with its engine: the library's placement
/// ([`LayoutPreset::placement`], [`LayoutPreset::bases`]) of a tensor at `base`, its pages padded
/// by `pad` bytes as [`Reference`] describes (the page stride grows by `pad`; in sglang's and
/// vLLM's layer-first layouts the strides and layer distances that span whole pages grow with it).
fn registered_layout(shape: &PoolShape, capacity_pages: u64, preset: LayoutPreset, pad: u64, base: usize) -> KvLayout {
    let placement = preset.placement(shape, capacity_pages);
    if pad == 0 {
        return preset.layout(shape, capacity_pages, MemoryKind::Host, base);
    }
    let (mut strides, mut v_strides) = (placement.strides, placement.v_strides);
    strides.page += pad;
    v_strides.page += pad;
    // A distance of whole (unpadded) pages, in padded pages.
    let grow = |x: u64| x / placement.strides.page * strides.page;
    let (layer_stride, v_offset) = match preset {
        LayoutPreset::Sglang | LayoutPreset::VllmLbhnc | LayoutPreset::VllmLbnhc => (grow(placement.layer_stride), placement.v_offset),
        LayoutPreset::VllmLhbnc => {
            strides.head = grow(strides.head);
            v_strides.head = strides.head;
            (grow(placement.layer_stride), placement.v_offset)
        }
        // The block is outermost: the layers and V lie inside it.
        _ => (placement.layer_stride, placement.v_offset),
    };
    let layers = shape.layer_ids.len();
    let k: Vec<usize> = (0..layers).map(|i| base + i * layer_stride as usize).collect();
    let v: Vec<usize> = match (shape.kind, v_offset) {
        (ModelKind::Mla, _) => Vec::new(),
        // sglang: V's buffers (pages of their own size, padded) after every K.
        (_, 0) => (0..layers).map(|i| base + layers * layer_stride as usize + i * (capacity_pages * v_strides.page) as usize).collect(),
        (_, off) => k.iter().map(|&b| b + off as usize).collect(),
    };
    KvLayout::new(shape.clone(), capacity_pages, MemoryKind::Host, [k, v].concat()).with_strides(strides).with_v_strides(v_strides)
}

/// One rank's KV pool in host memory: one allocation holding every buffer, laid out as an
/// engine lays it out ([`LayoutPreset`]; sglang's by default: per layer a K and a V buffer,
/// side by side).
pub struct HostPool {
    memory: PoolMemory,
    pub layout: KvLayout,
    /// The engine layout its bytes follow, and the bytes padding each page ([`Reference`]).
    pub preset: LayoutPreset,
    pub pad_bytes: u64,
}

impl HostPool {
    pub fn new(shape: PoolShape, capacity_pages: u64) -> HostPool {
        Self::with_layout(shape, capacity_pages, LayoutPreset::Sglang, 0, false)
    }

    /// A pool in memory of `kvstage_shared_alloc`: a same-host sender can write it directly.
    pub fn shared(shape: PoolShape, capacity_pages: u64) -> HostPool {
        Self::with_layout(shape, capacity_pages, LayoutPreset::Sglang, 0, true)
    }

    /// A pool laid out as `preset` lays it out, each page (block) followed by `pad_bytes` bytes
    /// nothing addresses (a multiple of the dtype; see [`Reference`] for which strides grow), in
    /// shared memory when `shared` (a same-host sender can write it directly). One allocation of
    /// the preset's tensor bytes (plus the padding); the layout the engine gets is the library's
    /// placement of that tensor, [`fill`](Self::fill) and the verifiers address rows through
    /// [`Reference`] alone. Panics where the library's layout would address bytes outside the
    /// allocation.
    ///
    /// A shared pool whose block is the outermost axis leaves out the padding after its last
    /// block: the library shares an allocation with a same-host sender only where the pool's
    /// buffers cover it end to end. Padded pools of the other layouts have padding between
    /// buffers (sglang's buffers, vLLM's layers) and go through the ring.
    pub fn with_layout(shape: PoolShape, capacity_pages: u64, preset: LayoutPreset, pad_bytes: u64, shared: bool) -> HostPool {
        let reference = Reference::new(&shape, capacity_pages, preset, pad_bytes);
        let trailing = if shared && reference.block_first() { pad_bytes } else { 0 };
        let len = (reference.total_bytes() - trailing) as usize;
        let mut memory = if shared {
            PoolMemory::Shared(kvstage::transport::shm::pool::alloc(len).expect("a shared pool allocation"), len)
        } else {
            PoolMemory::Heap(vec![0u8; len])
        };
        // Written, not just calloc'd: a real pool is resident, and first-touch page faults would
        // otherwise be measured as copy time.
        for i in (0..memory.len()).step_by(4096) {
            // SAFETY: in bounds; volatile so the store into calloc'd (known-zero) memory stays.
            unsafe { std::ptr::write_volatile(memory.as_mut_ptr().add(i), 0) };
        }
        let base = memory.as_mut_ptr() as usize;
        let layout = registered_layout(&shape, capacity_pages, preset, pad_bytes, base);
        let end = base + len;
        for (i, &b) in layout.bases.iter().enumerate() {
            let reach = b as u64 + layout.buffer_bytes(i as u32);
            assert!(
                b >= base && reach <= end as u64,
                "the {} layout's buffer {i} ({:#x}, {} bytes; strides {:?}) reaches outside its {len}-byte tensor at {base:#x} (pad {pad_bytes})",
                preset.name(),
                b,
                layout.buffer_bytes(i as u32),
                layout.strides_of(layout.kind_of(i as u32))
            );
        }
        HostPool { memory, layout, preset, pad_bytes }
    }

    /// The pool's rows as the testkit computes them ([`Reference`]).
    pub fn reference(&self) -> Reference {
        Reference::new(&self.layout.shape, self.layout.capacity_pages, self.preset, self.pad_bytes)
    }

    pub fn bytes(&self) -> usize {
        self.memory.len()
    }

    /// Bytes of the pool that are not zero (a fresh pool has none).
    pub fn bytes_nonzero(&self) -> usize {
        self.memory.iter().filter(|&&b| b != 0).count()
    }

    /// Zeroes every byte of the pool (as fresh). No transfer may be writing it.
    pub fn clear(&mut self) {
        self.memory.fill(0);
    }

    /// Writes the pattern for request tokens `first_token..` into `pages` (token order).
    pub fn fill(&mut self, pages: &[u32], first_token: u64) {
        let s = self.layout.shape.clone();
        let r = self.reference();
        for (li, &layer) in s.layer_ids.iter().enumerate() {
            for kv in 0..s.buffers_per_layer() {
                let hb = r.head_bytes(kv as u64) as usize;
                for (i, &page) in pages.iter().enumerate() {
                    for t in 0..s.page_size as u64 {
                        let token = first_token + i as u64 * s.page_size as u64 + t;
                        for lh in 0..s.local_heads {
                            let at = r.row(li as u64, kv as u64, page as u64, t, lh as u64) as usize;
                            pattern(layer, kv, token, global_head(&s, lh), &mut self.memory[at..at + hb]);
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
        let r = self.reference();
        let (mut bad, mut first) = (0u64, None);
        for (li, &layer) in s.layer_ids.iter().enumerate().filter(|(_, &l)| checked(l)) {
            for kv in 0..s.buffers_per_layer() {
                let hb = r.head_bytes(kv as u64) as usize;
                let mut expected = vec![0u8; hb];
                for (i, &page) in pages.iter().enumerate() {
                    for t in 0..s.page_size as u64 {
                        let index = i as u64 * s.page_size as u64 + t;
                        let token = first_token + index;
                        for lh in 0..s.local_heads {
                            let g = global_head(s, lh);
                            if index < count {
                                pattern(layer, kv, token, g, &mut expected);
                            } else {
                                expected.fill(0);
                            }
                            let at = r.row(li as u64, kv as u64, page as u64, t, lh as u64) as usize;
                            let got = &self.memory[at..at + hb];
                            let diff = got.iter().zip(&expected).filter(|(a, b)| a != b).count() as u64;
                            if diff > 0 && first.is_none() {
                                let past = if index < count { "" } else { " (past the last token: must be untouched)" };
                                first = Some(format!(
                                    "layer {layer} kv {kv} token {token} local head {lh} (global {g}) page {page}{past}: {diff} bytes differ [{} pool]",
                                    self.describe()
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

    /// The pool's layout in words: `vllm-lbhnc`, `trtllm, pages padded by 48 bytes`.
    pub fn describe(&self) -> String {
        match self.pad_bytes {
            0 => self.preset.name().to_owned(),
            pad => format!("{}, pages padded by {pad} bytes", self.preset.name()),
        }
    }

    /// Compares every byte of the pool: the rows of each `(pages, first_token, count)` hold the
    /// pattern for request tokens `first_token..` (the first `count` slots of the pages; zeros in
    /// the slots after them), and every other byte (other pages, padding, gaps) is still zero, as
    /// in a fresh pool. Returns the bytes that differ and a description of the first.
    pub fn verify_exact(&self, requests: &[(&[u32], u64, u64)]) -> (u64, Option<String>) {
        let s = &self.layout.shape;
        let r = self.reference();
        let mut expected = vec![0u8; self.memory.len()];
        // (page, slot) -> (request token, whether it is one of the `count`).
        let mut token_of = std::collections::HashMap::new();
        for &(pages, first_token, count) in requests {
            for (i, &page) in pages.iter().enumerate() {
                for t in 0..s.page_size as u64 {
                    let index = i as u64 * s.page_size as u64 + t;
                    token_of.insert((page as u64, t), (first_token + index, index < count));
                    if index >= count {
                        continue;
                    }
                    for (li, &layer) in s.layer_ids.iter().enumerate() {
                        for kv in 0..s.buffers_per_layer() {
                            let hb = r.head_bytes(kv as u64) as usize;
                            for lh in 0..s.local_heads {
                                let at = r.row(li as u64, kv as u64, page as u64, t, lh as u64) as usize;
                                pattern(layer, kv, first_token + index, global_head(s, lh), &mut expected[at..at + hb]);
                            }
                        }
                    }
                }
            }
        }
        let mut bad = 0u64;
        let mut first_at = None;
        for (i, (a, b)) in self.memory.iter().zip(&expected).enumerate() {
            if a != b {
                bad += 1;
                first_at.get_or_insert(i);
            }
        }
        let first = first_at.map(|at| {
            let (got, want) = (self.memory[at], expected[at]);
            let place = match r.locate(at as u64) {
                None => "padding or a gap between rows (must be untouched)".to_owned(),
                Some((li, kv, page, t, lh, e)) => {
                    let what = match token_of.get(&(page, t)) {
                        Some(&(token, true)) => format!("token {token}"),
                        Some(&(token, false)) => format!("token {token}, past the last token (must be untouched)"),
                        None => "a slot of no request (must be untouched)".to_owned(),
                    };
                    format!(
                        "layer {} kv {kv} page {page} slot {t} ({what}) local head {lh} (global {}) byte {e} of the row",
                        s.layer_ids[li as usize],
                        global_head(s, lh as u32)
                    )
                }
            };
            format!("byte {at} of the pool: {place}: {got:#04x}, expected {want:#04x}; {bad} bytes differ [{} pool, rank tp {}/{}]", self.describe(), s.tp_rank, s.tp_size)
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    /// For every preset, MHA and MLA, TP ranks, pages of 1 and 3, padded or not: the reference's
    /// rows tile its tensor (no byte twice, none outside; with padding, exactly the padding
    /// left over), and the layout registered with the library addresses each row where the
    /// reference does (a failure here says the library's placement and the engine's formula
    /// disagree before any transfer runs).
    #[test]
    fn the_reference_tiles_the_tensor_and_the_registered_layout_agrees() {
        for preset in LayoutPreset::ALL {
            for shape in [
                PoolShape::new(ModelKind::Mha, 4, 6, 2, 3, 3).with_tp(1, 2),
                PoolShape::new(ModelKind::Mha, 2, 4, 4, 1, 2),
                PoolShape::new(ModelKind::Mha, 4, 6, 2, 2, 2).with_tp(0, 2).with_head_dim_v(10),
                PoolShape::new(ModelKind::Mla, 1, 10, 2, 3, 2).with_pp(1, 2, vec![1, 3]),
            ] {
                for pad in [0u64, 8] {
                    let cap = 4;
                    let r = Reference::new(&shape, cap, preset, pad);
                    let total = r.total_bytes() as usize;
                    let base = 0x10_0000;
                    let layout = registered_layout(&shape, cap, preset, pad, base);
                    layout.validate().unwrap_or_else(|e| panic!("{} pad {pad}: {}", preset.name(), e.chain()));
                    let mut seen = vec![0u8; total];
                    for li in 0..r.layers {
                        for kv in 0..r.kvn {
                            for b in 0..cap {
                                for t in 0..r.ps {
                                    for h in 0..r.heads {
                                        let at = r.row(li, kv, b, t, h);
                                        let st = layout.strides_of(kv as u32);
                                        let lib = layout.bases[(kv * r.layers + li) as usize] as u64 - base as u64 + b * st.page + t * st.token + h * st.head;
                                        assert_eq!(lib, at, "{} pad {pad} {:?}: layer {li} kv {kv} page {b} slot {t} head {h}", preset.name(), shape.kind);
                                        assert_eq!(r.locate(at + 1), Some((li, kv, b, t, h, 1)));
                                        for e in 0..r.head_bytes(kv) {
                                            seen[(at + e) as usize] += 1;
                                        }
                                    }
                                }
                            }
                        }
                    }
                    let pages = match preset {
                        LayoutPreset::Sglang => r.kvn * r.layers * cap,
                        LayoutPreset::VllmLbhnc | LayoutPreset::VllmLbnhc => r.layers * cap,
                        LayoutPreset::VllmLhbnc => r.layers * r.heads * cap,
                        _ => cap,
                    };
                    assert!(seen.iter().all(|&x| x <= 1), "{} pad {pad}: rows overlap", preset.name());
                    assert_eq!(seen.iter().filter(|&&x| x == 0).count() as u64, pages * pad, "{} pad {pad}: only the padding is left over", preset.name());
                }
            }
        }
    }

    /// Fill, verify and the exact check on a padded pool: a byte changed anywhere shows, named.
    #[test]
    fn verify_exact_names_a_stray_byte() {
        let shape = PoolShape::new(ModelKind::Mha, 2, 4, 2, 2, 2);
        let mut pool = HostPool::with_layout(shape, 6, LayoutPreset::VllmLhbnc, 4, false);
        let pages = [4u32, 1];
        pool.fill(&pages, 10);
        assert_eq!(pool.verify(&pages, 10).0, 0);
        assert_eq!(pool.verify_exact(&[(&pages, 10, u64::MAX)]).0, 0);
        // LHBNC: page 0 of (layer 0, head 0) ends with V of its last slot; its padding follows.
        let pad_at = (pool.reference().row(0, 1, 0, 1, 0) + pool.reference().head_bytes(1)) as usize;
        pool.memory[pad_at] = 1;
        let (bad, first) = pool.verify_exact(&[(&pages, 10, u64::MAX)]);
        assert_eq!(bad, 1);
        assert!(first.as_deref().is_some_and(|f| f.contains("padding or a gap")), "{first:?}");
        pool.memory[pad_at] = 0;
        let row = pool.reference().row(1, 1, 1, 0, 1) as usize; // layer 1, V, page 1, slot 0, head 1
        pool.memory[row + 2] ^= 0xff;
        let (bad, first) = pool.verify_exact(&[(&pages, 10, u64::MAX)]);
        assert_eq!(bad, 1);
        assert!(first.as_deref().is_some_and(|f| f.contains("layer 1 kv 1 page 1 slot 0 (token 12) local head 1 (global 1) byte 2")), "{first:?}");
        assert_eq!(pool.verify(&pages, 10).0, 1);
    }
}
