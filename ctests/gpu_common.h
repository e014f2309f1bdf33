/* Shared by the GPU ctests (gpu_transfer, gpu_ready_fence): the driver entry points loaded from
 * libcuda.so.1 as an application would, the test geometry and its device pools, the fake driver's
 * counters. Header only (static functions), C11. */
#ifndef KVSTAGE_GPU_COMMON_H
#define KVSTAGE_GPU_COMMON_H

#include <dlfcn.h>
#include <stdint.h>
#include <time.h>

#include "kvstage_check.h"

enum { LAYERS = 3, HEADS = 4, DIM = 64, DT = 2, PAGE = 4, CAPACITY = 16, NPAGES = 4, CHUNK = 8, ROOM = 42 };

typedef int (*cu_init_fn)(unsigned);
typedef int (*cu_count_fn)(int *);
typedef int (*cu_retain_fn)(void **, int);
typedef int (*cu_push_fn)(void *);
typedef int (*cu_alloc_fn)(unsigned long long *, size_t);
typedef int (*cu_free_fn)(unsigned long long);
typedef int (*cu_htod_fn)(unsigned long long, const void *, size_t);
typedef int (*cu_dtoh_fn)(void *, unsigned long long, size_t);
typedef int (*cu_create_fn)(void **, unsigned); /* cuStreamCreate, cuEventCreate */
typedef int (*cu_destroy_fn)(void *);           /* cuStreamDestroy_v2, cuEventDestroy_v2 */
typedef int (*cu_record_fn)(void *, void *);

static struct {
    cu_init_fn init;
    cu_count_fn count;
    cu_retain_fn retain;
    cu_push_fn push;
    cu_alloc_fn alloc;
    cu_free_fn free_;
    cu_htod_fn htod;
    cu_dtoh_fn dtoh;
    cu_create_fn stream_create, event_create;
    cu_destroy_fn stream_destroy, event_destroy;
    cu_record_fn event_record;
} cu;

static inline int load(void *lib, const char *name, void *fn_slot, size_t size) {
    void *sym = dlsym(lib, name);
    if (sym == NULL) return 0;
    memcpy(fn_slot, &sym, size); /* object pointer -> function pointer, the POSIX way */
    return 1;
}

static inline int skip(const char *why) {
    const char *require = getenv("KVSTAGE_REQUIRE_GPU");
    if (require != NULL && strcmp(require, "1") == 0) {
        fprintf(stderr, "KVSTAGE_REQUIRE_GPU=1 but %s\n", why);
        return 1;
    }
    printf("%s: skipped\n", why);
    return 77;
}

typedef struct pool {
    uint32_t local_heads;
    size_t slot, buffer; /* bytes of a token slot, of a buffer */
    unsigned long long dev;
    uint8_t *host; /* what the device holds (mirror) */
    uint64_t k[LAYERS], v[LAYERS];
    kvstage_kv_layout layout;
} pool;

static inline void pool_init(pool *p, uint32_t tp_rank, uint32_t tp_size, unsigned seed) {
    size_t i;
    p->local_heads = HEADS / tp_size;
    p->slot = (size_t)p->local_heads * DIM * DT;
    p->buffer = (size_t)CAPACITY * PAGE * p->slot;
    p->host = (uint8_t *)malloc(2 * LAYERS * p->buffer);
    REQUIRE(p->host != NULL);
    for (i = 0; i < 2 * LAYERS * p->buffer; i++) p->host[i] = (uint8_t)((i * 2654435761u + seed) >> 7);
    REQUIRE(cu.alloc(&p->dev, 2 * LAYERS * p->buffer) == 0);
    REQUIRE(cu.htod(p->dev, p->host, 2 * LAYERS * p->buffer) == 0);
    for (i = 0; i < LAYERS; i++) {
        p->k[i] = p->dev + (2 * i) * p->buffer;
        p->v[i] = p->dev + (2 * i + 1) * p->buffer;
    }
    REQUIRE(kvstage_kv_layout_init(&p->layout, sizeof p->layout) == KVSTAGE_OK);
    p->layout.page_size = PAGE;
    p->layout.local_heads = p->local_heads;
    p->layout.global_heads = HEADS;
    p->layout.head_dim = DIM;
    p->layout.dtype_bytes = DT;
    p->layout.tp_rank = tp_rank;
    p->layout.tp_size = tp_size;
    p->layout.num_layers = LAYERS;
    p->layout.k_bases = p->k;
    p->layout.v_bases = p->v;
    p->layout.capacity_pages = CAPACITY;
    p->layout.memory_kind = KVSTAGE_MEMORY_CUDA;
    p->layout.cuda_device = 0;
}

