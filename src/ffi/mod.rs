//! The only `extern "C"` code of kvstage.
//!
//! The body of every export is [`ffi_fn!`], which clears the thread's last error, runs the body
//! under `catch_unwind`, turns `Err` into a status code plus last error, and turns a panic into
//! `KVSTAGE_E_PANIC` while poisoning every handle the call touched.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result, Status};

pub mod core;
pub mod doctor;
pub mod engine;
pub mod geometry;
pub mod last_error;
pub mod transfer;

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
/// cause, poisoning every handle the call borrowed. A unit test checks that every `extern "C"`
/// function in `src/ffi` starts with this macro.
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

thread_local! {
    /// Poison flags of the handles borrowed by the export running on this thread.
    static TOUCHED: RefCell<Vec<*const AtomicBool>> = const { RefCell::new(Vec::new()) };
}

/// The shared body of every export: clear, catch, poison on panic.
pub fn guard<R>(clear_error: bool, on_panic: R, body: impl FnOnce() -> R) -> R {
    if clear_error {
        last_error::clear();
    }
    TOUCHED.with(|t| t.borrow_mut().clear());
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(payload) => {
            let text = crate::error::panic_text(&*payload);
            let poisoned = TOUCHED.with(|t| {
                let flags = std::mem::take(&mut *t.borrow_mut());
                for flag in &flags {
                    // SAFETY: handles touched by this call are alive until it returns.
                    unsafe { (**flag).store(true, Ordering::SeqCst) };
                }
                flags.len()
            });
            let err = Error::new(
                Status::KVSTAGE_E_PANIC,
                format!("internal panic caught at the C boundary ({poisoned} handle(s) poisoned)"),
            )
            .with_source(PanicText(text));
            last_error::set(err);
            on_panic
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("panic: {0}")]
struct PanicText(String);

/// Header every opaque handle starts with.
pub struct Handle<T> {
    magic: u64,
    poisoned: AtomicBool,
    kind: &'static str,
    inner: T,
}

const HANDLE_MAGIC: u64 = 0x6b76_7374_6167_6521;

impl<T> Handle<T> {
    pub fn into_raw(kind: &'static str, inner: T) -> *mut Handle<T> {
        Box::into_raw(Box::new(Handle { magic: HANDLE_MAGIC, poisoned: AtomicBool::new(false), kind, inner }))
    }

    /// Borrows a handle passed by C: NULL, a foreign pointer or a poisoned handle are errors.
    pub unsafe fn borrow<'a>(ptr: *const Handle<T>, arg: &str) -> Result<&'a T> {
        // SAFETY: the caller passes a pointer it got from `into_raw` (checked by the magic).
        let handle = unsafe { ptr.as_ref() }.ok_or_else(|| Error::invalid_arg(arg, "is NULL"))?;
        if handle.magic != HANDLE_MAGIC {
            return Err(Error::invalid_arg(arg, "is not a live kvstage handle (freed or foreign pointer)"));
        }
        if handle.poisoned.load(Ordering::SeqCst) {
            return Err(Error::new(
                Status::KVSTAGE_E_POISONED,
                format!("`{arg}` ({}) was poisoned by an earlier panic; it can only be freed", handle.kind),
            ));
        }
        TOUCHED.with(|t| t.borrow_mut().push(&handle.poisoned as *const AtomicBool));
        Ok(&handle.inner)
    }

    /// Frees a handle; NULL is a no-op. Poisoned handles can be freed.
    pub unsafe fn free(ptr: *mut Handle<T>) {
        if ptr.is_null() {
            return;
        }
        // SAFETY: see `borrow`; the magic is cleared so a double free is caught as a foreign pointer.
        unsafe {
            if (*ptr).magic != HANDLE_MAGIC {
                return;
            }
            (*ptr).magic = 0;
            drop(Box::from_raw(ptr));
        }
    }
}

/// Reads a NUL-terminated UTF-8 string argument; NULL is an error naming `arg`.
pub unsafe fn str_arg<'a>(ptr: *const c_char, arg: &str) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, "is NULL"));
    }
    // SAFETY: non-NULL C strings are NUL-terminated by contract.
    unsafe { CStr::from_ptr(ptr) }.to_str().map_err(|_| Error::invalid_arg(arg, "is not valid UTF-8"))
}

/// Checks an output pointer.
///
/// # Safety
/// `ptr` is NULL or points to writable storage for a `T` that outlives `'a` (the C caller's
/// contract). A safe signature here would let safe code turn any pointer into `&mut T`.
pub unsafe fn out_arg<'a, T>(ptr: *mut T, arg: &str) -> Result<&'a mut T> {
    // SAFETY: non-NULL output pointers point to writable storage by contract.
    unsafe { ptr.as_mut() }.ok_or_else(|| Error::invalid_arg(arg, "is NULL"))
}

/// A slice argument `(ptr, len)`; `len == 0` accepts NULL.
pub unsafe fn slice_arg<'a, T>(ptr: *const T, len: usize, arg: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, format!("is NULL with length {len}")));
    }
    // SAFETY: the caller provides `len` readable elements by contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Reads a versioned options struct whose first field is `struct_size`: fields the caller's
/// (older, smaller) struct lacks keep their defaults; a size below the first version is an error.
pub unsafe fn versioned_struct<T: Copy + Default>(ptr: *const T, arg: &str, min_size: usize) -> Result<T> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, "is NULL"));
    }
    // SAFETY: the first field of every versioned struct is a `size_t struct_size`.
    let given = unsafe { *(ptr as *const usize) };
    let full = std::mem::size_of::<T>();
    if given < min_size || given > (1 << 20) {
        return Err(Error::invalid_arg(
            &format!("{arg}->struct_size"),
            format!("{given} is not a valid size (expected {min_size}..={full}; call the _init function first)"),
        ));
    }
    let mut value = T::default();
    let n = given.min(full);
    // SAFETY: `n` bytes are readable from the caller's struct and writable in `value`.
    unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, &mut value as *mut T as *mut u8, n) };
    Ok(value)
}

/// Writes a versioned output struct: copies as many bytes as the caller's `struct_size` holds.
pub fn write_versioned<T: Copy>(out: &mut T, value: T, arg: &str) -> Result<()> {
    // SAFETY: the first field of every versioned struct is a `size_t struct_size`.
    let given = unsafe { *(out as *mut T as *const usize) };
    let full = std::mem::size_of::<T>();
    if given < std::mem::size_of::<usize>() || given > (1 << 20) {
        return Err(Error::invalid_arg(
            &format!("{arg}->struct_size"),
            format!("{given} is not a valid size (set it to sizeof the struct, {full} here)"),
        ));
    }
    let n = given.min(full);
    // SAFETY: `n` bytes are writable in the caller's struct (it said so) and readable in `value`.
    unsafe {
        std::ptr::copy_nonoverlapping(&value as *const T as *const u8, out as *mut T as *mut u8, n);
        *(out as *mut T as *mut usize) = given;
    }
    Ok(())
}
