//! Request parts besides the KV for C: a rank's components (aux buffers, state, extra paged
//! pools), the room that names them on the decode side and the transfer that sends them.

use super::engine::{borrow as borrow_engine, kvstage_engine};
use super::state::{kvstage_state_item, state_item};
use super::{ffi_fn, out_arg, slice_arg, str_arg, versioned_struct};
use crate::error::{Error, Result, Status};
use crate::geometry::{ComponentKind, ComponentSpec, PoolSpan, RequestParts};

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

/// Fills `component` with defaults (sets `struct_size`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_component_init(component: *mut kvstage_component) -> Status {
    ffi_fn!(status {
        *out_arg(component, "component")? = kvstage_component::default();
        Ok(Status::KVSTAGE_OK)
    })
}

/// Tokens `[first_token, first_token + num_tokens)` of an extra pool's page list for one request
/// (a sliding window: the window's pages; both sides name the same token count).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstage_pool_span {
    pub pages: *const u32,
    pub num_pages: usize,
    /// Slots of `pages[0]` before the first token.
    pub first_token: u32,
    pub num_tokens: u32,
}

/// What one side names of a request besides its KV pages: the aux row (of every aux buffer), one
/// slot per state component and one span per pool component, in registration order. Fill with
/// `kvstage_request_parts_init`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstage_request_parts {
    pub struct_size: usize,
    pub aux_row: u64,
    pub state_slots: *const u64,
    pub num_state_slots: usize,
    pub pool_spans: *const kvstage_pool_span,
    pub num_pool_spans: usize,
}

impl Default for kvstage_request_parts {
    fn default() -> Self {
        kvstage_request_parts {
            struct_size: std::mem::size_of::<Self>(),
            aux_row: 0,
            state_slots: std::ptr::null(),
            num_state_slots: 0,
            pool_spans: std::ptr::null(),
            num_pool_spans: 0,
        }
    }
}

/// Fills `parts` with defaults (sets `struct_size`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_request_parts_init(parts: *mut kvstage_request_parts) -> Status {
    ffi_fn!(status {
        *out_arg(parts, "parts")? = kvstage_request_parts::default();
        Ok(Status::KVSTAGE_OK)
    })
}

unsafe fn component(raw: &kvstage_component, at: &str) -> Result<(ComponentSpec, u64, Vec<usize>)> {
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

/// Registers the rank's components (host memory), once, after its KV pool and before its
/// sessions connect or are accepted (a session carries the components registered when it
/// connected; the handshake refuses components that differ from the peer's with
/// `KVSTAGE_E_GEOMETRY_MISMATCH`, every differing field in the causes). `KVSTAGE_E_INVALID_ARG`
/// names the bad field (`components[i].field`) and its value.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_register_components(
    engine: *const kvstage_engine,
    components: *const kvstage_component,
    num_components: usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { borrow_engine(engine, "engine") }?;
        let raw = unsafe { slice_arg(components, num_components, "components") }?;
        let mut list = Vec::with_capacity(raw.len());
        for (i, c) in raw.iter().enumerate() {
            let at = format!("components[{i}]");
            let c: kvstage_component = unsafe { versioned_struct(c, &at, std::mem::size_of::<kvstage_component>()) }?;
            list.push(unsafe { component(&c, &at) }?);
        }
        engine.register_components(list)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Reads a request's parts (`None` for NULL); checked against the components by the caller.
pub(super) unsafe fn request_parts(ptr: *const kvstage_request_parts, arg: &str) -> Result<Option<RequestParts>> {
    if ptr.is_null() {
        return Ok(None);
    }
    let raw: kvstage_request_parts = unsafe { versioned_struct(ptr, arg, std::mem::size_of::<kvstage_request_parts>()) }?;
    let slots = unsafe { slice_arg(raw.state_slots, raw.num_state_slots, &format!("{arg}->state_slots")) }?.to_vec();
    let spans = unsafe { slice_arg(raw.pool_spans, raw.num_pool_spans, &format!("{arg}->pool_spans")) }?;
    let mut pools = Vec::with_capacity(spans.len());
    for (i, s) in spans.iter().enumerate() {
        let pages = unsafe { slice_arg(s.pages, s.num_pages, &format!("{arg}->pool_spans[{i}].pages")) }?.to_vec();
        pools.push(PoolSpan { pages, first_token: s.first_token, tokens: s.num_tokens });
    }
    Ok(Some(RequestParts { aux_row: raw.aux_row, state_slots: slots, pools }))
}

/// Decode side: `kvstage_room_open` for a request that also moves parts besides its KV pages:
/// `parts` names its aux row, state slots and extra pools' pages on this rank (NULL: KV only).
/// They travel with the room's last chunk; the room completes only once its KV, pools and state
/// are in place and then its aux rows are written. Errors as `kvstage_room_open`, and
/// `KVSTAGE_E_INVALID_ARG` naming the field of `parts` outside its component (both values).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvstage_room_open_parts(
    engine: *const kvstage_engine,
    room: u64,
    dst_pages: *const u32,
    num_pages: usize,
    chunk_tokens: u32,
    parts: *const kvstage_request_parts,
    num_chunks_out: *mut u32,
    room_key_out: *mut u64,
) -> Status {
    ffi_fn!(status { unsafe { super::transfer::open_room(engine, room, (dst_pages, num_pages), chunk_tokens, parts, num_chunks_out, room_key_out) } })
}
