// CPU emulator of kernels.cu for the Rust tests (src/copy/cuda/emu.rs): compiles the very same
// kernel source as host C++ and runs a launch with 256 real threads per block, blocks one after
// the other, __syncthreads() as a barrier and __syncthreads_and() as a barrier with a reduction.
// "Device memory" is host memory. Built at test time with any C++17 compiler; with clang the
// 16-byte type is the kernels' own vector type (aligned loads: a misaligned 16-byte access
// faults, as on the GPU), elsewhere an aligned struct.
#include <pthread.h>

#include <atomic>
#include <cstring>

#define KV_GLOBAL extern "C"
#define KV_DEVICE static inline
#define KV_SHARED static
#define KV_LAUNCH_BOUNDS(n)
#define KV_AS_GLOBAL
#if !defined(__clang__)
#define KV_V4_DEFINED
struct alignas(16) v4u32 {
    unsigned x, y, z, w;
};
#endif

static pthread_barrier_t g_bar;
static unsigned g_gx, g_gy;
static std::atomic<int> g_and[2];
static thread_local unsigned t_tid, t_cx, t_cy, t_and_gen;

static unsigned __nvvm_read_ptx_sreg_tid_x() { return t_tid; }
static unsigned __nvvm_read_ptx_sreg_ctaid_x() { return t_cx; }
static unsigned __nvvm_read_ptx_sreg_ctaid_y() { return t_cy; }
static unsigned __nvvm_read_ptx_sreg_nctaid_x() { return g_gx; }
static unsigned __nvvm_read_ptx_sreg_nctaid_y() { return g_gy; }
static void __syncthreads() { pthread_barrier_wait(&g_bar); }
static int __nvvm_bar0_and(int pred) {
    const unsigned g = t_and_gen++ & 1u;
    if (!pred) g_and[g].store(0);
    pthread_barrier_wait(&g_bar);
    const int all = g_and[g].load();
    pthread_barrier_wait(&g_bar);
    // Every thread read the flag; reset it for the next use of this parity (two barriers away).
    if (t_tid == 0) g_and[g].store(1);
    return all;
}

#include "kernels.cu"

// Every entry takes its parameter block (a KvJob or a KvAcross) from raw bytes.
typedef void (*entry_fn)(const void *);
template <typename P, void (*F)(P)>
static void call(const void *params) {
    P p;
    std::memcpy(&p, params, sizeof p);
    F(p);
}
template <typename P, void (*F)(P)>
static constexpr entry_fn entry() {
    return call<P, F>;
}

static const struct {
    const char *name;
    entry_fn fn;
    size_t params;
} kEntries[] = {
#define KV_JOB(name) {#name, entry<KvJob, name>(), sizeof(KvJob)}
#define KV_ACROSS_JOB(name) {#name, entry<KvAcross, name>(), sizeof(KvAcross)}
    KV_JOB(kvstage_gather_v16),  KV_JOB(kvstage_gather_v8),   KV_JOB(kvstage_gather_v4),   KV_JOB(kvstage_gather_v2),
    KV_JOB(kvstage_gather_v1),   KV_JOB(kvstage_scatter_v16), KV_JOB(kvstage_scatter_v8),  KV_JOB(kvstage_scatter_v4),
    KV_JOB(kvstage_scatter_v2),  KV_JOB(kvstage_scatter_v1),  KV_ACROSS_JOB(kvstage_across_v16),
    KV_ACROSS_JOB(kvstage_across_v8), KV_ACROSS_JOB(kvstage_across_v4), KV_ACROSS_JOB(kvstage_across_v2),
    KV_ACROSS_JOB(kvstage_across_v1),
#undef KV_JOB
#undef KV_ACROSS_JOB
};

constexpr size_t kMaxParams = sizeof(KvJob) > sizeof(KvAcross) ? sizeof(KvJob) : sizeof(KvAcross);

struct Launch {
    entry_fn fn;
    unsigned char params[kMaxParams];
    unsigned tid;
};

static void *worker(void *arg) {
    Launch *l = static_cast<Launch *>(arg);
    t_tid = l->tid;
    t_and_gen = 0;
    for (unsigned y = 0; y < g_gy; ++y) {
        for (unsigned x = 0; x < g_gx; ++x) {
            t_cx = x;
            t_cy = y;
            l->fn(l->params);
            pthread_barrier_wait(&g_bar);  // the block ends: shared memory is free again
        }
    }
    return nullptr;
}

// Runs kernel `name` on a (gx, gy) grid of THREADS-thread blocks. 0, or -1 for an unknown name,
// -2 when threads cannot be started. Not reentrant (one launch at a time per process).
extern "C" int kvemu_launch(const char *name, unsigned gx, unsigned gy, const void *job) {
    entry_fn fn = nullptr;
    size_t params = 0;
    for (const auto &e : kEntries)
        if (std::strcmp(e.name, name) == 0) {
            fn = e.fn;
            params = e.params;
        }
    if (fn == nullptr) return -1;
    g_gx = gx;
    g_gy = gy;
    g_and[0].store(1);
    g_and[1].store(1);
    pthread_barrier_init(&g_bar, nullptr, THREADS);
    static Launch launches[THREADS];
    static pthread_t threads[THREADS];
    int rc = 0;
    for (unsigned i = 0; i < THREADS; ++i) {
        launches[i].fn = fn;
        std::memcpy(launches[i].params, job, params);
        launches[i].tid = i;
        if (pthread_create(&threads[i], nullptr, worker, &launches[i]) != 0) {
            // Cannot happen in practice; a partial block would deadlock the others, so give up.
            rc = -2;
            break;
        }
    }
    if (rc == 0)
        for (unsigned i = 0; i < THREADS; ++i) pthread_join(threads[i], nullptr);
    pthread_barrier_destroy(&g_bar);
    return rc;
}
