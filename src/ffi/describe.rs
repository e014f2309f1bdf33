//! Where is this request: JSON documents for operators (schema in README "Troubleshooting"),
//! written with the string-output convention `(buf, capacity, needed)`.

use std::ffi::c_char;

use super::engine::{borrow, kvstage_engine};
use super::transfer::kvstage_op;
use super::{ffi_fn, write_text};
use crate::error::{Error, Result, Status};
use crate::session::sender::describe::describe_op;

fn json(value: &impl serde::Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::internal("the describe document does not serialize").with_source(e))
}

/// Decode side: room `room` as a JSON document (NUL-terminated) in `buf`: its state, failure,
/// and per chunk its phase (`not_started`, `waiting_for_watermark` with the older allocation it
/// waits behind, `granted`, `writing`, `waiting_for_writers`, `scattering`, `done`, `failed`), its
/// ring allocation, each writer's session, prefill rank and bytes landed, the slabs no writer
/// claimed. `*needed` (may be NULL) receives its size with the NUL; `buf` NULL with `capacity` 0
/// is a size query. The document changes as the room moves: query and fill in a loop until the
/// fill succeeds. `KVSTAGE_E_INVALID_ARG` when no room of that id is open.
#[no_mangle]
pub unsafe extern "C" fn kvstage_room_describe(
    engine: *const kvstage_engine,
    room: u64,
    buf: *mut c_char,
    capacity: usize,
    needed: *mut usize,
) -> Status {
    ffi_fn!(status {
        let engine = unsafe { borrow(engine, "engine") }?;
        let text = json(&engine.receiver().describe_room(room)?)?;
        unsafe { write_text(&text, buf, capacity, needed) }
    })
}

/// The whole engine as a JSON document, as `kvstage_room_describe`: its transport, the decode
/// side's staging ring (live allocations oldest first, with their rooms and chunks), accepted
/// connections and rooms (state and chunks done), and the sessions it opened (transport, bytes
/// sent, the chunks running, why one is dead).
#[no_mangle]
pub unsafe extern "C" fn kvstage_engine_describe(engine: *const kvstage_engine, buf: *mut c_char, capacity: usize, needed: *mut usize) -> Status {
    ffi_fn!(status {
        let engine = unsafe { borrow(engine, "engine") }?;
        let text = json(&engine.describe())?;
        unsafe { write_text(&text, buf, capacity, needed) }
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
        let op = unsafe { super::transfer::op(op) }?;
        let described = describe_op(&op).ok_or_else(|| Error::internal("an operation without progress (it never started)"))?;
        let text = json(&described)?;
        unsafe { write_text(&text, buf, capacity, needed) }
    })
}
