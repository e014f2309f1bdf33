/* Hostile and careless input at the C boundary: NULL for every pointer argument of every export,
 * wrong struct_size, zero and overflowing sizes, ranks out of range, invalid enums and UTF-8,
 * overlapping and overflowing buffers in a KV layout, layout presets and strides (a bad preset,
 * capacity 0, a 0.4-sized layout; strides of part elements or shorter than what they stride
 * over, V both in buffers and at an offset, an interleaved V on K's rows), foreign pointers passed as handles, and
 * every engine call on a poisoned engine. Each case asserts the status code the header and
 * docs/c-api-conventions.md document, that the thread's last error carries the same code, and that
 * its message names the argument (fields of a KV layout are named in the causes: the message names
 * the layout argument, the first cause the field).
 *
 * Pointers that never came from the library (a zeroed block) are refused as "not a live kvstage
 * handle", and `_free` ignores them. Freed handles, handles of the wrong kind and handles freed
 * during a call are the `handles` ctest's.
 *
 * Also built as C++17. */
#include <stddef.h>
#include <stdint.h>

#include "host_pool.h"

#if !defined(KVSTAGE_TESTING)
#error "bad_input.c needs KVSTAGE_TESTING (kvstage_testing_panic poisons an engine)"
#endif

static int g_cases = 0;

static int cause_contains(const kvstage_error *e, const char *needle) {
    size_t i;
    for (i = 0; i < e->cause_count; i++)
        if (e->causes[i] != NULL && strstr(e->causes[i], needle) != NULL) return 1;
    return 0;
}

/* Checks one case. `msg` must appear in the message; `cause` (may be NULL) in one of the causes.
 * Reads the last error before any other kvstage call. */
static void expect_at(const char *file, int line, const char *what, int rc, int code, const char *msg,
                      const char *cause) {
    const kvstage_error *e = kvstage_error_last();
    int ok = 1;
    ++g_cases;
    if (rc != code) {
        KV_FAIL_AT(file, line, "%s returned %d, expected %d", what, rc, code);
        ok = 0;
    }
    /* Errors leave their code; success and informational codes leave "no error" (KVSTAGE_OK). */
    if ((int)e->code != (code < 0 ? code : KVSTAGE_OK)) {
        KV_FAIL_AT(file, line, "%s: last error code %d, expected %d", what, (int)e->code, code < 0 ? code : 0);
        ok = 0;
    }
    if (code < 0) {
        if (msg != NULL && strstr(e->message, msg) == NULL) {
            KV_FAIL_AT(file, line, "%s: message \"%s\" does not contain \"%s\"", what, e->message, msg);
            ok = 0;
        }
        if (cause != NULL && !cause_contains(e, cause)) {
            KV_FAIL_AT(file, line, "%s: no cause contains \"%s\"", what, cause);
            ok = 0;
        }
        if (e->klass == KVSTAGE_CLASS_NONE) {
            KV_FAIL_AT(file, line, "%s: error without a class", what);
            ok = 0;
        }
    } else if (strcmp(e->message, "no error") != 0) {
        KV_FAIL_AT(file, line, "%s: a call returning %d left the error \"%s\"", what, rc, e->message);
        ok = 0;
    }
    if (!ok) kv_print_last_error(what);
}

#define EXPECT(call, code, msg) expect_at(__FILE__, __LINE__, #call, (int)(call), (int)(code), (msg), NULL)
#define EXPECT_CAUSE(call, code, msg, cause) \
    expect_at(__FILE__, __LINE__, #call, (int)(call), (int)(code), (msg), (cause))

/* --- fixtures ------------------------------------------------------------------------------- */

/* A small MHA pool: 2 layers (ids named), 2 KV heads of 8 bf16 elements, 4-token pages, 16 pages. */
enum { LAYERS = 2, HEADS = 2, HEAD_DIM = 8, DTYPE = 2, PAGE = 4, CAPACITY = 16 };

static const uint32_t LAYER_IDS[LAYERS] = {0, 1};

static void pool_init(host_pool *p) {
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
    shape.layer_ids = LAYER_IDS;
    host_pool_init(p, &shape);
}

static kvstage_engine *engine_new(void) {
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_new(NULL, &e) == KVSTAGE_OK);
    REQUIRE(e != NULL);
    return e;
}

/* A sentinel that must survive failed constructors ("writes *out only on success"). */
#define SENTINEL_ENGINE ((kvstage_engine *)(uintptr_t)0x5e5e)
#define SENTINEL_SESSION ((kvstage_session *)(uintptr_t)0x5e5e)
#define SENTINEL_OP ((kvstage_op *)(uintptr_t)0x5e5e)

/* --- global functions, options, engine construction ------------------------------------------ */

