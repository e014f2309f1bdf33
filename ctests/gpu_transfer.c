/* Label gpu: a staged transfer between CUDA device pools over loopback TCP, in one process.
 * Prefill TP 2 (two engines, 2 KV heads each) -> decode TP 1 (4 KV heads), 3 layers, bf16,
 * 4-token pages, two chunks with pages out of order, the second sent layer-wise (each layer marked
 * after work on a CUDA stream, by a recorded event or by the stream). The decode pool is read back from the device
 * and compared byte for byte with a reference reshard of the prefill pools; pages outside the room
 * must be untouched. The device memory is allocated through libcuda itself (dlopen), as an
 * application would. Exit 77 without a CUDA device, unless KVSTAGE_REQUIRE_GPU=1.
 *
 * The decode staging ring (argv[1]): "host" (default, engine-owned host memory), "device"
 * (engine-allocated on device 0) or "caller-device" (device memory the test allocates). Device
 * rings run with integrity ALWAYS (the receiver reads each region back to check it), and first
 * check what must be refused: a device ring with a host pool (either registration order), an
 * engine-allocated device ring without a device, device memory through the host-only call, a
 * bad memory kind, and a sender that requires the same-host path (a device ring cannot be mapped);
 * an AUTO sender on this host downgrades to TCP and counts it. */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <stdint.h>

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

static int load(void *lib, const char *name, void *fn_slot, size_t size) {
    void *sym = dlsym(lib, name);
    if (sym == NULL) return 0;
    memcpy(fn_slot, &sym, size); /* object pointer -> function pointer, the POSIX way */
    return 1;
}

