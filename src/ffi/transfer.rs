//! Sessions, transfers, operations and rooms.

use std::ffi::c_char;
use std::sync::Arc;
use std::time::Duration;

use super::engine::{borrow as borrow_engine, kvstage_engine, KVSTAGE_DEADLINE_INFINITE};
use super::{ffi_fn, out_arg, slice_arg, str_arg, versioned_struct, Borrowed, Handle};
use crate::copy::ReadyFence;
use crate::error::{Error, Result, Status};
use crate::session::op::Op;
use crate::protocol::RoomRef;
use crate::session::sender::{RoomGrid, SenderSession, TransferDesc};

/// A sender session: one (prefill rank → decode rank) peering. Thread-safe; transfers on one
/// session may run concurrently.
pub struct kvstage_session {
    _private: [u8; 0],
}

/// An asynchronous operation started by `kvstage_transfer_async`.
pub struct kvstage_op {
    _private: [u8; 0],
}

pub(crate) unsafe fn session(ptr: *const kvstage_session) -> Result<Borrowed<Arc<SenderSession>>> {
    Handle::borrow(ptr, "session")
}

pub(crate) unsafe fn op(ptr: *const kvstage_op) -> Result<Borrowed<Arc<Op>>> {
    Handle::borrow(ptr, "op")
}

/// A room's chunk grid on the decode side (`kvstage_session_room_grid`). Set `struct_size` first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstage_room_grid {
    pub struct_size: usize,
    /// Tokens of every chunk but possibly the last (the `chunk_tokens` of `kvstage_room_open`
    /// rounded to whole pages).
    pub chunk_tokens: u32,
    /// Chunks of the room: `chunk_index` of a transfer is below this.
    pub num_chunks: u32,
    /// Pages of the room.
    pub num_pages: u32,
}

