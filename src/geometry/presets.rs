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

/// Where a preset puts a pool's buffers: the strides every buffer shares, V's offset from K in
/// the same layer (0: V has buffers of its own), and the bytes between consecutive layers' K
/// (layer `i`'s K lies `i · layer_stride` after layer 0's where all layers are one tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub strides: Strides,
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
        let hb = shape.head_bytes();
        let kv = shape.buffers_per_layer() as u64;
        // vLLM's cell holds K and V of one (head, token): `head_size + head_size_v` elements.
        let cell = kv * hb;
        let v_cell = if shape.kind == ModelKind::Mha { hb } else { 0 };
        let place = |page, token, head, v_offset, layer_stride| Placement { strides: Strides { page, token, head }, v_offset, layer_stride };
        match self {
            LayoutPreset::Sglang => place(n * h * hb, h * hb, hb, 0, cap * n * h * hb),
            LayoutPreset::VllmLbhnc => place(h * n * cell, cell, n * cell, v_cell, cap * h * n * cell),
            LayoutPreset::VllmLbnhc => place(n * h * cell, h * cell, cell, v_cell, cap * n * h * cell),
            LayoutPreset::VllmLhbnc => place(n * cell, cell, cap * n * cell, v_cell, h * cap * n * cell),
            LayoutPreset::VllmBlhnc => place(l * h * n * cell, cell, n * cell, v_cell, h * n * cell),
            LayoutPreset::VllmBlnhc => place(l * n * h * cell, h * cell, cell, v_cell, n * h * cell),
            LayoutPreset::VllmBhlnc => place(h * l * n * cell, cell, l * n * cell, v_cell, n * cell),
            LayoutPreset::Trtllm => {
                let half = h * n * hb; // one layer's K (or V) of one block
                place(l * kv * half, hb, n * hb, if kv == 2 { half } else { 0 }, kv * half)
            }
        }
    }

    /// Bytes of one tensor holding every buffer of the pool as [`Self::bases`] places them: what
    /// an engine allocates for it.
    pub fn tensor_bytes(self, shape: &PoolShape, capacity_pages: u64) -> u64 {
        let strides = self.placement(shape, capacity_pages).strides;
        let layout = super::KvLayout::new(shape.clone(), capacity_pages, super::MemoryKind::Host, Vec::new()).with_strides(strides);
        self.bases(shape, capacity_pages, 0).iter().max().map_or(0, |&b| b as u64) + layout.buffer_bytes()
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
        let v_offset = if p.v_offset == 0 { layers as u64 * p.layer_stride } else { p.v_offset };
        let v = k.iter().map(|&b| b + v_offset as usize);
        k.iter().copied().chain(v).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{KvLayout, MemoryKind};

    /// Every preset, MHA and MLA, several TP ranks: a valid layout whose rows fill the tensor
    /// exactly once (no row outside it, no byte of it twice), each row where the engine's own
    /// index formula puts it.
    #[test]
    fn every_preset_tiles_its_tensor_as_the_engine_indexes_it() {
        for preset in LayoutPreset::ALL {
            for shape in [
                PoolShape::new(ModelKind::Mha, 8, 16, 2, 4, 3).with_tp(1, 2),
                PoolShape::new(ModelKind::Mha, 2, 8, 4, 3, 2),
                PoolShape::new(ModelKind::Mla, 1, 24, 2, 5, 2),
            ] {
                let cap = 3;
                let bytes = preset.tensor_bytes(&shape, cap) as usize;
                let base = 0x10000;
                let layout = KvLayout::new(shape.clone(), cap, MemoryKind::Host, preset.bases(&shape, cap, base)).with_strides(preset.placement(&shape, cap).strides);
                layout.validate().unwrap_or_else(|e| panic!("{}: {}", preset.name(), e.chain()));
                let mut seen = vec![0u8; bytes];
                let (h, n, l, hb) = (shape.local_heads as u64, shape.page_size as u64, shape.layer_ids.len() as u64, shape.head_bytes());
                let kvn = shape.buffers_per_layer() as u64;
                for li in 0..l {
                    for kv in 0..kvn {
                        for b in 0..cap {
                            for s in 0..n {
                                for hd in 0..h {
                                    let at = layout.bases[(kv * l + li) as usize] as u64 - base as u64 + layout.slot_offset(b * n + s) + hd * layout.strides.head;
                                    // The engine's formula: element offsets in its own axis order.
                                    let c = kvn * hb; // vLLM cell bytes
                                    let want = match preset {
                                        LayoutPreset::Sglang => kv * l * cap * n * h * hb + li * cap * n * h * hb + (b * n + s) * h * hb + hd * hb,
                                        LayoutPreset::VllmLbhnc => (((li * cap + b) * h + hd) * n + s) * c + kv * hb,
                                        LayoutPreset::VllmLbnhc => (((li * cap + b) * n + s) * h + hd) * c + kv * hb,
                                        LayoutPreset::VllmLhbnc => (((li * h + hd) * cap + b) * n + s) * c + kv * hb,
                                        LayoutPreset::VllmBlhnc => (((b * l + li) * h + hd) * n + s) * c + kv * hb,
                                        LayoutPreset::VllmBlnhc => (((b * l + li) * n + s) * h + hd) * c + kv * hb,
                                        LayoutPreset::VllmBhlnc => (((b * h + hd) * l + li) * n + s) * c + kv * hb,
                                        LayoutPreset::Trtllm => ((((b * l + li) * kvn + kv) * h + hd) * n + s) * hb,
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
