/* Failure paths of the staged transfer between two real processes on 127.0.0.1: connection
 * refused, geometry mismatch with a field-by-field diff, fallback when the ring is too small,
 * deadline expiry, cancel, and a peer killed mid-chunk on either side (the survivor reports
 * PEER_GONE within a second and the ring returns to empty).
 *
 * KVSTAGE_TEST_TRANSPORT=rdma (or tcp, or shm) forces every engine's transport (default: auto) and
 * checks that each session really uses it, so a run on real verbs (ctest rdma_vm) or on the
 * same-host path (ctest int_errors_shm) cannot pass by quietly moving the chunks over TCP. */
#define _POSIX_C_SOURCE 200809L

#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "host_pool.h"

/* Small MHA model: 2 layers, 2 KV heads of 8 bf16 elements, 4-token pages. */
enum { LAYERS = 2, HEADS = 2, PAGE = 4, CAPACITY = 16, CHUNK_TOKENS = 16, ROOM = 7, ROOMS = 3 };

/* A pool of TP rank `tp_rank` of `tp_size` (heads of `head_dim` elements of `dtype` bytes). */
static void pool_init(host_pool *p, uint32_t tp_rank, uint32_t tp_size, uint32_t head_dim, uint32_t dtype) {
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, head_dim, dtype, PAGE, CAPACITY, tp_rank, tp_size);
    host_pool_init(p, &shape);
}

static const uint32_t PAGES[8] = {3, 4, 5, 6, 9, 1, 2, 0}; /* two chunks of 4 pages */

static int32_t g_transport = KVSTAGE_TRANSPORT_AUTO;

/* `wr_bytes` 0: the default RDMA work-request size; smaller makes a chunk several requests. */
static kvstage_engine *new_engine(uint32_t wr_bytes) {
    kvstage_engine_options o;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = g_transport;
    if (wr_bytes) {
        o.rdma_wr_bytes = wr_bytes;
        o.rdma_signal_every = 1;
    }
    REQUIRE(kvstage_engine_new(&o, &e) == KVSTAGE_OK);
    return e;
}

static kvstage_engine *engine_with_pool_wr(host_pool *p, uint32_t wr_bytes) {
    kvstage_engine *e = new_engine(wr_bytes);
    REQUIRE(host_pool_register(e, p) == KVSTAGE_OK);
    return e;
}

static kvstage_engine *engine_with_pool(host_pool *p) {
    return engine_with_pool_wr(p, 0);
}

/* A session that must open; with a forced transport, on that transport. */
static kvstage_session *connect_ok(kvstage_engine *e, const char *addr, const char *id) {
    kvstage_session *s = NULL;
    kvstage_session_stats st;
    REQUIRE(kvstage_session_connect(e, addr, id, 2000, &s) == KVSTAGE_OK);
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    REQUIRE(kvstage_session_stats_get(s, &st) == KVSTAGE_OK);
    if (g_transport != KVSTAGE_TRANSPORT_AUTO) CHECK_INT(st.transport, g_transport);
    return s;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t live_allocations(kvstage_engine *e) {
    kvstage_engine_stats stats;
    stats.struct_size = sizeof stats;
    REQUIRE(kvstage_engine_stats_get(e, &stats) == KVSTAGE_OK);
    return stats.ring_live_allocations;
}

static int causes_mention(const kvstage_error *err, const char *needle) {
    for (size_t i = 0; i < err->cause_count; ++i)
        if (strstr(err->causes[i], needle)) return 1;
    return strstr(err->message, needle) != NULL;
}

/* A decode process (decode TP 1) with a ring of `ring_bytes` (0 = none) and rooms ROOM.. open. It
 * writes its address and the rooms' keys (ROOM first) to `addr_fd`, then lives until `done_fd`
 * closes (or it is killed). */
static pid_t spawn_decode(uint32_t head_dim, uint32_t dtype, size_t ring_bytes, int *addr_fd, int *done_fd) {
    int addr_pipe[2], done_pipe[2];
    REQUIRE(pipe(addr_pipe) == 0 && pipe(done_pipe) == 0);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(addr_pipe[0]);
        close(done_pipe[1]);
        host_pool p;
        pool_init(&p, 0, 1, head_dim, dtype);
        kvstage_engine *e = engine_with_pool(&p);
        if (ring_bytes) REQUIRE(kv_staging_register(e, NULL, ring_bytes) == KVSTAGE_OK);
        uint64_t keys[ROOMS];
        for (uint64_t room = ROOM; room < ROOM + ROOMS; ++room) {
            uint32_t chunks = 0;
            REQUIRE(kv_room_open(e, room, PAGES, 8, CHUNK_TOKENS, NULL, &chunks, &keys[room - ROOM]) == KVSTAGE_OK);
            REQUIRE(chunks == 2);
        }
        char addr[64] = {0}; /* all 64 bytes go through the pipe */
        REQUIRE(kvstage_engine_listen_address(e, addr, sizeof addr, NULL) == KVSTAGE_OK);
        REQUIRE(write(addr_pipe[1], addr, sizeof addr) == (ssize_t)sizeof addr);
        REQUIRE(write(addr_pipe[1], keys, sizeof keys) == (ssize_t)sizeof keys);
        char c;
        while (read(done_pipe[0], &c, 1) > 0) {
        }
        kvstage_engine_free(e);
        _exit(0);
    }
    close(addr_pipe[1]);
    close(done_pipe[0]);
    *addr_fd = addr_pipe[0];
    *done_fd = done_pipe[1];
    return pid;
}

