//! KV layout descriptor, head mapping, writers, chunk grid and staging layout for C.

use super::{ffi_fn, out_arg, slice_arg, versioned_struct, write_versioned};
use crate::error::{Error, Result, Status};
use crate::geometry::{self, KvLayout, MemoryKind, ModelKind, PoolShape};

/// Attention flavour of a KV pool (`kvstage_kv_layout.model_kind`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_model_kind {
    /// MHA / GQA: per layer a K and a V buffer of `[pool_tokens, local_heads, head_dim]`.
    KVSTAGE_MODEL_MHA = 0,
    /// MLA: per layer one latent buffer of `[pool_tokens, head_dim]`, replicated on every TP rank
    /// (`local_heads` = `global_heads` = 1).
    KVSTAGE_MODEL_MLA = 1,
}

/// Where a pool's buffers live (`kvstage_kv_layout.memory_kind`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_memory_kind {
    KVSTAGE_MEMORY_HOST = 0,
    KVSTAGE_MEMORY_CUDA = 1,
}

/// Default chunk size in tokens of the chunk grid.
pub const KVSTAGE_DEFAULT_CHUNK_TOKENS: u32 = 8192;

/// One rank's KV pool. Fill with `kvstage_kv_layout_init`, then set the fields.
///
/// Buffers are token-major: slot `t` of a buffer starts `t · local_heads · head_dim · dtype_bytes`
/// bytes after its base; page `p` is slots `[p · page_size, (p + 1) · page_size)`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstage_kv_layout {
    pub struct_size: usize,
    /// A `kvstage_model_kind` value (plain int so that a bad value is an error, not UB).
    pub model_kind: i32,
    /// Token slots per page (1..=2^20).
    pub page_size: u32,
    /// KV heads on this rank: max(1, global_heads / tp_size); 1 for MLA. 0 (the `_init` default)
    /// derives that value from `global_heads` and `tp_size`; any other value is refused
    /// (`KVSTAGE_E_GEOMETRY_INVALID`, the cause naming both values): kvstage does not support
    /// padded or uneven head layouts, so the field only states what the caller expects.
    pub local_heads: u32,
    /// KV heads of the model; 1 for MLA.
    pub global_heads: u32,
    /// Elements per head; the latent width (e.g. 576) for MLA.
    pub head_dim: u32,
    /// Bytes per element: 1, 2 or 4.
    pub dtype_bytes: u32,
    pub tp_rank: u32,
    pub tp_size: u32,
    pub pp_rank: u32,
    pub pp_size: u32,
    /// Model layer ids held by this rank, strictly increasing; NULL means 0 .. num_layers-1.
    pub layer_ids: *const u32,
    /// Number of layers held (entries of `layer_ids`, `k_bases`, `v_bases`).
    pub num_layers: usize,
    /// Per layer, the base address of the K buffer (the latent buffer for MLA).
    pub k_bases: *const u64,
    /// Per layer, the base address of the V buffer; ignored (may be NULL) for MLA.
    pub v_bases: *const u64,
    /// Pages each buffer holds.
    pub capacity_pages: u64,
    /// A `kvstage_memory_kind` value.
    pub memory_kind: i32,
    /// KVSTAGE_MEMORY_CUDA: the CUDA device ordinal holding the buffers, checked against the
    /// memory at registration; negative (the `_init` default, -1) = the device holding `k_bases[0]`.
    /// Ignored for host memory.
    pub cuda_device: i32,
}

impl Default for kvstage_kv_layout {
    fn default() -> Self {
        kvstage_kv_layout {
            struct_size: std::mem::size_of::<Self>(),
            model_kind: kvstage_model_kind::KVSTAGE_MODEL_MHA as i32,
            page_size: 1,
            local_heads: 0,
            global_heads: 1,
            head_dim: 0,
            dtype_bytes: 2,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            layer_ids: std::ptr::null(),
            num_layers: 0,
            k_bases: std::ptr::null(),
            v_bases: std::ptr::null(),
            capacity_pages: 0,
            memory_kind: kvstage_memory_kind::KVSTAGE_MEMORY_HOST as i32,
            cuda_device: -1,
        }
    }
}

