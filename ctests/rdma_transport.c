/* The RDMA transport from C, two engines in one process.
 *
 * Mode "none" (test rdma_none, label api, every host): on a host without a usable RDMA device the doctor reports
 * "no RDMA" cleanly (text and JSON, with libibverbs found or not as KVSTAGE_EXPECT_LIBIBVERBS says:
 * "present" or "hidden"), transport RDMA fails at engine creation with KVSTAGE_E_NO_DEVICE (class
 * RDMA, a cause chain ending with the device-list error), and transport AUTO moves a staged chunk
 * over TCP, counts the downgrade in kvstage_engine_stats.rdma_downgrades and says so in the
 * "transport" line of kvstage_engine_describe. Exits 77 on a host that has an RDMA device.
 *
 * Mode "loopback" (test rdma_loopback, label rdma): both engines with transport RDMA on this host's device (or
 * KVSTAGE_RDMA_DEVICES), a staged chunk written by RDMA WRITE + WRITE_WITH_IMM, every byte of the
 * decode pool compared with the prefill pool. Exits 77 without a device unless
 * KVSTAGE_REQUIRE_RDMA=1. The chunk (4 MiB) spans many work requests and signal intervals;
 * KVSTAGE_RDMA_QPS=n stripes it over n queue pairs per device, and with KVSTAGE_RDMA_DEVICES the
 * session must use the device named first (both checked in the transport's description). The
 * same chunk then goes layer-wise (a plain RDMA WRITE per marked layer, the write-with-immediate
 * after the last). Then a chunk from a vllm-lbhnc pool into a trtllm pool, every decode byte
 * checked against TensorRT-LLM's index formula (rdma_none does the same over its TCP fallback).
 * Then the decode ring is registered again under a connected session (see below). */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <time.h>

#include "host_pool.h"

enum { LAYERS = 4, HEADS = 8, HEAD_DIM = 64, DTYPE = 2, PAGE = 16, CAPACITY = 64, NPAGES = 32, ROOM = 11 };

/* A pool filled with the pattern of `seed` (0: zeros). */
static void pool_init(host_pool *p, unsigned seed) {
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
    host_pool_init(p, &shape);
    host_pool_fill(p, seed);
}

static void print_error(const char *what) {
    const kvstage_error *e = kvstage_error_last();
    size_t i;
    /* No kvstage call in between: it would replace the last error. */
    printf("%s: %s (code %d)\n", what, e->message, (int)e->code);
    for (i = 0; i < e->cause_count; i++) printf("  cause %zu: %s\n", i, e->causes[i]);
}

/* Decode pages 0..NPAGES-1 receive prefill pages NPAGES..2*NPAGES-1 (TP 1 -> 1: whole slots).
 * `layerwise`: the chunk goes layer by layer (kvstage_transfer_layerwise_async), its layers marked
 * in reverse order, one RDMA WRITE per marked batch and the write-with-immediate after the last. */
