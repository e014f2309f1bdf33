// A fake libcuda.so.1 with one "GPU" whose memory is host memory and whose kernels are
// src/copy/cuda/kernels.cu run by the CPU emulator (src/copy/cuda/emu_harness.cpp). It exports
// exactly the driver entry points kvstage calls (plus what the GPU tests use), so the CUDA engine's
// driver-side code — presence and symbol checks, contexts, module loading, pointer attributes,
// launches with the real parameter block, fences, pinning — runs on a machine without a GPU.
// Streams execute every operation at once (in order), except host-to-device copies queued on a
// stream: those run only when that stream is synchronized, records an event or runs later work,
// like a GPU that has not got to them yet, so code that refills the source or relies on the bytes
// before then sees it. Time on streams is modelled only as far as the ready points need it: a
// stream can be held back (kvstage_fake_stream_delay, as a caller's long kernel would), an event
// recorded on it fires when the stream gets there (cuEventQuery says CUDA_ERROR_NOT_READY until
// then, cuEventSynchronize sleeps), a stream made to wait for an event is held back until it fires,
// and work or a synchronize on a held-back stream blocks the calling thread until then (the work
// itself still runs at once). What the fake cannot show is real concurrency, the PTX JIT and device
// speed.
// Device memory is mapped PROT_NONE except while the fake itself copies or runs a kernel, so that
// host code touching it (which on a GPU reads garbage or faults) crashes here too.
// Each allocation is a memfd, so that CUDA IPC works between processes: a handle names the
// exporting process and descriptor, and cuIpcOpenMemHandle maps /proc/<pid>/fd/<fd> (like CUDA,
// it refuses a handle made by the opening process itself). KVSTAGE_FAKE_CUDA_NO_IPC=1 makes
// cuIpcGetMemHandle fail as it does for memory legacy IPC cannot share (VMM allocations).
// cuMemGetHandleForAddressRange hands out the allocation's memfd as its dma-buf (whole
// allocations only), which kvstage's soft RDMA fabric maps as a NIC would reach the memory;
// KVSTAGE_FAKE_CUDA_NO_DMABUF=1 makes it fail as on a driver or GPU without dma-buf support.
//
// Only for tests (ctests of label api run `kvstage-cuda check` and gpu_transfer against it).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include "emu_harness.cpp"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;

enum : int {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_INVALID_CONTEXT = 201,
    E_INVALID_IMAGE = 200,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_HOST_MEMORY_ALREADY_REGISTERED = 712,
    E_HOST_MEMORY_NOT_REGISTERED = 713,
    E_NOT_SUPPORTED = 801,
};

typedef struct {
    char reserved[64];
} CUipcMemHandle;

