//! The decode side's rooms: one opening per request (its pages, grid, parts and key), its wait,
//! release, describe document and events (docs/ARCHITECTURE.md, "Rooms and keys").

use std::ffi::c_char;

use super::args::{checked_output, init_versioned, json, out_arg, out_ptr, read_versioned, slice_arg, str_arg, timeout, versioned, write_text, write_versioned, write_versioned_array};
use super::ffi_fn;
use super::handle::{self, kvstage_engine};
use super::parts::{kvstage_request_parts, request_parts};
use crate::error::{Error, Result, Status};
use crate::protocol::RoomRef;
use crate::session::notify::{ChunkEvent, EventKind};
use crate::session::receiver::RoomOpening;
use crate::session::sender::RoomGrid;

/// A request to receive (`kvstage_room_open`). Fill with `kvstage_room_desc_init`, then set the
/// fields.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_room_desc {
    pub struct_size: usize,
    /// The room id: the engine's own request id as a number, unique among the rooms open on
    /// this engine (an id may be opened again once released; each opening gets a new key).
    pub room: u64,
    /// The decode pool pages that receive the request's new tokens (after the cached prefix), in
    /// token order.
    pub pages: *const u32,
    pub num_pages: usize,
    /// Tokens per chunk (0: the engine's `chunk_tokens`); rounded down to whole pages.
    pub chunk_tokens: u32,
    /// The request's parts besides the KV on this rank (its metadata row, state slots, extra
    /// pools' pages), or NULL for KV only. They travel with the room's last chunk; the room
    /// completes only once its KV, pools and state are in place and then its aux rows are written.
    pub parts: *const kvstage_request_parts,
    /// Tokens of the request this decode rank already holds (a prefix cache hit), in front of
    /// `pages`: whole decode pages (`KVSTAGE_E_INVALID_ARG` naming both values otherwise). Only
    /// reported to the senders in the grid (`prefix_tokens`), from which they compute their spans.
    pub prefix_tokens: u64,
    /// The request's trace id, NUL-terminated (copied; the rules of `kvstage_transfer_desc.trace_id`),
    /// or NULL: the first id a writer names, else one derived from the opening
    /// (`<room>#<4 hex digits>`).
    pub trace_id: *const c_char,
}

impl Default for kvstage_room_desc {
    fn default() -> Self {
        kvstage_room_desc {
            struct_size: std::mem::size_of::<Self>(),
            room: 0,
            pages: std::ptr::null(),
            num_pages: 0,
            chunk_tokens: 0,
            parts: std::ptr::null(),
            prefix_tokens: 0,
            trace_id: std::ptr::null(),
        }
    }
}

versioned!(kvstage_room_desc, trace_id: *const c_char);

/// Fills `desc` with defaults (`size`: the caller's `sizeof(*desc)`): no pages, the engine's
/// chunk tokens, no parts, no prefix, a derived trace id.
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_desc_init(desc: *mut kvstage_room_desc, size: usize) -> Status {
    ffi_fn!(status { unsafe { init_versioned(desc, size, "desc") } })
}

/// A room opening's chunk grid: what `kvstage_room_open` answers on the decode side and
/// `kvstage_session_room_grid_get` on the prefill side (set `struct_size` first). Chunk `k` of a
/// transfer carries the tokens `[k · chunk_tokens, min((k + 1) · chunk_tokens, num_pages ·
/// page_size))` of the room's pages (the last chunk may end earlier, where the request ends).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstage_room_grid {
    pub struct_size: usize,
    /// This opening's key: a fresh, unguessable nonzero value each time an id is opened. The
    /// senders name it (`kvstage_transfer_desc.room_key`); so does every room call.
    pub key: u64,
    /// Tokens of every chunk but possibly the last (the desc's `chunk_tokens` in whole pages).
    pub chunk_tokens: u32,
    /// Chunks of the room: `chunk_index` of a transfer is below this.
    pub num_chunks: u32,
    /// Pages of the room.
    pub num_pages: u32,
    /// Token slots per decode page.
    pub page_size: u32,
    /// Tokens the decode rank already held (the desc's `prefix_tokens`).
    pub prefix_tokens: u64,
}

versioned!(kvstage_room_grid, prefix_tokens: u64);

impl kvstage_room_grid {
    pub(crate) fn from_grid(key: u64, g: &RoomGrid) -> kvstage_room_grid {
        kvstage_room_grid {
            struct_size: std::mem::size_of::<kvstage_room_grid>(),
            key,
            chunk_tokens: g.chunk_tokens,
            num_chunks: g.num_chunks,
            num_pages: g.num_pages,
            page_size: g.page_size,
            prefix_tokens: g.prefix_tokens,
        }
    }
}

/// A room opening as the calls name it; key 0 is never handed out (a caller that did not pass
/// the key on).
pub(crate) fn room_ref(room: u64, key: u64, field: &str) -> Result<RoomRef> {
    if key == 0 {
        return Err(Error::invalid_arg(
            field,
            format!("is 0 for room {room}: pass the key kvstage_room_open returned for this opening of the room (the prefill side gets it with the room id through the engine's bootstrap)"),
        ));
    }
    Ok(RoomRef { id: room, key })
}

