//! The pure math of the staged path: pool shapes and layouts, head mapping, rank pairing, staging
//! layout, chunk grid, fingerprints, and the copy planner shared by every copy engine.
//!
//! Nothing here touches memory: [`KvLayout`] carries base addresses only so that they can be
//! validated (NULL, overlap, address-space overflow) before an engine dereferences them.
//! See docs/GEOMETRY.md ("Head mapping", "Staging layout"); the staging layout follows the
//! pipeline split (see `staging`), not a fixed writer order by prefill rank.

use crate::error::{Error, FieldMismatch, Result, Status};

pub(crate) mod fingerprint;
mod grid;
mod heads;
mod layout;
mod pairing;
mod presets;
pub mod plan;
mod slice;
mod span;
mod staging;
pub mod parts;
pub mod state;

pub use fingerprint::{Fingerprint, FINGERPRINT_VERSION};
pub use grid::{chunk_count, chunk_span, grid_tokens, split_grid, ChunkSpan, GridPiece, DEFAULT_CHUNK_TOKENS};
pub use heads::{
    decode_pp_ranks_for_prefill, decode_ranks_for_prefill, head_slice, mla_source_rank, pp_writers,
    prefill_pp_ranks_for_decode, prefill_ranks_for_decode, sends_its_heads, tp_writers, tp_writers_of, writers_per_chunk,
    HeadSlice,
};
pub use layout::{KvLayout, PoolGeometry, Strides};
pub use presets::{LayoutPreset, Placement};
pub use pairing::{decode_peers, decode_peers_of_request, prefill_peers, prefill_peers_of_request, PeerRank};
pub use plan::{plan_chunk, plan_gather, plan_scatter, CopyPlan, CopyRun, RowGeometry, Segment, Slab};
pub use slice::{slice_plan, SliceOp};
pub use span::PageSpan;
pub use staging::{staging_layout, staging_layout_stages, MissingWriter, StagingLayout, WriterRegion, TAIL_ONLY};
pub use parts::{owed_tail, ComponentKind, ComponentSpec, PartCopy, PoolSpan, RequestParts, TailPart, TailSides};
pub use state::{state_slice, ByteRange, StateItem};

/// Upper bounds that keep every size computation far from overflow (and reject garbage early).
pub(crate) mod limits {
    pub const MAX_PAGE_SIZE: u32 = 1 << 20;
    pub const MAX_HEADS: u32 = 1 << 16;
    pub const MAX_HEAD_DIM: u32 = 1 << 16;
    pub const MAX_PARALLEL: u32 = 1 << 16;
    pub const MAX_LAYERS: usize = 1 << 16;
}

/// Attention flavour of the KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// MHA / GQA: per layer one K and one V buffer of `[pool_tokens, local_heads, head_dim]`.
    Mha,
    /// MLA (DeepSeek): per layer one latent buffer of `[pool_tokens, head_dim]`, replicated on every
    /// TP rank (so `local_heads == global_heads == 1` and no head slicing).
    Mla,
}

impl ModelKind {
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Mha => "MHA",
            ModelKind::Mla => "MLA",
        }
    }

    /// K and V buffers (2) for MHA, one latent buffer for MLA.
    pub fn buffers_per_layer(self) -> u32 {
        match self {
            ModelKind::Mha => 2,
            ModelKind::Mla => 1,
        }
    }
}

/// Where a pool's buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    Host,
    Cuda,
}

