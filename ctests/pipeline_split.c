/* Pipeline splits and prefill-side head replication on the staged path, between real processes
 * on 127.0.0.1: one process (fork) per decode rank and per prefill rank. Each scenario moves one
 * 12-token chunk from a prefill (TP, PP) layout to decode stages split another way: uneven
 * stages (4 + 3 layers into 7), three stages into two (the middle stage writes to both), prefill
 * TP 4 over 2 KV heads (ranks 1 and 3 hold copies that ranks 0 and 2 send), and TP 2 with an
 * uneven split. The decode side is TP 1 in every scenario: each decode rank holds every head.
 *
 * What it proves:
 * - kvstage_pairing_decode_ranks gives each prefill rank exactly the decode ranks the scenario
 *   expects (none for a replica), and those sessions are all a transfer needs;
 * - every byte of every decode pool equals an independent reference: a hash of (layer id, K/V,
 *   global head, token, byte) at the slot the room's page list gives the token (page lists that
 *   are not the identity on either side), the initial filler everywhere else;
 * - each (head, layer) crosses the wire once: decode bytes_received and each session's bytes_sent
 *   are exact, and a replica that connects and transfers anyway gets KVSTAGE_OK having sent 0. */
#define _POSIX_C_SOURCE 200809L

#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fork_ranks.h"
#include "host_pool.h"

enum { HEAD_DIM = 16, DTYPE = 2, ROW = HEAD_DIM * DTYPE, PAGE = 4, CAPACITY = 8, NPAGES = 3, TOKENS = NPAGES * PAGE };
enum { ROOM = 1, MAX_LAYERS = 8, MAX_STAGES = 3, MAX_TP = 4, ADDR_LEN = 64 };
/* Every wait is bounded: a transfer by its deadline, a room by its wait, a scenario's processes
 * by SCENARIO_MS (then they are killed). The three fit in the ctest TIMEOUT for four scenarios. */
enum { CONNECT_MS = 10000, TRANSFER_MS = 15000, ROOM_WAIT_MS = 18000, SCENARIO_MS = 25000 };
enum { PREFILL_FILLER = 0xA5 }; /* decode pools are calloc'ed: their filler is 0 */

/* Neither the identity nor each other: a gather or scatter through the wrong pages shows. */
static const uint32_t PREFILL_PAGES[NPAGES] = {5, 0, 3};
static const uint32_t DECODE_PAGES[NPAGES] = {6, 4, 1};

/* One side's pipeline split: stage j holds layer ids ids[j][0 .. n[j]). */
typedef struct split {
    uint32_t stages;
    uint32_t n[MAX_STAGES];
    uint32_t ids[MAX_STAGES][MAX_LAYERS];
} split;

typedef struct scenario {
    const char *name;
    uint32_t heads; /* KV heads of the model */
    uint32_t prefill_tp;
    split prefill, decode;
    uint32_t peer_stages[MAX_STAGES]; /* bit d of [j]: prefill stage j writes to decode stage d */
    uint32_t replicas;                /* bit r: prefill TP rank r's heads are sent by another rank */
} scenario;

static const scenario SCENARIOS[] = {
    {"4+3 into 7", 8, 1, {2, {4, 3}, {{0, 1, 2, 3}, {4, 5, 6}}}, {1, {7}, {{0, 1, 2, 3, 4, 5, 6}}}, {1, 1}, 0},
    {"3+2+2 into 4+3", 8, 1, {3, {3, 2, 2}, {{0, 1, 2}, {3, 4}, {5, 6}}}, {2, {4, 3}, {{0, 1, 2, 3}, {4, 5, 6}}},
     {1, 3, 2}, 0},
    {"TP 4 over 2 heads into TP 1", 2, 4, {1, {2}, {{0, 1}}}, {1, {2}, {{0, 1}}}, {1}, 0xA},
    {"TP 2, 4+3 into 7", 8, 2, {2, {4, 3}, {{0, 1, 2, 3}, {4, 5, 6}}}, {1, {7}, {{0, 1, 2, 3, 4, 5, 6}}}, {1, 1}, 0},
};

/* The reference byte: splitmix64 of the coordinates, independent of any kvstage code. */
static uint8_t pattern(uint32_t layer, uint32_t kv, uint32_t head, uint32_t token, uint32_t byte) {
    uint64_t x = ((uint64_t)layer << 48 | (uint64_t)kv << 40 | (uint64_t)head << 32 | (uint64_t)token << 16 | byte);
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (uint8_t)(x ^ (x >> 31));
}