static int transfer_and_verify(kvstage_engine *pre, kvstage_engine *dec, host_pool *pp, host_pool *dp, const char *session_id, int layerwise) {
    uint32_t src[NPAGES], dst[NPAGES], chunks = 0;
    uint64_t room_key = 0;
    char addr[64];
    kvstage_session *s = NULL;
    kvstage_transfer_desc d;
    size_t b, pg, page_bytes = (size_t)PAGE * HEADS * HEAD_DIM * DTYPE;
    int bad = 0, i;
    for (i = 0; i < NPAGES; i++) {
        dst[i] = (uint32_t)i;
        src[i] = (uint32_t)(NPAGES + i);
    }
    REQUIRE(kvstage_engine_listen_address(dec, addr, sizeof addr, NULL) == KVSTAGE_OK);
    CHECK_OK(kv_room_open(dec, ROOM, dst, NPAGES, NPAGES * PAGE, NULL, &chunks, &room_key));
    CHECK_INT(chunks, 1);
    if (kvstage_session_connect(pre, addr, session_id, 10000, &s) != KVSTAGE_OK) {
        print_error("connect");
        return 1;
    }
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = ROOM;
    d.room_key = room_key;
    d.chunk_index = 0;
    d.src_pages = src;
    d.num_pages = NPAGES;
    d.timeout_ms = 20000;
    host_pool_fill(dp, 0);
    if (layerwise) {
        kvstage_op *op = NULL;
        CHECK_INT(kvstage_transfer_layerwise_async(s, &d, &op), KVSTAGE_PENDING);
        /* 20 ms apart: the sender takes each layer as its own batch (several pieces, not one). */
        const struct timespec gap = {0, 20 * 1000 * 1000};
        for (i = LAYERS - 1; i >= 0; i--) {
            CHECK_OK(kvstage_op_layers_ready(op, (uint32_t)i, 1, NULL, NULL));
            nanosleep(&gap, NULL);
        }
        if (kvstage_op_wait(op, 20000) != KVSTAGE_OK) {
            print_error("layer-wise transfer");
            bad = 1;
        }
        kvstage_op_free(op);
    } else if (kvstage_transfer(s, &d) != KVSTAGE_OK) {
        print_error("transfer");
        bad = 1;
    }
    CHECK_OK(kvstage_room_wait(dec, ROOM, room_key, 20000));
    for (b = 0; b < 2 * LAYERS; b++)
        for (pg = 0; pg < NPAGES; pg++)
            if (memcmp(dp->memory + b * dp->buffer + pg * page_bytes, pp->memory + b * pp->buffer + (NPAGES + pg) * page_bytes, page_bytes) != 0) {
                if (bad < 5) fprintf(stderr, "buffer %zu page %zu differs\n", b, pg);
                bad++;
            }
    CHECK_INT(bad, 0);
    CHECK_OK(kvstage_room_release(dec, ROOM, room_key));
    kvstage_session_free(s);
    return bad;
}

static kvstage_engine *engine_for(int transport, const char *devices, const kvstage_kv_layout *layout, int staging) {
    const char *qps = getenv("KVSTAGE_RDMA_QPS");
    kvstage_engine_options o;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = transport;
    /* These engines share a host: AUTO would take the same-host path before RDMA or TCP. */
    o.same_host = KVSTAGE_SAME_HOST_OFF;
    o.rdma_devices = devices;
    if (qps != NULL) o.rdma_qps_per_device = (uint32_t)atoi(qps);
    o.rdma_wr_bytes = 64 * 1024; /* several work requests per chunk */
    o.rdma_signal_every = 4;
    o.integrity = KVSTAGE_INTEGRITY_ALWAYS;
    if (kvstage_engine_new(&o, &e) != KVSTAGE_OK) return NULL;
    REQUIRE(kvstage_pool_register(e, layout) == KVSTAGE_OK);
    if (staging) REQUIRE(kv_staging_register(e, NULL, 16u << 20) == KVSTAGE_OK);
    return e;
}

static kvstage_engine *engine(int transport, const char *devices, host_pool *p, int staging) {
    return engine_for(transport, devices, &p->layout, staging);
}

/* ---- mixed layouts: prefill vLLM [L][B][H][N][K||V] -> decode TensorRT-LLM [B][L][K/V][H][N][D] ---- */

enum { ROWB = HEAD_DIM * DTYPE, MIX_PAGES = 8, MIX_ROOM = 12 };
#define MIX_TENSOR ((size_t)LAYERS * CAPACITY * HEADS * PAGE * 2 * ROWB)

/* Each engine's own index formula (element 0 of head `hd` of slot `s` of block `b`), written
 * here: nothing is derived from the strides kvstage_kv_layout_preset returns. */
static uint64_t lbhnc_at(uint32_t li, uint32_t kv, uint32_t b, uint32_t s, uint32_t hd) {
    return (((((uint64_t)li * CAPACITY + b) * HEADS + hd) * PAGE + s) * 2 + kv) * ROWB;
}
static uint64_t trtllm_at(uint32_t li, uint32_t kv, uint32_t b, uint32_t s, uint32_t hd) {
    return (((((uint64_t)b * LAYERS + li) * 2 + kv) * HEADS + hd) * PAGE + s) * ROWB;
}

typedef uint64_t (*index_fn)(uint32_t li, uint32_t kv, uint32_t b, uint32_t s, uint32_t hd);

typedef struct preset_pool {
    uint8_t *tensor;
    uint64_t k[LAYERS];
    kvstage_kv_layout layout;
} preset_pool;

/* A zeroed pool of `preset` whose bases the formula `at` places (checked against the preset's
 * layer distance and V offset). */
