//! CPU tests of the CUDA copy engine: the engine's own code (tables, pieces, vector width, grid,
//! scratch, staging kinds) against a backend whose "device" is host memory and whose kernels are
//! kernels.cu compiled as host C++ and run by emu_harness.cpp with 256 threads per block. The
//! cases are [`selftest`]'s: token-major pools and strided ones (every named layout, padded pages,
//! direct copies between different layouts), each checked against a reference walk of its rows.
//!
//! The harness is built at test time with a C++17 compiler (`KVSTAGE_CLANGXX`, else clang++-14,
//! clang++, c++, g++: clang first, whose 16-byte vector loads fault when misaligned, as on a GPU).
//! Without one the tests say so and pass, unless `KVSTAGE_REQUIRE_PTX_TOOLS=1` (CI).

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::engine::{Backend, DeviceCopyEngine};
use super::job::{GridLimits, KvAcross, KvJob};
use super::selftest::{self, Case, TestMemory};
use super::{Kernel, KernelOp, ReadyFence};
use crate::error::{Error, Result};

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, *const c_void) -> c_int;

struct Harness {
    launch: LaunchFn,
}

fn compiler() -> Option<String> {
    let candidates = std::env::var("KVSTAGE_CLANGXX").into_iter().chain(["clang++-14", "clang++", "c++", "g++"].map(str::to_owned));
    candidates.into_iter().find(|c| std::process::Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

fn build(dir: &Path) -> std::result::Result<Harness, String> {
    let cxx = compiler().ok_or("no C++ compiler (apt-get install clang-14)")?;
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/copy/cuda");
    let lib = dir.join(format!("libkvemu-{}.so", std::process::id()));
    let out = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-g0", "-shared", "-fPIC", "-pthread", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"])
        .arg("-I")
        .arg(&src)
        .arg(src.join("emu_harness.cpp"))
        .arg("-o")
        .arg(&lib)
        .output()
        .map_err(|e| format!("{cxx}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cxx} failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let path = CString::new(lib.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: loading the library we just built; it stays loaded for the process.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        // The mapping stays; the file is not needed any more.
        let _ = std::fs::remove_file(&lib);
        if h.is_null() {
            return Err("dlopen of the emulator failed".into());
        }
        let f = libc::dlsym(h, c"kvemu_launch".as_ptr());
        if f.is_null() {
            return Err("kvemu_launch missing".into());
        }
        Ok(Harness { launch: std::mem::transmute::<*mut c_void, LaunchFn>(f) })
    }
}

/// The emulator, or `None` (after saying why) when no clang++ is available.
fn harness() -> Option<&'static Harness> {
    static H: OnceLock<std::result::Result<Harness, String>> = OnceLock::new();
    let h = H.get_or_init(|| build(&std::env::temp_dir()));
    match h {
        Ok(h) => Some(h),
        Err(why) => {
            if std::env::var("KVSTAGE_REQUIRE_PTX_TOOLS").as_deref() == Ok("1") {
                panic!("kernel emulator unavailable: {why}");
            }
            eprintln!("kernel emulator unavailable, test skipped: {why}");
            None
        }
    }
}

/// Emulated launches run one at a time (the harness keeps global block state).
static LAUNCH_LOCK: Mutex<()> = Mutex::new(());

/// A recorded launch: kernel, grid, and the pieces per row it copied (a row's heads one by one
/// where either pool puts them apart).
#[derive(Clone, Copy, Debug)]
struct LaunchRecord {
    kernel: Kernel,
    grid: (u32, u32),
    pieces: u64,
}

/// "Device" memory: host allocations the engine and the cases treat as device memory.
#[derive(Default)]
pub(super) struct EmuBackend {
    allocs: Mutex<Vec<(u64, usize)>>,
    launches: Mutex<Vec<LaunchRecord>>,
}

impl EmuBackend {
    fn find(&self, ptr: u64) -> Option<(u64, usize)> {
        self.allocs.lock().iter().copied().find(|&(p, n)| ptr >= p && ptr < p + n as u64)
    }
}

