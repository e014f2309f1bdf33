/* The same-host path (transport SHM, or AUTO between two processes on one host) between real
 * processes on 127.0.0.1: the prefill maps the decode engine's ring (a sealed memfd named
 * "kvstage-ring") and gathers straight into the granted range.
 *
 * Cases, each printing what it checked:
 *   a. AUTO: the session uses SHM, both engines count it, every decode byte equals an independent
 *      reference (a hash of layer, K/V, source slot and word), the untouched slots stay zero;
 *   b. same_host OFF: TCP, no downgrade counted, bytes checked;
 *   c. a caller-memory decode ring: AUTO falls back to TCP and counts and explains the downgrade;
 *      transport SHM is refused at connect with KVSTAGE_E_UNSUPPORTED and the reason in the chain;
 *   d. the prefill SIGKILLed while it writes 32 MiB chunks in place: the room fails, the ring
 *      returns to empty, the decode process's descriptors return to their count before the
 *      session (no lease socket left behind); again after the prefill forked a sleeping child
 *      that holds its lease and session sockets open (the receiver watches the process itself);
 *   e. the decode SIGKILLed while the prefill writes: the transfer ends with an error (no crash,
 *      no hang), and once the session is freed no "kvstage-ring" mapping and no extra descriptor
 *      is left in the prefill;
 *   f. the decode ring registered again under a connected SHM session: that session's next
 *      transfer fails, a new session maps the new ring and delivers, and once the old session is
 *      freed the prefill maps exactly one ring, the new one.
 *
 * Each decode process ends with kvstage_engine_shutdown, which must say that no peer maps its
 * ring or pool any more, and then frees its pool before the engine (refused before the shutdown
 * when the pool is shared memory).
 *
 * With KVSTAGE_TEST_DIRECT=1 (ctest same_host_direct) every decode pool lies in memory of
 * kvstage_shared_alloc, so the same-host sessions run in direct mode: the prefill copies each chunk
 * from its pages into the decode pages (no ring write, no scatter), and every case above holds
 * with the prefill mapping the decode pool too (a maps "kvstage-pool" while the session lives,
 * counts the chunk as direct on both sides, and unmaps the pool with the ring).
 *
 * Every wait is bounded; nothing asserts how long something took (deadlines are only bounds). */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "host_pool.h"


/* MHA, 4 layers, 8 KV heads of 128 bf16 elements, TP 1 on both sides: a slot of one buffer is a
 * ROW of 2 KiB, a token (every layer, K and V) 16 KiB. 128 pages of 16 tokens: 32 MiB a pool. */
enum { LAYERS = 4, HEADS = 8, HEAD_DIM = 128, DTYPE = 2, ROW = HEADS * HEAD_DIM * DTYPE };
enum { PAGE = 16, CAPACITY = 128, SLOTS = CAPACITY * PAGE };
/* A small room: one chunk of 4 pages (1 MiB). A large room: LARGE_CHUNKS chunks of every page
 * (32 MiB each; the decode pages repeat from chunk to chunk). */
