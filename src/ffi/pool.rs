//! The KV pool a rank registers (`kvstage_kv_layout`) and its extra components (aux rows, state
//! slots, extra pools): what the handshake compares (docs/GEOMETRY.md, "Pool layout").

use super::args::{init_versioned, read_versioned, read_versioned_array, slice_arg, str_arg, versioned, write_versioned};
use super::ffi_fn;
use super::handle::{self, kvstage_engine};
use crate::error::{Error, Result, Status};
use crate::geometry::{ComponentKind, ComponentSpec, KvLayout, LayoutPreset, MemoryKind, ModelKind, PoolShape, StateItem, Strides};

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

/// An engine's named pool layout (`kvstage_kv_layout_preset`; the names kvstage-bench and Python
/// use are in parentheses).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_layout_preset {
    /// sglang (`sglang`): per layer a K and a V buffer `[slots, heads, head_dim]`, token-major.
    KVSTAGE_LAYOUT_SGLANG = 0,
    /// vLLM (`vllm-lbhnc`, ...): the logical cache `[layer, block, head, token, cell]`, K and V
    /// in one cell (`K‖V`), stored in this order of its axes, outermost first. `LBHNC` is vLLM's
    /// CPU backend's and what its NIXL and Mooncake connectors ask for; the `BL..` orders are
    /// blocks that hold every layer.
    KVSTAGE_LAYOUT_VLLM_LBHNC = 1,
    KVSTAGE_LAYOUT_VLLM_LBNHC = 2,
    KVSTAGE_LAYOUT_VLLM_LHBNC = 3,
    KVSTAGE_LAYOUT_VLLM_BLHNC = 4,
    KVSTAGE_LAYOUT_VLLM_BLNHC = 5,
    KVSTAGE_LAYOUT_VLLM_BHLNC = 6,
    /// TensorRT-LLM (`trtllm`): one pool of blocks `[block][layer][K/V][head][token][head_dim]`.
    KVSTAGE_LAYOUT_TRTLLM = 7,
}

/// One rank's KV pool. Fill with `kvstage_kv_layout_init`, then set the fields.
///
/// Byte `e` of local head `h` of token `s` of page `p` of a buffer lies at `base + p·page_stride +
/// s·token_stride + h·head_stride + e`. The strides left 0 are sglang's token-major layout: slot
/// `t` of a buffer starts `t · local_heads · head_dim · dtype_bytes` bytes after its base; page `p`
/// is slots `[p · page_size, (p + 1) · page_size)`. `kvstage_kv_layout_preset` sets them for
/// vLLM's and TensorRT-LLM's layouts. Each side's strides are its own: only the model (heads,
/// head_dim, dtype, layers) must agree across the wire.
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
    /// Bytes between pages (blocks) of a buffer; 0 = `page_size · token_stride` (larger for padded
    /// pages, or a block that holds every layer).
    pub page_stride: u64,
    /// Bytes between the token slots of a page; 0 = `local_heads · head_dim · dtype_bytes`.
    pub token_stride: u64,
    /// Bytes between the heads of a token slot; 0 = `head_dim · dtype_bytes`.
    pub head_stride: u64,
    /// MHA with `v_bases` NULL: V of layer `i` lies `v_offset` bytes after `k_bases[i]` (K and V in
    /// one cell, or one block); 0 = V has buffers of its own (`v_bases`). Ignored for MLA.
    pub v_offset: u64,
    /// Elements per V head where they differ from K's (vLLM `head_size_v`, sglang `v_head_dim`);
    /// 0 = `head_dim`. Ignored for MLA. Both sides of a transfer must agree on it.
    pub head_dim_v: u32,
    /// V's strides where they differ from K's; each 0 = K's stride where the caller set K's (V in
    /// K's cell or block strides like K), else V's own token-major default (`page_size ·
    /// v_token_stride`, `local_heads · head_dim_v · dtype_bytes`, `head_dim_v · dtype_bytes`).
    /// Ignored for MLA.
    pub v_page_stride: u64,
    pub v_token_stride: u64,
    pub v_head_stride: u64,
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
            page_stride: 0,
            token_stride: 0,
            head_stride: 0,
            v_offset: 0,
            head_dim_v: 0,
            v_page_stride: 0,
            v_token_stride: 0,
            v_head_stride: 0,
        }
    }
}

