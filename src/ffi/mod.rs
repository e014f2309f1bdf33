//! The only `extern "C"` code of kvstage.
//!
//! The body of every export is [`ffi_fn!`], which clears the thread's last error, runs the body
//! under `catch_unwind`, turns `Err` into a status code plus last error, and turns a panic into
//! `KVSTAGE_E_PANIC` while poisoning every handle the call touched. Handles live in a registry
//! ([`Handle`]) that checks their kind and keeps their objects alive during calls.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, CStr};
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::error::{Error, Result, Status};

pub mod completion;
pub mod core;
pub mod describe;
pub mod doctor;
pub mod engine;
pub mod geometry;
pub mod grid;
pub mod last_error;
pub mod log;
pub mod parts;
pub mod shared;
pub mod state;
pub mod stats;
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
    /// Addresses of the handles borrowed by the export running on this thread (poisoned if it
    /// panics).
    static TOUCHED: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
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
            let touched = TOUCHED.with(|t| std::mem::take(&mut *t.borrow_mut()));
            let poisoned = Handle::poison(touched);
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

/// One kind of opaque handle: the C type (`kvstage_engine`), the Rust object behind it and the C
/// type's name, which error messages use. Every handle type is listed here, below.
pub trait HandleKind: 'static {
    type Inner: Send + Sync + 'static;
    const NAME: &'static str;
}

impl HandleKind for engine::kvstage_engine {
    type Inner = crate::engine::Engine;
    const NAME: &'static str = "kvstage_engine";
}

impl HandleKind for transfer::kvstage_session {
    type Inner = Arc<crate::session::sender::SenderSession>;
    const NAME: &'static str = "kvstage_session";
}

impl HandleKind for transfer::kvstage_op {
    type Inner = Arc<crate::session::op::Op>;
    const NAME: &'static str = "kvstage_op";
}

/// The handles given to C: a process-wide registry from handle address to object.
///
/// - **Addresses.** A handle's address is not memory: it is `HANDLE_TAG | id << 4` with `id` from
///   a counter that only grows, so an address is never handed out twice in a process (no ABA: a
///   stale pointer can never name a newer handle) and never NULL. On 64-bit targets bit 63 is set
///   and bits 62..56 clear: a non-canonical address on x86-64 (4- and 5-level paging), so no
///   pointer to real memory equals a live handle, and C code that dereferences one faults at once
///   instead of corrupting memory. Nothing is ever read through a handle pointer: a freed or
///   foreign pointer is simply not in the registry.
/// - **Kinds.** Each entry records its [`HandleKind`]; a handle of another kind is
///   `KVSTAGE_E_INVALID_ARG` naming the argument and both kinds.
/// - **Lifetime.** An entry holds the object in an `Arc`. [`Handle::borrow`] clones it for the
///   duration of the call ([`Borrowed`]), so a `_free` racing with calls on the same handle only
///   removes the entry: it returns at once, the object lives until the last call in flight
///   returns, and its `Drop` (an engine joining its threads) runs on that call's thread after its
///   body, still inside its `ffi_fn!` (on a new thread when that is a library thread, see
///   [`release`]). Objects are never dropped under the registry lock.
/// - **Poisoning.** An entry carries its poisoned flag; a panic poisons the entries the call
///   borrowed (looked up by address in `TOUCHED`, so a handle freed meanwhile is skipped).
pub enum Handle {}

struct Entry {
    kind: TypeId,
    name: &'static str,
    object: Arc<dyn Any + Send + Sync>,
    poisoned: bool,
}

/// Live handles by address.
static LIVE: RwLock<BTreeMap<usize, Entry>> = RwLock::new(BTreeMap::new());
/// The next handle id (never reused).
static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

#[cfg(target_pointer_width = "64")]
const HANDLE_TAG: usize = 1 << 63;
#[cfg(target_pointer_width = "64")]
const MAX_ID: usize = (1 << 52) - 1;
#[cfg(not(target_pointer_width = "64"))]
const HANDLE_TAG: usize = 0;
#[cfg(not(target_pointer_width = "64"))]
const MAX_ID: usize = usize::MAX >> 4;

// The registry's critical sections cannot panic part-way through a change, so a poisoned lock
// (a panic elsewhere while it was held) still guards a consistent map.
fn live() -> RwLockReadGuard<'static, BTreeMap<usize, Entry>> {
    LIVE.read().unwrap_or_else(PoisonError::into_inner)
}

