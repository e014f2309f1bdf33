//! The thread-local last error and its C view.

use std::cell::RefCell;
use std::ffi::{c_char, CString};

use super::ffi_fn;
use crate::error::{Error, ErrorClass, Status};

/// Details of the last failed kvstage call on this thread.
///
/// Owned by the library and valid until the next kvstage call on the same thread.
/// `session` and `message` are never NULL (empty strings when absent); `causes` holds
/// `cause_count` strings, outermost first.
#[repr(C)]
pub struct kvstage_error {
    /// `sizeof(kvstage_error)` of the library that filled it.
    pub struct_size: usize,
    pub code: Status,
    pub klass: ErrorClass,
    pub session: *const c_char,
    pub message: *const c_char,
    pub cause_count: usize,
    pub causes: *const *const c_char,
}

/// Makes the static sentinels shareable across threads (they only point at static strings).
struct Sentinel(kvstage_error);
// SAFETY: the sentinel's pointers point to immutable 'static data.
unsafe impl Sync for Sentinel {}

static NO_ERROR: Sentinel = Sentinel(kvstage_error {
    struct_size: std::mem::size_of::<kvstage_error>(),
    code: Status::KVSTAGE_OK,
    klass: ErrorClass::KVSTAGE_CLASS_NONE,
    session: c"".as_ptr(),
    message: c"no error".as_ptr(),
    cause_count: 0,
    causes: std::ptr::null(),
});

/// The owned strings behind one filled-in `kvstage_error`.
struct Stored {
    _strings: Vec<CString>,
    _cause_ptrs: Vec<*const c_char>,
    view: kvstage_error,
}

thread_local! {
    static LAST: RefCell<Option<Box<Stored>>> = const { RefCell::new(None) };
}

fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).expect("NULs were replaced")
}

/// Stores `error` as this thread's last error and returns its code.
pub fn set(error: Error) -> Status {
    let code = error.code();
    let session = c_string(error.session().unwrap_or(""));
    let message = c_string(error.message());
    let causes: Vec<CString> = error.causes().iter().map(|c| c_string(c)).collect();
    let cause_ptrs: Vec<*const c_char> = causes.iter().map(|c| c.as_ptr()).collect();
    let view = kvstage_error {
        struct_size: std::mem::size_of::<kvstage_error>(),
        code,
        klass: error.class(),
        session: session.as_ptr(),
        message: message.as_ptr(),
        cause_count: cause_ptrs.len(),
        causes: if cause_ptrs.is_empty() { std::ptr::null() } else { cause_ptrs.as_ptr() },
    };
    let mut strings = vec![session, message];
    strings.extend(causes);
    let stored = Box::new(Stored { _strings: strings, _cause_ptrs: cause_ptrs, view });
    LAST.with(|l| *l.borrow_mut() = Some(stored));
    code
}

pub fn clear() {
    LAST.with(|l| l.borrow_mut().take());
}

/// The static "no error" sentinel.
pub fn no_error() -> *const kvstage_error {
    &NO_ERROR.0
}

/// Pointer to this thread's last error, or to the static "no error" sentinel. Never NULL.
pub fn current() -> *const kvstage_error {
    LAST.with(|l| match l.borrow().as_ref() {
        Some(stored) => &stored.view as *const kvstage_error,
        None => no_error(),
    })
}

/// The name of a status code ("KVSTAGE_E_TIMEOUT"), or "KVSTAGE_UNKNOWN" (static storage).
#[no_mangle]
pub unsafe extern "C" fn kvstage_status_name(code: i32) -> *const c_char {
    ffi_fn!(value = c"KVSTAGE_UNKNOWN".as_ptr(), {
        match Status::from_code(code) {
            Some(status) => status.name_c().as_ptr() as *const c_char,
            None => c"KVSTAGE_UNKNOWN".as_ptr(),
        }
    })
}

/// The last error of this thread; never NULL ("no error" sentinel with code `KVSTAGE_OK`).
/// Valid until the next kvstage call on the same thread.
#[no_mangle]
pub unsafe extern "C" fn kvstage_error_last() -> *const kvstage_error {
    ffi_fn!(keep_error, value = no_error(), { current() })
}

/// Resets this thread's last error to the "no error" sentinel.
#[no_mangle]
pub unsafe extern "C" fn kvstage_error_clear() {
    ffi_fn!(keep_error, value = (), { clear() })
}
