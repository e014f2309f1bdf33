//! Run-time probes of optional driver libraries (never linked: the `.so` must load anywhere).

use std::ffi::{c_int, c_void, CStr};

/// An open `dlopen` handle, closed on drop.
struct Library(*mut c_void);

impl Library {
    fn open(name: &CStr) -> Option<Library> {
        // SAFETY: dlopen with a valid C string; RTLD_LOCAL keeps its symbols private.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        // Not `then_some(Library(handle))`: that builds (and drops) a Library even for NULL, and
        // Drop would call dlclose(NULL), which crashes glibc.
        if handle.is_null() {
            None
        } else {
            Some(Library(handle))
        }
    }

    fn symbol(&self, name: &CStr) -> Option<*mut c_void> {
        // SAFETY: the handle is open; the caller casts to the documented signature.
        let sym = unsafe { libc::dlsym(self.0, name.as_ptr()) };
        (!sym.is_null()).then_some(sym)
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: closing the handle we opened.
        unsafe { libc::dlclose(self.0) };
    }
}

/// Number of RDMA devices libibverbs lists, 0 when the library or kernel support is absent.
pub fn rdma_device_count() -> usize {
    let Some(lib) = Library::open(c"libibverbs.so.1") else { return 0 };
    let (Some(get), Some(free)) = (lib.symbol(c"ibv_get_device_list"), lib.symbol(c"ibv_free_device_list")) else {
        return 0;
    };
    type GetList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
    type FreeList = unsafe extern "C" fn(*mut *mut c_void);
    // SAFETY: documented verbs signatures.
    unsafe {
        let get: GetList = std::mem::transmute::<*mut c_void, GetList>(get);
        let free: FreeList = std::mem::transmute::<*mut c_void, FreeList>(free);
        let mut n: c_int = 0;
        let list = get(&mut n);
        if list.is_null() {
            return 0;
        }
        free(list);
        n.max(0) as usize
    }
}

/// Number of CUDA devices the driver reports, 0 when libcuda is absent or has no device.
pub fn cuda_device_count() -> usize {
    let Some(lib) = Library::open(c"libcuda.so.1") else { return 0 };
    let (Some(init), Some(count)) = (lib.symbol(c"cuInit"), lib.symbol(c"cuDeviceGetCount")) else { return 0 };
    type Init = unsafe extern "C" fn(u32) -> c_int;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: documented driver API signatures.
    unsafe {
        let init: Init = std::mem::transmute::<*mut c_void, Init>(init);
        let count: Count = std::mem::transmute::<*mut c_void, Count>(count);
        if init(0) != 0 {
            return 0;
        }
        let mut n: c_int = 0;
        if count(&mut n) != 0 {
            return 0;
        }
        // Keep libcuda loaded once initialized: unloading an initialized driver is unsafe.
        std::mem::forget(lib);
        n.max(0) as usize
    }
}


/// Why the library `name` cannot be loaded (the `dlerror` text), `None` when it loads.
pub fn load_error(name: &CStr) -> Option<String> {
    if Library::open(name).is_some() {
        return None;
    }
    // SAFETY: dlerror returns NULL or a thread-local NUL-terminated string.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        Some(format!("{} could not be opened", name.to_string_lossy()))
    } else {
        // SAFETY: non-NULL dlerror text is a valid C string until the next dl* call.
        Some(unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
    }
}

/// True when `name` loads and defines `symbol` (a capability probe, e.g. `ibv_reg_dmabuf_mr`).
pub fn has_symbol(name: &CStr, symbol: &CStr) -> bool {
    Library::open(name).is_some_and(|l| l.symbol(symbol).is_some())
}
