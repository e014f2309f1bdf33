//! Byte layout of one staging allocation (one decode rank, one chunk).
//!
//! ```text
//! allocation = [ region 0 | region 1 | … ]           regions placed back to back, in placement order
//! region     = [ K_0 | K_1 | … | K_{l-1} | V_0 | … | V_{l-1} ]   (MLA: latent slabs only)
//! slab       = T tokens (chunk token order) × n heads × D × b bytes
//! ```
//! A region is what one prefill rank writes: the decode rank's heads of its head group (its "TP
//! writer") for the decode rank's layers it holds. The allocation holds one slab per (TP writer,
//! decode layer, buffer), so its size follows from the decode rank's shape and the TP sizes alone,
//! whatever the pipeline split: stages of any size, decode stages that take a subset, layer ids
//! that are not contiguous. Where a region lies is decided when it is placed (the receiver places
//! regions in the order their allocation requests arrive and tells each writer its offset);
//! placing refuses a region that carries a (TP writer, layer) another region already carries.

use super::heads::{head_slice, mla_source_rank, prefill_ranks_for_decode, sends_its_heads, HeadSlice};
use super::pairing::check_stages;
use super::parts::{tail_bytes, TailPart};
use super::{agreed_field_mismatches, mismatch_error, ModelKind, PoolShape};
use crate::error::{Error, FieldMismatch, Result, Status};

/// [`WriterRegion::tp_writer`] of a region of request parts only (a rank replicating heads
/// another rank sends; see [`StagingLayout::place_tail_only`]).
pub const TAIL_ONLY: u32 = u32::MAX;

/// One writer's region of a staging allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterRegion {
    /// Byte offset of the region within the allocation (0 until placed).
    pub offset: u64,
    /// Region size: `layers ·` [`StagingLayout::layer_bytes`] of its heads, plus the tail.
    pub bytes: u64,
    /// Layers carried (`layer_ids.len()`).
    pub layers: u32,
    /// Model layer ids carried, in slab order (ascending): the decode rank's layers the writer holds.
    pub layer_ids: Vec<u32>,
    /// The prefill rank that writes this region.
    pub src_tp_rank: u32,
    pub src_pp_rank: u32,
    /// Its TP writer: index of its head group among the decode rank's ([`StagingLayout::tp_ranks`]).
    pub tp_writer: u32,
    /// Heads it carries: source heads for its gather, destination heads for the scatter.
    pub heads: HeadSlice,
    /// The request parts it carries after its KV slabs (the room's last chunk only; offsets
    /// relative to the tail's start, [`WriterRegion::kv_bytes`] into the region).
    pub tail: Vec<TailPart>,
}

/// A prefill rank a chunk still waits for ([`StagingLayout::missing_writers`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MissingWriter {
    pub src_tp_rank: u32,
    /// `None` when the prefill side has several stages (the one holding `layers` is not known).
    pub src_pp_rank: Option<u32>,
    /// The decode rank's model layers it has not written.
    pub layers: Vec<u32>,
}

impl std::fmt::Display for MissingWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (first, last) = (self.layers[0], self.layers[self.layers.len() - 1]);
        match self.src_pp_rank {
            Some(pp) => write!(f, "prefill tp {} pp {pp}", self.src_tp_rank)?,
            None => write!(f, "prefill tp {} (the pp stage holding them)", self.src_tp_rank)?,
        }
        write!(f, " has not written layers {first}..={last} ({} layer(s))", self.layers.len())
    }
}

impl WriterRegion {
    /// The (unplaced, still empty) region of request parts alone of prefill rank `src`, which
    /// replicates `heads` another rank sends ([`TAIL_ONLY`]).
    pub fn tail_only(src: &PoolShape, heads: HeadSlice) -> WriterRegion {
        WriterRegion {
            offset: 0,
            bytes: 0,
            layers: 0,
            layer_ids: Vec::new(),
            src_tp_rank: src.tp_rank,
            src_pp_rank: src.pp_rank,
            tp_writer: TAIL_ONLY,
            heads,
            tail: Vec::new(),
        }
    }

