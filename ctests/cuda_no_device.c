/* A CUDA KV layout on a host that cannot run it is refused at registration with a kvstage error,
 * never a crash, and the engine stays usable:
 *   - cuda_no_libcuda: no libcuda.so.1 at all: KVSTAGE_E_NO_DEVICE, class CUDA, the message says
 *     the driver library cannot be loaded. Skipped (77) where a real libcuda.so.1 loads.
 *   - cuda_stub_libcuda (KVSTAGE_EXPECT_STUB=1, LD_LIBRARY_PATH = the stub's directory): the stub
 *     driver's cuInit returns CUDA_ERROR_NO_DEVICE: KVSTAGE_E_NO_DEVICE whose causes name it. */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <stdint.h>

#include "kvstage_check.h"

enum { LAYERS = 2, PAGE = 4, CAPACITY = 8, HEADS = 2, DIM = 8 };

static void layout_init(kvstage_kv_layout *l, uint64_t *k, uint64_t *v, int32_t memory_kind) {
    REQUIRE(kvstage_kv_layout_init(l, sizeof *l) == KVSTAGE_OK);
    CHECK_INT(l->cuda_device, -1);
    l->page_size = PAGE;
    l->local_heads = HEADS;
    l->global_heads = HEADS;
    l->head_dim = DIM;
    l->dtype_bytes = 2;
    l->num_layers = LAYERS;
    l->k_bases = k;
    l->v_bases = v;
    l->capacity_pages = CAPACITY;
    l->memory_kind = memory_kind;
}

static int any_cause_contains(const kvstage_error *e, const char *needle) {
    size_t i;
    for (i = 0; i < e->cause_count; i++)
        if (strstr(e->causes[i], needle) != NULL) return 1;
    return 0;
}

int main(void) {
    const char *stub = getenv("KVSTAGE_EXPECT_STUB");
    int expect_stub = stub != NULL && strcmp(stub, "1") == 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    kvstage_engine *engine = NULL;
    kvstage_kv_layout layout;
    kvstage_capabilities caps;
    static uint8_t host[2 * LAYERS][CAPACITY * PAGE * HEADS * DIM * 2];
    /* Plausible device addresses: never dereferenced, the driver is asked about them first. */
    uint64_t k[LAYERS] = {0x7f0000000000ull, 0x7f0000100000ull};
    uint64_t v[LAYERS] = {0x7f0000200000ull, 0x7f0000300000ull};
    uint64_t hk[LAYERS], hv[LAYERS];
    int round;

    if (expect_stub) {
        REQUIRE(lib != NULL);
        REQUIRE(dlsym(lib, "kvstage_stub_libcuda") != NULL); /* the stub, not a real driver */
    } else if (lib != NULL) {
        printf("a libcuda.so.1 loads on this host: the no-libcuda case cannot be shown; skipped\n");
        return 77;
    }

    memset(&caps, 0, sizeof caps);
    caps.struct_size = sizeof caps;
    CHECK_OK(kvstage_capabilities_get(&caps));
    CHECK_INT(caps.cuda_memory, 0);

    CHECK_OK(kvstage_engine_new(NULL, &engine));
    REQUIRE(engine != NULL);
    layout_init(&layout, k, v, KVSTAGE_MEMORY_CUDA);
    CHECK_OK(kvstage_kv_layout_validate(&layout)); /* pure: addresses only */
    for (round = 0; round < 2; ++round) {            /* the failure is remembered, not a crash */
        const kvstage_error *e;
        CHECK_INT(kvstage_pool_register(engine, &layout), KVSTAGE_E_NO_DEVICE);
        e = kvstage_error_last();
        CHECK_INT(e->code, KVSTAGE_E_NO_DEVICE);
        CHECK_INT(e->klass, KVSTAGE_CLASS_CUDA);
        if (expect_stub) {
            CHECK_CONTAINS(e->message, "CUDA driver initialization failed");
            CHECK(any_cause_contains(e, "cuInit: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"));
        } else {
            CHECK_CONTAINS(e->message, "libcuda.so.1 cannot be loaded");
        }
        if (*kv_failures() != 0) kv_print_last_error("kvstage_pool_register");
    }
    /* An explicit device ordinal: the same answer. */
    layout.cuda_device = 0;
    CHECK_INT(kvstage_pool_register(engine, &layout), KVSTAGE_E_NO_DEVICE);

    /* The engine still takes a host pool. */
    for (round = 0; round < LAYERS; ++round) {
        hk[round] = (uint64_t)(uintptr_t)host[2 * round];
        hv[round] = (uint64_t)(uintptr_t)host[2 * round + 1];
    }
    layout_init(&layout, hk, hv, KVSTAGE_MEMORY_HOST);
    CHECK_OK(kvstage_pool_register(engine, &layout));
    kvstage_engine_free(engine);
    if (lib != NULL) dlclose(lib);
    return kv_finish(expect_stub ? "cuda_stub_libcuda" : "cuda_no_libcuda");
}