static inline kvstage_engine_stats stats_of(const kvstage_engine *e) {
    kvstage_engine_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvstage_engine_stats_get(e, &st));
    return st;
}

/* Loads the driver entry points, makes device 0's primary context current: 0, or an exit code. */
static inline int start_cuda(void **lib) {
    void *ctx = NULL;
    int devices = 0;
    *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (*lib == NULL) return skip("no libcuda.so.1");
    if (!load(*lib, "cuInit", &cu.init, sizeof cu.init) || !load(*lib, "cuDeviceGetCount", &cu.count, sizeof cu.count) ||
        !load(*lib, "cuDevicePrimaryCtxRetain", &cu.retain, sizeof cu.retain) ||
        !load(*lib, "cuCtxPushCurrent_v2", &cu.push, sizeof cu.push) ||
        !load(*lib, "cuMemAlloc_v2", &cu.alloc, sizeof cu.alloc) || !load(*lib, "cuMemFree_v2", &cu.free_, sizeof cu.free_) ||
        !load(*lib, "cuMemcpyHtoD_v2", &cu.htod, sizeof cu.htod) || !load(*lib, "cuMemcpyDtoH_v2", &cu.dtoh, sizeof cu.dtoh) ||
        !load(*lib, "cuStreamCreate", &cu.stream_create, sizeof cu.stream_create) ||
        !load(*lib, "cuStreamDestroy_v2", &cu.stream_destroy, sizeof cu.stream_destroy) ||
        !load(*lib, "cuEventCreate", &cu.event_create, sizeof cu.event_create) ||
        !load(*lib, "cuEventRecord", &cu.event_record, sizeof cu.event_record) ||
        !load(*lib, "cuEventDestroy_v2", &cu.event_destroy, sizeof cu.event_destroy))
        return skip("libcuda.so.1 lacks a driver entry point");
    if (cu.init(0) != 0 || cu.count(&devices) != 0 || devices < 1) return skip("no CUDA device");
    REQUIRE(cu.retain(&ctx, 0) == 0);
    REQUIRE(cu.push(ctx) == 0);
    return 0;
}

/* Bytes the fake driver copied host to device and back (NULL on a real driver). */
static unsigned long long *fake_htod_bytes, *fake_dtoh_bytes;
/* Pointer probes the real driver answers with an error; GPUDirect RDMA flushes (NULL on a real
 * driver). */
static unsigned long long *fake_probe_errors, *fake_rdma_flushes;

/* The fake driver's counters, once CUDA started. */
static inline void find_fake_counters(void *lib) {
    fake_htod_bytes = (unsigned long long *)dlsym(lib, "kvstage_fake_htod_bytes");
    fake_dtoh_bytes = (unsigned long long *)dlsym(lib, "kvstage_fake_dtoh_bytes");
    fake_probe_errors = (unsigned long long *)dlsym(lib, "kvstage_fake_pointer_probe_errors");
    fake_rdma_flushes = (unsigned long long *)dlsym(lib, "kvstage_fake_rdma_flushes");
}

/* The end of a process of the test: no driver call answered with an error that compute-sanitizer
 * would report (on an H200 it reported every host pointer probed by cuPointerGetAttribute). */
static inline int finish(const char *name) {
    if (fake_probe_errors != NULL) CHECK_INT(*fake_probe_errors, 0);
    return kv_finish(name);
}

static inline void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

#endif
