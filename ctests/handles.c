/* Handles at the C boundary (docs/c-api-conventions.md, sections 2 and 8):
 *
 * - kinds: every export that takes an engine, a session or an op, given a live handle of each
 *   other kind, returns KVSTAGE_E_INVALID_ARG whose message names the argument and both kinds;
 *   `_free` of a handle of another kind leaves it alone (it keeps working) and says so in the
 *   last error;
 * - freed handles: every such export given a freed handle returns KVSTAGE_E_INVALID_ARG "not a
 *   live kvstage handle" (nothing is read through the pointer, so this is clean under ASan and
 *   valgrind), a second `_free` is harmless, and an address is never handed out again;
 * - free during a call: thread A blocks in kvstage_room_wait (engine), kvstage_transfer
 *   (session) or kvstage_op_wait (op) while thread B frees the handle. The free returns at once,
 *   A returns normally, the last user stops the object (a freed engine's port is closed once A
 *   returns), and later calls on the pointer return INVALID_ARG. Each race runs in a bounded
 *   loop with varying delays; at least one round of each must catch A inside its call.
 *
 * A blocked operation: the prefill rank is writer 0 of 2 (prefill TP 2, decode TP 1) and the
 * decode ring holds exactly one chunk. A "plug" chunk whose writer 1 never comes keeps the whole
 * ring, so every later chunk waits for the watermark until its own deadline.
 *
 * Also built as C++17. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "host_pool.h"

static int g_cases = 0;

/* --- checks ---------------------------------------------------------------------------------- */

/* `rc` (or, for `_free`, only the last error) is KVSTAGE_E_INVALID_ARG and the message contains
 * `arg` (as "`engine`") and `needle`. Reads the last error before any other kvstage call. */
static void expect_invalid_at(const char *file, int line, const char *what, int has_rc, int rc, const char *arg,
                              const char *needle) {
    const kvstage_error *e = kvstage_error_last();
    int ok = 1;
    ++g_cases;
    if (has_rc && rc != KVSTAGE_E_INVALID_ARG) {
        KV_FAIL_AT(file, line, "%s returned %d, expected KVSTAGE_E_INVALID_ARG", what, rc);
        ok = 0;
    }
    if ((int)e->code != KVSTAGE_E_INVALID_ARG) {
        KV_FAIL_AT(file, line, "%s: last error code %d, expected KVSTAGE_E_INVALID_ARG", what, (int)e->code);
        ok = 0;
    }
    if (strstr(e->message, arg) == NULL) {
        KV_FAIL_AT(file, line, "%s: message \"%s\" does not name %s", what, e->message, arg);
        ok = 0;
    }
    if (strstr(e->message, needle) == NULL) {
        KV_FAIL_AT(file, line, "%s: message \"%s\" does not contain \"%s\"", what, e->message, needle);
        ok = 0;
    }
    if (e->klass != KVSTAGE_CLASS_CONFIG) {
        KV_FAIL_AT(file, line, "%s: class %d, expected KVSTAGE_CLASS_CONFIG", what, (int)e->klass);
        ok = 0;
    }
    if (!ok) kv_print_last_error(what);
}

