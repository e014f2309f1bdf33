/* Whole requests between real processes on 127.0.0.1 (fork: one process per rank): KV plus three
 * aux buffers of different row sizes, a conv-like state of three groups and an SSM-like state
 * (sharded by TP), and a sliding-window pool with its own page size, in one room per decode rank,
 * prefill TP 4 -> decode TP 2 and TP 2 -> 4. The request's last chunk ends inside a decode page and
 * carries the parts; the window starts inside a prefill window page.
 *
 * What it proves: every byte of every decode buffer (KV pool and components) equals an
 * independent reference, a hash of each element's global coordinates (layer, global head or
 * element, token, byte) written here without any kvstage code, at the rows, slots and pages the
 * decode room named, and 0 everywhere else. TCP by default; ctest request_parts_shm forces the
 * same-host path, rdma_vm runs it with transport RDMA (each session's transport is checked). */
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

enum { HEADS = 4, HEAD_DIM = 16, DTYPE = 2, ROW = HEAD_DIM * DTYPE, LAYERS = 4, PAGE = 4, CAPACITY = 8 };
enum { TOTAL = 22, CHUNK = 16, NPAGES = (TOTAL + PAGE - 1) / PAGE, ROOM = 3, ITEMS = 4, MAX_TP = 4, ADDR_LEN = 64 };
enum { WINDOW = 10, WPAGE = 8, WUNIT = 8, WFIRST = (TOTAL - WINDOW) % WPAGE, NCOMP = 6 };
enum { CONNECT_MS = 10000, TRANSFER_MS = 15000, ROOM_WAIT_MS = 18000, SCENARIO_MS = 25000 };

static const uint32_t PREFILL_PAGES[NPAGES] = {5, 0, 3, 7, 1, 6};
static const uint32_t DECODE_PAGES[NPAGES] = {2, 6, 4, 1, 7, 0};
static const uint32_t PREFILL_WINDOW[2] = {3, 1}, DECODE_WINDOW[2] = {2, 0};
static const uint32_t LAYER_IDS[LAYERS] = {0, 1, 2, 3};
static const uint32_t STATE_LAYERS[2] = {0, 2}, WINDOW_LAYERS[2] = {1, 3};
static const uint32_t CONV_GROUPS[3] = {8, 8, 16}, SSM_GROUPS[1] = {16};

/* The components in registration order: kind, row bytes (aux) or unit bytes (pool), state shape. */
typedef struct comp {
    const char *name;
    int32_t kind;
    uint64_t item;
    const uint32_t *groups;
    uint32_t ngroups, outer, dtype;
} comp;

static const comp COMPS[NCOMP] = {
    {"output_ids", KVSTAGE_COMPONENT_AUX, 16, NULL, 0, 0, 0},
    {"conv", KVSTAGE_COMPONENT_STATE, 0, CONV_GROUPS, 3, 2, 2},
    {"logprobs", KVSTAGE_COMPONENT_AUX, 64, NULL, 0, 0, 0},
    {"ssm", KVSTAGE_COMPONENT_STATE, 0, SSM_GROUPS, 1, 2, 4},
    {"swa", KVSTAGE_COMPONENT_POOL, WUNIT, NULL, 0, 0, 0},
    {"hidden", KVSTAGE_COMPONENT_AUX, 200, NULL, 0, 0, 0},
};

/* What each side names: aux row, conv and ssm slots (decode and prefill differ on purpose). */
static const uint64_t DECODE_ROW = 3, PREFILL_ROW = 1;
static const uint64_t DECODE_SLOTS[2] = {2, 0}, PREFILL_SLOTS[2] = {1, 3};

typedef struct scenario {
    const char *name;
    uint32_t prefill_tp, decode_tp;
} scenario;

static const scenario SCENARIOS[] = {{"P4 -> D2", 4, 2}, {"P2 -> D4", 2, 4}};

/* The reference byte: splitmix64 of the coordinates, independent of any kvstage code. */
static uint8_t pattern(uint32_t what, uint32_t layer, uint32_t a, uint32_t b, uint32_t byte) {
    uint64_t x = ((uint64_t)what << 56 | (uint64_t)layer << 48 | (uint64_t)a << 32 | (uint64_t)b << 16 | byte);
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (uint8_t)(x ^ (x >> 31)) | 1;
}

