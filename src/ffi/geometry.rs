//! Geometry helpers for C: head mapping, pairing, staging layout, chunk spans and the grid, state
//! slices (Mamba/GDN conv and SSM states under a TP change). Pure functions of their arguments
//! (docs/GEOMETRY.md).

use super::args::{out_arg, read_versioned, read_versioned_array, slice_arg, write_array, write_versioned, write_versioned_array};
use super::ffi_fn;
use super::pool::{kvstage_component, kvstage_kv_layout, kvstage_state_item, pool_shape_from_c, state_item};
use super::room::kvstage_room_grid;
use crate::error::{Error, Result, Status};
use crate::geometry::{self, ComponentSpec, PoolShape, StateItem};

/// Heads prefill rank `src_rank` sends to decode rank `dst_rank`, in local head units.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvstage_head_slice {
    pub src_head_start: u32,
    pub num_heads: u32,
    pub dst_head_start: u32,
}

/// The head slice prefill rank `src_rank` (of `src_tp`) sends to decode rank `dst_rank` (of
/// `dst_tp`) for a model with `total_kv_heads` KV heads (MHA/GQA): the heads both hold, whatever
/// the two TP sizes (3 and 2 too: decode rank 0 of 2 then reads prefill ranks 0 and 1 of 3).
/// `KVSTAGE_E_INVALID_ARG` naming the argument for zero sizes, ranks not below their size, head
/// counts that do not divide a TP size (either way), or ranks that do not exchange data —
/// including a prefill rank whose heads another rank feeding the same decode rank holds too
/// (prefill-side replication: the first of them sends, the message names it), exactly the pairs
/// `kvstage_pairing_decode_ranks` leaves out. MLA: the latent is not head-sliced; decode rank `d`
/// is written by prefill TP rank `d % src_tp` alone (`kvstage_pairing_prefill_ranks`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_head_slice_compute(
    src_tp: u32,
    dst_tp: u32,
    src_rank: u32,
    dst_rank: u32,
    total_kv_heads: u32,
    out: *mut kvstage_head_slice,
) -> Status {
    ffi_fn!(status {
        let out = out_arg(out, "out")?;
        let hs = geometry::head_slice(src_tp, dst_tp, src_rank, dst_rank, total_kv_heads)?;
        if !geometry::sends_its_heads(src_rank, dst_rank, src_tp, dst_tp, total_kv_heads) {
            let rep = (src_tp / total_kv_heads).max(1);
            let sender = geometry::prefill_ranks_for_decode(dst_rank, src_tp, dst_tp)?
                .find(|&r| r / rep == src_rank / rep && geometry::sends_its_heads(r, dst_rank, src_tp, dst_tp, total_kv_heads))
                .unwrap_or(src_rank);
            return Err(Error::invalid_arg(
                "src_rank",
                format!(
                    "prefill rank {src_rank} sends nothing to decode rank {dst_rank}: prefill rank {sender} holds the same heads and sends them (heads replicated across prefill ranks cross the wire once)"
                ),
            ));
        }
        *out = kvstage_head_slice { src_head_start: hs.src_head_start, num_heads: hs.num_heads, dst_head_start: hs.dst_head_start };
        Ok(Status::KVSTAGE_OK)
    })
}

/// A rank of the other side that a rank exchanges KV data with (`kvstage_pairing_*`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvstage_rank {
    pub tp_rank: u32,
    pub pp_rank: u32,
}

/// Shapes of the other side's pipeline stages: an array of `count` layouts, `stages[j]` for stage
/// `j` (any TP rank of it). Its stride is the first element's `struct_size`: every element comes
/// from the same `kvstage_kv_layout_init`, so an array built against an older header is read as
/// such.
unsafe fn stage_shapes(stages: *const kvstage_kv_layout, count: usize, arg: &str) -> Result<Vec<PoolShape>> {
    let raw = unsafe { read_versioned_array(stages, count, arg) }?;
    raw.iter().enumerate().map(|(j, l)| unsafe { super::pool::shape_of(l, &format!("{arg}[{j}]")) }).collect()
}

