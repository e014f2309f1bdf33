//! Byte layout of one staging allocation (one decode rank, one chunk).
//!
//! ```text
//! allocation = [ writer 0 | writer 1 | … | writer W-1 ]     writer w at Σ bytes of writers < w
//! writer     = [ K_0 | K_1 | … | K_{L-1} | V_0 | … | V_{L-1} ]   (MLA: latent slabs only)
//! slab       = T tokens (chunk page order) × n heads × D × b bytes
//! ```
//! Writer `w = pp_writer · tp_writers + tp_writer`. Every writer carries the same head count `n`;
//! with several PP writers each carries its own block of the decode rank's layers.

use super::heads::{head_slice, mla_source_rank, pp_writers, prefill_ranks_for_decode, sends_its_heads, HeadSlice};
use super::{agreed_field_mismatches, geometry_invalid, mismatch_error, ModelKind, PoolShape};
use crate::error::{Error, FieldMismatch, Result, Status};

/// One writer's region of a staging allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterRegion {
    /// Byte offset of the region within the allocation.
    pub offset: u64,
    /// Region size: `tokens · row_bytes · layers · buffers_per_layer`.
    pub bytes: u64,
    /// Layers carried (`layer_ids.len()`).
    pub layers: u32,
    /// Model layer ids carried, in slab order (ascending).
    pub layer_ids: Vec<u32>,
    /// The prefill rank that writes this region.
    pub src_tp_rank: u32,
    pub src_pp_rank: u32,
    /// Heads it carries: source heads for its gather, destination heads for the scatter.
    pub heads: HeadSlice,
}

/// Layout of one staging allocation on one decode rank for a chunk of `tokens` tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingLayout {
    pub writers: Vec<WriterRegion>,
    /// Bytes of the whole allocation (Σ writer bytes).
    pub total_bytes: u64,
    pub tokens: u32,
    /// Bytes of one token's head slice: `n · D · b`.
    pub row_bytes: u64,
    /// Bytes of one (buffer, layer) slab: `tokens · row_bytes`.
    pub slab_bytes: u64,
    /// Heads per row (`n`).
    pub num_heads: u32,
    pub kind: ModelKind,
    pub page_size: u32,
    pub buffers_per_layer: u32,
    pub tp_writers: u32,
    pub pp_writers: u32,
    /// Parallel sizes of the prefill side this layout was computed for.
    pub src_tp: u32,
    pub src_pp: u32,
    /// The decode rank's shape.
    pub dst: PoolShape,
}

impl StagingLayout {
    /// Offset within the allocation of slab (`kv`, `layer_idx`) of `writer` (`kv` 0 = K / latent,
    /// 1 = V; `layer_idx` indexes the writer's `layer_ids`). Panics when `writer` is out of range.
    pub fn slab_offset(&self, writer: u32, kv: u32, layer_idx: u32) -> u64 {
        let w = &self.writers[writer as usize];
        w.offset + (kv as u64 * w.layers as u64 + layer_idx as u64) * self.slab_bytes
    }

    /// Number of writers whose arrival completes the chunk.
    pub fn writer_count(&self) -> u32 {
        self.writers.len() as u32
    }

    /// The writer index of prefill rank `src` in this allocation, or `None` when that rank does not
    /// write to this decode rank (a different TP or PP group, or a non-designated MLA rank).
    ///
    /// Fails with `KVSTAGE_E_GEOMETRY_MISMATCH` when `src` disagrees with the layout (agreed fields,
    /// TP/PP sizes) or holds a different set of this decode rank's layers than its region carries
    /// (the two sides split pipeline stages differently).
    pub fn writer_for(&self, src: &PoolShape) -> Result<Option<u32>> {
        src.validate().map_err(|e| e.context("prefill (src) pool shape"))?;
        let mut list = agreed_field_mismatches(src, &self.dst);
        if src.tp_size != self.src_tp {
            list.push(FieldMismatch { field: "src tp_size".into(), local: src.tp_size.to_string(), remote: self.src_tp.to_string() });
        }
        if src.pp_size != self.src_pp {
            list.push(FieldMismatch { field: "src pp_size".into(), local: src.pp_size.to_string(), remote: self.src_pp.to_string() });
        }
        if !list.is_empty() {
            return Err(mismatch_error("prefill rank does not match the staging layout", list));
        }
        let Some(w) = self.writers.iter().position(|w| w.src_tp_rank == src.tp_rank && w.src_pp_rank == src.pp_rank) else {
            return Ok(None);
        };
        let held: Vec<u32> = src.layer_ids.iter().copied().filter(|id| self.dst.layer_ids.binary_search(id).is_ok()).collect();
        if held != self.writers[w].layer_ids {
            return Err(mismatch_error(
                "pipeline stages split differently",
                vec![FieldMismatch {
                    field: format!("decode layers held by prefill rank (tp {}, pp {})", src.tp_rank, src.pp_rank),
                    local: format!("{held:?}"),
                    remote: format!("{:?} (writer {w})", self.writers[w].layer_ids),
                }],
            ));
        }
        Ok(Some(w as u32))
    }
}