    /// Bytes of its KV slabs (the region without its tail).
    pub fn kv_bytes(&self) -> u64 {
        self.bytes - tail_bytes(&self.tail)
    }
}

/// Layout of one staging allocation on one decode rank for a chunk of `tokens` tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingLayout {
    /// Regions placed so far, back to back from offset 0: by [`StagingLayout::place`] (the
    /// receiver, in allocation order) or all of them by [`staging_layout_stages`].
    pub writers: Vec<WriterRegion>,
    /// Bytes of the whole allocation: `layers ·` [`StagingLayout::layer_bytes`] of every head
    /// group, plus `tail_total`.
    pub total_bytes: u64,
    /// Bytes of request parts the allocation owes besides the KV (every region's tail together).
    pub tail_total: u64,
    pub tokens: u32,
    pub kind: ModelKind,
    pub buffers_per_layer: u32,
    /// The prefill TP rank that writes each head group (TP writer) of the decode rank, and the
    /// heads it sends: one rank per group of prefill ranks holding the same heads.
    pub tp_ranks: Vec<(u32, HeadSlice)>,
    /// Parallel sizes of the prefill side this layout was computed for.
    pub src_tp: u32,
    pub src_pp: u32,
    /// The decode rank's shape.
    pub dst: PoolShape,
}

impl StagingLayout {
    /// Offset within the allocation of slab (`kv`, `layer_idx`) of placed region `writer` (`kv`
    /// 0 = K / latent, 1 = V; `layer_idx` indexes the region's `layer_ids`). Panics when `writer`
    /// is out of range.
    pub fn slab_offset(&self, writer: u32, kv: u32, layer_idx: u32) -> u64 {
        let w = &self.writers[writer as usize];
        w.offset + self.slab_in_region(w.heads.num_heads, w.layers, kv, layer_idx)
    }

    /// Offset of slab (`kv`, `layer_idx`) within a region of `layers` layers of `heads` heads
    /// per row: K slabs, then V.
    pub fn slab_in_region(&self, heads: u32, layers: u32, kv: u32, layer_idx: u32) -> u64 {
        let before_kind = if kv == 0 { 0 } else { layers as u64 * self.slab_bytes(heads, 0) };
        before_kind + layer_idx as u64 * self.slab_bytes(heads, kv)
    }

    /// Bytes of one token's slice of `heads` heads in a slab of buffer kind `kv` (0 = K / latent,
    /// 1 = V): `heads · D · b` (V: `Dv`).
    pub fn row_bytes(&self, heads: u32, kv: u32) -> u64 {
        heads as u64 * self.dst.head_bytes_of(kv.min(self.buffers_per_layer - 1))
    }

    /// Bytes of one (buffer, layer) slab of kind `kv` with `heads` heads per row: `tokens ·
    /// row_bytes`.
    pub fn slab_bytes(&self, heads: u32, kv: u32) -> u64 {
        self.tokens as u64 * self.row_bytes(heads, kv)
    }

    /// Bytes of one layer's slabs (K and V, or the latent) with `heads` heads per row.
    pub fn layer_bytes(&self, heads: u32) -> u64 {
        (0..self.buffers_per_layer).map(|kv| self.slab_bytes(heads, kv)).sum()
    }

    /// Heads per row when every head group sends as many (always, unless neither TP size divides
    /// the other: P3→D2 with 12 heads sends decode rank 0 four heads from prefill rank 0 and two
    /// from prefill rank 1).
    pub fn uniform_heads(&self) -> Option<u32> {
        let n = self.tp_ranks.first().map(|(_, h)| h.num_heads)?;
        self.tp_ranks.iter().all(|(_, h)| h.num_heads == n).then_some(n)
    }

