//! The rest of a request besides its paged KV ("request parts"): per-request metadata rows (aux
//! buffers), per-request state (Mamba/GDN conv and SSM slots, per layer) and extra paged pools (a
//! sliding window's pages, an indexer's key pages), registered as components by each rank. They
//! travel with the room's last chunk, in a tail after each writer's KV slabs: which bytes of which
//! component a writer carries, and where they go, is decided here. Pure.
//!
//! Who carries what, per decode rank: head-sliced pools the same heads as the writer's KV; state
//! the writer's TP share ([`state_slice`]: a sharded item from every prefill rank whose share
//! overlaps; a replicated one whole from one carrier: prefill rank `⌊d · src_tp / dst_tp⌋` for
//! MHA, the rank that sends the latent for MLA, its only carrier); replicated pools
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
    /// Tokens of each pool component for this request (both sides named the same).
    pub pool_tokens: &'a [u32],
}

/// A prefill TP rank that carries request parts into a decode rank's last chunk: a KV writer
/// (head group `Some(index)`, with its heads) or, for MHA, a rank that replicates the heads another
/// rank sends (`None`: it carries its state shares only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Carrier {
    pub src_rank: u32,
    pub head_group: Option<u32>,
    pub heads: HeadSlice,
    /// It sends the replicated state items (every rank holds them whole; one carrier sends them).
    pub sends_replicated: bool,
}

impl Carrier {
    /// What it sends of a state item into the decode rank's slot: its overlap of a sharded item,
    /// a replicated item whole where [`Carrier::sends_replicated`].
    fn state_share(&self, item: &StateItem, src_tp: u32, dst_tp: u32, dst_rank: u32) -> Result<Vec<ByteRange>> {
        if !item.replicated {
            return state_slice(item, src_tp, dst_tp, self.src_rank, dst_rank);
        }
        item.validate(src_tp, dst_tp)?;
        Ok(if self.sends_replicated { vec![ByteRange { src: 0, dst: 0, len: item.slot_bytes(1) }] } else { Vec::new() })
    }
}

/// Every prefill TP rank that may carry parts into `layout`'s decode rank: its KV writers in head
/// group order, then (MHA) the ranks that replicate their heads.
///
/// Replicated state goes from one of them: for MHA the replica source `⌊d · src_tp / dst_tp⌋`
/// (always a carrier), for MLA the one rank that sends the latent (the source is not paired
/// with the decode rank when it is another rank).
pub fn carriers(layout: &StagingLayout) -> Result<Vec<Carrier>> {
    let mla = layout.kind == super::ModelKind::Mla;
    let source = super::state::replica_source(layout.src_tp, layout.dst.tp_size, layout.dst.tp_rank);
    let sends_replicated = |src_rank: u32, group: Option<u32>| if mla { group == Some(0) } else { src_rank == source };
    let mut out: Vec<Carrier> = layout
        .tp_ranks
        .iter()
        .enumerate()
        .map(|(t, &(src_rank, heads))| Carrier { src_rank, head_group: Some(t as u32), heads, sends_replicated: sends_replicated(src_rank, Some(t as u32)) })
        .collect();
    if !mla {
        for rank in super::prefill_ranks_for_decode(layout.dst.tp_rank, layout.src_tp, layout.dst.tp_size)? {
            if !out.iter().any(|c| c.src_rank == rank) {
                let heads = super::head_slice(layout.src_tp, layout.dst.tp_size, rank, layout.dst.tp_rank, layout.dst.global_heads)?;
                out.push(Carrier { src_rank: rank, head_group: None, heads, sends_replicated: sends_replicated(rank, None) });
            }
        }
    }
    Ok(out)
}

/// The parts head group `tp_writer` of `layout` carries: layers of `stage` (the writer's
/// component layers; `None`: every decode layer, for the allocation's total), aux rows when
/// `carries_aux`.
pub fn tail_parts(sides: &TailSides<'_>, layout: &StagingLayout, tp_writer: u32, stage: Option<&[ComponentSpec]>, carries_aux: bool) -> Result<Vec<TailPart>> {
    let carrier = carriers(layout)?
        .into_iter()
        .find(|c| c.head_group == Some(tp_writer))
        .ok_or_else(|| Error::internal(format!("head group {tp_writer} of {}", layout.tp_writers())))?;
    carrier_parts(sides, &carrier, stage, carries_aux)
}