static void test_global_and_options(void) {
    kvstage_capabilities caps;
    kvstage_engine_options o;
    kvstage_engine *out = SENTINEL_ENGINE;
    char *bad_utf8 = (char *)malloc(4);
    REQUIRE(bad_utf8 != NULL);
    bad_utf8[0] = (char)0xff;
    bad_utf8[1] = (char)0xfe;
    bad_utf8[2] = ':';
    bad_utf8[3] = 0;

    EXPECT(kvstage_capabilities_get(NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    caps.struct_size = 0;
    EXPECT(kvstage_capabilities_get(&caps), KVSTAGE_E_INVALID_ARG, "`out->struct_size`");
    caps.struct_size = (size_t)2 << 20;
    EXPECT(kvstage_capabilities_get(&caps), KVSTAGE_E_INVALID_ARG, "`out->struct_size`");
    caps.struct_size = SIZE_MAX;
    EXPECT(kvstage_capabilities_get(&caps), KVSTAGE_E_INVALID_ARG, "`out->struct_size`");

    /* Not a status code: a static fallback string, no error. */
    ++g_cases;
    CHECK_STR(kvstage_status_name(12345), "KVSTAGE_UNKNOWN");
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    ++g_cases;
    CHECK_STR(kvstage_status_name(INT32_MIN), "KVSTAGE_UNKNOWN");

    EXPECT(kvstage_testing_panic(NULL), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_engine_options_init(NULL, sizeof(kvstage_engine_options)), KVSTAGE_E_INVALID_ARG, "`options`");
    /* The caller's size: below the first published version (0.4: the whole struct but its tail
     * padding), or absurd, is refused naming `size`, and nothing is written. */
    memset(&o, 0x5A, sizeof o);
    EXPECT(kvstage_engine_options_init(&o, 0), KVSTAGE_E_INVALID_ARG, "`size`");
    EXPECT(kvstage_engine_options_init(&o, sizeof o - 8), KVSTAGE_E_INVALID_ARG, "`size`");
    EXPECT(kvstage_engine_options_init(&o, SIZE_MAX), KVSTAGE_E_INVALID_ARG, "`size`");
    ++g_cases;
    CHECK(o.worker_threads == 0x5A5A5A5Au && o.transport == 0x5A5A5A5A);

    EXPECT(kvstage_engine_new(NULL, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    EXPECT(kvstage_engine_new(&o, NULL), KVSTAGE_E_INVALID_ARG, "`out`");

#define BAD_OPTION(field, value, needle)                                        \
    do {                                                                        \
        REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);                 \
        o.field = value;                                                        \
        EXPECT(kvstage_engine_new(&o, &out), KVSTAGE_E_INVALID_ARG, needle);    \
        CHECK(out == SENTINEL_ENGINE);                                          \
    } while (0)

    BAD_OPTION(struct_size, 0, "`options->struct_size`");
    /* Below the first published version (0.4: every field; only the tail padding may be left out). */
    BAD_OPTION(struct_size, sizeof(kvstage_engine_options) - 8, "`options->struct_size`");
    BAD_OPTION(struct_size, offsetof(kvstage_engine_options, rdma_devices) - 1, "`options->struct_size`");
    BAD_OPTION(struct_size, (size_t)1 << 21, "`options->struct_size`");
    BAD_OPTION(struct_size, SIZE_MAX, "`options->struct_size`");
    BAD_OPTION(transport, 7, "`options->transport`");
    BAD_OPTION(transport, -1, "`options->transport`");
    BAD_OPTION(worker_threads, 0, "`options->worker_threads`");
    BAD_OPTION(worker_threads, 257, "`options->worker_threads`");
    BAD_OPTION(worker_threads, UINT32_MAX, "`options->worker_threads`");
    BAD_OPTION(default_timeout_ms, 0, "`options->default_timeout_ms`");
    BAD_OPTION(chunk_tokens, 0, "`options->chunk_tokens`");
    BAD_OPTION(send_staging_bytes, 0, "`options->send_staging_bytes`");
    BAD_OPTION(listen_address, "not an address", "`options->listen_address`");
    BAD_OPTION(listen_address, "127.0.0.1:99999", "`options->listen_address`");
    BAD_OPTION(listen_address, "", "`options->listen_address`");
    BAD_OPTION(listen_address, bad_utf8, "`options->listen_address`");

    BAD_OPTION(rdma_devices, "mlx5_0:0", "`options->rdma_devices`");
    BAD_OPTION(rdma_devices, "a b", "`options->rdma_devices`");
    BAD_OPTION(rdma_devices, bad_utf8, "`options->rdma_devices`");
    BAD_OPTION(rdma_gid_index, -2, "`options->rdma_gid_index`");
    BAD_OPTION(rdma_qps_per_device, 0, "`options->rdma_qps_per_device`");
    BAD_OPTION(rdma_qps_per_device, 17, "`options->rdma_qps_per_device`");
    BAD_OPTION(rdma_wr_bytes, 4095, "`options->rdma_wr_bytes`");
    BAD_OPTION(rdma_signal_every, 0, "`options->rdma_signal_every`");
    BAD_OPTION(rdma_signal_every, 1025, "`options->rdma_signal_every`");
    BAD_OPTION(max_connections, 0, "`options->max_connections`");
    BAD_OPTION(max_handshakes, 0, "`options->max_handshakes`");
    BAD_OPTION(handshake_timeout_ms, 0, "`options->handshake_timeout_ms`");
    BAD_OPTION(max_events, 0, "`options->max_events`");
    BAD_OPTION(dead_peer_timeout_ms, 999, "`options->dead_peer_timeout_ms`");
    BAD_OPTION(dead_peer_timeout_ms, 0, "`options->dead_peer_timeout_ms`");
    BAD_OPTION(room_timeout_ms, 0, "`options->room_timeout_ms`");
    BAD_OPTION(send_from_pool, 2, "`options->send_from_pool`");
    BAD_OPTION(send_from_pool, -1, "`options->send_from_pool`");
    BAD_OPTION(same_host_direct, 2, "`options->same_host_direct`");
    BAD_OPTION(same_host_direct, -1, "`options->same_host_direct`");
#undef BAD_OPTION

    /* Shared memory for direct mode: 0 bytes, a NULL out, pointers it never returned. */
    void *shared = (void *)(uintptr_t)0x5e5e;
    EXPECT(kvstage_shared_alloc(0, &shared), KVSTAGE_E_INVALID_ARG, "`bytes`");
    CHECK(shared == (void *)(uintptr_t)0x5e5e); /* untouched */
    EXPECT(kvstage_shared_alloc(4096, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    EXPECT(kvstage_shared_free(NULL), KVSTAGE_E_INVALID_ARG, "`ptr`");
    REQUIRE(kvstage_shared_alloc(8192, &shared) == KVSTAGE_OK);
    EXPECT(kvstage_shared_free((char *)shared + 4096), KVSTAGE_E_INVALID_ARG, "not an allocation of kvstage_shared_alloc");
    CHECK_OK(kvstage_shared_free(shared));
    EXPECT(kvstage_shared_free(shared), KVSTAGE_E_INVALID_ARG, "freed already");

    /* RDMA is a valid value: without a usable device NO_DEVICE (not INVALID_ARG), out untouched. */
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_RDMA;
    {
        kvstage_capabilities caps;
        memset(&caps, 0, sizeof caps);
        caps.struct_size = sizeof caps;
        REQUIRE(kvstage_capabilities_get(&caps) == KVSTAGE_OK);
        if (!caps.rdma) {
            EXPECT(kvstage_engine_new(&o, &out), KVSTAGE_E_NO_DEVICE, "transport rdma");
            CHECK(out == SENTINEL_ENGINE);
        }
    }

    /* _free(NULL) is a no-op and leaves "no error". */
    kvstage_engine_free(NULL);
    kvstage_session_free(NULL);
    kvstage_op_free(NULL);
    ++g_cases;
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    free(bad_utf8);
}

/* --- engine functions ------------------------------------------------------------------------- */

static void test_engine_calls(void) {
    kvstage_engine *e = engine_new();
    kvstage_engine_stats stats;
    kvstage_staging_memory staging;
    kvstage_room_event events[4];
    size_t count = 99;
    char buf[64];
    host_pool p;
    pool_init(&p);
    memset(events, 0, sizeof events);
    events[0].struct_size = sizeof events[0];

    EXPECT(kvstage_engine_listen_address(NULL, buf, sizeof buf, NULL), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_engine_shutdown(NULL, 0, NULL), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_engine_listen_address(e, NULL, sizeof buf, NULL), KVSTAGE_E_INVALID_ARG, "`buf`");
    EXPECT(kvstage_engine_listen_address(e, buf, 0, NULL), KVSTAGE_E_INVALID_ARG, "`capacity`");
    EXPECT(kvstage_engine_listen_address(e, buf, 5, NULL), KVSTAGE_E_INVALID_ARG, "`capacity`");
    {
        /* (buf, capacity, needed): NULL and 0 is a size query (OK, no error left); a big enough
         * buffer gets the text. */
        size_t needed = 0;
        EXPECT(kvstage_engine_listen_address(e, NULL, 0, &needed), KVSTAGE_OK, NULL);
        CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
        EXPECT(kvstage_engine_listen_address(e, NULL, 0, NULL), KVSTAGE_E_INVALID_ARG, "`needed`");
        CHECK(needed > sizeof "1.2.3.4:5" - 1 && needed <= sizeof buf);
        size_t again = 0;
        EXPECT(kvstage_engine_listen_address(e, buf, needed, &again), KVSTAGE_OK, NULL);
        CHECK(again == needed && strlen(buf) + 1 == needed);
    }

    {
        size_t needed = 0;
        EXPECT(kvstage_engine_describe(NULL, buf, sizeof buf, NULL), KVSTAGE_E_INVALID_ARG, "`engine`");
        EXPECT(kvstage_engine_describe(e, NULL, 0, NULL), KVSTAGE_E_INVALID_ARG, "`needed`");
        EXPECT(kvstage_engine_describe(e, buf, 4, &needed), KVSTAGE_E_INVALID_ARG, "`capacity`");
        CHECK(needed > 4);
        EXPECT(kvstage_room_describe(NULL, 5, 1, NULL, 0, &needed), KVSTAGE_E_INVALID_ARG, "`engine`");
        EXPECT(kvstage_room_describe(e, 5, 1, NULL, 0, &needed), KVSTAGE_E_STALE_ROOM, "room 5"); /* not open */
        EXPECT(kvstage_room_describe(e, 5, 0, NULL, 0, &needed), KVSTAGE_E_INVALID_ARG, "`key`");
        EXPECT(kvstage_op_describe(NULL, buf, sizeof buf, NULL), KVSTAGE_E_INVALID_ARG, "`op`");
    }

    EXPECT(kvstage_engine_stats_get(NULL, &stats), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_engine_stats_get(e, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    stats.struct_size = 0;
    EXPECT(kvstage_engine_stats_get(e, &stats), KVSTAGE_E_INVALID_ARG, "`out->struct_size`");
    stats.struct_size = 3;
    EXPECT(kvstage_engine_stats_get(e, &stats), KVSTAGE_E_INVALID_ARG, "`out->struct_size`");

    /* Staging rings: the descriptor is versioned like the options. */
    EXPECT(kvstage_staging_memory_init(NULL, sizeof staging), KVSTAGE_E_INVALID_ARG, "`staging`");
    EXPECT(kvstage_staging_memory_init(&staging, 0), KVSTAGE_E_INVALID_ARG, "`size`");
    REQUIRE(kvstage_staging_memory_init(&staging, sizeof staging) == KVSTAGE_OK);
    CHECK_INT(staging.struct_size, sizeof staging);
    CHECK_INT(staging.memory_kind, KVSTAGE_MEMORY_HOST);
    CHECK_INT(staging.cuda_device, -1);
    CHECK(staging.memory == NULL);
    staging.bytes = 4096;
    EXPECT(kvstage_staging_register(NULL, &staging), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_staging_register(e, NULL), KVSTAGE_E_INVALID_ARG, "`staging`");
    staging.bytes = 0;
    EXPECT(kvstage_staging_register(e, &staging), KVSTAGE_E_INVALID_ARG, "`staging->bytes`");
    staging.memory = buf;
    EXPECT(kvstage_staging_register(e, &staging), KVSTAGE_E_INVALID_ARG, "`staging->bytes`");
    /* More than the address space: no allocation is attempted (Vec capacity overflow). */
    staging.memory = NULL;
    staging.bytes = SIZE_MAX;
    EXPECT(kvstage_staging_register(e, &staging), KVSTAGE_E_OUT_OF_MEMORY, "bytes");
    staging.bytes = 4096;
    staging.memory_kind = 7;
    EXPECT(kvstage_staging_register(e, &staging), KVSTAGE_E_INVALID_ARG, "`staging->memory_kind`");
    staging.memory_kind = KVSTAGE_MEMORY_HOST;
    staging.struct_size = 0;
    EXPECT(kvstage_staging_register(e, &staging), KVSTAGE_E_INVALID_ARG, "`staging->struct_size`");
    staging.struct_size = sizeof staging;

    EXPECT(kvstage_pool_register(NULL, &p.layout), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_pool_register(e, NULL), KVSTAGE_E_INVALID_ARG, "`layout`");

    EXPECT(kvstage_engine_poll_events(NULL, events, 4, &count), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_engine_poll_events(e, NULL, 4, &count), KVSTAGE_E_INVALID_ARG, "`events`");
    EXPECT(kvstage_engine_poll_events(e, events, 4, NULL), KVSTAGE_E_INVALID_ARG, "`count`");
    /* The caller's element size is events[0].struct_size, required whenever capacity > 0 (also
     * when there is nothing to report). */
    events[0].struct_size = 0;
    EXPECT(kvstage_engine_poll_events(e, events, 4, &count), KVSTAGE_E_INVALID_ARG, "struct_size");
    events[0].struct_size = sizeof events[0];
    EXPECT(kvstage_engine_poll_events(e, events, 4, &count), KVSTAGE_OK, NULL);
    CHECK_INT(count, 0);
    /* (NULL, 0) is an empty array, not an error. */
    count = 99;
    EXPECT(kvstage_engine_poll_events(e, NULL, 0, &count), KVSTAGE_OK, NULL);
    CHECK_INT(count, 0);

    /* Rooms before a pool is registered: the engine is not ready; the grid is untouched. */
    {
        const uint32_t pages[2] = {0, 1};
        kvstage_room_desc d;
        kvstage_room_grid g;
        REQUIRE(kvstage_room_desc_init(&d, sizeof d) == KVSTAGE_OK);
        d.room = 1;
        d.pages = pages;
        d.num_pages = 2;
        memset(&g, 0, sizeof g);
        g.struct_size = sizeof g;
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`engine`");
        CHECK(g.key == 0 && g.num_chunks == 0);
    }

    REQUIRE(kvstage_pool_register(e, &p.layout) == KVSTAGE_OK);
    EXPECT(kvstage_pool_register(e, &p.layout), KVSTAGE_E_INVALID_ARG, "`layout`");

    /* Rooms. */
    {
        const uint32_t pages[4] = {0, 1, 2, 3};
        const uint32_t outside[3] = {0, CAPACITY, 1};
        kvstage_room_desc d;
        kvstage_room_grid g, again;
        uint64_t key, key2;

        EXPECT(kvstage_room_desc_init(NULL, sizeof d), KVSTAGE_E_INVALID_ARG, "`desc`");
        EXPECT(kvstage_room_desc_init(&d, 8), KVSTAGE_E_INVALID_ARG, "`size`");
        memset(&d, 0xA5, sizeof d);
        REQUIRE(kvstage_room_desc_init(&d, sizeof d) == KVSTAGE_OK);
        /* The defaults: nothing named, every optional field empty. */
        CHECK_INT(d.struct_size, sizeof d);
        CHECK(d.pages == NULL && d.num_pages == 0 && d.chunk_tokens == 0 && d.parts == NULL);
        CHECK(d.prefix_tokens == 0 && d.trace_id == NULL);
        d.room = 1;
        d.pages = pages;
        d.num_pages = 4;
        memset(&g, 0, sizeof g);
        g.struct_size = sizeof g;
        g.num_chunks = 77;
        EXPECT(kvstage_room_open(NULL, &d, &g), KVSTAGE_E_INVALID_ARG, "`engine`");
        EXPECT(kvstage_room_open(e, NULL, &g), KVSTAGE_E_INVALID_ARG, "`desc`");
        d.pages = NULL;
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`desc->pages`");
        d.num_pages = 0;
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`desc->num_pages`");
        d.pages = pages;
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`desc->num_pages`");
        d.pages = outside;
        d.num_pages = 3;
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`desc->pages`");
        d.pages = pages;
        d.num_pages = 4;
        d.struct_size = 0;
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`desc->struct_size`");
        d.struct_size = sizeof d;
        d.trace_id = "not a trace id";
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`desc->trace_id`");
        d.trace_id = NULL;
        /* A cached prefix is whole decode pages. */
        d.prefix_tokens = PAGE + 1;
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_E_INVALID_ARG, "`desc->prefix_tokens`");
        d.prefix_tokens = 0;
        /* The grid is required (its key is the only way to name this opening), and a refused
         * opening opens nothing: the room can be opened right after. */
        EXPECT(kvstage_room_open(e, &d, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
        CHECK_INT(g.num_chunks, 77);
        CHECK(g.key == 0);
        {
            /* A grid without a valid struct_size: refused, and room 2 is not opened either. */
            kvstage_room_grid bad, good;
            d.room = 2;
            memset(&bad, 0, sizeof bad);
            EXPECT(kvstage_room_open(e, &d, &bad), KVSTAGE_E_INVALID_ARG, "`out->struct_size`");
            CHECK(bad.key == 0);
            memset(&good, 0, sizeof good);
            good.struct_size = sizeof good;
            EXPECT(kvstage_room_open(e, &d, &good), KVSTAGE_OK, NULL);
            if (good.key != 0) EXPECT(kvstage_room_release(e, 2, good.key), KVSTAGE_OK, NULL);
            d.room = 1;
        }
        /* The grid of the opening; the key is never 0. */
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_OK, NULL);
        key = g.key;
        CHECK(key != 0);
        CHECK_INT(g.struct_size, sizeof g);
        CHECK_INT(g.num_chunks, 1);
        CHECK_INT(g.num_pages, 4);
        CHECK_INT(g.page_size, PAGE);
        CHECK_INT(g.chunk_tokens, KVSTAGE_DEFAULT_CHUNK_TOKENS);
        CHECK_INT(g.prefix_tokens, 0);
        memset(&again, 0, sizeof again);
        again.struct_size = sizeof again;
        EXPECT(kvstage_room_open(e, &d, &again), KVSTAGE_E_INVALID_ARG, "`desc->room`");
        CHECK(again.key == 0);
        EXPECT(kvstage_room_wait(NULL, 1, key, 10), KVSTAGE_E_INVALID_ARG, "`engine`");
        EXPECT(kvstage_room_wait(e, 424242, key, 10), KVSTAGE_E_STALE_ROOM, "room 424242");
        EXPECT(kvstage_room_wait(e, 1, 0, 10), KVSTAGE_E_INVALID_ARG, "`key`");
        EXPECT(kvstage_room_wait(e, 1, key, 1), KVSTAGE_E_TIMEOUT, "room 1");
        /* Another opening's key names nothing that is open. */
        EXPECT(kvstage_room_wait(e, 1, key + 1, 10), KVSTAGE_E_STALE_ROOM, "room 1");
        {
            size_t needed = 0;
            EXPECT(kvstage_room_describe(e, 1, key, NULL, 0, &needed), KVSTAGE_OK, NULL);
            CHECK(needed > 2);
            EXPECT(kvstage_room_describe(e, 1, key + 1, NULL, 0, &needed), KVSTAGE_E_STALE_ROOM, "room 1");
        }
        count = 99;
        EXPECT(kvstage_room_poll_events(NULL, 1, key, events, 4, &count), KVSTAGE_E_INVALID_ARG, "`engine`");
        EXPECT(kvstage_room_poll_events(e, 1, key, NULL, 4, &count), KVSTAGE_E_INVALID_ARG, "`events`");
        EXPECT(kvstage_room_poll_events(e, 1, key, events, 4, NULL), KVSTAGE_E_INVALID_ARG, "`count`");
        EXPECT(kvstage_room_poll_events(e, 1, key, events, 4, &count), KVSTAGE_OK, NULL);
        CHECK_INT(count, 0);
        EXPECT(kvstage_room_release(NULL, 1, key), KVSTAGE_E_INVALID_ARG, "`engine`");
        EXPECT(kvstage_room_release(e, 1, 0), KVSTAGE_E_INVALID_ARG, "`key`");
        EXPECT(kvstage_room_release(e, 1, key), KVSTAGE_OK, NULL);
        /* Idempotent: an opening no longer open (or never: unknown rooms) is fine. */
        EXPECT(kvstage_room_release(e, 1, key), KVSTAGE_OK, NULL);
        EXPECT(kvstage_room_release(e, 424242, key), KVSTAGE_OK, NULL);
        /* Every opening of an id gets a fresh key; releasing an older opening's key does nothing
         * to the open one. */
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_OK, NULL);
        key2 = g.key;
        CHECK(key2 != 0 && key2 != key);
        EXPECT(kvstage_room_release(e, 1, key), KVSTAGE_OK, NULL);
        EXPECT(kvstage_room_wait(e, 1, key2, 1), KVSTAGE_E_TIMEOUT, "room 1"); /* still open */
        memset(&again, 0, sizeof again);
        again.struct_size = sizeof again;
        EXPECT(kvstage_room_open(e, &d, &again), KVSTAGE_E_INVALID_ARG, "`desc->room`");
        EXPECT(kvstage_room_release(e, 1, key2), KVSTAGE_OK, NULL);
        /* Released: its id opens again. */
        EXPECT(kvstage_room_open(e, &d, &g), KVSTAGE_OK, NULL);
        CHECK(g.key != 0 && g.key != key && g.key != key2);
        EXPECT(kvstage_room_release(e, 1, g.key), KVSTAGE_OK, NULL);
    }

    kvstage_engine_free(e);
    host_pool_free(&p);
}

/* --- KV layouts ----------------------------------------------------------------------------- */

static void test_layouts(void) {
    host_pool p;
    kvstage_kv_layout l;
    uint32_t bad_ids[LAYERS] = {1, 1};
    uint64_t k[LAYERS], v[LAYERS];
    pool_init(&p);

    EXPECT(kvstage_kv_layout_init(NULL, sizeof(kvstage_kv_layout)), KVSTAGE_E_INVALID_ARG, "`layout`");
    EXPECT(kvstage_kv_layout_init(&l, sizeof(size_t)), KVSTAGE_E_INVALID_ARG, "`size`");
    EXPECT(kvstage_kv_layout_init(&l, (size_t)2 << 20), KVSTAGE_E_INVALID_ARG, "`size`");
    EXPECT(kvstage_kv_layout_validate(NULL), KVSTAGE_E_INVALID_ARG, "`layout`");

#define BAD_FIELD(field, value, code, msg, cause)                                   \
    do {                                                                            \
        l = p.layout;                                                               \
        l.field = value;                                                            \
        EXPECT_CAUSE(kvstage_kv_layout_validate(&l), code, msg, cause);             \
    } while (0)

    BAD_FIELD(struct_size, 0, KVSTAGE_E_INVALID_ARG, "`layout->struct_size`", NULL);
    BAD_FIELD(struct_size, 8, KVSTAGE_E_INVALID_ARG, "`layout->struct_size`", NULL);
    BAD_FIELD(struct_size, SIZE_MAX, KVSTAGE_E_INVALID_ARG, "`layout->struct_size`", NULL);
    BAD_FIELD(model_kind, 2, KVSTAGE_E_INVALID_ARG, "`layout->model_kind`", NULL);
    BAD_FIELD(model_kind, -1, KVSTAGE_E_INVALID_ARG, "`layout->model_kind`", NULL);
    BAD_FIELD(memory_kind, 9, KVSTAGE_E_INVALID_ARG, "`layout->memory_kind`", NULL);
    BAD_FIELD(num_layers, 0, KVSTAGE_E_INVALID_ARG, "`layout->num_layers`", NULL);
    BAD_FIELD(layer_ids, bad_ids, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`layer_ids`");
    BAD_FIELD(k_bases, NULL, KVSTAGE_E_INVALID_ARG, "`layout->k_bases`", NULL);
    BAD_FIELD(v_bases, NULL, KVSTAGE_E_INVALID_ARG, "`layout->v_bases`", NULL);
    BAD_FIELD(page_size, 0, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`page_size`");
    BAD_FIELD(page_size, UINT32_MAX, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`page_size`");
    BAD_FIELD(dtype_bytes, 3, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`dtype_bytes`");
    BAD_FIELD(head_dim, 0, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`head_dim`");
    BAD_FIELD(tp_size, 0, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`tp_size`");
    BAD_FIELD(tp_rank, 1, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`tp_rank`");
    BAD_FIELD(tp_rank, UINT32_MAX, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`tp_rank`");
    BAD_FIELD(pp_size, 0, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`pp_size`");
    BAD_FIELD(pp_rank, 1, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`pp_rank`");
    BAD_FIELD(local_heads, 1, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`local_heads`");
    BAD_FIELD(global_heads, 0, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`global_heads`");
    BAD_FIELD(capacity_pages, 0, KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`capacity_pages`");
    /* Named through the stride it overflows with (the count is the capacity). */
    BAD_FIELD(capacity_pages, UINT64_MAX, KVSTAGE_E_GEOMETRY_INVALID, "`layout`",
              "18446744073709551615 pages of 128 bytes overflow the address space");
#undef BAD_FIELD

    /* GQA heads that do not split over TP 2: 3 heads. */
    l = p.layout;
    l.global_heads = 3;
    l.local_heads = 1;
    l.tp_size = 2;
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`global_heads`");

    /* Buffers: NULL, overlapping (whole and by one byte), past the end of the address space. */
    memcpy(k, p.k, sizeof k);
    memcpy(v, p.v, sizeof v);
    l = p.layout;
    l.k_bases = k;
    l.v_bases = v;
    k[1] = 0;
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "is NULL");
    k[1] = p.k[1];
    v[0] = k[0];
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`",
                 "`bases[2] (V of layer 0)`: 0x");
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "puts rows on bytes of bases[0] (K of layer 0)");
    v[0] = k[0] + p.buffer - 1;
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "puts rows on bytes of bases[0] (K of layer 0)");
    v[0] = p.v[0];
    k[1] = v[1];
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "puts rows on bytes of bases[1] (K of layer 1)");
    k[1] = UINT64_MAX - 16;
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "overflows");
    k[1] = p.k[1];
    EXPECT(kvstage_kv_layout_validate(&l), KVSTAGE_OK, NULL);

    /* The same checks guard registration. */
    {
        kvstage_engine *e = engine_new();
        v[0] = k[0];
        EXPECT_CAUSE(kvstage_pool_register(e, &l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "puts rows on bytes of");
        l.tp_rank = 5;
        EXPECT_CAUSE(kvstage_pool_register(e, &l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`tp_rank`");
        kvstage_engine_free(e);
    }
    host_pool_free(&p);
}

/* --- layout presets and strides ---------------------------------------------------------------- */

/* kvstage_kv_layout_preset's bad input (nothing written: the strides keep a canary), and strides
 * kvstage_kv_layout_validate refuses naming the field and its value. The pool: bad_input's shape
 * (2 layers, 2 heads of 8 bf16 elements = 16-byte rows, 4-token pages, 16 pages). */
static void test_layout_strides(void) {
    enum { ROW = HEAD_DIM * DTYPE, CELL = 2 * ROW };
    const uint64_t CANARY = 0xC5C5C5C5C5C5C5C5ull;
    host_pool p;
    kvstage_kv_layout l;
    uint64_t layer_stride = 77, k[LAYERS];
    uint8_t *tensor;
    size_t tensor_bytes;
    int preset;
    pool_init(&p);

    /* Every preset sets strides the same shape validates with (the byte-level check of what they
     * mean is the `layouts` int test's). */
    for (preset = KVSTAGE_LAYOUT_SGLANG; preset <= KVSTAGE_LAYOUT_TRTLLM; ++preset) {
        l = p.layout;
        EXPECT(kvstage_kv_layout_preset(&l, preset, NULL), KVSTAGE_OK, NULL);
        CHECK(l.token_stride != 0 && l.head_stride != 0 && l.page_stride != 0);
        CHECK((preset == KVSTAGE_LAYOUT_SGLANG) == (l.v_offset == 0));
    }

    /* A preset value that is none: refused naming `preset`, the layout untouched. */
    l = p.layout;
    l.page_stride = l.token_stride = l.head_stride = l.v_offset = CANARY;
    EXPECT(kvstage_kv_layout_preset(&l, 8, &layer_stride), KVSTAGE_E_INVALID_ARG, "`preset`");
    EXPECT(kvstage_kv_layout_preset(&l, -1, &layer_stride), KVSTAGE_E_INVALID_ARG, "`preset`");
    EXPECT(kvstage_kv_layout_preset(&l, INT32_MAX, &layer_stride), KVSTAGE_E_INVALID_ARG, "`preset`");
    EXPECT(kvstage_kv_layout_preset(NULL, KVSTAGE_LAYOUT_SGLANG, &layer_stride), KVSTAGE_E_INVALID_ARG, "`layout`");
    /* capacity_pages 0: some layouts' strides span the blocks. */
    l.capacity_pages = 0;
    EXPECT(kvstage_kv_layout_preset(&l, KVSTAGE_LAYOUT_VLLM_LHBNC, &layer_stride), KVSTAGE_E_INVALID_ARG,
           "`layout->capacity_pages`");
    l.capacity_pages = CAPACITY;
    /* A shape that is no shape. */
    l.num_layers = 0;
    EXPECT(kvstage_kv_layout_preset(&l, KVSTAGE_LAYOUT_TRTLLM, &layer_stride), KVSTAGE_E_INVALID_ARG, "`layout->num_layers`");
    l.num_layers = LAYERS;
    /* A caller of 0.4, whose struct ends before the strides: nothing to set them in. */
    l.struct_size = offsetof(kvstage_kv_layout, page_stride);
    EXPECT(kvstage_kv_layout_preset(&l, KVSTAGE_LAYOUT_VLLM_LBHNC, &layer_stride), KVSTAGE_E_INVALID_ARG,
           "`layout->struct_size`");
    CHECK(l.page_stride == CANARY && l.token_stride == CANARY && l.head_stride == CANARY && l.v_offset == CANARY);
    CHECK_INT(l.capacity_pages, CAPACITY);
    CHECK_INT(layer_stride, 77);

    /* Strides validate refuses, each naming the field and both values. bad_input's pool is
     * token-major: slots of 2 heads · 16 bytes, pages of 4 slots. */
    l = p.layout;
    l.token_stride = 2 * ROW + 1; /* not whole elements */
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`token_stride`: 33");
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "dtype_bytes 2");
    l.token_stride = 0;
    l.head_stride = ROW - DTYPE; /* smaller than a head's row */
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`head_stride`: 14");
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "16 bytes of a head's row");
    l.head_stride = 0;
    l.page_stride = (PAGE - 1) * 2 * ROW; /* a page shorter than its slots */
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`page_stride`: 96");
    l.page_stride = 0;
    /* v_bases and v_offset both set: V lies in its own buffers or after K, not both. */
    l.v_offset = ROW;
    EXPECT(kvstage_kv_layout_validate(&l), KVSTAGE_E_INVALID_ARG, "`layout->v_offset`");
    /* Neither: no V at all. */
    l.v_offset = 0;
    l.v_bases = NULL;
    EXPECT(kvstage_kv_layout_validate(&l), KVSTAGE_E_INVALID_ARG, "`layout->v_bases`");

    /* An interleaved layout (vLLM's [L, B, H, N, K‖V]) in memory of its own: valid with V one row
     * after K, refused with V one element short of it (V's rows overlap K's), naming the V buffer
     * and the K buffer it lands on. */
    tensor_bytes = (size_t)LAYERS * CAPACITY * HEADS * PAGE * CELL;
    tensor = (uint8_t *)calloc(1, tensor_bytes);
    REQUIRE(tensor != NULL);
    l = p.layout;
    EXPECT(kvstage_kv_layout_preset(&l, KVSTAGE_LAYOUT_VLLM_LBHNC, &layer_stride), KVSTAGE_OK, NULL);
    CHECK_INT(layer_stride, tensor_bytes / LAYERS);
    CHECK_INT(l.v_offset, ROW);
    k[0] = (uint64_t)(uintptr_t)tensor;
    k[1] = k[0] + layer_stride;
    l.k_bases = k;
    l.v_bases = NULL;
    EXPECT(kvstage_kv_layout_validate(&l), KVSTAGE_OK, NULL);
    l.v_offset = ROW - DTYPE;
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "(V of layer 0)");
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "puts rows on bytes of bases[0] (K of layer 0)");
    /* V a whole page after K: on K's next page. */
    l.v_offset = l.page_stride;
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "puts rows on bytes of bases[0]");
    /* Two layers one row apart: layer 1's K on layer 0's V. */
    l.v_offset = ROW;
    k[1] = k[0] + ROW;
    EXPECT_CAUSE(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "puts rows on bytes of");
    k[1] = k[0] + layer_stride;
    /* The same refusals guard registration. */
    {
        kvstage_engine *e = engine_new();
        l.v_offset = ROW - DTYPE;
        EXPECT_CAUSE(kvstage_pool_register(e, &l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "(V of layer 0)");
        l.v_offset = ROW;
        l.head_stride = ROW - DTYPE;
        EXPECT_CAUSE(kvstage_pool_register(e, &l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`", "`head_stride`");
        kvstage_engine_free(e);
    }
    free(tensor);
    host_pool_free(&p);
}

/* --- geometry helpers ------------------------------------------------------------------------ */

static void test_geometry(void) {
    kvstage_head_slice hs;
    kvstage_staging_layout st;
    kvstage_staging_writer writers[4];
    uint32_t n = 0;
    host_pool src, dst;
    pool_init(&src);
    pool_init(&dst);
    /* Prefill TP 2 (one head each) feeding a decode TP 1 rank: 2 writers. */
    src.layout.tp_size = 2;
    src.layout.tp_rank = 1;
    src.layout.local_heads = 1;

    {
        static const uint32_t groups[1] = {8};
        kvstage_state_item item;
        kvstage_byte_range r[4];
        size_t count = 0;
        EXPECT(kvstage_state_item_init(NULL, sizeof(kvstage_state_item)), KVSTAGE_E_INVALID_ARG, "`item`");
        REQUIRE(kvstage_state_item_init(&item, sizeof item) == KVSTAGE_OK);
        EXPECT(kvstage_state_slice_compute(NULL, 2, 1, 0, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`item`");
        item.num_groups = 1; /* group_dims still NULL */
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 0, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`item->group_dims`");
        item.group_dims = groups;
        item.replicated = 2;
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 0, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`item->replicated`");
        item.replicated = 0;
        item.outer = 0;
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 0, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`outer`");
        item.outer = 1;
        EXPECT(kvstage_state_slice_compute(&item, 0, 1, 0, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`src_tp`");
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 2, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`src_rank`");
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 0, 1, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`dst_rank`");
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 0, 0, NULL, 4, &count), KVSTAGE_E_INVALID_ARG, "`out`");
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 0, 0, NULL, 0, NULL), KVSTAGE_E_INVALID_ARG, "`count`");
        item.struct_size = 0;
        EXPECT(kvstage_state_slice_compute(&item, 2, 1, 0, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`item->struct_size`");
    }
    EXPECT(kvstage_head_slice_compute(2, 1, 0, 0, 8, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    EXPECT(kvstage_head_slice_compute(0, 1, 0, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "`src_tp`");
    EXPECT(kvstage_head_slice_compute(2, 0, 0, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "`dst_tp`");
    EXPECT(kvstage_head_slice_compute(2, 1, 2, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "`src_rank`");
    EXPECT(kvstage_head_slice_compute(2, 1, UINT32_MAX, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "`src_rank`");
    EXPECT(kvstage_head_slice_compute(2, 4, 0, 4, 8, &hs), KVSTAGE_E_INVALID_ARG, "`dst_rank`");
    EXPECT(kvstage_head_slice_compute(2, 1, 0, 0, 0, &hs), KVSTAGE_E_INVALID_ARG, "`total_kv_heads`");
    /* TP 3 and 2 pair (each side's TP divides 6 heads), but not with 4 heads. */
    EXPECT(kvstage_head_slice_compute(3, 2, 0, 0, 4, &hs), KVSTAGE_E_INVALID_ARG, "`total_kv_heads`");
    EXPECT(kvstage_head_slice_compute(3, 2, 2, 0, 6, &hs), KVSTAGE_E_INVALID_ARG, "`src_rank`");
    /* A pair that exchanges nothing: prefill rank 3 of 4 writes to decode rank 1 of 2, not 0. */
    EXPECT(kvstage_head_slice_compute(4, 2, 3, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "`src_rank`");
    EXPECT(kvstage_head_slice_compute(2, 4, 0, 3, 8, &hs), KVSTAGE_E_INVALID_ARG, "`dst_rank`");

    EXPECT(kvstage_grid_tokens_compute(16, 4, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    EXPECT(kvstage_grid_tokens_compute(16, 0, &n), KVSTAGE_E_INVALID_ARG, "`page_size`");
    {
        /* A room's grid as kvstage_room_open (decode) or kvstage_session_room_grid_get (prefill)
         * gave it: chunks of 64 tokens in decode pages of 16, no cached prefix, 100 tokens. */
        kvstage_room_grid g;
        kvstage_chunk_span sp;
        memset(&g, 0, sizeof g);
        g.struct_size = sizeof g;
        g.key = 1;
        g.chunk_tokens = 64;
        g.num_chunks = 2;
        g.num_pages = 7;
        g.page_size = 16;
        memset(&sp, 0, sizeof sp);
        sp.struct_size = sizeof sp;
        EXPECT(kvstage_chunk_span_compute(&g, 100, 16, 0, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
        EXPECT(kvstage_chunk_span_compute(NULL, 100, 16, 0, &sp), KVSTAGE_E_INVALID_ARG, "`grid`");
        EXPECT(kvstage_chunk_span_compute(&g, 100, 0, 0, &sp), KVSTAGE_E_INVALID_ARG, "`src_page_size`");
        g.page_size = 0;
        EXPECT(kvstage_chunk_span_compute(&g, 100, 16, 0, &sp), KVSTAGE_E_INVALID_ARG, "`grid->page_size`");
        g.page_size = 16;
        g.prefix_tokens = 112;
        EXPECT(kvstage_chunk_span_compute(&g, 100, 16, 0, &sp), KVSTAGE_E_INVALID_ARG, "leaves none");
        g.prefix_tokens = 0;
        g.struct_size = 0;
        EXPECT(kvstage_chunk_span_compute(&g, 100, 16, 0, &sp), KVSTAGE_E_INVALID_ARG, "`grid->struct_size`");
        g.struct_size = sizeof g;
        sp.struct_size = 0;
        EXPECT(kvstage_chunk_span_compute(&g, 100, 16, 0, &sp), KVSTAGE_E_INVALID_ARG, "`out->struct_size`");
        sp.struct_size = sizeof sp;
        EXPECT(kvstage_chunk_span_compute(&g, 100, 16, 1, &sp), KVSTAGE_OK, NULL);
        CHECK_INT(sp.num_tokens, 36);
    }

    st.struct_size = sizeof st;
    memset(writers, 0, sizeof writers);
    writers[0].struct_size = sizeof writers[0]; /* the caller's element size (its stride) */
    EXPECT(kvstage_staging_layout_compute(NULL, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_INVALID_ARG, "`prefill_stages`");
    EXPECT(kvstage_staging_layout_compute(&src.layout, 0, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_INVALID_ARG, "is empty");
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, NULL, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_INVALID_ARG, "`dst`");
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, NULL, writers, 4), KVSTAGE_E_INVALID_ARG, "`out`");
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, NULL, 4), KVSTAGE_E_INVALID_ARG, "`writers`");
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 1), KVSTAGE_E_INVALID_ARG,
           "`writers_len`");
    CHECK_INT(st.num_writers, 2); /* still filled */
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, NULL, 0), KVSTAGE_OK, NULL);
    writers[0].struct_size = 0;
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_INVALID_ARG,
           "struct_size");
    writers[0].struct_size = sizeof writers[0];
    /* Any token count (a request's last chunk may end inside a page). */
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 6, &st, writers, 4), KVSTAGE_OK, NULL);
    CHECK_INT(st.tokens, 6);
    st.struct_size = 0;
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_INVALID_ARG,
           "`out->struct_size`");
    st.struct_size = sizeof st;
    src.layout.struct_size = 0;
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_INVALID_ARG,
           "`prefill_stages[0]->struct_size`");
    src.layout.struct_size = sizeof src.layout;
    dst.layout.tp_rank = 1;
    EXPECT_CAUSE(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_GEOMETRY_INVALID,
                 "`dst`", "`tp_rank`");
    dst.layout.tp_rank = 0;
    /* Only the shape is read: bases may be NULL. */
    src.layout.k_bases = NULL;
    src.layout.v_bases = NULL;
    EXPECT(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_OK, NULL);
    /* Geometry that disagrees (head_dim): a mismatch, one cause per field. */
    src.layout.head_dim = 16;
    EXPECT_CAUSE(kvstage_staging_layout_compute(&src.layout, 1, &dst.layout, NULL, 0, NULL, 0, 8, &st, writers, 4), KVSTAGE_E_GEOMETRY_MISMATCH,
                 "", "head_dim");
    host_pool_free(&src);
    host_pool_free(&dst);
}

/* --- sessions, transfers, operations ----------------------------------------------------------- */

static void test_sessions(void) {
    host_pool pre, dec;
    kvstage_engine *decode, *prefill, *bare;
    kvstage_session *s = NULL, *out_s = SENTINEL_SESSION;
    kvstage_op *op = SENTINEL_OP;
    kvstage_transfer_desc d;
    char addr[64];
    const uint32_t src_pages[2] = {0, 1};
    const uint32_t outside[2] = {0, CAPACITY + 3};
    char *bad_utf8 = (char *)malloc(3);
    REQUIRE(bad_utf8 != NULL);
    bad_utf8[0] = 'a';
    bad_utf8[1] = (char)0xc0;
    bad_utf8[2] = 0;

    pool_init(&pre);
    pool_init(&dec);
    decode = engine_new();
    prefill = engine_new();
    bare = engine_new();
    REQUIRE(kvstage_pool_register(decode, &dec.layout) == KVSTAGE_OK);
    REQUIRE(kv_staging_register(decode, NULL, 1 << 16) == KVSTAGE_OK);
    REQUIRE(kvstage_pool_register(prefill, &pre.layout) == KVSTAGE_OK);
    REQUIRE(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL) == KVSTAGE_OK);

    EXPECT(kvstage_session_connect(NULL, addr, "bad-1", 2000, &out_s), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_session_connect(prefill, NULL, "bad-1", 2000, &out_s), KVSTAGE_E_INVALID_ARG, "`peer_address`");
    EXPECT(kvstage_session_connect(prefill, addr, NULL, 2000, &out_s), KVSTAGE_E_INVALID_ARG, "`session_id`");
    EXPECT(kvstage_session_connect(prefill, addr, "bad-1", 2000, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    EXPECT(kvstage_session_connect(prefill, "decode-0", "bad-1", 2000, &out_s), KVSTAGE_E_INVALID_ARG,
           "`peer_address`");
    EXPECT(kvstage_session_connect(prefill, bad_utf8, "bad-1", 2000, &out_s), KVSTAGE_E_INVALID_ARG,
           "`peer_address`");
    EXPECT(kvstage_session_connect(prefill, addr, "", 2000, &out_s), KVSTAGE_E_INVALID_ARG, "`session_id`");
    EXPECT(kvstage_session_connect(prefill, addr, bad_utf8, 2000, &out_s), KVSTAGE_E_INVALID_ARG, "`session_id`");
    /* A sender needs its own pool first. */
    EXPECT(kvstage_session_connect(bare, addr, "bad-1", 2000, &out_s), KVSTAGE_E_INVALID_ARG, "`engine`");
    CHECK(out_s == SENTINEL_SESSION);

    REQUIRE(kvstage_session_connect(prefill, addr, "bad-ok", 5000, &s) == KVSTAGE_OK);
    REQUIRE(s != NULL);

    EXPECT(kvstage_transfer_desc_init(NULL, sizeof(kvstage_transfer_desc)), KVSTAGE_E_INVALID_ARG, "`desc`");
    EXPECT(kvstage_transfer_desc_init(&d, offsetof(kvstage_transfer_desc, room_key)), KVSTAGE_E_INVALID_ARG, "`size`");
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = 1;
    d.src_pages = src_pages;
    d.num_pages = 2;
    d.timeout_ms = 2000;

    /* Every transfer names the room's opening by its key: 0 (never handed out) is refused by
     * every path before anything is sent. */
    EXPECT(kvstage_transfer(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->room_key`");
    EXPECT(kvstage_transfer_slices(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->room_key`");
    EXPECT(kvstage_transfer_async(s, &d, &op), KVSTAGE_E_INVALID_ARG, "`desc->room_key`");
    EXPECT(kvstage_transfer_layerwise_async(s, &d, &op), KVSTAGE_E_INVALID_ARG, "`desc->room_key`");
    CHECK(op == SENTINEL_OP);
    /* A descriptor that ends before `room_key` (smaller than the first published version): refused. */
    d.room_key = 1;
    d.struct_size = offsetof(kvstage_transfer_desc, room_key);
    EXPECT(kvstage_transfer(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->struct_size`");
    d.struct_size = sizeof d;
    /* The grid request names the opening too. */
    {
        kvstage_room_grid grid;
        memset(&grid, 0, sizeof grid);
        grid.struct_size = sizeof grid;
        EXPECT(kvstage_session_room_grid_get(s, 1, 0, 2000, &grid), KVSTAGE_E_INVALID_ARG, "`key`");
        CHECK_INT(grid.num_chunks, 0);
    }

    /* From here on a key (for a room the decode side never opened; only the arguments are
     * checked until the real operation below). */
    d.room_key = 1;
    EXPECT(kvstage_transfer(NULL, &d), KVSTAGE_E_INVALID_ARG, "`session`");
    EXPECT(kvstage_transfer(s, NULL), KVSTAGE_E_INVALID_ARG, "`desc`");
    EXPECT(kvstage_transfer_slices(NULL, &d), KVSTAGE_E_INVALID_ARG, "`session`");
    EXPECT(kvstage_transfer_slices(s, NULL), KVSTAGE_E_INVALID_ARG, "`desc`");
    EXPECT(kvstage_transfer_async(NULL, &d, &op), KVSTAGE_E_INVALID_ARG, "`session`");
    EXPECT(kvstage_transfer_async(s, NULL, &op), KVSTAGE_E_INVALID_ARG, "`desc`");
    EXPECT(kvstage_transfer_async(s, &d, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    CHECK(op == SENTINEL_OP);

    d.struct_size = 0;
    EXPECT(kvstage_transfer(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->struct_size`");
    d.struct_size = SIZE_MAX;
    EXPECT(kvstage_transfer_slices(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->struct_size`");
    d.struct_size = sizeof d;
    d.src_pages = NULL;
    EXPECT(kvstage_transfer(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->src_pages`");
    EXPECT(kvstage_transfer_async(s, &d, &op), KVSTAGE_E_INVALID_ARG, "`desc->src_pages`");
    CHECK(op == SENTINEL_OP);
    d.num_pages = 0;
    EXPECT(kvstage_transfer(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->num_pages`");
    d.src_pages = outside;
    d.num_pages = 2;
    EXPECT(kvstage_transfer(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->src_pages`");
    EXPECT(kvstage_transfer_slices(s, &d), KVSTAGE_E_INVALID_ARG, "`desc->src_pages`");
    EXPECT(kvstage_transfer_async(s, &d, &op), KVSTAGE_E_INVALID_ARG, "`desc->src_pages`");
    CHECK(op == SENTINEL_OP);

    EXPECT(kvstage_op_poll(NULL), KVSTAGE_E_INVALID_ARG, "`op`");
    EXPECT(kvstage_op_wait(NULL, 10), KVSTAGE_E_INVALID_ARG, "`op`");
    EXPECT(kvstage_op_cancel(NULL), KVSTAGE_E_INVALID_ARG, "`op`");

    /* A real operation on a room the receiver never opened: it ends in an error (not a hang), and
     * its result can be read again and again. */
    d.src_pages = src_pages;
    d.room = 9999;
    op = NULL;
    EXPECT(kvstage_transfer_async(s, &d, &op), KVSTAGE_PENDING, NULL);
    REQUIRE(op != NULL);
    {
        int rc = (int)kvstage_op_wait(op, 5000);
        ++g_cases;
        CHECK(rc < 0);
        CHECK_INT(kvstage_error_last()->code, rc);
        CHECK_CONTAINS(kvstage_error_last()->message, "room 9999");
        CHECK_INT(kvstage_op_poll(op), rc);
        EXPECT(kvstage_op_cancel(op), KVSTAGE_OK, NULL); /* after the end: harmless */
        CHECK_INT(kvstage_op_poll(op), rc);
    }
    kvstage_op_free(op);

    /* Nothing leaked in the decode ring by any of the above. */
    {
        kvstage_engine_stats stats;
        stats.struct_size = sizeof stats;
        REQUIRE(kvstage_engine_stats_get(decode, &stats) == KVSTAGE_OK);
        CHECK_INT(stats.ring_live_allocations, 0);
    }

    kvstage_session_free(s);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);
    kvstage_engine_free(bare);
    host_pool_free(&pre);
    host_pool_free(&dec);
    free(bad_utf8);
}

/* --- pointers that are not handles ------------------------------------------------------------ */

static void test_foreign_handles(void) {
    /* Zeroed memory: never a live handle (the library never reads through a handle pointer). */
    void *zeros = calloc(1, 1 << 16);
    kvstage_transfer_desc d;
    char buf[64];
    REQUIRE(zeros != NULL);
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);

    EXPECT(kvstage_engine_listen_address((const kvstage_engine *)zeros, buf, sizeof buf, NULL), KVSTAGE_E_INVALID_ARG,
           "not a live kvstage handle");
    CHECK_CONTAINS(kvstage_error_last()->message, "`engine`");
    EXPECT(kvstage_room_release((const kvstage_engine *)zeros, 1, 1), KVSTAGE_E_INVALID_ARG, "`engine`");
    EXPECT(kvstage_transfer((const kvstage_session *)zeros, &d), KVSTAGE_E_INVALID_ARG, "`session`");
    EXPECT(kvstage_op_poll((const kvstage_op *)zeros), KVSTAGE_E_INVALID_ARG, "`op`");
    EXPECT(kvstage_op_cancel((const kvstage_op *)zeros), KVSTAGE_E_INVALID_ARG, "`op`");

    /* _free of a foreign pointer: ignored (said in the last error), the memory untouched. */
    kvstage_engine_free((kvstage_engine *)zeros);
    EXPECT(kvstage_error_last()->code, KVSTAGE_E_INVALID_ARG, "not a live kvstage handle");
    kvstage_session_free((kvstage_session *)zeros);
    EXPECT(kvstage_error_last()->code, KVSTAGE_E_INVALID_ARG, "`session`");
    kvstage_op_free((kvstage_op *)zeros);
    EXPECT(kvstage_error_last()->code, KVSTAGE_E_INVALID_ARG, "`op`");
    ++g_cases;
    {
        size_t i;
        const unsigned char *z = (const unsigned char *)zeros;
        for (i = 0; i < (1u << 16); i++)
            if (z[i] != 0) break;
        CHECK_INT(i, 1u << 16);
    }
    free(zeros);
}

/* --- a poisoned engine ----------------------------------------------------------------------- */

static void test_poisoned(void) {
    kvstage_engine *e = engine_new();
    kvstage_engine *fresh;
    kvstage_session *s = SENTINEL_SESSION;
    kvstage_engine_stats stats;
    kvstage_room_event events[2];
    kvstage_staging_memory staging;
    kvstage_room_desc desc;
    kvstage_room_grid grid;
    size_t count = 0;
    char buf[64];
    const uint32_t pages[1] = {0};
    host_pool p;
    pool_init(&p);
    stats.struct_size = sizeof stats;
    memset(events, 0, sizeof events);
    events[0].struct_size = sizeof events[0];
    REQUIRE(kvstage_staging_memory_init(&staging, sizeof staging) == KVSTAGE_OK);
    staging.bytes = 4096;
    REQUIRE(kvstage_room_desc_init(&desc, sizeof desc) == KVSTAGE_OK);
    desc.room = 1;
    desc.pages = pages;
    desc.num_pages = 1;
    memset(&grid, 0, sizeof grid);
    grid.struct_size = sizeof grid;

    EXPECT(kvstage_testing_panic(e), KVSTAGE_E_PANIC, "panic");

#define POISONED(call) EXPECT(call, KVSTAGE_E_POISONED, "`engine` (kvstage_engine) was poisoned")
    POISONED(kvstage_testing_panic(e));
    POISONED(kvstage_engine_listen_address(e, buf, sizeof buf, NULL));
    POISONED(kvstage_pool_register(e, &p.layout));
    POISONED(kvstage_pool_register(e, NULL)); /* the handle is checked first */
    POISONED(kvstage_staging_register(e, &staging));
    POISONED(kvstage_engine_stats_get(e, &stats));
    POISONED(kvstage_room_open(e, &desc, &grid));
    POISONED(kvstage_room_wait(e, 1, 1, 10));
    POISONED(kvstage_room_release(e, 1, 1));
    POISONED(kvstage_room_describe(e, 1, 1, buf, sizeof buf, NULL));
    POISONED(kvstage_room_poll_events(e, 1, 1, events, 2, &count));
    POISONED(kvstage_engine_poll_events(e, events, 2, &count));
    POISONED(kvstage_engine_describe(e, buf, sizeof buf, NULL));
    POISONED(kvstage_session_connect(e, "127.0.0.1:1", "poisoned", 100, &s));
#undef POISONED
    CHECK(s == SENTINEL_SESSION);
    CHECK(grid.key == 0);
    CHECK_INT(kvstage_error_last()->klass, KVSTAGE_CLASS_INTERNAL);

    /* Other engines are unaffected; the poisoned one can and must be freed. */
    fresh = engine_new();
    EXPECT(kvstage_engine_listen_address(fresh, buf, sizeof buf, NULL), KVSTAGE_OK, NULL);
    kvstage_engine_free(fresh);
    kvstage_engine_free(e);
    ++g_cases;
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    host_pool_free(&p);
}

int main(void) {
    test_global_and_options();
    test_engine_calls();
    test_layouts();
    test_layout_strides();
    test_geometry();
    test_sessions();
    test_foreign_handles();
    test_poisoned();
    printf("bad_input: %d cases\n", g_cases);
    CHECK(g_cases >= 50);
    return kv_finish("bad_input");
}