static void preset_pool_init(preset_pool *p, int preset, index_fn at) {
    uint64_t layer_stride = 0;
    uint32_t li;
    p->layout = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
    REQUIRE(kvstage_kv_layout_preset(&p->layout, preset, &layer_stride) == KVSTAGE_OK);
    p->tensor = (uint8_t *)calloc(1, MIX_TENSOR);
    REQUIRE(p->tensor != NULL);
    for (li = 0; li < LAYERS; li++) p->k[li] = (uint64_t)(uintptr_t)(p->tensor + at(li, 0, 0, 0, 0));
    CHECK_INT(p->k[1] - p->k[0], layer_stride);
    CHECK_INT(at(0, 1, 0, 0, 0) - at(0, 0, 0, 0, 0), p->layout.v_offset);
    p->layout.k_bases = p->k;
    p->layout.v_bases = NULL; /* V lies v_offset after K */
    if (kvstage_kv_layout_validate(&p->layout) != KVSTAGE_OK) {
        print_error("mixed layouts: kvstage_kv_layout_validate");
        exit(1);
    }
}

static uint8_t mix_byte(uint32_t li, uint32_t kv, uint32_t hd, uint32_t slot, uint32_t e) {
    uint64_t x = (uint64_t)li << 48 | (uint64_t)kv << 44 | (uint64_t)hd << 36 | (uint64_t)slot << 12 | e;
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (uint8_t)(x ^ (x >> 31));
}

/* One chunk of MIX_PAGES pages from a vllm-lbhnc pool into a trtllm pool (`transport`, same
 * host path off), every byte of the decode tensor checked: the chunk's rows where TensorRT-LLM's
 * formula puts them, zeros elsewhere. Returns the number of bytes that differ. */
static size_t mixed_layouts(int transport, const char *devices, const char *id) {
    preset_pool pp, dp;
    kvstage_engine *pre, *dec;
    kvstage_session *s = NULL;
    kvstage_session_stats st;
    kvstage_transfer_desc d;
    uint32_t src[MIX_PAGES], dst[MIX_PAGES], li, kv, b, t, hd, e, i;
    uint64_t room_key = 0;
    uint8_t *want;
    size_t bad = 0, first = 0, at;
    char addr[64];
    preset_pool_init(&pp, KVSTAGE_LAYOUT_VLLM_LBHNC, lbhnc_at);
    preset_pool_init(&dp, KVSTAGE_LAYOUT_TRTLLM, trtllm_at);
    for (li = 0; li < LAYERS; li++)
        for (kv = 0; kv < 2; kv++)
            for (b = 0; b < CAPACITY; b++)
                for (t = 0; t < PAGE; t++)
                    for (hd = 0; hd < HEADS; hd++)
                        for (e = 0; e < ROWB; e++) pp.tensor[lbhnc_at(li, kv, b, t, hd) + e] = mix_byte(li, kv, hd, b * PAGE + t, e);
    for (i = 0; i < MIX_PAGES; i++) {
        src[i] = (7 * i + 3) % CAPACITY;
        dst[i] = (5 * i + 9) % CAPACITY;
    }
    dec = engine_for(transport, devices, &dp.layout, 1);
    pre = engine_for(transport, devices, &pp.layout, 0);
    REQUIRE(dec != NULL && pre != NULL);
    REQUIRE(kvstage_engine_listen_address(dec, addr, sizeof addr, NULL) == KVSTAGE_OK);
    CHECK_OK(kv_room_open(dec, MIX_ROOM, dst, MIX_PAGES, MIX_PAGES * PAGE, NULL, NULL, &room_key));
    if (kvstage_session_connect(pre, addr, id, 10000, &s) != KVSTAGE_OK) {
        print_error("mixed layouts: connect");
        exit(1);
    }
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = MIX_ROOM;
    d.room_key = room_key;
    d.src_pages = src;
    d.num_pages = MIX_PAGES;
    d.timeout_ms = 20000;
    if (kvstage_transfer(s, &d) != KVSTAGE_OK) print_error("mixed layouts: transfer");
    CHECK_OK(kvstage_room_wait(dec, MIX_ROOM, room_key, 20000));
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvstage_session_stats_get(s, &st));
    CHECK_INT(st.transport, transport == KVSTAGE_TRANSPORT_AUTO ? KVSTAGE_TRANSPORT_TCP : transport);
    want = (uint8_t *)calloc(1, MIX_TENSOR);
    REQUIRE(want != NULL);
    for (i = 0; i < MIX_PAGES; i++)
        for (li = 0; li < LAYERS; li++)
            for (kv = 0; kv < 2; kv++)
                for (t = 0; t < PAGE; t++)
                    for (hd = 0; hd < HEADS; hd++)
                        for (e = 0; e < ROWB; e++) want[trtllm_at(li, kv, dst[i], t, hd) + e] = mix_byte(li, kv, hd, src[i] * PAGE + t, e);
    for (at = 0; at < MIX_TENSOR; at++)
        if (dp.tensor[at] != want[at] && bad++ == 0) first = at;
    if (bad) {
        uint64_t off = first;
        uint32_t rb = (uint32_t)(off / (LAYERS * 2 * HEADS * PAGE * ROWB)), rest = (uint32_t)(off % (LAYERS * 2 * HEADS * PAGE * ROWB));
        KV_FAIL_AT(__FILE__, __LINE__,
                   "[%s] prefill vllm-lbhnc -> decode trtllm: %zu byte(s) differ; first at tensor byte %zu: block %u layer %u "
                   "%c head %u slot %u byte %u: 0x%02x, expected 0x%02x",
                   id, bad, first, (unsigned)rb, (unsigned)(rest / (2 * HEADS * PAGE * ROWB)),
                   "KV"[rest / (HEADS * PAGE * ROWB) % 2], (unsigned)(rest / (PAGE * ROWB) % HEADS),
                   (unsigned)(rest / ROWB % PAGE), (unsigned)(rest % ROWB), dp.tensor[first], want[first]);
    }
    printf("mixed layouts [%s]: vllm-lbhnc -> trtllm over %s, %d pages: %s\n", id, kv_transport_name(st.transport), MIX_PAGES,
           bad ? "bytes differ" : "every decode byte as TensorRT-LLM's formula puts it");
    CHECK_OK(kvstage_room_release(dec, MIX_ROOM, room_key));
    kvstage_session_free(s);
    kvstage_engine_free(pre);
    kvstage_engine_free(dec);
    free(want);
    free(pp.tensor);
    free(dp.tensor);
    return bad;
}