    /// Head groups of the decode rank: prefill ranks (one per group) that write each chunk's
    /// heads for every layer.
    pub fn tp_writers(&self) -> u32 {
        self.tp_ranks.len() as u32
    }

    /// Whether the placed regions carry every (TP writer, decode layer): the chunk is complete
    /// once each of them arrived.
    pub fn complete(&self) -> bool {
        self.carried_slabs() == self.owed_slabs() && self.carried_tail() == self.tail_total
    }

    /// Bytes of request parts the placed regions carry.
    pub fn carried_tail(&self) -> u64 {
        self.writers.iter().map(|w| tail_bytes(&w.tail)).sum()
    }

    /// Every (head group, layer) is claimed but the placed regions carry less of the request's
    /// parts than the allocation owes (a component layer no prefill stage sent): `(carried, owed)`.
    pub fn tail_short(&self) -> Option<(u64, u64)> {
        (self.carried_slabs() == self.owed_slabs() && self.carried_tail() != self.tail_total).then(|| (self.carried_tail(), self.tail_total))
    }

    /// The layout with `bytes` of request parts owed besides the KV.
    pub fn with_tail_total(mut self, bytes: u64) -> StagingLayout {
        self.total_bytes += bytes;
        self.tail_total = bytes;
        self
    }

    fn carried_slabs(&self) -> u64 {
        self.writers.iter().map(|w| w.layers as u64).sum()
    }

    /// The writers this chunk still lacks: per head group, its prefill TP rank and the decode
    /// rank's layers no placed region of that group carries (their prefill PP stage when the
    /// prefill side has one stage; with several, the stage holding them is not known here).
    pub fn missing_writers(&self) -> Vec<MissingWriter> {
        (0..self.tp_writers())
            .filter_map(|g| {
                let carried: Vec<u32> = self.writers.iter().filter(|w| w.tp_writer == g).flat_map(|w| w.layer_ids.iter().copied()).collect();
                let layers: Vec<u32> = self.dst.layer_ids.iter().copied().filter(|l| !carried.contains(l)).collect();
                (!layers.is_empty()).then(|| MissingWriter {
                    src_tp_rank: self.tp_ranks[g as usize].0,
                    src_pp_rank: (self.src_pp == 1).then_some(0),
                    layers,
                })
            })
            .collect()
    }

    /// The same layout with no region placed (the writers a chunk owes before any asked).
    pub fn unplaced(&self) -> StagingLayout {
        StagingLayout { writers: Vec::new(), ..self.clone() }
    }

    /// (head group, layer) pairs of the decode rank no placed region carries yet.
    pub fn unclaimed_slabs(&self) -> u64 {
        self.owed_slabs().saturating_sub(self.carried_slabs())
    }

    /// (head group, layer) pairs of the decode rank: each arrives once per chunk.
    pub fn owed_slabs(&self) -> u64 {
        self.tp_writers() as u64 * self.dst.layer_count() as u64
    }

    /// Checks that prefill rank `src` shares the agreed fields and the TP/PP sizes of the layout
    /// (`KVSTAGE_E_GEOMETRY_MISMATCH` listing the differing fields).
    fn check_src(&self, src: &PoolShape) -> Result<()> {
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
        Ok(())
    }

    /// The region prefill rank `src` writes (offset 0: not placed), or `None` when it writes
    /// nothing to this decode rank: another TP group, a replica of heads another rank sends, a
    /// non-designated MLA rank, or a stage holding none of the decode rank's layers.
    pub fn region_of(&self, src: &PoolShape) -> Result<Option<WriterRegion>> {
        self.check_src(src)?;
        let Some(t) = self.tp_ranks.iter().position(|(rank, _)| *rank == src.tp_rank) else {
            return Ok(None);
        };
        let layer_ids: Vec<u32> = src.layer_ids.iter().copied().filter(|id| self.dst.layer_ids.binary_search(id).is_ok()).collect();
        if layer_ids.is_empty() {
            return Ok(None);
        }
        let layers = layer_ids.len() as u32;
        Ok(Some(WriterRegion {
            offset: 0,
            bytes: self.layer_bytes(self.tp_ranks[t].1.num_heads) * layers as u64,
            layers,
            layer_ids,
            src_tp_rank: src.tp_rank,
            src_pp_rank: src.pp_rank,
            tp_writer: t as u32,
            heads: self.tp_ranks[t].1,
            tail: Vec::new(),
        }))
    }