/// Asks the decode rank of `session` for the chunk grid of `room` (open there): chunk `k` of a
/// transfer must carry the tokens `[k · chunk_tokens, min((k + 1) · chunk_tokens, num_pages ·
/// page_size))` of the room (the last chunk may end earlier, inside its last decode page, where the
/// request ends), so a prefill engine can cut its transfers on the decode side's grid instead of
/// guessing it. `room_key`: the key `kvstage_room_open` returned for this opening of
/// the room. One round trip; `timeout_ms` 0 = the engine default. Errors: the room is not open
/// there under that key (`KVSTAGE_E_STALE_ROOM`: released, or another opening), it failed there
/// (its error), the session is gone, the timeout passed. Fills `*out` only on success.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_room_grid(
    session: *const kvstage_session,
    room: u64,
    room_key: u64,
    timeout_ms: u64,
    out: *mut kvstage_room_grid,
) -> Status {
    ffi_fn!(status {
        let session = unsafe { self::session(session) }?;
        let out = super::out_ptr(out, "out")?;
        let room = room_ref(room, room_key, "room_key")?;
        let timeout = timeout_from_ms(timeout_ms).unwrap_or(session.default_timeout());
        let RoomGrid { chunk_tokens, num_chunks, num_pages } = session.room_grid(room, timeout)?;
        let grid = kvstage_room_grid { struct_size: std::mem::size_of::<kvstage_room_grid>(), chunk_tokens, num_chunks, num_pages };
        unsafe { super::write_versioned(out, grid, "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// A room as a sender names it; key 0 is never handed out (a caller that did not pass the key on).
fn room_ref(room: u64, key: u64, field: &str) -> Result<RoomRef> {
    if key == 0 {
        return Err(Error::invalid_arg(
            field,
            format!("is 0 for room {room}: pass the key kvstage_room_open returned on the decode side for this opening of the room (send it with the room id through your bootstrap)"),
        ));
    }
    Ok(RoomRef { id: room, key })
}

/// Milliseconds → timeout: 0 = the engine default, `KVSTAGE_DEADLINE_INFINITE` = none.
fn timeout_from_ms(ms: u64) -> Option<Option<Duration>> {
    match ms {
        0 => None,
        KVSTAGE_DEADLINE_INFINITE => Some(None),
        ms => Some(Some(Duration::from_millis(ms))),
    }
}

/// Connects to the decode engine at `peer_address` ("127.0.0.1:5000") and runs the handshake
/// (versions, geometry fingerprints, pairing). A geometry disagreement fails with
/// `KVSTAGE_E_GEOMETRY_MISMATCH`, every differing field listed in the error's causes.
/// `timeout_ms` 0 = engine default; a receiver at its connection limits is asked again, backing
/// off, until then. Writes `*out` only on success.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_connect(
    engine: *const kvstage_engine,
    peer_address: *const c_char,
    session_id: *const c_char,
    timeout_ms: u64,
    out: *mut *mut kvstage_session,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { borrow_engine(engine, "engine") }?;
        let addr = unsafe { str_arg(peer_address, "peer_address") }?;
        let id = unsafe { str_arg(session_id, "session_id") }?;
        let out = out_arg(out, "out")?;
        let timeout = engine.timeout(timeout_from_ms(timeout_ms));
        let session = engine.connect(addr, id, timeout)?;
        *out = Handle::into_raw(session)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Closes a session. Operations still running, and calls in flight on other threads, keep it
/// alive until they end; this returns at once. NULL is a no-op. Later calls with the pointer fail
/// with `KVSTAGE_E_INVALID_ARG`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_session_free(session: *mut kvstage_session) {
    ffi_fn!(value = (), { Handle::free(session, "session") })
}

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
    /// Deadline in milliseconds: 0 = engine default, KVSTAGE_DEADLINE_INFINITE = none.
    pub deadline_ms: u64,
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
    /// parts (`kvstage_room_open_parts`). Staged whole-chunk transfers only.
    pub parts: *const super::parts::kvstage_request_parts,
}

impl Default for kvstage_transfer_desc {
    fn default() -> Self {
        kvstage_transfer_desc {
            struct_size: std::mem::size_of::<Self>(),
            room: 0,
            chunk_index: 0,
            src_pages: std::ptr::null(),
            num_pages: 0,
            deadline_ms: 0,
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

/// Fills `desc` with defaults (sets `struct_size`).
#[no_mangle]
pub unsafe extern "C" fn kvstage_transfer_desc_init(desc: *mut kvstage_transfer_desc) -> Status {
    ffi_fn!(status {
        *out_arg(desc, "desc")? = kvstage_transfer_desc::default();
        Ok(Status::KVSTAGE_OK)
    })
}

/// Size of the first version of `kvstage_transfer_desc` (before the CUDA ready point).
const TRANSFER_DESC_V1: usize = std::mem::offset_of!(kvstage_transfer_desc, cuda_stream);
/// Size of the first version with `room_key`, which every transfer needs.
const TRANSFER_DESC_KEYED: usize = std::mem::offset_of!(kvstage_transfer_desc, room_key) + std::mem::size_of::<u64>();

/// Reads a descriptor. The CUDA ready point is captured here, on the caller's thread, so work the
/// caller queues on its stream afterwards is not waited for.
unsafe fn transfer_desc(session: &SenderSession, ptr: *const kvstage_transfer_desc) -> Result<TransferDesc> {
    let engine_default = session.default_timeout();
    let raw: kvstage_transfer_desc = unsafe { versioned_struct(ptr, "desc", TRANSFER_DESC_V1) }?;
    if raw.struct_size < TRANSFER_DESC_KEYED {
        return Err(Error::invalid_arg(
            "desc->struct_size",
            format!("{} predates `room_key` ({TRANSFER_DESC_KEYED} bytes and up): rebuild against this kvstage.h and set desc->room_key", raw.struct_size),
        ));
    }
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
        timeout: timeout_from_ms(raw.deadline_ms).unwrap_or(engine_default),
        ready: ready.map(Arc::new),
        layers: None,
        parts: unsafe { super::parts::request_parts(raw.parts, "desc->parts") }?.map(Arc::new),
    })
}

/// `desc->user_tag` when the caller's struct has it, else 0 (the struct was validated by
/// `transfer_desc`, which fails first on a bad one).
unsafe fn user_tag(ptr: *const kvstage_transfer_desc) -> u64 {
    let raw: Option<kvstage_transfer_desc> = unsafe { versioned_struct(ptr, "desc", TRANSFER_DESC_V1) }.ok();
    raw.map_or(0, |d| d.user_tag)
}

enum Path {
    Staged,
    Slices,
}

/// Runs a synchronous transfer; its phase timings become this thread's
/// `kvstage_transfer_timings_last` (zeros when it did not start).
unsafe fn run_sync(session_ptr: *const kvstage_session, desc_ptr: *const kvstage_transfer_desc, path: Path) -> Result<Status> {
    super::stats::set_last(crate::session::stats::TransferTimings::ZERO);
    let session = unsafe { session(session_ptr) }?;
    let desc = unsafe { transfer_desc(&session, desc_ptr) }?;
    let op = Op::new(session.waker());
    let (result, timings) = match path {
        Path::Staged => session.transfer_timed(&desc, &op),
        Path::Slices => session.transfer_slices_timed(&desc, &op),
    };
    super::stats::set_last(timings);
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
        let session = unsafe { self::session(session) }?.clone();
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
/// skipped). Those layers must be marked before `desc->deadline_ms`, or the transfer ends with
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
        let session = unsafe { self::session(session) }?.clone();
        // Refused before `transfer_desc` captures a ready point (which needs the CUDA driver).
        let raw: kvstage_transfer_desc = unsafe { versioned_struct(desc, "desc", TRANSFER_DESC_V1) }?;
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
        let op = unsafe { self::op(op) }?;
        let gate = op.layers().ok_or_else(|| Error::invalid_arg("op", "is not a layer-wise transfer (kvstage_transfer_layerwise_async)"))?;
        gate.mark_after(first_layer, num_layers, cuda_stream as usize, cuda_event as usize)?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// `KVSTAGE_PENDING` while running; then the operation's result (repeatable; errors set the last
/// error each time).
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_poll(op: *const kvstage_op) -> Status {
    ffi_fn!(status { unsafe { self::op(op) }?.poll() })
}

/// Waits up to `timeout_ms` (KVSTAGE_DEADLINE_INFINITE = until it ends); `KVSTAGE_PENDING` when it
/// is still running then. The operation's own deadline still bounds it. From inside a completion
/// callback only `timeout_ms` 0 is allowed (`KVSTAGE_E_UNSUPPORTED`: the wait could need the
/// thread running the callback).
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_wait(op: *const kvstage_op, timeout_ms: u64) -> Status {
    ffi_fn!(status {
        let op = unsafe { self::op(op) }?;
        if timeout_ms != 0 {
            crate::session::notify::refuse_in_callback("kvstage_op_wait")?;
        }
        let timeout = if timeout_ms == KVSTAGE_DEADLINE_INFINITE { None } else { Some(Duration::from_millis(timeout_ms)) };
        op.wait(timeout)
    })
}

/// Asks the operation to stop; it ends with `KVSTAGE_E_CANCELED` unless it already finished.
/// Ring space it held on the receiver is released.
#[no_mangle]
pub unsafe extern "C" fn kvstage_op_cancel(op: *const kvstage_op) -> Status {
    ffi_fn!(status {
        unsafe { self::op(op) }?.cancel();
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

/// Decode side: opens room `room` whose new tokens land in `dst_pages` (the pages after the
/// decode-side cached prefix, in token order), cut into chunks of `chunk_tokens` tokens (0 =
/// engine default; rounded down to whole pages). `*num_chunks_out` (may be NULL) receives the
/// number of chunks the senders must deliver; `*room_key_out` (required) this opening's key: a
/// fresh, unguessable nonzero value each time the id is opened. Send it to the prefill ranks with
/// the room id and the pages (in the engine's own bootstrap message); their transfers name it in
/// `kvstage_transfer_desc.room_key`, and a transfer naming another opening (a request this id was
/// opened for before) is refused with `KVSTAGE_E_STALE_ROOM`, writing nothing.
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_open(
    engine: *const kvstage_engine,
    room: u64,
    dst_pages: *const u32,
    num_pages: usize,
    chunk_tokens: u32,
    num_chunks_out: *mut u32,
    room_key_out: *mut u64,
) -> Status {
    ffi_fn!(status { unsafe { open_room(engine, room, (dst_pages, num_pages), chunk_tokens, std::ptr::null(), num_chunks_out, room_key_out) } })
}

/// `kvstage_room_open` and `kvstage_room_open_parts`.
pub(super) unsafe fn open_room(
    engine: *const kvstage_engine,
    room: u64,
    (dst_pages, num_pages): (*const u32, usize),
    chunk_tokens: u32,
    parts: *const super::parts::kvstage_request_parts,
    num_chunks_out: *mut u32,
    room_key_out: *mut u64,
) -> Result<Status> {
    let engine = unsafe { borrow_engine(engine, "engine") }?;
    let pages = unsafe { slice_arg(dst_pages, num_pages, "dst_pages") }?;
    let key_out = out_arg(room_key_out, "room_key_out")?;
    let parts = unsafe { super::parts::request_parts(parts, "parts") }?;
    let (n, key) = engine.receiver().open_room_parts(room, pages, chunk_tokens, parts)?;
    *key_out = key;
    if let Some(out) = unsafe { num_chunks_out.as_mut() } {
        *out = n;
    }
    Ok(Status::KVSTAGE_OK)
}

/// Decode side: waits until every chunk of the room is in the KV pool (`KVSTAGE_OK`), the room
/// failed (its error: peer gone, canceled, ...) or `timeout_ms` passed (`KVSTAGE_E_TIMEOUT`;
/// 0 = engine default, KVSTAGE_DEADLINE_INFINITE = none). The wait is bound to the room's opening
/// open when it starts: released meanwhile (and maybe opened again for another request), it ends
/// with `KVSTAGE_E_CANCELED`. Not from inside a completion callback (`KVSTAGE_E_UNSUPPORTED`: the
/// wait could need the thread running the callback; poll the engine's events there).
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_wait(engine: *const kvstage_engine, room: u64, timeout_ms: u64) -> Status {
    ffi_fn!(status {
        let engine = unsafe { borrow_engine(engine, "engine") }?;
        crate::session::notify::refuse_in_callback("kvstage_room_wait")?;
        engine.receiver().wait_room(room, engine.timeout(timeout_from_ms(timeout_ms)))
    })
}

/// Decode side: forgets the room and frees every ring allocation it still holds (on completion,
/// abort or failure). Idempotent until the id is opened again: it releases whatever opening is
/// open under the id, so release each request's room once (a late second release after the id
/// was reopened releases the next request's room). Late data for it is discarded. It returns once
/// nothing will write the room's pages: a payload read or same-host copy into them gets 0.5 s,
/// then its connection is cut and the release waits for it to end. A writer that cannot end (a
/// same-host prefill process stopped mid-copy) holds them: after the engine's
/// `default_deadline_ms` the release fails with `KVSTAGE_E_TIMEOUT` naming its connections; the
/// room is released, but its pages and id are not free yet (call again to wait more). Not from
/// inside a completion callback (`KVSTAGE_E_UNSUPPORTED`: the release may wait for the thread
/// running the callback); release the room from another thread.
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_release(engine: *const kvstage_engine, room: u64) -> Status {
    ffi_fn!(status {
        let engine = unsafe { borrow_engine(engine, "engine") }?;
        crate::session::notify::refuse_in_callback("kvstage_room_release")?;
        engine.receiver().release_room(room, engine.timeout(None))?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// A chunk that reached the decode KV pool (status `KVSTAGE_OK`) or failed.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_chunk_event {
    pub room: u64,
    pub chunk_index: u32,
    pub status: Status,
    /// The key of the room's opening the chunk belongs to (`kvstage_room_open`'s `room_key_out`).
    pub room_key: u64,
    /// The request's trace id, NUL-terminated (see `kvstage_transfer_desc.trace_id`).
    pub trace_id: [std::ffi::c_char; KVSTAGE_TRACE_ID_SIZE],
}

/// Bytes of a trace id field: the longest trace id (64 bytes) and its NUL.
pub const KVSTAGE_TRACE_ID_SIZE: usize = 65;

/// `trace` as a NUL-terminated fixed array (trace ids are checked to fit; a longer one is cut).
pub(crate) fn trace_c(trace: &str) -> [std::ffi::c_char; KVSTAGE_TRACE_ID_SIZE] {
    let mut out = [0; KVSTAGE_TRACE_ID_SIZE];
    for (o, b) in out.iter_mut().zip(trace.bytes().take(KVSTAGE_TRACE_ID_SIZE - 1)) {
        *o = b as std::ffi::c_char;
    }
    out
}

/// Decode side: moves up to `capacity` chunk events into `events` and their number into
/// `*count` (0 when none). Non-blocking.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_poll_events(
    engine: *const kvstage_engine,
    events: *mut kvstage_chunk_event,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { borrow_engine(engine, "engine") }?;
        let count = out_arg(count, "count")?;
        if capacity > 0 && events.is_null() {
            return Err(Error::invalid_arg("events", format!("is NULL with capacity {capacity}")));
        }
        let taken = engine.receiver().take_events(capacity);
        super::completion::write_events(&taken, events, capacity, count)?;
        Ok(Status::KVSTAGE_OK)
    })
}