/// Size of the first published version of `kvstage_kv_layout`.
const KV_LAYOUT_V1: usize = std::mem::size_of::<kvstage_kv_layout>();

/// Reads the shape part of a C layout (bases, capacity and memory kind are not read) and validates
/// it; errors name `arg`.
pub unsafe fn pool_shape_from_c(ptr: *const kvstage_kv_layout, arg: &str) -> Result<PoolShape> {
    let raw: kvstage_kv_layout = unsafe { versioned_struct(ptr, arg, KV_LAYOUT_V1) }?;
    unsafe { shape_of(&raw, arg) }
}

/// A `kvstage_model_kind` value passed as a plain int; anything else is an error naming `arg`.
fn model_kind_arg(value: i32, arg: &str) -> Result<ModelKind> {
    match value {
        0 => Ok(ModelKind::Mha),
        1 => Ok(ModelKind::Mla),
        other => Err(Error::invalid_arg(arg, format!("{other} is not a kvstage_model_kind value"))),
    }
}

unsafe fn shape_of(raw: &kvstage_kv_layout, arg: &str) -> Result<PoolShape> {
    let kind = model_kind_arg(raw.model_kind, &format!("{arg}->model_kind"))?;
    if raw.num_layers == 0 || raw.num_layers > u32::MAX as usize {
        return Err(Error::invalid_arg(
            &format!("{arg}->num_layers"),
            format!("{} is outside 1..={}", raw.num_layers, u32::MAX),
        ));
    }
    let layer_ids = if raw.layer_ids.is_null() {
        (0..raw.num_layers as u32).collect()
    } else {
        unsafe { slice_arg(raw.layer_ids, raw.num_layers, &format!("{arg}->layer_ids")) }?.to_vec()
    };
    let shape = PoolShape {
        kind,
        page_size: raw.page_size,
        local_heads: match raw.local_heads {
            0 => (raw.global_heads / raw.tp_size.max(1)).max(1),
            given => given,
        },
        global_heads: raw.global_heads,
        head_dim: raw.head_dim,
        dtype_bytes: raw.dtype_bytes,
        tp_rank: raw.tp_rank,
        tp_size: raw.tp_size,
        pp_rank: raw.pp_rank,
        pp_size: raw.pp_size,
        layer_ids,
    };
    shape.validate().map_err(|e| e.context(format!("`{arg}` is not a valid KV layout")))?;
    Ok(shape)
}

/// Reads and validates a whole C layout (shape, bases, capacity, memory kind); errors name `arg`.
/// The engine's pool registration uses this. Pure: no driver call (see
/// [`kv_layout_device_from_c`] for the CUDA device).
pub unsafe fn kv_layout_from_c(ptr: *const kvstage_kv_layout, arg: &str) -> Result<KvLayout> {
    unsafe { kv_layout_device_from_c(ptr, arg) }.map(|(layout, _)| layout)
}

/// [`kv_layout_from_c`] plus the CUDA device the caller names (`cuda_device`; `None` when
/// negative or for host memory). Registration passes both to `copy::cuda::check_pool`.
pub unsafe fn kv_layout_device_from_c(ptr: *const kvstage_kv_layout, arg: &str) -> Result<(KvLayout, Option<u32>)> {
    let raw: kvstage_kv_layout = unsafe { versioned_struct(ptr, arg, KV_LAYOUT_V1) }?;
    let shape = unsafe { shape_of(&raw, arg) }?;
    let memory = memory_kind_from_c(raw.memory_kind, &format!("{arg}->memory_kind"))?;
    let n = raw.num_layers;
    let k = unsafe { slice_arg(raw.k_bases, n, &format!("{arg}->k_bases")) }?;
    let mut bases: Vec<usize> = k.iter().map(|&b| b as usize).collect();
    if shape.kind == ModelKind::Mha {
        let v = unsafe { slice_arg(raw.v_bases, n, &format!("{arg}->v_bases")) }?;
        bases.extend(v.iter().map(|&b| b as usize));
    }
    let layout = KvLayout { shape, capacity_pages: raw.capacity_pages, memory, bases };
    layout.validate().map_err(|e| e.context(format!("`{arg}` is not a valid KV layout")))?;
    let device = (memory == MemoryKind::Cuda && raw.cuda_device >= 0).then_some(raw.cuda_device as u32);
    Ok((layout, device))
}