fn live_mut() -> RwLockWriteGuard<'static, BTreeMap<usize, Entry>> {
    LIVE.write().unwrap_or_else(PoisonError::into_inner)
}

fn not_live(arg: &str) -> Error {
    Error::invalid_arg(arg, "is not a live kvstage handle (freed, or not from kvstage)")
}

fn wrong_kind<H: HandleKind>(arg: &str, actual: &str) -> Error {
    Error::invalid_arg(arg, format!("is a {actual}, not a {}", H::NAME))
}

impl Handle {
    /// Registers `inner` as a new handle of kind `H` and returns its address for C.
    pub fn into_raw<H: HandleKind>(inner: H::Inner) -> Result<*mut H> {
        let id = NEXT_ID
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |id| (id <= MAX_ID).then_some(id + 1))
            .map_err(|_| Error::internal("every kvstage handle address of this process has been used"))?;
        let address = HANDLE_TAG | id << 4;
        let entry = Entry { kind: TypeId::of::<H>(), name: H::NAME, object: Arc::new(inner), poisoned: false };
        let previous = live_mut().insert(address, entry);
        debug_assert!(previous.is_none(), "handle address {address:#x} handed out twice");
        Ok(address as *mut H)
    }

    /// Borrows a handle passed by C for the duration of the call: NULL, a freed or foreign
    /// pointer, a handle of another kind and a poisoned handle are errors naming `arg`. Never
    /// reads through `ptr`.
    pub fn borrow<H: HandleKind>(ptr: *const H, arg: &str) -> Result<Borrowed<H::Inner>> {
        if ptr.is_null() {
            return Err(Error::invalid_arg(arg, "is NULL"));
        }
        let address = ptr as usize;
        let object = {
            let live = live();
            let entry = live.get(&address).ok_or_else(|| not_live(arg))?;
            if entry.kind != TypeId::of::<H>() {
                return Err(wrong_kind::<H>(arg, entry.name));
            }
            if entry.poisoned {
                return Err(Error::new(
                    Status::KVSTAGE_E_POISONED,
                    format!("`{arg}` ({}) was poisoned by an earlier panic; it can only be freed", H::NAME),
                ));
            }
            entry.object.clone()
        };
        // Same kind, same type: the downcast cannot fail.
        let object = object
            .downcast::<H::Inner>()
            .map_err(|_| Error::internal(format!("handle `{arg}` ({}) holds another type", H::NAME)))?;
        TOUCHED.with(|t| t.borrow_mut().push(address));
        Ok(Borrowed { object: ManuallyDrop::new(object) })
    }

    /// Frees a handle (the C `_free`): NULL is a no-op; poisoned handles can be freed. A freed or
    /// foreign pointer, or a handle of another kind, is left alone and recorded in the last error
    /// (`_free` returns nothing). Returns at once: calls in flight on the handle keep the object
    /// alive, and the last one to return drops it.
    pub fn free<H: HandleKind>(ptr: *mut H, arg: &str) {
        if ptr.is_null() {
            return;
        }
        let address = ptr as usize;
        let removed = {
            let mut live = live_mut();
            match live.get(&address) {
                None => Err(not_live(arg)),
                Some(entry) if entry.kind != TypeId::of::<H>() => Err(wrong_kind::<H>(arg, entry.name)),
                Some(_) => Ok(live.remove(&address)),
            }
        };
        // Released here, after the lock: an engine joins its threads in its `Drop`.
        match removed {
            Ok(Some(entry)) => match entry.object.downcast::<H::Inner>() {
                Ok(object) => release(object),
                Err(other) => drop(other),
            },
            Ok(None) => {}
            Err(error) => {
                last_error::set(error);
            }
        }
    }

    /// Poisons the live handles among `addresses`; returns how many.
    fn poison(mut addresses: Vec<usize>) -> usize {
        addresses.sort_unstable();
        addresses.dedup();
        let mut live = live_mut();
        let mut poisoned = 0;
        for address in addresses {
            if let Some(entry) = live.get_mut(&address) {
                entry.poisoned = true;
                poisoned += 1;
            }
        }
        poisoned
    }
}