impl Backend for EmuBackend {
    fn scoped<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        f()
    }

    fn create_stream(&self) -> Result<usize> {
        Ok(1)
    }

    unsafe fn destroy_stream(&self, _stream: usize) {}

    fn alloc(&self, bytes: u64) -> Result<u64> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1) as usize, 256).map_err(|e| Error::internal(e.to_string()))?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc(layout) } as u64;
        if p == 0 {
            return Err(Error::internal("emu alloc failed"));
        }
        self.allocs.lock().push((p, layout.size()));
        Ok(p)
    }

    unsafe fn free(&self, ptr: u64) {
        let mut list = self.allocs.lock();
        if let Some(i) = list.iter().position(|&(p, _)| p == ptr) {
            let (p, n) = list.swap_remove(i);
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(p as *mut u8, std::alloc::Layout::from_size_align_unchecked(n, 256)) };
        }
    }

    unsafe fn copy(&self, _stream: usize, dst: u64, src: u64, bytes: u64) -> Result<()> {
        // SAFETY: the engine's contract (valid, non-overlapping ranges).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize) };
        Ok(())
    }

    unsafe fn launch(&self, _stream: usize, kernel: Kernel, grid: (u32, u32), job: *const c_void) -> Result<()> {
        let h = harness().ok_or_else(|| Error::internal("no emulator"))?;
        // SAFETY: `job` is this kernel's parameter block (the engine's contract).
        let (row, piece) = unsafe {
            match kernel.op {
                KernelOp::Across => {
                    let j = &*job.cast::<KvAcross>();
                    (j.row_bytes, j.piece_bytes)
                }
                _ => {
                    let j = &*job.cast::<KvJob>();
                    (j.row_bytes, j.piece_bytes)
                }
            }
        };
        self.launches.lock().push(LaunchRecord { kernel, grid, pieces: row / piece.max(1) });
        let name = CString::new(kernel.name()).map_err(|e| Error::internal(e.to_string()))?;
        let _g = LAUNCH_LOCK.lock();
        // SAFETY: the harness reads the kernel's parameter block (same layout) and runs the kernel
        // on host memory.
        let rc = unsafe { (h.launch)(name.as_ptr(), grid.0, grid.1, job) };
        if rc != 0 {
            return Err(Error::internal(format!("emulated launch of {} failed ({rc})", kernel.name())));
        }
        Ok(())
    }

    fn wait(&self, _stream: usize, _fence: &ReadyFence) -> Result<()> {
        Ok(())
    }

    fn sync(&self, _stream: usize) -> Result<()> {
        Ok(())
    }

    fn is_device(&self, ptr: u64) -> bool {
        self.find(ptr).is_some()
    }

    fn check_device_range(&self, ptr: u64, bytes: u64) -> Result<()> {
        match self.find(ptr) {
            Some((p, n)) if ptr + bytes <= p + n as u64 => Ok(()),
            _ => Err(Error::internal(format!("{ptr:#x} + {bytes} is not emulated device memory"))),
        }
    }

    fn describe(&self) -> String {
        "emulated device".into()
    }
}

impl Drop for EmuBackend {
    fn drop(&mut self) {
        let list = self.allocs.lock().clone();
        for (p, _) in list {
            // SAFETY: every remaining allocation is ours.
            unsafe { self.free(p) };
        }
    }
}

impl TestMemory for EmuBackend {
    fn alloc(&self, bytes: usize) -> Result<u64> {
        Backend::alloc(self, bytes as u64)
    }

    fn write(&self, at: u64, data: &[u8]) -> Result<()> {
        // SAFETY: `at` is an allocation of at least `data.len()` bytes (the cases' contract).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at as *mut u8, data.len()) };
        Ok(())
    }

