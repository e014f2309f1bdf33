/* Completions in a C event loop: the engine's descriptor with poll(), the callback with each
 * operation's user_tag, and chunk events polled by room. Two engines in this process on
 * 127.0.0.1; the decode bytes are compared with the prefill pool. Each room reports its chunk
 * and then the whole request (a ROOM event and completion, after its last chunk's). Also: a room's
 * chunk grid as the prefill side learns it (kvstage_session_room_grid_get), and a layer-wise
 * transfer whose layers are marked ready out of order (kvstage_transfer_layerwise_async,
 * kvstage_op_layers_ready). */
#define _POSIX_C_SOURCE 200809L

#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "host_pool.h"

enum { LAYERS = 2, HEADS = 2, HEAD_DIM = 8, DTYPE = 2, PAGE = 4, CAPACITY = 8, CHUNK_TOKENS = 16, OPS = 24 };

static const uint32_t PAGES[4] = {0, 1, 2, 3}; /* one chunk of 16 tokens */

typedef struct seen {
    pthread_mutex_t lock;
    uint64_t tags;        /* bit i: the operation with user_tag i */
    uint64_t chunk_rooms; /* bit r: room r's chunk completion came */
    int ops, chunks, rooms, bad;
} seen;

static void on_completion(void *user_data, const kvstage_completion *c) {
    seen *s = (seen *)user_data;
    char want[32];
    pthread_mutex_lock(&s->lock);
    if (c->struct_size != sizeof *c) s->bad++;
    if (c->kind == KVSTAGE_COMPLETION_OP) {
        snprintf(want, sizeof want, "req-%llu", (unsigned long long)c->tag);
        if (strcmp(c->trace_id, want) != 0) s->bad++; /* the request's trace id comes back */
        if (c->status != KVSTAGE_OK || c->tag >= OPS) s->bad++;
        else s->tags |= (uint64_t)1 << c->tag;
        s->ops++;
    } else if (c->kind == KVSTAGE_COMPLETION_CHUNK) {
        if (c->status != KVSTAGE_OK || c->chunk_index != 0 || c->room_key == 0 || c->room >= 64) s->bad++;
        else s->chunk_rooms |= (uint64_t)1 << c->room;
        s->chunks++;
    } else if (c->kind == KVSTAGE_COMPLETION_ROOM) {
        /* The whole request, once its one chunk landed: after that chunk's completion. */
        if (c->status != KVSTAGE_OK || c->room_key == 0 || c->room >= 64 || !((s->chunk_rooms >> c->room) & 1)) s->bad++;
        snprintf(want, sizeof want, "req-%llu", (unsigned long long)c->room);
        if (c->room < OPS && strcmp(c->trace_id, want) != 0) s->bad++; /* the writer's trace id */
        s->rooms++;
    } else {
        s->bad++;
    }
    pthread_mutex_unlock(&s->lock);
}