static int doctor_says_usable(void) {
    size_t needed = 0;
    char *json;
    int usable;
    CHECK_OK(kvstage_doctor_run(1, NULL, 0, &needed)); /* a size query */
    REQUIRE(needed > 10);
    json = (char *)malloc(needed);
    REQUIRE(json != NULL);
    CHECK_OK(kvstage_doctor_run(1, json, needed, NULL));
    usable = strstr(json, "\"usable\":true") != NULL;
    free(json);
    return usable;
}

static int mode_none(void) {
    const char *expect = getenv("KVSTAGE_EXPECT_LIBIBVERBS");
    char text[8192], json[8192], describe[1024];
    size_t needed = 0;
    const kvstage_error *e;
    kvstage_engine_stats st;
    host_pool pp, dp;
    kvstage_engine *pre, *dec, *bad = NULL;
    kvstage_engine_options o;

    if (doctor_says_usable()) {
        printf("this host has a usable RDMA device: the no-device checks do not apply: skipped\n");
        return 77;
    }
    CHECK_OK(kvstage_doctor_run(0, text, sizeof text, &needed));
    CHECK_INT(needed, strlen(text) + 1);
    CHECK_OK(kvstage_doctor_run(1, json, sizeof json, NULL));
    printf("%s\n%s\n", text, json);
    CHECK_CONTAINS(text, "verdict: no RDMA");
    CHECK_CONTAINS(text, "libcuda.so.1:");
    CHECK_CONTAINS(json, "\"usable\":false");
    CHECK_CONTAINS(json, "\"devices\":[]");
    if (expect != NULL && strcmp(expect, "present") == 0) {
        CHECK_CONTAINS(text, "libibverbs.so.1: found");
        CHECK_CONTAINS(json, "\"libibverbs\":{\"found\":true");
    } else if (expect != NULL && strcmp(expect, "hidden") == 0) {
        CHECK_CONTAINS(text, "libibverbs.so.1: not found");
        CHECK_CONTAINS(json, "\"libibverbs\":{\"found\":false");
        CHECK_CONTAINS(text, "os error");
    }
    CHECK_INT(kvstage_doctor_run(2, text, sizeof text, NULL), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "json");

    /* transport RDMA: no engine, NO_DEVICE, class RDMA, causes down to the device list's error. */
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_RDMA;
    CHECK_INT(kvstage_engine_new(&o, &bad), KVSTAGE_E_NO_DEVICE);
    CHECK(bad == NULL);
    e = kvstage_error_last();
    print_error("transport rdma");
    CHECK_INT(e->klass, KVSTAGE_CLASS_RDMA);
    CHECK_CONTAINS(e->message, "transport rdma: no usable RDMA device");
    REQUIRE(e->cause_count >= 2);
    CHECK_CONTAINS(e->causes[0], "libibverbs.so.1");
    if (expect != NULL && strcmp(expect, "hidden") == 0) {
        CHECK_CONTAINS(e->causes[0], "could not be loaded");
        CHECK_CONTAINS(e->causes[e->cause_count - 2], "ibv_get_device_list failed");
        CHECK_CONTAINS(e->causes[e->cause_count - 1], "os error");
    }
    o.rdma_devices = "mlx5_0:x";
    CHECK_INT(kvstage_engine_new(&o, &bad), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "options->rdma_devices");
    o.rdma_devices = NULL;
    o.rdma_wr_bytes = 1;
    CHECK_INT(kvstage_engine_new(&o, &bad), KVSTAGE_E_INVALID_ARG);
    CHECK_CONTAINS(kvstage_error_last()->message, "options->rdma_wr_bytes");

    /* transport AUTO: TCP, the downgrade counted and described. */
    pool_init(&pp, 7);
    pool_init(&dp, 0);
    pre = engine(KVSTAGE_TRANSPORT_AUTO, NULL, &pp, 0);
    dec = engine(KVSTAGE_TRANSPORT_AUTO, NULL, &dp, 1);
    REQUIRE(pre != NULL && dec != NULL);
    CHECK_INT(transfer_and_verify(pre, dec, &pp, &dp, "auto-1", 0), 0);
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvstage_engine_stats_get(pre, &st));
    CHECK_INT(st.rdma_downgrades, 1);
    CHECK_INT(st.rdma_sessions, 0);
    kv_engine_transport(pre, describe, sizeof describe);
    printf("prefill transport: %s\n", describe);
    CHECK_CONTAINS(describe, "tcp (transport auto, no usable RDMA device");
    CHECK_CONTAINS(describe, "1 session(s) downgraded to tcp");
    kvstage_engine_free(pre);
    kvstage_engine_free(dec);
    host_pool_free(&pp);
    host_pool_free(&dp);
    /* A chunk between two named layouts, over the same TCP fallback. */
    CHECK_INT(mixed_layouts(KVSTAGE_TRANSPORT_AUTO, NULL, "auto-mixed-layouts"), 0);
    return kv_finish("rdma_none");
}