enum { SMALL_PAGES = 4, LARGE_PAGES = CAPACITY, LARGE_CHUNKS = 64 };
#define SMALL_CHUNK_BYTES ((uint64_t)SMALL_PAGES * PAGE * LAYERS * 2 * ROW)
#define RING_SMALL ((size_t)4 << 20)
#define RING_AGAIN ((size_t)8 << 20) /* case f: the new ring, told apart from the old by size */
#define RING_LARGE ((size_t)64 << 20)
enum { ADDR_LEN = 64, CONNECT_MS = 10000, TRANSFER_MS = 15000, WAIT_MS = 20000, ANSWER_MS = 60000 };
enum { SETTLE_MS = 10000 }; /* bound of the polls for teardown (ring empty, fds, mappings) */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(unsigned ms) {
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- pools and the reference bytes -------------------------------------------------------- */

#define BUFFER_BYTES ((size_t)SLOTS * ROW)
#define POOL_BYTES (2 * LAYERS * BUFFER_BYTES)

/* ctest same_host_direct: decode pools in shared memory, so same-host sessions go direct. */
static int direct_mode(void) {
    const char *v = getenv("KVSTAGE_TEST_DIRECT");
    return v != NULL && strcmp(v, "1") == 0;
}

static kvstage_kv_layout pool_shape(void) {
    return host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
}

/* A prefill pool (the heap). */
static void pool_init(host_pool *p) {
    kvstage_kv_layout shape = pool_shape();
    host_pool_init(p, &shape);
    REQUIRE(p->bytes == POOL_BYTES);
}

/* A decode pool: shared memory in direct mode. */
static void decode_pool_init(host_pool *p) {
    kvstage_kv_layout shape = pool_shape();
    if (direct_mode())
        host_pool_init_shared(p, &shape);
    else
        host_pool_init(p, &shape);
    REQUIRE(p->bytes == POOL_BYTES);
}

/* splitmix64: the reference, independent of any kvstage code. */
static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The row the prefill pool holds in slot `slot` of layer `layer`, buffer `kv`. */
static void reference_row(uint8_t *row, uint32_t layer, uint32_t kv, uint32_t slot) {
    for (uint32_t w = 0; w < ROW / 8; ++w) {
        uint64_t h = mix((uint64_t)layer << 56 | (uint64_t)kv << 48 | (uint64_t)slot << 16 | w);
        memcpy(row + 8 * w, &h, 8);
    }
}

static uint8_t *buffer_of(uint8_t *memory, uint32_t layer, uint32_t kv) {
    return memory + (size_t)(2 * layer + kv) * BUFFER_BYTES;
}

static void paint_prefill(host_pool *p) {
    for (uint32_t l = 0; l < LAYERS; ++l)
        for (uint32_t kv = 0; kv < 2; ++kv)
            for (uint32_t s = 0; s < SLOTS; ++s) reference_row(buffer_of(p->memory, l, kv) + (size_t)s * ROW, l, kv, s);
}

/* A small room's pages: neither the identity nor each other, different from room to room
 * (7 and 11 are odd: the four pages of a list are distinct). */
static void small_pages(uint64_t room, uint32_t *src, uint32_t *dst) {
    for (uint32_t i = 0; i < SMALL_PAGES; ++i) {
        src[i] = (uint32_t)((room * 13 + 7 * i + 5) % CAPACITY);
        dst[i] = (uint32_t)((room * 29 + 11 * i + 2) % CAPACITY);
    }
}

/* A large chunk's pages: permutations of every page. */
static uint32_t large_src(uint32_t i) { return (7 * i + 5) % CAPACITY; }
static uint32_t large_dst(uint32_t i) { return (11 * i + 2) % CAPACITY; }

/* Bytes of the decode pool that differ from what small room `room` leaves in a zeroed pool: for
 * each token t, decode slot dst[t / PAGE]·PAGE + t % PAGE holds the prefill's slot
 * src[t / PAGE]·PAGE + t % PAGE; every other slot is still zero. Prints the first difference. */
static size_t verify_small_room(const uint8_t *memory, uint64_t room) {
    static int32_t from[SLOTS];
    uint32_t src[SMALL_PAGES], dst[SMALL_PAGES];
    uint8_t expected[ROW];
    size_t bad = 0;
    small_pages(room, src, dst);
    for (uint32_t s = 0; s < SLOTS; ++s) from[s] = -1;
    for (uint32_t t = 0; t < SMALL_PAGES * PAGE; ++t)
        from[dst[t / PAGE] * PAGE + t % PAGE] = (int32_t)(src[t / PAGE] * PAGE + t % PAGE);
    for (uint32_t l = 0; l < LAYERS; ++l)
        for (uint32_t kv = 0; kv < 2; ++kv)
            for (uint32_t s = 0; s < SLOTS; ++s) {
                const uint8_t *row = memory + (size_t)(2 * l + kv) * BUFFER_BYTES + (size_t)s * ROW;
                if (from[s] >= 0)
                    reference_row(expected, l, kv, (uint32_t)from[s]);
                else
                    memset(expected, 0, ROW);
                for (uint32_t b = 0; b < ROW; ++b)
                    if (row[b] != expected[b] && bad++ == 0)
                        fprintf(stderr, "room %llu: layer %u %c slot %u (from prefill slot %d) byte %u: 0x%02x, expected 0x%02x\n",
                                (unsigned long long)room, (unsigned)l, "KV"[kv], (unsigned)s, (int)from[s], (unsigned)b,
                                row[b], expected[b]);
            }
    return bad;
}

/* ---- /proc/self: descriptors and mappings ------------------------------------------------- */

static int fd_count(void) {
    DIR *dir = opendir("/proc/self/fd");
    REQUIRE(dir != NULL);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL)
        if (de->d_name[0] != '.') ++n;
    closedir(dir);
    return n - 1; /* the directory's own descriptor */
}

/* Mappings of a "kvstage-ring" memfd in this process; `*bytes` (may be NULL) receives the size of
 * the last one. */
