/* Metrics from C: after a known sequence (3 synchronous transfers, 1 asynchronous, a fallback, a
 * transfer to a room that is not open, one to a decode engine that was freed) the engine and
 * session counters are exact and the phase timings positive and ordered, in the stats, the
 * operation's getter, this thread's last synchronous transfer and the completion events. An old,
 * smaller struct_size of kvstage_engine_stats gets the old fields and nothing past its size. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "kvstage_check.h"

enum { LAYERS = 2, HEADS = 2, HEAD_DIM = 8, DTYPE = 2, PAGE = 4, CAPACITY = 8, CHUNK_TOKENS = 16 };
/* One 16-token chunk: tokens × heads × head_dim × dtype × (K, V) × layers. */
enum { CHUNK_BYTES = CHUNK_TOKENS * HEADS * HEAD_DIM * DTYPE * 2 * LAYERS, RING_BYTES = CHUNK_BYTES * 3 / 2 };

typedef struct pool {
    uint8_t *memory;
    size_t buffer;
    uint64_t k[LAYERS], v[LAYERS];
    kvstage_kv_layout layout;
} pool;

static void pool_init(pool *p, uint8_t seed) {
    p->buffer = (size_t)CAPACITY * PAGE * HEADS * HEAD_DIM * DTYPE;
    p->memory = (uint8_t *)calloc(2 * LAYERS, p->buffer);
    REQUIRE(p->memory != NULL);
    for (size_t i = 0; seed && i < 2 * LAYERS * p->buffer; ++i) p->memory[i] = (uint8_t)(i * 5 + seed);
    for (int l = 0; l < LAYERS; ++l) {
        p->k[l] = (uint64_t)(uintptr_t)(p->memory + (size_t)(2 * l) * p->buffer);
        p->v[l] = (uint64_t)(uintptr_t)(p->memory + (size_t)(2 * l + 1) * p->buffer);
    }
    REQUIRE(kvstage_kv_layout_init(&p->layout) == KVSTAGE_OK);
    p->layout.model_kind = KVSTAGE_MODEL_MHA;
    p->layout.page_size = PAGE;
    p->layout.local_heads = HEADS;
    p->layout.global_heads = HEADS;
    p->layout.head_dim = HEAD_DIM;
    p->layout.dtype_bytes = DTYPE;
    p->layout.tp_rank = 0;
    p->layout.tp_size = 1;
    p->layout.pp_rank = 0;
    p->layout.pp_size = 1;
    p->layout.num_layers = LAYERS;
    p->layout.k_bases = p->k;
    p->layout.v_bases = p->v;
    p->layout.capacity_pages = CAPACITY;
}

static const uint32_t PAGES[8] = {0, 1, 2, 3, 4, 5, 6, 7};

typedef struct seen {
    pthread_mutex_t lock;
    int ops, chunks, bad;
    kvstage_transfer_timings op_timings; /* of the operation with user_tag 9 */
    uint64_t scatter_ns[8];
} seen;

static void on_completion(void *user_data, const kvstage_completion *c) {
    seen *s = (seen *)user_data;
    pthread_mutex_lock(&s->lock);
    if (c->struct_size != sizeof *c) s->bad++;
    if (c->kind == KVSTAGE_COMPLETION_OP) {
        if (c->tag == 9) s->op_timings = c->timings;
        s->ops++;
    } else if (c->kind == KVSTAGE_COMPLETION_CHUNK && c->status == KVSTAGE_OK) {
        if (s->chunks < 8) s->scatter_ns[s->chunks] = c->scatter_ns;
        s->chunks++;
    }
    pthread_mutex_unlock(&s->lock);
}

static kvstage_engine *tcp_engine(void) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_TCP;
    /* Through a send staging buffer, so that every phase happens (from the pool, the default
     * over TCP, there is no wait for a buffer: alloc_wait_ns is 0). */
    o.send_from_pool = 0;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_new(&o, &e) == KVSTAGE_OK);
    return e;
}

static kvstage_session *connect_to(kvstage_engine *prefill, kvstage_engine *decode, const char *id) {
    char addr[64] = {0};
    REQUIRE(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL) == KVSTAGE_OK);
    kvstage_session *s = NULL;
    REQUIRE(kvstage_session_connect(prefill, addr, id, 0, &s) == KVSTAGE_OK);
    return s;
}

