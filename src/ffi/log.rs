//! Log records for the embedding engine's own logger: the levels, the record and the callback.

use std::ffi::{c_char, c_void, CString};

use super::ffi_fn;
use crate::engine::logging::{self, Line, Sink};
use crate::error::{Error, Status};

/// Severity of a log record, and the most verbose level a sink receives (each level includes the
/// ones above it). Passed as a plain int.
///
/// Without a callback, records go to stderr at the level of the environment variable
/// `KVSTAGE_LOG` (`off`, `error`, `warn`, `info`, `debug` or `trace`; default `warn`), read once
/// when the first engine is created or a callback is set.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvstage_log_level {
    /// As `max_level`: no records at all.
    KVSTAGE_LOG_OFF = 0,
    /// Something failed that an operator must look at (RDMA queue pair errors, caught panics,
    /// rooms failed by a CUDA, RDMA or internal error).
    KVSTAGE_LOG_ERROR = 1,
    /// Something failed or degraded and the library carried on (a room failed, a session
    /// downgraded from RDMA to TCP, a connection lost or refused).
    KVSTAGE_LOG_WARN = 2,
    /// Lifecycle: engines created and freed, sessions opened and closed with their transport.
    KVSTAGE_LOG_INFO = 3,
    /// Details for diagnosis (errors also returned to the caller, connections without a valid
    /// hello); at most one record per chunk.
    KVSTAGE_LOG_DEBUG = 4,
    /// Per chunk.
    KVSTAGE_LOG_TRACE = 5,
}

/// One log record, as handed to a `kvstage_log_fn`. Every pointer is valid during the call only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvstage_log_record {
    /// `sizeof(kvstage_log_record)` of the library (fields are only ever appended).
    pub struct_size: usize,
    /// A `kvstage_log_level` value: `KVSTAGE_LOG_ERROR` … `KVSTAGE_LOG_TRACE`.
    pub level: i32,
    /// Where in kvstage the record comes from, e.g. "kvstage::transport::rdma" (NUL-terminated).
    pub target: *const c_char,
    /// The session id the record is about (the one `kvstage_error.session` names), "" when none.
    /// Not repeated in `message`.
    pub session: *const c_char,
    /// One line of text without a trailing newline, e.g. "room 7 failed (KVSTAGE_E_TIMEOUT): …".
    pub message: *const c_char,
}

/// Receives kvstage's log records (see `kvstage_log_set_callback`).
///
/// - **Threads.** Called on whatever thread logs: the caller's own thread inside a kvstage call,
///   or a kvstage thread (listener, connection, transfer worker, scatter, RDMA completion). It
///   can be called from several threads at once: it must be thread-safe.
/// - **Blocking.** It delays the thread that logs: return quickly (queue the record if the
///   embedder's logger may block). It must not wait for anything that waits for kvstage (an
///   engine being freed, an operation or room wait on another thread).
/// - **Reentrancy.** It must not call kvstage functions. Records that kvstage calls made from
///   inside it would log are dropped, and `kvstage_log_set_callback` called from inside it fails
///   with `KVSTAGE_E_UNSUPPORTED`.
/// - **Lifetime.** `record` and the strings it points to are valid during the call only: copy
///   what must outlive it.
/// - **Unwinding.** It must return normally: no C++ exception, `longjmp` or thread exit may
///   leave it (that would cross kvstage's frames, which is undefined behavior).
pub type kvstage_log_fn = Option<unsafe extern "C" fn(user_data: *mut c_void, record: *const kvstage_log_record)>;

/// The caller's pointer, handed back unchanged on the threads that log.
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

fn c_text(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).expect("NULs were replaced")
}

/// Sends kvstage's log records at or above `max_level` (a `kvstage_log_level` value) to
/// `callback` instead of stderr, with `user_data` handed back unchanged; `callback` NULL sends
/// them to stderr again (at the `KVSTAGE_LOG` level; `max_level` is then ignored). Process-wide:
/// one callback for every engine. See `kvstage_log_fn` for the threads it runs on and what it
/// must not do.
///
/// Safe to call at any time from any thread (except from inside the callback: that fails with
/// `KVSTAGE_E_UNSUPPORTED`): it returns only once no call of the previous callback is running or
/// can start, so the previous `user_data` may be freed as soon as it returns. It waits for those
/// calls: do not call it while holding a lock that the callback takes.
///
/// `max_level` outside `KVSTAGE_LOG_OFF`..=`KVSTAGE_LOG_TRACE` is `KVSTAGE_E_INVALID_ARG`.
#[no_mangle]
pub unsafe extern "C" fn kvstage_log_set_callback(callback: kvstage_log_fn, user_data: *mut c_void, max_level: i32) -> Status {
    ffi_fn!(status {
        let sink = match callback {
            None => None,
            Some(f) => {
                let max = logging::level_from_int(max_level).ok_or_else(|| {
                    Error::invalid_arg("max_level", format!("{max_level} is not a kvstage_log_level (0..=5)"))
                })?;
                let data = UserData(user_data);
                let sink: Sink = Box::new(move |line: &Line<'_>| {
                    let (target, session, message) = (c_text(line.target), c_text(line.session), c_text(line.message));
                    let record = kvstage_log_record {
                        struct_size: std::mem::size_of::<kvstage_log_record>(),
                        level: logging::level_to_int(line.level),
                        target: target.as_ptr(),
                        session: session.as_ptr(),
                        message: message.as_ptr(),
                    };
                    // SAFETY: the caller's function with its own pointer; `record` and its
                    // strings live for the call.
                    unsafe { f(data.get(), &record) }
                });
                Some((sink, max))
            }
        };
        logging::set_callback(sink)?;
        Ok(Status::KVSTAGE_OK)
    })
}
