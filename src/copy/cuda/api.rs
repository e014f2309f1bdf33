//! The driver entry points kvstage calls, resolved from `libcuda.so.1`, the driver's SONAME, which
//! the CUDA runtime (and so PyTorch) loads too. cudarc's own loader tries `libcuda.so` first: on a
//! GPU host that name may be another library than the driver the application uses (the CUDA
//! toolkit's stub in `lib64/stubs`, a development link into an older driver), and on the GPU
//! runner a stand-in `libcuda.so.1` first on `LD_LIBRARY_PATH` lost to the real driver's
//! `libcuda.so`. cudarc still gives the types; no cudarc function is called.
//!
//! A symbol the library lacks answers `CUDA_ERROR_NOT_FOUND`; `driver()` checks every required
//! one before the first call.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_ulonglong, c_void, CString};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUevent, CUflushGPUDirectRDMAWritesScope, CUflushGPUDirectRDMAWritesTarget,
    CUfunction, CUipcMemHandle, CUjit_option, CUmemRangeHandleType, CUmodule, CUpointer_attribute, CUresult, CUstream,
};

/// The driver library's handle, never closed (unloading an initialized driver is unsafe).
struct Handle(usize);

static LIBRARY: OnceLock<Option<Handle>> = OnceLock::new();

fn handle() -> Option<*mut c_void> {
    LIBRARY
        .get_or_init(|| {
            // SAFETY: dlopen of a constant name; RTLD_LOCAL keeps the driver's symbols private.
            let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            (!h.is_null()).then_some(Handle(h as usize))
        })
        .as_ref()
        .map(|h| h.0 as *mut c_void)
}

/// Whether `libcuda.so.1` loads.
pub fn present() -> bool {
    handle().is_some()
}

/// The address of driver entry point `name`, if the library exports it.
pub fn symbol(name: &str) -> Option<*mut c_void> {
    let h = handle()?;
    let name = CString::new(name).ok()?;
    // SAFETY: an open handle and a C string; the caller casts to the documented signature.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

macro_rules! entry_points {
    ($( fn $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        $(
            /// The driver API function of this name.
            ///
            /// # Safety
            /// As the CUDA driver API documents for it.
            #[allow(non_snake_case, clippy::too_many_arguments)]
            pub unsafe fn $name($($arg: $ty),*) -> CUresult {
                type Entry = unsafe extern "C" fn($($ty),*) -> CUresult;
                static ADDRESS: OnceLock<usize> = OnceLock::new();
                let address = *ADDRESS.get_or_init(|| symbol(stringify!($name)).map_or(0, |p| p as usize));
                if address == 0 {
                    return CUresult::CUDA_ERROR_NOT_FOUND;
                }
                // SAFETY: the driver exports `$name` with this signature (cuda.h).
                let entry = unsafe { std::mem::transmute::<usize, Entry>(address) };
                // SAFETY: the caller upholds the function's contract.
                unsafe { entry($($arg),*) }
            }
        )*
    };
}

entry_points! {
    fn cuInit(flags: c_uint);
    fn cuDriverGetVersion(version: *mut c_int);
    fn cuGetErrorString(error: CUresult, text: *mut *const c_char);
    fn cuDeviceGetCount(count: *mut c_int);
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int);
    fn cuDeviceGetName(name: *mut c_char, len: c_int, device: CUdevice);
    fn cuDeviceGetAttribute(value: *mut c_int, attribute: CUdevice_attribute, device: CUdevice);
    fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, device: CUdevice);
    fn cuCtxPushCurrent_v2(ctx: CUcontext);
    fn cuCtxPopCurrent_v2(ctx: *mut CUcontext);
    fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, options: c_uint, keys: *mut CUjit_option, values: *mut *mut c_void);
    fn cuModuleGetFunction(function: *mut CUfunction, module: CUmodule, name: *const c_char);
    fn cuStreamCreate(stream: *mut CUstream, flags: c_uint);
    fn cuStreamDestroy_v2(stream: CUstream);
    fn cuStreamSynchronize(stream: CUstream);
    fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint);
    fn cuStreamGetCtx(stream: CUstream, ctx: *mut CUcontext);
    fn cuEventCreate(event: *mut CUevent, flags: c_uint);
    fn cuEventRecord(event: CUevent, stream: CUstream);
    fn cuEventSynchronize(event: CUevent);
    fn cuEventQuery(event: CUevent);
    fn cuEventDestroy_v2(event: CUevent);
    fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize);
    fn cuMemFree_v2(ptr: CUdeviceptr);
    fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream);
    fn cuMemsetD8Async(dst: CUdeviceptr, value: c_uchar, bytes: usize, stream: CUstream);
    fn cuMemHostRegister_v2(ptr: *mut c_void, bytes: usize, flags: c_uint);
    fn cuMemHostUnregister(ptr: *mut c_void);
    fn cuPointerGetAttributes(count: c_uint, attributes: *mut CUpointer_attribute, data: *mut *mut c_void, ptr: CUdeviceptr);
    fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, bytes: *mut usize, ptr: CUdeviceptr);
    fn cuMemGetHandleForAddressRange(handle: *mut c_void, ptr: CUdeviceptr, bytes: usize, kind: CUmemRangeHandleType, flags: c_ulonglong);
    fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, ptr: CUdeviceptr);
    fn cuIpcOpenMemHandle_v2(ptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint);
    fn cuIpcCloseMemHandle(ptr: CUdeviceptr);
    fn cuFlushGPUDirectRDMAWrites(target: CUflushGPUDirectRDMAWritesTarget, scope: CUflushGPUDirectRDMAWritesScope);
    fn cuLaunchKernel(
        function: CUfunction,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    );
}
