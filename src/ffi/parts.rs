//! Request parts besides the KV for C: a rank's components (aux buffers, state, extra paged
//! pools), the room that names them on the decode side and the transfer that sends them.

use super::args::{init_versioned, read_versioned, slice_arg, versioned};
use super::ffi_fn;
use crate::error::{Result, Status};
use crate::geometry::{PoolSpan, RequestParts};

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

versioned!(kvstage_request_parts, num_pool_spans: usize);

/// Fills `parts` (`size`: the caller's `sizeof(*parts)`) with defaults (sets `struct_size`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_request_parts_init(parts: *mut kvstage_request_parts, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(parts, size, "parts") } })
}

/// Reads a request's parts (`None` for NULL); checked against the components by the caller.
pub(super) unsafe fn request_parts(ptr: *const kvstage_request_parts, arg: &str) -> Result<Option<RequestParts>> {
    if ptr.is_null() {
        return Ok(None);
    }
    let raw: kvstage_request_parts = unsafe { read_versioned(ptr, arg) }?;
    let slots = unsafe { slice_arg(raw.state_slots, raw.num_state_slots, &format!("{arg}->state_slots")) }?.to_vec();
    let spans = unsafe { slice_arg(raw.pool_spans, raw.num_pool_spans, &format!("{arg}->pool_spans")) }?;
    let mut pools = Vec::with_capacity(spans.len());
    for (i, s) in spans.iter().enumerate() {
        let pages = unsafe { slice_arg(s.pages, s.num_pages, &format!("{arg}->pool_spans[{i}].pages")) }?.to_vec();
        pools.push(PoolSpan { pages, first_token: s.first_token, tokens: s.num_tokens });
    }
    Ok(Some(RequestParts { aux_row: raw.aux_row, state_slots: slots, pools }))
}