#define EXPECT_INVALID(call, arg, needle) \
    expect_invalid_at(__FILE__, __LINE__, #call, 1, (int)(call), (arg), (needle))
/* For the `_free` functions (void): only the last error tells. */
#define EXPECT_INVALID_VOID(call, arg, needle) \
    do {                                       \
        call;                                  \
        expect_invalid_at(__FILE__, __LINE__, #call, 0, 0, (arg), (needle)); \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_ms(unsigned ms) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ms / 1000);
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* --- fixtures -------------------------------------------------------------------------------- */

/* MHA: 2 layers, 2 KV heads of 8 bf16 elements, 4-token pages, 16 pages; chunks of 2 pages. */
enum { LAYERS = 2, HEADS = 2, HEAD_DIM = 8, DTYPE = 2, PAGE = 4, CAPACITY = 16, CHUNK_TOKENS = 8 };

static void pool_init(host_pool *p, uint32_t tp_rank, uint32_t tp_size) {
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, tp_rank, tp_size);
    host_pool_init(p, &shape);
}

/* An engine (one copy worker) with `p` as its pool. */
static kvstage_engine *engine_with_pool(const host_pool *p) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.worker_threads = 1;
    return host_pool_engine(&o, p, 0);
}

static uint64_t live_allocations(const kvstage_engine *e) {
    kvstage_engine_stats stats;
    stats.struct_size = sizeof stats;
    REQUIRE(kvstage_engine_stats_get(e, &stats) == KVSTAGE_OK);
    return stats.ring_live_allocations;
}

static const uint32_t SRC_PAGES[2] = {0, 1};
static const uint32_t DST_PAGES[4] = {4, 5, 6, 7};

typedef struct world {
    host_pool pre, dec;
    kvstage_engine *decode;  /* ring of exactly one chunk */
    kvstage_engine *prefill; /* writer 0 of 2 */
    kvstage_session *session;
    kvstage_op *op; /* ended: a transfer to a room the decode side never opened */
    int op_result;
    uint64_t plug_key; /* the opening of PLUG_ROOM */
    char addr[64];
} world;

/* The key transfers name for rooms the decode side never opened (any nonzero value). */
static const uint64_t NOT_OPEN_KEY = 1;

static void desc_for(kvstage_transfer_desc *d, uint64_t room, uint64_t room_key, uint32_t chunk, uint64_t timeout_ms) {
    REQUIRE(kvstage_transfer_desc_init(d, sizeof *d) == KVSTAGE_OK);
    d->room = room;
    d->room_key = room_key;
    d->chunk_index = chunk;
    d->src_pages = SRC_PAGES;
    d->num_pages = 2;
    d->timeout_ms = timeout_ms;
}

static void world_init(world *w) {
    kvstage_staging_layout st;
    kvstage_transfer_desc d;
    pool_init(&w->pre, 0, 2);
    pool_init(&w->dec, 0, 1);
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    REQUIRE(kvstage_staging_layout_compute(&w->pre.layout, 1, &w->dec.layout, NULL, 0, NULL, 0, CHUNK_TOKENS, &st, NULL, 0) == KVSTAGE_OK);
    REQUIRE(st.num_writers == 2);
    w->decode = engine_with_pool(&w->dec);
    REQUIRE(kv_staging_register(w->decode, NULL, (size_t)st.total_bytes) == KVSTAGE_OK);
    REQUIRE(kvstage_engine_listen_address(w->decode, w->addr, sizeof w->addr, NULL) == KVSTAGE_OK);
    w->prefill = engine_with_pool(&w->pre);
    w->session = NULL;
    CHECK_OK(kvstage_session_connect(w->prefill, w->addr, "handles", 5000, &w->session));
    REQUIRE(w->session != NULL);
    desc_for(&d, 9999, NOT_OPEN_KEY, 0, 2000);
    w->op = NULL;
    REQUIRE(kvstage_transfer_async(w->session, &d, &w->op) == KVSTAGE_PENDING);
    REQUIRE(w->op != NULL);
    w->op_result = (int)kvstage_op_wait(w->op, 5000);
    REQUIRE(w->op_result < 0); /* room 9999 is not open */
}

static void world_free(world *w) {
    kvstage_op_free(w->op);
    kvstage_session_free(w->session);
    kvstage_engine_free(w->prefill);
    kvstage_engine_free(w->decode);
    host_pool_free(&w->pre);
    host_pool_free(&w->dec);
}

/* --- every export that takes a handle, with a handle that is not a live one of its kind ------- */

#define SENTINEL_SESSION ((kvstage_session *)(uintptr_t)0x5e5e)
#define SENTINEL_OP ((kvstage_op *)(uintptr_t)0x5e5e)

/* `e` is not a live kvstage_engine; every message must name `engine` and contain `needle`. */
static void engine_exports(world *w, kvstage_engine *e, const char *needle) {
    char buf[64];
    size_t needed = 0, count = 0, still_mapped = 0;
    int32_t fd = -1;
    uint64_t drained = 0;
    kvstage_engine_stats stats;
    kvstage_staging_memory staging;
    kvstage_room_desc desc;
    kvstage_room_grid grid;
    kvstage_room_event events[4];
    kvstage_session *s = SENTINEL_SESSION;
    stats.struct_size = sizeof stats;
    REQUIRE(kvstage_staging_memory_init(&staging, sizeof staging) == KVSTAGE_OK);
    staging.bytes = 4096;
    REQUIRE(kvstage_room_desc_init(&desc, sizeof desc) == KVSTAGE_OK);
    desc.room = 77;
    desc.pages = DST_PAGES;
    desc.num_pages = 2;
    desc.chunk_tokens = CHUNK_TOKENS;
    memset(&grid, 0, sizeof grid);
    grid.struct_size = sizeof grid;
    memset(events, 0, sizeof events);
    events[0].struct_size = sizeof events[0];

    EXPECT_INVALID(kvstage_engine_listen_address(e, buf, sizeof buf, NULL), "`engine`", needle);
    EXPECT_INVALID(kvstage_pool_register(e, &w->dec.layout), "`engine`", needle);
    EXPECT_INVALID(kvstage_staging_register(e, &staging), "`engine`", needle);
    EXPECT_INVALID(kvstage_engine_stats_get(e, &stats), "`engine`", needle);
    EXPECT_INVALID(kvstage_engine_describe(e, buf, sizeof buf, &needed), "`engine`", needle);
    EXPECT_INVALID(kvstage_engine_completion_fd(e, &fd), "`engine`", needle);
    EXPECT_INVALID(kvstage_engine_completions_drain(e, &drained), "`engine`", needle);
    EXPECT_INVALID(kvstage_engine_shutdown(e, 10, &still_mapped), "`engine`", needle);
    EXPECT_INVALID(kvstage_session_connect(e, w->addr, "wrong", 1000, &s), "`engine`", needle);
    CHECK(s == SENTINEL_SESSION);
    EXPECT_INVALID(kvstage_room_open(e, &desc, &grid), "`engine`", needle);
    CHECK(grid.key == 0);
    EXPECT_INVALID(kvstage_room_wait(e, 77, 1, 10), "`engine`", needle);
    EXPECT_INVALID(kvstage_room_release(e, 77, 1), "`engine`", needle);
    EXPECT_INVALID(kvstage_room_describe(e, 77, 1, buf, sizeof buf, &needed), "`engine`", needle);
    EXPECT_INVALID(kvstage_room_poll_events(e, 77, 1, events, 4, &count), "`engine`", needle);
    EXPECT_INVALID(kvstage_engine_poll_events(e, events, 4, &count), "`engine`", needle);
#if defined(KVSTAGE_TESTING)
    EXPECT_INVALID(kvstage_testing_panic(e), "`engine`", needle);
#endif
    EXPECT_INVALID_VOID(kvstage_engine_free(e), "`engine`", needle);
}

/* `s` is not a live kvstage_session. */
static void session_exports(kvstage_session *s, const char *needle) {
    kvstage_transfer_desc d;
    kvstage_op *op = SENTINEL_OP;
    desc_for(&d, 5, NOT_OPEN_KEY, 0, 1000);
    EXPECT_INVALID(kvstage_transfer(s, &d), "`session`", needle);
    EXPECT_INVALID(kvstage_transfer_slices(s, &d), "`session`", needle);
    EXPECT_INVALID(kvstage_transfer_async(s, &d, &op), "`session`", needle);
    CHECK(op == SENTINEL_OP);
    EXPECT_INVALID_VOID(kvstage_session_free(s), "`session`", needle);
}

/* `op` is not a live kvstage_op. */
static void op_exports(kvstage_op *op, const char *needle) {
    EXPECT_INVALID(kvstage_op_poll(op), "`op`", needle);
    EXPECT_INVALID(kvstage_op_wait(op, 10), "`op`", needle);
    EXPECT_INVALID(kvstage_op_cancel(op), "`op`", needle);
    EXPECT_INVALID_VOID(kvstage_op_free(op), "`op`", needle);
}

/* The world's handles still work (a wrong-kind `_free` must not have freed them). */
static void still_live(world *w) {
    char buf[64];
    ++g_cases;
    CHECK_OK(kvstage_engine_listen_address(w->decode, buf, sizeof buf, NULL));
    CHECK_STR(buf, w->addr);
    CHECK_OK(kvstage_engine_listen_address(w->prefill, buf, sizeof buf, NULL));
    CHECK_INT(kvstage_op_poll(w->op), w->op_result);
    {
        kvstage_transfer_desc d;
        kvstage_op *op = NULL;
        desc_for(&d, 9998, NOT_OPEN_KEY, 0, 2000);
        CHECK_INT(kvstage_transfer_async(w->session, &d, &op), KVSTAGE_PENDING);
        REQUIRE(op != NULL);
        CHECK(kvstage_op_wait(op, 5000) < 0); /* room 9998 is not open either */
        kvstage_op_free(op);
        CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    }
}

static void test_wrong_kinds(world *w) {
    engine_exports(w, (kvstage_engine *)w->session, "is a kvstage_session, not a kvstage_engine");
    engine_exports(w, (kvstage_engine *)w->op, "is a kvstage_op, not a kvstage_engine");
    session_exports((kvstage_session *)w->decode, "is a kvstage_engine, not a kvstage_session");
    session_exports((kvstage_session *)w->op, "is a kvstage_op, not a kvstage_session");
    op_exports((kvstage_op *)w->prefill, "is a kvstage_engine, not a kvstage_op");
    op_exports((kvstage_op *)w->session, "is a kvstage_session, not a kvstage_op");
    still_live(w);
}

/* --- freed handles --------------------------------------------------------------------------- */

enum { BATCH = 24 };

static void test_freed(world *w) {
    const char *dead = "not a live kvstage handle";
    kvstage_engine *e = NULL;
    kvstage_session *s = NULL;
    kvstage_op *op = NULL, *old[BATCH], *fresh[BATCH];
    kvstage_transfer_desc d;
    int i, j;

    REQUIRE(kvstage_engine_new(NULL, &e) == KVSTAGE_OK);
    kvstage_engine_free(e);
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    CHECK_OK(kvstage_session_connect(w->prefill, w->addr, "handles-freed", 5000, &s));
    REQUIRE(s != NULL);
    desc_for(&d, 9997, NOT_OPEN_KEY, 0, 2000);
    REQUIRE(kvstage_transfer_async(s, &d, &op) == KVSTAGE_PENDING);
    REQUIRE(op != NULL);
    kvstage_session_free(s); /* the running op keeps the session alive */
    CHECK(kvstage_op_wait(op, 5000) < 0);
    kvstage_op_free(op);
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);

    /* Every export; `_free` a second time included (a no-op that says why). */
    engine_exports(w, e, dead);
    session_exports(s, dead);
    op_exports(op, dead);
    /* A freed handle passed as another kind: still "not live". */
    EXPECT_INVALID(kvstage_room_wait((kvstage_engine *)op, 1, 1, 10), "`engine`", dead);
    EXPECT_INVALID(kvstage_op_poll((kvstage_op *)e), "`op`", dead);

    /* Addresses are never handed out again: freed handles stay dead while new ones are made. */
    for (i = 0; i < BATCH; ++i) {
        old[i] = NULL;
        desc_for(&d, 9996, NOT_OPEN_KEY, 0, 2000);
        REQUIRE(kvstage_transfer_async(w->session, &d, &old[i]) == KVSTAGE_PENDING);
    }
    for (i = 0; i < BATCH; ++i) {
        CHECK(kvstage_op_wait(old[i], 5000) < 0);
        kvstage_op_free(old[i]);
    }
    for (i = 0; i < BATCH; ++i) {
        fresh[i] = NULL;
        desc_for(&d, 9996, NOT_OPEN_KEY, 0, 2000);
        REQUIRE(kvstage_transfer_async(w->session, &d, &fresh[i]) == KVSTAGE_PENDING);
        for (j = 0; j < BATCH; ++j) CHECK(fresh[i] != old[j]);
        CHECK(fresh[i] != op);
    }
    for (i = 0; i < BATCH; ++i) EXPECT_INVALID(kvstage_op_poll(old[i]), "`op`", dead);
    for (i = 0; i < BATCH; ++i) {
        CHECK(kvstage_op_wait(fresh[i], 5000) < 0);
        kvstage_op_free(fresh[i]);
    }
    still_live(w);
}