/* Elements of one state row on a rank of `tp`; the global element of local element `i`. */
static uint32_t row_elems(const comp *c, uint32_t tp) {
    uint32_t n = 0;
    for (uint32_t g = 0; g < c->ngroups; ++g) n += c->groups[g] / tp;
    return n;
}

static uint32_t global_elem(const comp *c, uint32_t rank, uint32_t tp, uint32_t i) {
    uint32_t local = 0, global = 0;
    for (uint32_t g = 0; g < c->ngroups; ++g) {
        uint32_t share = c->groups[g] / tp;
        if (i < local + share) return global + rank * share + (i - local);
        local += share;
        global += c->groups[g];
    }
    return UINT32_MAX;
}

/* One rank: its KV pool and component buffers (per component, per layer: one calloc'ed buffer). */
typedef struct rank {
    uint32_t tp_rank, tp, heads;
    host_pool pool;   /* the KV pool */
    uint8_t *kv;      /* its memory */
    size_t kv_buffer; /* bytes of one of its buffers */
    uint8_t *buf[NCOMP][2];
    size_t bytes[NCOMP], item_bytes[NCOMP];
    uint64_t bases[NCOMP][2];
} rank;

static void rank_alloc(rank *r, uint32_t tp_rank, uint32_t tp) {
    memset(r, 0, sizeof *r);
    r->tp_rank = tp_rank, r->tp = tp, r->heads = HEADS / tp;
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, tp_rank, tp);
    shape.layer_ids = LAYER_IDS;
    host_pool_init(&r->pool, &shape);
    r->kv = r->pool.memory;
    r->kv_buffer = r->pool.buffer;
    REQUIRE(r->kv_buffer == (size_t)CAPACITY * PAGE * r->heads * ROW);
    for (int c = 0; c < NCOMP; ++c) {
        const comp *k = &COMPS[c];
        size_t item = k->kind == KVSTAGE_COMPONENT_AUX    ? k->item
                      : k->kind == KVSTAGE_COMPONENT_POOL ? (size_t)k->item * r->heads
                                                          : (size_t)k->outer * row_elems(k, tp) * k->dtype;
        r->item_bytes[c] = item;
        r->bytes[c] = ITEMS * item * (k->kind == KVSTAGE_COMPONENT_POOL ? WPAGE : 1);
        for (int l = 0; l < (k->kind == KVSTAGE_COMPONENT_AUX ? 1 : 2); ++l) {
            r->buf[c][l] = (uint8_t *)calloc(1, r->bytes[c]);
            REQUIRE(r->buf[c][l] != NULL);
            r->bases[c][l] = (uint64_t)(uintptr_t)r->buf[c][l];
        }
    }
}

static void rank_free(rank *r) {
    host_pool_free(&r->pool);
    for (int c = 0; c < NCOMP; ++c)
        for (int l = 0; l < 2; ++l) free(r->buf[c][l]);
}

/* Writes the reference into `kv` and `buf` (arrays shaped like the rank's) for the request as the
 * rank's side names it: KV tokens in `pages`, aux row, state slots, window pages from `wfirst`. */
static void paint(const rank *r, uint8_t *kv, uint8_t *buf[NCOMP][2], const uint32_t *pages, uint64_t row, const uint64_t *slots,
                  const uint32_t *wpages, uint32_t wfirst) {
    uint32_t first_head = r->tp_rank * r->heads;
    for (size_t l = 0; l < LAYERS; ++l)
        for (uint32_t kvi = 0; kvi < 2; ++kvi)
            for (uint32_t t = 0; t < TOTAL; ++t) {
                size_t slot = (size_t)pages[t / PAGE] * PAGE + t % PAGE;
                for (uint32_t h = 0; h < r->heads; ++h)
                    for (uint32_t b = 0; b < ROW; ++b)
                        kv[(2 * l + kvi) * r->kv_buffer + (slot * r->heads + h) * ROW + b] = pattern(kvi, LAYER_IDS[l], first_head + h, t, b);
            }
    uint32_t state = 0;
    for (uint32_t c = 0; c < NCOMP; ++c) {
        const comp *k = &COMPS[c];
        if (k->kind == KVSTAGE_COMPONENT_AUX) {
            for (uint32_t b = 0; b < k->item; ++b) buf[c][0][row * k->item + b] = pattern(10 + c, 0, 0, 0, b);
            continue;
        }
        for (uint32_t li = 0; li < 2; ++li) {
            if (k->kind == KVSTAGE_COMPONENT_STATE) {
                uint32_t n = row_elems(k, r->tp);
                for (uint32_t o = 0; o < k->outer; ++o)
                    for (uint32_t i = 0; i < n; ++i)
                        for (uint32_t b = 0; b < k->dtype; ++b)
                            buf[c][li][slots[state] * r->item_bytes[c] + ((size_t)o * n + i) * k->dtype + b] =
                                pattern(10 + c, STATE_LAYERS[li], o, global_elem(k, r->tp_rank, r->tp, i), b);
            } else {
                for (uint32_t j = 0; j < WINDOW; ++j) {
                    uint32_t t = wfirst + j;
                    size_t slot = (size_t)wpages[t / WPAGE] * WPAGE + t % WPAGE;
                    for (uint32_t h = 0; h < r->heads; ++h)
                        for (uint32_t b = 0; b < WUNIT; ++b)
                            buf[c][li][slot * r->item_bytes[c] + h * WUNIT + b] =
                                pattern(10 + c, WINDOW_LAYERS[li], first_head + h, TOTAL - WINDOW + j, b);
                }
            }
        }
        state += k->kind == KVSTAGE_COMPONENT_STATE;
    }
}