static int skip(const char *why) {
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

static void pool_init(pool *p, uint32_t tp_rank, uint32_t tp_size, unsigned seed) {
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
    REQUIRE(kvstage_kv_layout_init(&p->layout) == KVSTAGE_OK);
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

static kvstage_engine *engine_with(pool *p, int integrity) {
    kvstage_engine_options o;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_options_init(&o) == KVSTAGE_OK);
    o.integrity = integrity;
    REQUIRE(kvstage_engine_new(&o, &e) == KVSTAGE_OK);
    CHECK_OK(kvstage_engine_register_pool(e, &p->layout));
    return e;
}

/* `got` is `want` and the last error's message or a cause contains `needle`. */

static kvstage_staging_memory device_ring(void *memory, int32_t device, size_t bytes) {
    kvstage_staging_memory m;
    REQUIRE(kvstage_staging_memory_init(&m) == KVSTAGE_OK);
    m.memory_kind = KVSTAGE_MEMORY_CUDA;
    m.cuda_device = device;
    m.memory = memory;
    m.bytes = bytes;
    return m;
}

/* What a device ring must refuse, on engines of their own. */
static void check_refusals(pool *dst, pool *sender, void *device_memory) {
    kvstage_engine *e = NULL, *shm_sender = NULL;
    kvstage_engine_options o;
    kvstage_staging_memory m = device_ring(NULL, 0, 1 << 16);
    kvstage_session *s = NULL;
    char addr[64];
    kvstage_kv_layout host = dst->layout;
    uint8_t *host_buffers = (uint8_t *)calloc(2 * LAYERS, dst->buffer);
    uint64_t hk[LAYERS], hv[LAYERS];
    size_t i;

    REQUIRE(host_buffers != NULL);
    for (i = 0; i < LAYERS; i++) {
        hk[i] = (uint64_t)(uintptr_t)(host_buffers + 2 * i * dst->buffer);
        hv[i] = (uint64_t)(uintptr_t)(host_buffers + (2 * i + 1) * dst->buffer);
    }
    host.k_bases = hk;
    host.v_bases = hv;
    host.memory_kind = KVSTAGE_MEMORY_HOST;
    host.cuda_device = -1;

    /* Host pool, then a device ring; and the other order. */
    REQUIRE(kvstage_engine_new(NULL, &e) == KVSTAGE_OK);
    CHECK_OK(kvstage_engine_register_pool(e, &host));
    CHECK_ERR(kvstage_engine_register_staging_memory(e, &m), KVSTAGE_E_INVALID_ARG, "the KV pool is host memory");
    kvstage_engine_free(e);
    REQUIRE(kvstage_engine_new(NULL, &e) == KVSTAGE_OK);
    CHECK_OK(kvstage_engine_register_staging_memory(e, &m));
    CHECK_ERR(kvstage_engine_register_pool(e, &host), KVSTAGE_E_INVALID_ARG, "the KV pool is host memory");
    /* Bad descriptors. */
    m.cuda_device = -1;
    CHECK_ERR(kvstage_engine_register_staging_memory(e, &m), KVSTAGE_E_INVALID_ARG, "staging->cuda_device");
    m.cuda_device = 0;
    m.memory_kind = 7;
    CHECK_ERR(kvstage_engine_register_staging_memory(e, &m), KVSTAGE_E_INVALID_ARG, "staging->memory_kind");
    m.memory_kind = KVSTAGE_MEMORY_CUDA;
    m.struct_size = 0;
    CHECK_ERR(kvstage_engine_register_staging_memory(e, &m), KVSTAGE_E_INVALID_ARG, "staging->struct_size");
    CHECK_ERR(kvstage_engine_register_staging(e, device_memory, 1 << 16), KVSTAGE_E_INVALID_ARG, "is CUDA device memory");
    kvstage_engine_free(e);

    /* A sender that requires the same-host path: the device ring cannot be mapped. */
    e = engine_with(dst, KVSTAGE_INTEGRITY_OFF);
    m = device_ring(NULL, 0, 1 << 20);
    CHECK_OK(kvstage_engine_register_staging_memory(e, &m));
    CHECK_OK(kvstage_engine_listen_address(e, addr, sizeof addr, NULL));
    REQUIRE(kvstage_engine_options_init(&o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_SHM;
    REQUIRE(kvstage_engine_new(&o, &shm_sender) == KVSTAGE_OK);
    CHECK_OK(kvstage_engine_register_pool(shm_sender, &sender->layout));
    CHECK_ERR(kvstage_session_connect(shm_sender, addr, "shm-required", 5000, &s), KVSTAGE_E_UNSUPPORTED, "same-node CUDA IPC is not implemented");
    kvstage_engine_free(shm_sender);
    kvstage_engine_free(e);
    free(host_buffers);
}

/* One chunk layer-wise, its layers marked last first, each after the caller's work on a CUDA
 * stream: odd layers by an event recorded there, even ones by the stream itself. */
static void send_layerwise(kvstage_session *s, const kvstage_transfer_desc *d) {
    void *stream = NULL, *events[LAYERS] = {NULL};
    kvstage_op *op = NULL;
    int l;
    REQUIRE(cu.stream_create(&stream, 0) == 0);
    CHECK_INT(kvstage_transfer_layerwise_async(s, d, &op), KVSTAGE_PENDING);
    for (l = LAYERS - 1; l >= 0; l--) {
        if (l % 2) {
            REQUIRE(cu.event_create(&events[l], 0) == 0);
            REQUIRE(cu.event_record(events[l], stream) == 0);
            CHECK_OK(kvstage_op_layers_ready(op, (uint32_t)l, 1, NULL, events[l]));
        } else {
            CHECK_OK(kvstage_op_layers_ready(op, (uint32_t)l, 1, stream, NULL));
        }
    }
    CHECK_OK(kvstage_op_wait(op, 10000));
    kvstage_op_free(op);
    for (l = 0; l < LAYERS; l++)
        if (events[l] != NULL) cu.event_destroy(events[l]);
    cu.stream_destroy(stream);
}

int main(int argc, char **argv) {
    static const uint32_t SRC_PAGES[NPAGES] = {7, 2, 3, 11};
    static const uint32_t DST_PAGES[NPAGES] = {5, 14, 0, 1};
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *ctx = NULL;
    int devices = 0;
    pool src[2], dst;
    kvstage_engine *prefill[2], *decode;
    kvstage_session *session[2];
    char addr[64];
    uint32_t chunks = 0;
    uint8_t *got;
    int r, c;
    size_t b, pg, t;
    const char *ring = argc > 1 ? argv[1] : "host";
    const int device_ring_mode = strcmp(ring, "host") != 0;
    unsigned long long caller_ring = 0;
    kvstage_engine_stats st;

    if (lib == NULL) return skip("no libcuda.so.1");
    if (!load(lib, "cuInit", &cu.init, sizeof cu.init) || !load(lib, "cuDeviceGetCount", &cu.count, sizeof cu.count) ||
        !load(lib, "cuDevicePrimaryCtxRetain", &cu.retain, sizeof cu.retain) ||
        !load(lib, "cuCtxPushCurrent_v2", &cu.push, sizeof cu.push) ||
        !load(lib, "cuMemAlloc_v2", &cu.alloc, sizeof cu.alloc) || !load(lib, "cuMemFree_v2", &cu.free_, sizeof cu.free_) ||
        !load(lib, "cuMemcpyHtoD_v2", &cu.htod, sizeof cu.htod) || !load(lib, "cuMemcpyDtoH_v2", &cu.dtoh, sizeof cu.dtoh) ||
        !load(lib, "cuStreamCreate", &cu.stream_create, sizeof cu.stream_create) ||
        !load(lib, "cuStreamDestroy_v2", &cu.stream_destroy, sizeof cu.stream_destroy) ||
        !load(lib, "cuEventCreate", &cu.event_create, sizeof cu.event_create) ||
        !load(lib, "cuEventRecord", &cu.event_record, sizeof cu.event_record) ||
        !load(lib, "cuEventDestroy_v2", &cu.event_destroy, sizeof cu.event_destroy))
        return skip("libcuda.so.1 lacks a driver entry point");
    if (cu.init(0) != 0 || cu.count(&devices) != 0 || devices < 1) return skip("no CUDA device");
    REQUIRE(cu.retain(&ctx, 0) == 0);
    REQUIRE(cu.push(ctx) == 0);

    for (r = 0; r < 2; r++) pool_init(&src[r], (uint32_t)r, 2, 17u * (unsigned)r + 1);
    pool_init(&dst, 0, 1, 99);
    REQUIRE(strcmp(ring, "host") == 0 || strcmp(ring, "device") == 0 || strcmp(ring, "caller-device") == 0);
    for (r = 0; r < 2; r++) prefill[r] = engine_with(&src[r], KVSTAGE_INTEGRITY_OFF);
    decode = engine_with(&dst, device_ring_mode ? KVSTAGE_INTEGRITY_ALWAYS : KVSTAGE_INTEGRITY_OFF);
    REQUIRE(*kv_failures() == 0);
    if (!device_ring_mode) {
        CHECK_OK(kvstage_engine_register_staging(decode, NULL, 1 << 20));
    } else {
        kvstage_staging_memory m;
        REQUIRE(cu.alloc(&caller_ring, 1 << 20) == 0);
        check_refusals(&dst, &src[0], (void *)(uintptr_t)caller_ring);
        m = device_ring(strcmp(ring, "device") == 0 ? NULL : (void *)(uintptr_t)caller_ring, strcmp(ring, "device") == 0 ? 0 : -1, 1 << 20);
        CHECK_OK(kvstage_engine_register_staging_memory(decode, &m));
    }
    printf("staging ring: %s\n", ring);
    CHECK_OK(kvstage_room_open(decode, ROOM, DST_PAGES, NPAGES, CHUNK, &chunks));
    CHECK_INT(chunks, NPAGES * PAGE / CHUNK);
    CHECK_OK(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL));
    for (r = 0; r < 2; r++) {
        char id[32];
        snprintf(id, sizeof id, "gpu-p%d", r);
        CHECK_OK(kvstage_session_connect(prefill[r], addr, id, 5000, &session[r]));
    }
    REQUIRE(*kv_failures() == 0);
    for (c = 0; c < (int)chunks; c++) {
        for (r = 0; r < 2; r++) {
            kvstage_transfer_desc d;
            REQUIRE(kvstage_transfer_desc_init(&d) == KVSTAGE_OK);
            d.room = ROOM;
            d.chunk_index = (uint32_t)c;
            d.src_pages = SRC_PAGES + c * (CHUNK / PAGE);
            d.num_pages = CHUNK / PAGE;
            d.deadline_ms = 10000;
            if (c + 1 < (int)chunks)
                CHECK_OK(kvstage_transfer(session[r], &d));
            else
                send_layerwise(session[r], &d);
        }
    }
    CHECK_OK(kvstage_room_wait(decode, ROOM, 10000));

    /* Reference reshard on the host mirrors: decode heads [2r, 2r+2) of page DST_PAGES[i] come from
     * prefill rank r's page SRC_PAGES[i]; every other byte keeps its initial value. */
    for (b = 0; b < 2 * LAYERS; b++)
        for (pg = 0; pg < NPAGES; pg++)
            for (t = 0; t < PAGE; t++)
                for (r = 0; r < 2; r++) {
                    const uint8_t *from = src[r].host + b * src[r].buffer + ((size_t)SRC_PAGES[pg] * PAGE + t) * src[r].slot;
                    uint8_t *to = dst.host + b * dst.buffer + ((size_t)DST_PAGES[pg] * PAGE + t) * dst.slot + (size_t)r * src[r].slot;
                    memcpy(to, from, src[r].slot);
                }
    got = (uint8_t *)malloc(2 * LAYERS * dst.buffer);
    REQUIRE(got != NULL);
    REQUIRE(cu.dtoh(got, dst.dev, 2 * LAYERS * dst.buffer) == 0);
    for (b = 0; b < 2 * LAYERS * dst.buffer; b++)
        if (got[b] != dst.host[b]) {
            KV_FAIL_AT(__FILE__, __LINE__, "decode pool byte %lu (buffer %lu, token slot %lu) = %u, expected %u",
                       (unsigned long)b, (unsigned long)(b / dst.buffer), (unsigned long)(b % dst.buffer / dst.slot),
                       got[b], dst.host[b]);
            break;
        }
    printf("decode pool verified: %lu bytes\n", (unsigned long)(2 * LAYERS * dst.buffer));

    CHECK_OK(kvstage_room_release(decode, ROOM));
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvstage_engine_stats_get(decode, &st));
    CHECK_INT(st.ring_live_allocations, 0);
    for (r = 0; r < 2; r++) {
        memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        CHECK_OK(kvstage_engine_stats_get(prefill[r], &st));
        /* Same host: a host ring is mapped (shm); a device ring refuses it, counted, over TCP. */
        CHECK_INT(st.shm_sessions, device_ring_mode ? 0 : 1);
        CHECK_INT(st.shm_downgrades, device_ring_mode ? 1 : 0);
    }
    for (r = 0; r < 2; r++) {
        kvstage_session_free(session[r]);
        kvstage_engine_free(prefill[r]);
    }
    kvstage_engine_free(decode);
    for (r = 0; r < 2; r++) {
        cu.free_(src[r].dev);
        free(src[r].host);
    }
    cu.free_(dst.dev);
    if (caller_ring) cu.free_(caller_ring);
    free(dst.host);
    free(got);
    return kv_finish("gpu_transfer");
}
