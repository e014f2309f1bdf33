//! The prefill side's transfers: one chunk's descriptor, the synchronous and asynchronous
//! transfers, and the operation handle of an asynchronous one (poll, wait, cancel, layers, timings,
//! describe).

use std::ffi::c_char;
use std::sync::Arc;

use super::args::{init_versioned, json, out_arg, out_ptr, read_versioned, slice_arg, str_arg, timeout, versioned, write_text, write_versioned};
use super::ffi_fn;
use super::handle::{self, kvstage_op, kvstage_session, Handle};
use super::parts::{kvstage_request_parts, request_parts};
use super::room::room_ref;
use super::timings::{kvstage_transfer_timings, timings_to_c};
use crate::copy::ReadyFence;
use crate::error::{Error, Result, Status};
use crate::session::op::Op;
use crate::session::sender::describe::describe_op;
use crate::session::sender::{SenderSession, TransferDesc};

/// One chunk to transfer. Fill with `kvstage_transfer_desc_init`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_transfer_desc {
    pub struct_size: usize,
    /// The request's room id on the decode side (opened there with `kvstage_room_open`).
    pub room: u64,
    /// Index of the chunk within the room (chunk grid of the decode side).
    pub chunk_index: u32,
    /// Prefill pool pages holding the chunk's tokens, in token order.
    pub src_pages: *const u32,
    pub num_pages: usize,
    /// The transfer's deadline, in milliseconds from the call: 0 = the engine default,
    /// KVSTAGE_TIMEOUT_INFINITE = none.
    pub timeout_ms: u64,
    /// CUDA pools: the `CUstream` after whose current work the chunk's KV is valid (an event is
    /// recorded on it during the call), or NULL.
    pub cuda_stream: *mut std::ffi::c_void,
    /// CUDA pools: a recorded `CUevent` after which the chunk's KV is valid, or NULL. At most one
    /// of `cuda_stream` and `cuda_event` is set; both NULL: the KV is valid now. The transfer
    /// waits for this point before it asks for ring space or takes a copy lane or staging buffer
    /// (so a chunk whose KV is late delays no other transfer), bounded by its deadline
    /// (`KVSTAGE_E_TIMEOUT` naming the ready point) and by a cancel.
    pub cuda_event: *mut std::ffi::c_void,
    /// The caller's value, handed back with this transfer's completion (asynchronous transfers).
    pub user_tag: u64,
    /// The key `kvstage_room_open` returned on the decode side for this opening of `room`
    /// (required: 0 is refused). A transfer naming an opening that is not open (the room was
    /// released, maybe reopened for another request) or a wrong key ends with
    /// `KVSTAGE_E_STALE_ROOM` and writes nothing.
    pub room_key: u64,
    /// Slots of `src_pages[0]` before the chunk's first token (below the prefill page size): where
    /// the decode side's cached prefix (whole *decode* pages) or the previous chunk ends inside a
    /// prefill page. `kvstage_chunk_span_compute` computes it.
    pub src_token_offset: u32,
    /// Tokens of the chunk; 0: every slot of `src_pages` from `src_token_offset` on. The pages
    /// must hold exactly these tokens (the last one in the last page). Each chunk carries the
    /// decode room's chunk-grid tokens but the room's last, which may end inside a decode page
    /// (where the request ends).
    pub num_tokens: u32,
    /// The request's trace id, NUL-terminated (copied): the engine's own request id, at most 64
    /// bytes of letters, digits and `. _ - : / @ + #`. It goes in front of every log line about the
    /// request on both sides, and into the describe documents and completions; the decode room
    /// takes the first one a writer names. NULL: both sides derive one from the room's opening
    /// (`<room>#<4 hex digits>`).
    pub trace_id: *const std::ffi::c_char,
    /// The request's parts besides the KV on this rank (aux row, state slots, extra pools'
    /// pages), or NULL: set on the transfer of the room's last chunk when the decode room names
    /// parts (`kvstage_room_desc.parts`). Staged whole-chunk transfers only.
    pub parts: *const kvstage_request_parts,
}