/// The parts `carrier` carries (see [`tail_parts`]): a replica of a head group carries its state
/// shares only (its heads and the replicated items are its writer's to send).
pub fn carrier_parts(sides: &TailSides<'_>, carrier: &Carrier, stage: Option<&[ComponentSpec]>, carries_aux: bool) -> Result<Vec<TailPart>> {
    if sides.pool_tokens.len() != sides.dst.iter().filter(|c| matches!(c.kind, ComponentKind::Pool { .. })).count() {
        return Err(Error::internal("pool token counts do not match the pool components"));
    }
    let heads = carrier.heads;
    let writer = carrier.head_group.is_some();
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
                if carries_aux && writer {
                    push(&mut out, &mut offset, i, u32::MAX, *row_bytes, PartCopy::Row);
                }
                continue;
            }
            ComponentKind::State { item } => {
                let ranges = carrier.state_share(item, sides.src_tp, sides.dst_tp, sides.dst_rank)?;
                (ranges.iter().map(|r| r.len).sum::<u64>(), PartCopy::Ranges(ranges))
            }
            ComponentKind::Pool { unit_bytes, head_sliced } => {
                let tokens = sides.pool_tokens[pools] as u64;
                pools += 1;
                let copy = match head_sliced {
                    _ if !writer => continue,
                    true => PartCopy::Rows {
                        row_bytes: heads.num_heads as u64 * unit_bytes,
                        src_at: heads.src_head_start as u64 * unit_bytes,
                        dst_at: heads.dst_head_start as u64 * unit_bytes,
                    },
                    false if carrier.head_group == Some(0) => PartCopy::Rows { row_bytes: *unit_bytes, src_at: 0, dst_at: 0 },
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
    let carries_aux = region.tp_writer == 0 && region.layer_ids.first() == layout.dst.layer_ids.first();
    Ok((owed_tail(sides, layout)?, tail_parts(sides, layout, region.tp_writer, Some(sides.src), carries_aux)?))
}

/// What prefill rank `src_rank`, a replica of heads another rank sends, carries of a request's
/// parts (its state shares of the component layers its stage holds), and what the allocation
/// owes: `(owed, tail)`; an empty tail when it carries nothing.
pub fn replica_tail(sides: &TailSides<'_>, layout: &StagingLayout, src_rank: u32) -> Result<(u64, Vec<TailPart>)> {
    let carrier = carriers(layout)?.into_iter().find(|c| c.src_rank == src_rank && c.head_group.is_none());
    let tail = match carrier {
        Some(c) => carrier_parts(sides, &c, Some(sides.src), false)?,
        None => Vec::new(),
    };
    Ok((owed_tail(sides, layout)?, tail))
}

/// Bytes of request parts a decode rank's last chunk owes: every carrier's parts of every
/// component layer, the aux rows once.
pub fn owed_tail(sides: &TailSides<'_>, layout: &StagingLayout) -> Result<u64> {
    let mut owed = 0;
    for c in carriers(layout)? {
        owed += tail_bytes(&carrier_parts(sides, &c, None, c.head_group == Some(0))?);
    }
    Ok(owed)
}

fn push(out: &mut Vec<TailPart>, offset: &mut u64, component: usize, layer_id: u32, bytes: u64, copy: PartCopy) {
    out.push(TailPart { component: component as u32, layer_id, offset: *offset, bytes, copy });
    *offset += bytes;
}

/// Bytes of a tail.
pub fn tail_bytes(parts: &[TailPart]) -> u64 {
    parts.iter().map(|p| p.bytes).sum()
}

/// Checks that the carriers of `layout` (its KV writers and, MHA, the ranks replicating their heads)
/// hold every byte of the decode rank's state slots: a share held only by a prefill rank that is
/// neither (an MLA rank not designated) cannot travel (`KVSTAGE_E_UNSUPPORTED` naming the
/// component).
pub fn check_state_carried(components: &[ComponentSpec], layout: &StagingLayout) -> Result<()> {
    let (src_tp, dst_tp, dst_rank) = (layout.src_tp, layout.dst.tp_size, layout.dst.tp_rank);
    let carriers = carriers(layout)?;
    for c in components {
        let ComponentKind::State { item } = &c.kind else { continue };
        let mut carried = 0u64;
        for k in &carriers {
            carried += k.state_share(item, src_tp, dst_tp, dst_rank)?.iter().map(|r| r.len).sum::<u64>();
        }
        if carried != item.slot_bytes(dst_tp) {
            let writers: Vec<u32> = carriers.iter().map(|k| k.src_rank).collect();
            return Err(Error::new(
                Status::KVSTAGE_E_UNSUPPORTED,
                format!(
                    "state component {:?}: the prefill ranks that feed decode rank {dst_rank} (TP {src_tp} ranks {writers:?}) hold {carried} of its {}-byte slot; the rest lies on prefill ranks that are not paired with it (an MLA decode rank reads one prefill rank, which holds only its own share of a sharded state: replicate the state, or use equal TP sizes)",
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
        let sides = TailSides { src: &s, dst: &d, src_tp: 4, dst_tp: 2, dst_rank: 0, pool_tokens: &[40] };
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
    fn replicas_of_a_head_group_carry_their_state_shares_only() {
        // Prefill TP 8 over 2 KV heads into decode TP 2: decode rank 0's head comes from rank 0;
        // ranks 1..4 replicate it and hold conv shares of decode rank 0's slot.
        let src = PoolShape::new(ModelKind::Mha, 2, 16, 2, 16, 4).with_tp(0, 8);
        let dst = PoolShape::new(ModelKind::Mha, 2, 16, 2, 16, 4).with_tp(0, 2);
        let layout = staging_layout(&src, &dst, 16).unwrap();
        let c = carriers(&layout).unwrap();
        assert_eq!(c.iter().map(|c| (c.src_rank, c.head_group)).collect::<Vec<_>>(), vec![(0, Some(0)), (1, None), (2, None), (3, None)]);
        let specs = vec![
            ComponentSpec {
                name: "conv".into(),
                kind: ComponentKind::State { item: StateItem { outer: 1, groups: vec![16], dtype_bytes: 2, replicated: false } },
                layer_ids: vec![0],
                page_size: 0,
            },
            ComponentSpec { name: "swa".into(), kind: ComponentKind::Pool { unit_bytes: 4, head_sliced: true }, layer_ids: vec![0], page_size: 16 },
            ComponentSpec { name: "aux".into(), kind: ComponentKind::Aux { row_bytes: 8 }, layer_ids: vec![], page_size: 0 },
        ];
        let sides = TailSides { src: &specs, dst: &specs, src_tp: 8, dst_tp: 2, dst_rank: 0, pool_tokens: &[5] };
        let parts: Vec<Vec<TailPart>> = c.iter().map(|k| carrier_parts(&sides, k, None, true).unwrap()).collect();
        // Every carrier: its 2-element conv share (4 bytes); the writer also the window (5 tokens
        // of its head) and the aux row.
        assert_eq!(parts.iter().map(|p| tail_bytes(p)).collect::<Vec<_>>(), vec![4 + 5 * 4 + 8, 4, 4, 4]);
        assert!(parts[1..].iter().all(|p| p.len() == 1 && matches!(p[0].copy, PartCopy::Ranges(_))));
        // Together they cover the decode slot exactly.
        let covered: u64 = parts.iter().flatten().filter(|p| p.component == 0).map(|p| p.bytes).sum();
        assert_eq!(covered, 16 / 2 * 2);
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
    fn state_on_ranks_that_feed_no_kv_is_refused() {
        let s = specs(vec![0]);
        // MHA, prefill TP 8 with 2 KV heads: ranks 1..4 replicate rank 0's head and carry their
        // conv shares themselves.
        let mha = |heads: u32| {
            let src = PoolShape::new(ModelKind::Mha, heads, 16, 2, 16, 1).with_tp(0, 8);
            staging_layout(&src, &PoolShape::new(ModelKind::Mha, heads, 16, 2, 16, 1).with_tp(0, 2), 16).unwrap()
        };
        assert!(check_state_carried(&s, &mha(2)).is_ok());
        assert!(check_state_carried(&s, &mha(8)).is_ok());
        // MLA, prefill TP 2 into decode TP 4: decode rank 1's latent comes from rank 1, its conv
        // share lies on rank 0, which is not paired with it.
        let src = PoolShape::new(ModelKind::Mla, 1, 576, 2, 16, 1).with_tp(1, 2);
        let mla = staging_layout(&src, &PoolShape::new(ModelKind::Mla, 1, 576, 2, 16, 1).with_tp(1, 4), 16).unwrap();
        let e = check_state_carried(&s, &mla).unwrap_err();
        assert_eq!(e.code(), Status::KVSTAGE_E_UNSUPPORTED);
        assert!(e.message().contains("\"conv\"") && e.message().contains("hold 0 of its 48-byte slot"), "{}", e.message());
        assert!(check_state_carried(&s[..1], &mla).is_ok());
    }

    /// MLA with replicated state under a TP change: the one prefill rank that sends a decode
    /// rank's latent holds the whole item and sends it (P2→D4, P4→D2, P8→D4 and back, every decode
    /// rank), exactly once per decode slot; before, the designated replica source (another rank,
    /// not paired with the decode rank) was expected and the handshake refused.
    #[test]
    fn mla_replicated_state_goes_with_the_latent() {
        let whole = ComponentSpec {
            name: "ssm".into(),
            kind: ComponentKind::State { item: StateItem { outer: 2, groups: vec![12], dtype_bytes: 2, replicated: true } },
            layer_ids: vec![0],
            page_size: 0,
        };
        let specs = vec![whole];
        for (stp, dtp) in [(2, 4), (4, 2), (8, 4), (4, 8), (1, 4), (4, 1), (2, 2)] {
            for rd in 0..dtp {
                let dst = PoolShape::new(ModelKind::Mla, 1, 64, 2, 16, 1).with_tp(rd, dtp);
                let src = PoolShape::new(ModelKind::Mla, 1, 64, 2, 16, 1).with_tp(crate::geometry::mla_source_rank(rd, stp, dtp).unwrap(), stp);
                let st = staging_layout(&src, &dst, 16).unwrap();
                check_state_carried(&specs, &st).unwrap_or_else(|e| panic!("P{stp}→D{dtp} d{rd}: {}", e.chain()));
                let sides = TailSides { src: &specs, dst: &specs, src_tp: stp, dst_tp: dtp, dst_rank: rd, pool_tokens: &[] };
                let tail = tail_parts(&sides, &st, 0, None, false).unwrap();
                assert_eq!(tail_bytes(&tail), 2 * 12 * 2, "P{stp}→D{dtp} d{rd}: the whole slot from the latent's rank");
                assert_eq!(owed_tail(&sides, &st).unwrap(), 2 * 12 * 2, "owed once");
            }
        }
    }
}