static int32_t g_transport = KVSTAGE_TRANSPORT_TCP;

/* An engine with the rank's KV pool and components registered. */
static kvstage_engine *engine_of(rank *r) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = g_transport;
    /* KVSTAGE_TEST_PIECE_BYTES: every chunk gathered into a staging buffer (also over TCP) and
     * written in pieces of that many bytes, each while the next is gathered. */
    const char *pieces = getenv("KVSTAGE_TEST_PIECE_BYTES");
    if (pieces != NULL && pieces[0] != 0) {
        o.send_from_pool = 0;
        o.send_piece_bytes = strtoull(pieces, NULL, 10);
    }
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_new(&o, &e) == KVSTAGE_OK);
    REQUIRE(host_pool_register(e, &r->pool) == KVSTAGE_OK);
    kvstage_component comps[NCOMP];
    kvstage_state_item items[NCOMP];
    for (uint32_t c = 0; c < NCOMP; ++c) {
        const comp *k = &COMPS[c];
        REQUIRE(kvstage_component_init(&comps[c], sizeof comps[c]) == KVSTAGE_OK);
        comps[c].name = k->name;
        comps[c].kind = k->kind;
        comps[c].item_bytes = k->item;
        comps[c].num_items = ITEMS;
        comps[c].bases = r->bases[c];
        comps[c].num_bases = k->kind == KVSTAGE_COMPONENT_AUX ? 1 : 2;
        if (k->kind == KVSTAGE_COMPONENT_STATE) {
            REQUIRE(kvstage_state_item_init(&items[c], sizeof items[c]) == KVSTAGE_OK);
            items[c].outer = k->outer, items[c].dtype_bytes = k->dtype, items[c].group_dims = k->groups, items[c].num_groups = k->ngroups;
            comps[c].state = &items[c];
            comps[c].layer_ids = STATE_LAYERS, comps[c].num_layers = 2;
        } else if (k->kind == KVSTAGE_COMPONENT_POOL) {
            comps[c].page_size = WPAGE, comps[c].head_sliced = 1;
            comps[c].layer_ids = WINDOW_LAYERS, comps[c].num_layers = 2;
        }
    }
    if (kvstage_pool_register_components(e, comps, NCOMP) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_pool_register_components");
        REQUIRE(0);
    }
    return e;
}

static kvstage_request_parts parts_of(uint64_t row, const uint64_t *slots, const uint32_t *wpages, uint32_t wfirst, kvstage_pool_span *span) {
    kvstage_request_parts p;
    REQUIRE(kvstage_request_parts_init(&p, sizeof p) == KVSTAGE_OK);
    p.aux_row = row, p.state_slots = slots, p.num_state_slots = 2;
    span->pages = wpages, span->num_pages = 2, span->first_token = wfirst, span->num_tokens = WINDOW;
    p.pool_spans = span, p.num_pool_spans = 1;
    return p;
}

typedef struct bootstrap {
    char addr[ADDR_LEN];
    uint64_t room_key;
} bootstrap;

/* Decode rank `d`: opens the room with its parts, sends its bootstrap, waits for the room, then
 * (every prefill process gone) compares every byte it holds with the reference. */
