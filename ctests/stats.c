/* Metrics from C: after a known sequence (3 synchronous transfers, 1 asynchronous, a fallback and
 * a transfer to a room that is not open (both asynchronous), one to a decode engine that was freed)
 * the engine and session counters are exact and the phase timings positive and ordered, in the
 * stats (each synchronous transfer's own, as the growth of its session's timings_sum), the
 * operation's getter and the completion events. Each decode room reports its chunk and then the
 * whole request (a ROOM completion). An old, smaller struct_size of kvstage_engine_stats gets the
 * old fields and nothing past its size. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "host_pool.h"

enum { LAYERS = 2, HEADS = 2, HEAD_DIM = 8, DTYPE = 2, PAGE = 4, CAPACITY = 8, CHUNK_TOKENS = 16 };
/* One 16-token chunk: tokens × heads × head_dim × dtype × (K, V) × layers. */
enum { CHUNK_BYTES = CHUNK_TOKENS * HEADS * HEAD_DIM * DTYPE * 2 * LAYERS, RING_BYTES = CHUNK_BYTES * 3 / 2 };

static const uint32_t PAGES[8] = {0, 1, 2, 3, 4, 5, 6, 7};

typedef struct seen {
    pthread_mutex_t lock;
    int ops, chunks, rooms, bad;
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
    } else if (c->kind == KVSTAGE_COMPLETION_ROOM) {
        if (c->status != KVSTAGE_OK || c->room_key == 0) s->bad++;
        s->rooms++;
    }
    pthread_mutex_unlock(&s->lock);
}

/* A TCP engine with pool `p` (and a ring of `ring_bytes`, 0: none). */
static kvstage_engine *tcp_engine(const host_pool *p, size_t ring_bytes) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_TCP;
    /* Through a send staging buffer, so that every phase happens (from the pool, the default
     * over TCP, there is no wait for a buffer: alloc_wait_ns is 0). */
    o.send_from_pool = 0;
    return host_pool_engine(&o, p, ring_bytes);
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
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = room;
    d.room_key = room_key;
    d.chunk_index = 0;
    d.src_pages = PAGES;
    d.num_pages = pages;
    d.timeout_ms = 20000;
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

/* The session's timings_sum and timed_transfers now. */
static kvstage_session_stats session_stats(const kvstage_session *s) {
    kvstage_session_stats ss;
    memset(&ss, 0, sizeof ss);
    ss.struct_size = sizeof ss;
    REQUIRE(kvstage_session_stats_get(s, &ss) == KVSTAGE_OK);
    return ss;
}

/* The timings of the one transfer that ended on `s` between two snapshots. */
static kvstage_transfer_timings timings_between(const kvstage_session_stats *before, const kvstage_session_stats *after) {
    kvstage_transfer_timings t;
    const kvstage_transfer_timings *a = &after->timings_sum, *b = &before->timings_sum;
    CHECK_INT(after->timed_transfers - before->timed_transfers, 1);
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    t.queued_ns = a->queued_ns - b->queued_ns;
    t.watermark_wait_ns = a->watermark_wait_ns - b->watermark_wait_ns;
    t.alloc_wait_ns = a->alloc_wait_ns - b->alloc_wait_ns;
    t.gather_ns = a->gather_ns - b->gather_ns;
    t.wire_ns = a->wire_ns - b->wire_ns;
    t.ack_ns = a->ack_ns - b->ack_ns;
    t.total_ns = a->total_ns - b->total_ns;
    return t;
}

/* An asynchronous transfer of `d` to its end: its result and, in `*t`, its timings. */
static int async_timed(kvstage_session *s, const kvstage_transfer_desc *d, kvstage_transfer_timings *t) {
    kvstage_op *op = NULL;
    int rc;
    CHECK_INT(kvstage_transfer_async(s, d, &op), KVSTAGE_PENDING);
    REQUIRE(op != NULL);
    rc = (int)kvstage_op_wait(op, KVSTAGE_TIMEOUT_INFINITE);
    memset(t, 0xA5, sizeof *t);
    t->struct_size = sizeof *t;
    CHECK_OK(kvstage_op_timings_get(op, t));
    kvstage_op_free(op);
    return rc;
}

static void nap(void) {
    struct timespec ten_ms = {0, 10 * 1000 * 1000};
    nanosleep(&ten_ms, NULL);
}