/// The staging layout of decode rank `dst` for a chunk of `tokens` tokens written by the prefill
/// side described by `src` (any prefill rank: its TP/PP sizes and agreed fields are used).
///
/// With several PP writers (`src.pp_size > dst.pp_size`) the decode rank's layers are split into
/// equal contiguous blocks, one per prefill stage; when they do not split evenly, use
/// [`staging_layout_pp`] with the layer ids each prefill stage really holds.
pub fn staging_layout(src: &PoolShape, dst: &PoolShape, tokens: u32) -> Result<StagingLayout> {
    src.validate().map_err(|e| e.context("prefill (src) pool shape"))?;
    dst.validate().map_err(|e| e.context("decode (dst) pool shape"))?;
    let pw = pp_writers(src.pp_size, dst.pp_size)?;
    let l = dst.layer_ids.len();
    if !l.is_multiple_of(pw as usize) {
        return Err(geometry_invalid(
            "layer_ids",
            format!(
                "the decode rank's {l} layers do not split evenly among {pw} pipeline writers (prefill pp_size {} / decode pp_size {}); pass each stage's layers explicitly",
                src.pp_size, dst.pp_size
            ),
        ));
    }
    let block = l / pw as usize;
    let blocks: Vec<Vec<u32>> = dst.layer_ids.chunks(block).map(|c| c.to_vec()).collect();
    staging_layout_pp(src, dst, tokens, &blocks)
}