/// A C `kvstage_memory_kind` value; errors name `arg`.
pub fn memory_kind_from_c(value: i32, arg: &str) -> Result<MemoryKind> {
    match value {
        0 => Ok(MemoryKind::Host),
        1 => Ok(MemoryKind::Cuda),
        other => Err(Error::invalid_arg(arg, format!("{other} is not a kvstage_memory_kind value"))),
    }
}

/// Fills `layout` with defaults (sets `struct_size`; MHA, page_size 1, one head, bf16, TP 1,
/// PP 1, host memory, cuda_device -1; head_dim, layers, bases and capacity must be set).
#[no_mangle]
pub unsafe extern "C" fn kvstage_kv_layout_init(layout: *mut kvstage_kv_layout) -> Status {
    ffi_fn!(status {
        *out_arg(layout, "layout")? = kvstage_kv_layout::default();
        Ok(Status::KVSTAGE_OK)
    })
}

/// Checks a layout (shape, layer ids, bases: NULL, overlapping, overflowing). `KVSTAGE_OK` or an
/// error naming the field.
#[no_mangle]
pub unsafe extern "C" fn kvstage_kv_layout_validate(layout: *const kvstage_kv_layout) -> Status {
    ffi_fn!(status {
        unsafe { kv_layout_from_c(layout, "layout") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Heads prefill rank `src_rank` sends to decode rank `dst_rank`, in local head units.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvstage_head_slice {
    pub src_head_start: u32,
    pub num_heads: u32,
    pub dst_head_start: u32,
}

/// The head slice prefill rank `src_rank` (of `src_tp`) sends to decode rank `dst_rank` (of
/// `dst_tp`) for a model with `total_kv_heads` KV heads (MHA/GQA). `KVSTAGE_E_INVALID_ARG` naming
/// the argument for zero sizes, ranks not below their size, head counts that do not divide a TP
/// size, TP sizes that are not multiples of one another, or ranks that do not exchange data —
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

/// Writers per chunk on a decode rank with equal-sized pipeline stages: `tp_writers × pp_writers`
/// for MHA (`tp_writers` counts one writer per distinct head group: with prefill-side GQA
/// replication only one of the prefill ranks holding a head sends it), `pp_writers` for MLA (one
/// designated TP writer); `model_kind` is a `kvstage_model_kind`, `total_kv_heads` the model's
/// KV heads (1 for MLA: anything else is `KVSTAGE_E_INVALID_ARG`). With equal stages the PP
/// sizes must divide one another; for any other split (uneven stages, 3 into 2) the count depends
/// on the layers each stage holds: `kvstage_staging_layout_compute` takes the stages' layouts and
/// reports the writers of any split exactly.
#[no_mangle]
pub unsafe extern "C" fn kvstage_writers_per_chunk(
    model_kind: i32,
    total_kv_heads: u32,
    src_tp: u32,
    dst_tp: u32,
    src_pp: u32,
    dst_pp: u32,
    out: *mut u32,
) -> Status {
    ffi_fn!(status {
        let out = out_arg(out, "out")?;
        let kind = model_kind_arg(model_kind, "model_kind")?;
        if kind == ModelKind::Mla && total_kv_heads != 1 {
            return Err(Error::invalid_arg("total_kv_heads", format!("{total_kv_heads} for MLA, whose latent is one head (pass 1)")));
        }
        if src_pp > 0 && dst_pp > 0 && !src_pp.is_multiple_of(dst_pp) && !dst_pp.is_multiple_of(src_pp) {
            return Err(Error::invalid_arg(
                "src_pp",
                format!("{src_pp} and dst_pp {dst_pp} do not divide each other: the writers of such a split depend on the layers each stage holds (kvstage_staging_layout_compute takes the stages' layouts)"),
            ));
        }
        *out = geometry::writers_per_chunk(kind, total_kv_heads, src_tp, dst_tp, src_pp, dst_pp)?;
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
    if count == 0 {
        return Ok(Vec::new());
    }
    if stages.is_null() {
        return Err(Error::invalid_arg(arg, format!("is NULL with {count} stages")));
    }
    // SAFETY: a non-NULL array holds `count` layouts, each starting with its `size_t struct_size`.
    let stride = unsafe { *(stages as *const usize) };
    (0..count)
        .map(|j| {
            let name = format!("{arg}[{j}]");
            // SAFETY: as above; `versioned_struct` bounds the stride (>= the first version, <= 1 MiB)
            // for element 0 before element 1 is reached.
            let ptr = unsafe { (stages as *const u8).add(j * stride) } as *const kvstage_kv_layout;
            let size = unsafe { *(ptr as *const usize) };
            if size != stride {
                return Err(Error::invalid_arg(
                    &format!("{name}.struct_size"),
                    format!("{size} differs from `{arg}[0].struct_size` {stride} (fill every stage with kvstage_kv_layout_init)"),
                ));
            }
            unsafe { pool_shape_from_c(ptr, &name) }
        })
        .collect()
}

/// Writes `peers` into `out[capacity]`; `*count` (may be NULL) receives their number, also when
/// `capacity` is too small (then `KVSTAGE_E_INVALID_ARG` naming both). `out` NULL with `capacity`
/// 0 is a count query (`KVSTAGE_OK`).
unsafe fn write_peers(peers: &[geometry::PeerRank], out: *mut kvstage_rank, capacity: usize, count: *mut usize) -> Result<Status> {
    let ranks: Vec<kvstage_rank> = peers.iter().map(|p| kvstage_rank { tp_rank: p.tp_rank, pp_rank: p.pp_rank }).collect();
    unsafe { super::write_array(&ranks, out, capacity, count, "ranks") }
}

/// The decode ranks prefill rank `prefill` must open sessions to, ordered by (pp_rank, tp_rank):
/// TP ranks by the head mapping (MLA: the decode ranks this rank is the designated writer of), PP
/// stages that hold at least one of its layers, whatever the split. `decode_stages` is an array of
/// `num_decode_stages` shape-only layouts (each filled by `kvstage_kv_layout_init`),
/// `decode_stages[j]` for decode stage `j` (any TP rank: its `tp_size` and `layer_ids` are used;
/// bases are ignored). The ranks go to
/// `out[capacity]`; `*count` (may be NULL) receives their number, also when `capacity` is too
/// small (`KVSTAGE_E_INVALID_ARG`). A call with `out` NULL and `capacity` 0 is a count query:
/// `KVSTAGE_OK` with `*count` set (0 when the rank exchanges nothing with that side).
/// Errors name the bad stage: out of order, TP sizes that differ, a layer held twice, fields both
/// sides must agree on (`KVSTAGE_E_GEOMETRY_MISMATCH`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_pairing_decode_ranks(
    prefill: *const kvstage_kv_layout,
    decode_stages: *const kvstage_kv_layout,
    num_decode_stages: usize,
    out: *mut kvstage_rank,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let local = unsafe { pool_shape_from_c(prefill, "prefill") }?;
        let stages = unsafe { stage_shapes(decode_stages, num_decode_stages, "decode_stages") }?;
        let peers = geometry::decode_peers(&local, &stages)?;
        unsafe { write_peers(&peers, out, capacity, count) }
    })
}

/// The prefill ranks that write to decode rank `decode` (the sessions it will accept), ordered by
/// (pp_rank, tp_rank): the inverse of `kvstage_pairing_decode_ranks`, with the same conventions;
/// `prefill_stages[j]` describes prefill stage `j`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_pairing_prefill_ranks(
    decode: *const kvstage_kv_layout,
    prefill_stages: *const kvstage_kv_layout,
    num_prefill_stages: usize,
    out: *mut kvstage_rank,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let local = unsafe { pool_shape_from_c(decode, "decode") }?;
        let stages = unsafe { stage_shapes(prefill_stages, num_prefill_stages, "prefill_stages") }?;
        let peers = geometry::prefill_peers(&local, &stages)?;
        unsafe { write_peers(&peers, out, capacity, count) }
    })
}