/* Something goes wrong with a connected RDMA session's next chunk: `spoil` (run between the
 * connect and the transfer, given `arg`) makes the write fail on the wire. The transfer fails with
 * KVSTAGE_E_RDMA naming `wc_status` in the chain, the session is dead, the decode room fails and the
 * ring holds nothing; then a new session delivers the chunk, verified. */
static void spoiled_chunk(kvstage_engine *pre, kvstage_engine *dec, host_pool *pp, host_pool *dp, const char *id, int code,
                          const char *wc_status, void (*spoil)(kvstage_engine *dec, uintptr_t arg), uintptr_t arg) {
    uint32_t src[NPAGES], dst[NPAGES];
    uint64_t room_key = 0;
    char addr[64], again[48];
    kvstage_session *s = NULL;
    kvstage_transfer_desc d;
    kvstage_engine_stats st;
    const kvstage_error *e;
    int i, seen = 0;
    size_t c;
    for (i = 0; i < NPAGES; i++) {
        dst[i] = (uint32_t)i;
        src[i] = (uint32_t)(NPAGES + i);
    }
    REQUIRE(kvstage_engine_listen_address(dec, addr, sizeof addr, NULL) == KVSTAGE_OK);
    REQUIRE(kvstage_session_connect(pre, addr, id, 10000, &s) == KVSTAGE_OK);
    spoil(dec, arg);
    CHECK_OK(kv_room_open(dec, ROOM, dst, NPAGES, NPAGES * PAGE, NULL, NULL, &room_key));
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = ROOM;
    d.room_key = room_key;
    d.chunk_index = 0;
    d.src_pages = src;
    d.num_pages = NPAGES;
    d.timeout_ms = 20000;
    CHECK_INT(kvstage_transfer(s, &d), code);
    e = kvstage_error_last();
    print_error(id);
    for (c = 0; c < e->cause_count; c++) seen |= strstr(e->causes[c], wc_status) != NULL;
    seen |= strstr(e->message, wc_status) != NULL;
    CHECK(seen);
    CHECK(kvstage_transfer(s, &d) < 0); /* the session is dead */
    kvstage_session_free(s);
    CHECK(kvstage_room_wait(dec, ROOM, room_key, 5000) < 0); /* the aborted chunk failed the room */
    CHECK_OK(kvstage_room_release(dec, ROOM, room_key));
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvstage_engine_stats_get(dec, &st));
    CHECK_INT(st.ring_live_allocations, 0);
    host_pool_fill(dp, 0);
    snprintf(again, sizeof again, "after-%s", id);
    CHECK_INT(transfer_and_verify(pre, dec, pp, dp, again, 0), 0);
}