/// Writes `peers` into `out[capacity]`; `*count` (may be NULL) receives their number, also when
/// `capacity` is too small (then `KVSTAGE_E_INVALID_ARG` naming both). `out` NULL with `capacity`
/// 0 is a count query (`KVSTAGE_OK`).
unsafe fn write_peers(peers: &[geometry::PeerRank], out: *mut kvstage_rank, capacity: usize, count: *mut usize) -> Result<Status> {
    let ranks: Vec<kvstage_rank> = peers.iter().map(|p| kvstage_rank { tp_rank: p.tp_rank, pp_rank: p.pp_rank }).collect();
    unsafe { write_array(&ranks, out, capacity, count, "ranks") }
}

/// The decode ranks prefill rank `prefill` must open sessions to for whole requests, ordered by
/// (pp_rank, tp_rank): TP ranks by the head mapping (MLA: the decode ranks this rank is the
/// designated writer of) and, with sharded state, the decode ranks its state shares go to — a
/// rank that only replicates heads another rank sends still owes them its share of a sharded
/// state item — and PP stages that hold at least one of its layers, whatever the split.
/// `components` (may be NULL with 0) are the rank's registered components (`kvstage_component`,
/// as for `kvstage_pool_register_components`; only STATE components' `state` is read, bases are
/// ignored). `decode_stages` is an array of `num_decode_stages` shape-only layouts (each filled by
/// `kvstage_kv_layout_init`), `decode_stages[j]` for decode stage `j` (any TP rank: its `tp_size`
/// and `layer_ids` are used; bases are ignored). The ranks go to `out[capacity]`; `*count` (may
/// be NULL) receives their number, also when `capacity` is too small (`KVSTAGE_E_INVALID_ARG`). A
/// call with `out` NULL and `capacity` 0 is a count query: `KVSTAGE_OK` with `*count` set (0 when
/// the rank exchanges nothing with that side). Errors name the bad stage: out of order, TP sizes
/// that differ, a layer held twice, fields both sides must agree on (`KVSTAGE_E_GEOMETRY_MISMATCH`).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvstage_pairing_decode_ranks(
    prefill: *const kvstage_kv_layout,
    components: *const kvstage_component,
    num_components: usize,
    decode_stages: *const kvstage_kv_layout,
    num_decode_stages: usize,
    out: *mut kvstage_rank,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let local = unsafe { pool_shape_from_c(prefill, "prefill") }?;
        let states = unsafe { state_items(components, num_components) }?;
        let stages = unsafe { stage_shapes(decode_stages, num_decode_stages, "decode_stages") }?;
        let peers = geometry::decode_peers_of_request(&local, &stages, &states)?;
        unsafe { write_peers(&peers, out, capacity, count) }
    })
}

/// The prefill ranks that write to decode rank `decode` for whole requests (the sessions it will
/// accept), ordered by (pp_rank, tp_rank): the inverse of `kvstage_pairing_decode_ranks`, with the
/// same conventions; `components` are the decode rank's, `prefill_stages[j]` describes prefill
/// stage `j`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvstage_pairing_prefill_ranks(
    decode: *const kvstage_kv_layout,
    components: *const kvstage_component,
    num_components: usize,
    prefill_stages: *const kvstage_kv_layout,
    num_prefill_stages: usize,
    out: *mut kvstage_rank,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let local = unsafe { pool_shape_from_c(decode, "decode") }?;
        let states = unsafe { state_items(components, num_components) }?;
        let stages = unsafe { stage_shapes(prefill_stages, num_prefill_stages, "prefill_stages") }?;
        let peers = geometry::prefill_peers_of_request(&local, &stages, &states)?;
        unsafe { write_peers(&peers, out, capacity, count) }
    })
}

