//! The rest of a request besides its paged KV ("request parts"): per-request metadata rows (aux
//! buffers), per-request state (Mamba/GDN conv and SSM slots, per layer) and extra paged pools (a
//! sliding window's pages, an indexer's key pages), registered as components by each rank. They
//! travel with the room's last chunk, in a tail after each writer's KV slabs: which bytes of which
//! component a writer carries, and where they go, is decided here. Pure.
//!
//! Who carries what, per decode rank: head-sliced pools the same heads as the writer's KV; state
//! the writer's TP share ([`state_slice`]: a sharded item from every prefill rank whose share
//! overlaps, a replicated one whole from prefill rank `⌊d · src_tp / dst_tp⌋`); replicated pools
//! from head group 0; aux rows from head group 0's region that carries the decode rank's first KV
//! layer. Under a pipeline split a region carries the component layers its stage holds.
//!
//! Tail layout of a region: parts in component order, then layer order; a pool part is `tokens`
//! rows of its slice, a state part its share's byte ranges packed in slot order, an aux part the
//! row.

use super::state::{state_slice, ByteRange, StateItem};
use super::{HeadSlice, StagingLayout, WriterRegion};
use crate::error::{Error, FieldMismatch, Result, Status};

/// Longest component name.
pub const MAX_NAME: usize = 64;
/// Most components a rank registers.
pub const MAX_COMPONENTS: usize = 64;

/// What a component is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ComponentKind {
    /// One row of `row_bytes` per request (sglang's metadata buffers): written last.
    Aux { row_bytes: u64 },
    /// One slot per request per layer, sharded by TP as `item` says.
    State { item: StateItem },
    /// A paged pool: `unit_bytes` per head per token (head-sliced like the KV) or per token
    /// (replicated: whole on every rank, sent once).
    Pool { unit_bytes: u64, head_sliced: bool },
}

impl ComponentKind {
    pub fn name(&self) -> &'static str {
        match self {
            ComponentKind::Aux { .. } => "aux",
            ComponentKind::State { .. } => "state",
            ComponentKind::Pool { .. } => "pool",
        }
    }
}

/// A component as both sides describe it in the handshake (its memory stays local).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentSpec {
    pub name: String,
    pub kind: ComponentKind,
    /// Model layers it holds on this rank, strictly increasing (aux: none; a pipeline stage may
    /// hold none of a component's layers).
    pub layer_ids: Vec<u32>,
    /// Pools: this side's page size (the two sides may differ).
    pub page_size: u32,
}

impl ComponentSpec {
    /// Checks the fields a peer or caller supplies (`KVSTAGE_E_INVALID_ARG` naming the field).
    pub fn validate(&self, at: &str) -> Result<()> {
        let field = |f: &str| format!("{at}.{f}");
        if self.name.is_empty() || self.name.len() > MAX_NAME || !self.name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::invalid_arg(&field("name"), format!("{:?} is not 1..={MAX_NAME} printable ASCII characters", self.name)));
        }
        // A pipeline stage may hold none of a component's layers (it registers it all the same:
        // both sides list the same components).
        if matches!(self.kind, ComponentKind::Aux { .. }) && !self.layer_ids.is_empty() {
            return Err(Error::invalid_arg(&field("layer_ids"), format!("holds {} ids; an aux component has no layers", self.layer_ids.len())));
        }
        if self.layer_ids.len() > 4096 || self.layer_ids.windows(2).any(|w| w[1] <= w[0]) {
            return Err(Error::invalid_arg(&field("layer_ids"), "must be strictly increasing, at most 4096"));
        }
        match &self.kind {
            ComponentKind::Aux { row_bytes: b } | ComponentKind::Pool { unit_bytes: b, .. } if *b == 0 || *b > 1 << 30 => {
                Err(Error::invalid_arg(&field("item_bytes"), format!("{b} is outside 1..={}", 1u64 << 30)))
            }
            ComponentKind::Pool { .. } if self.page_size == 0 || self.page_size > 1 << 20 => {
                Err(Error::invalid_arg(&field("page_size"), format!("{} is outside 1..={}", self.page_size, 1 << 20)))
            }
            ComponentKind::State { item } => item.validate(1, 1).map_err(|e| e.context(format!("{at} ({})", self.name))),
            _ => Ok(()),
        }
    }

    /// Bytes of one item on a rank of `tp` holding `local_heads` KV heads: an aux row, a state
    /// slot, a pool token slot.
    pub fn item_bytes(&self, tp: u32, local_heads: u32) -> u64 {
        match &self.kind {
            ComponentKind::Aux { row_bytes } => *row_bytes,
            ComponentKind::State { item } => item.slot_bytes(tp),
            ComponentKind::Pool { unit_bytes, head_sliced: true } => unit_bytes * local_heads as u64,
            ComponentKind::Pool { unit_bytes, head_sliced: false } => *unit_bytes,
        }
    }
}