impl Default for kvstage_transfer_desc {
    fn default() -> Self {
        kvstage_transfer_desc {
            struct_size: std::mem::size_of::<Self>(),
            room: 0,
            chunk_index: 0,
            src_pages: std::ptr::null(),
            num_pages: 0,
            timeout_ms: 0,
            cuda_stream: std::ptr::null_mut(),
            cuda_event: std::ptr::null_mut(),
            user_tag: 0,
            room_key: 0,
            src_token_offset: 0,
            num_tokens: 0,
            trace_id: std::ptr::null(),
            parts: std::ptr::null(),
        }
    }
}

versioned!(kvstage_transfer_desc, parts: *const kvstage_request_parts);

/// Fills `desc` with defaults (`size`: the caller's `sizeof(*desc)`; sets `struct_size`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_transfer_desc_init(desc: *mut kvstage_transfer_desc, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(desc, size, "desc") } })
}

/// Reads a descriptor. The CUDA ready point is captured here, on the caller's thread, so work the
/// caller queues on its stream afterwards is not waited for.
unsafe fn transfer_desc(session: &SenderSession, ptr: *const kvstage_transfer_desc) -> Result<TransferDesc> {
    let raw: kvstage_transfer_desc = unsafe { read_versioned(ptr, "desc") }?;
    let room = room_ref(raw.room, raw.room_key, "desc->room_key")?;
    let pages = unsafe { slice_arg(raw.src_pages, raw.num_pages, "desc->src_pages") }?;
    if pages.is_empty() {
        return Err(Error::invalid_arg("desc->num_pages", "0 (a chunk holds at least one page)"));
    }
    if !raw.cuda_stream.is_null() && !raw.cuda_event.is_null() {
        return Err(Error::invalid_arg("desc->cuda_event", "is set together with desc->cuda_stream (set at most one)"));
    }
    let ready = ReadyFence::capture(session.pool(), raw.cuda_stream as usize, raw.cuda_event as usize)?;
    Ok(TransferDesc {
        room,
        chunk: raw.chunk_index,
        pages: pages.to_vec(),
        src_token_offset: raw.src_token_offset,
        num_tokens: raw.num_tokens,
        trace: match raw.trace_id.is_null() {
            true => None,
            false => Some(unsafe { str_arg(raw.trace_id, "desc->trace_id") }?.to_owned()),
        },
        timeout: timeout(raw.timeout_ms, session.default_timeout()),
        ready: ready.map(Arc::new),
        layers: None,
        parts: unsafe { request_parts(raw.parts, "desc->parts") }?.map(Arc::new),
    })
}

/// `desc->user_tag` when the caller's struct has it, else 0 (the struct was validated by
/// `transfer_desc`, which fails first on a bad one).
unsafe fn user_tag(ptr: *const kvstage_transfer_desc) -> u64 {
    let raw: Option<kvstage_transfer_desc> = unsafe { read_versioned(ptr, "desc") }.ok();
    raw.map_or(0, |d| d.user_tag)
}

enum Path {
    Staged,
    Slices,
}

/// Runs a synchronous transfer (its timings count in the session's stats).
unsafe fn run_sync(session_ptr: *const kvstage_session, desc_ptr: *const kvstage_transfer_desc, path: Path) -> Result<Status> {
    let session = unsafe { handle::session(session_ptr) }?;
    let desc = unsafe { transfer_desc(&session, desc_ptr) }?;
    let op = Op::new(session.waker());
    let (result, _timings) = match path {
        Path::Staged => session.transfer_timed(&desc, &op),
        Path::Slices => session.transfer_slices_timed(&desc, &op),
    };
    result
}

/// The staged path for one chunk, blocking until the receiver acknowledged the data, the
/// deadline, or a failure. Returns `KVSTAGE_OK`, or `KVSTAGE_FALLBACK` (positive) when staging is
/// impossible (the peer has no ring, the chunk is larger than the ring or the send staging limit):
/// nothing was allocated and the caller may use `kvstage_transfer_slices`. Errors leave nothing
/// allocated on either side.
#[no_mangle]
pub unsafe extern "C" fn kvstage_transfer(session: *const kvstage_session, desc: *const kvstage_transfer_desc) -> Status {
    ffi_fn!(status { unsafe { run_sync(session, desc, Path::Staged) } })
}