    /// Whether placed regions of `region`'s head group carry every layer of `region`.
    pub fn carries(&self, region: &WriterRegion) -> bool {
        region.layer_ids.iter().all(|id| {
            self.writers.iter().any(|w| w.tp_writer == region.tp_writer && w.layer_ids.binary_search(id).is_ok())
        })
    }

    /// The placed region that already carries one of `region`'s (head group, layer), with that layer.
    pub fn overlap(&self, region: &WriterRegion) -> Option<(&WriterRegion, u32)> {
        self.writers.iter().filter(|w| w.tp_writer == region.tp_writer).find_map(|w| {
            region.layer_ids.iter().find(|id| w.layer_ids.binary_search(id).is_ok()).map(|&id| (w, id))
        })
    }

    /// Places the region of prefill rank `src` after the regions placed so far and returns its
    /// index. Refused (nothing placed) when `src` writes nothing here
    /// (`KVSTAGE_E_GEOMETRY_MISMATCH`) or carries a (TP writer, layer) a placed region carries
    /// already (`KVSTAGE_E_GEOMETRY_MISMATCH` naming the layer and both ranks: [`Self::overlap`]).
    pub fn place(&mut self, src: &PoolShape) -> Result<u32> {
        self.place_with_tail(src, Vec::new())
    }

    /// As [`Self::place`] for a region that carries `tail` after its KV slabs; also refused when a
    /// placed region of the same head group carries one of its (component, layer) parts.
    pub fn place_with_tail(&mut self, src: &PoolShape, tail: Vec<TailPart>) -> Result<u32> {
        let region = self.region_of(src)?;
        self.place_region(src, region, tail)
    }

    /// Places a region of request parts only: prefill rank `src` replicates the heads another
    /// rank sends (it carries no KV here) and carries `tail` (its state shares).
    pub fn place_tail_only(&mut self, src: &PoolShape, tail: Vec<TailPart>) -> Result<u32> {
        self.check_src(src)?;
        let heads = self.tp_ranks.first().map(|(_, h)| *h).unwrap_or(HeadSlice::MLA);
        self.place_region(src, Some(WriterRegion::tail_only(src, heads)), tail)
    }