versioned!(kvstage_kv_layout, cuda_device: i32);

/// Reads the shape part of a C layout (bases, capacity and memory kind are not read) and validates
/// it; errors name `arg`.
pub unsafe fn pool_shape_from_c(ptr: *const kvstage_kv_layout, arg: &str) -> Result<PoolShape> {
    let raw: kvstage_kv_layout = unsafe { read_versioned(ptr, arg) }?;
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

pub(super) unsafe fn shape_of(raw: &kvstage_kv_layout, arg: &str) -> Result<PoolShape> {
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
        head_dim_v: if raw.head_dim_v == 0 { raw.head_dim } else { raw.head_dim_v },
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
    let raw: kvstage_kv_layout = unsafe { read_versioned(ptr, arg) }?;
    let shape = unsafe { shape_of(&raw, arg) }?;
    let memory = memory_kind_from_c(raw.memory_kind, &format!("{arg}->memory_kind"))?;
    let n = raw.num_layers;
    let k = unsafe { slice_arg(raw.k_bases, n, &format!("{arg}->k_bases")) }?;
    let mut bases: Vec<usize> = k.iter().map(|&b| b as usize).collect();
    if shape.kind == ModelKind::Mha {
        match (raw.v_bases.is_null(), raw.v_offset) {
            (true, 0) => return Err(Error::invalid_arg(&format!("{arg}->v_bases"), "is NULL and v_offset is 0 (an MHA pool's V lies in buffers of its own or v_offset after K)")),
            (true, off) => {
                for (i, &b) in k.iter().enumerate() {
                    let v = b.checked_add(off).filter(|v| *v <= usize::MAX as u64);
                    bases.push(v.ok_or_else(|| Error::invalid_arg(&format!("{arg}->v_offset"), format!("k_bases[{i}] {b:#x} + v_offset {off} overflows the address space")))? as usize);
                }
            }
            (false, 0) => bases.extend(unsafe { slice_arg(raw.v_bases, n, &format!("{arg}->v_bases")) }?.iter().map(|&b| b as usize)),
            (false, off) => {
                return Err(Error::invalid_arg(&format!("{arg}->v_offset"), format!("is {off} and v_bases is set too: V lies in its own buffers or v_offset after K, not both")))
            }
        }
    }
    let or = |v: u64, default: u64| if v == 0 { default } else { v };
    let ps = shape.page_size as u64;
    let (tm, tmv) = (Strides::token_major_of(&shape, 0), Strides::token_major_of(&shape, 1));
    let token = or(raw.token_stride, tm.token);
    // A page stride left 0 follows the token stride.
    let strides = Strides { page: or(raw.page_stride, ps * token), token, head: or(raw.head_stride, tm.head) };
    // V's: its own, else K's where the caller set K's, else V's token-major default.
    let v_token = or(raw.v_token_stride, or(raw.token_stride, tmv.token));
    let v_strides = Strides {
        page: or(raw.v_page_stride, or(raw.page_stride, ps * v_token)),
        token: v_token,
        head: or(raw.v_head_stride, or(raw.head_stride, tmv.head)),
    };
    let layout = KvLayout::new(shape, raw.capacity_pages, memory, bases).with_strides(strides).with_v_strides(v_strides);
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

/// Fills `layout` (`size`: the caller's `sizeof(*layout)`) with defaults (sets `struct_size`; MHA, page_size 1, one head, bf16, TP 1,
/// PP 1, host memory, cuda_device -1; head_dim, layers, bases and capacity must be set).
#[no_mangle]
pub unsafe extern "C" fn kvstage_kv_layout_init(layout: *mut kvstage_kv_layout, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(layout, size, "layout") } })
}