/// The slice path for the same chunk: one write per token, layer and K/V into the room's decode
/// pages. Same decode bytes as `kvstage_transfer`; the fallback and the benchmark baseline.
#[no_mangle]
pub unsafe extern "C" fn kvstage_transfer_slices(session: *const kvstage_session, desc: *const kvstage_transfer_desc) -> Status {
    ffi_fn!(status { unsafe { run_sync(session, desc, Path::Slices) } })
}

/// Queues the staged path for one chunk on the engine's transfer workers and returns
/// `KVSTAGE_PENDING` with an operation in `*out` (poll, wait, cancel, then free it); its end is
/// signalled on the engine's completion descriptor and callback with `desc->user_tag`. The
/// deadline runs from this call (time spent queued counts). Argument errors return at once.
#[no_mangle]
pub unsafe extern "C" fn kvstage_transfer_async(
    session: *const kvstage_session,
    desc: *const kvstage_transfer_desc,
    out: *mut *mut kvstage_op,
) -> Status {
    ffi_fn!(status {
        let session = unsafe { handle::session(session) }?.clone();
        let tag = unsafe { user_tag(desc) };
        let desc = unsafe { transfer_desc(&session, desc) }?;
        let out = out_arg(out, "out")?;
        let op = session.transfer_async(desc, false, tag)?;
        *out = Handle::into_raw(op)?;
        Ok(Status::KVSTAGE_PENDING)
    })
}

/// Layer-wise sending: as `kvstage_transfer_async` for a chunk whose layers the prefill is still
/// computing. The ring space is requested as soon as a transfer worker takes the operation; each
/// batch of layers marked with `kvstage_op_layers_ready` is gathered and written into its place
/// while later layers are computed, and the operation ends as a whole-chunk transfer does, once
/// every layer it carries went: the pool's layers the session's decode rank holds (with a
/// pipeline split, those of its stage; marks of the pool's other layers are accepted and
/// skipped). Those layers must be marked before `desc->timeout_ms`, or the transfer ends with
/// `KVSTAGE_E_TIMEOUT` and the decode room fails. Marking every layer of the pool is always
/// enough. `desc->cuda_stream` and
/// `desc->cuda_event` must be NULL (`KVSTAGE_E_INVALID_ARG`: each batch names its own ready
/// point). Until its last layer went the transfer holds a transfer worker (a session runs at most
/// half of `transfer_threads` at once; later ones wait queued, their ring space not yet asked
/// for) and a send staging buffer (none on the same-host path with a host pool). Mark layers on
/// the running operations before waiting on queued ones. `KVSTAGE_FALLBACK` as for
/// `kvstage_transfer_async`, without waiting for any layer.
#[no_mangle]
pub unsafe extern "C" fn kvstage_transfer_layerwise_async(
    session: *const kvstage_session,
    desc: *const kvstage_transfer_desc,
    out: *mut *mut kvstage_op,
) -> Status {
    ffi_fn!(status {
        let session = unsafe { handle::session(session) }?.clone();
        // Refused before `transfer_desc` captures a ready point (which needs the CUDA driver).
        let raw: kvstage_transfer_desc = unsafe { read_versioned(desc, "desc") }?;
        for (set, field) in [(!raw.cuda_stream.is_null(), "desc->cuda_stream"), (!raw.cuda_event.is_null(), "desc->cuda_event")] {
            if set {
                return Err(Error::invalid_arg(field, "is set on a layer-wise transfer (kvstage_op_layers_ready takes each batch's ready point)"));
            }
        }
        let tag = unsafe { user_tag(desc) };
        let mut desc = unsafe { transfer_desc(&session, desc) }?;
        desc.layers = Some(session.layer_gate());
        let out = out_arg(out, "out")?;
        let op = session.transfer_async(desc, false, tag)?;
        *out = Handle::into_raw(op)?;
        Ok(Status::KVSTAGE_PENDING)
    })
}

