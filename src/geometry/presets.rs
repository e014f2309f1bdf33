//! The engines' own pool layouts by name (docs/GEOMETRY.md, "Pool layouts"): the strides of a
//! [`super::KvLayout`] for sglang's token-major pool, vLLM's six orders of `[L, B, H, N, C]` (K and V
//! in one cell, `C = K‖V`) and TensorRT-LLM's blocks (`[block][layer][K/V][head][token][dim]`).

use super::{Error, ModelKind, PoolShape, Result, Strides};

/// A named pool layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayoutPreset {
    /// sglang: per layer a K and a V buffer `[slots, heads, D]`.
    Sglang,
    /// vLLM `[L, B, H, N, C]` stored in this order of its axes (outermost first).
    VllmLbhnc,
    VllmLbnhc,
    VllmLhbnc,
    VllmBlhnc,
    VllmBlnhc,
    VllmBhlnc,
    /// TensorRT-LLM: `[block][layer][K/V][head][token][dim]`.
    Trtllm,
}

/// Where a preset puts a pool's buffers: the strides of K (or the latent) and of V (the same but
/// where V's heads differ in size and lie apart from K's), V's offset from K in the same layer
/// (0: V has buffers of its own), and the bytes between consecutive layers' K (layer `i`'s K lies
/// `i · layer_stride` after layer 0's where all layers are one tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub strides: Strides,
    pub v_strides: Strides,
    pub v_offset: u64,
    pub layer_stride: u64,
}

impl LayoutPreset {
    pub const ALL: [LayoutPreset; 8] = [
        LayoutPreset::Sglang,
        LayoutPreset::VllmLbhnc,
        LayoutPreset::VllmLbnhc,
        LayoutPreset::VllmLhbnc,
        LayoutPreset::VllmBlhnc,
        LayoutPreset::VllmBlnhc,
        LayoutPreset::VllmBhlnc,
        LayoutPreset::Trtllm,
    ];