int main(void) {
    host_pool dp, pp, gp;
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
    host_pool_init(&dp, &shape);
    host_pool_init(&gp, &shape);
    host_pool_init(&pp, &shape);
    host_pool_fill(&pp, 3);
    kvstage_engine *decode = tcp_engine(&dp, RING_BYTES), *gone = tcp_engine(&gp, RING_BYTES), *prefill = tcp_engine(&pp, 0);
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
    kvstage_session_stats before = session_stats(session), after;
    CHECK_INT(before.timed_transfers, 0);
    CHECK_INT(before.timings_sum.total_ns, 0);

    /* 1. Three synchronous transfers: each one's timings are what it added to the sums. */
    uint64_t keys[4] = {0, 0, 0, 0}; /* of decode rooms 0..3 */
    for (uint64_t room = 0; room < 3; ++room) {
        REQUIRE(kv_room_open(decode, room, PAGES, 4, CHUNK_TOKENS, NULL, NULL, &keys[room]) == KVSTAGE_OK);
        kvstage_transfer_desc d = desc_for(room, keys[room], 4, 0);
        CHECK_OK(kvstage_transfer(session, &d));
        after = session_stats(session);
        t = timings_between(&before, &after);
        check_full(&t);
        CHECK_INT(t.queued_ns, 0); /* synchronous: never queued */
        before = after;
        CHECK_OK(kvstage_room_wait(decode, room, keys[room], 20000));
    }

    /* 2. One asynchronous transfer: its getter and its completion agree. */
    REQUIRE(kv_room_open(decode, 3, PAGES, 4, CHUNK_TOKENS, NULL, NULL, &keys[3]) == KVSTAGE_OK);
    kvstage_transfer_desc d = desc_for(3, keys[3], 4, 9);
    kvstage_op *op = NULL;
    CHECK_INT(kvstage_transfer_async(session, &d, &op), KVSTAGE_PENDING);
    CHECK_OK(kvstage_op_wait(op, KVSTAGE_TIMEOUT_INFINITE));
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
    CHECK_OK(kvstage_room_wait(decode, 3, keys[3], 20000));
    {
        char doc[8192];
        CHECK_OK(kvstage_room_describe(decode, 3, keys[3], doc, sizeof doc, NULL));
        CHECK(strstr(doc, "\"state\":\"complete\"") != NULL && strstr(doc, "\"phase\":\"done\"") != NULL);
        CHECK_OK(kvstage_engine_describe(decode, doc, sizeof doc, NULL));
        CHECK(strstr(doc, "\"receiver\":") != NULL && strstr(doc, "\"version\":1") != NULL);
    }

    /* 3. A fallback: 8 pages (2 chunks of bytes) exceed the 1.5-chunk ring. Only its total (and
     * its time queued) happened. */
    kvstage_transfer_timings ft;
    d = desc_for(4, NOT_OPEN_KEY, 8, 0);
    CHECK_INT(async_timed(session, &d, &ft), KVSTAGE_FALLBACK);
    CHECK_INT(ft.struct_size, sizeof ft);
    CHECK(ft.total_ns > 0 && ft.total_ns >= ft.queued_ns);
    CHECK_INT(ft.watermark_wait_ns + ft.alloc_wait_ns + ft.gather_ns + ft.wire_ns + ft.ack_ns, 0);

    /* 4. A room that is not open on the receiver: KVSTAGE_E_STALE_ROOM at the allocation. */
    kvstage_transfer_timings st;
    d = desc_for(50, NOT_OPEN_KEY, 4, 0);
    CHECK_INT(async_timed(session, &d, &st), KVSTAGE_E_STALE_ROOM);
    CHECK(st.watermark_wait_ns > 0 && st.total_ns >= st.queued_ns + st.watermark_wait_ns);
    CHECK_INT(st.gather_ns + st.wire_ns, 0);

    /* Bad arguments: no transfer started, nothing is timed or counted (the counters below are
     * exact). A page outside the pool is one too, synchronous or not. */
    before = session_stats(session);
    static const uint32_t OUTSIDE[1] = {CAPACITY};
    d = desc_for(0, keys[0], 1, 0);
    d.src_pages = OUTSIDE;
    CHECK_INT(kvstage_transfer(session, &d), KVSTAGE_E_INVALID_ARG);
    op = NULL;
    CHECK_INT(kvstage_transfer_async(session, &d, &op), KVSTAGE_E_INVALID_ARG);
    CHECK(op == NULL);
    CHECK_INT(kvstage_transfer(session, NULL), KVSTAGE_E_INVALID_ARG);
    after = session_stats(session);
    CHECK_INT(after.timed_transfers, before.timed_transfers);
    CHECK_INT(after.timings_sum.total_ns, before.timings_sum.total_ns);

    /* 5. The peer is gone: its engine was freed. */
    kvstage_engine_free(gone);
    d = desc_for(0, NOT_OPEN_KEY, 4, 0); /* never opened on `gone` */
    CHECK_INT(kvstage_transfer(doomed, &d), KVSTAGE_E_PEER_GONE);
    /* It says it is dead, and why: free it, connect again. */
    CHECK_INT(session_stats(doomed).dead_status, KVSTAGE_E_PEER_GONE);

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
    CHECK_INT(ss.dead_status, 0); /* refusals leave a session usable */
    /* The asynchronous transfers' time queued, and nothing else: the synchronous ones have none. */
    CHECK(ss.timings_sum.gather_ns > 0);
    CHECK_INT(ss.timings_sum.queued_ns, ot.queued_ns + ft.queued_ns + st.queued_ns);
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

    for (int i = 0; i < 500; ++i) { /* chunk and room callbacks run after the room completes */
        pthread_mutex_lock(&ds.lock);
        int n = ds.chunks, r = ds.rooms;
        pthread_mutex_unlock(&ds.lock);
        if (n >= 4 && r >= 4) break;
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
    CHECK_INT(ds.rooms, 4); /* one per request, each complete */
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
    for (uint64_t room = 0; room < 4; ++room) CHECK_OK(kvstage_room_release(decode, room, keys[room]));
    kvstage_session_free(doomed);
    kvstage_session_free(session);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);
    host_pool_free(&dp);
    host_pool_free(&gp);
    host_pool_free(&pp);
    pthread_mutex_destroy(&ps.lock);
    pthread_mutex_destroy(&ds.lock);
    return kv_finish("stats");
}