/* Mappings of this process whose line names `name` (a memfd's name); `*bytes`: the last one's size. */
static int mappings_of(const char *name, uint64_t *bytes) {
    FILE *f = fopen("/proc/self/maps", "r");
    REQUIRE(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    int n = 0;
    while (getline(&line, &cap, f) > 0) {
        if (strstr(line, name) == NULL) continue;
        unsigned long long start = 0, end = 0;
        if (sscanf(line, "%llx-%llx", &start, &end) == 2 && bytes) *bytes = end - start;
        ++n;
    }
    free(line);
    fclose(f);
    return n;
}

static int ring_mappings(uint64_t *bytes) {
    return mappings_of("kvstage-ring", bytes);
}

/* Decode pools mapped here (direct mode). */
static int pool_mappings(void) {
    return mappings_of("kvstage-pool", NULL);
}

static void print_ring_mappings(const char *what) {
    FILE *f = fopen("/proc/self/maps", "r");
    REQUIRE(f != NULL);
    char *line = NULL;
    size_t cap = 0;
    fprintf(stderr, "%s: kvstage-ring mappings:\n", what);
    while (getline(&line, &cap, f) > 0)
        if (strstr(line, "kvstage-ring")) fprintf(stderr, "  %s", line);
    free(line);
    fclose(f);
}

/* Polls (bounded by SETTLE_MS) until this process maps `want` mappings named `name`; returns the
 * last count (and the size of one in *bytes). */
static int settle_mappings(const char *name, int want, uint64_t *bytes) {
    double end = now_ms() + SETTLE_MS;
    int n = mappings_of(name, bytes);
    while (n != want && now_ms() < end) {
        sleep_ms(10);
        n = mappings_of(name, bytes);
    }
    return n;
}

static int settle_ring_mappings(int want, uint64_t *bytes) {
    return settle_mappings("kvstage-ring", want, bytes);
}

/* Decode pools: the thread that drops a session's last reference unmaps its ring, then its pool;
 * after kvstage_session_free an operation that just ended may still hold the session, so a check
 * made when the ring went can come before the pool goes. */
static int settle_pool_mappings(int want) {
    return settle_mappings("kvstage-pool", want, NULL);
}

/* Polls (bounded by SETTLE_MS) until this process holds `want` descriptors; returns the last count. */
static int settle_fd_count(int want) {
    double end = now_ms() + SETTLE_MS;
    int n = fd_count();
    while (n != want && now_ms() < end) {
        sleep_ms(10);
        n = fd_count();
    }
    return n;
}

static void print_fds(const char *what) {
    DIR *dir = opendir("/proc/self/fd");
    REQUIRE(dir != NULL);
    struct dirent *de;
    fprintf(stderr, "%s: open descriptors:\n", what);
    while ((de = readdir(dir)) != NULL) {
        char path[300], target[256];
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/self/fd/%s", de->d_name);
        ssize_t len = readlink(path, target, sizeof target - 1);
        target[len > 0 ? len : 0] = 0;
        fprintf(stderr, "  %s -> %s\n", de->d_name, target);
    }
    closedir(dir);
}

/* ---- kvstage helpers ---------------------------------------------------------------------- */

static kvstage_engine *new_engine(int32_t transport, int32_t same_host, const host_pool *p) {
    kvstage_engine_options o;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = transport;
    o.same_host = same_host;
    CHECK_OK(kvstage_engine_new(&o, &e));
    REQUIRE(e != NULL);
    if (p) REQUIRE(host_pool_register(e, p) == KVSTAGE_OK);
    return e;
}

static kvstage_engine_stats engine_stats(const kvstage_engine *e) {
    kvstage_engine_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    REQUIRE(kvstage_engine_stats_get(e, &st) == KVSTAGE_OK);
    return st;
}

static kvstage_session_stats session_stats(const kvstage_session *s) {
    kvstage_session_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    REQUIRE(kvstage_session_stats_get(s, &st) == KVSTAGE_OK);
    return st;
}

static kvstage_session *connect_or_fail(kvstage_engine *e, const char *addr, const char *id) {
    kvstage_session *s = NULL;
    int rc = kvstage_session_connect(e, addr, id, CONNECT_MS, &s);
    if (rc != KVSTAGE_OK) {
        KV_FAIL_AT(__FILE__, __LINE__, "session %s to %s: %s", id, addr, kvstage_status_name(rc));
        kv_print_last_error("kvstage_session_connect");
        exit(1);
    }
    return s;
}

/* `room_key`: the key the decode side's kvstage_room_open returned for the room (its answer). */
static int transfer_small(kvstage_session *s, uint64_t room, uint64_t room_key) {
    static uint32_t src[SMALL_PAGES], dst[SMALL_PAGES];
    kvstage_transfer_desc d;
    small_pages(room, src, dst);
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = room;
    d.room_key = room_key;
    d.chunk_index = 0;
    d.src_pages = src;
    d.num_pages = SMALL_PAGES;
    d.timeout_ms = TRANSFER_MS;
    return kvstage_transfer(s, &d);
}

static uint32_t g_large_src[LARGE_PAGES];

static kvstage_transfer_desc large_desc(uint64_t room, uint64_t room_key, uint32_t chunk, uint64_t timeout_ms) {
    kvstage_transfer_desc d;
    for (uint32_t i = 0; i < LARGE_PAGES; ++i) g_large_src[i] = large_src(i);
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = room;
    d.room_key = room_key;
    d.chunk_index = chunk;
    d.src_pages = g_large_src;
    d.num_pages = LARGE_PAGES;
    d.timeout_ms = timeout_ms;
    return d;
}

/* Opens a large room: LARGE_CHUNKS chunks of every page; the opening's key in `*room_key`. */
static int open_large_room(kvstage_engine *e, uint64_t room, uint32_t *chunks, uint64_t *room_key) {
    static uint32_t dst[LARGE_CHUNKS * LARGE_PAGES];
    for (uint32_t c = 0; c < LARGE_CHUNKS; ++c)
        for (uint32_t i = 0; i < LARGE_PAGES; ++i) dst[c * LARGE_PAGES + i] = large_dst(i);
    return kv_room_open(e, room, dst, LARGE_CHUNKS * LARGE_PAGES, LARGE_PAGES * PAGE, NULL, chunks, room_key);
}

/* ---- a decode process run by commands over a pipe ----------------------------------------- */

/* OP_OPEN_SMALL and OP_OPEN_LARGE answer the number of chunks (v[0]) and the opening's room key
 * (v[1]), which the prefill side's transfers name, as an engine's bootstrap would pass it on. */
enum { OP_OPEN_SMALL = 1, OP_OPEN_LARGE, OP_WAIT, OP_VERIFY, OP_RELEASE, OP_STATS, OP_REGISTER_RING };

typedef struct command {
    int32_t op;
    int32_t unused;
    uint64_t room;
    uint64_t arg;
} command;

typedef struct answer {
    int32_t status;
    int32_t unused;
    uint64_t v[4];
} answer;

typedef struct decode_proc {
    pid_t pid;
    int cmd_fd, answer_fd;
    char addr[ADDR_LEN];
} decode_proc;

static void read_exactly(int fd, void *buf, size_t len, int timeout_ms, const char *what) {
    size_t got = 0;
    double end = now_ms() + timeout_ms;
    while (got < len) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int left = (int)(end - now_ms());
        if (left <= 0 || poll(&pfd, 1, left) != 1) {
            KV_FAIL_AT(__FILE__, __LINE__, "%s: nothing within %d ms", what, timeout_ms);
            exit(1);
        }
        ssize_t n = read(fd, (char *)buf + got, len - got);
        if (n <= 0) {
            KV_FAIL_AT(__FILE__, __LINE__, "%s: the other process is gone", what);
            exit(1);
        }
        got += (size_t)n;
    }
}

/* The keys of the rooms a decode process opened (ids below 128), as its engine's bootstrap keeps
 * them: its waits and releases name the opening. */
static uint64_t g_room_keys[128];

