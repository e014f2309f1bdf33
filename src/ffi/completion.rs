//! Completions for an engine's event loop: the eventfd and the callback (the events themselves are
//! polled from the rooms, src/ffi/room.rs).

use std::ffi::c_void;
use std::sync::Arc;

use super::args::out_arg;
use super::ffi_fn;
use super::handle::{self, kvstage_engine};
use super::room::{check_events, kvstage_room_event, trace_c, write_events, KVSTAGE_TRACE_ID_SIZE};
use crate::error::Status;
use crate::session::notify::EventKind;
use crate::session::notify::Completion;
use crate::session::receiver::ChunkEvent;

/// What a completion reports.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_completion_kind {
    /// An asynchronous operation ended: `tag` is its descriptor's `user_tag`, `status` its result
    /// (as `kvstage_op_poll` would return it).
    KVSTAGE_COMPLETION_OP = 1,
    /// A decode chunk was scattered (`status` OK) or failed: `room`, `room_key`, `chunk_index`,
    /// `status` (a `KVSTAGE_ROOM_EVENT_CHUNK` event).
    KVSTAGE_COMPLETION_CHUNK = 2,
    /// A decode room's whole request is in place (`status` OK) or the room failed: `room`,
    /// `room_key`, `status`, `chunk_index` = its chunk count (a `KVSTAGE_ROOM_EVENT_ROOM` event).
    KVSTAGE_COMPLETION_ROOM = 3,
}

/// One completion, as handed to a `kvstage_completion_fn`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_completion {
    pub struct_size: usize,
    /// A `kvstage_completion_kind` value.
    pub kind: i32,
    pub status: Status,
    /// `KVSTAGE_COMPLETION_OP`: the operation's `user_tag`.
    pub tag: u64,
    /// `KVSTAGE_COMPLETION_CHUNK` and `_ROOM`: the decode room, and the chunk (ROOM: the room's
    /// chunk count).
    pub room: u64,
    pub chunk_index: u32,
    /// Appended with the metrics: read only when `struct_size` covers it.
    /// `KVSTAGE_COMPLETION_OP`: the transfer's phase timings (as `kvstage_op_timings_get`).
    pub timings: super::timings::kvstage_transfer_timings,
    /// `KVSTAGE_COMPLETION_CHUNK` with status OK, staged path: nanoseconds from the arrival of the
    /// chunk's last writer to the end of its scatter (see `kvstage_engine_stats.scatter_ns_sum`);
    /// 0 otherwise.
    pub scatter_ns: u64,
    /// `KVSTAGE_COMPLETION_CHUNK` and `_ROOM`: the key of the room's opening (a callback
    /// running after the room was released and its id opened again tells the events apart).
    pub room_key: u64,
    /// The request's trace id, NUL-terminated (see `kvstage_transfer_desc.trace_id`).
    pub trace_id: [std::ffi::c_char; KVSTAGE_TRACE_ID_SIZE],
}

/// Called once per completion, on a library thread (a transfer worker, a receiver connection
/// thread or the scatter thread), with no kvstage lock held. It may call kvstage functions (poll
/// an operation, poll events) but must return quickly (it delays that thread's other work), must
/// not free the engine that calls it, and must not call `kvstage_room_release`,
/// `kvstage_room_wait` or `kvstage_op_wait` (they may wait for work of the very thread running
/// the callback). `completion` is valid during the call only. An operation's callback runs before
/// its end is visible anywhere else: once `kvstage_op_poll` or `kvstage_op_wait` returned its
/// result, or the completion descriptor counted it, its callback has returned; during the callback
/// the operation still polls `KVSTAGE_PENDING` (`completion` carries its status). A room event's
/// callback runs after the event is queued and counted, so a room wait may return before it.
pub type kvstage_completion_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, completion: *const kvstage_completion)>;

/// The caller's pointer, handed back unchanged on the library's threads.
struct UserData(*mut c_void);
// SAFETY: kvstage never dereferences it; thread-safety of what it points to is the caller's
// contract for the callback (documented above).
unsafe impl Send for UserData {}
unsafe impl Sync for UserData {}

impl UserData {
    fn get(&self) -> *mut c_void {
        self.0
    }
}