/// [`staging_layout`] with explicit layer ids per PP writer: `pp_layers[j]` are the decode rank's
/// layers held by the `j`-th prefill stage writing to it (ascending, disjoint, together exactly
/// `dst.layer_ids`).
pub fn staging_layout_pp(src: &PoolShape, dst: &PoolShape, tokens: u32, pp_layers: &[Vec<u32>]) -> Result<StagingLayout> {
    src.validate().map_err(|e| e.context("prefill (src) pool shape"))?;
    dst.validate().map_err(|e| e.context("decode (dst) pool shape"))?;
    let list = agreed_field_mismatches(src, dst);
    if !list.is_empty() {
        return Err(mismatch_error("prefill and decode pools", list));
    }
    if !tokens.is_multiple_of(dst.page_size) {
        return Err(Error::invalid_arg("tokens", format!("{tokens} is not a multiple of page_size {}", dst.page_size)));
    }
    let pw = pp_writers(src.pp_size, dst.pp_size)?;
    if pp_layers.len() != pw as usize {
        return Err(Error::invalid_arg(
            "pp_layers",
            format!("holds {} layer lists, expected {pw} (one per pipeline writer)", pp_layers.len()),
        ));
    }
    let mut all: Vec<u32> = pp_layers.iter().flatten().copied().collect();
    all.sort_unstable();
    if all != dst.layer_ids || pp_layers.iter().any(|b| b.is_empty() || b.windows(2).any(|p| p[1] <= p[0])) {
        return Err(Error::invalid_arg(
            "pp_layers",
            format!("{pp_layers:?} are not non-empty ascending disjoint blocks covering the decode layers {:?}", dst.layer_ids),
        ));
    }

    let (tw, tp_sources): (u32, Vec<(u32, HeadSlice)>) = match dst.kind {
        ModelKind::Mha => {
            let mut v = Vec::new();
            for rs in prefill_ranks_for_decode(dst.tp_rank, src.tp_size, dst.tp_size)? {
                if sends_its_heads(rs, dst.tp_rank, src.tp_size, dst.tp_size, dst.global_heads) {
                    v.push((rs, head_slice(src.tp_size, dst.tp_size, rs, dst.tp_rank, dst.global_heads)?));
                }
            }
            (v.len() as u32, v)
        }
        ModelKind::Mla => (1, vec![(mla_source_rank(dst.tp_rank, src.tp_size, dst.tp_size)?, HeadSlice::MLA)]),
    };
    let first_pp = if src.pp_size > dst.pp_size { dst.pp_rank * pw } else { dst.pp_rank / (dst.pp_size / src.pp_size) };
    let n = tp_sources[0].1.num_heads;
    let overflow = || Error::new(Status::KVSTAGE_E_GEOMETRY_INVALID, format!("staging size of {tokens} tokens overflows 64 bits"));
    let row_bytes = n as u64 * dst.head_bytes();
    let slab_bytes = (tokens as u64).checked_mul(row_bytes).ok_or_else(overflow)?;
    let bpl = dst.buffers_per_layer();
    let mut writers = Vec::with_capacity((tw * pw) as usize);
    let mut offset = 0u64;
    for (j, layer_ids) in pp_layers.iter().enumerate() {
        let layers = layer_ids.len() as u32;
        let bytes = slab_bytes.checked_mul(layers as u64 * bpl as u64).ok_or_else(overflow)?;
        for &(src_tp_rank, heads) in &tp_sources {
            writers.push(WriterRegion {
                offset,
                bytes,
                layers,
                layer_ids: layer_ids.clone(),
                src_tp_rank,
                src_pp_rank: first_pp + j as u32,
                heads,
            });
            offset = offset.checked_add(bytes).ok_or_else(overflow)?;
        }
    }
    Ok(StagingLayout {
        writers,
        total_bytes: offset,
        tokens,
        row_bytes,
        slab_bytes,
        num_heads: n,
        kind: dst.kind,
        page_size: dst.page_size,
        buffers_per_layer: bpl,
        tp_writers: tw,
        pp_writers: pw,
        src_tp: src.tp_size,
        src_pp: src.pp_size,
        dst: dst.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tp_rank: u32, tp: u32) -> PoolShape {
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 80).with_tp(tp_rank, tp)
    }

    #[test]
    fn seventy_b_p4_to_d2() {
        // GEOMETRY.md: 70B, P4→D2, 8192-token chunk: 2 writers × 640 MiB.
        let st = staging_layout(&shape(0, 4), &shape(1, 2), 8192).unwrap();
        assert_eq!(st.writers.len(), 2);
        assert_eq!(st.row_bytes, 512);
        assert!(st.writers.iter().all(|w| w.bytes == 640 << 20));
        assert_eq!(st.total_bytes, 1280 << 20);
        assert_eq!(st.writers[1].offset, 640 << 20);
        assert_eq!((st.writers[0].src_tp_rank, st.writers[1].src_tp_rank), (2, 3));
        assert_eq!(st.writers[1].heads, HeadSlice { src_head_start: 0, num_heads: 2, dst_head_start: 2 });
        assert_eq!(st.slab_offset(1, 1, 3), (640 << 20) + (80 + 3) * 8192 * 512);
        assert_eq!(st.writer_for(&shape(3, 4)).unwrap(), Some(1));
        assert_eq!(st.writer_for(&shape(1, 4)).unwrap(), None);
    }

    #[test]
    fn per_token_sizes_from_geometry_md() {
        // Per token, all layers, K+V, bf16: 8B 128 KiB, 32B 256 KiB, 70B 320 KiB, DeepSeek-V3 ≈ 68.6 KiB.
        for (layers, kib) in [(32u32, 128u64), (64, 256), (80, 320)] {
            let s = PoolShape::new(ModelKind::Mha, 8, 128, 2, 1, layers);
            assert_eq!(staging_layout(&s, &s, 1).unwrap().total_bytes, kib << 10);
        }
        let mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 1, 61);
        assert_eq!(staging_layout(&mla.clone().with_tp(0, 8), &mla.with_tp(3, 4), 1).unwrap().total_bytes, 61 * 1152);
    }

    #[test]
    fn mla_has_one_designated_writer() {
        let mla = PoolShape::new(ModelKind::Mla, 1, 576, 2, 64, 4);
        let st = staging_layout(&mla.clone().with_tp(0, 2), &mla.clone().with_tp(3, 4), 128).unwrap();
        assert_eq!(st.writers.len(), 1);
        assert_eq!(st.writers[0].src_tp_rank, 1);
        assert_eq!(st.writers[0].bytes, 128 * 1152 * 4);
        assert_eq!(st.writer_for(&mla.clone().with_tp(1, 2)).unwrap(), Some(0));
        assert_eq!(st.writer_for(&mla.with_tp(0, 2)).unwrap(), None);
    }

    #[test]
    fn pipeline_writers_carry_their_layer_blocks() {
        let base = PoolShape::new(ModelKind::Mha, 8, 64, 2, 4, 8);
        let src = |tp_rank, pp_rank: u32| base.clone().with_tp(tp_rank, 4).with_pp(pp_rank, 4, (pp_rank * 2..pp_rank * 2 + 2).collect());
        let dst = base.clone().with_tp(1, 2).with_pp(1, 2, (4..8).collect());
        let st = staging_layout(&src(0, 0), &dst, 8).unwrap();
        assert_eq!((st.tp_writers, st.pp_writers, st.writers.len()), (2, 2, 4));
        assert_eq!(st.writers[3].layer_ids, vec![6, 7]);
        assert_eq!((st.writers[3].src_tp_rank, st.writers[3].src_pp_rank), (3, 3));
        assert_eq!(st.writer_for(&src(3, 3)).unwrap(), Some(3));
        assert_eq!(st.writer_for(&src(2, 2)).unwrap(), Some(0));
        assert_eq!(st.writer_for(&src(2, 1)).unwrap(), None);
        // A prefill stage that holds a different block is a mismatch, not a silent garble.
        let odd = base.clone().with_tp(2, 4).with_pp(2, 4, vec![3, 4]);
        let e = st.writer_for(&odd).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert!(e.causes()[0].contains("local [4] != remote [4, 5] (writer 0)"), "{:?}", e.causes());
        // Uneven split needs explicit blocks.
        let dst5 = base.clone().with_tp(1, 2).with_pp(0, 1, (0..5).collect());
        let src2 = base.clone().with_tp(2, 4).with_pp(0, 2, vec![0, 1, 2]);
        let e = staging_layout(&src2, &dst5, 8).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_INVALID);
        assert!(e.message().contains("5 layers do not split evenly among 2 pipeline writers"), "{}", e.message());
        let st = staging_layout_pp(&src2, &dst5, 8, &[vec![0, 1, 2], vec![3, 4]]).unwrap();
        assert_eq!(st.writers[0].bytes, 8 * 2 * 64 * 2 * 3 * 2);
        assert_eq!(st.writers[2].bytes, 8 * 2 * 64 * 2 * 2 * 2);
        assert_eq!(st.writers[2].offset, 2 * st.writers[0].bytes);
        assert_eq!(st.writer_for(&src2).unwrap(), Some(0));
    }

    #[test]
    fn staging_errors() {
        let e = staging_layout(&shape(0, 4), &shape(1, 2), 20).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(e.message().contains("`tokens`: 20 is not a multiple of page_size 16"));
        let mut other = shape(1, 2);
        other.head_dim = 64;
        other.dtype_bytes = 4;
        let e = staging_layout(&shape(0, 4), &other, 16).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert_eq!(e.causes(), vec!["head_dim: local 128 != remote 64", "dtype_bytes: local 2 != remote 4"]);
        let mut bad = shape(0, 4);
        bad.local_heads = 3;
        let e = staging_layout(&bad, &shape(1, 2), 16).unwrap_err();
        assert_eq!(e.message(), "prefill (src) pool shape");
        assert!(e.causes()[0].contains("`local_heads`"));
        let e = staging_layout(&shape(0, 4), &shape(0, 3).with_tp(0, 3), 16).unwrap_err();
        assert!(e.message().contains("decode (dst) pool shape"), "{}", e.message());
        let e = staging_layout_pp(&shape(0, 4), &shape(1, 2), 16, &[vec![0]]).unwrap_err();
        assert!(e.message().contains("`pp_layers`"));
        let e = staging_layout_pp(&shape(0, 4), &shape(1, 2), 16, &[]).unwrap_err();
        assert!(e.message().contains("holds 0 layer lists, expected 1"));
        let st = staging_layout(&shape(0, 4), &shape(1, 2), 16).unwrap();
        let mut wrong_tp = shape(0, 8);
        wrong_tp.tp_rank = 2;
        let e = st.writer_for(&wrong_tp).unwrap_err();
        assert_eq!(e.causes(), vec!["src tp_size: local 8 != remote 4"]);
        let e = staging_layout(&shape(0, 4), &shape(1, 2), 0).map(|s| s.total_bytes).unwrap();
        assert_eq!(e, 0);
    }
}