/// The state items of the STATE components among `components` (read at the caller's stride).
unsafe fn state_items(components: *const kvstage_component, count: usize) -> Result<Vec<StateItem>> {
    let raw = unsafe { read_versioned_array(components, count, "components") }?;
    let mut items = Vec::new();
    for (i, c) in raw.iter().enumerate() {
        if c.kind == super::pool::kvstage_component_kind::KVSTAGE_COMPONENT_STATE as i32 {
            items.push(unsafe { state_item(c.state) }.map_err(|e| e.context(format!("components[{i}].state")))?);
        }
    }
    Ok(items)
}

/// Layout of one staging allocation (one decode rank, one chunk). Set `struct_size` before the
/// call. Writer `w`'s slab for layer index `l` (into the decode rank's layers the writer holds,
/// ascending) starts at `writers[w].offset + l · writers[w].slab_bytes` for K (or the latent) and
/// at `writers[w].offset + writers[w].layers · writers[w].slab_bytes + l · writers[w].v_slab_bytes`
/// for V. The row and slab sizes here are every writer's, except where the TP sizes do not divide
/// one another and the decode rank's head groups differ in size (P3→D2 with 12 heads: 4 heads
/// from prefill rank 0, 2 from prefill rank 1): then `num_heads`, `row_bytes`, `slab_bytes`,
/// `v_row_bytes` and `v_slab_bytes` are 0 and each writer's own say it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstage_staging_layout {
    pub struct_size: usize,
    /// Bytes of the whole allocation.
    pub total_bytes: u64,
    /// Bytes of one token's head slice of K (or the latent): `num_heads · head_dim · dtype_bytes`.
    pub row_bytes: u64,
    /// Bytes of one (K or latent, layer) slab (`tokens · row_bytes`).
    pub slab_bytes: u64,
    pub tokens: u32,
    /// Heads per row (every writer's; 0 when head groups differ in size).
    pub num_heads: u32,
    /// 2 (K, V) for MHA, 1 for MLA.
    pub buffers_per_layer: u32,
    /// Writers whose arrival completes the chunk (entries `kvstage_staging_layout_compute` fills).
    pub num_writers: u32,
    /// Head groups of the decode rank: each of its layers arrives once per head group.
    pub num_tp_writers: u32,
    /// Bytes of the request's parts (metadata rows, state shares, extra pools' rows) the room's
    /// last chunk carries besides its KV, included in `total_bytes`; 0 without components.
    pub parts_bytes: u64,
    /// V's row and slab: `num_heads · head_dim_v · dtype_bytes`, `tokens · v_row_bytes` (the
    /// K ones where V's heads are K's size; 0 for MLA).
    pub v_row_bytes: u64,
    pub v_slab_bytes: u64,
}

/// One writer's region of a staging allocation (an output array: set `writers[0].struct_size`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvstage_staging_writer {
    pub struct_size: usize,
    /// Byte offset of the region within the allocation.
    pub offset: u64,
    pub bytes: u64,
    /// Layers carried.
    pub layers: u32,
    /// The prefill rank writing the region.
    pub src_tp_rank: u32,
    pub src_pp_rank: u32,
    /// Its head group among the decode rank's (`0 .. num_tp_writers`).
    pub tp_writer: u32,
    /// First source head (gather) and first destination head (scatter), `num_heads` each.
    pub src_head_start: u32,
    pub num_heads: u32,
    pub dst_head_start: u32,
    /// Bytes of one of its (K or latent, layer) slabs: `tokens · num_heads · head_dim ·
    /// dtype_bytes`; V's: `tokens · num_heads · head_dim_v · dtype_bytes` (0 for MLA).
    pub slab_bytes: u64,
    pub v_slab_bytes: u64,
}