/// Decode side: opens the room `desc` describes and fills `*out` with its grid (`key`,
/// `num_chunks`, `chunk_tokens`, `num_pages`, `page_size`, `prefix_tokens`). Send the room id and
/// `out->key` to the prefill ranks (in the engine's own bootstrap message); their transfers name
/// the key, and a transfer naming another opening (a request this id was opened for before) is
/// refused with `KVSTAGE_E_STALE_ROOM`, writing nothing. Errors: `KVSTAGE_E_INVALID_ARG` naming
/// the field (pages outside the pool, parts outside their components, an id open or still
/// being released), `KVSTAGE_E_CANCELED` after a shutdown. `*out` is written only on success.
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_open(engine: *const kvstage_engine, desc: *const kvstage_room_desc, out: *mut kvstage_room_grid) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let raw: kvstage_room_desc = unsafe { read_versioned(desc, "desc") }?;
        // Checked before the room opens: an opening whose key the caller never got could not be
        // released.
        let out = unsafe { checked_output(out, "out") }?;
        let opening = RoomOpening {
            room: raw.room,
            pages: unsafe { slice_arg(raw.pages, raw.num_pages, "desc->pages") }?.to_vec(),
            chunk_tokens: raw.chunk_tokens,
            parts: unsafe { request_parts(raw.parts, "desc->parts") }?,
            prefix_tokens: raw.prefix_tokens,
            trace: match raw.trace_id.is_null() {
                true => None,
                false => Some(unsafe { str_arg(raw.trace_id, "desc->trace_id") }?.to_owned()),
            },
        };
        let (key, grid) = engine.receiver().open_room(opening)?;
        unsafe { write_versioned(out, kvstage_room_grid::from_grid(key, &grid), "out") }?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Decode side: waits until the whole request of the opening (`room`, `key`) is in place — every
/// chunk scattered and its parts written (`KVSTAGE_OK`) —, the room failed (its error: peer gone,
/// canceled, timeout, ...), or `timeout_ms` passed (`KVSTAGE_E_TIMEOUT`, naming the chunks not
/// done and the prefill ranks that have not written them; 0 = the engine default,
/// KVSTAGE_TIMEOUT_INFINITE = none). An opening that is not open (released, or never this key) is
/// `KVSTAGE_E_STALE_ROOM`; released while waiting, `KVSTAGE_E_CANCELED`. Not from inside a
/// completion callback (`KVSTAGE_E_UNSUPPORTED`: the wait could need the thread running the
/// callback; poll the events there).
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_wait(engine: *const kvstage_engine, room: u64, key: u64, timeout_ms: u64) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let at = room_ref(room, key, "key")?;
        crate::session::notify::refuse_in_callback("kvstage_room_wait")?;
        engine.receiver().wait_room(at, timeout(timeout_ms, engine.default_timeout()))
    })
}

/// Decode side: releases the opening (`room`, `key`) — on completion, abort or failure — and
/// frees every ring allocation it still holds; late data for it is discarded. An opening that is
/// not open any more (released before: an error path and a cleanup both releasing) is
/// `KVSTAGE_OK` and touches nothing, so a second release can never release the next request the
/// id was opened for. It returns once nothing will write the room's pages: a payload read or
/// same-host copy into them gets 0.5 s, then its connection is cut and the release waits for it
/// to end. A writer that cannot end (a same-host prefill process stopped mid-copy) holds them:
/// after the engine's `default_timeout_ms` the release fails with `KVSTAGE_E_TIMEOUT` naming
/// its connections; the room is released, but its pages and id are not free yet (call again to
/// wait more). Not from inside a completion callback (`KVSTAGE_E_UNSUPPORTED`: the release may
/// wait for the thread running the callback).
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_release(engine: *const kvstage_engine, room: u64, key: u64) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let at = room_ref(room, key, "key")?;
        crate::session::notify::refuse_in_callback("kvstage_room_release")?;
        engine.receiver().release_room(at, engine.default_timeout())?;
        Ok(Status::KVSTAGE_OK)
    })
}

/// Decode side: the opening (`room`, `key`) as a JSON document (NUL-terminated) in `buf`: its
/// state, failure, and per chunk its phase (`not_started`, `waiting_for_watermark` with the older
/// allocation it waits behind, `granted`, `writing`, `waiting_for_writers`, `scattering`, `done`,
/// `failed`), its ring allocation, each writer's session, prefill rank and bytes landed, and the
/// writers still missing (`missing_writers`: the prefill tp/pp rank of every slab no writer
/// claimed). `*needed` (may be NULL) receives its size with the NUL; `buf` NULL with `capacity` 0
/// is a size query. The document changes as the room moves: query and fill in a loop until the
/// fill succeeds. `KVSTAGE_E_STALE_ROOM` when that opening is not open.
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_describe(
    engine: *const kvstage_engine,
    room: u64,
    key: u64,
    buf: *mut c_char,
    capacity: usize,
    needed: *mut usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let at = room_ref(room, key, "key")?;
        let text = json(&engine.receiver().describe_room(at)?)?;
        unsafe { write_text(&text, buf, capacity, needed) }
    })
}

