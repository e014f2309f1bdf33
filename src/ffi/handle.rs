//! The handles given to C: the opaque types, and the process-wide registry that checks their kind
//! and keeps their objects alive during calls (docs/c-api-conventions.md, section 2).

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::last_error;
use crate::engine::Engine;
use crate::error::{Error, Result, Status};
use crate::session::op::Op;
use crate::session::sender::SenderSession;

/// An engine: listener, peers, registrations and worker threads. Thread-safe.
pub struct kvstage_engine {
    _private: [u8; 0],
}

/// A sender session: one (prefill rank → decode rank) peering. Thread-safe; transfers on one
/// session may run concurrently.
pub struct kvstage_session {
    _private: [u8; 0],
}

/// An asynchronous transfer started by `kvstage_transfer_async` or
/// `kvstage_transfer_layerwise_async`.
pub struct kvstage_op {
    _private: [u8; 0],
}

impl HandleKind for kvstage_engine {
    type Inner = Engine;
    const NAME: &'static str = "kvstage_engine";
}

impl HandleKind for kvstage_session {
    type Inner = Arc<SenderSession>;
    const NAME: &'static str = "kvstage_session";
}

impl HandleKind for kvstage_op {
    type Inner = Arc<Op>;
    const NAME: &'static str = "kvstage_op";
}

pub(crate) unsafe fn engine(ptr: *const kvstage_engine) -> Result<Borrowed<Engine>> {
    Handle::borrow(ptr, "engine")
}

pub(crate) unsafe fn session(ptr: *const kvstage_session) -> Result<Borrowed<Arc<SenderSession>>> {
    Handle::borrow(ptr, "session")
}

pub(crate) unsafe fn op(ptr: *const kvstage_op) -> Result<Borrowed<Arc<Op>>> {
    Handle::borrow(ptr, "op")
}

thread_local! {
    /// Addresses of the handles borrowed by the export running on this thread (poisoned if it
    /// panics).
    static TOUCHED: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// A call begins: it has borrowed nothing yet.
pub(super) fn begin_call() {
    TOUCHED.with(|t| t.borrow_mut().clear());
}

/// A call panicked: poisons the live handles it borrowed; returns how many.
pub(super) fn poison_touched() -> usize {
    let touched = TOUCHED.with(|t| std::mem::take(&mut *t.borrow_mut()));
    Handle::poison(touched)
}

/// One kind of opaque handle: the C type (`kvstage_engine`), the Rust object behind it and the C
/// type's name, which error messages use. Every handle type is listed here, below.
pub trait HandleKind: 'static {
    type Inner: Send + Sync + 'static;
    const NAME: &'static str;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

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
        let status = super::super::guard(true, Status::KVSTAGE_E_PANIC, || {
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