/// Sets the strides, V's strides (where they differ from K's: V heads of another size in buffers or
/// block halves of their own) and `v_offset` of `layout` to an engine's layout `preset` (a
/// `kvstage_layout_preset` value), from the fields already set: `model_kind`, `page_size`,
/// `global_heads`, `tp_size`, `head_dim`, `head_dim_v`, `dtype_bytes`, `num_layers` and `capacity_pages` (for
/// layouts whose strides span the blocks). `layer_stride` (may be NULL) receives the bytes between
/// consecutive layers' K where every layer lies in one tensor: `k_bases[i] = base + i ·
/// layer_stride` (sglang: the distance if its per-layer buffers were back to back; V then follows
/// every K). The bases stay the caller's to set. Padded pages: set `page_stride` after this.
#[no_mangle]
pub unsafe extern "C" fn kvstage_kv_layout_preset(layout: *mut kvstage_kv_layout, preset: i32, layer_stride: *mut u64) -> Status {
    ffi_fn!(status {
        let mut raw: kvstage_kv_layout = unsafe { read_versioned(layout, "layout") }?;
        let needed = std::mem::offset_of!(kvstage_kv_layout, v_offset) + 8;
        // SAFETY: read_versioned checked the pointer and read its size.
        let size = unsafe { (*layout).struct_size };
        if size < needed {
            return Err(Error::invalid_arg("layout->struct_size", format!("{size} bytes hold no strides (this library's layout has them in its first {needed})")));
        }
        let has_v = size >= std::mem::offset_of!(kvstage_kv_layout, v_head_stride) + 8;
        let preset = LayoutPreset::from_c(preset).ok_or_else(|| Error::invalid_arg("preset", format!("{preset} is not a kvstage_layout_preset value")))?;
        let shape = unsafe { shape_of(&raw, "layout") }?;
        if raw.capacity_pages == 0 {
            return Err(Error::invalid_arg("layout->capacity_pages", "is 0: set it before the preset (strides of some layouts span the blocks)"));
        }
        let p = preset.placement(&shape, raw.capacity_pages);
        raw.page_stride = p.strides.page;
        raw.token_stride = p.strides.token;
        raw.head_stride = p.strides.head;
        raw.v_offset = p.v_offset;
        if shape.kind == ModelKind::Mha && p.v_strides != p.strides {
            // Only a layout with `head_dim_v` (which has these fields) has V strides of its own.
            if !has_v {
                return Err(Error::internal("a layout without head_dim_v has V strides of its own"));
            }
            (raw.v_page_stride, raw.v_token_stride, raw.v_head_stride) = (p.v_strides.page, p.v_strides.token, p.v_strides.head);
        } else if has_v {
            (raw.v_page_stride, raw.v_token_stride, raw.v_head_stride) = (0, 0, 0);
        }
        unsafe { write_versioned(layout, raw, "layout") }?;
        if !layer_stride.is_null() {
            // SAFETY: the caller's out pointer, checked non-NULL.
            unsafe { layer_stride.write(p.layer_stride) };
        }
        Ok(Status::KVSTAGE_OK)
    })
}