int main(void) {
    host_pool dp, pp;
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
    host_pool_init(&dp, &shape);
    host_pool_init(&pp, &shape);
    host_pool_fill(&pp, 3);
    kvstage_engine *decode = host_pool_engine(NULL, &dp, 1 << 20);
    kvstage_engine *prefill = host_pool_engine(NULL, &pp, 0);
    /* Each opening's key, as the decode side's bootstrap would hand it to the prefill side. */
    uint64_t keys[OPS + 2];
    for (uint64_t room = 0; room < OPS; ++room) {
        keys[room] = 0;
        REQUIRE(kv_room_open(decode, room, PAGES, 4, CHUNK_TOKENS, NULL, NULL, &keys[room]) == KVSTAGE_OK);
        REQUIRE(keys[room] != 0);
    }
    char addr[64] = {0};
    REQUIRE(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL) == KVSTAGE_OK);
    kvstage_session *session = NULL;
    REQUIRE(kvstage_session_connect(prefill, addr, "completion", 0, &session) == KVSTAGE_OK);

    {
        /* The prefill side learns the decode side's chunk grid of a room. */
        kvstage_room_grid grid;
        memset(&grid, 0, sizeof grid);
        grid.struct_size = sizeof grid;
        CHECK_OK(kvstage_session_room_grid_get(session, 0, keys[0], 5000, &grid));
        CHECK_INT(grid.struct_size, sizeof grid);
        CHECK(grid.key == keys[0]);
        CHECK_INT(grid.chunk_tokens, CHUNK_TOKENS);
        CHECK_INT(grid.num_chunks, 1);
        CHECK_INT(grid.num_pages, 4);
        CHECK_INT(grid.page_size, PAGE);
        CHECK_INT(grid.prefix_tokens, 0);
        CHECK_INT(kvstage_session_room_grid_get(session, 999, keys[0], 5000, &grid), KVSTAGE_E_STALE_ROOM); /* not open */
        CHECK_CONTAINS(kvstage_error_last()->message, "room 999: the room key names no open opening");
        CHECK_INT(kvstage_session_room_grid_get(session, 0, keys[0], 5000, NULL), KVSTAGE_E_INVALID_ARG);
        /* An open room named with a key that is not its opening's: stale, and `out` untouched. */
        uint64_t wrong_key = keys[0] + 1;
        if (wrong_key == 0) wrong_key = 1;
        memset(&grid, 0, sizeof grid);
        grid.struct_size = sizeof grid;
        CHECK_INT(kvstage_session_room_grid_get(session, 0, wrong_key, 5000, &grid), KVSTAGE_E_STALE_ROOM);
        CHECK_INT(kvstage_error_last()->code, KVSTAGE_E_STALE_ROOM);
        CHECK_INT(grid.num_chunks, 0);
        CHECK_INT(grid.num_pages, 0);
        /* The right key still works after that. */
        CHECK_OK(kvstage_session_room_grid_get(session, 0, keys[0], 5000, &grid));
        CHECK_INT(grid.num_chunks, 1);
    }

    seen prefill_seen, decode_seen;
    memset(&prefill_seen, 0, sizeof prefill_seen);
    memset(&decode_seen, 0, sizeof decode_seen);
    pthread_mutex_init(&prefill_seen.lock, NULL);
    pthread_mutex_init(&decode_seen.lock, NULL);
    CHECK_OK(kvstage_engine_set_completion_callback(prefill, on_completion, &prefill_seen));
    CHECK_OK(kvstage_engine_set_completion_callback(decode, on_completion, &decode_seen));
    CHECK_INT(kvstage_engine_set_completion_callback(NULL, on_completion, NULL), KVSTAGE_E_INVALID_ARG);

    int fd = -1;
    CHECK_OK(kvstage_engine_completion_fd(prefill, &fd));
    CHECK(fd >= 0);
    CHECK_INT(kvstage_engine_completion_fd(prefill, NULL), KVSTAGE_E_INVALID_ARG);
    struct pollfd pfd = {fd, POLLIN, 0};
    CHECK_INT(poll(&pfd, 1, 0), 0); /* nothing finished yet */

    kvstage_op *ops[OPS];
    for (uint64_t i = 0; i < OPS; ++i) {
        kvstage_transfer_desc d;
        REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
        d.room = i;
        d.chunk_index = 0;
        d.src_pages = PAGES;
        d.num_pages = 4;
        d.timeout_ms = 20000;
        d.user_tag = i;
        d.room_key = keys[i];
        char trace[32];
        snprintf(trace, sizeof trace, "req-%llu", (unsigned long long)i);
        d.trace_id = trace; /* copied by the call */
        ops[i] = NULL;
        CHECK_INT(kvstage_transfer_async(session, &d, &ops[i]), KVSTAGE_PENDING);
    }
    /* The event loop: sleep in poll() until the descriptor says something finished, drain it,
     * then look at the operations. An operation's end is counted on the descriptor when its result
     * becomes visible, after its callback ran: once every signal came, every callback ran too.
     * Bounded: 200 wake-ups of at most 5 s. */
    int finished = 0;
    uint64_t signalled = 0;
    for (int round = 0; round < 200 && (finished < OPS || signalled < OPS); ++round) {
        pfd.revents = 0;
        if (poll(&pfd, 1, 5000) != 1) break;
        uint64_t n = 0;
        CHECK_OK(kvstage_engine_completions_drain(prefill, &n));
        signalled += n;
        finished = 0;
        for (int i = 0; i < OPS; ++i) finished += kvstage_op_poll(ops[i]) != KVSTAGE_PENDING;
    }
    CHECK_INT(finished, OPS);
    CHECK_INT(signalled, OPS);
    for (int i = 0; i < OPS; ++i) {
        CHECK_INT(kvstage_op_poll(ops[i]), KVSTAGE_OK);
        kvstage_op_free(ops[i]);
    }
    pthread_mutex_lock(&prefill_seen.lock);
    CHECK_INT(prefill_seen.ops, OPS);
    CHECK(prefill_seen.tags == (((uint64_t)1 << OPS) - 1));
    CHECK_INT(prefill_seen.bad, 0);
    pthread_mutex_unlock(&prefill_seen.lock);

    /* Decode side: every room completes; its events are polled room by room: the chunk's, then
     * the room's (the whole request). */
    for (uint64_t room = 0; room < OPS; ++room) CHECK_OK(kvstage_room_wait(decode, room, keys[room], 20000));
    kvstage_room_event ev[4];
    memset(ev, 0, sizeof ev);
    ev[0].struct_size = sizeof ev[0];
    size_t count = 0;
    CHECK_OK(kvstage_room_poll_events(decode, 5, keys[5], ev, 4, &count));
    CHECK_INT(count, 2);
    CHECK_INT(ev[0].kind, KVSTAGE_ROOM_EVENT_CHUNK);
    CHECK_INT(ev[0].room, 5);
    CHECK(ev[0].room_key == keys[5]);
    CHECK_INT(ev[0].chunk_index, 0);
    CHECK_INT(ev[0].status, KVSTAGE_OK);
    CHECK(strcmp(ev[0].trace_id, "req-5") == 0); /* the decode room took the writer's id */
    CHECK_INT(ev[1].kind, KVSTAGE_ROOM_EVENT_ROOM);
    CHECK_INT(ev[1].room, 5);
    CHECK(ev[1].room_key == keys[5]);
    CHECK_INT(ev[1].status, KVSTAGE_OK);
    CHECK(strcmp(ev[1].trace_id, "req-5") == 0);
    CHECK_INT(kvstage_room_poll_events(decode, 5, keys[5], NULL, 4, &count), KVSTAGE_E_INVALID_ARG);
    CHECK_OK(kvstage_room_poll_events(decode, 5, keys[5], ev, 4, &count));
    CHECK_INT(count, 0);
    /* The other rooms' events, from the engine: for each, its chunk's then its room's. */
    size_t rest = 0;
    kvstage_room_event all[2 * OPS];
    memset(all, 0, sizeof all);
    all[0].struct_size = sizeof all[0];
    CHECK_OK(kvstage_engine_poll_events(decode, all, 2 * OPS, &rest));
    CHECK_INT(rest, 2 * (OPS - 1));
    {
        uint64_t chunk_seen = 0, room_seen = 0;
        int out_of_order = 0;
        for (size_t i = 0; i < rest && i < 2 * OPS; ++i) {
            const kvstage_room_event *e = &all[i];
            CHECK(e->room < OPS && e->room != 5);
            CHECK_INT(e->status, KVSTAGE_OK);
            if (e->room >= OPS) continue;
            CHECK(e->room_key == keys[e->room]);
            if (e->kind == KVSTAGE_ROOM_EVENT_CHUNK) {
                CHECK(!((chunk_seen >> e->room) & 1));
                chunk_seen |= (uint64_t)1 << e->room;
            } else if (e->kind == KVSTAGE_ROOM_EVENT_ROOM) {
                CHECK(!((room_seen >> e->room) & 1));
                out_of_order += !((chunk_seen >> e->room) & 1);
                room_seen |= (uint64_t)1 << e->room;
            } else {
                CHECK_INT(e->kind, KVSTAGE_ROOM_EVENT_CHUNK);
            }
        }
        const uint64_t others = (((uint64_t)1 << OPS) - 1) & ~((uint64_t)1 << 5);
        CHECK(chunk_seen == others); /* one chunk event per room */
        CHECK(room_seen == others);  /* and one room event */
        CHECK_INT(out_of_order, 0);  /* each after its chunk's */
    }
    /* A room completes before its events' callbacks have run (they run after the state lock is
     * released): wait for the callbacks, bounded. */
    for (int i = 0; i < 500; ++i) {
        pthread_mutex_lock(&decode_seen.lock);
        int n = decode_seen.chunks, r = decode_seen.rooms;
        pthread_mutex_unlock(&decode_seen.lock);
        if (n >= OPS && r >= OPS) break;
        struct timespec ten_ms = {0, 10 * 1000 * 1000};
        nanosleep(&ten_ms, NULL);
    }
    pthread_mutex_lock(&decode_seen.lock);
    CHECK_INT(decode_seen.chunks, OPS);
    CHECK_INT(decode_seen.rooms, OPS);
    CHECK(decode_seen.chunk_rooms == (((uint64_t)1 << OPS) - 1));
    CHECK_INT(decode_seen.ops, 0);
    CHECK_INT(decode_seen.bad, 0);
    pthread_mutex_unlock(&decode_seen.lock);
    pthread_mutex_lock(&prefill_seen.lock);
    CHECK_INT(prefill_seen.chunks + prefill_seen.rooms, 0); /* the sender's engine has no rooms */
    pthread_mutex_unlock(&prefill_seen.lock);
    /* The bytes: the decode pool now holds the prefill pool's pages 0..3 (same layout). */
    size_t page_bytes = (size_t)PAGE * HEADS * HEAD_DIM * DTYPE;
    for (int b = 0; b < 2 * LAYERS; ++b)
        CHECK(memcmp(dp.memory + (size_t)b * dp.buffer, pp.memory + (size_t)b * pp.buffer, 4 * page_bytes) == 0);

    CHECK_OK(kvstage_engine_set_completion_callback(prefill, NULL, NULL));

    {
        /* Layer-wise: the transfer starts before its layers are ready; layer 1 then layer 0 are
         * marked; the decode pool (cleared first) then holds the prefill pool's bytes again. */
        host_pool_fill(&dp, 0);
        const uint64_t room = OPS;
        REQUIRE(kv_room_open(decode, room, PAGES, 4, CHUNK_TOKENS, NULL, NULL, &keys[room]) == KVSTAGE_OK);
        kvstage_transfer_desc d;
        REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
        d.room = room;
        d.room_key = keys[room];
        d.src_pages = PAGES;
        d.num_pages = 4;
        d.timeout_ms = 20000;
        kvstage_op *op = NULL;
        d.cuda_event = (void *)0x1; /* refused before anything touches it: batches carry their own */
        CHECK_ERR(kvstage_transfer_layerwise_async(session, &d, &op), KVSTAGE_E_INVALID_ARG, "desc->cuda_event");
        CHECK(op == NULL);
        d.cuda_event = NULL;
        CHECK_INT(kvstage_transfer_layerwise_async(session, &d, &op), KVSTAGE_PENDING);
        REQUIRE(op != NULL);
        CHECK_ERR(kvstage_op_layers_ready(op, LAYERS, 1, NULL, NULL), KVSTAGE_E_INVALID_ARG, "is not a layer of this pool");
        CHECK_INT(kvstage_op_layers_ready(op, 0, 0, NULL, NULL), KVSTAGE_E_INVALID_ARG);
        CHECK_OK(kvstage_op_layers_ready(op, 1, 1, NULL, NULL));
        CHECK_ERR(kvstage_op_layers_ready(op, 0, 2, NULL, NULL), KVSTAGE_E_INVALID_ARG, "layer 1 was already marked ready");
        CHECK_INT(kvstage_op_poll(op), KVSTAGE_PENDING); /* layer 0 is still missing */
        CHECK_OK(kvstage_op_layers_ready(op, 0, 1, NULL, NULL));
        CHECK_OK(kvstage_op_wait(op, 20000));
        CHECK_OK(kvstage_room_wait(decode, room, keys[room], 20000));
        for (int b = 0; b < 2 * LAYERS; ++b)
            CHECK(memcmp(dp.memory + (size_t)b * dp.buffer, pp.memory + (size_t)b * pp.buffer, 4 * page_bytes) == 0);
        CHECK_OK(kvstage_room_release(decode, room, keys[room]));
        kvstage_op_free(op);

        /* Only a layer-wise operation takes marks. */
        REQUIRE(kv_room_open(decode, room + 1, PAGES, 4, CHUNK_TOKENS, NULL, NULL, &keys[room + 1]) == KVSTAGE_OK);
        d.room = room + 1;
        d.room_key = keys[room + 1];
        CHECK_INT(kvstage_transfer_async(session, &d, &op), KVSTAGE_PENDING);
        CHECK_ERR(kvstage_op_layers_ready(op, 0, 1, NULL, NULL), KVSTAGE_E_INVALID_ARG, "is not a layer-wise transfer");
        CHECK_OK(kvstage_op_wait(op, 20000));
        CHECK_OK(kvstage_room_release(decode, room + 1, keys[room + 1]));
        kvstage_op_free(op);
        CHECK_INT(kvstage_op_layers_ready(NULL, 0, 1, NULL, NULL), KVSTAGE_E_INVALID_ARG);
    }

    for (uint64_t room = 0; room < OPS; ++room) CHECK_OK(kvstage_room_release(decode, room, keys[room]));
    kvstage_session_free(session);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);
    host_pool_free(&dp);
    host_pool_free(&pp);
    return kv_finish("completion");
}