static void decode_serve(int cmd_fd, int answer_fd, int caller_ring, size_t ring_bytes) {
    host_pool p;
    decode_pool_init(&p);
    kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_AUTO, &p);
    void *caller = NULL;
    if (caller_ring) {
        caller = calloc(1, ring_bytes);
        REQUIRE(caller != NULL);
    }
    REQUIRE(kv_staging_register(e, caller, ring_bytes) == KVSTAGE_OK);
    char addr[ADDR_LEN] = {0}; /* all ADDR_LEN bytes go through the pipe */
    REQUIRE(kvstage_engine_listen_address(e, addr, sizeof addr, NULL) == KVSTAGE_OK);
    REQUIRE(write(answer_fd, addr, sizeof addr) == (ssize_t)sizeof addr);
    command c;
    while (read(cmd_fd, &c, sizeof c) == (ssize_t)sizeof c) {
        answer a;
        memset(&a, 0, sizeof a);
        uint32_t chunks = 0;
        uint64_t key = 0;
        REQUIRE(c.room < 128);
        switch (c.op) {
        case OP_OPEN_SMALL: {
            uint32_t src[SMALL_PAGES], dst[SMALL_PAGES];
            small_pages(c.room, src, dst);
            memset(p.memory, 0, POOL_BYTES); /* VERIFY compares the whole pool */
            a.status = kv_room_open(e, c.room, dst, SMALL_PAGES, SMALL_PAGES * PAGE, NULL, &chunks, &key);
            a.v[0] = chunks;
            a.v[1] = g_room_keys[c.room] = key;
            break;
        }
        case OP_OPEN_LARGE:
            a.status = open_large_room(e, c.room, &chunks, &key);
            a.v[0] = chunks;
            a.v[1] = g_room_keys[c.room] = key;
            break;
        case OP_WAIT:
            a.status = kvstage_room_wait(e, c.room, g_room_keys[c.room], c.arg);
            if (a.status != KVSTAGE_OK) kv_print_last_error("decode: kvstage_room_wait");
            break;
        case OP_VERIFY:
            a.v[0] = verify_small_room(p.memory, c.room);
            break;
        case OP_RELEASE:
            a.status = kvstage_room_release(e, c.room, g_room_keys[c.room]);
            break;
        case OP_STATS: {
            kvstage_engine_stats st = engine_stats(e);
            a.v[0] = st.shm_sessions;
            a.v[1] = st.shm_downgrades;
            a.v[2] = st.ring_live_allocations;
            a.v[3] = st.chunks_received;
            break;
        }
        case OP_REGISTER_RING:
            a.status = kv_staging_register(e, NULL, (size_t)c.arg);
            if (a.status != KVSTAGE_OK) kv_print_last_error("decode: kvstage_staging_register");
            break;
        default:
            a.status = KVSTAGE_E_INVALID_ARG;
        }
        if (a.status < 0 && c.op != OP_WAIT && c.op != OP_REGISTER_RING) kv_print_last_error("decode");
        REQUIRE(write(answer_fd, &a, sizeof a) == (ssize_t)sizeof a);
    }
    /* A pool a same-host peer may map is not the caller's to free while the engine lives; once a
     * shutdown said no peer maps it any more, it is (every case: prefills freed or killed). */
    if (p.shared) CHECK_INT(kvstage_shared_free(p.memory), KVSTAGE_E_INVALID_ARG);
    size_t still_mapped = 99;
    CHECK_OK(kvstage_engine_shutdown(e, WAIT_MS, &still_mapped));
    CHECK_INT(still_mapped, 0);
    uint32_t dst[SMALL_PAGES], src[SMALL_PAGES], chunks = 0;
    uint64_t key = 0;
    small_pages(1, src, dst);
    CHECK_INT(kv_room_open(e, 1, dst, SMALL_PAGES, SMALL_PAGES * PAGE, NULL, &chunks, &key), KVSTAGE_E_CANCELED);
    host_pool_free(&p);
    kvstage_engine_free(e);
    free(caller);
}

/* Forks a decode process (transport AUTO, a ring of `ring_bytes`: engine-owned, or caller memory
 * with `caller_ring`) and reads its address. */
static decode_proc spawn_decode(int caller_ring, size_t ring_bytes) {
    int cmd[2], ans[2];
    decode_proc d;
    REQUIRE(pipe(cmd) == 0 && pipe(ans) == 0);
    fflush(NULL); /* or the child would print the parent's buffered output again */
    d.pid = fork();
    REQUIRE(d.pid >= 0);
    if (d.pid == 0) {
        close(cmd[1]);
        close(ans[0]);
        *kv_failures() = 0;
        decode_serve(cmd[0], ans[1], caller_ring, ring_bytes);
        fflush(NULL);
        _exit(*kv_failures() ? 1 : 0);
    }
    close(cmd[0]);
    close(ans[1]);
    d.cmd_fd = cmd[1];
    d.answer_fd = ans[0];
    read_exactly(d.answer_fd, d.addr, ADDR_LEN, ANSWER_MS, "decode address");
    return d;
}

static answer ask(const decode_proc *d, int32_t op, uint64_t room, uint64_t arg) {
    command c;
    answer a;
    memset(&c, 0, sizeof c);
    c.op = op;
    c.room = room;
    c.arg = arg;
    REQUIRE(write(d->cmd_fd, &c, sizeof c) == (ssize_t)sizeof c);
    read_exactly(d->answer_fd, &a, sizeof a, ANSWER_MS, "decode answer");
    return a;
}

/* Opens `room` in the decode process (`op`: OP_OPEN_SMALL or OP_OPEN_LARGE); returns its key. */
static uint64_t open_room(const decode_proc *d, int32_t op, uint64_t room) {
    answer a = ask(d, op, room, 0);
    CHECK_INT(a.status, KVSTAGE_OK);
    CHECK(a.v[1] != 0);
    return a.v[1];
}