/// Checks a layout (shape, layer ids, bases: NULL, rows that share a byte, overflowing; strides
/// that are not whole elements or smaller than what they stride over). `KVSTAGE_OK` or an error
/// naming the field.
#[no_mangle]
pub unsafe extern "C" fn kvstage_kv_layout_validate(layout: *const kvstage_kv_layout) -> Status {
    ffi_fn!(status {
        unsafe { kv_layout_from_c(layout, "layout") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Registers this rank's KV pool (copied; the memory it points to must outlive the engine).
/// A CUDA pool (`memory_kind` CUDA) is checked here: `KVSTAGE_E_NO_DEVICE` without libcuda or
/// without the device (the causes name the CUDA error, e.g. CUDA_ERROR_NO_DEVICE),
/// `KVSTAGE_E_GEOMETRY_INVALID` when a buffer is not device memory of `cuda_device` over its
/// whole extent, `KVSTAGE_E_CUDA` when the kernels do not load (the cause holds the JIT log),
/// `KVSTAGE_E_INVALID_ARG` when the registered staging ring is device memory and this pool is
/// not CUDA memory of the same device.
#[no_mangle]
pub unsafe extern "C" fn kvstage_pool_register(
    engine: *const kvstage_engine,
    layout: *const kvstage_kv_layout,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let (layout, cuda_device) = unsafe { kv_layout_device_from_c(layout, "layout") }?;
        // CUDA pools: driver, device, kernels and device memory checked here, before any transfer.
        crate::copy::check_pool(&layout, cuda_device)?;
        engine.register_pool(layout)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// What a component holds (`kvstage_component.kind`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_component_kind {
    /// Metadata rows (sglang's `MetadataBuffers`: output ids, cached-token counts, logprobs,
    /// draft hidden states, ...): one row of `item_bytes` per request, the row index each side's
    /// own. Written into the decode buffers last, once everything else of the room is in place.
    KVSTAGE_COMPONENT_AUX = 0,
    /// Per-request state (Mamba/GDN conv and SSM states): one slot per request per layer, shaped
    /// and sharded as `state` says.
    KVSTAGE_COMPONENT_STATE = 1,
    /// An extra paged pool (a sliding window's KV, an indexer's key pages): `item_bytes` per head
    /// per token, head-sliced like the KV (`head_sliced` 1), or per token, whole on every rank
    /// (`head_sliced` 0).
    KVSTAGE_COMPONENT_POOL = 2,
}

/// One component of a rank. Fill with `kvstage_component_init`, then set the fields. Host or CUDA
/// device memory (the driver tells which; all of a component's buffers one or the other; device
/// buffers are moved with synchronous copies, fine for the small parts of a request).
///
/// Buffers: AUX `bases[0]` holds `num_items` rows of `item_bytes`; STATE `bases[i]` (layer
/// `layer_ids[i]`) holds `num_items` slots of this rank's share of `state`; POOL `bases[i]` holds
/// `num_items` pages of `page_size` token slots of `item_bytes · local KV heads` (head-sliced) or
/// `item_bytes` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstage_component {
    pub struct_size: usize,
    /// Its name, NUL-terminated, 1..=64 printable ASCII characters, unique on the rank: both sides
    /// register the same components in the same order (the handshake compares them).
    pub name: *const std::ffi::c_char,
    /// A `kvstage_component_kind` value.
    pub kind: i32,
    /// AUX: bytes of a row; POOL: bytes per head per token (head-sliced) or per token.
    pub item_bytes: u64,
    /// Rows (AUX), slots (STATE) or pages (POOL) each buffer holds.
    pub num_items: u64,
    /// STATE: the item's shape (global sizes; this rank holds its TP share).
    pub state: *const kvstage_state_item,
    /// POOL: token slots per page (the two sides may differ).
    pub page_size: u32,
    /// POOL: 1 = head-sliced like the KV, 0 = whole on every rank (sent once).
    pub head_sliced: i32,
    /// STATE and POOL: the model layers held on this rank, strictly increasing (AUX: none; a
    /// pipeline stage may hold none of a component's layers, and registers it all the same).
    pub layer_ids: *const u32,
    pub num_layers: usize,
    /// One buffer address per layer (AUX: one).
    pub bases: *const u64,
    pub num_bases: usize,
}

impl Default for kvstage_component {
    fn default() -> Self {
        kvstage_component {
            struct_size: std::mem::size_of::<Self>(),
            name: std::ptr::null(),
            kind: kvstage_component_kind::KVSTAGE_COMPONENT_AUX as i32,
            item_bytes: 0,
            num_items: 0,
            state: std::ptr::null(),
            page_size: 1,
            head_sliced: 1,
            layer_ids: std::ptr::null(),
            num_layers: 0,
            bases: std::ptr::null(),
            num_bases: 0,
        }
    }
}

versioned!(kvstage_component, num_bases: usize);

/// Fills `component` (`size`: the caller's `sizeof(*component)`) with defaults (sets `struct_size`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_component_init(component: *mut kvstage_component, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(component, size, "component") } })
}

pub(super) unsafe fn component(raw: &kvstage_component, at: &str) -> Result<(ComponentSpec, u64, Vec<usize>)> {
    let field = |f: &str| format!("{at}.{f}");
    let name = unsafe { str_arg(raw.name, &field("name")) }?.to_owned();
    let flag = |v: i32, f: &str| match v {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(Error::invalid_arg(&field(f), format!("{other} is neither 0 nor 1"))),
    };
    let kind = match raw.kind {
        0 => ComponentKind::Aux { row_bytes: raw.item_bytes },
        1 => ComponentKind::State { item: unsafe { state_item(raw.state) }.map_err(|e| e.context(format!("{at}.state")))? },
        2 => ComponentKind::Pool { unit_bytes: raw.item_bytes, head_sliced: flag(raw.head_sliced, "head_sliced")? },
        other => return Err(Error::invalid_arg(&field("kind"), format!("{other} is not a kvstage_component_kind"))),
    };
    let layer_ids = unsafe { slice_arg(raw.layer_ids, raw.num_layers, &field("layer_ids")) }?.to_vec();
    let bases = unsafe { slice_arg(raw.bases, raw.num_bases, &field("bases")) }?.iter().map(|&b| b as usize).collect();
    let page_size = if matches!(kind, ComponentKind::Pool { .. }) { raw.page_size } else { 0 };
    Ok((ComponentSpec { name, kind, layer_ids, page_size }, raw.num_items, bases))
}

/// Registers the rank's components (host or CUDA memory, see `kvstage_component`), once, after its KV pool and before its
/// sessions connect or are accepted (a session carries the components registered when it
/// connected; the handshake refuses components that differ from the peer's with
/// `KVSTAGE_E_GEOMETRY_MISMATCH`, every differing field in the causes). `KVSTAGE_E_INVALID_ARG`
/// names the bad field (`components[i].field`) and its value.
#[no_mangle]
pub unsafe extern "C" fn kvstage_pool_register_components(
    engine: *const kvstage_engine,
    components: *const kvstage_component,
    num_components: usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let raw = unsafe { read_versioned_array(components, num_components, "components") }?;
        let mut list = Vec::with_capacity(raw.len());
        for (i, c) in raw.iter().enumerate() {
            list.push(unsafe { component(c, &format!("components[{i}]")) }?);
        }
        engine.register_components(list)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// One state item (one slot of one layer): `outer` rows of `sum(group_dims)` elements of
/// `dtype_bytes` each. Sharded (`replicated` 0), each TP rank holds, per row, its share of every
/// group, groups back to back: rank `r` of `tp` holds elements `[r·g/tp, (r+1)·g/tp)` of a group of
/// `g` (a conv state's key, key and value groups each sharded on their own; one group: the whole
/// row). Replicated (`replicated` 1): whole on every rank. Fill with `kvstage_state_item_init`.
/// Limits: `dtype_bytes` 1..=64, 1..=64 groups, `outer` 1..=2^20 rows, a slot of at most 2^40
/// bytes; a sharded group a multiple of both TP sizes. Under an MLA TP change a replicated item
/// travels with the latent; a sharded one is refused (`KVSTAGE_E_UNSUPPORTED`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstage_state_item {
    pub struct_size: usize,
    pub outer: u32,
    pub dtype_bytes: u32,
    /// Global elements of each group of a row, `num_groups` entries.
    pub group_dims: *const u32,
    pub num_groups: usize,
    /// 1: the item is whole on every rank (nothing to shard); 0: sharded by groups.
    pub replicated: i32,
}

impl Default for kvstage_state_item {
    fn default() -> Self {
        kvstage_state_item {
            struct_size: std::mem::size_of::<Self>(),
            outer: 1,
            dtype_bytes: 2,
            group_dims: std::ptr::null(),
            num_groups: 0,
            replicated: 0,
        }
    }
}

/// Fills `item` with defaults (sets `struct_size`; one row, 2-byte elements, sharded; set
/// `group_dims` and `num_groups`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_state_item_init(item: *mut kvstage_state_item, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(item, size, "item") } })
}

versioned!(kvstage_state_item, replicated: i32);

pub(super) unsafe fn state_item(ptr: *const kvstage_state_item) -> Result<StateItem> {
    let raw: kvstage_state_item = unsafe { read_versioned(ptr, "item") }?;
    let groups = unsafe { slice_arg(raw.group_dims, raw.num_groups, "item->group_dims") }?;
    let replicated = match raw.replicated {
        0 => false,
        1 => true,
        other => return Err(Error::invalid_arg("item->replicated", format!("{other} is neither 0 nor 1"))),
    };
    Ok(StateItem { outer: raw.outer, groups: groups.to_vec(), dtype_bytes: raw.dtype_bytes, replicated })
}