/// Fields of the two sides' component lists that differ (index-matched): what a handshake
/// refuses. Layer ids are compared only when neither side is split into pipeline stages.
pub fn component_mismatches(local: &[ComponentSpec], remote: &[ComponentSpec], compare_layers: bool) -> Vec<FieldMismatch> {
    let mut out = Vec::new();
    let mut diff = |field: String, l: String, r: String| {
        if l != r {
            out.push(FieldMismatch { field, local: l, remote: r });
        }
    };
    diff("components".into(), local.len().to_string(), remote.len().to_string());
    for (i, (l, r)) in local.iter().zip(remote).enumerate() {
        let f = |x: &str| format!("components[{i}] ({}).{x}", l.name);
        diff(format!("components[{i}].name"), l.name.clone(), r.name.clone());
        diff(f("kind"), l.kind.name().into(), r.kind.name().into());
        match (&l.kind, &r.kind) {
            (ComponentKind::Aux { row_bytes: a }, ComponentKind::Aux { row_bytes: b }) => diff(f("item_bytes"), a.to_string(), b.to_string()),
            (ComponentKind::State { item: a }, ComponentKind::State { item: b }) => {
                diff(f("outer"), a.outer.to_string(), b.outer.to_string());
                diff(f("group_dims"), format!("{:?}", a.groups), format!("{:?}", b.groups));
                diff(f("dtype_bytes"), a.dtype_bytes.to_string(), b.dtype_bytes.to_string());
                diff(f("replicated"), a.replicated.to_string(), b.replicated.to_string());
            }
            (ComponentKind::Pool { unit_bytes: a, head_sliced: x }, ComponentKind::Pool { unit_bytes: b, head_sliced: y }) => {
                diff(f("item_bytes"), a.to_string(), b.to_string());
                diff(f("head_sliced"), x.to_string(), y.to_string());
            }
            _ => {}
        }
        if compare_layers {
            diff(f("layer_ids"), format!("{:?}", l.layer_ids), format!("{:?}", r.layer_ids));
        }
    }
    out
}

/// Tokens `[first_token, first_token + tokens)` of an extra pool's page list for one request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolSpan {
    pub pages: Vec<u32>,
    pub first_token: u32,
    pub tokens: u32,
}

/// What one side names of a request besides its KV pages: the aux row (all aux buffers), one
/// slot per state component, one span per pool component (in registration order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestParts {
    pub aux_row: u64,
    pub state_slots: Vec<u64>,
    pub pools: Vec<PoolSpan>,
}

impl RequestParts {
    /// Tokens of each pool span: what both sides must agree on (the allocation request carries
    /// the sender's).
    pub fn pool_tokens(&self) -> Vec<u32> {
        self.pools.iter().map(|p| p.tokens).collect()
    }
}

/// How a part's bytes map between the two sides' memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartCopy {
    /// Pool rows: `row_bytes` at byte `src_at` of each prefill token slot ↔ byte `dst_at` of
    /// each decode token slot, one row per token of the spans, packed in the tail.
    Rows { row_bytes: u64, src_at: u64, dst_at: u64 },
    /// State: byte ranges of the prefill slot ↔ the decode slot, packed in order in the tail.
    Ranges(Vec<ByteRange>),
    /// The whole aux row.
    Row,
}

/// One (component, layer) a writer carries in its region's tail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TailPart {
    pub component: u32,
    /// Model layer (aux: `u32::MAX`).
    pub layer_id: u32,
    /// Offset within the tail, and size.
    pub offset: u64,
    pub bytes: u64,
    pub copy: PartCopy,
}

/// Sides of a transfer as the tail plan needs them.
pub struct TailSides<'a> {
    /// Component specs of the prefill rank and the decode rank (matched by the handshake).
    pub src: &'a [ComponentSpec],
    pub dst: &'a [ComponentSpec],
    pub src_tp: u32,
    pub dst_tp: u32,
    pub dst_rank: u32,
    pub src_local_heads: u32,
    pub dst_local_heads: u32,
    /// Tokens of each pool component for this request (both sides named the same).
    pub pool_tokens: &'a [u32],
}