/* Ends the decode process (its command pipe closes) and checks it exited with 0. */
static void finish_decode(decode_proc *d) {
    int status = 0;
    close(d->cmd_fd);
    double end = now_ms() + SETTLE_MS;
    pid_t got = 0;
    while ((got = waitpid(d->pid, &status, WNOHANG)) == 0 && now_ms() < end) sleep_ms(10);
    if (got != d->pid) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, NULL, 0);
        KV_FAIL_AT(__FILE__, __LINE__, "decode process still running after %d ms: killed", SETTLE_MS);
    } else {
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    close(d->answer_fd);
}

/* The decode side of one small room: complete, every byte as the reference says. */
static void check_small_room_landed(const decode_proc *d, uint64_t room) {
    answer a = ask(d, OP_WAIT, room, WAIT_MS);
    CHECK_INT(a.status, KVSTAGE_OK);
    a = ask(d, OP_VERIFY, room, 0);
    CHECK_INT(a.v[0], 0);
}

/* ---- the cases ---------------------------------------------------------------------------- */

/* a. AUTO between two processes on this host: the same-host path. */
static void test_auto_uses_shm(void) {
    enum { ROOM = 11 };
    decode_proc d = spawn_decode(0, RING_SMALL);
    host_pool src;
    pool_init(&src);
    paint_prefill(&src);
    kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_AUTO, &src);
    uint64_t key = open_room(&d, OP_OPEN_SMALL, ROOM);
    kvstage_session *s = connect_or_fail(e, d.addr, "shm-auto");
    kvstage_session_stats ss = session_stats(s);
    CHECK_INT(ss.transport, KVSTAGE_TRANSPORT_SHM);
    CHECK_INT(ss.downgraded, 0);
    uint64_t mapped = 0;
    CHECK_INT(ring_mappings(&mapped), 1); /* the decode ring, mapped here */
    CHECK_INT(mapped, RING_SMALL);
    /* A child forked now (multiprocessing, a helper) gets no copy of the mapping (MADV_DONTFORK):
     * only this process, whose teardown the receiver waits for, can write the ring. */
    if (getenv("KVSTAGE_UNDER_VALGRIND") == NULL) {
        pid_t child = fork();
        REQUIRE(child >= 0);
        if (child == 0) _exit(ring_mappings(NULL) == 0 ? 0 : 1);
        int child_status = 0;
        REQUIRE(waitpid(child, &child_status, 0) == child);
        CHECK(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0);
    } else {
        printf("under valgrind: the forked child's mapping check is skipped (memcheck reports the parent's thread-locals "
               "as the child's leaks)\n");
    }
    CHECK_OK(transfer_small(s, ROOM, key));
    check_small_room_landed(&d, ROOM);
    ss = session_stats(s);
    CHECK_INT(ss.bytes_sent, SMALL_CHUNK_BYTES);
    CHECK_INT(ss.transfers_ok, 1);
    kvstage_engine_stats es = engine_stats(e);
    CHECK_INT(es.shm_sessions, 1);
    CHECK_INT(es.shm_downgrades, 0);
    int direct = direct_mode();
    CHECK_INT(es.shm_direct_sessions, direct);
    CHECK_INT(es.shm_direct_chunks, direct); /* the one chunk, copied page to page */
    CHECK_INT(pool_mappings(), direct);      /* the decode pool (one allocation), mapped here */
    answer a = ask(&d, OP_STATS, 0, 0);
    CHECK_INT(a.v[0], 1); /* decode shm_sessions */
    CHECK_INT(a.v[1], 0); /* decode shm_downgrades */
    CHECK_INT(a.v[2], 0); /* decode ring_live_allocations */
    CHECK_INT(a.v[3], 1); /* decode chunks_received */
    char text[1024] = {0};
    kv_engine_transport(e, text, sizeof text);
    CHECK_CONTAINS(text, "same host: shm (auto), 1 session");
    if (direct) CHECK_CONTAINS(text, "1 direct (decode pool mapped, 1 chunk region(s) copied page to page)");
    CHECK_INT(ask(&d, OP_RELEASE, ROOM, 0).status, KVSTAGE_OK);
    kvstage_session_free(s);
    CHECK_INT(settle_ring_mappings(0, NULL), 0);
    CHECK_INT(settle_pool_mappings(0), 0); /* unmapped with the ring */
    kvstage_engine_free(e);
    host_pool_free(&src);
    finish_decode(&d);
    printf("same_host a [auto%s]: session transport shm, not downgraded, the decode ring mapped here (%llu bytes); "
           "%llu bytes sent, every decode byte equals the reference; shm_sessions 1 on both engines; describe: %s; "
           "no ring or pool mapping left after session_free\n",
           direct ? ", direct" : "", (unsigned long long)mapped, (unsigned long long)SMALL_CHUNK_BYTES, text);
}

/* b. same_host OFF on the prefill: TCP, and that is no downgrade. */
static void test_same_host_off(void) {
    enum { ROOM = 21 };
    decode_proc d = spawn_decode(0, RING_SMALL);
    host_pool src;
    pool_init(&src);
    paint_prefill(&src);
    kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_OFF, &src);
    uint64_t key = open_room(&d, OP_OPEN_SMALL, ROOM);
    kvstage_session *s = connect_or_fail(e, d.addr, "shm-off");
    kvstage_session_stats ss = session_stats(s);
    CHECK_INT(ss.transport, KVSTAGE_TRANSPORT_TCP);
    CHECK_INT(ring_mappings(NULL), 0);
    CHECK_OK(transfer_small(s, ROOM, key));
    check_small_room_landed(&d, ROOM);
    kvstage_engine_stats es = engine_stats(e);
    CHECK_INT(es.shm_sessions, 0);
    CHECK_INT(es.shm_downgrades, 0);
    answer a = ask(&d, OP_STATS, 0, 0);
    CHECK_INT(a.v[0], 0);
    CHECK_INT(a.v[2], 0);
    CHECK_INT(ask(&d, OP_RELEASE, ROOM, 0).status, KVSTAGE_OK);
    kvstage_session_free(s);
    kvstage_engine_free(e);
    host_pool_free(&src);
    finish_decode(&d);
    printf("same_host b [same_host OFF]: session transport tcp, no ring mapped, shm_downgrades 0, shm_sessions 0 on "
           "both engines, every decode byte equals the reference\n");
}