static uint32_t heads_per_rank(uint32_t heads, uint32_t tp) { return heads / tp ? heads / tp : 1; }

/* The layout of TP rank `tp_rank` of `tp`, stage `stage` of `s`, without buffers (a shape). */
static kvstage_kv_layout shape(const scenario *sc, uint32_t tp_rank, uint32_t tp, const split *s, uint32_t stage) {
    kvstage_kv_layout l = host_pool_shape(s->n[stage], sc->heads, HEAD_DIM, DTYPE, PAGE, CAPACITY, tp_rank, tp);
    REQUIRE(l.local_heads == heads_per_rank(sc->heads, tp));
    l.pp_rank = stage;
    l.pp_size = s->stages;
    l.layer_ids = s->ids[stage];
    return l;
}

/* Writes into `memory` (a pool's buffers) what the reference says a pool of layout `l` holds:
 * token t of the chunk in slot pages[t / PAGE]·PAGE + t % PAGE, for the global heads the rank
 * holds (rank r of tp: heads r·H/tp ..), `filler` everywhere else. */
static void paint(uint8_t *memory, const kvstage_kv_layout *l, const uint32_t *pages, uint8_t filler) {
    size_t heads = l->local_heads, buffer = (size_t)CAPACITY * PAGE * heads * ROW;
    uint32_t first = l->tp_rank * l->global_heads / l->tp_size;
    memset(memory, filler, 2 * l->num_layers * buffer);
    for (size_t li = 0; li < l->num_layers; ++li)
        for (uint32_t kv = 0; kv < 2; ++kv)
            for (uint32_t t = 0; t < TOKENS; ++t) {
                size_t slot = (size_t)pages[t / PAGE] * PAGE + t % PAGE;
                for (uint32_t h = 0; h < heads; ++h)
                    for (uint32_t b = 0; b < ROW; ++b)
                        memory[(2 * li + kv) * buffer + (slot * heads + h) * ROW + b] =
                            pattern(l->layer_ids[li], kv, first + h, t, b);
            }
}

/* TCP unless KVSTAGE_TEST_TRANSPORT says otherwise (ctest rdma_vm: rdma, the same regions by RDMA
 * WRITE; ctest pipeline_split_shm: shm, the prefill gathers straight into the mapped decode ring).
 * Every session's transport is checked, so no run passes by quietly falling back to TCP. */
static int32_t g_transport = KVSTAGE_TRANSPORT_TCP;

/* An engine with pool `p` and a ring of `ring_bytes` (0: none). */
static kvstage_engine *engine_with(const host_pool *p, size_t ring_bytes) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = g_transport;
    return host_pool_engine(&o, p, ring_bytes);
}

static uint32_t shared_layers(const split *a, uint32_t sa, const split *b, uint32_t sb) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < a->n[sa]; ++i)
        for (uint32_t j = 0; j < b->n[sb]; ++j) n += a->ids[sa][i] == b->ids[sb][j];
    return n;
}

/* What a decode stage tells the prefill processes, as an engine's bootstrap would: where to
 * connect, and the key of its opening of the room (each decode stage has its own). */
typedef struct bootstrap {
    char addr[ADDR_LEN];
    uint64_t room_key;
} bootstrap;

/* Decode stage `stage`: opens the room, sends its bootstrap on `addr_fd`, waits for the room, then
 * (once `done_fd` closes: every prefill process has exited, so late traffic is in) compares its
 * whole pool with the reference and its received bytes with each head and layer counted once. */