/// Computes the staging layout of decode rank `dst` for a chunk of `tokens` tokens written by the
/// prefill side: `prefill_stages` is an array of `num_prefill_stages` layouts, `prefill_stages[j]`
/// for prefill stage `j` (any TP rank: its `tp_size` and `layer_ids` are used), as for
/// `kvstage_pairing_prefill_ranks`; stages may split the layers any way, together they must hold
/// every layer of `dst`. Only shape fields are read (bases may be NULL). Fills `*out` and
/// `writers[0 .. out->num_writers)` in (stage, head group) order; no memory is allocated. A
/// receiver places regions in the order their allocation requests arrive (each writer learns its
/// offset from the grant), so at run time offsets may differ from these; sizes and the total do
/// not: the offsets here hold when the regions' requests arrive in stage order, (stage, head
/// group). With `components` (the decode rank's, as registered; NULL with 0: KV only) the layout
/// is that of a room's last chunk, which carries the request's parts too: `parts_bytes` of them,
/// included in `total_bytes`, so one query sizes the ring for a whole request. `pool_tokens`
/// names, per POOL component in registration order, the tokens of the request's span in it (a
/// sliding window's tokens; NULL with 0 without pools). The writers' regions are the KV ones (at
/// run time each region's parts follow its KV). `writers` may be NULL with `writers_len` 0 to ask
/// for the count only. When `writers_len` is too small, `out` (with `num_writers`) is still
/// filled and `KVSTAGE_E_INVALID_ARG` names `writers_len`. Where the regions carry different head
/// counts (TP sizes that do not divide one another), a `writers` array of a header older than
/// `slab_bytes` is refused the same way, naming `writers[0].struct_size`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvstage_staging_layout_compute(
    prefill_stages: *const kvstage_kv_layout,
    num_prefill_stages: usize,
    dst: *const kvstage_kv_layout,
    components: *const kvstage_component,
    num_components: usize,
    pool_tokens: *const u32,
    num_pool_tokens: usize,
    tokens: u32,
    out: *mut kvstage_staging_layout,
    writers: *mut kvstage_staging_writer,
    writers_len: usize,
) -> Status {
    ffi_fn!(status {
        let out = super::args::out_ptr(out, "out")?;
        let stages = unsafe { stage_shapes(prefill_stages, num_prefill_stages, "prefill_stages") }?;
        let dst = unsafe { pool_shape_from_c(dst, "dst") }?;
        let st = geometry::staging_layout_stages(&stages, &dst, tokens)?;
        let specs: Vec<ComponentSpec> = unsafe { read_versioned_array(components, num_components, "components") }?
            .iter()
            .enumerate()
            .map(|(i, c)| unsafe { super::pool::component(c, &format!("components[{i}]")) }.map(|(spec, _, _)| spec))
            .collect::<Result<_>>()?;
        let pool_tokens = unsafe { slice_arg(pool_tokens, num_pool_tokens, "pool_tokens") }?;
        let pools = specs.iter().filter(|c| matches!(c.kind, geometry::ComponentKind::Pool { .. })).count();
        if pool_tokens.len() != pools {
            return Err(Error::invalid_arg("num_pool_tokens", format!("{} != {pools} POOL component(s) among `components`", pool_tokens.len())));
        }
        let sides = geometry::TailSides { src: &specs, dst: &specs, src_tp: st.src_tp, dst_tp: dst.tp_size, dst_rank: dst.tp_rank, pool_tokens };
        let parts_bytes = if specs.is_empty() { 0 } else { geometry::owed_tail(&sides, &st)? };
        let uniform = st.uniform_heads();
        let n = uniform.unwrap_or(0);
        let v = |bytes: u64| if st.buffers_per_layer == 2 { bytes } else { 0 };
        let filled = kvstage_staging_layout {
            struct_size: std::mem::size_of::<kvstage_staging_layout>(),
            total_bytes: st.total_bytes + parts_bytes,
            row_bytes: st.row_bytes(n, 0),
            slab_bytes: st.slab_bytes(n, 0),
            v_row_bytes: v(st.row_bytes(n, 1)),
            v_slab_bytes: v(st.slab_bytes(n, 1)),
            tokens: st.tokens,
            num_heads: n,
            buffers_per_layer: st.buffers_per_layer,
            num_writers: st.writers.len() as u32,
            num_tp_writers: st.tp_writers(),
            parts_bytes,
        };
        unsafe { write_versioned(out, filled, "out") }?;
        if writers.is_null() && writers_len == 0 {
            return Ok(Status::KVSTAGE_OK);
        }
        let entries: Vec<kvstage_staging_writer> = st
            .writers
            .iter()
            .map(|w| kvstage_staging_writer {
                struct_size: std::mem::size_of::<kvstage_staging_writer>(),
                offset: w.offset,
                bytes: w.bytes,
                layers: w.layers,
                src_tp_rank: w.src_tp_rank,
                src_pp_rank: w.src_pp_rank,
                tp_writer: w.tp_writer,
                src_head_start: w.heads.src_head_start,
                num_heads: w.heads.num_heads,
                dst_head_start: w.heads.dst_head_start,
                slab_bytes: st.slab_bytes(w.heads.num_heads, 0),
                v_slab_bytes: v(st.slab_bytes(w.heads.num_heads, 1)),
            })
            .collect();
        if writers_len < entries.len() {
            return Err(Error::invalid_arg(
                "writers_len",
                format!("{writers_len} entries are too few: the layout has {} writers (out->num_writers)", entries.len()),
            ));
        }
        // Regions of different head counts are placed by each writer's own slab sizes: a caller
        // whose struct ends before them would place every slab with the layout-wide 0.
        let needed = std::mem::offset_of!(kvstage_staging_writer, v_slab_bytes) + std::mem::size_of::<u64>();
        let given = if writers.is_null() { needed } else { unsafe { super::args::struct_size_at(writers as *const u8) } };
        if uniform.is_none() && given < needed {
            return Err(Error::invalid_arg(
                "writers[0].struct_size",
                format!(
                    "{given} bytes end before `slab_bytes` and `v_slab_bytes`, which this layout needs: its regions carry different head counts ({:?}; TP sizes {} and {} do not divide one another); pass this header's kvstage_staging_writer ({needed} bytes or more)",
                    st.writers.iter().map(|w| w.heads.num_heads).collect::<Vec<_>>(),
                    st.src_tp,
                    dst.tp_size
                ),
            ));
        }
        unsafe { write_versioned_array(&entries, writers, writers_len, std::ptr::null_mut(), "writers") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Tokens per chunk of the chunk grid: `max(1, chunk_tokens / page_size) · page_size`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_grid_tokens_compute(chunk_tokens: u32, page_size: u32, out: *mut u32) -> Status {
    ffi_fn!(status {
        let out = out_arg(out, "out")?;
        if page_size == 0 {
            return Err(Error::invalid_arg("page_size", "is 0"));
        }
        *out = geometry::grid_tokens(chunk_tokens, page_size);
        Ok(Status::KVSTAGE_OK)
    })
}

/// Where one chunk of a request lies on both sides (`kvstage_chunk_span_compute`). Set `struct_size`
/// before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstage_chunk_span {
    pub struct_size: usize,
    /// Chunks of the request (the room's chunk count).
    pub num_chunks: u32,
    /// Tokens of this chunk: the chunk grid's, the request's last chunk possibly fewer.
    pub num_tokens: u32,
    /// The chunk's first request token (`decode_prefix_tokens + chunk_index · grid tokens`).
    pub first_token: u64,
    /// Prefill side: `src_pages` of the transfer are pages `[src_first_page, src_first_page +
    /// src_num_pages)` of the request's prefill page list (page `k` holds request tokens
    /// `[k · src_page_size, …)`); `src_token_offset` and `num_tokens` go into the descriptor as
    /// they are.
    pub src_first_page: u64,
    pub src_num_pages: u32,
    pub src_token_offset: u32,
    /// Decode side: pages `[dst_first_page, dst_first_page + dst_num_pages)` of the room's page
    /// list (the pages after the decode side's cached prefix).
    pub dst_first_page: u64,
    pub dst_num_pages: u32,
}

/// The pure function's argument names as the caller wrote them (fields of `grid`).
fn grid_names(e: Error) -> Error {
    let mut message = e.message().to_owned();
    for (name, field) in [("`decode_prefix_tokens`", "`grid->prefix_tokens`"), ("`dst_page_size`", "`grid->page_size`"), ("`chunk_tokens`", "`grid->chunk_tokens`")] {
        message = message.replace(name, field);
    }
    Error::new(e.code(), message)
}

/// Chunk `chunk_index` of a request of `total_tokens` tokens (the decode side's cached prefix
/// included) on the decode room's grid (`grid`: what `kvstage_room_open` or
/// `kvstage_session_room_grid_get` answered: its chunk tokens, decode page size and prefix), with
/// prefill pages of `src_page_size` tokens. Pure: no engine, no I/O. `KVSTAGE_E_INVALID_ARG` names
/// the bad argument: a page size of 0, a prefix that is not whole decode pages or leaves nothing
/// to send, a chunk past the request's `num_chunks`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_chunk_span_compute(
    grid: *const kvstage_room_grid,
    total_tokens: u64,
    src_page_size: u32,
    chunk_index: u32,
    out: *mut kvstage_chunk_span,
) -> Status {
    ffi_fn!(status {
        let out = super::args::out_ptr(out, "out")?;
        let g = unsafe { read_versioned::<kvstage_room_grid>(grid, "grid") }?;
        let s = geometry::chunk_span(total_tokens, g.prefix_tokens, src_page_size, g.page_size, g.chunk_tokens, chunk_index)
            .map_err(grid_names)?;
        let filled = kvstage_chunk_span {
            struct_size: std::mem::size_of::<kvstage_chunk_span>(),
            num_chunks: s.num_chunks,
            num_tokens: s.num_tokens,
            first_token: s.first_token,
            src_first_page: s.src_first_page,
            src_num_pages: s.src_num_pages,
            src_token_offset: s.src_token_offset,
            dst_first_page: s.dst_first_page,
            dst_num_pages: s.dst_num_pages,
        };
        unsafe { write_versioned(out, filled, "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// `len` bytes at `src_offset` of the prefill rank's slot go to `dst_offset` of the decode rank's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvstage_byte_range {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// Which bytes of prefill rank `src_rank`'s slot (of `src_tp` ranks) go where in decode rank
/// `dst_rank`'s slot (of `dst_tp`) for `item`: byte ranges in row order, adjacent ones merged,
/// into `out[capacity]`; `*count` receives their number, also when `capacity` is too small
/// (`KVSTAGE_E_INVALID_ARG`); `out` NULL with `capacity` 0 is a count query. No range: the two
/// ranks share no element (`KVSTAGE_OK`, count 0). A decode slot is assembled from every prefill
/// rank's ranges (prefill TP larger) or cut from one rank's (smaller); a replicated item comes
/// whole from prefill rank `dst_rank · src_tp / dst_tp` (rounded down) alone. Slot sizes: `outer · Σ(group_dims) /
/// tp · dtype_bytes` (sharded), `outer · Σ(group_dims) · dtype_bytes` (replicated).
/// `KVSTAGE_E_INVALID_ARG` names the field: a group that does not split among either side's TP
/// ranks (both values), ranks not below their TP size, zero sizes.
#[no_mangle]
pub unsafe extern "C" fn kvstage_state_slice_compute(
    item: *const kvstage_state_item,
    src_tp: u32,
    dst_tp: u32,
    src_rank: u32,
    dst_rank: u32,
    out: *mut kvstage_byte_range,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let item = unsafe { state_item(item) }?;
        let ranges: Vec<kvstage_byte_range> = geometry::state_slice(&item, src_tp, dst_tp, src_rank, dst_rank)?
            .iter()
            .map(|r| kvstage_byte_range { src_offset: r.src, dst_offset: r.dst, len: r.len })
            .collect();
        unsafe { write_array(&ranges, out, capacity, count, "ranges") }
    })
}