namespace {
struct Range {
    uintptr_t ptr;
    size_t bytes;
    int fd = -1;         // the allocation's memfd (-1: opened from another process's handle)
    bool opened = false; // mapped by cuIpcOpenMemHandle_v2
};
struct IpcPayload {
    char magic[8];
    int32_t pid, fd;
    uint64_t bytes;
};
const char kIpcMagic[8] = {'k', 'v', 'f', 'a', 'k', 'e', 'i', 'p'};
std::mutex g_mu;
std::vector<Range> g_device, g_pinned;
int g_ctx_token;
// Host-to-device copies queued on a stream and not run yet, in order.
struct QueuedCopy {
    CUstream stream;
    uintptr_t dst, src;
    size_t n;
};
std::vector<QueuedCopy> g_queued;
thread_local std::vector<CUcontext> t_ctx;
int g_stream_count;
using Clock = std::chrono::steady_clock;
// When each held-back stream gets to work queued on it now (absent: at once).
std::map<CUstream, Clock::time_point> g_stream_busy_until;
// An event: when the work recorded before it is done.
struct FakeEvent {
    Clock::time_point fires;
};
Clock::time_point busy_until(CUstream s) {  // g_mu held
    auto it = g_stream_busy_until.find(s);
    return it == g_stream_busy_until.end() ? Clock::time_point{} : it->second;
}
// Blocks the caller until `s` got to the work it is about to queue (without the lock).
void wait_for_stream(CUstream s) {
    Clock::time_point until;
    {
        std::lock_guard<std::mutex> g(g_mu);
        until = busy_until(s);
    }
    std::this_thread::sleep_until(until);
}

bool inside(const std::vector<Range> &list, uintptr_t p) {
    for (const Range &r : list)
        if (p >= r.ptr && p < r.ptr + r.bytes) return true;
    return false;
}

size_t mapped_bytes(size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

void protect_device(int prot) {
    for (const Range &r : g_device) mprotect((void *)r.ptr, mapped_bytes(r.bytes), prot);
}

// The "device" side of the fake at work: every device allocation readable and writable until the
// scope ends (one such scope at a time, holding g_mu).
struct DeviceAccess {
    std::lock_guard<std::mutex> lock{g_mu};
    DeviceAccess() { protect_device(PROT_READ | PROT_WRITE); }
    ~DeviceAccess() { protect_device(PROT_NONE); }
    DeviceAccess(const DeviceAccess &) = delete;
    DeviceAccess &operator=(const DeviceAccess &) = delete;
    // Runs the copies queued on `stream` (its earlier work), in order.
    void catch_up(CUstream stream) {
        for (auto it = g_queued.begin(); it != g_queued.end();) {
            if (it->stream == stream) {
                std::memcpy((void *)it->dst, (const void *)it->src, it->n);
                it = g_queued.erase(it);
            } else {
                ++it;
            }
        }
    }
};
}  // namespace

#define API extern "C" __attribute__((visibility("default")))

int kvstage_fake_libcuda = 1;  // marker for tests
// Bytes copied from host to device memory and back (tests check that a path stays on the device).
unsigned long long kvstage_fake_htod_bytes = 0, kvstage_fake_dtoh_bytes = 0;

API CUresult cuInit(unsigned) { return OK; }
API CUresult cuDriverGetVersion(int *v) { return v ? (*v = 12080, OK) : E_INVALID_VALUE; }
API CUresult cuDeviceGetCount(int *n) { return n ? (*n = 1, OK) : E_INVALID_VALUE; }
API CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (d == nullptr || ordinal != 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
    *d = 0;
    return OK;
}
API CUresult cuDeviceGetName(char *name, int len, CUdevice) {
    if (name == nullptr || len <= 0) return E_INVALID_VALUE;
    std::strncpy(name, "kvstage fake GPU (CPU emulator)", (size_t)len - 1);
    name[len - 1] = 0;
    return OK;
}
static bool env_set(const char *name);
API CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice) {
    if (v == nullptr) return E_INVALID_VALUE;
    *v = attr == 75 ? 9 : 0;  // compute capability 9.0
    if (attr == 116) *v = 1;  // GPUDirect RDMA supported
    // GPUDirect RDMA writes ordering: owner, as an H200 (driver 580) reports; KVSTAGE_FAKE_CUDA_RDMA_UNORDERED
    // makes it none (the device's kernels need cuFlushGPUDirectRDMAWrites to see a NIC's writes).
    if (attr == 118) *v = env_set("KVSTAGE_FAKE_CUDA_RDMA_UNORDERED") ? 0 : 100;
    if (attr == 124) *v = env_set("KVSTAGE_FAKE_CUDA_NO_DMABUF") ? 0 : 1;  // dma-buf export
    return OK;
}
API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice) { return c ? (*c = &g_ctx_token, OK) : E_INVALID_VALUE; }
API CUresult cuCtxPushCurrent_v2(CUcontext c) {
    if (c != &g_ctx_token) return E_INVALID_CONTEXT;
    t_ctx.push_back(c);
    return OK;
}
API CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    if (t_ctx.empty()) return E_INVALID_CONTEXT;
    if (c) *c = t_ctx.back();
    t_ctx.pop_back();
    return OK;
}
API CUresult cuCtxGetCurrent(CUcontext *c) { return c ? (*c = t_ctx.empty() ? nullptr : t_ctx.back(), OK) : E_INVALID_VALUE; }
static CUresult need_ctx() { return t_ctx.empty() ? E_INVALID_CONTEXT : OK; }

API CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned, int *, void **) {
    if (m == nullptr || image == nullptr) return E_INVALID_VALUE;
    if (need_ctx()) return E_INVALID_CONTEXT;
    const char *ptx = static_cast<const char *>(image);
    if (std::strstr(ptx, ".target sm_80") == nullptr || std::strstr(ptx, ".entry kvstage_gather_v16") == nullptr)
        return E_INVALID_IMAGE;
    *m = &g_ctx_token;
    return OK;
}
API CUresult cuModuleGetFunction(CUfunction *f, CUmodule, const char *name) {
    if (f == nullptr || name == nullptr) return E_INVALID_VALUE;
    for (const auto &e : kEntries)
        if (std::strcmp(e.name, name) == 0) {
            *f = const_cast<char *>(e.name);
            return OK;
        }
    return E_NOT_FOUND;
}