/* The key transfers name for rooms the decode side never opened (any nonzero value). */
static const uint64_t NOT_OPEN_KEY = 1;

static kvstage_transfer_desc desc_for(uint64_t room, uint64_t room_key, size_t pages, uint64_t tag) {
    kvstage_transfer_desc d;
    REQUIRE(kvstage_transfer_desc_init(&d) == KVSTAGE_OK);
    d.room = room;
    d.room_key = room_key;
    d.chunk_index = 0;
    d.src_pages = PAGES;
    d.num_pages = pages;
    d.deadline_ms = 20000;
    d.user_tag = tag;
    return d;
}

/* Each phase of a transfer that was acknowledged happened; the total spans them. */
static void check_full(const kvstage_transfer_timings *t) {
    CHECK_INT(t->struct_size, sizeof *t);
    CHECK(t->watermark_wait_ns > 0);
    CHECK(t->alloc_wait_ns > 0);
    CHECK(t->gather_ns > 0);
    CHECK(t->wire_ns > 0);
    CHECK(t->ack_ns > 0);
    CHECK(t->total_ns >= t->queued_ns + t->watermark_wait_ns + t->alloc_wait_ns + t->gather_ns + t->wire_ns + t->ack_ns);
}

static void nap(void) {
    struct timespec ten_ms = {0, 10 * 1000 * 1000};
    nanosleep(&ten_ms, NULL);
}