/* c. The decode ring is caller memory: it cannot be shared. */
static void test_caller_memory_ring(void) {
    enum { ROOM = 31 };
    decode_proc d = spawn_decode(1, RING_SMALL);
    host_pool src;
    pool_init(&src);
    paint_prefill(&src);
    kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_AUTO, &src);
    uint64_t key = open_room(&d, OP_OPEN_SMALL, ROOM);
    kvstage_session *s = connect_or_fail(e, d.addr, "shm-caller-ring");
    kvstage_session_stats ss = session_stats(s);
    CHECK_INT(ss.transport, KVSTAGE_TRANSPORT_TCP);
    CHECK_INT(ss.downgraded, 1);
    CHECK_INT(ring_mappings(NULL), 0);
    kvstage_engine_stats es = engine_stats(e);
    CHECK_INT(es.shm_downgrades, 1);
    CHECK_INT(es.shm_sessions, 0);
    char text[2048] = {0};
    kv_engine_transport(e, text, sizeof text);
    CHECK_CONTAINS(text, "same host");
    CHECK_CONTAINS(text, "caller memory");
    CHECK_CONTAINS(text, "shm-caller-ring");
    CHECK_OK(transfer_small(s, ROOM, key)); /* over TCP, into the caller's ring */
    check_small_room_landed(&d, ROOM);
    CHECK_INT(ask(&d, OP_RELEASE, ROOM, 0).status, KVSTAGE_OK);
    kvstage_session_free(s);
    kvstage_engine_free(e);

    /* Transport SHM: refused at connect, with the reason. */
    kvstage_engine *forced = new_engine(KVSTAGE_TRANSPORT_SHM, KVSTAGE_SAME_HOST_AUTO, &src);
    kvstage_session *none = NULL;
    char message[512] = {0}, chain[1024] = {0};
    int rc = kvstage_session_connect(forced, d.addr, "shm-forced-caller-ring", CONNECT_MS, &none);
    CHECK_INT(rc, KVSTAGE_E_UNSUPPORTED);
    CHECK(none == NULL);
    {
        const kvstage_error *err = kvstage_error_last();
        int mentions = strstr(err->message, "caller memory") != NULL;
        snprintf(message, sizeof message, "%s", err->message);
        for (size_t i = 0; i < err->cause_count; ++i) {
            mentions |= strstr(err->causes[i], "caller memory") != NULL;
            size_t used = strlen(chain);
            snprintf(chain + used, sizeof chain - used, "%s%s", i ? " | " : "", err->causes[i]);
        }
        CHECK_INT(err->code, KVSTAGE_E_UNSUPPORTED);
        CHECK_STR(err->session, "shm-forced-caller-ring");
        if (!mentions)
            KV_FAIL_AT(__FILE__, __LINE__, "the error does not say the ring is caller memory: \"%s\" causes: %s", message, chain);
    }
    CHECK_INT(ring_mappings(NULL), 0);
    es = engine_stats(forced);
    CHECK_INT(es.shm_sessions, 0);
    CHECK_INT(es.shm_downgrades, 0); /* transport SHM: an error, not a downgrade */
    answer a = ask(&d, OP_STATS, 0, 0);
    CHECK_INT(a.v[0], 0);
    kvstage_engine_free(forced);
    host_pool_free(&src);
    finish_decode(&d);
    printf("same_host c [caller-memory ring]: auto -> tcp, downgraded 1, shm_downgrades 1, bytes verified; describe: "
           "%s\n  transport shm -> KVSTAGE_E_UNSUPPORTED: %s; causes: %s\n",
           text, message, chain);
}

/* d. The prefill process is SIGKILLed while it writes large chunks into the mapped ring. With
 * `fork_child`, it first forked a child (no exec) that inherits its lease and session sockets and
 * sleeps: the receiver must see the process end by itself (a pidfd), not wait for the sockets. */
