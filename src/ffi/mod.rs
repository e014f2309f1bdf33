//! The only `extern "C"` code of kvstage.
//!
//! The body of every export is [`ffi_fn!`], which clears the thread's last error, runs the body
//! under `catch_unwind`, turns `Err` into a status code plus last error, and turns a panic into
//! `KVSTAGE_E_PANIC` while poisoning every handle the call touched. Handles live in a registry
//! ([`handle::Handle`]) that checks their kind and keeps their objects alive during calls.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, Status};

// Leaves: the conventions every export shares and the handle registry.
pub mod args;
pub mod handle;

// One module per C object, in the order of the header's sections (build.rs names them).
pub mod library;
pub mod log;
pub mod last_error;
pub mod engine;
pub mod completion;
pub mod pool;
pub mod parts;
pub mod staging;
pub mod room;
pub mod session;
pub mod timings;
pub mod op;
pub mod geometry;
pub mod diagnostics;
pub mod testing;

pub use last_error::kvstage_error;

/// The body of every C export. Three forms:
///
/// - `ffi_fn!(status { body })`: `body` evaluates to `Result<Status>`; `Err` becomes the last error
///   and its code is returned;
/// - `ffi_fn!(value = DEFAULT, { body })`: `body` evaluates to the return value and cannot fail;
/// - `ffi_fn!(keep_error, value = DEFAULT, { body })`: as `value`, without clearing the last error
///   (only for the error accessors themselves).
///
/// In every form the last error is cleared on entry (except `keep_error`), the body runs under
/// `catch_unwind`, and a panic becomes `KVSTAGE_E_PANIC` (or `DEFAULT`) with the panic text as a
/// cause, poisoning every handle the call borrowed. The `ffi_macro` ctest checks that every
/// `extern "C"` function is written with this macro, and only in `src/ffi`.
macro_rules! ffi_fn {
    (status $body:block) => {
        $crate::ffi::guard(true, $crate::error::Status::KVSTAGE_E_PANIC, || {
            #[allow(clippy::redundant_closure_call)]
            let result: $crate::error::Result<$crate::error::Status> = (|| $body)();
            match result {
                Ok(status) => status,
                Err(error) => $crate::ffi::last_error::set(error),
            }
        })
    };
    (value = $default:expr, $body:block) => {
        $crate::ffi::guard(true, $default, || $body)
    };
    (keep_error, value = $default:expr, $body:block) => {
        $crate::ffi::guard(false, $default, || $body)
    };
}
pub(crate) use ffi_fn;

/// The shared body of every export: clear, catch, poison on panic.
pub fn guard<R>(clear_error: bool, on_panic: R, body: impl FnOnce() -> R) -> R {
    if clear_error {
        last_error::clear();
    }
    handle::begin_call();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(payload) => {
            let text = crate::error::panic_text(&*payload);
            let poisoned = handle::poison_touched();
            let err = Error::new(
                Status::KVSTAGE_E_PANIC,
                format!("internal panic caught at the C boundary ({poisoned} handle(s) poisoned)"),
            )
            .with_source(PanicText(text));
            ::log::error!("{}", err.chain());
            last_error::set(err);
            on_panic
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("panic: {0}")]
struct PanicText(String);