/// The parts head group `tp_writer` of `layout` carries: layers of `stage` (the writer's
/// component layers; `None`: every decode layer, for the allocation's total), aux rows when
/// `carries_aux`.
pub fn tail_parts(sides: &TailSides<'_>, layout: &StagingLayout, tp_writer: u32, stage: Option<&[ComponentSpec]>, carries_aux: bool) -> Result<Vec<TailPart>> {
    if sides.pool_tokens.len() != sides.dst.iter().filter(|c| matches!(c.kind, ComponentKind::Pool { .. })).count() {
        return Err(Error::internal("pool token counts do not match the pool components"));
    }
    let (src_rank, heads): (u32, HeadSlice) = *layout
        .tp_ranks
        .get(tp_writer as usize)
        .ok_or_else(|| Error::internal(format!("head group {tp_writer} of {}", layout.tp_writers())))?;
    let mut out = Vec::new();
    let mut offset = 0u64;
    let mut pools = 0usize;
    for (i, dst) in sides.dst.iter().enumerate() {
        let layers: Vec<u32> = match stage {
            None => dst.layer_ids.clone(),
            Some(src) => {
                let held = &src.get(i).ok_or_else(|| Error::internal("component lists differ in length"))?.layer_ids;
                dst.layer_ids.iter().copied().filter(|l| held.binary_search(l).is_ok()).collect()
            }
        };
        let (per_layer, copy) = match &dst.kind {
            ComponentKind::Aux { row_bytes } => {
                if carries_aux {
                    push(&mut out, &mut offset, i, u32::MAX, *row_bytes, PartCopy::Row);
                }
                continue;
            }
            ComponentKind::State { item } => {
                let ranges = state_slice(item, sides.src_tp, sides.dst_tp, src_rank, sides.dst_rank)?;
                (ranges.iter().map(|r| r.len).sum::<u64>(), PartCopy::Ranges(ranges))
            }
            ComponentKind::Pool { unit_bytes, head_sliced } => {
                let tokens = sides.pool_tokens[pools] as u64;
                pools += 1;
                let copy = match head_sliced {
                    true => PartCopy::Rows {
                        row_bytes: heads.num_heads as u64 * unit_bytes,
                        src_at: heads.src_head_start as u64 * unit_bytes,
                        dst_at: heads.dst_head_start as u64 * unit_bytes,
                    },
                    false if tp_writer == 0 => PartCopy::Rows { row_bytes: *unit_bytes, src_at: 0, dst_at: 0 },
                    false => continue,
                };
                let PartCopy::Rows { row_bytes, .. } = copy else { unreachable!() };
                (tokens * row_bytes, copy)
            }
        };
        if per_layer == 0 {
            continue;
        }
        for l in layers {
            push(&mut out, &mut offset, i, l, per_layer, copy.clone());
        }
    }
    Ok(out)
}

/// What `region`'s writer carries of a request's parts, and what the whole allocation owes: its
/// head group's share of the component layers its stage holds, and the aux rows when it is head
/// group 0 carrying the decode rank's first KV layer. `(owed, tail)`.
pub fn writer_tail(sides: &TailSides<'_>, layout: &StagingLayout, region: &WriterRegion) -> Result<(u64, Vec<TailPart>)> {
    let mut owed = 0;
    for t in 0..layout.tp_writers() {
        owed += tail_bytes(&tail_parts(sides, layout, t, None, t == 0)?);
    }
    let carries_aux = region.tp_writer == 0 && region.layer_ids.first() == layout.dst.layer_ids.first();
    Ok((owed, tail_parts(sides, layout, region.tp_writer, Some(sides.src), carries_aux)?))
}

fn push(out: &mut Vec<TailPart>, offset: &mut u64, component: usize, layer_id: u32, bytes: u64, copy: PartCopy) {
    out.push(TailPart { component: component as u32, layer_id, offset: *offset, bytes, copy });
    *offset += bytes;
}

/// Bytes of a tail.
pub fn tail_bytes(parts: &[TailPart]) -> u64 {
    parts.iter().map(|p| p.bytes).sum()
}