static void test_sender_killed(int fork_child) {
    const uint64_t ROOM = fork_child ? 42 : 41;
    pid_t kid = 0;
    int addr_pipe[2], note_pipe[2];
    REQUIRE(pipe(addr_pipe) == 0 && pipe(note_pipe) == 0);
    fflush(NULL);
    pid_t pid = fork(); /* before the decode engine exists: the child inherits none of it */
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(addr_pipe[1]);
        close(note_pipe[0]);
        char addr[ADDR_LEN];
        uint64_t key = 0;
        REQUIRE(read(addr_pipe[0], addr, sizeof addr) == (ssize_t)sizeof addr);
        REQUIRE(read(addr_pipe[0], &key, sizeof key) == (ssize_t)sizeof key);
        host_pool src;
        pool_init(&src);
        memset(src.memory, 0x5A, POOL_BYTES);
        kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_AUTO, &src);
        kvstage_session *s = connect_or_fail(e, addr, "shm-dying-sender");
        char t = session_stats(s).transport == KVSTAGE_TRANSPORT_SHM ? 'S' : 'T';
        if (fork_child) {
            kid = fork(); /* inherits every descriptor, the lease and the session's socket too */
            REQUIRE(kid >= 0);
            if (kid == 0) {
                /* Killed by the test at its end; never outlives a test that failed early, and never
                 * holds ctest's output pipes. */
                alarm(120);
                if (freopen("/dev/null", "w", stdout) == NULL || freopen("/dev/null", "w", stderr) == NULL) _exit(1);
                for (;;) pause();
            }
        }
        REQUIRE(write(note_pipe[1], &t, 1) == 1);
        REQUIRE(write(note_pipe[1], &kid, sizeof kid) == (ssize_t)sizeof kid);
        /* Every chunk but the last: the room still owes one whenever the kill lands. */
        for (uint32_t c = 0; c + 1 < LARGE_CHUNKS; ++c) {
            kvstage_transfer_desc desc = large_desc(ROOM, key, c, 20000);
            int rc = kvstage_transfer(s, &desc);
            if (rc != KVSTAGE_OK) {
                kv_print_last_error("dying sender: kvstage_transfer");
                REQUIRE(write(note_pipe[1], "e", 1) == 1);
                break;
            }
            if (c == 0) REQUIRE(write(note_pipe[1], "x", 1) == 1);
        }
        for (;;) pause(); /* killed by the parent */
    }
    close(addr_pipe[0]);
    close(note_pipe[1]);
    host_pool dst;
    decode_pool_init(&dst);
    kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_AUTO, &dst);
    REQUIRE(kv_staging_register(e, NULL, RING_LARGE) == KVSTAGE_OK);
    uint32_t chunks = 0;
    uint64_t key = 0;
    REQUIRE(open_large_room(e, ROOM, &chunks, &key) == KVSTAGE_OK);
    CHECK_INT(chunks, LARGE_CHUNKS);
    int baseline = fd_count();
    char addr[ADDR_LEN] = {0};
    REQUIRE(kvstage_engine_listen_address(e, addr, sizeof addr, NULL) == KVSTAGE_OK);
    REQUIRE(write(addr_pipe[1], addr, sizeof addr) == (ssize_t)sizeof addr);
    REQUIRE(write(addr_pipe[1], &key, sizeof key) == (ssize_t)sizeof key);
    char t = 0, x = 0;
    read_exactly(note_pipe[0], &t, 1, ANSWER_MS, "sender's transport");
    CHECK(t == 'S');
    read_exactly(note_pipe[0], &kid, sizeof kid, ANSWER_MS, "sender's child");
    read_exactly(note_pipe[0], &x, 1, ANSWER_MS, "sender's first chunk");
    CHECK(x == 'x');
    CHECK_INT(engine_stats(e).shm_sessions, 1);
    unsigned delay = (unsigned)(((unsigned)getpid() * 2654435761u) >> 16) % 20; /* somewhere in the next chunk */
    sleep_ms(delay);
    uint64_t live_at_kill = engine_stats(e).ring_live_allocations; /* reported, not asserted */
    kill(pid, SIGKILL);
    REQUIRE(waitpid(pid, NULL, 0) == pid);
    int rc = kvstage_room_wait(e, ROOM, key, WAIT_MS);
    char why[512];
    snprintf(why, sizeof why, "%s", kvstage_error_last()->message);
    CHECK(rc < 0 && rc != KVSTAGE_E_TIMEOUT);
    if (!(rc < 0 && rc != KVSTAGE_E_TIMEOUT)) kv_print_last_error("kvstage_room_wait after the sender died");
    uint64_t received = engine_stats(e).chunks_received;
    double end = now_ms() + SETTLE_MS;
    uint64_t live = engine_stats(e).ring_live_allocations;
    while (live != 0 && now_ms() < end) {
        sleep_ms(10);
        live = engine_stats(e).ring_live_allocations;
    }
    CHECK_INT(live, 0);
    int fds = settle_fd_count(baseline);
    CHECK_INT(fds, baseline);
    if (fds != baseline) print_fds("decode after the sender died");
    CHECK_OK(kvstage_room_release(e, ROOM, key));
    kvstage_engine_free(e);
    CHECK_INT(settle_ring_mappings(0, NULL), 0); /* the decode's own ring is gone with its engine */
    host_pool_free(&dst);
    close(addr_pipe[1]);
    close(note_pipe[0]);
    if (kid > 0) kill(kid, SIGKILL);
    printf("same_host d [sender killed%s]: shm session, killed %u ms after its first 32 MiB chunk was acknowledged "
           "(%llu live allocation(s) just before the kill, %llu chunk(s) scattered); room wait -> %s (%s); "
           "ring_live_allocations back to 0; decode descriptors back to %d\n",
           fork_child ? ", its forked child holding the lease and session sockets" : "", delay, (unsigned long long)live_at_kill, (unsigned long long)received, kvstage_status_name(rc), why, baseline);
}