fn to_c(c: &Completion) -> kvstage_completion {
    let mut out = kvstage_completion {
        struct_size: std::mem::size_of::<kvstage_completion>(),
        kind: kvstage_completion_kind::KVSTAGE_COMPLETION_OP as i32,
        status: Status::KVSTAGE_OK,
        tag: 0,
        room: 0,
        chunk_index: 0,
        timings: super::timings::kvstage_transfer_timings {
            struct_size: std::mem::size_of::<super::timings::kvstage_transfer_timings>(),
            ..Default::default()
        },
        scatter_ns: 0,
        room_key: 0,
        trace_id: [0; KVSTAGE_TRACE_ID_SIZE],
    };
    match c {
        Completion::Op { tag, status, timings, trace } => {
            out.tag = *tag;
            out.status = *status;
            out.timings = super::timings::timings_to_c(timings);
            out.trace_id = trace_c(trace);
        }
        Completion::Chunk(ChunkEvent { kind, room, key, chunk, status, trace, scatter_ns }) => {
            out.trace_id = trace_c(trace);
            out.kind = match kind {
                EventKind::Chunk => kvstage_completion_kind::KVSTAGE_COMPLETION_CHUNK,
                EventKind::Room => kvstage_completion_kind::KVSTAGE_COMPLETION_ROOM,
            } as i32;
            out.room = *room;
            out.room_key = *key;
            out.chunk_index = *chunk;
            out.status = *status;
            out.scatter_ns = *scatter_ns;
        }
    }
    out
}

/// Writes the engine's completion descriptor into `*fd`: it becomes readable whenever an
/// asynchronous operation of the engine ends or a decode room event is queued. Add it to an
/// epoll set or an asyncio loop; when readable, call `kvstage_engine_completions_drain` (or read 8
/// bytes from it), then poll operations and events. Owned by the engine: do not close it; it is
/// valid until `kvstage_engine_free`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_completion_fd(engine: *const kvstage_engine, fd: *mut i32) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        *out_arg(fd, "fd")? = engine.completions().fd();
        Ok(Status::KVSTAGE_OK)
    })
}

/// Resets the completion descriptor (it is not readable again until the next completion) and
/// writes how many completions were signalled since the last reset into `*count` (may be NULL).
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_completions_drain(engine: *const kvstage_engine, count: *mut u64) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let n = engine.completions().drain();
        if !count.is_null() {
            *out_arg(count, "count")? = n;
        }
        Ok(Status::KVSTAGE_OK)
    })
}

/// Sets (or with NULL removes) the engine's completion callback; see `kvstage_completion_fn` for
/// the thread it runs on and what it may do. Completions keep being signalled on the descriptor.
/// Returns only once no call of the previous callback is running (none starts afterwards), so its
/// code and `user_data` may be freed then; do not hold a lock the callback takes while calling it.
/// Called from inside a completion callback (of any engine) it does not wait (callbacks replacing
/// each other's would wait for each other for ever): the previous callback may still be running
/// on other threads then, and its caller goes on after this returns.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_set_completion_callback(
    engine: *const kvstage_engine,
    callback: kvstage_completion_fn,
    user_data: *mut c_void,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        let cb = callback.map(|f| {
            let data = UserData(user_data);
            Arc::new(move |c: &Completion| {
                let out = to_c(c);
                // SAFETY: the caller's function with its own pointer; `out` lives for the call.
                unsafe { f(data.get(), &out) }
            }) as crate::session::notify::Callback
        });
        engine.completions().set_callback(cb);
        Ok(Status::KVSTAGE_OK)
    })
}

/// Decode side: moves up to `capacity` events of every room into `events` (oldest first; set
/// `events[0].struct_size` first) and their number into `*count` (0 when none). Non-blocking.
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_poll_events(
    engine: *const kvstage_engine,
    events: *mut kvstage_room_event,
    capacity: usize,
    count: *mut usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { handle::engine(engine) }?;
        out_arg(count, "count")?;
        unsafe { check_events(events, capacity) }?;
        let taken = engine.receiver().take_events(None, capacity);
        unsafe { write_events(&taken, events, capacity, count) }
    })
}