/* --- free during a call ---------------------------------------------------------------------- */

typedef enum { CALL_ROOM_WAIT, CALL_TRANSFER, CALL_OP_WAIT } call_kind;

typedef struct race {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started, done;
    call_kind kind;
    kvstage_engine *engine;
    kvstage_session *session;
    kvstage_op *op;
    uint64_t room, key;
    kvstage_transfer_desc desc;
    int rc, error_code;
    char message[256];
} race;

/* Thread A: the call, then what it returned (read before any other kvstage call). */
static void *race_call(void *arg) {
    race *r = (race *)arg;
    int rc = 0;
    const kvstage_error *e;
    pthread_mutex_lock(&r->mu);
    r->started = 1;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    switch (r->kind) {
    case CALL_ROOM_WAIT: rc = (int)kvstage_room_wait(r->engine, r->room, r->key, 150); break;
    case CALL_TRANSFER: rc = (int)kvstage_transfer(r->session, &r->desc); break;
    case CALL_OP_WAIT: rc = (int)kvstage_op_wait(r->op, KVSTAGE_TIMEOUT_INFINITE); break;
    }
    e = kvstage_error_last();
    pthread_mutex_lock(&r->mu);
    r->rc = rc;
    r->error_code = (int)e->code;
    snprintf(r->message, sizeof r->message, "%s", e->message);
    r->done = 1;
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Starts A, waits until it is about to call, sleeps `delay_ms`, frees the handle (thread B is
 * this one), joins A. Returns 1 when the free happened during A's call: A's call got past the
 * handle check (so it started before the free) and returned after the free returned. */
static int run_race(race *r, unsigned delay_ms) {
    pthread_t a;
    int a_inside_after_free, in_flight;
    r->started = r->done = 0;
    REQUIRE(pthread_create(&a, NULL, race_call, r) == 0);
    pthread_mutex_lock(&r->mu);
    while (!r->started) pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
    if (delay_ms) sleep_ms(delay_ms);
    switch (r->kind) {
    case CALL_ROOM_WAIT: kvstage_engine_free(r->engine); break;
    case CALL_TRANSFER: kvstage_session_free(r->session); break;
    case CALL_OP_WAIT: kvstage_op_free(r->op); break;
    }
    ++g_cases;
    CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
    pthread_mutex_lock(&r->mu);
    a_inside_after_free = !r->done;
    pthread_mutex_unlock(&r->mu);
    REQUIRE(pthread_join(a, NULL) == 0);

    /* A returned cleanly: an error code (nothing ever completes here) with its last error. */
    ++g_cases;
    CHECK(r->rc < 0);
    CHECK_INT(r->error_code, r->rc);
    if (r->rc == KVSTAGE_E_INVALID_ARG) CHECK_CONTAINS(r->message, "not a live kvstage handle");
    /* A free that waited for A's call to end could never count as in flight: every race below
     * requires some rounds that do. */
    in_flight = a_inside_after_free && r->rc != KVSTAGE_E_INVALID_ARG;

    /* Later calls on the freed pointer. */
    switch (r->kind) {
    case CALL_ROOM_WAIT: EXPECT_INVALID(kvstage_room_wait(r->engine, r->room, r->key, 10), "`engine`", "not a live"); break;
    case CALL_TRANSFER: EXPECT_INVALID(kvstage_transfer(r->session, &r->desc), "`session`", "not a live"); break;
    case CALL_OP_WAIT: EXPECT_INVALID(kvstage_op_poll(r->op), "`op`", "not a live"); break;
    }
    return in_flight;
}

/* Delays of thread B, in ms: 0 races with A's handle check, the others land inside A's call. */
static const unsigned DELAYS[] = {0, 1, 5, 20, 40, 2, 10, 30};
#define DELAY(i) DELAYS[(i) % (sizeof DELAYS / sizeof DELAYS[0])]

enum { ENGINE_ROUNDS = 32, SESSION_ROUNDS = 12, OP_ROUNDS = 16, PLUG_ROOM = 500 };

static void test_free_engine_during_room_wait(world *w) {
    race r;
    int i, in_flight = 0;
    memset(&r, 0, sizeof r);
    REQUIRE(pthread_mutex_init(&r.mu, NULL) == 0 && pthread_cond_init(&r.cv, NULL) == 0);
    r.kind = CALL_ROOM_WAIT;
    for (i = 0; i < ENGINE_ROUNDS; ++i) {
        char addr[64];
        kvstage_session *s = NULL;
        uint32_t chunks = 0;
        uint64_t key = 0;
        int rc, hit;
        r.engine = engine_with_pool(&w->dec);
        r.room = 10 + (uint64_t)i;
        REQUIRE(kv_room_open(r.engine, r.room, DST_PAGES, 4, CHUNK_TOKENS, NULL, &chunks, &key) == KVSTAGE_OK);
        r.key = key;
        REQUIRE(kvstage_engine_listen_address(r.engine, addr, sizeof addr, NULL) == KVSTAGE_OK);
        hit = run_race(&r, DELAY(i));
        in_flight += hit;
        /* A held the last reference: the engine stopped when A returned (its port is closed). */
        if (hit && i % 4 == 0) {
            rc = (int)kvstage_session_connect(w->prefill, addr, "handles-gone", 1000, &s);
            ++g_cases;
            CHECK(rc < 0);
            CHECK(s == NULL);
        }
    }
    printf("engine freed during kvstage_room_wait: %d of %d rounds in flight\n", in_flight, ENGINE_ROUNDS);
    CHECK(in_flight >= 1);
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);
}