/* e. The decode process is SIGKILLed while the prefill writes into its ring. */
static void test_receiver_killed(void) {
    enum { ROOM = 51 };
    decode_proc d = spawn_decode(0, RING_LARGE);
    uint64_t key = open_room(&d, OP_OPEN_LARGE, ROOM);
    host_pool src;
    pool_init(&src);
    memset(src.memory, 0x5A, POOL_BYTES);
    kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_AUTO, &src);
    int baseline = fd_count();
    CHECK_INT(ring_mappings(NULL), 0);
    kvstage_session *s = connect_or_fail(e, d.addr, "shm-receiver-dies");
    CHECK_INT(session_stats(s).transport, KVSTAGE_TRANSPORT_SHM);
    CHECK_INT(ring_mappings(NULL), 1);
    kvstage_transfer_desc d0 = large_desc(ROOM, key, 0, TRANSFER_MS);
    CHECK_OK(kvstage_transfer(s, &d0));
    kvstage_transfer_desc d1 = large_desc(ROOM, key, 1, 10000);
    kvstage_op *op = NULL;
    REQUIRE(kvstage_transfer_async(s, &d1, &op) == KVSTAGE_PENDING);
    unsigned delay = (unsigned)(((unsigned)getpid() * 2654435761u) >> 16) % 10;
    if (delay) /* PENDING, or its result if it was that quick (0 would wait the engine's default) */
        kvstage_op_wait(op, delay);
    else
        kvstage_op_poll(op);
    kill(d.pid, SIGKILL);
    REQUIRE(waitpid(d.pid, NULL, 0) == d.pid);
    int rc = kvstage_op_wait(op, 30000); /* its deadline (10 s) ends it at the latest */
    CHECK(rc != KVSTAGE_PENDING);
    int in_flight = rc;
    char why[512] = {0};
    if (rc == KVSTAGE_OK) {
        /* It finished before the kill: the next one runs against a dead receiver. */
        kvstage_transfer_desc d2 = large_desc(ROOM, key, 2, 10000);
        rc = kvstage_transfer(s, &d2);
    }
    snprintf(why, sizeof why, "%s", kvstage_error_last()->message);
    CHECK(rc < 0);
    kvstage_op_free(op);
    kvstage_session_free(s);
    uint64_t left = 0;
    int maps = settle_ring_mappings(0, &left);
    CHECK_INT(maps, 0);
    if (maps != 0) print_ring_mappings("prefill after session_free");
    CHECK_INT(settle_pool_mappings(0), 0); /* direct mode: the dead decode's pool is unmapped too */
    int fds = settle_fd_count(baseline);
    CHECK_INT(fds, baseline);
    if (fds != baseline) print_fds("prefill after session_free");
    kvstage_engine_free(e);
    host_pool_free(&src);
    close(d.cmd_fd);
    close(d.answer_fd);
    printf("same_host e [receiver killed]: shm session; the transfer in flight at the kill -> %s%s, failed with %s "
           "(%s); after session_free no kvstage-ring mapping and descriptors back to %d\n",
           kvstage_status_name(in_flight), in_flight == KVSTAGE_OK ? " (done before the kill; the next one)" : "",
           kvstage_status_name(rc), why, baseline);
}

/* f. The decode ring registered again while an SHM session maps the old one. */
static void test_ring_registered_again(void) {
    enum { ROOM1 = 61, ROOM2 = 62, ROOM3 = 63 };
    decode_proc d = spawn_decode(0, RING_SMALL);
    host_pool src;
    pool_init(&src);
    paint_prefill(&src);
    kvstage_engine *e = new_engine(KVSTAGE_TRANSPORT_AUTO, KVSTAGE_SAME_HOST_AUTO, &src);
    uint64_t key1 = open_room(&d, OP_OPEN_SMALL, ROOM1);
    kvstage_session *old = connect_or_fail(e, d.addr, "shm-old-ring");
    CHECK_INT(session_stats(old).transport, KVSTAGE_TRANSPORT_SHM);
    uint64_t mapped = 0;
    CHECK_INT(ring_mappings(&mapped), 1);
    CHECK_INT(mapped, RING_SMALL);
    CHECK_OK(transfer_small(old, ROOM1, key1));
    check_small_room_landed(&d, ROOM1);
    CHECK_INT(ask(&d, OP_RELEASE, ROOM1, 0).status, KVSTAGE_OK);

    CHECK_INT(ask(&d, OP_REGISTER_RING, 0, RING_AGAIN).status, KVSTAGE_OK);
    uint64_t key2 = open_room(&d, OP_OPEN_SMALL, ROOM2);
    int stale = transfer_small(old, ROOM2, key2);
    char why[512];
    snprintf(why, sizeof why, "%s", kvstage_error_last()->message);
    CHECK(stale < 0);
    CHECK_INT(ask(&d, OP_RELEASE, ROOM2, 0).status, KVSTAGE_OK);

    uint64_t key3 = open_room(&d, OP_OPEN_SMALL, ROOM3);
    kvstage_session *fresh = connect_or_fail(e, d.addr, "shm-new-ring");
    CHECK_INT(session_stats(fresh).transport, KVSTAGE_TRANSPORT_SHM);
    CHECK_OK(transfer_small(fresh, ROOM3, key3));
    check_small_room_landed(&d, ROOM3);
    kvstage_session_free(old);
    mapped = 0;
    int maps = settle_ring_mappings(1, &mapped);
    CHECK_INT(maps, 1);
    CHECK_INT(mapped, RING_AGAIN); /* the new ring, not the stale one */
    if (maps != 1 || mapped != RING_AGAIN) print_ring_mappings("prefill after freeing the old session");
    CHECK_INT(engine_stats(e).shm_sessions, 2);
    answer a = ask(&d, OP_STATS, 0, 0);
    CHECK_INT(a.v[0], 2);
    CHECK_INT(a.v[2], 0);
    CHECK_INT(ask(&d, OP_RELEASE, ROOM3, 0).status, KVSTAGE_OK);
    kvstage_session_free(fresh);
    CHECK_INT(settle_ring_mappings(0, NULL), 0);
    CHECK_INT(settle_pool_mappings(0), 0);
    kvstage_engine_free(e);
    host_pool_free(&src);
    finish_decode(&d);
    printf("same_host f [ring registered again]: the old session's next transfer -> %s (%s); a new session over shm "
           "delivered every byte; after freeing the old session one kvstage-ring mapping, of the new ring's %llu "
           "bytes; shm_sessions 2 on both engines\n",
           kvstage_status_name(stale), why, (unsigned long long)mapped);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    fflush(NULL);
    test_auto_uses_shm();
    test_same_host_off();
    test_caller_memory_ring();
    test_sender_killed(0);
    test_sender_killed(1);
    test_receiver_killed();
    test_ring_registered_again();
    return kv_finish("same_host");
}