/* What spawn_decode's process wrote: its address and the keys of rooms ROOM.. (`keys[ROOMS]`). */
static void read_addr(int fd, char *addr, uint64_t *keys) {
    REQUIRE(read(fd, addr, 64) == 64);
    REQUIRE(read(fd, keys, ROOMS * sizeof *keys) == (ssize_t)(ROOMS * sizeof *keys));
    close(fd);
}

static void finish(pid_t pid, int done_fd) {
    int status = 0;
    close(done_fd);
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void test_connection_refused(void) {
    /* A port that was just in use and is now closed. */
    kvstage_engine *e = new_engine(0);
    char addr[64];
    REQUIRE(kvstage_engine_listen_address(e, addr, sizeof addr, NULL) == KVSTAGE_OK);
    kvstage_engine_free(e);
    host_pool p;
    pool_init(&p, 0, 2, 8, 2);
    e = engine_with_pool(&p);
    kvstage_session *s = NULL;
    CHECK_INT(kvstage_session_connect(e, addr, "refused-1", 2000, &s), KVSTAGE_E_TRANSPORT);
    CHECK(s == NULL);
    const kvstage_error *err = kvstage_error_last();
    CHECK_STR(err->session, "refused-1");
    CHECK_CONTAINS(err->message, addr);
    CHECK(causes_mention(err, "refused"));
    kvstage_engine_free(e);
    host_pool_free(&p);
}

static void test_geometry_mismatch(void) {
    int addr_fd, done_fd;
    pid_t pid = spawn_decode(16, 4, 1 << 16, &addr_fd, &done_fd);
    char addr[64];
    uint64_t keys[ROOMS];
    read_addr(addr_fd, addr, keys);
    host_pool p;
    pool_init(&p, 0, 2, 8, 2);
    kvstage_engine *e = engine_with_pool(&p);
    kvstage_session *s = NULL;
    CHECK_INT(kvstage_session_connect(e, addr, "mismatch-1", 2000, &s), KVSTAGE_E_GEOMETRY_MISMATCH);
    const kvstage_error *err = kvstage_error_last();
    CHECK_INT(err->klass, KVSTAGE_CLASS_GEOMETRY);
    CHECK_STR(err->session, "mismatch-1");
    CHECK(err->cause_count >= 2);
    CHECK(causes_mention(err, "head_dim"));
    CHECK(causes_mention(err, "dtype_bytes"));
    CHECK(causes_mention(err, "8") && causes_mention(err, "16"));
    kvstage_engine_free(e);
    host_pool_free(&p);
    finish(pid, done_fd);
}

static kvstage_transfer_desc chunk_desc(uint64_t room, uint64_t room_key, uint32_t chunk, uint64_t timeout_ms) {
    kvstage_transfer_desc d;
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = room;
    d.room_key = room_key;
    d.chunk_index = chunk;
    d.src_pages = PAGES + 4 * chunk;
    d.num_pages = 4;
    d.timeout_ms = timeout_ms;
    return d;
}

static void test_fallback_when_the_ring_is_too_small(void) {
    int addr_fd, done_fd;
    pid_t pid = spawn_decode(8, 2, 512, &addr_fd, &done_fd); /* one chunk needs 2048 bytes */
    char addr[64];
    uint64_t keys[ROOMS];
    read_addr(addr_fd, addr, keys);
    host_pool p;
    pool_init(&p, 0, 2, 8, 2);
    kvstage_engine *e = engine_with_pool(&p);
    kvstage_session *s = NULL;
    s = connect_ok(e, addr, "fallback-1");
    kvstage_transfer_desc d = chunk_desc(ROOM, keys[0], 0, 0);
    CHECK_INT(kvstage_transfer(s, &d), KVSTAGE_FALLBACK);
    /* The slice path still delivers the chunk. */
    CHECK_INT(kvstage_transfer_slices(s, &d), KVSTAGE_OK);
    kvstage_session_free(s);
    kvstage_engine_free(e);
    host_pool_free(&p);
    finish(pid, done_fd);
}

/* Writer 0 of 2 sends chunk 0 of `room` (which then waits for writer 1, holding the whole ring), so
 * chunk 1's grant waits for the watermark: the transfer blocks in back-pressure. A transfer that
 * fails after its grant aborts, which fails its room on the receiver and frees the ring. */
static kvstage_op *blocked_transfer(kvstage_session *s, uint64_t room, uint64_t room_key, uint64_t timeout_ms) {
    kvstage_transfer_desc d0 = chunk_desc(room, room_key, 0, 5000);
    REQUIRE(kvstage_transfer(s, &d0) == KVSTAGE_OK);
    kvstage_transfer_desc d1 = chunk_desc(room, room_key, 1, timeout_ms);
    kvstage_op *op = NULL;
    REQUIRE(kvstage_transfer_async(s, &d1, &op) == KVSTAGE_PENDING);
    CHECK_INT(kvstage_op_wait(op, 200), KVSTAGE_PENDING);
    return op;
}

static void test_deadline_cancel_and_decode_killed(void) {
    int addr_fd, done_fd;
    pid_t pid = spawn_decode(8, 2, 2048, &addr_fd, &done_fd);
    char addr[64];
    uint64_t keys[ROOMS];
    read_addr(addr_fd, addr, keys);
    host_pool p;
    pool_init(&p, 0, 2, 8, 2);
    kvstage_engine *e = engine_with_pool(&p);
    kvstage_session *s = NULL;
    s = connect_ok(e, addr, "blocked-1");

    /* Deadline: the blocked transfer ends with TIMEOUT, naming what it waited for. */
    kvstage_op *op = blocked_transfer(s, ROOM, keys[0], 400);
    CHECK_INT(kvstage_op_wait(op, 5000), KVSTAGE_E_TIMEOUT);
    CHECK_CONTAINS(kvstage_error_last()->message, "room 7 chunk 1");
    CHECK(causes_mention(kvstage_error_last(), "watermark"));
    CHECK_STR(kvstage_error_last()->session, "blocked-1");
    kvstage_op_free(op);

    /* Cancel: a blocked transfer in the next room ends with CANCELED at once. */
    op = blocked_transfer(s, ROOM + 1, keys[1], 10000);
    REQUIRE(kvstage_op_cancel(op) == KVSTAGE_OK);
    CHECK_INT(kvstage_op_wait(op, 2000), KVSTAGE_E_CANCELED);
    CHECK_INT(kvstage_op_poll(op), KVSTAGE_E_CANCELED);
    kvstage_op_free(op);

    /* The decode process dies while a third transfer waits: PEER_GONE well before its deadline. */
    kvstage_session_free(s);
    s = connect_ok(e, addr, "blocked-2");
    op = blocked_transfer(s, ROOM + 2, keys[2], 30000);
    double t0 = now_s();
    kill(pid, SIGKILL);
    CHECK_INT(kvstage_op_wait(op, 5000), KVSTAGE_E_PEER_GONE);
    CHECK(now_s() - t0 < 1.0);
    CHECK_STR(kvstage_error_last()->session, "blocked-2");
    kvstage_op_free(op);
    kvstage_session_free(s);
    kvstage_engine_free(e);
    host_pool_free(&p);
    close(done_fd);
    waitpid(pid, NULL, 0);
}

/* A prefill process sends its half of chunk 0 and dies: the decode room fails with PEER_GONE within
 * a second and the ring is empty again. With `mid_write` (test builds) it dies inside the write
 * instead: over RDMA its 64 KiB share goes in 4 KiB work requests and the writer stops after the first
 * (kvstage_testing_rdma_fault), so part of the region has landed, the immediate has not, and the
 * grant is still quarantined for that writer when its process is killed. */
static void test_prefill_killed(int mid_write) {
    uint32_t head_dim = mid_write ? 512 : 8;
    host_pool p;
    pool_init(&p, 0, 1, head_dim, 2);
    int addr_pipe[2], sent_pipe[2];
    REQUIRE(pipe(addr_pipe) == 0 && pipe(sent_pipe) == 0);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        char addr[64];
        uint64_t key = 0;
        REQUIRE(read(addr_pipe[0], addr, sizeof addr) == (ssize_t)sizeof addr);
        REQUIRE(read(addr_pipe[0], &key, sizeof key) == (ssize_t)sizeof key);
        host_pool src;
        pool_init(&src, 0, 2, head_dim, 2);
        kvstage_engine *e = engine_with_pool_wr(&src, mid_write ? 4096 : 0);
        kvstage_session *s = NULL;
        s = connect_ok(e, addr, mid_write ? "dying-mid-write" : "dying-prefill");
        kvstage_transfer_desc d = chunk_desc(ROOM, key, 0, 20000);
        if (mid_write) {
#if defined(KVSTAGE_TESTING)
            REQUIRE(kvstage_testing_rdma_fault(4) == KVSTAGE_OK);
#endif
            REQUIRE(write(sent_pipe[1], "x", 1) == 1);
            kvstage_transfer(s, &d); /* over RDMA it stops mid-write; over TCP it completes */
        } else {
            REQUIRE(kvstage_transfer(s, &d) == KVSTAGE_OK);
            REQUIRE(write(sent_pipe[1], "x", 1) == 1);
        }
        for (;;) pause(); /* killed by the parent */
    }
    kvstage_engine *e = engine_with_pool(&p);
    REQUIRE(kv_staging_register(e, NULL, mid_write ? 1u << 20 : 4096) == KVSTAGE_OK);
    uint64_t key = 0;
    REQUIRE(kv_room_open(e, ROOM, PAGES, 8, CHUNK_TOKENS, NULL, NULL, &key) == KVSTAGE_OK);
    char addr[64] = {0};
    REQUIRE(kvstage_engine_listen_address(e, addr, sizeof addr, NULL) == KVSTAGE_OK);
    REQUIRE(write(addr_pipe[1], addr, sizeof addr) == (ssize_t)sizeof addr);
    REQUIRE(write(addr_pipe[1], &key, sizeof key) == (ssize_t)sizeof key);
    char c;
    REQUIRE(read(sent_pipe[0], &c, 1) == 1);
    if (mid_write) {
        struct timespec settle = {1, 0}; /* the grant, then the first work request */
        nanosleep(&settle, NULL);
    }
    CHECK_INT(live_allocations(e), 1);
    double t0 = now_s();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    CHECK_INT(kvstage_room_wait(e, ROOM, key, 5000), KVSTAGE_E_PEER_GONE);
    CHECK(now_s() - t0 < 1.0);
    CHECK_CONTAINS(kvstage_error_last()->message, "room 7");
    CHECK_INT(live_allocations(e), 0);
    /* Both chunks failed, then the room: one ROOM event with the failure, after the chunks'. */
    kvstage_room_event events[4];
    memset(events, 0, sizeof events);
    events[0].struct_size = sizeof events[0];
    size_t n = 0;
    REQUIRE(kvstage_engine_poll_events(e, events, 4, &n) == KVSTAGE_OK);
    CHECK_INT(n, 3);
    for (size_t i = 0; i < n && i < 4; ++i) {
        CHECK_INT(events[i].room, ROOM);
        CHECK(events[i].room_key == key);
        CHECK_INT(events[i].status, KVSTAGE_E_PEER_GONE);
        CHECK_INT(events[i].kind, i + 1 < n ? KVSTAGE_ROOM_EVENT_CHUNK : KVSTAGE_ROOM_EVENT_ROOM);
    }
    if (n == 3) CHECK(events[0].chunk_index != events[1].chunk_index); /* chunks 0 and 1, once each */
    CHECK_INT(kvstage_room_release(e, ROOM, key), KVSTAGE_OK);
    CHECK_INT(kvstage_room_release(e, ROOM, key), KVSTAGE_OK); /* idempotent */
    kvstage_engine_free(e);
    host_pool_free(&p);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    g_transport = kv_test_transport(KVSTAGE_TRANSPORT_AUTO);
    printf("int_errors: transport %s\n", kv_transport_name(g_transport));
    fflush(stdout); /* before any fork: a child must not flush a copy of it again */
    test_connection_refused();
    test_geometry_mismatch();
    test_fallback_when_the_ring_is_too_small();
    test_deadline_cancel_and_decode_killed();
    test_prefill_killed(0);
#if defined(KVSTAGE_TESTING)
    test_prefill_killed(1);
#endif
    return *kv_failures() ? 1 : 0;
}