static int decode_main(const scenario *sc, uint32_t stage, int addr_fd, int done_fd) {
    kvstage_kv_layout l = shape(sc, 0, 1, &sc->decode, stage);
    host_pool p;
    host_pool_init(&p, &l);
    kvstage_engine *e = engine_with(&p, 1 << 20);
    uint32_t chunks = 0;
    bootstrap boot;
    memset(&boot, 0, sizeof boot); /* all of it goes through the pipe (atomic: < PIPE_BUF) */
    REQUIRE(kv_room_open(e, ROOM, DECODE_PAGES, NPAGES, TOKENS, NULL, &chunks, &boot.room_key) == KVSTAGE_OK);
    CHECK_INT(chunks, 1);
    REQUIRE(kvstage_engine_listen_address(e, boot.addr, sizeof boot.addr, NULL) == KVSTAGE_OK);
    REQUIRE(write(addr_fd, &boot, sizeof boot) == (ssize_t)sizeof boot);
    close(addr_fd);

    CHECK_OK(kvstage_room_wait(e, ROOM, boot.room_key, ROOM_WAIT_MS));
    struct pollfd done = {done_fd, POLLIN, 0};
    char c;
    CHECK(poll(&done, 1, SCENARIO_MS) == 1 && read(done_fd, &c, 1) == 0);

    uint8_t *expected = (uint8_t *)malloc(2 * l.num_layers * p.buffer);
    REQUIRE(expected != NULL);
    paint(expected, &p.layout, DECODE_PAGES, 0);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < 2 * l.num_layers * p.buffer; ++i)
        if (p.memory[i] != expected[i] && bad++ == 0) first = i;
    if (bad) {
        size_t buf = first / p.buffer, row = first % p.buffer / ROW;
        KV_FAIL_AT(__FILE__, __LINE__, "%zu byte(s) differ; first: layer id %u %c, slot %zu, head %zu, byte %zu: 0x%02x, expected 0x%02x",
                   bad, (unsigned)l.layer_ids[buf / 2], "KV"[buf % 2], row / l.local_heads, row % l.local_heads,
                   first % ROW, p.memory[first], expected[first]);
    }
    kvstage_engine_stats stats;
    stats.struct_size = sizeof stats;
    CHECK_OK(kvstage_engine_stats_get(e, &stats));
    CHECK_INT(stats.bytes_received, (uint64_t)sc->heads * l.num_layers * 2 * TOKENS * ROW);
    CHECK_INT(stats.chunks_received, 1);
    CHECK_INT(stats.ring_live_allocations, 0);

    CHECK_OK(kvstage_room_release(e, ROOM, boot.room_key));
    kvstage_engine_free(e);
    free(expected);
    host_pool_free(&p);
    char name[96];
    snprintf(name, sizeof name, "pipeline_split [%s] decode stage %u", sc->name, (unsigned)stage);
    return kv_finish(name);
}

/* Prefill TP rank `tp_rank` of stage `stage`: asks the pairing helper whom to connect to (checked
 * against the scenario) and transfers the chunk to each. A replica, which has no peers, connects
 * to every decode stage anyway, as a launcher that ignores the helper would: its transfers must
 * succeed and send nothing, or the decode side would count its heads twice. */
static int prefill_main(const scenario *sc, uint32_t tp_rank, uint32_t stage, const bootstrap *boots) {
    kvstage_kv_layout l = shape(sc, tp_rank, sc->prefill_tp, &sc->prefill, stage);
    host_pool p;
    host_pool_init(&p, &l);
    paint(p.memory, &p.layout, PREFILL_PAGES, PREFILL_FILLER);
    kvstage_engine *e = engine_with(&p, 0);

    kvstage_kv_layout decode_stages[MAX_STAGES];
    for (uint32_t d = 0; d < sc->decode.stages; ++d) decode_stages[d] = shape(sc, 0, 1, &sc->decode, d);
    kvstage_rank peers[MAX_STAGES];
    size_t count = 0;
    REQUIRE(kvstage_pairing_decode_ranks(&p.layout, NULL, 0, decode_stages, sc->decode.stages, peers, MAX_STAGES, &count) ==
            KVSTAGE_OK);
    int replica = (sc->replicas >> tp_rank) & 1;
    uint32_t expected = replica ? 0 : sc->peer_stages[stage];
    size_t n = 0; /* the expected peers, in (pp_rank, tp_rank) order */
    for (uint32_t d = 0; d < sc->decode.stages; ++d)
        if ((expected >> d) & 1) {
            CHECK(n < count && peers[n].pp_rank == d && peers[n].tp_rank == 0);
            ++n;
        }
    CHECK_INT(count, n);

    uint32_t targets = 0;
    for (size_t i = 0; i < count; ++i) targets |= 1u << peers[i].pp_rank;
    if (replica) targets = (1u << sc->decode.stages) - 1;
    for (uint32_t d = 0; d < sc->decode.stages; ++d) {
        if (!((targets >> d) & 1)) continue;
        char id[48];
        snprintf(id, sizeof id, "p%u.%u-d%u", (unsigned)stage, (unsigned)tp_rank, (unsigned)d);
        kvstage_session *s = NULL;
        if (kvstage_session_connect(e, boots[d].addr, id, CONNECT_MS, &s) != KVSTAGE_OK) {
            KV_FAIL_AT(__FILE__, __LINE__, "session %s to %s", id, boots[d].addr);
            kv_print_last_error("kvstage_session_connect");
            continue;
        }
        kvstage_transfer_desc desc;
        REQUIRE(kvstage_transfer_desc_init(&desc, sizeof desc) == KVSTAGE_OK);
        desc.room = ROOM;
        desc.room_key = boots[d].room_key; /* decode stage d's opening */
        desc.chunk_index = 0;
        desc.src_pages = PREFILL_PAGES;
        desc.num_pages = NPAGES;
        desc.timeout_ms = TRANSFER_MS;
        CHECK_OK(kvstage_transfer(s, &desc));
        kvstage_session_stats st;
        st.struct_size = sizeof st;
        CHECK_OK(kvstage_session_stats_get(s, &st));
        CHECK_INT(st.transport, g_transport);
        uint64_t heads = replica ? 0 : l.local_heads; /* decode TP 1 takes all of them */
        CHECK_INT(st.bytes_sent, heads * shared_layers(&sc->prefill, stage, &sc->decode, d) * 2 * TOKENS * ROW);
        kvstage_session_free(s);
    }
    kvstage_engine_free(e);
    host_pool_free(&p);
    char name[96];
    snprintf(name, sizeof name, "pipeline_split [%s] prefill stage %u rank %u", sc->name, (unsigned)stage,
             (unsigned)tp_rank);
    return kv_finish(name);
}