    fn place_region(&mut self, src: &PoolShape, region: Option<WriterRegion>, tail: Vec<TailPart>) -> Result<u32> {
        let Some(mut region) = region else {
            return Err(Error::new(
                Status::KVSTAGE_E_GEOMETRY_MISMATCH,
                format!(
                    "prefill rank (tp {}/{}, pp {}/{}) writes nothing to decode rank (tp {}/{}, pp {}/{})",
                    src.tp_rank, src.tp_size, src.pp_rank, src.pp_size, self.dst.tp_rank, self.dst.tp_size, self.dst.pp_rank, self.dst.pp_size
                ),
            ));
        };
        if let Some((other, id)) = self.overlap(&region) {
            return Err(mismatch_error(
                "pipeline stages overlap",
                vec![FieldMismatch {
                    field: format!("layer {id} of head group {}", region.tp_writer),
                    local: format!("carried by prefill rank (tp {}, pp {})", other.src_tp_rank, other.src_pp_rank),
                    remote: format!("claimed by prefill rank (tp {}, pp {})", src.tp_rank, src.pp_rank),
                }],
            ));
        }
        // A (component, layer) share is carried once per prefill TP rank: two stages of one rank
        // claiming the same one disagree on the split.
        let same_rank = self.writers.iter().filter(|w| w.src_tp_rank == region.src_tp_rank);
        if let Some((other, part)) = same_rank.flat_map(|w| w.tail.iter().map(move |p| (w, p))).find(|(_, p)| tail.iter().any(|q| (q.component, q.layer_id) == (p.component, p.layer_id))) {
            return Err(mismatch_error(
                "pipeline stages overlap",
                vec![FieldMismatch {
                    field: format!("component {} layer {} of prefill TP rank {}", part.component, part.layer_id, region.src_tp_rank),
                    local: format!("carried by prefill rank (tp {}, pp {})", other.src_tp_rank, other.src_pp_rank),
                    remote: format!("claimed by prefill rank (tp {}, pp {})", src.tp_rank, src.pp_rank),
                }],
            ));
        }
        region.bytes += tail_bytes(&tail);
        region.tail = tail;
        region.offset = self.writers.iter().map(|w| w.bytes).sum();
        // Disjoint (head group, layer) cells always fit; checked anyway, since writes are bounded
        // by the grant only through the regions.
        if region.offset + region.bytes > self.total_bytes {
            return Err(Error::internal(format!("region [{}, +{}) past the allocation's {} bytes", region.offset, region.bytes, self.total_bytes)));
        }
        self.writers.push(region);
        Ok(self.writers.len() as u32 - 1)
    }