/* The decode engine registers its staging ring again while an RDMA session is connected: the old
 * region (and its rkey) is gone, so that session's next chunk fails on the remote side. */
static void register_the_ring_again(kvstage_engine *dec, uintptr_t unused) {
    (void)unused;
    CHECK_OK(kv_staging_register(dec, NULL, 16u << 20));
}

static int mode_loopback(void) {
    const char *require = getenv("KVSTAGE_REQUIRE_RDMA");
    const char *devices = getenv("KVSTAGE_RDMA_DEVICES");
    char describe[1024];
    kvstage_engine_stats st;
    host_pool pp, dp;
    kvstage_engine *pre, *dec;
    int required = require != NULL && strcmp(require, "1") == 0;

    pool_init(&pp, 3);
    pool_init(&dp, 0);
    dec = engine(KVSTAGE_TRANSPORT_RDMA, devices, &dp, 1);
    if (dec == NULL) {
        print_error("transport rdma");
        host_pool_free(&pp);
        host_pool_free(&dp);
        if (required) {
            fprintf(stderr, "KVSTAGE_REQUIRE_RDMA=1 but no usable RDMA device\n");
            return 1;
        }
        printf("no usable RDMA device on this host: skipped\n");
        return 77;
    }
    pre = engine(KVSTAGE_TRANSPORT_RDMA, devices, &pp, 0);
    REQUIRE(pre != NULL);
    kv_engine_transport(pre, describe, sizeof describe);
    printf("prefill transport: %s\n", describe);
    CHECK_CONTAINS(describe, "rdma (required)");
    if (getenv("KVSTAGE_RDMA_QPS") != NULL) {
        char want[64];
        snprintf(want, sizeof want, ", %s QP(s) per device", getenv("KVSTAGE_RDMA_QPS"));
        CHECK_CONTAINS(describe, want);
    }
    if (devices != NULL) {
        char want[64];
        snprintf(want, sizeof want, ": %.*s:", (int)strcspn(devices, ",:"), devices);
        CHECK_CONTAINS(describe, want);
    }
    CHECK_INT(transfer_and_verify(pre, dec, &pp, &dp, "loopback-1", 0), 0);
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvstage_engine_stats_get(pre, &st));
    CHECK_INT(st.rdma_sessions, 1);
    CHECK_INT(st.rdma_downgrades, 0);
    CHECK_OK(kvstage_engine_stats_get(dec, &st));
    CHECK_INT(st.rdma_sessions, 1);
    CHECK_INT(st.ring_live_allocations, 0);
    CHECK_INT(transfer_and_verify(pre, dec, &pp, &dp, "loopback-layerwise", 1), 0);
    CHECK_INT(mixed_layouts(KVSTAGE_TRANSPORT_RDMA, devices, "loopback-mixed-layouts"), 0);
    spoiled_chunk(pre, dec, &pp, &dp, "before-reregister", KVSTAGE_E_RDMA, "IBV_WC_REM_ACCESS_ERR", register_the_ring_again, 0);
    kvstage_engine_free(pre);
    kvstage_engine_free(dec);
    host_pool_free(&pp);
    host_pool_free(&dp);
    return kv_finish("rdma_loopback");
}