/* Plugs the decode ring (see the top of the file). */
static void plug_ring(world *w) {
    kvstage_transfer_desc d;
    uint32_t chunks = 0;
    uint64_t key = 0;
    REQUIRE(kv_room_open(w->decode, PLUG_ROOM, DST_PAGES, 4, CHUNK_TOKENS, NULL, &chunks, &key) == KVSTAGE_OK);
    REQUIRE(chunks == 2);
    w->plug_key = key;
    desc_for(&d, PLUG_ROOM, key, 0, 5000);
    CHECK_OK(kvstage_transfer(w->session, &d)); /* writer 0 arrived; writer 1 never will */
    CHECK_INT(live_allocations(w->decode), 1);
}

/* Opens room `room` (one chunk) on the decode side for a chunk that will wait for the plug;
 * returns the opening's key. */
static uint64_t open_blocked_room(world *w, uint64_t room) {
    uint32_t chunks = 0;
    uint64_t key = 0;
    REQUIRE(kv_room_open(w->decode, room, DST_PAGES, 2, CHUNK_TOKENS, NULL, &chunks, &key) == KVSTAGE_OK);
    REQUIRE(chunks == 1);
    return key;
}

static void test_free_session_during_transfer(world *w) {
    race r;
    int i, in_flight = 0;
    memset(&r, 0, sizeof r);
    REQUIRE(pthread_mutex_init(&r.mu, NULL) == 0 && pthread_cond_init(&r.cv, NULL) == 0);
    r.kind = CALL_TRANSFER;
    for (i = 0; i < SESSION_ROUNDS; ++i) {
        char id[32];
        uint64_t room = 600 + (uint64_t)i, key;
        snprintf(id, sizeof id, "handles-race-%d", i);
        key = open_blocked_room(w, room);
        r.session = NULL;
        CHECK_OK(kvstage_session_connect(w->prefill, w->addr, id, 5000, &r.session));
        REQUIRE(r.session != NULL);
        desc_for(&r.desc, room, key, 0, 300);
        in_flight += run_race(&r, DELAY(i + 3));
        CHECK_OK(kvstage_room_release(w->decode, room, key));
    }
    printf("session freed during kvstage_transfer: %d of %d rounds in flight\n", in_flight, SESSION_ROUNDS);
    CHECK(in_flight >= 1);
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);
}