static int decode_main(const scenario *sc, uint32_t d, int addr_fd, int done_fd) {
    rank r;
    rank_alloc(&r, d, sc->decode_tp);
    kvstage_engine *e = engine_of(&r);
    REQUIRE(kv_staging_register(e, NULL, 1 << 20) == KVSTAGE_OK);
    kvstage_pool_span span;
    kvstage_request_parts parts = parts_of(DECODE_ROW, DECODE_SLOTS, DECODE_WINDOW, 0, &span);
    bootstrap boot;
    memset(&boot, 0, sizeof boot);
    uint32_t chunks = 0;
    REQUIRE(kv_room_open(e, ROOM, DECODE_PAGES, NPAGES, CHUNK, &parts, &chunks, &boot.room_key) == KVSTAGE_OK);
    CHECK_INT(chunks, 2);
    REQUIRE(kvstage_engine_listen_address(e, boot.addr, sizeof boot.addr, NULL) == KVSTAGE_OK);
    REQUIRE(write(addr_fd, &boot, sizeof boot) == (ssize_t)sizeof boot);
    close(addr_fd);
    CHECK_OK(kvstage_room_wait(e, ROOM, boot.room_key, ROOM_WAIT_MS));
    struct pollfd done = {done_fd, POLLIN, 0};
    char ch;
    CHECK(poll(&done, 1, SCENARIO_MS) == 1 && read(done_fd, &ch, 1) == 0);

    rank want;
    rank_alloc(&want, d, sc->decode_tp);
    paint(&want, want.kv, want.buf, DECODE_PAGES, DECODE_ROW, DECODE_SLOTS, DECODE_WINDOW, 0);
    size_t bad = 0;
    for (size_t i = 0; i < 2 * LAYERS * r.kv_buffer; ++i)
        if (r.kv[i] != want.kv[i] && bad++ == 0) KV_FAIL_AT(__FILE__, __LINE__, "KV byte %zu: 0x%02x, expected 0x%02x", i, r.kv[i], want.kv[i]);
    for (int c = 0; c < NCOMP; ++c)
        for (int l = 0; l < 2 && r.buf[c][l]; ++l)
            for (size_t i = 0; i < r.bytes[c]; ++i)
                if (r.buf[c][l][i] != want.buf[c][l][i] && bad++ == 0)
                    KV_FAIL_AT(__FILE__, __LINE__, "%s layer index %d byte %zu: 0x%02x, expected 0x%02x", COMPS[c].name, l, i, r.buf[c][l][i],
                               want.buf[c][l][i]);
    if (bad) KV_FAIL_AT(__FILE__, __LINE__, "%zu byte(s) differ in all", bad);
    CHECK_OK(kvstage_room_release(e, ROOM, boot.room_key));
    kvstage_engine_free(e);
    rank_free(&r);
    rank_free(&want);
    char name[96];
    snprintf(name, sizeof name, "request_parts [%s] decode rank %u", sc->name, (unsigned)d);
    return kv_finish(name);
}