int main(void) {
    pool dp, pp, gp;
    pool_init(&dp, 0);
    pool_init(&gp, 0);
    pool_init(&pp, 3);
    kvstage_engine *decode = tcp_engine(), *gone = tcp_engine(), *prefill = tcp_engine();
    REQUIRE(kvstage_engine_register_pool(decode, &dp.layout) == KVSTAGE_OK);
    REQUIRE(kvstage_engine_register_staging(decode, NULL, RING_BYTES) == KVSTAGE_OK);
    REQUIRE(kvstage_engine_register_pool(gone, &gp.layout) == KVSTAGE_OK);
    REQUIRE(kvstage_engine_register_staging(gone, NULL, RING_BYTES) == KVSTAGE_OK);
    REQUIRE(kvstage_engine_register_pool(prefill, &pp.layout) == KVSTAGE_OK);
    kvstage_session *session = connect_to(prefill, decode, "stats");
    kvstage_session *doomed = connect_to(prefill, gone, "doomed");

    seen ps, ds;
    memset(&ps, 0, sizeof ps);
    memset(&ds, 0, sizeof ds);
    pthread_mutex_init(&ps.lock, NULL);
    pthread_mutex_init(&ds.lock, NULL);
    CHECK_OK(kvstage_engine_set_completion_callback(prefill, on_completion, &ps));
    CHECK_OK(kvstage_engine_set_completion_callback(decode, on_completion, &ds));

    kvstage_transfer_timings t;
    memset(&t, 0xA5, sizeof t);
    t.struct_size = sizeof t;
    CHECK_OK(kvstage_transfer_timings_last(&t));
    CHECK_INT(t.total_ns, 0); /* no synchronous transfer on this thread yet */
    CHECK_INT(kvstage_transfer_timings_last(NULL), KVSTAGE_E_INVALID_ARG);

    /* 1. Three synchronous transfers. */
    uint64_t keys[4] = {0, 0, 0, 0}; /* of decode rooms 0..3 */
    for (uint64_t room = 0; room < 3; ++room) {
        REQUIRE(kvstage_room_open(decode, room, PAGES, 4, CHUNK_TOKENS, NULL, &keys[room]) == KVSTAGE_OK);
        kvstage_transfer_desc d = desc_for(room, keys[room], 4, 0);
        CHECK_OK(kvstage_transfer(session, &d));
        t.struct_size = sizeof t;
        CHECK_OK(kvstage_transfer_timings_last(&t));
        check_full(&t);
        CHECK_INT(t.queued_ns, 0);
        CHECK_OK(kvstage_room_wait(decode, room, 20000));
    }

    /* 2. One asynchronous transfer: its getter and its completion agree. */
    REQUIRE(kvstage_room_open(decode, 3, PAGES, 4, CHUNK_TOKENS, NULL, &keys[3]) == KVSTAGE_OK);
    kvstage_transfer_desc d = desc_for(3, keys[3], 4, 9);
    kvstage_op *op = NULL;
    CHECK_INT(kvstage_transfer_async(session, &d, &op), KVSTAGE_PENDING);
    CHECK_OK(kvstage_op_wait(op, KVSTAGE_DEADLINE_INFINITE));
    kvstage_transfer_timings ot;
    ot.struct_size = sizeof ot;
    CHECK_OK(kvstage_op_timings_get(op, &ot));
    check_full(&ot);
    CHECK(ot.queued_ns > 0);
    CHECK_INT(kvstage_op_timings_get(op, NULL), KVSTAGE_E_INVALID_ARG);
    CHECK_INT(kvstage_op_timings_get(NULL, &ot), KVSTAGE_E_INVALID_ARG);
    for (int i = 0; i < 500; ++i) { /* the callback runs just after the waiters wake */
        pthread_mutex_lock(&ps.lock);
        int n = ps.ops;
        pthread_mutex_unlock(&ps.lock);
        if (n >= 1) break;
        nap();
    }
    pthread_mutex_lock(&ps.lock);
    CHECK_INT(ps.ops, 1);
    CHECK_INT(ps.bad, 0);
    CHECK(memcmp(&ps.op_timings, &ot, sizeof ot) == 0);
    pthread_mutex_unlock(&ps.lock);
    {
        /* Where it is, as JSON: a size query, then the document (done, its room and session). */
        size_t needed = 0;
        char doc[4096];
        CHECK_OK(kvstage_op_describe(op, NULL, 0, &needed));
        CHECK(needed > 1 && needed <= sizeof doc);
        CHECK_OK(kvstage_op_describe(op, doc, sizeof doc, &needed));
        CHECK(strstr(doc, "\"phase\":\"done\"") != NULL && strstr(doc, "\"room\":3") != NULL);
        CHECK(strstr(doc, "\"status\":\"KVSTAGE_OK\"") != NULL);
    }
    kvstage_op_free(op);
    CHECK_OK(kvstage_room_wait(decode, 3, 20000));
    {
        char doc[8192];
        CHECK_OK(kvstage_room_describe(decode, 3, doc, sizeof doc, NULL));
        CHECK(strstr(doc, "\"state\":\"complete\"") != NULL && strstr(doc, "\"phase\":\"done\"") != NULL);
        CHECK_OK(kvstage_engine_describe(decode, doc, sizeof doc, NULL));
        CHECK(strstr(doc, "\"receiver\":") != NULL && strstr(doc, "\"version\":1") != NULL);
    }

    /* 3. A fallback: 8 pages (2 chunks of bytes) exceed the 1.5-chunk ring. */
    d = desc_for(4, NOT_OPEN_KEY, 8, 0);
    CHECK_INT(kvstage_transfer(session, &d), KVSTAGE_FALLBACK);
    t.struct_size = sizeof t;
    CHECK_OK(kvstage_transfer_timings_last(&t));
    CHECK(t.total_ns > 0);
    CHECK_INT(t.watermark_wait_ns + t.alloc_wait_ns + t.gather_ns + t.wire_ns + t.ack_ns, 0);

    /* 4. A room that is not open on the receiver: KVSTAGE_E_STALE_ROOM at the allocation. */
    d = desc_for(50, NOT_OPEN_KEY, 4, 0);
    CHECK_INT(kvstage_transfer(session, &d), KVSTAGE_E_STALE_ROOM);
    CHECK_OK(kvstage_transfer_timings_last(&t));
    CHECK(t.watermark_wait_ns > 0 && t.total_ns >= t.watermark_wait_ns);
    CHECK_INT(t.gather_ns + t.wire_ns, 0);

    /* Bad arguments: no transfer started, the last timings are zeros, nothing is counted (the
     * counters below are exact). A page outside the pool is one too, synchronous or not. */
    static const uint32_t OUTSIDE[1] = {CAPACITY};
    d = desc_for(0, keys[0], 1, 0);
    d.src_pages = OUTSIDE;
    CHECK_INT(kvstage_transfer(session, &d), KVSTAGE_E_INVALID_ARG);
    t.struct_size = sizeof t;
    CHECK_OK(kvstage_transfer_timings_last(&t));
    CHECK_INT(t.total_ns + t.watermark_wait_ns, 0);
    op = NULL;
    CHECK_INT(kvstage_transfer_async(session, &d, &op), KVSTAGE_E_INVALID_ARG);
    CHECK(op == NULL);
    CHECK_INT(kvstage_transfer(session, NULL), KVSTAGE_E_INVALID_ARG);
    CHECK_OK(kvstage_transfer_timings_last(&t));
    CHECK_INT(t.total_ns, 0);

    /* 5. The peer is gone: its engine was freed. */
    kvstage_engine_free(gone);
    d = desc_for(0, NOT_OPEN_KEY, 4, 0); /* never opened on `gone` */
    CHECK_INT(kvstage_transfer(doomed, &d), KVSTAGE_E_PEER_GONE);

    /* Session counters. */
    kvstage_session_stats ss;
    memset(&ss, 0, sizeof ss);
    ss.struct_size = sizeof ss;
    CHECK_OK(kvstage_session_stats_get(session, &ss));
    CHECK_INT(ss.struct_size, sizeof ss);
    CHECK_INT(ss.transport, KVSTAGE_TRANSPORT_TCP);
    CHECK_INT(ss.downgraded, 0);
    CHECK_INT(ss.bytes_sent, 4 * CHUNK_BYTES);
    CHECK_INT(ss.chunks_sent, 4);
    CHECK_INT(ss.transfers_ok, 4);
    CHECK_INT(ss.transfers_fallback, 1);
    CHECK_INT(ss.transfers_failed, 1);
    CHECK_INT(ss.transfers_canceled, 1);
    CHECK_INT(ss.transfers_timeout + ss.transfers_peer_gone + ss.transfers_failed_other, 0);
    CHECK_INT(ss.transfers_in_flight, 0);
    CHECK_INT(ss.timed_transfers, 6); /* the bad argument never started */
    CHECK(ss.timings_sum.gather_ns > 0 && ss.timings_sum.queued_ns == ot.queued_ns);
    CHECK_INT(kvstage_session_stats_get(NULL, &ss), KVSTAGE_E_INVALID_ARG);
    CHECK_INT(kvstage_session_stats_get(session, NULL), KVSTAGE_E_INVALID_ARG);
    /* An older, smaller session stats: filled up to its size, nothing written past it. The
     * buffer is aligned as the struct would be (a union: portable to C11 and C++). */
    union {
        unsigned char bytes[sizeof(kvstage_session_stats) + 32];
        uint64_t align_u64;
        size_t align_size;
    } sbuf;
    size_t s_old = offsetof(kvstage_session_stats, timings_sum);
    memset(sbuf.bytes, 0xA5, sizeof sbuf.bytes);
    memcpy(sbuf.bytes, &s_old, sizeof s_old);
    CHECK_OK(kvstage_session_stats_get(session, (kvstage_session_stats *)(void *)sbuf.bytes));
    for (size_t i = s_old; i < sizeof sbuf.bytes; ++i) CHECK(sbuf.bytes[i] == 0xA5);
    kvstage_session_stats small;
    memcpy(&small, sbuf.bytes, s_old);
    CHECK_INT(small.transfers_ok, 4);
    memset(&ss, 0, sizeof ss);
    ss.struct_size = sizeof ss;
    CHECK_OK(kvstage_session_stats_get(doomed, &ss));
    CHECK_INT(ss.transfers_peer_gone, 1);
    CHECK_INT(ss.transfers_failed, 1);
    CHECK_INT(ss.bytes_sent, 0);

    /* Engine counters: prefill (senders) and decode (receiver). */
    kvstage_engine_stats es;
    memset(&es, 0, sizeof es);
    es.struct_size = sizeof es;
    CHECK_OK(kvstage_engine_stats_get(prefill, &es));
    CHECK_INT(es.bytes_sent, 4 * CHUNK_BYTES);
    CHECK_INT(es.chunks_sent, 4);
    CHECK_INT(es.transfers_ok, 4);
    CHECK_INT(es.transfers_fallback, 1);
    CHECK_INT(es.transfers_failed, 2);
    CHECK_INT(es.transfers_canceled, 1);
    CHECK_INT(es.transfers_peer_gone, 1);
    CHECK_INT(es.transfers_timeout + es.transfers_failed_other, 0);
    CHECK_INT(es.transfers_in_flight, 0);
    CHECK_INT(es.timed_transfers, 7);
    CHECK_INT(es.timings_sum.struct_size, sizeof es.timings_sum);
    CHECK(es.timings_sum.total_ns >= es.timings_sum.wire_ns + es.timings_sum.ack_ns + es.timings_sum.gather_ns);
    CHECK_INT(es.bytes_received + es.chunks_received + es.ring_high_water_bytes, 0);

    for (int i = 0; i < 500; ++i) { /* chunk callbacks run after the room completes */
        pthread_mutex_lock(&ds.lock);
        int n = ds.chunks;
        pthread_mutex_unlock(&ds.lock);
        if (n >= 4) break;
        nap();
    }
    memset(&es, 0, sizeof es);
    es.struct_size = sizeof es;
    CHECK_OK(kvstage_engine_stats_get(decode, &es));
    CHECK_INT(es.bytes_received, 4 * CHUNK_BYTES);
    CHECK_INT(es.chunks_received, 4);
    CHECK_INT(es.scatter_count, 4);
    CHECK(es.scatter_ns_max > 0 && es.scatter_ns_sum >= es.scatter_ns_max);
    CHECK(es.ring_high_water_bytes >= CHUNK_BYTES && es.ring_high_water_bytes <= RING_BYTES);
    CHECK_INT(es.ring_used_bytes, 0);
    CHECK_INT(es.ring_capacity, RING_BYTES);
    CHECK_INT(es.bytes_sent + es.transfers_ok + es.timed_transfers, 0);
    pthread_mutex_lock(&ds.lock);
    CHECK_INT(ds.chunks, 4);
    CHECK_INT(ds.bad, 0);
    uint64_t sum = 0;
    for (int i = 0; i < 4; ++i) {
        CHECK(ds.scatter_ns[i] > 0);
        sum += ds.scatter_ns[i];
    }
    CHECK_INT(sum, es.scatter_ns_sum);
    pthread_mutex_unlock(&ds.lock);

    /* Versioning: a caller built before the metrics passes the old size; it gets the old fields
     * and not one byte past its struct. */
    size_t old = offsetof(kvstage_engine_stats, bytes_sent);
    union {
        unsigned char bytes[sizeof(kvstage_engine_stats) + 64];
        uint64_t align_u64;
        size_t align_size;
    } buf;
    memset(buf.bytes, 0xA5, sizeof buf.bytes);
    memcpy(buf.bytes, &old, sizeof old);
    CHECK_OK(kvstage_engine_stats_get(decode, (kvstage_engine_stats *)(void *)buf.bytes));
    size_t written = 0;
    memcpy(&written, buf.bytes, sizeof written);
    CHECK_INT(written, old);
    for (size_t i = old; i < sizeof buf.bytes; ++i) CHECK(buf.bytes[i] == 0xA5);
    kvstage_engine_stats v1;
    memset(&v1, 0, sizeof v1);
    memcpy(&v1, buf.bytes, old);
    CHECK_INT(v1.ring_capacity, RING_BYTES);
    CHECK_INT(v1.ring_live_allocations, 0);
    CHECK_INT(v1.thread_panics, 0);
    CHECK_INT(v1.connections, 1);

    CHECK_OK(kvstage_engine_set_completion_callback(prefill, NULL, NULL));
    CHECK_OK(kvstage_engine_set_completion_callback(decode, NULL, NULL));
    for (uint64_t room = 0; room < 4; ++room) CHECK_OK(kvstage_room_release(decode, room));
    kvstage_session_free(doomed);
    kvstage_session_free(session);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);
    free(dp.memory);
    free(gp.memory);
    free(pp.memory);
    pthread_mutex_destroy(&ps.lock);
    pthread_mutex_destroy(&ds.lock);
    return kv_finish("stats");
}