/// Checks that the writers of `layout` (one prefill rank per head group) hold every byte of the
/// decode rank's state slots: a share held only by a prefill rank that sends no KV to this decode
/// rank (one replicating KV heads another rank sends, or an MLA rank not designated) cannot
/// travel, since request parts travel with the KV (`KVSTAGE_E_UNSUPPORTED` naming the component).
pub fn check_state_carried(components: &[ComponentSpec], layout: &StagingLayout) -> Result<()> {
    let (src_tp, dst_tp, dst_rank) = (layout.src_tp, layout.dst.tp_size, layout.dst.tp_rank);
    for c in components {
        let ComponentKind::State { item } = &c.kind else { continue };
        let mut carried = 0u64;
        for (rank, _) in &layout.tp_ranks {
            carried += state_slice(item, src_tp, dst_tp, *rank, dst_rank)?.iter().map(|r| r.len).sum::<u64>();
        }
        if carried != item.slot_bytes(dst_tp) {
            let writers: Vec<u32> = layout.tp_ranks.iter().map(|(r, _)| *r).collect();
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!(
                    "state component {:?}: the prefill ranks that send KV to decode rank {dst_rank} (TP {src_tp} ranks {writers:?}) hold {carried} of its {}-byte slot; the rest lies on prefill ranks that send it no KV (they replicate KV heads another rank sends), and request parts travel with the KV",
                    c.name,
                    item.slot_bytes(dst_tp)
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{staging_layout, ModelKind, PoolShape};

    fn specs(layers: Vec<u32>) -> Vec<ComponentSpec> {
        vec![
            ComponentSpec { name: "output_ids".into(), kind: ComponentKind::Aux { row_bytes: 64 }, layer_ids: vec![], page_size: 0 },
            ComponentSpec {
                name: "conv".into(),
                kind: ComponentKind::State { item: StateItem { outer: 3, groups: vec![8, 8, 16], dtype_bytes: 2, replicated: false } },
                layer_ids: layers.clone(),
                page_size: 0,
            },
            ComponentSpec { name: "swa".into(), kind: ComponentKind::Pool { unit_bytes: 32, head_sliced: true }, layer_ids: layers, page_size: 16 },
        ]
    }

    #[test]
    fn writers_split_the_total_and_aux_goes_once() {
        let src = PoolShape::new(ModelKind::Mha, 8, 16, 2, 16, 4).with_tp(1, 4);
        let dst = PoolShape::new(ModelKind::Mha, 8, 16, 2, 64, 4).with_tp(0, 2);
        let layout = staging_layout(&src, &dst, 100).unwrap();
        let (s, d) = (specs(vec![0, 2]), specs(vec![0, 2]));
        let sides = TailSides { src: &s, dst: &d, src_tp: 4, dst_tp: 2, dst_rank: 0, src_local_heads: 2, dst_local_heads: 4, pool_tokens: &[40] };
        let w0 = tail_parts(&sides, &layout, 0, Some(&s), true).unwrap();
        let w1 = tail_parts(&sides, &layout, 1, Some(&s), false).unwrap();
        let aux = 64;
        // Per layer: the prefill rank's conv share (3 rows × 8 elements × 2 bytes), 40 rows of 2
        // heads × 32 bytes.
        let per_writer = 2 * (3 * 8 * 2 + 40 * 2 * 32);
        assert_eq!(tail_bytes(&w0), per_writer + aux);
        assert_eq!(tail_bytes(&w1), per_writer);
        assert_eq!(w0[0].copy, PartCopy::Row);
        let owed: u64 = (0..2).map(|t| tail_bytes(&tail_parts(&sides, &layout, t, None, t == 0).unwrap())).sum();
        assert_eq!(owed, tail_bytes(&w0) + tail_bytes(&w1));
        assert_eq!(w1[2].copy, PartCopy::Rows { row_bytes: 64, src_at: 0, dst_at: 64 });
    }

    #[test]
    fn mismatches_name_the_component_and_field() {
        let mut other = specs(vec![0, 1]);
        other[2].kind = ComponentKind::Pool { unit_bytes: 16, head_sliced: true };
        other[2].page_size = 64;
        let list = component_mismatches(&specs(vec![0, 1]), &other, true);
        assert_eq!(list.len(), 1, "{list:?}");
        assert_eq!((list[0].field.as_str(), list[0].local.as_str(), list[0].remote.as_str()), ("components[2] (swa).item_bytes", "32", "16"));
        assert_eq!(component_mismatches(&specs(vec![0]), &specs(vec![1]), true).len(), 2);
        assert!(component_mismatches(&specs(vec![0]), &specs(vec![1]), false).is_empty());
        assert!(component_mismatches(&specs(vec![0]), &specs(vec![0])[..2], false)[0].field == "components");
    }

    #[test]
    fn state_held_by_a_replica_is_refused() {
        let s = specs(vec![0]);
        // Prefill TP 8 with 2 KV heads: rank 0 sends decode rank 0's head, ranks 1..4 replicate
        // it but hold their own conv shares.
        let layout = |heads: u32| {
            let src = PoolShape::new(ModelKind::Mha, heads, 16, 2, 16, 1).with_tp(0, 8);
            staging_layout(&src, &PoolShape::new(ModelKind::Mha, heads, 16, 2, 16, 1).with_tp(0, 2), 16).unwrap()
        };
        let e = check_state_carried(&s, &layout(2)).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_UNSUPPORTED);
        assert!(e.message().contains("\"conv\"") && e.message().contains("hold 24 of its 96-byte slot"), "{}", e.message());
        assert!(check_state_carried(&s[..1], &layout(2)).is_ok());
        assert!(check_state_carried(&s, &layout(8)).is_ok());
    }
}