/* Prefill rank `p`: sends both chunks to each decode rank it feeds, the parts with the last. */
static int prefill_main(const scenario *sc, uint32_t p, const bootstrap *boots) {
    rank r;
    rank_alloc(&r, p, sc->prefill_tp);
    paint(&r, r.kv, r.buf, PREFILL_PAGES, PREFILL_ROW, PREFILL_SLOTS, PREFILL_WINDOW, WFIRST);
    kvstage_engine *e = engine_of(&r);
    kvstage_pool_span span;
    kvstage_request_parts parts = parts_of(PREFILL_ROW, PREFILL_SLOTS, PREFILL_WINDOW, WFIRST, &span);
    uint32_t lo = p * sc->decode_tp / sc->prefill_tp, hi = (p + 1) * sc->decode_tp / sc->prefill_tp;
    if (hi == lo) hi = lo + 1;
    for (uint32_t d = lo; d < hi; ++d) {
        char id[48];
        snprintf(id, sizeof id, "p%u-d%u", (unsigned)p, (unsigned)d);
        kvstage_session *s = NULL;
        if (kvstage_session_connect(e, boots[d].addr, id, CONNECT_MS, &s) != KVSTAGE_OK) {
            KV_FAIL_AT(__FILE__, __LINE__, "session %s to %s", id, boots[d].addr);
            kv_print_last_error("kvstage_session_connect");
            continue;
        }
        for (uint32_t chunk = 0; chunk < 2; ++chunk) {
            kvstage_transfer_desc desc;
            REQUIRE(kvstage_transfer_desc_init(&desc, sizeof desc) == KVSTAGE_OK);
            desc.room = ROOM, desc.room_key = boots[d].room_key, desc.chunk_index = chunk;
            desc.src_pages = PREFILL_PAGES + chunk * (CHUNK / PAGE);
            desc.num_pages = chunk == 0 ? CHUNK / PAGE : NPAGES - CHUNK / PAGE;
            desc.num_tokens = chunk == 0 ? CHUNK : TOTAL - CHUNK;
            desc.timeout_ms = TRANSFER_MS;
            desc.parts = chunk == 1 ? &parts : NULL;
            CHECK_OK(kvstage_transfer(s, &desc));
        }
        kvstage_session_stats st;
        st.struct_size = sizeof st;
        CHECK_OK(kvstage_session_stats_get(s, &st));
        CHECK_INT(st.transport, g_transport);
        kvstage_session_free(s);
    }
    kvstage_engine_free(e);
    rank_free(&r);
    char name[96];
    snprintf(name, sizeof name, "request_parts [%s] prefill rank %u", sc->name, (unsigned)p);
    return kv_finish(name);
}

static void run(const scenario *sc) {
    double deadline = now_ms() + SCENARIO_MS;
    child decode[MAX_TP], prefill[MAX_TP];
    bootstrap boots[MAX_TP];
    int done[2], ready = 1, nd = 0, np = 0;
    REQUIRE(pipe(done) == 0);
    for (uint32_t d = 0; ready && d < sc->decode_tp; ++d, ++nd) {
        int addr[2];
        REQUIRE(pipe(addr) == 0);
        fflush(NULL);
        decode[d].pid = fork();
        REQUIRE(decode[d].pid >= 0);
        if (decode[d].pid == 0) {
            *kv_failures() = 0;
            close(done[1]);
            close(addr[0]);
            exit(decode_main(sc, d, addr[1], done[0]));
        }
        snprintf(decode[d].name, sizeof decode[d].name, "decode rank %u", (unsigned)d);
        close(addr[1]);
        struct pollfd pfd = {addr[0], POLLIN, 0};
        int wait_ms = (int)(deadline - now_ms());
        if (!(poll(&pfd, 1, wait_ms > 0 ? wait_ms : 0) == 1 && read(addr[0], &boots[d], sizeof boots[d]) == (ssize_t)sizeof boots[d])) {
            KV_FAIL_AT(__FILE__, __LINE__, "[%s] decode rank %u sent no address", sc->name, (unsigned)d);
            ready = 0;
        }
        close(addr[0]);
    }
    close(done[0]);
    for (uint32_t p = 0; ready && p < sc->prefill_tp; ++p, ++np) {
        fflush(NULL);
        prefill[np].pid = fork();
        REQUIRE(prefill[np].pid >= 0);
        if (prefill[np].pid == 0) {
            *kv_failures() = 0;
            close(done[1]);
            exit(prefill_main(sc, p, boots));
        }
        snprintf(prefill[np].name, sizeof prefill[np].name, "prefill rank %u", (unsigned)p);
    }
    reap(sc->name, prefill, np, deadline, SCENARIO_MS);
    close(done[1]);
    reap(sc->name, decode, nd, deadline, SCENARIO_MS);
}

int main(void) {
    g_transport = kv_test_transport(KVSTAGE_TRANSPORT_TCP);
    const char *pieces = getenv("KVSTAGE_TEST_PIECE_BYTES");
    printf("request_parts: transport %s%s%s\n", kv_transport_name(g_transport),
           pieces != NULL && pieces[0] != 0 ? ", every chunk gathered into staging and written in pieces of at least bytes: " : "",
           pieces != NULL && pieces[0] != 0 ? pieces : "");
    fflush(stdout);
    for (size_t i = 0; i < sizeof SCENARIOS / sizeof SCENARIOS[0]; ++i) {
        int before = *kv_failures();
        run(&SCENARIOS[i]);
        printf("request_parts [%s]: %s\n", SCENARIOS[i].name, *kv_failures() == before ? "ok" : "FAILED");
        fflush(stdout);
    }
    return kv_finish("request_parts");
}