/// What a room event reports (`kvstage_room_event.kind`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_room_event_kind {
    /// One chunk reached the decode KV pool (status `KVSTAGE_OK`) or failed.
    KVSTAGE_ROOM_EVENT_CHUNK = 1,
    /// The whole request: every chunk and part in place (`KVSTAGE_OK`, after the last chunk's
    /// event), or the room failed (its error, after the failed chunks' events). One per opening.
    KVSTAGE_ROOM_EVENT_ROOM = 2,
}

/// A decode room's event. Polled into an array whose element 0 carries the caller's
/// `struct_size` (`sizeof(kvstage_room_event)`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_room_event {
    pub struct_size: usize,
    /// A `kvstage_room_event_kind` value.
    pub kind: i32,
    pub status: Status,
    pub room: u64,
    /// The key of the room's opening the event belongs to.
    pub room_key: u64,
    /// CHUNK: the chunk; ROOM: the room's chunk count.
    pub chunk_index: u32,
    /// CHUNK with status OK, staged path: nanoseconds from the arrival of the chunk's last writer
    /// to the end of its scatter; 0 otherwise.
    pub scatter_ns: u64,
    /// The request's trace id, NUL-terminated (see `kvstage_transfer_desc.trace_id`).
    pub trace_id: [c_char; KVSTAGE_TRACE_ID_SIZE],
}

/// Bytes of a trace id field: the longest trace id (64 bytes) and its NUL.
pub const KVSTAGE_TRACE_ID_SIZE: usize = 65;

/// `trace` as a NUL-terminated fixed array (trace ids are checked to fit; a longer one is cut).
pub(crate) fn trace_c(trace: &str) -> [c_char; KVSTAGE_TRACE_ID_SIZE] {
    let mut out = [0; KVSTAGE_TRACE_ID_SIZE];
    for (o, b) in out.iter_mut().zip(trace.bytes().take(KVSTAGE_TRACE_ID_SIZE - 1)) {
        *o = b as c_char;
    }
    out
}

pub(crate) fn event_to_c(e: &ChunkEvent) -> kvstage_room_event {
    kvstage_room_event {
        struct_size: std::mem::size_of::<kvstage_room_event>(),
        kind: match e.kind {
            EventKind::Chunk => kvstage_room_event_kind::KVSTAGE_ROOM_EVENT_CHUNK,
            EventKind::Room => kvstage_room_event_kind::KVSTAGE_ROOM_EVENT_ROOM,
        } as i32,
        status: e.status,
        room: e.room,
        room_key: e.key,
        chunk_index: e.chunk,
        scatter_ns: e.scatter_ns,
        trace_id: trace_c(&e.trace),
    }
}

/// Moves up to `capacity` events into `events` (element 0's `struct_size` set by the caller);
/// `*count` receives how many.
pub(super) unsafe fn write_events(taken: &[ChunkEvent], events: *mut kvstage_room_event, capacity: usize, count: *mut usize) -> Result<Status> {
    let count = out_arg(count, "count")?;
    let items: Vec<kvstage_room_event> = taken.iter().map(event_to_c).collect();
    *count = items.len();
    unsafe { write_versioned_array(&items, events, capacity, std::ptr::null_mut(), "events") }
}

/// Checks an event array before events are taken from the queue (a bad array loses none).
pub(super) unsafe fn check_events(events: *mut kvstage_room_event, capacity: usize) -> Result<()> {
    if capacity > 0 {
        let first = out_ptr(events, "events")?;
        let size = unsafe { std::ptr::read_unaligned(first as *const usize) };
        if size < std::mem::size_of::<usize>() || size > (1 << 20) {
            return Err(Error::invalid_arg("events[0].struct_size", format!("{size} is not a valid size (set it to sizeof(kvstage_room_event), {} here)", std::mem::size_of::<kvstage_room_event>())));
        }
    }
    Ok(())
}

/// Decode side: as `kvstage_engine_poll_events` for the opening (`room`, `key`) only; events of
/// other rooms stay queued. Non-blocking. `KVSTAGE_E_STALE_ROOM` when that opening is not open
/// (a release drops the events of its opening not yet polled).
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_poll_events(
    engine: *const kvstage_engine,
    room: u64,
    key: u64,
    events: *mut kvstage_room_event,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let at = room_ref(room, key, "key")?;
        out_arg(count, "count")?;
        unsafe { check_events(events, capacity) }?;
        if !engine.receiver().is_open(at) {
            return Err(crate::session::receiver::state::not_open(room));
        }
        let taken = engine.receiver().take_events(Some(at), capacity);
        unsafe { write_events(&taken, events, capacity, count) }
    })
}