    fn read(&self, at: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

/// Allocations the cases make through TestMemory stay until the engine drops; the engine's own
/// scratch and tables go through Backend::alloc of the same backend.
fn run(engine: DeviceCopyEngine<EmuBackend>, cases: &[Case]) -> (usize, Vec<LaunchRecord>) {
    let (n, _) = selftest::run_cases(&engine, engine.backend(), cases, &mut |line| eprintln!("{line}")).unwrap_or_else(|e| panic!("{}", e.chain()));
    let launches = engine.backend().launches.lock().clone();
    (n, launches)
}

/// Every kernel (gather, scatter, across) ran at every width `widths`.
fn assert_widths(launches: &[LaunchRecord], widths: &[u32]) {
    for &width in widths {
        for op in [KernelOp::Gather, KernelOp::Scatter, KernelOp::Across] {
            assert!(launches.iter().any(|l| l.kernel == Kernel { op, width }), "no launch of {}", Kernel { op, width }.name());
        }
    }
}

#[test]
fn emulated_kernels_match_the_host_engine() {
    if harness().is_none() {
        return;
    }
    let (n, launches) = run(DeviceCopyEngine::new(EmuBackend::default()).unwrap(), &selftest::standard_cases());
    assert_eq!(n, selftest::standard_cases().len());
    // Every vector width was exercised, by every kernel.
    assert_widths(&launches, &Kernel::WIDTHS);
}

/// Strided pools: every named layout on both sides, padded pages, direct copies between different
/// layouts, against the reference walk. Every kernel ran with 16-byte and narrower vectors, and
/// with rows in pieces (heads apart) at 16 bytes.
#[test]
fn emulated_kernels_on_strided_pools() {
    if harness().is_none() {
        return;
    }
    let cases = selftest::layout_cases();
    let (n, launches) = run(DeviceCopyEngine::new(EmuBackend::default()).unwrap(), &cases);
    assert_eq!(n, cases.len());
    assert_widths(&launches, &Kernel::WIDTHS);
    for op in [KernelOp::Gather, KernelOp::Scatter, KernelOp::Across] {
        let k = Kernel { op, width: 16 };
        assert!(launches.iter().any(|l| l.kernel == k && l.pieces > 1), "no launch of {} with rows in pieces", k.name());
        assert!(launches.iter().any(|l| l.kernel == k && l.pieces == 1), "no launch of {} with rows whole", k.name());
    }
    // Every preset on both sides, and direct copies between different layouts.
    for p in crate::geometry::LayoutPreset::ALL {
        let on = |side: fn(&Case) -> selftest::PoolLayout| cases.iter().any(|c| side(c) == selftest::PoolLayout::Preset(p));
        assert!(on(|c| c.src_layout) && on(|c| c.dst_layout), "{} not on both sides", p.name());
    }
    assert!(cases.iter().filter(|c| c.src_layout != c.dst_layout).count() >= 10);
    assert!(cases.iter().any(|c| matches!(c.src_layout, selftest::PoolLayout::Padded(..))));
    assert!(cases.iter().any(|c| matches!(c.dst_layout, selftest::PoolLayout::Padded(..))));
}

#[test]
fn emulated_kernels_with_tiny_grids_and_scratch() {
    if harness().is_none() {
        return;
    }
    let cases = selftest::all_cases();
    // One block: every grid-stride loop runs; 1-byte scratch limit: one piece per slab.
    let engine = DeviceCopyEngine::new(EmuBackend::default()).unwrap().with_scratch_limit(1).with_grid_limits(GridLimits { x: 1, y: 1 });
    let (_, launches) = run(engine, &cases);
    assert!(launches.iter().all(|l| l.grid == (1, 1)));
    let engine = DeviceCopyEngine::new(EmuBackend::default()).unwrap().with_scratch_limit(3 << 10).with_grid_limits(GridLimits { x: 2, y: 3 });
    let (_, launches) = run(engine, &cases);
    assert!(launches.iter().any(|l| l.grid == (2, 2)));
}

#[test]
fn engine_refuses_host_pools_and_foreign_memory() {
    use crate::copy::CopyEngine;
    use crate::error::Status;
    use crate::geometry::{plan_gather, staging_layout, KvLayout, MemoryKind, ModelKind, PoolShape};
    let engine = DeviceCopyEngine::new(EmuBackend::default()).unwrap();
    let shape = PoolShape::new(ModelKind::Mha, 2, 4, 2, 2, 1);
    let mut host = vec![0u8; 1024];
    let layout = KvLayout::new(shape.clone(), 4, MemoryKind::Host, vec![host.as_mut_ptr() as usize, host.as_mut_ptr() as usize + 512]);
    let st = staging_layout(&shape, &shape, 4).unwrap();
    let g = plan_gather(&shape, &[1, 0], 0, &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
    let mut buf = vec![0u8; st.total_bytes as usize];
    let e = unsafe { engine.gather(&g, &layout, buf.as_mut_ptr()) }.unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_UNSUPPORTED);
    assert_eq!(engine.check_pool(&layout).unwrap_err().code(), Status::KVSTAGE_E_UNSUPPORTED);
    // A "CUDA" pool whose memory is not the device's: refused by check_pool, naming the buffer.
    let cuda = KvLayout { memory: MemoryKind::Cuda, ..layout.clone() };
    let e = engine.check_pool(&cuda).unwrap_err();
    assert!(e.message().contains("bases[0]"), "{}", e.chain());
    // A plan outside the pool is refused before any launch (same check as the host engine).
    let dev = Backend::alloc(engine.backend(), 1024).unwrap() as usize;
    let cuda = KvLayout { bases: vec![dev, dev + 512], ..cuda };
    engine.check_pool(&cuda).unwrap();
    let far = plan_gather(&shape, &[1, 3], 0, &st, &st.region_of(&shape).unwrap().unwrap()).unwrap();
    let mut small = cuda.clone();
    small.capacity_pages = 2;
    let e = unsafe { engine.gather(&far, &small, buf.as_mut_ptr()) }.unwrap_err();
    assert_eq!(e.code(), Status::KVSTAGE_E_INVALID_ARG);
    let e = unsafe { engine.gather(&g, &cuda, std::ptr::null_mut()) }.unwrap_err();
    assert!(e.message().contains("`staging`: is NULL"));
    assert!(engine.backend().launches.lock().is_empty());
    let _ = &mut host;
}