#if defined(KVSTAGE_TESTING)
/* Test builds: the next write carries fault `arg` (kvstage_testing_rdma_fault). */
static void arm_fault(kvstage_engine *dec, uintptr_t fault) {
    (void)dec;
    CHECK_OK(kvstage_testing_rdma_fault((uint32_t)fault));
}

/* Guard bytes around the caller-provided ring are all 0x5A: nothing was written outside it. */
static int guards_intact(const uint8_t *ring, size_t ring_bytes, size_t guard) {
    size_t i;
    int intact = 1;
    for (i = 0; i < guard; i++) intact &= ring[i] == 0x5A && ring[guard + ring_bytes + i] == 0x5A;
    return intact;
}

/* Mode "faults" (test rdma_faults, label rdma, test builds): each failure of a write on the
 * wire, with the receiver's ring in caller memory between two guard zones: a remote key the
 * receiver never issued and a range past the end of the registered ring (both refused by the
 * receiving side: IBV_WC_REM_ACCESS_ERR), and QP 0 moved to the error state once the first work
 * requests are posted (flushed: IBV_WC_WR_FLUSH_ERR), and a ready whose write-with-immediate went
 * as a plain write (refused after the receiver's wait, the connection closed). Exits 77 without a device unless
 * KVSTAGE_REQUIRE_RDMA=1. */
static int mode_faults(void) {
    const char *require = getenv("KVSTAGE_REQUIRE_RDMA");
    enum { RING = 16u << 20, GUARD = 1u << 20 };
    host_pool pp, dp;
    kvstage_engine *pre, *dec;
    uint8_t *ring = (uint8_t *)malloc(RING + 2 * GUARD);
    REQUIRE(ring != NULL);
    memset(ring, 0x5A, RING + 2 * GUARD);
    pool_init(&pp, 5);
    pool_init(&dp, 0);
    dec = engine(KVSTAGE_TRANSPORT_RDMA, getenv("KVSTAGE_RDMA_DEVICES"), &dp, 0);
    if (dec == NULL) {
        print_error("transport rdma");
        host_pool_free(&pp);
        host_pool_free(&dp);
        free(ring);
        if (require != NULL && strcmp(require, "1") == 0) return 1;
        printf("no usable RDMA device on this host: skipped\n");
        return 77;
    }
    REQUIRE(kv_staging_register(dec, ring + GUARD, RING) == KVSTAGE_OK);
    pre = engine(KVSTAGE_TRANSPORT_RDMA, getenv("KVSTAGE_RDMA_DEVICES"), &pp, 0);
    REQUIRE(pre != NULL);
    spoiled_chunk(pre, dec, &pp, &dp, "fault-1", KVSTAGE_E_RDMA, "IBV_WC_REM_ACCESS_ERR", arm_fault, 1);
    CHECK(guards_intact(ring, RING, GUARD));
    spoiled_chunk(pre, dec, &pp, &dp, "fault-2", KVSTAGE_E_RDMA, "IBV_WC_REM_ACCESS_ERR", arm_fault, 2);
    CHECK(guards_intact(ring, RING, GUARD));
    spoiled_chunk(pre, dec, &pp, &dp, "fault-3", KVSTAGE_E_RDMA, "IBV_WC_WR_FLUSH_ERR", arm_fault, 3);
    CHECK(guards_intact(ring, RING, GUARD));
    /* The ready arrives without its write-with-immediate: refused after the receiver's wait,
     * the connection closed (its room fails at once), nothing of the chunk scattered. */
    spoiled_chunk(pre, dec, &pp, &dp, "fault-5", KVSTAGE_E_PROTOCOL, "write-with-immediate did not arrive", arm_fault, 5);
    CHECK(guards_intact(ring, RING, GUARD));
    CHECK_INT(kvstage_testing_rdma_fault(6), KVSTAGE_E_INVALID_ARG);
    kvstage_engine_free(pre);
    kvstage_engine_free(dec);
    host_pool_free(&pp);
    host_pool_free(&dp);
    free(ring);
    return kv_finish("rdma_faults");
}
#endif

/* The executable's name picks the mode: rdma_loopback, rdma_faults (test builds), or anything
 * else (rdma_none). */
int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : argv[0];
    if (strstr(mode, "loopback") != NULL) return mode_loopback();
#if defined(KVSTAGE_TESTING)
    if (strstr(mode, "faults") != NULL) return mode_faults();
#endif
    return mode_none();
}