API CUresult cuStreamCreate(CUstream *s, unsigned) {
    if (s == nullptr) return E_INVALID_VALUE;
    if (need_ctx()) return E_INVALID_CONTEXT;
    std::lock_guard<std::mutex> g(g_mu);
    *s = reinterpret_cast<CUstream>((uintptr_t)0x1000 + 16 * (uintptr_t)++g_stream_count);
    return OK;
}
API CUresult cuStreamDestroy_v2(CUstream s) {
    DeviceAccess device;
    device.catch_up(s);
    g_stream_busy_until.erase(s);
    return OK;
}
API CUresult cuStreamSynchronize(CUstream s) {
    wait_for_stream(s);
    DeviceAccess device;
    device.catch_up(s);
    return OK;
}
API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
    if (e == nullptr) return E_INVALID_HANDLE;
    std::lock_guard<std::mutex> g(g_mu);
    g_stream_busy_until[s] = std::max(busy_until(s), static_cast<FakeEvent *>(e)->fires);
    return OK;
}
API CUresult cuStreamGetCtx(CUstream s, CUcontext *c) {
    if (s == nullptr || c == nullptr) return E_INVALID_HANDLE;
    *c = &g_ctx_token;
    return OK;
}
API CUresult cuEventCreate(CUevent *e, unsigned) {
    if (e == nullptr) return E_INVALID_VALUE;
    if (need_ctx()) return E_INVALID_CONTEXT;
    *e = new FakeEvent{Clock::now()};
    return OK;
}
API CUresult cuEventRecord(CUevent e, CUstream s) {
    if (e == nullptr) return E_INVALID_HANDLE;
    DeviceAccess device;
    device.catch_up(s);
    static_cast<FakeEvent *>(e)->fires = std::max(Clock::now(), busy_until(s));
    return OK;
}
API CUresult cuEventQuery(CUevent e) {
    if (e == nullptr) return E_INVALID_HANDLE;
    std::lock_guard<std::mutex> g(g_mu);
    return Clock::now() >= static_cast<FakeEvent *>(e)->fires ? OK : E_NOT_READY;
}
API CUresult cuEventSynchronize(CUevent e) {
    if (e == nullptr) return E_INVALID_HANDLE;
    Clock::time_point fires;
    {
        std::lock_guard<std::mutex> g(g_mu);
        fires = static_cast<FakeEvent *>(e)->fires;
    }
    std::this_thread::sleep_until(fires);
    return OK;
}
API CUresult cuEventDestroy_v2(CUevent e) {
    delete static_cast<FakeEvent *>(e);
    return OK;
}
// Tests: holds `s` back for `ms` from now, as a long kernel the caller queued there would.
API void kvstage_fake_stream_delay(CUstream s, unsigned ms) {
    std::lock_guard<std::mutex> g(g_mu);
    g_stream_busy_until[s] = std::max(busy_until(s), Clock::now() + std::chrono::milliseconds(ms));
}