/// Layout of one staging allocation (one decode rank, one chunk). Set `struct_size` before the
/// call. Writer `w`'s slab for buffer `kv` (0 = K / latent, 1 = V) and layer index `l` (into the
/// decode rank's layers the writer holds, ascending) starts at
/// `writers[w].offset + (kv · writers[w].layers + l) · slab_bytes`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstage_staging_layout {
    pub struct_size: usize,
    /// Bytes of the whole allocation.
    pub total_bytes: u64,
    /// Bytes of one token's head slice (`num_heads · head_dim · dtype_bytes`).
    pub row_bytes: u64,
    /// Bytes of one (buffer, layer) slab (`tokens · row_bytes`).
    pub slab_bytes: u64,
    pub tokens: u32,
    /// Heads per row (the same for every writer).
    pub num_heads: u32,
    /// 2 (K, V) for MHA, 1 for MLA.
    pub buffers_per_layer: u32,
    /// Writers whose arrival completes the chunk (entries `kvstage_staging_layout_compute` fills).
    pub num_writers: u32,
    /// Head groups of the decode rank: each of its layers arrives once per head group.
    pub num_tp_writers: u32,
}

/// One writer's region of a staging allocation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvstage_staging_writer {
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
/// group). `writers` may be NULL with `writers_len` 0 to ask for the count only. When
/// `writers_len` is too small, `out` (with `num_writers`) is still filled and
/// `KVSTAGE_E_INVALID_ARG` names `writers_len`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_staging_layout_compute(
    prefill_stages: *const kvstage_kv_layout,
    num_prefill_stages: usize,
    dst: *const kvstage_kv_layout,
    tokens: u32,
    out: *mut kvstage_staging_layout,
    writers: *mut kvstage_staging_writer,
    writers_len: usize,
) -> Status {
    ffi_fn!(status {
        let out = out_arg(out, "out")?;
        let stages = unsafe { stage_shapes(prefill_stages, num_prefill_stages, "prefill_stages") }?;
        let dst = unsafe { pool_shape_from_c(dst, "dst") }?;
        let st = geometry::staging_layout_stages(&stages, &dst, tokens)?;
        let filled = kvstage_staging_layout {
            struct_size: std::mem::size_of::<kvstage_staging_layout>(),
            total_bytes: st.total_bytes,
            row_bytes: st.row_bytes,
            slab_bytes: st.slab_bytes,
            tokens: st.tokens,
            num_heads: st.num_heads,
            buffers_per_layer: st.buffers_per_layer,
            num_writers: st.writers.len() as u32,
            num_tp_writers: st.tp_writers(),
        };
        write_versioned(out, filled, "out")?;
        let needed = st.writers.len();
        if writers.is_null() && writers_len == 0 {
            return Ok(Status::KVSTAGE_OK);
        }
        if writers.is_null() {
            return Err(Error::invalid_arg("writers", format!("is NULL with writers_len {writers_len}")));
        }
        if writers_len < needed {
            return Err(Error::invalid_arg(
                "writers_len",
                format!("{writers_len} entries are too few: the layout has {needed} writers (out->num_writers)"),
            ));
        }
        // SAFETY: the caller provides `writers_len` >= `needed` writable entries.
        let dst_entries = unsafe { std::slice::from_raw_parts_mut(writers, needed) };
        for (slot, w) in dst_entries.iter_mut().zip(&st.writers) {
            *slot = kvstage_staging_writer {
                offset: w.offset,
                bytes: w.bytes,
                layers: w.layers,
                src_tp_rank: w.src_tp_rank,
                src_pp_rank: w.src_pp_rank,
                tp_writer: w.tp_writer,
                src_head_start: w.heads.src_head_start,
                num_heads: w.heads.num_heads,
                dst_head_start: w.heads.dst_head_start,
            };
        }
        Ok(Status::KVSTAGE_OK)
    })
}