/* One scenario: the decode processes first (their bootstraps are collected before any prefill
 * process exists, so those inherit them), then the prefill processes; the decode processes check
 * their pools once every prefill process is gone (the done pipe closes). */
static void run(const scenario *sc) {
    double deadline = now_ms() + SCENARIO_MS;
    child decode[MAX_STAGES], prefill[MAX_STAGES * MAX_TP];
    bootstrap boots[MAX_STAGES];
    int done[2], ready = 1, nd = 0, np = 0;
    REQUIRE(pipe(done) == 0);
    for (uint32_t d = 0; ready && d < sc->decode.stages; ++d, ++nd) {
        int addr[2];
        REQUIRE(pipe(addr) == 0);
        fflush(NULL); /* or the children would print the parent's buffered output again */
        decode[d].pid = fork();
        REQUIRE(decode[d].pid >= 0);
        if (decode[d].pid == 0) {
            *kv_failures() = 0; /* a child counts its own failures, not the earlier scenarios' */
            close(done[1]);
            close(addr[0]);
            exit(decode_main(sc, d, addr[1], done[0]));
        }
        snprintf(decode[d].name, sizeof decode[d].name, "decode stage %u", (unsigned)d);
        close(addr[1]);
        struct pollfd pfd = {addr[0], POLLIN, 0};
        int wait_ms = (int)(deadline - now_ms());
        if (!(poll(&pfd, 1, wait_ms > 0 ? wait_ms : 0) == 1 &&
              read(addr[0], &boots[d], sizeof boots[d]) == (ssize_t)sizeof boots[d])) {
            KV_FAIL_AT(__FILE__, __LINE__, "[%s] decode stage %u sent no address", sc->name, (unsigned)d);
            ready = 0;
        }
        close(addr[0]);
    }
    close(done[0]);
    for (uint32_t s = 0; ready && s < sc->prefill.stages; ++s)
        for (uint32_t r = 0; r < sc->prefill_tp; ++r, ++np) {
            fflush(NULL);
            prefill[np].pid = fork();
            REQUIRE(prefill[np].pid >= 0);
            if (prefill[np].pid == 0) {
                *kv_failures() = 0;
                close(done[1]);
                exit(prefill_main(sc, r, s, boots));
            }
            snprintf(prefill[np].name, sizeof prefill[np].name, "prefill stage %u rank %u", (unsigned)s, (unsigned)r);
        }
    reap(sc->name, prefill, np, deadline, SCENARIO_MS);
    close(done[1]);
    reap(sc->name, decode, nd, deadline, SCENARIO_MS);
}

int main(void) {
    g_transport = kv_test_transport(KVSTAGE_TRANSPORT_TCP);
    printf("pipeline_split: transport %s\n", kv_transport_name(g_transport));
    fflush(stdout); /* before any fork */
    for (size_t i = 0; i < sizeof SCENARIOS / sizeof SCENARIOS[0]; ++i) {
        int before = *kv_failures();
        run(&SCENARIOS[i]);
        printf("pipeline_split [%s]: %s\n", SCENARIOS[i].name, *kv_failures() == before ? "ok" : "FAILED");
        fflush(stdout); /* before the next scenario's children, and in order with stderr */
    }
    return kv_finish("pipeline_split");
}