    /// The index of the placed region written by prefill rank `src`, or `None` when it has none.
    ///
    /// Fails with `KVSTAGE_E_GEOMETRY_MISMATCH` when `src` disagrees with the layout (agreed fields,
    /// TP/PP sizes) or holds a different set of this decode rank's layers than its region carries.
    pub fn writer_for(&self, src: &PoolShape) -> Result<Option<u32>> {
        self.check_src(src)?;
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

/// The staging allocation of decode rank `dst` for a chunk of `tokens` tokens written by the
/// prefill side described by `src` (any prefill rank: its TP/PP sizes and agreed fields are
/// used), with no region placed yet. Its size does not depend on how either side splits its
/// layers among pipeline stages.
pub fn staging_layout(src: &PoolShape, dst: &PoolShape, tokens: u32) -> Result<StagingLayout> {
    src.validate().map_err(|e| e.context("prefill (src) pool shape"))?;
    dst.validate().map_err(|e| e.context("decode (dst) pool shape"))?;
    let list = agreed_field_mismatches(src, dst);
    if !list.is_empty() {
        return Err(mismatch_error("prefill and decode pools", list));
    }
    let tp_ranks: Vec<(u32, HeadSlice)> = match dst.kind {
        ModelKind::Mha => {
            let mut v = Vec::new();
            for rs in prefill_ranks_for_decode(dst.tp_rank, src.tp_size, dst.tp_size)? {
                if sends_its_heads(rs, dst.tp_rank, src.tp_size, dst.tp_size, dst.global_heads) {
                    v.push((rs, head_slice(src.tp_size, dst.tp_size, rs, dst.tp_rank, dst.global_heads)?));
                }
            }
            v
        }
        ModelKind::Mla => vec![(mla_source_rank(dst.tp_rank, src.tp_size, dst.tp_size)?, HeadSlice::MLA)],
    };
    let overflow = || Error::new(Status::KVSTAGE_E_GEOMETRY_INVALID, format!("staging size of {tokens} tokens overflows 64 bits"));
    let bpl = dst.buffers_per_layer();
    // One token of one layer, every head group: their heads together are the decode rank's.
    let heads: u64 = tp_ranks.iter().map(|(_, h)| h.num_heads as u64).sum();
    let token_bytes = heads * (dst.head_bytes_of(0) + if bpl == 2 { dst.head_bytes_of(1) } else { 0 });
    let layer_bytes = (tokens as u64).checked_mul(token_bytes).ok_or_else(overflow)?;
    let total_bytes = layer_bytes.checked_mul(dst.layer_count() as u64).ok_or_else(overflow)?;
    Ok(StagingLayout {
        writers: Vec::new(),
        total_bytes,
        tail_total: 0,
        tokens,
        kind: dst.kind,
        buffers_per_layer: bpl,
        tp_ranks,
        src_tp: src.tp_size,
        src_pp: src.pp_size,
        dst: dst.clone(),
    })
}

/// [`staging_layout`] with every region placed, in the order (prefill stage, TP writer):
/// `src_stages[j]` describes prefill stage `j` (any TP rank: its TP size and layer ids are used).
/// Errors when a decode layer is held by no stage (`KVSTAGE_E_GEOMETRY_MISMATCH`), or the stage
/// list is malformed, a layer held by two stages included (`KVSTAGE_E_INVALID_ARG`, as for the
/// pairing helpers).
pub fn staging_layout_stages(src_stages: &[PoolShape], dst: &PoolShape, tokens: u32) -> Result<StagingLayout> {
    let src_tp = check_stages(dst, src_stages, "prefill_stages")?;
    let mut layout = staging_layout(&src_stages[0], dst, tokens)?;
    for stage in src_stages {
        for t in 0..layout.tp_ranks.len() {
            let rank = stage.clone().with_tp(layout.tp_ranks[t].0, src_tp);
            if layout.region_of(&rank)?.is_some() {
                layout.place(&rank)?;
            }
        }
    }
    let unheld: Vec<u32> = dst.layer_ids.iter().copied().filter(|id| !src_stages.iter().any(|s| s.layer_ids.binary_search(id).is_ok())).collect();
    if !unheld.is_empty() {
        return Err(mismatch_error(
            "prefill stages do not cover the decode rank",
            vec![FieldMismatch { field: "decode layers".into(), local: format!("{unheld:?}"), remote: "held by no prefill stage".into() }],
        ));
    }
    debug_assert!(layout.complete());
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tp_rank: u32, tp: u32) -> PoolShape {
        PoolShape::new(ModelKind::Mha, 8, 128, 2, 16, 80).with_tp(tp_rank, tp)
    }

    fn stages(base: &PoolShape, tp: u32, split: &[Vec<u32>]) -> Vec<PoolShape> {
        split.iter().enumerate().map(|(j, ids)| base.clone().with_tp(0, tp).with_pp(j as u32, split.len() as u32, ids.clone())).collect()
    }

    #[test]
    fn seventy_b_p4_to_d2() {
        // docs/GEOMETRY.md, "Sizes": 70B, P4→D2, 8192-token chunk: 2 writers × 640 MiB.
        let st = staging_layout_stages(&[shape(0, 4)], &shape(1, 2), 8192).unwrap();
        assert_eq!(st.writers.len(), 2);
        assert_eq!((st.uniform_heads(), st.row_bytes(2, 0)), (Some(2), 512));
        assert!(st.writers.iter().all(|w| w.bytes == 640 << 20));
        assert_eq!(st.total_bytes, 1280 << 20);
        assert_eq!(staging_layout(&shape(0, 4), &shape(1, 2), 8192).unwrap().total_bytes, st.total_bytes);
        assert_eq!(st.writers[1].offset, 640 << 20);
        assert_eq!((st.writers[0].src_tp_rank, st.writers[1].src_tp_rank), (2, 3));
        assert_eq!(st.writers[1].heads, HeadSlice { src_head_start: 0, num_heads: 2, dst_head_start: 2 });
        assert_eq!(st.slab_offset(1, 1, 3), (640 << 20) + (80 + 3) * 8192 * 512);
        assert_eq!(st.writer_for(&shape(3, 4)).unwrap(), Some(1));
        assert_eq!(st.writer_for(&shape(1, 4)).unwrap(), None);
        assert!(st.complete());
    }

    #[test]
    fn missing_writers_name_the_prefill_ranks_and_layers_not_placed() {
        // 70B, P4→D2: decode rank 1 takes heads from prefill ranks 2 and 3.
        let mut st = staging_layout(&shape(2, 4), &shape(1, 2), 64).unwrap();
        let all: Vec<u32> = (0..80).collect();
        let missing = |tp| MissingWriter { src_tp_rank: tp, src_pp_rank: Some(0), layers: all.clone() };
        assert_eq!(st.missing_writers(), vec![missing(2), missing(3)]);
        st.place(&shape(3, 4)).unwrap();
        assert_eq!(st.missing_writers(), vec![missing(2)]);
        assert_eq!(st.missing_writers()[0].to_string(), "prefill tp 2 pp 0 has not written layers 0..=79 (80 layer(s))");
        assert_eq!(st.unplaced().missing_writers(), vec![missing(2), missing(3)]);
        st.place(&shape(2, 4)).unwrap();
        assert!(st.missing_writers().is_empty());
        // Two prefill stages: a stage that wrote leaves the other's layers, its stage unknown.
        let base = PoolShape::new(ModelKind::Mha, 8, 64, 2, 4, 8);
        let prefill = stages(&base, 1, &[vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        let mut st = staging_layout(&prefill[0], &base.clone().with_tp(0, 1), 16).unwrap();
        st.place(&prefill[1]).unwrap();
        assert_eq!(st.missing_writers(), vec![MissingWriter { src_tp_rank: 0, src_pp_rank: None, layers: vec![0, 1, 2, 3] }]);
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
        let st = staging_layout_stages(&[mla.clone().with_tp(0, 2)], &mla.clone().with_tp(3, 4), 128).unwrap();
        assert_eq!(st.writers.len(), 1);
        assert_eq!(st.writers[0].src_tp_rank, 1);
        assert_eq!(st.writers[0].bytes, 128 * 1152 * 4);
        assert_eq!(st.writer_for(&mla.clone().with_tp(1, 2)).unwrap(), Some(0));
        assert_eq!(st.writer_for(&mla.with_tp(0, 2)).unwrap(), None);
    }

    #[test]
    fn pipeline_writers_carry_the_layers_they_hold_whatever_the_split() {
        let base = PoolShape::new(ModelKind::Mha, 8, 64, 2, 4, 8);
        let slab = 8 * 2 * 64 * 2; // 8 tokens × 2 heads × 64 × bf16
        // Even: 4 prefill stages of 2 layers into decode stage 1 of 2 (layers 4..8).
        let src = stages(&base, 4, &[vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        let dst = base.clone().with_tp(1, 2).with_pp(1, 2, (4..8).collect());
        let st = staging_layout_stages(&src, &dst, 8).unwrap();
        assert_eq!((st.tp_writers(), st.writers.len()), (2, 4));
        assert_eq!(st.writers[3].layer_ids, vec![6, 7]);
        assert_eq!((st.writers[3].src_tp_rank, st.writers[3].src_pp_rank), (3, 3));
        assert_eq!(st.writer_for(&src[3].clone().with_tp(3, 4)).unwrap(), Some(3));
        assert_eq!(st.writer_for(&src[2].clone().with_tp(2, 4)).unwrap(), Some(0));
        assert_eq!(st.writer_for(&src[1].clone().with_tp(2, 4)).unwrap(), None);
        // A prefill rank that holds a different block than its region is a mismatch, not a garble.
        let odd = base.clone().with_tp(2, 4).with_pp(2, 4, vec![3, 4]);
        let e = st.writer_for(&odd).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert!(e.causes()[0].contains("local [4] != remote [4, 5] (writer 0)"), "{:?}", e.causes());

        // Uneven: stages of 3 and 2 layers into one decode rank of 5.
        let src = stages(&base, 4, &[vec![0, 1, 2], vec![3, 4]]);
        let dst5 = base.clone().with_tp(1, 2).with_pp(0, 1, (0..5).collect());
        let st = staging_layout_stages(&src, &dst5, 8).unwrap();
        assert_eq!(st.total_bytes, 2 * 5 * 2 * slab);
        assert_eq!(st.writers.iter().map(|w| w.bytes).collect::<Vec<_>>(), [3 * 2 * slab, 3 * 2 * slab, 2 * 2 * slab, 2 * 2 * slab]);
        assert_eq!(st.writers[2].offset, 2 * st.writers[0].bytes);
        assert!(st.complete());

        // Interleaved ids, and a decode stage that takes a subset: regions follow what each holds.
        let src = stages(&base, 2, &[vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        let dst = base.clone().with_tp(0, 1).with_pp(1, 2, vec![3, 4, 5]);
        let st = staging_layout_stages(&src, &dst, 8).unwrap();
        assert_eq!(st.writers.iter().map(|w| w.layer_ids.clone()).collect::<Vec<_>>(), [vec![4], vec![4], vec![3, 5], vec![3, 5]]);
        assert_eq!(st.total_bytes, st.writers.iter().map(|w| w.bytes).sum::<u64>());

        // Placing in any order fills the allocation; a layer claimed twice is refused.
        let mut st = staging_layout(&src[0], &dst, 8).unwrap();
        assert_eq!(st.place(&src[1].clone().with_tp(1, 2)).unwrap(), 0);
        assert!(!st.complete());
        let e = st.place(&base.clone().with_tp(1, 2).with_pp(0, 2, vec![4, 5])).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert!(e.causes()[0].contains("layer 5 of head group 1"), "{:?}", e.causes());
        assert_eq!(st.writers.len(), 1, "a refused region is not placed");
        let e = st.place(&src[0].clone().with_pp(0, 2, vec![0, 1])).unwrap_err();
        assert!(e.message().contains("writes nothing to decode rank"), "{}", e.message());
    }

    #[test]
    fn stage_lists_must_cover_the_decode_rank() {
        let base = PoolShape::new(ModelKind::Mha, 8, 64, 2, 4, 8);
        let src = stages(&base, 1, &[vec![0, 1, 2], vec![4, 5]]);
        let dst = base.clone().with_pp(0, 1, (0..6).collect());
        let e = staging_layout_stages(&src, &dst, 4).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_GEOMETRY_MISMATCH);
        assert_eq!(e.causes(), vec!["decode layers: local [3] != remote held by no prefill stage"]);
        let twice = stages(&base, 1, &[vec![0, 1, 2], vec![2, 3, 4, 5]]);
        let e = staging_layout_stages(&twice, &dst, 4).unwrap_err();
        assert!(e.message().contains("holds layer 2, which stage 0 holds too"), "{}", e.message());
    }

    #[test]
    fn staging_errors() {
        // Any token count: a request's last chunk may end inside a page.
        assert_eq!(staging_layout(&shape(0, 4), &shape(1, 2), 20).unwrap().slab_bytes(2, 0), 20 * 2 * 128 * 2);
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
        let e = staging_layout_stages(&[], &shape(1, 2), 16).unwrap_err();
        assert!(e.message().contains("`prefill_stages`: is empty"), "{}", e.message());
        let st = staging_layout(&shape(0, 4), &shape(1, 2), 16).unwrap();
        let mut wrong_tp = shape(0, 8);
        wrong_tp.tp_rank = 2;
        let e = st.writer_for(&wrong_tp).unwrap_err();
        assert_eq!(e.causes(), vec!["src tp_size: local 8 != remote 4"]);
        assert_eq!(staging_layout(&shape(0, 4), &shape(1, 2), 0).unwrap().total_bytes, 0);
    }
}