    /// The name in kvstage-bench, Python and the docs (`sglang`, `vllm-lbhnc`, …, `trtllm`).
    pub fn name(self) -> &'static str {
        match self {
            LayoutPreset::Sglang => "sglang",
            LayoutPreset::VllmLbhnc => "vllm-lbhnc",
            LayoutPreset::VllmLbnhc => "vllm-lbnhc",
            LayoutPreset::VllmLhbnc => "vllm-lhbnc",
            LayoutPreset::VllmBlhnc => "vllm-blhnc",
            LayoutPreset::VllmBlnhc => "vllm-blnhc",
            LayoutPreset::VllmBhlnc => "vllm-bhlnc",
            LayoutPreset::Trtllm => "trtllm",
        }
    }

    pub fn from_name(name: &str) -> Result<LayoutPreset> {
        Self::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|p| p.name()).collect();
            Error::invalid_arg("layout", format!("{name:?} is not a layout name ({})", names.join(", ")))
        })
    }

    /// The C enum value (`kvstage_layout_preset`: its position in [`Self::ALL`]).
    pub fn from_c(value: i32) -> Option<LayoutPreset> {
        usize::try_from(value).ok().and_then(|i| Self::ALL.get(i)).copied()
    }

    /// The placement of a pool of `shape` holding `capacity_pages` pages (blocks) of its
    /// `layer_ids.len()` layers.
    pub fn placement(self, shape: &PoolShape, capacity_pages: u64) -> Placement {
        let (h, n, l, cap) = (shape.local_heads as u64, shape.page_size as u64, shape.layer_ids.len() as u64, capacity_pages);
        let mha = shape.kind == ModelKind::Mha;
        let (hb, hbv) = (shape.head_bytes_of(0), if mha { shape.head_bytes_of(1) } else { 0 });
        // vLLM's cell holds K and V of one (head, token): `head_size + head_size_v` elements.
        let cell = hb + hbv;
        let v_cell = if mha { hb } else { 0 };
        let st = |page, token, head| Strides { page, token, head };
        let shared = |strides, v_offset, layer_stride| Placement { strides, v_strides: strides, v_offset, layer_stride };
        match self {
            LayoutPreset::Sglang => Placement {
                strides: Strides::token_major_of(shape, 0),
                v_strides: Strides::token_major_of(shape, 1),
                v_offset: 0,
                layer_stride: cap * n * h * hb,
            },
            LayoutPreset::VllmLbhnc => shared(st(h * n * cell, cell, n * cell), v_cell, cap * h * n * cell),
            LayoutPreset::VllmLbnhc => shared(st(n * h * cell, h * cell, cell), v_cell, cap * n * h * cell),
            LayoutPreset::VllmLhbnc => shared(st(n * cell, cell, cap * n * cell), v_cell, h * cap * n * cell),
            LayoutPreset::VllmBlhnc => shared(st(l * h * n * cell, cell, n * cell), v_cell, h * n * cell),
            LayoutPreset::VllmBlnhc => shared(st(l * n * h * cell, h * cell, cell), v_cell, n * h * cell),
            LayoutPreset::VllmBhlnc => shared(st(h * l * n * cell, cell, l * n * cell), v_cell, n * cell),
            LayoutPreset::Trtllm => {
                // One layer of one block: K's heads `[head][token][dim]`, then V's.
                let (k_half, v_half) = (h * n * hb, h * n * hbv);
                let page = l * (k_half + v_half);
                Placement {
                    strides: st(page, hb, n * hb),
                    v_strides: if mha { st(page, hbv, n * hbv) } else { st(page, hb, n * hb) },
                    v_offset: if mha { k_half } else { 0 },
                    layer_stride: k_half + v_half,
                }
            }
        }
    }

    /// Bytes of one tensor holding every buffer of the pool as [`Self::bases`] places them: what
    /// an engine allocates for it.
    pub fn tensor_bytes(self, shape: &PoolShape, capacity_pages: u64) -> u64 {
        let layout = self.layout(shape, capacity_pages, super::MemoryKind::Host, 0);
        let ends = layout.bases.iter().enumerate().map(|(i, &b)| b as u64 + layout.buffer_bytes(i as u32));
        ends.max().unwrap_or(0)
    }

    /// A pool of this layout in one tensor at `base` ([`Self::bases`], the placement's strides).
    pub fn layout(self, shape: &PoolShape, capacity_pages: u64, memory: super::MemoryKind, base: usize) -> super::KvLayout {
        let p = self.placement(shape, capacity_pages);
        super::KvLayout::new(shape.clone(), capacity_pages, memory, self.bases(shape, capacity_pages, base)).with_strides(p.strides).with_v_strides(p.v_strides)
    }

    /// The bases of a pool of this layout in one tensor at `base` (K of every layer, then V, as
    /// [`super::KvLayout::bases`] lists them); where V is not in K's cell or block (sglang), the V
    /// buffers follow all K buffers.
    pub fn bases(self, shape: &PoolShape, capacity_pages: u64, base: usize) -> Vec<usize> {
        let p = self.placement(shape, capacity_pages);
        let layers = shape.layer_ids.len();
        let k: Vec<usize> = (0..layers).map(|i| base + i * p.layer_stride as usize).collect();
        if shape.kind == ModelKind::Mla {
            return k;
        }
        let v: Vec<usize> = if p.v_offset == 0 {
            // V's buffers of their own (sglang) follow every K, back to back.
            let v_layer = capacity_pages * p.v_strides.page;
            (0..layers).map(|i| base + layers * p.layer_stride as usize + i * v_layer as usize).collect()
        } else {
            k.iter().map(|&b| b + p.v_offset as usize).collect()
        };
        [k, v].concat()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::MemoryKind;

    /// Every preset, MHA and MLA, several TP ranks: a valid layout whose rows fill the tensor
    /// exactly once (no row outside it, no byte of it twice), each row where the engine's own
    /// index formula puts it.
    #[test]
    fn every_preset_tiles_its_tensor_as_the_engine_indexes_it() {
        for preset in LayoutPreset::ALL {
            for shape in [
                PoolShape::new(ModelKind::Mha, 8, 16, 2, 4, 3).with_tp(1, 2),
                PoolShape::new(ModelKind::Mha, 2, 8, 4, 3, 2),
                PoolShape::new(ModelKind::Mha, 4, 12, 2, 4, 2).with_tp(0, 2).with_head_dim_v(8),
                PoolShape::new(ModelKind::Mha, 2, 4, 2, 2, 3).with_head_dim_v(10),
                PoolShape::new(ModelKind::Mla, 1, 24, 2, 5, 2),
            ] {
                let cap = 3;
                let bytes = preset.tensor_bytes(&shape, cap) as usize;
                let base = 0x10000;
                let layout = preset.layout(&shape, cap, MemoryKind::Host, base);
                layout.validate().unwrap_or_else(|e| panic!("{}: {}", preset.name(), e.chain()));
                let mut seen = vec![0u8; bytes];
                let (h, n, l) = (shape.local_heads as u64, shape.page_size as u64, shape.layer_ids.len() as u64);
                let kvn = shape.buffers_per_layer() as u64;
                let (hk, hv) = (shape.head_bytes_of(0), if kvn == 2 { shape.head_bytes_of(1) } else { 0 });
                for li in 0..l {
                    for kv in 0..kvn {
                        for b in 0..cap {
                            for s in 0..n {
                                for hd in 0..h {
                                    let hb = if kv == 0 { hk } else { hv };
                                    let at = layout.bases[(kv * l + li) as usize] as u64 - base as u64 + layout.slot_offset(kv as u32, b * n + s) + hd * layout.strides_of(kv as u32).head;
                                    // The engine's formula: byte offsets in its own axis order.
                                    let c = hk + hv; // vLLM cell bytes: K‖V
                                    let cell = kv * hk; // V's place in the cell
                                    let want = match preset {
                                        LayoutPreset::Sglang => kv * l * cap * n * h * hk + li * cap * n * h * hb + (b * n + s) * h * hb + hd * hb,
                                        LayoutPreset::VllmLbhnc => (((li * cap + b) * h + hd) * n + s) * c + cell,
                                        LayoutPreset::VllmLbnhc => (((li * cap + b) * n + s) * h + hd) * c + cell,
                                        LayoutPreset::VllmLhbnc => (((li * h + hd) * cap + b) * n + s) * c + cell,
                                        LayoutPreset::VllmBlhnc => (((b * l + li) * h + hd) * n + s) * c + cell,
                                        LayoutPreset::VllmBlnhc => (((b * l + li) * n + s) * h + hd) * c + cell,
                                        LayoutPreset::VllmBhlnc => (((b * h + hd) * l + li) * n + s) * c + cell,
                                        // A block: per layer K `[head][token][D]` then V `[head][token][Dv]`.
                                        LayoutPreset::Trtllm => (b * l + li) * h * n * c + kv * h * n * hk + (hd * n + s) * hb,
                                    };
                                    assert_eq!(at, want, "{} layer {li} kv {kv} block {b} token {s} head {hd}", preset.name());
                                    for e in 0..hb {
                                        seen[(at + e) as usize] += 1;
                                    }
                                }
                            }
                        }
                    }
                }
                assert!(seen.iter().all(|&x| x == 1), "{}: the rows tile the tensor once", preset.name());
                assert_eq!(LayoutPreset::from_name(preset.name()).unwrap(), preset);
            }
        }
        assert!(LayoutPreset::from_name("nhd").unwrap_err().message().contains("\"nhd\" is not a layout name (sglang, vllm-lbhnc"));
    }
}