API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
    if (p == nullptr || bytes == 0) return E_INVALID_VALUE;
    if (need_ctx()) return E_INVALID_CONTEXT;
    const int fd = memfd_create("kvstage-fake-gpu", MFD_CLOEXEC);
    if (fd < 0) return E_OUT_OF_MEMORY;
    void *m = ftruncate(fd, (off_t)mapped_bytes(bytes)) == 0
                  ? mmap(nullptr, mapped_bytes(bytes), PROT_NONE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
    if (m == MAP_FAILED) {
        close(fd);
        return E_OUT_OF_MEMORY;
    }
    DeviceAccess device;
    g_device.push_back({(uintptr_t)m, bytes, fd, false});
    mprotect(m, mapped_bytes(bytes), PROT_READ | PROT_WRITE);
    std::memset(m, 0xCD, bytes);
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}
// Unmaps the range starting at `p` that `opened` says (an allocation, or an opened IPC handle).
static CUresult release(CUdeviceptr p, bool opened) {
    std::lock_guard<std::mutex> g(g_mu);
    for (size_t i = 0; i < g_device.size(); ++i)
        if (g_device[i].ptr == (uintptr_t)p && g_device[i].opened == opened) {
            munmap((void *)(uintptr_t)p, mapped_bytes(g_device[i].bytes));
            if (g_device[i].fd >= 0) close(g_device[i].fd);
            g_device.erase(g_device.begin() + (long)i);
            return OK;
        }
    return E_INVALID_VALUE;
}
API CUresult cuMemFree_v2(CUdeviceptr p) { return release(p, false); }
static bool env_set(const char *name) {
    const char *v = std::getenv(name);
    return v != nullptr && std::strcmp(v, "1") == 0;
}
API CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t size, int type, unsigned long long flags) {
    if (handle == nullptr || type != 1 /* DMA_BUF_FD */ || flags != 0) return E_INVALID_VALUE;
    if (env_set("KVSTAGE_FAKE_CUDA_NO_DMABUF")) return E_NOT_SUPPORTED;
    std::lock_guard<std::mutex> g(g_mu);
    for (const Range &r : g_device)
        if (!r.opened && r.ptr == (uintptr_t)p) {
            if (size == 0 || size % (size_t)sysconf(_SC_PAGESIZE) != 0 || size > mapped_bytes(r.bytes)) return E_INVALID_VALUE;
            const int fd = fcntl(r.fd, F_DUPFD_CLOEXEC, 0);
            if (fd < 0) return E_OUT_OF_MEMORY;
            *static_cast<int *>(handle) = fd;
            return OK;
        }
    return E_INVALID_VALUE;
}
API CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    if (h == nullptr) return E_INVALID_VALUE;
    if (env_set("KVSTAGE_FAKE_CUDA_NO_IPC")) return E_NOT_SUPPORTED;
    std::lock_guard<std::mutex> g(g_mu);
    for (const Range &r : g_device)
        if (!r.opened && (uintptr_t)p >= r.ptr && (uintptr_t)p < r.ptr + r.bytes) {
            IpcPayload payload;
            std::memcpy(payload.magic, kIpcMagic, sizeof kIpcMagic);
            payload.pid = (int32_t)getpid();
            payload.fd = r.fd;
            payload.bytes = r.bytes;
            std::memset(h, 0, sizeof *h);
            std::memcpy(h->reserved, &payload, sizeof payload);
            return OK;
        }
    return E_INVALID_VALUE;
}
API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned) {
    if (p == nullptr) return E_INVALID_VALUE;
    if (need_ctx()) return E_INVALID_CONTEXT;
    IpcPayload payload;
    std::memcpy(&payload, h.reserved, sizeof payload);
    if (std::memcmp(payload.magic, kIpcMagic, sizeof kIpcMagic) != 0) return E_INVALID_VALUE;
    if (payload.pid == (int32_t)getpid()) return E_INVALID_CONTEXT;  // as CUDA: not in the exporting process
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)payload.pid, (int)payload.fd);
    const int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return E_INVALID_VALUE;
    void *m = mmap(nullptr, mapped_bytes(payload.bytes), PROT_NONE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return E_OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(g_mu);
    g_device.push_back({(uintptr_t)m, (size_t)payload.bytes, -1, true});
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}
API CUresult cuIpcCloseMemHandle(CUdeviceptr p) { return release(p, true); }
API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    if (stream != nullptr) wait_for_stream(stream);
    DeviceAccess device;
    const bool to_device = inside(g_device, (uintptr_t)dst), from_device = inside(g_device, (uintptr_t)src);
    if (to_device && !from_device) kvstage_fake_htod_bytes += n;
    if (from_device && !to_device) kvstage_fake_dtoh_bytes += n;
    if (stream != nullptr && to_device && !from_device) {
        g_queued.push_back({stream, (uintptr_t)dst, (uintptr_t)src, n});
        return OK;
    }
    device.catch_up(stream);
    std::memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return OK;
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream) {
    return cuMemcpyAsync(dst, (CUdeviceptr)(uintptr_t)src, n, nullptr);
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr); }
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { return cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, src, n, nullptr); }
API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
    wait_for_stream(s);
    DeviceAccess device;
    device.catch_up(s);
    std::memset((void *)(uintptr_t)p, v, n);
    return OK;
}
API CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned) {
    if (p == nullptr || bytes == 0) return E_INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mu);
    if (inside(g_pinned, (uintptr_t)p)) return E_HOST_MEMORY_ALREADY_REGISTERED;
    g_pinned.push_back({(uintptr_t)p, bytes});
    return OK;
}
API CUresult cuMemHostUnregister(void *p) {
    std::lock_guard<std::mutex> g(g_mu);
    for (size_t i = 0; i < g_pinned.size(); ++i)
        if (g_pinned[i].ptr == (uintptr_t)p) {
            g_pinned.erase(g_pinned.begin() + (long)i);
            return OK;
        }
    return E_HOST_MEMORY_NOT_REGISTERED;
}
// As the real driver: the singular call fails for memory it does not know (pageable host memory),
// an API error that compute-sanitizer reports (counted here: kvstage must not probe that way); the
// plural call answers it with memory type 0 and ordinal -2, and success.
unsigned long long kvstage_fake_pointer_probe_errors = 0;
// cuFlushGPUDirectRDMAWrites calls (tests check one comes before device work reads a NIC's writes).
unsigned long long kvstage_fake_rdma_flushes = 0;
API CUresult cuFlushGPUDirectRDMAWrites(int target, int scope) {
    if (target != 0 || (scope != 100 && scope != 200)) return E_INVALID_VALUE;
    if (need_ctx()) return E_INVALID_CONTEXT;
    std::lock_guard<std::mutex> g(g_mu);
    ++kvstage_fake_rdma_flushes;
    return OK;
}
API CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    if (data == nullptr) return E_INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mu);
    const bool dev = inside(g_device, (uintptr_t)p), pinned = inside(g_pinned, (uintptr_t)p);
    if (!dev && !pinned) {  // unknown to the driver (pageable)
        ++kvstage_fake_pointer_probe_errors;
        return E_INVALID_VALUE;
    }
    if (attr == 2) {                              // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
        *static_cast<unsigned *>(data) = dev ? 2u : 1u;
        return OK;
    }
    if (attr == 9) {  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        *static_cast<int *>(data) = 0;
        return OK;
    }
    return E_INVALID_VALUE;
}
API CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p) {
    if (attrs == nullptr || data == nullptr) return E_INVALID_VALUE;
    std::lock_guard<std::mutex> g(g_mu);
    const bool dev = inside(g_device, (uintptr_t)p), pinned = inside(g_pinned, (uintptr_t)p);
    for (unsigned i = 0; i < n; ++i) {
        if (data[i] == nullptr) return E_INVALID_VALUE;
        if (attrs[i] == 2)  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
            *static_cast<unsigned *>(data[i]) = dev ? 2u : pinned ? 1u : 0u;
        else if (attrs[i] == 9)  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
            *static_cast<int *>(data[i]) = dev || pinned ? 0 : -2;
        else
            return E_INVALID_VALUE;
    }
    return OK;
}
API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    std::lock_guard<std::mutex> g(g_mu);
    for (const Range &r : g_device)
        if ((uintptr_t)p >= r.ptr && (uintptr_t)p < r.ptr + r.bytes) {
            if (base) *base = (CUdeviceptr)r.ptr;
            if (size) *size = r.bytes;
            return OK;
        }
    return E_NOT_FOUND;
}
API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned smem, CUstream stream, void **params, void **extra) {
    if (f == nullptr || params == nullptr || extra != nullptr) return E_INVALID_VALUE;
    if (gz != 1 || bx != THREADS || by != 1 || bz != 1 || smem != 0 || gx == 0 || gy == 0) return E_INVALID_VALUE;
    if (need_ctx()) return E_INVALID_CONTEXT;
    wait_for_stream(stream);
    DeviceAccess device;  // the emulator runs one launch at a time
    device.catch_up(stream);
    return kvemu_launch(static_cast<const char *>(f), gx, gy, params[0]) == 0 ? OK : E_INVALID_VALUE;
}
API CUresult cuGetErrorName(CUresult e, const char **s) {
    if (s == nullptr) return E_INVALID_VALUE;
    *s = e == 0 ? "CUDA_SUCCESS" : "CUDA_ERROR_FAKE";
    return OK;
}
API CUresult cuGetErrorString(CUresult e, const char **s) {
    if (s == nullptr) return E_INVALID_VALUE;
    *s = e == 0 ? "no error" : "error reported by the fake driver";
    return OK;
}