static void test_free_op_during_op_wait(world *w) {
    race r;
    int i, in_flight = 0, blocked = 0;
    memset(&r, 0, sizeof r);
    REQUIRE(pthread_mutex_init(&r.mu, NULL) == 0 && pthread_cond_init(&r.cv, NULL) == 0);
    r.kind = CALL_OP_WAIT;
    for (i = 0; i < OP_ROUNDS; ++i) {
        kvstage_transfer_desc d;
        uint64_t room = 700 + (uint64_t)i;
        uint64_t key = open_blocked_room(w, room);
        desc_for(&d, room, key, 0, 300);
        r.op = NULL;
        REQUIRE(kvstage_transfer_async(w->session, &d, &r.op) == KVSTAGE_PENDING);
        REQUIRE(r.op != NULL);
        blocked += kvstage_op_poll(r.op) == KVSTAGE_PENDING;
        /* A waits without a timeout: when it returns, the operation has ended, so nothing of it
         * outlives the test. Unless the free came first: then it ends by its deadline. */
        in_flight += run_race(&r, DELAY(i + 1));
        CHECK_OK(kvstage_room_release(w->decode, room, key));
    }
    printf("op freed during kvstage_op_wait: %d of %d rounds in flight (%d blocked at start)\n", in_flight,
           OP_ROUNDS, blocked);
    CHECK(in_flight >= 1);
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);
}

/* Every blocked chunk gave its grant back; releasing the plug empties the ring. */
static void unplug_ring(world *w) {
    double until = now_s() + 10;
    while (live_allocations(w->decode) > 1 && now_s() < until) sleep_ms(10);
    CHECK_INT(live_allocations(w->decode), 1);
    CHECK_OK(kvstage_room_release(w->decode, PLUG_ROOM, w->plug_key));
    ++g_cases;
    CHECK_INT(live_allocations(w->decode), 0);
}

int main(void) {
    world w;
    world_init(&w);
    test_wrong_kinds(&w);
    test_freed(&w);
    test_free_engine_during_room_wait(&w);
    plug_ring(&w);
    test_free_session_during_transfer(&w);
    test_free_op_during_op_wait(&w);
    unplug_ring(&w);
    still_live(&w);
    world_free(&w);
    printf("handles: %d cases\n", g_cases);
    CHECK(g_cases >= 150);
    return kv_finish("handles");
}