/// Marks the model layers `[first_layer, first_layer + num_layers)` of a layer-wise transfer
/// ready: their KV is valid after the caller's current work on `cuda_stream`, after the recorded
/// `cuda_event`, or (both NULL) now. The point is captured during the call, except that for a
/// host pool a `cuda_event` is itself waited for later: do not re-record or destroy it before the
/// operation ends. NULL is not the legacy default stream here: pass `CU_STREAM_LEGACY` (0x1) for
/// it. Layers are model layer ids of the pool (a pipeline stage marks its own). `KVSTAGE_E_INVALID_ARG` when `op` is not a
/// layer-wise transfer, a layer is not in the pool, or one was marked before (nothing is marked
/// then). Marking after the operation ended is harmless.
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_layers_ready(
    op: *const kvstage_op,
    first_layer: u32,
    num_layers: u32,
    cuda_stream: *mut std::ffi::c_void,
    cuda_event: *mut std::ffi::c_void,
) -> Status {
    ffi_fn!(status {
        let op = unsafe { handle::op(op) }?;
        let gate = op.layers().ok_or_else(|| Error::invalid_arg("op", "is not a layer-wise transfer (kvstage_transfer_layerwise_async)"))?;
        gate.mark_after(first_layer, num_layers, cuda_stream as usize, cuda_event as usize)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// `KVSTAGE_PENDING` while running; then the operation's result (repeatable; errors set the last
/// error each time).
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_poll(op: *const kvstage_op) -> Status {
    ffi_fn!(status { unsafe { handle::op(op) }?.poll() })
}

/// Waits up to `timeout_ms` (0 = the engine default, KVSTAGE_TIMEOUT_INFINITE = until it ends)
/// for the operation's result; `KVSTAGE_PENDING` when it is still running then (look without
/// waiting with `kvstage_op_poll`). The operation's own deadline still bounds it. Not from inside
/// a completion callback (`KVSTAGE_E_UNSUPPORTED`: the wait could need the thread running the
/// callback; `kvstage_op_poll` is fine there).
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_wait(op: *const kvstage_op, timeout_ms: u64) -> Status {
    ffi_fn!(status {
        let op = unsafe { handle::op(op) }?;
        crate::session::notify::refuse_in_callback("kvstage_op_wait")?;
        op.wait(timeout(timeout_ms, op.default_timeout()))
    })
}

/// Asks the operation to stop; it ends with `KVSTAGE_E_CANCELED` unless it already finished.
/// Ring space it held on the receiver is released.
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_cancel(op: *const kvstage_op) -> Status {
    ffi_fn!(status {
        unsafe { handle::op(op) }?.cancel();
        Ok(Status::KVSTAGE_OK)
    })
}

/// Frees an operation handle (a running operation continues to its end; a `kvstage_op_wait` in
/// flight on another thread ends by its own rules). NULL is a no-op. Later calls with the pointer
/// fail with `KVSTAGE_E_INVALID_ARG`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_free(op: *mut kvstage_op) {
    ffi_fn!(value = (), { Handle::free(op, "op") })
}

/// Fills `out` (set `out->struct_size` first) with the phase timings of a finished asynchronous
/// operation and returns `KVSTAGE_OK`; while it runs, returns `KVSTAGE_PENDING` and leaves `out`
/// as it is. The same timings come with the operation's completion (`kvstage_completion.timings`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_timings_get(op: *const kvstage_op, out: *mut kvstage_transfer_timings) -> Status {
    ffi_fn!(status {
        let op = unsafe { handle::op(op) }?;
        let out = out_ptr(out, "out")?;
        match op.timings() {
            None => Ok(Status::KVSTAGE_PENDING),
            Some(t) => {
                unsafe { write_versioned(out, timings_to_c(&t), "out") }?;
                Ok(Status::KVSTAGE_OK)
            }
        }
    })
}

/// Prefill side: an operation as a JSON document, as `kvstage_room_describe`: its session, room
/// and chunk, its phase (`queued` when asynchronous or `starting` when synchronous,
/// `waiting_for_ready_point`, `waiting_for_allocation`, `waiting_for_watermark`,
/// `waiting_for_staging_buffer`, `gathering`, `writing`, `waiting_for_layers`,
/// `waiting_for_acknowledgement`, `done`, `failed`), what the phase waits on, the time in it, the
/// deadline left, its status and error.
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_describe(op: *const kvstage_op, buf: *mut c_char, capacity: usize, needed: *mut usize) -> Status {
    ffi_fn!(status {
        let op = unsafe { handle::op(op) }?;
        let described = describe_op(&op).ok_or_else(|| Error::internal("an operation without progress (it never started)"))?;
        let text = json(&described)?;
        unsafe { write_text(&text, buf, capacity, needed) }
    })
}