/// Gives up a reference to a handle's object. The last one runs the object's `Drop` here, unless
/// this is a library thread (every thread kvstage starts is named `kvstage-*`; a completion
/// callback calling kvstage runs on one): an engine's `Drop` joins its threads, and a thread cannot
/// join itself, so the object ends on a new thread instead (inline if none can be started).
fn release<T: Send + Sync + 'static>(object: Arc<T>) {
    let Some(last) = Arc::into_inner(object) else { return };
    if std::thread::current().name().is_some_and(|name| name.starts_with("kvstage-")) {
        // On failure the closure, and `last` with it, is dropped here.
        let _ = std::thread::Builder::new().name("kvstage-release".to_owned()).spawn(move || drop(last));
    }
}

/// A handle's object, kept alive for the call that borrowed it (even if another thread frees the
/// handle meanwhile). Derefs to the object.
pub struct Borrowed<T: Send + Sync + 'static> {
    object: ManuallyDrop<Arc<T>>,
}

impl<T: Send + Sync + 'static> std::ops::Deref for Borrowed<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.object
    }
}

impl<T: Send + Sync + 'static> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: `object` is not used again.
        release(unsafe { ManuallyDrop::take(&mut self.object) });
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

/// The one convention of string outputs `(buf, capacity, needed)`: copies `text` NUL-terminated
/// into `buf` of `capacity` bytes; `*needed` (when not NULL) gets the size including the NUL, also
/// when the buffer is too small (then `KVSTAGE_E_INVALID_ARG` naming both sizes). A call with
/// `buf` NULL and `capacity` 0 is a size query: `KVSTAGE_OK` with `*needed` set.
pub unsafe fn write_text(text: &str, buf: *mut c_char, capacity: usize, needed: *mut usize) -> Result<Status> {
    let size = text.len() + 1;
    if unsafe { size_query(buf, capacity, needed, "needed", size) }? {
        return Ok(Status::KVSTAGE_OK);
    }
    if size > capacity {
        return Err(Error::invalid_arg("capacity", format!("{capacity} < {size} bytes needed")));
    }
    if buf.is_null() {
        return Err(Error::invalid_arg("buf", format!("is NULL with capacity {capacity}")));
    }
    // SAFETY: `capacity >= size` writable bytes at `buf` by contract.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, text.len());
        *buf.add(text.len()) = 0;
    }
    Ok(Status::KVSTAGE_OK)
}

/// Stores `size` in `*needed` (when not NULL); `Ok(true)` when the call is a size query (`out`
/// NULL, `capacity` 0: nothing more to do). A size query without `needed` asks for nothing.
pub unsafe fn size_query<T>(out: *mut T, capacity: usize, needed: *mut usize, needed_arg: &str, size: usize) -> Result<bool> {
    if !needed.is_null() {
        // SAFETY: a non-NULL `needed` points to writable storage by contract.
        unsafe { *needed = size };
    }
    if out.is_null() && capacity == 0 && size > 0 {
        if needed.is_null() {
            return Err(Error::invalid_arg(needed_arg, "is NULL in a size query (output NULL, capacity 0)"));
        }
        return Ok(true);
    }
    Ok(false)
}