/// Pure shape of one rank's pool: what both sides must agree on plus this rank's position.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolShape {
    pub kind: ModelKind,
    /// Token slots per page (`ps`).
    pub page_size: u32,
    /// KV heads held by this rank: `max(1, global_heads / tp_size)` (1 for MLA).
    pub local_heads: u32,
    /// KV heads of the model (`H`; 1 for MLA).
    pub global_heads: u32,
    /// Elements per head (`D`); the latent width (e.g. 576) for MLA.
    pub head_dim: u32,
    /// Elements per V head (`Dv`): `head_dim` unless the model's V heads differ in size from its
    /// K heads (vLLM `head_size_v`, sglang `v_head_dim`). Unused for MLA (no V buffer).
    pub head_dim_v: u32,
    /// Bytes per element (`b`): 1, 2 or 4.
    pub dtype_bytes: u32,
    pub tp_rank: u32,
    pub tp_size: u32,
    pub pp_rank: u32,
    pub pp_size: u32,
    /// Model layer ids this rank holds, strictly increasing. Buffer `i` of the pool holds
    /// `layer_ids[i]`.
    pub layer_ids: Vec<u32>,
}

pub(crate) fn geometry_invalid(field: &str, reason: impl std::fmt::Display) -> Error {
    Error::new(Status::KVSTAGE_E_GEOMETRY_INVALID, format!("invalid KV layout field `{field}`: {reason}"))
}

/// Error for two sides that disagree: one cause per differing field.
pub(crate) fn mismatch_error(what: &str, list: Vec<FieldMismatch>) -> Error {
    let n = list.len();
    let mut err = Error::new(
        Status::KVSTAGE_E_GEOMETRY_MISMATCH,
        format!("{what}: KV geometry mismatch ({n} field{})", if n == 1 { "" } else { "s" }),
    );
    if let Some(chain) = crate::error::CauseChain::from_list(list) {
        err = err.with_source(chain);
    }
    err
}

fn mismatch(field: &str, local: impl ToString, remote: impl ToString) -> FieldMismatch {
    FieldMismatch { field: field.to_owned(), local: local.to_string(), remote: remote.to_string() }
}

/// Fields both sides of a transfer must agree on (not ranks, TP or PP sizes, layer ids nor page
/// sizes: the staging buffer is token-major, so the gather follows prefill pages and the scatter
/// decode pages).
pub(crate) fn agreed_field_mismatches(local: &PoolShape, remote: &PoolShape) -> Vec<FieldMismatch> {
    let mut out = Vec::new();
    if local.kind != remote.kind {
        out.push(mismatch("model_kind", local.kind.name(), remote.kind.name()));
    }
    if local.global_heads != remote.global_heads {
        out.push(mismatch("global_heads", local.global_heads, remote.global_heads));
    }
    if local.head_dim != remote.head_dim {
        out.push(mismatch("head_dim", local.head_dim, remote.head_dim));
    }
    // Where neither side's V heads differ from its K heads, a head_dim mismatch says it all.
    let own_v = |s: &PoolShape| s.head_dim_v != s.head_dim;
    if local.kind == ModelKind::Mha && remote.kind == ModelKind::Mha && local.head_dim_v != remote.head_dim_v && (own_v(local) || own_v(remote)) {
        out.push(mismatch("head_dim_v", local.head_dim_v, remote.head_dim_v));
    }
    if local.dtype_bytes != remote.dtype_bytes {
        out.push(mismatch("dtype_bytes", local.dtype_bytes, remote.dtype_bytes));
    }
    out
}

impl PoolShape {
    /// A shape with defaults for the rank fields (TP 1, PP 1) and `local_heads` derived from
    /// `global_heads`; handy in tests and tools.
    pub fn new(kind: ModelKind, global_heads: u32, head_dim: u32, dtype_bytes: u32, page_size: u32, layers: u32) -> PoolShape {
        PoolShape {
            kind,
            page_size,
            local_heads: global_heads,
            global_heads,
            head_dim,
            head_dim_v: head_dim,
            dtype_bytes,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            layer_ids: (0..layers).collect(),
        }
    }

    /// The same shape with V heads of `head_dim_v` elements.
    pub fn with_head_dim_v(mut self, head_dim_v: u32) -> PoolShape {
        self.head_dim_v = head_dim_v;
        self
    }