/// The one convention of array outputs `(out, capacity, count)`: writes `items` into
/// `out[capacity]`; `*count` (may be NULL) receives their number, also when `capacity` is too
/// small (`KVSTAGE_E_INVALID_ARG` naming both); `out` NULL with `capacity` 0 is a count query.
pub unsafe fn write_array<T: Copy>(items: &[T], out: *mut T, capacity: usize, count: *mut usize, what: &str) -> Result<Status> {
    if unsafe { size_query(out, capacity, count, "count", items.len()) }? {
        return Ok(Status::KVSTAGE_OK);
    }
    if items.len() > capacity {
        return Err(Error::invalid_arg("capacity", format!("{capacity} < {} {what} to report", items.len())));
    }
    if items.is_empty() {
        return Ok(Status::KVSTAGE_OK);
    }
    if out.is_null() {
        return Err(Error::invalid_arg("out", format!("is NULL with capacity {capacity}")));
    }
    // SAFETY: `capacity >= items.len()` writable entries at `out` by contract.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    Ok(Status::KVSTAGE_OK)
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

/// Checks a versioned output pointer for NULL without making a reference of it: the caller's
/// struct may be an older, smaller one than `T` (see [`write_versioned`]).
pub fn out_ptr<T>(ptr: *mut T, arg: &str) -> Result<*mut T> {
    if ptr.is_null() {
        return Err(Error::invalid_arg(arg, "is NULL"));
    }
    Ok(ptr)
}

/// Writes a versioned output struct: copies as many bytes as the caller's `struct_size` holds.
/// Works on the raw pointer only: the caller's struct may be smaller than `T` (built with an
/// older header), so no `&mut T` over it may exist.
///
/// # Safety
/// `out` is NULL or points to at least `out->struct_size` writable bytes (the C caller's
/// contract), beginning with a `size_t struct_size`; no alignment is assumed.
pub unsafe fn write_versioned<T: Copy>(out: *mut T, value: T, arg: &str) -> Result<()> {
    let out = out_ptr(out, arg)? as *mut u8;
    // SAFETY: the first field of every versioned struct is a `size_t struct_size`.
    let given = unsafe { std::ptr::read_unaligned(out as *const usize) };
    let full = std::mem::size_of::<T>();
    if given < std::mem::size_of::<usize>() || given > (1 << 20) {
        return Err(Error::invalid_arg(
            &format!("{arg}->struct_size"),
            format!("{given} is not a valid size (set it to sizeof the struct, {full} here)"),
        ));
    }
    let n = given.min(full);
    // SAFETY: `n` bytes are writable in the caller's struct (it said so) and readable in `value`;
    // the caller's bytes and the local `value` do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(&value as *const T as *const u8, out, n);
        std::ptr::write_unaligned(out as *mut usize, given);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts its drops.
    struct Probe(Arc<AtomicUsize>);

    impl Drop for Probe {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct ProbeA;
    struct ProbeB;

    impl HandleKind for ProbeA {
        type Inner = Probe;
        const NAME: &'static str = "probe_a";
    }

    impl HandleKind for ProbeB {
        type Inner = Probe;
        const NAME: &'static str = "probe_b";
    }

    fn last_message() -> String {
        // SAFETY: the last error and its strings are valid until the next call on this thread.
        unsafe { CStr::from_ptr((*last_error::current()).message) }.to_string_lossy().into_owned()
    }

    fn probe<H: HandleKind<Inner = Probe>>() -> (*mut H, Arc<AtomicUsize>) {
        let drops = Arc::new(AtomicUsize::new(0));
        (Handle::into_raw::<H>(Probe(drops.clone())).unwrap(), drops)
    }

    #[test]
    fn kinds_are_checked_and_named() {
        let (a, drops) = probe::<ProbeA>();
        assert!(Handle::borrow(a, "a").is_ok());
        let err = Handle::borrow(a as *const ProbeB, "thing").err().unwrap();
        assert_eq!(err.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert_eq!(err.message(), "invalid argument `thing`: is a probe_a, not a probe_b");
        // A free of the wrong kind leaves the handle alone and says why.
        last_error::clear();
        Handle::free(a as *mut ProbeB, "thing");
        assert_eq!(last_message(), "invalid argument `thing`: is a probe_a, not a probe_b");
        assert!(Handle::borrow(a, "a").is_ok());
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        Handle::free(a, "a");
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn freed_foreign_and_null_pointers_are_refused() {
        let (a, drops) = probe::<ProbeA>();
        Handle::free(a, "a");
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        let err = Handle::borrow(a, "a").err().unwrap();
        assert_eq!(err.code(), Status::KVSTAGE_E_INVALID_ARG);
        assert!(err.message().contains("`a`: is not a live kvstage handle"), "{}", err.message());
        last_error::clear();
        Handle::free(a, "a");
        assert!(last_message().contains("is not a live kvstage handle"));
        let local = 0u64;
        let foreign = &local as *const u64 as *const ProbeA;
        assert!(Handle::borrow(foreign, "a").err().unwrap().message().contains("not a live"));
        assert!(Handle::borrow(std::ptr::null::<ProbeA>(), "a").err().unwrap().message().contains("is NULL"));
        last_error::clear();
        Handle::free(std::ptr::null_mut::<ProbeA>(), "a");
        assert_eq!(unsafe { (*last_error::current()).code }, Status::KVSTAGE_OK);
    }

    #[test]
    fn addresses_are_tagged_aligned_and_never_reused() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let (a, _) = probe::<ProbeA>();
            let address = a as usize;
            assert_ne!(address, 0);
            assert_eq!(address % 16, 0);
            assert_eq!(address & HANDLE_TAG, HANDLE_TAG);
            assert!(seen.insert(address), "{address:#x} handed out twice");
            Handle::free(a, "a");
        }
    }

    #[test]
    fn a_free_during_a_call_defers_the_drop_to_the_call() {
        let (a, drops) = probe::<ProbeA>();
        let borrowed = Handle::borrow(a, "a").unwrap();
        Handle::free(a, "a");
        // Dead for new calls at once, alive for the call in flight.
        assert!(Handle::borrow(a, "a").is_err());
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        assert_eq!(borrowed.0.load(Ordering::SeqCst), 0);
        drop(borrowed);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    /// Records the name of the thread it is dropped on.
    struct ThreadProbe(Arc<std::sync::Mutex<Option<String>>>, std::sync::mpsc::Sender<()>);

    impl Drop for ThreadProbe {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(std::thread::current().name().unwrap_or("").to_owned());
            let _ = self.1.send(());
        }
    }

    struct ProbeC;

    impl HandleKind for ProbeC {
        type Inner = ThreadProbe;
        const NAME: &'static str = "probe_c";
    }

    /// Borrows a `ProbeC` handle on a thread named `thread`, frees it meanwhile, and returns the
    /// name of the thread the object was dropped on.
    fn dropped_on(thread: &str) -> String {
        let dropped_on = Arc::new(std::sync::Mutex::new(None));
        let (tx, rx) = std::sync::mpsc::channel();
        let c = Handle::into_raw::<ProbeC>(ThreadProbe(dropped_on.clone(), tx)).unwrap() as usize;
        let (borrowed_tx, borrowed_rx) = std::sync::mpsc::channel();
        let (freed_tx, freed_rx) = std::sync::mpsc::channel::<()>();
        let caller = std::thread::Builder::new()
            .name(thread.to_owned())
            .spawn(move || {
                let borrowed = Handle::borrow(c as *const ProbeC, "c").unwrap();
                borrowed_tx.send(()).unwrap();
                freed_rx.recv().unwrap();
                drop(borrowed);
            })
            .unwrap();
        borrowed_rx.recv().unwrap();
        Handle::free(c as *mut ProbeC, "c");
        assert!(dropped_on.lock().unwrap().is_none(), "dropped by the free while borrowed");
        freed_tx.send(()).unwrap();
        caller.join().unwrap();
        rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        let name = dropped_on.lock().unwrap().take();
        name.unwrap()
    }

    #[test]
    fn the_last_call_in_flight_drops_the_object_on_its_thread_unless_a_library_thread() {
        assert_eq!(dropped_on("caller"), "caller");
        // A library thread (a completion callback) must not run an engine's `Drop`: it would
        // join itself.
        assert_eq!(dropped_on("kvstage-xfer-0"), "kvstage-release");
    }

    #[test]
    fn a_panic_poisons_the_live_handles_it_borrowed() {
        let (a, a_drops) = probe::<ProbeA>();
        let (b, _) = probe::<ProbeA>();
        let (c, _) = probe::<ProbeA>();
        let status = guard(true, Status::KVSTAGE_E_PANIC, || {
            let _a = Handle::borrow(a, "a").unwrap();
            let _again = Handle::borrow(a, "a").unwrap();
            let _b = Handle::borrow(b, "b").unwrap();
            // Freed during the call: nothing left to poison.
            Handle::free(b, "b");
            panic!("probe panic");
        });
        assert_eq!(status, Status::KVSTAGE_E_PANIC);
        assert!(last_message().contains("(1 handle(s) poisoned)"), "{}", last_message());
        let err = Handle::borrow(a, "a").err().unwrap();
        assert_eq!(err.code(), Status::KVSTAGE_E_POISONED);
        assert_eq!(err.message(), "`a` (probe_a) was poisoned by an earlier panic; it can only be freed");
        // Untouched handles are unaffected; poisoned ones can be freed.
        assert!(Handle::borrow(c, "c").is_ok());
        last_error::clear();
        Handle::free(a, "a");
        assert_eq!(a_drops.load(Ordering::SeqCst), 1);
        assert_eq!(unsafe { (*last_error::current()).code }, Status::KVSTAGE_OK);
        Handle::free(c, "c");
    }
}