    /// The same shape on TP rank `tp_rank` of `tp_size` (recomputes `local_heads`).
    pub fn with_tp(mut self, tp_rank: u32, tp_size: u32) -> PoolShape {
        self.tp_rank = tp_rank;
        self.tp_size = tp_size;
        self.local_heads = match self.kind {
            ModelKind::Mha => (self.global_heads / tp_size.max(1)).max(1),
            ModelKind::Mla => 1,
        };
        self
    }

    /// The same shape on PP rank `pp_rank` of `pp_size`, holding `layer_ids`.
    pub fn with_pp(mut self, pp_rank: u32, pp_size: u32, layer_ids: Vec<u32>) -> PoolShape {
        self.pp_rank = pp_rank;
        self.pp_size = pp_size;
        self.layer_ids = layer_ids;
        self
    }

    /// Checks every field; the error names the field and the values that disagree
    /// (`KVSTAGE_E_GEOMETRY_INVALID`).
    pub fn validate(&self) -> Result<()> {
        use limits::*;
        if self.page_size == 0 || self.page_size > MAX_PAGE_SIZE {
            return Err(geometry_invalid("page_size", format!("{} is outside 1..={MAX_PAGE_SIZE}", self.page_size)));
        }
        if !matches!(self.dtype_bytes, 1 | 2 | 4) {
            return Err(geometry_invalid("dtype_bytes", format!("{} is not 1, 2 or 4", self.dtype_bytes)));
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return Err(geometry_invalid("head_dim", format!("{} is outside 1..={MAX_HEAD_DIM}", self.head_dim)));
        }
        if self.kind == ModelKind::Mha && (self.head_dim_v == 0 || self.head_dim_v > MAX_HEAD_DIM) {
            return Err(geometry_invalid("head_dim_v", format!("{} is outside 1..={MAX_HEAD_DIM}", self.head_dim_v)));
        }
        if self.tp_size == 0 || self.tp_size > MAX_PARALLEL {
            return Err(geometry_invalid("tp_size", format!("{} is outside 1..={MAX_PARALLEL}", self.tp_size)));
        }
        if self.tp_rank >= self.tp_size {
            return Err(geometry_invalid("tp_rank", format!("{} is not below tp_size {}", self.tp_rank, self.tp_size)));
        }
        if self.pp_size == 0 || self.pp_size > MAX_PARALLEL {
            return Err(geometry_invalid("pp_size", format!("{} is outside 1..={MAX_PARALLEL}", self.pp_size)));
        }
        if self.pp_rank >= self.pp_size {
            return Err(geometry_invalid("pp_rank", format!("{} is not below pp_size {}", self.pp_rank, self.pp_size)));
        }
        match self.kind {
            ModelKind::Mha => {
                let h = self.global_heads;
                if h == 0 || h > MAX_HEADS {
                    return Err(geometry_invalid("global_heads", format!("{h} is outside 1..={MAX_HEADS}")));
                }
                if !h.is_multiple_of(self.tp_size) && !self.tp_size.is_multiple_of(h) {
                    return Err(geometry_invalid(
                        "global_heads",
                        format!("{h} and tp_size {} do not divide each other", self.tp_size),
                    ));
                }
                let expected = (h / self.tp_size).max(1);
                if self.local_heads != expected {
                    return Err(geometry_invalid(
                        "local_heads",
                        format!(
                            "{} != {expected} (max(1, global_heads {h} / tp_size {}))",
                            self.local_heads, self.tp_size
                        ),
                    ));
                }
            }
            ModelKind::Mla => {
                if self.global_heads != 1 {
                    return Err(geometry_invalid(
                        "global_heads",
                        format!("{} != 1 (an MLA pool holds one latent vector per token)", self.global_heads),
                    ));
                }
                if self.local_heads != 1 {
                    return Err(geometry_invalid(
                        "local_heads",
                        format!("{} != 1 (an MLA pool holds one latent vector per token)", self.local_heads),
                    ));
                }
            }
        }
        if self.layer_ids.is_empty() {
            return Err(geometry_invalid("layer_ids", "is empty (a pool holds at least one layer)"));
        }
        if self.layer_ids.len() > MAX_LAYERS {
            return Err(geometry_invalid("layer_ids", format!("holds {} ids, more than {MAX_LAYERS}", self.layer_ids.len())));
        }
        for (i, pair) in self.layer_ids.windows(2).enumerate() {
            if pair[1] <= pair[0] {
                return Err(geometry_invalid(
                    "layer_ids",
                    format!(
                        "layer_ids[{}] = {} is not greater than layer_ids[{i}] = {} (ids must be strictly increasing)",
                        i + 1,
                        pair[1],
                        pair[0]
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Bytes of one token slot of one K (or latent) buffer: `local_heads · head_dim · dtype_bytes`.
    pub fn token_bytes(&self) -> u64 {
        self.token_bytes_of(0)
    }

    /// Bytes of one head of one token of a K (or latent) buffer: `head_dim · dtype_bytes`.
    pub fn head_bytes(&self) -> u64 {
        self.head_bytes_of(0)
    }

    /// Bytes per page per layer of one K (or latent) buffer (`item_len`): `page_size · token_bytes`.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes_of(0)
    }

    /// Elements per head of buffer kind `kv` (0 = K / latent, 1 = V).
    pub fn head_dim_of(&self, kv: u32) -> u32 {
        if kv == 0 {
            self.head_dim
        } else {
            self.head_dim_v
        }
    }

    /// [`Self::head_bytes`] of buffer kind `kv`.
    pub fn head_bytes_of(&self, kv: u32) -> u64 {
        self.head_dim_of(kv) as u64 * self.dtype_bytes as u64
    }

    /// [`Self::token_bytes`] of buffer kind `kv`.
    pub fn token_bytes_of(&self, kv: u32) -> u64 {
        self.local_heads as u64 * self.head_bytes_of(kv)
    }

    /// [`Self::page_bytes`] of buffer kind `kv`.
    pub fn page_bytes_of(&self, kv: u32) -> u64 {
        self.page_size as u64 * self.token_bytes_of(kv)
    }

    /// Bytes of one token of every buffer of a layer (K and V, or the latent).
    pub fn layer_token_bytes(&self) -> u64 {
        (0..self.buffers_per_layer()).map(|kv| self.token_bytes_of(kv)).sum()
    }

    /// 2 for MHA (K and V), 1 for MLA (latent).
    pub fn buffers_per_layer(&self) -> u32 {
        self.kind.buffers_per_layer()
    }

    pub fn layer_count(&self) -> u32 {
        self.layer_ids.len() as u32
    }

    /// Position of `layer_id` in `layer_ids`.
    pub fn layer_index(&self, layer_id: u32) -> Option<u32> {
        self.layer_ids.binary_search(&layer_id).ok().map(|i| i as u32)
    }

    /// Index into [`KvLayout::bases`] of buffer `kv` (0 = K / latent, 1 = V) of layer index `layer_idx`.
    pub fn buffer_index(&self, kv: u32, layer_idx: u32) -> u32 {
        kv * self.layer_count() + layer_idx
    }

    /// Global KV head held in local head slot `local` of this rank (`tp_rank · H / tp_size + local`).
    pub fn global_head(&self, local: u32) -> u32 {
        match self.kind {
            ModelKind::Mha => (self.tp_rank as u64 * self.global_heads as u64 / self.tp_size as u64) as u32 + local,
            ModelKind::Mla => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mha() -> PoolShape {
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 4).with_tp(1, 4)
    }

    fn err_of(r: Result<()>) -> Error {
        r.expect_err("validation should fail")
    }

    #[test]
    fn token_and_page_bytes() {
        let s = mha();
        assert_eq!(s.local_heads, 2);
        assert_eq!(s.token_bytes(), 2 * 128 * 2);
        assert_eq!(s.page_bytes(), 16 * 512);
        assert_eq!(s.buffers_per_layer(), 2);
        assert_eq!(s.global_head(1), 3);
        let mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 64, 61).with_tp(3, 8);
        assert_eq!(mla.local_heads, 1);
        assert_eq!(mla.token_bytes(), 1152);
        assert_eq!(mla.buffers_per_layer(), 1);
        mla.validate().unwrap();
    }

    #[test]
    fn every_shape_validation_error_names_its_field() {
        type Case = (Box<dyn Fn(&mut PoolShape)>, &'static str, &'static str);
        let cases: Vec<Case> = vec![
            (Box::new(|s| s.page_size = 0), "page_size", "0 is outside"),
            (Box::new(|s| s.page_size = (1 << 20) + 1), "page_size", "is outside"),
            (Box::new(|s| s.dtype_bytes = 3), "dtype_bytes", "3 is not 1, 2 or 4"),
            (Box::new(|s| s.head_dim = 0), "head_dim", "0 is outside"),
            (Box::new(|s| s.head_dim_v = 0), "head_dim_v", "0 is outside"),
            (Box::new(|s| s.head_dim_v = 70000), "head_dim_v", "70000 is outside"),
            (Box::new(|s| s.tp_size = 0), "tp_size", "0 is outside"),
            (Box::new(|s| s.tp_rank = 4), "tp_rank", "4 is not below tp_size 4"),
            (Box::new(|s| s.pp_size = 0), "pp_size", "0 is outside"),
            (Box::new(|s| s.pp_rank = 1), "pp_rank", "1 is not below pp_size 1"),
            (Box::new(|s| s.global_heads = 0), "global_heads", "0 is outside"),
            (Box::new(|s| s.global_heads = 6), "global_heads", "6 and tp_size 4 do not divide"),
            (Box::new(|s| s.local_heads = 4), "local_heads", "4 != 2 (max(1, global_heads 8 / tp_size 4))"),
            (Box::new(|s| s.layer_ids.clear()), "layer_ids", "is empty"),
            (Box::new(|s| s.layer_ids = vec![0, 2, 2]), "layer_ids", "layer_ids[2] = 2 is not greater than layer_ids[1] = 2"),
            (Box::new(|s| s.layer_ids = vec![5, 1]), "layer_ids", "layer_ids[1] = 1"),
            (Box::new(|s| s.layer_ids = (0..70000).collect()), "layer_ids", "more than"),
        ];
        for (mutate, field, text) in cases {
            let mut s = mha();
            mutate(&mut s);
            let e = err_of(s.validate());
            assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_INVALID, "{}", e.message());
            assert!(e.message().contains(&format!("`{field}`")), "{} does not name {field}", e.message());
            assert!(e.message().contains(text), "{} lacks {text}", e.message());
        }
        let mut mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 1, 2);
        mla.global_heads = 2;
        assert!(err_of(mla.validate()).message().contains("`global_heads`: 2 != 1"));
        mla.global_heads = 1;
        mla.local_heads = 8;
        assert!(err_of(mla.validate()).message().contains("`local_heads`: 8 != 1"));
    }

    #[test]
    fn agreed_fields_ignore_ranks_and_sizes() {
        let a = mha();
        let b = PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 2).with_tp(0, 2);
        assert!(agreed_field_mismatches(&a, &b).is_empty());
        let mut c = b.clone();
        c.head_dim = 64;
        c.dtype_bytes = 4;
        let list = agreed_field_mismatches(&a, &c);
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].to_string(), "head_dim: local 128 != remote 64");
        assert_eq!(list[1].to_string(), "dtype_bytes: local 2 != remote 4");
        // V heads: compared where either side's differ from its K heads.
        let dv = b.clone().with_head_dim_v(64);
        assert_eq!(agreed_field_mismatches(&a, &dv).iter().map(|m| m.to_string()).collect::<Vec<_>>(), ["head_dim_v: local 128 != remote 64"]);
        assert!(agreed_field_mismatches(&dv, &dv).is_empty());
        let mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 1, 2);
        assert!(agreed_field_mismatches(&mla, &mla.clone().with_head_dim_v(7)).is_empty(), "MLA has no V");
    }
}
