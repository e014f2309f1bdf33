/* Named pool layouts (kvstage_kv_layout_preset) across real processes on 127.0.0.1: every ordered
 * pair (prefill layout, decode layout) of the eight presets (sglang, vLLM's six axis orders of
 * [L, B, H, N, K‖V], TensorRT-LLM's blocks), each a request of 18 tokens in 3 chunks (8 + 8 + 2:
 * the last ends inside a decode page) over TCP with a TP change: the pairs alternate between
 * prefill TP 2 -> decode TP 1 and prefill TP 1 -> decode TP 2 (direction (a + b) % 2), so every
 * layout meets both directions on both sides. One process per rank (fork); each process holds one
 * engine per layout it plays, so a run is 3 + 3 processes per phase.
 *
 * The reference is computed here, from each engine's own index formula for its axis order
 * (ref_offset: element offsets in the order the engine stores its axes, written out per layout;
 * nothing is derived from the strides kvstage_kv_layout_preset returns, which are only compared
 * with the formula). The prefill pools are painted through the formula with a hash of (prefill
 * layout, layer, K/V, global head, source token slot, byte); every byte of every decode tensor,
 * from the guard before it to the guard after it, is compared with an image built through the
 * decode layout's formula: the request's rows where the room's pages put them, the filler
 * everywhere else (other pages, the slots after the request's end, padding, the guards). A mismatch names the phase, the direction, the layout pair and the first
 * differing byte (tensor offset and what the formula says lies there). The prefill tensors are
 * checked unchanged after sending.
 *
 * Padding: in the P2 -> D1 direction the decode pools, in the P1 -> D2 direction the prefill
 * pools, have PAD bytes after every page (block) where the layout allows a page_stride set after
 * the preset (every layout but vllm-lhbnc, whose head stride spans the pages). Direct mode's
 * decode tensors have neither padding nor guards: the library shares a shared allocation with
 * the sender only when it holds nothing but the pool's buffers.
 *
 * Every pair runs four times: each chunk written from the pool's rows (send_from_pool, the
 * default); gathered into a staging buffer and written in pieces of one slab, with integrity checks
 * on; and twice with page sizes that differ across the wire (prefill pages of 4 tokens -> decode
 * pages of 1, then of 2, in the P2 -> D1 direction; 1 (2) -> 4 in the other). Page lists hold runs
 * of adjacent pages (which a plan may walk as one run of slots) and descending runs.
 *
 * Then the same-host path (transport SHM forced, every session checked to be SHM): the ring (decode
 * pools on the heap) for the pairs (a, a+3 mod 8) and direct mode (decode tensors in memory of
 * kvstage_shared_alloc: the prefill copies page to page, counted in shm_direct_chunks on both
 * sides) for the pairs (a, a+5 mod 8), each layout once on each side in each mode, both directions;
 * each mode with pages of 4 on both sides and with pages 4 <-> 1.
 *
 * KVSTAGE_TEST_TRANSPORT (rdma, tcp, shm) replaces TCP in the first phase. */
#define _POSIX_C_SOURCE 200809L

#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fork_ranks.h"

/* The model: 2 layers, 4 KV heads of 12 bf16 elements (24-byte rows: no power of two). */
enum { LAYERS = 2, HEADS = 4, HEAD_DIM = 12, DTYPE = 2, HB = HEAD_DIM * DTYPE };
/* V's head size of the running phase (head_dim_v: HEAD_DIM, or its own in the phases that say);
 * set before a phase forks its processes. */
static uint32_t g_dv = HEAD_DIM;
static uint64_t hbv(void) { return (uint64_t)g_dv * DTYPE; }
/* Bytes of a head's row of K (kv 0) or V. */
static uint64_t hb_of(uint32_t kv) { return kv ? hbv() : HB; }
/* A vLLM cell: K‖V of one (head, token). */
static uint64_t cell(void) { return HB + hbv(); }
/* The request: 18 tokens, chunks of 8 tokens (3 chunks: 8, 8, 2), in pages of 4 tokens (5 pages)
 * or, in the phases whose page sizes differ, 1 or 2 on one side (18 or 9 pages). */
enum { PAGE = 4, TOKENS = 18, CHUNK = 8, NCHUNKS = (TOKENS + CHUNK - 1) / CHUNK, MAX_PAGES = TOKENS };
/* Pools, in tokens: prefill 64, decode 128 (4 rooms of n pages, each room's pages in a region of
 * n + 1, the pages between the regions and after the last never written). */
enum { PCAP_TOKENS = 64, DCAP_TOKENS = 128, GUARD = 64, PAD = 40, NPRESETS = 8 };
enum { PREFILL_FILLER = 0xA5, DECODE_FILLER = 0x5C };
/* Every wait is bounded: a transfer by its deadline, a room by its wait, a phase's processes by
 * PHASE_MS (then they are killed); all of them g_slow times longer under valgrind. The eleven
 * phases fit in the ctest TIMEOUT. A phase takes well under a second here, 8 to 25 s over RDMA
 * in rdma_vm's emulated machine (3 times the limits there). */
enum { ADDR_LEN = 64, CONNECT_MS = 10000, TRANSFER_MS = 20000, ROOM_WAIT_MS = 25000, PHASE_MS = 30000 };
static int g_slow = 1;
enum { RING_BYTES = 256 * 1024 };

static const char *const NAMES[NPRESETS] = {"sglang",     "vllm-lbhnc", "vllm-lbnhc", "vllm-lhbnc",
                                            "vllm-blhnc", "vllm-blnhc", "vllm-bhlnc", "trtllm"};

/* ---- each engine's own index formula ------------------------------------------------------ */

/* One side's pool geometry, as the test sees it. */
typedef struct geo {
    int preset;
    uint32_t h;   /* local heads */
    uint32_t n;   /* token slots per page */
    uint32_t cap; /* pages (blocks) */
    uint32_t pad; /* bytes after every page (block) */
} geo;

static uint32_t pages_for(uint32_t tokens, uint32_t page) { return (tokens + page - 1) / page; }

/* Bytes of one page (block) including its padding, of the layouts whose block is a unit (sglang:
 * of a K buffer; sglang_v_page: of a V buffer). */
static uint64_t page_unit(const geo *g) {
    const uint64_t n = g->n, h = g->h, L = LAYERS, C = cell();
    switch (g->preset) {
    case KVSTAGE_LAYOUT_SGLANG: return n * h * HB + g->pad;
    case KVSTAGE_LAYOUT_VLLM_LBHNC: return h * n * C + g->pad;
    case KVSTAGE_LAYOUT_VLLM_LBNHC: return n * h * C + g->pad;
    case KVSTAGE_LAYOUT_VLLM_LHBNC: return n * C; /* no padding: the head stride spans the pages */
    case KVSTAGE_LAYOUT_VLLM_BLHNC: return L * h * n * C + g->pad;
    case KVSTAGE_LAYOUT_VLLM_BLNHC: return L * n * h * C + g->pad;
    case KVSTAGE_LAYOUT_VLLM_BHLNC: return h * L * n * C + g->pad;
    case KVSTAGE_LAYOUT_TRTLLM: return L * h * n * C + g->pad;
    }
    return 0;
}

static uint64_t sglang_v_page(const geo *g) { return (uint64_t)g->n * g->h * hbv() + g->pad; }

/* Byte offset, in the layout's tensor, of element 0 of local head `hd` of slot `s` of page `b` of
 * layer index `li`'s K (kv 0) or V (kv 1): the engine's own formula, its axes in its order.
 *   sglang:  K of every layer, then V of every layer; each buffer [page][token][head][dim] (V: dim_v)
 *   vLLM:    [L, B, H, N, C] stored in the named order, C = K‖V (V at +head_dim elements)
 *   TRT-LLM: [block][layer][K/V][head][token][dim] (V's half [head][token][dim_v]) */
static uint64_t ref_offset(const geo *g, uint32_t li, uint32_t kv, uint32_t b, uint32_t s, uint32_t hd) {
    const uint64_t n = g->n, h = g->h, L = LAYERS, cap = g->cap, P = page_unit(g), C = cell(), hb = hb_of(kv);
    switch (g->preset) {
    case KVSTAGE_LAYOUT_SGLANG:
        if (kv == 0) return ((uint64_t)li * cap + b) * P + (s * h + hd) * HB;
        return L * cap * P + ((uint64_t)li * cap + b) * sglang_v_page(g) + (s * h + hd) * hb;
    case KVSTAGE_LAYOUT_VLLM_LBHNC: return ((uint64_t)li * cap + b) * P + ((uint64_t)hd * n + s) * C + kv * HB;
    case KVSTAGE_LAYOUT_VLLM_LBNHC: return ((uint64_t)li * cap + b) * P + ((uint64_t)s * h + hd) * C + kv * HB;
    case KVSTAGE_LAYOUT_VLLM_LHBNC: return ((((uint64_t)li * h + hd) * cap + b) * n + s) * C + kv * HB;
    case KVSTAGE_LAYOUT_VLLM_BLHNC: return b * P + (((uint64_t)li * h + hd) * n + s) * C + kv * HB;
    case KVSTAGE_LAYOUT_VLLM_BLNHC: return b * P + (((uint64_t)li * n + s) * h + hd) * C + kv * HB;
    case KVSTAGE_LAYOUT_VLLM_BHLNC: return b * P + (((uint64_t)hd * L + li) * n + s) * C + kv * HB;
    case KVSTAGE_LAYOUT_TRTLLM: return b * P + (uint64_t)li * h * n * C + kv * h * n * HB + ((uint64_t)hd * n + s) * hb;
    }
    return 0;
}

/* Bytes of the layout's tensor. */
static uint64_t tensor_bytes(const geo *g) {
    const uint64_t n = g->n, h = g->h, L = LAYERS, cap = g->cap, P = page_unit(g);
    switch (g->preset) {
    case KVSTAGE_LAYOUT_SGLANG: return L * cap * (P + sglang_v_page(g));
    case KVSTAGE_LAYOUT_VLLM_LBHNC:
    case KVSTAGE_LAYOUT_VLLM_LBNHC: return L * cap * P;
    case KVSTAGE_LAYOUT_VLLM_LHBNC: return L * h * cap * n * cell();
    default: return cap * P;
    }
}

/* Which row of the tensor holds byte `at` (for failure messages): 1 and its coordinates, or 0. */
static int row_at(const geo *g, uint64_t at, uint32_t *li, uint32_t *kv, uint32_t *b, uint32_t *s, uint32_t *hd, uint32_t *e) {
    for (uint32_t l = 0; l < LAYERS; ++l)
        for (uint32_t k = 0; k < 2; ++k)
            for (uint32_t p = 0; p < g->cap; ++p)
                for (uint32_t t = 0; t < g->n; ++t)
                    for (uint32_t x = 0; x < g->h; ++x) {
                        uint64_t o = ref_offset(g, l, k, p, t, x);
                        if (at >= o && at < o + hb_of(k)) {
                            *li = l, *kv = k, *b = p, *s = t, *hd = x, *e = (uint32_t)(at - o);
                            return 1;
                        }
                    }
    return 0;
}

/* The reference byte: splitmix64 of the coordinates, independent of any kvstage code. */
static uint8_t pattern(uint32_t salt, uint32_t layer, uint32_t kv, uint32_t head, uint32_t slot, uint32_t byte) {
    uint64_t x = (uint64_t)salt << 56 | (uint64_t)layer << 48 | (uint64_t)kv << 44 | (uint64_t)head << 36 |
                 (uint64_t)slot << 16 | byte;
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (uint8_t)(x ^ (x >> 31));
}

/* ---- pools -------------------------------------------------------------------------------- */

typedef struct lpool {
    geo g;
    uint32_t tp_rank, tp_size;
    size_t guard;     /* bytes before and after the tensor (GUARD; 0 in shared memory) */
    size_t bytes;     /* guard + tensor + guard */
    uint8_t *memory;  /* the allocation */
    uint8_t *tensor;  /* memory + guard */
    int shared;       /* kvstage_shared_alloc */
    uint64_t k[LAYERS], v[LAYERS];
    kvstage_kv_layout layout;
} lpool;

/* A pool of layout `preset` for TP rank `tp_rank` of `tp_size`: the preset's strides (checked
 * against the formula: the layer distance it reports, V's offset), `pad` added to the page stride,
 * the bases where the formula puts layer i's K (and V), the whole allocation `filler`. */
static void pool_make(lpool *p, int preset, uint32_t tp_rank, uint32_t tp_size, uint32_t page, uint32_t cap_tokens, uint32_t pad,
                      int shared, uint8_t filler) {
    memset(p, 0, sizeof *p);
    p->g.preset = preset;
    p->g.h = HEADS / tp_size;
    p->g.n = page;
    p->g.cap = cap_tokens / page;
    p->g.pad = preset == KVSTAGE_LAYOUT_VLLM_LHBNC ? 0 : pad;
    p->tp_rank = tp_rank;
    p->tp_size = tp_size;
    REQUIRE(kvstage_kv_layout_init(&p->layout, sizeof p->layout) == KVSTAGE_OK);
    kvstage_kv_layout *l = &p->layout;
    l->model_kind = KVSTAGE_MODEL_MHA;
    l->memory_kind = KVSTAGE_MEMORY_HOST;
    l->page_size = page;
    l->global_heads = HEADS;
    l->head_dim = HEAD_DIM;
    l->head_dim_v = g_dv;
    l->dtype_bytes = DTYPE;
    l->tp_rank = tp_rank;
    l->tp_size = tp_size;
    l->num_layers = LAYERS;
    l->capacity_pages = p->g.cap;
    uint64_t layer_stride = 0;
    if (kvstage_kv_layout_preset(l, preset, &layer_stride) != KVSTAGE_OK) {
        kv_print_last_error(NAMES[preset]);
        exit(1);
    }
    /* What the preset says, against the formula (unpadded: the preset knows no padding). */
    geo plain = p->g;
    plain.pad = 0;
    uint64_t want_layer = ref_offset(&plain, 1, 0, 0, 0, 0) - ref_offset(&plain, 0, 0, 0, 0, 0);
    uint64_t want_v = preset == KVSTAGE_LAYOUT_SGLANG ? 0 : ref_offset(&plain, 0, 1, 0, 0, 0) - ref_offset(&plain, 0, 0, 0, 0, 0);
    if (layer_stride != want_layer || l->v_offset != want_v)
        KV_FAIL_AT(__FILE__, __LINE__, "%s (TP %u): layer_stride %llu, v_offset %llu; the engine's formula says %llu, %llu",
                   NAMES[preset], (unsigned)tp_size, (unsigned long long)layer_stride, (unsigned long long)l->v_offset,
                   (unsigned long long)want_layer, (unsigned long long)want_v);
    l->page_stride += p->g.pad; /* "Padded pages: set page_stride after this." */
    if (l->v_page_stride) l->v_page_stride += p->g.pad; /* V's strides of their own (head_dim_v) */

    /* A direct-mode pool's allocation holds nothing but its buffers (the library shares all of it
     * with the sender or nothing): no guards there. */
    p->guard = shared ? 0 : GUARD;
    p->bytes = (size_t)tensor_bytes(&p->g) + 2 * p->guard;
    if (shared) {
        void *m = NULL;
        if (kvstage_shared_alloc(p->bytes, &m) != KVSTAGE_OK) {
            kv_print_last_error("kvstage_shared_alloc");
            exit(1);
        }
        p->memory = (uint8_t *)m;
    } else {
        p->memory = (uint8_t *)malloc(p->bytes);
        REQUIRE(p->memory != NULL);
    }
    p->shared = shared;
    memset(p->memory, filler, p->bytes);
    p->tensor = p->memory + p->guard;
    for (uint32_t li = 0; li < LAYERS; ++li) {
        p->k[li] = (uint64_t)(uintptr_t)(p->tensor + ref_offset(&p->g, li, 0, 0, 0, 0));
        p->v[li] = (uint64_t)(uintptr_t)(p->tensor + ref_offset(&p->g, li, 1, 0, 0, 0));
        if (preset != KVSTAGE_LAYOUT_SGLANG && p->v[li] - p->k[li] != l->v_offset)
            KV_FAIL_AT(__FILE__, __LINE__, "%s: V of layer %u lies %llu bytes after K by the formula, v_offset %llu", NAMES[preset],
                       (unsigned)li, (unsigned long long)(p->v[li] - p->k[li]), (unsigned long long)l->v_offset);
    }
    l->k_bases = p->k;
    l->v_bases = preset == KVSTAGE_LAYOUT_SGLANG ? p->v : NULL; /* the others: v_offset after K */
    if (kvstage_kv_layout_validate(l) != KVSTAGE_OK) {
        fprintf(stderr, "%s (TP %u, page %u, pad %u): ", NAMES[preset], (unsigned)tp_size, (unsigned)page, (unsigned)p->g.pad);
        kv_print_last_error("kvstage_kv_layout_validate");
        exit(1);
    }
}

static void pool_free(lpool *p) {
    if (p->shared)
        CHECK_OK(kvstage_shared_free(p->memory));
    else
        free(p->memory);
    p->memory = NULL;
}

/* Paints every row of a prefill pool: pattern(prefill layout, layer, K/V, global head, slot). */
static void paint_prefill(lpool *p) {
    uint32_t first = p->tp_rank * p->g.h;
    for (uint32_t li = 0; li < LAYERS; ++li)
        for (uint32_t kv = 0; kv < 2; ++kv)
            for (uint32_t b = 0; b < p->g.cap; ++b)
                for (uint32_t s = 0; s < p->g.n; ++s)
                    for (uint32_t hd = 0; hd < p->g.h; ++hd) {
                        uint8_t *row = p->tensor + ref_offset(&p->g, li, kv, b, s, hd);
                        for (uint32_t e = 0; e < hb_of(kv); ++e)
                            row[e] = pattern((uint32_t)p->g.preset, li, kv, first + hd, b * p->g.n + s, e);
                    }
}

/* ---- phases, pairs, pages ----------------------------------------------------------------- */

/* Direction 0: prefill TP 2 -> decode TP 1; direction 1: prefill TP 1 -> decode TP 2. */
static uint32_t prefill_tp(int dir) { return dir == 0 ? 2 : 1; }
static uint32_t decode_tp(int dir) { return dir == 0 ? 1 : 2; }

typedef struct phase {
    const char *name;
    int32_t transport;
    int same_host; /* transport SHM: every session checked to be SHM */
    int direct;    /* decode tensors in kvstage_shared_alloc memory: direct mode */
    int kind;      /* which pairs: 0 every pair, 1 (a, a+3), 2 (a, a+5) */
    int staged;    /* every chunk gathered into a staging buffer, sent in pieces of one slab, checksummed */
    uint32_t small_page; /* 0: pages of 4 on both sides; else prefill 4 -> decode this (direction 0), this -> 4 (1) */
    uint32_t head_dim_v; /* 0: V's heads are K's size; else V's head_dim_v */
} phase;

/* The direction of pair (a, b) in `ph`, or -1 when the phase does not run it. */
static int pair_dir(const phase *ph, int a, int b) {
    switch (ph->kind) {
    case 0: return (a + b) % 2;
    case 1: return b == (a + 3) % NPRESETS ? a % 2 : -1;
    default: return b == (a + 5) % NPRESETS ? (a + 1) % 2 : -1;
    }
}

/* Page sizes: 4 tokens, or where the phase's differ, 4 -> small in direction 0, small -> 4 in 1. */
static uint32_t prefill_page(const phase *ph, int dir) { return ph->small_page && dir == 1 ? ph->small_page : PAGE; }
static uint32_t decode_page(const phase *ph, int dir) { return ph->small_page && dir == 0 ? ph->small_page : PAGE; }

/* Padding: decode pools in direction 0, prefill pools in direction 1. */
static uint32_t decode_pad(int dir) { return dir == 0 ? PAD : 0; }
static uint32_t prefill_pad(int dir) { return dir == 1 ? PAD : 0; }

/* Prefill pages (of `page` tokens) of pair (a, b): runs of three adjacent pages two pages apart
 * (k + 2·(k / 3)), from 5·(8a + b) on, mod the capacity (the run spans less than it: distinct).
 * Adjacent pages are what a plan may merge into one run of slots. */
static void src_pages(int a, int b, uint32_t page, uint32_t *pages) {
    const uint32_t cap = PCAP_TOKENS / page;
    for (uint32_t k = 0; k < pages_for(TOKENS, page); ++k) pages[k] = (uint32_t)((5 * (NPRESETS * a + b) + k + 2 * (k / 3)) % cap);
}

/* The room index of prefill layout `a` in decode engine `b` (its rank among the phase's pairs into
 * b of that direction). With n pages a room, room j's pages lie in [1 + j·(n + 1), (j + 1)·(n + 1)):
 * its first ceil(n/2) pages ascending and adjacent, the rest descending (never merged). */
static uint32_t room_slot(const phase *ph, int dir, int a, int b) {
    uint32_t j = 0;
    for (int x = 0; x < a; ++x) j += pair_dir(ph, x, b) == dir;
    return j;
}
static void dst_pages(uint32_t j, uint32_t page, uint32_t *pages) {
    const uint32_t n = pages_for(TOKENS, page), up = (n + 1) / 2;
    REQUIRE(4 * (n + 1) + 1 <= DCAP_TOKENS / page);
    for (uint32_t k = 0; k < n; ++k) pages[k] = 1 + j * (n + 1) + (k < up ? k : n - 1 - (k - up));
}

static uint64_t room_id(int a) { return (uint64_t)a + 1; }

/* What a decode rank tells the prefill processes: each layout engine's address and room keys. */
typedef struct bootstrap {
    char addr[NPRESETS][ADDR_LEN];
    uint64_t key[NPRESETS][NPRESETS]; /* [decode layout b][prefill layout a] */
} bootstrap;

static kvstage_engine *new_engine(const phase *ph, const lpool *p, size_t ring_bytes) {
    kvstage_engine_options o;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = ph->transport;
    o.worker_threads = 2;
    if (ph->staged) {
        o.send_from_pool = 0;
        o.send_piece_bytes = 1; /* pieces of one slab */
        o.integrity = KVSTAGE_INTEGRITY_ALWAYS;
    }
    if (kvstage_engine_new(&o, &e) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_engine_new");
        exit(1);
    }
    if (kvstage_pool_register(e, &p->layout) != KVSTAGE_OK) {
        fprintf(stderr, "%s: ", NAMES[p->g.preset]);
        kv_print_last_error("kvstage_pool_register");
        exit(1);
    }
    if (ring_bytes && kv_staging_register(e, NULL, ring_bytes) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_staging_register");
        exit(1);
    }
    return e;
}

static kvstage_engine_stats engine_stats(const kvstage_engine *e) {
    kvstage_engine_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvstage_engine_stats_get(e, &st));
    return st;
}

/* Reads `len` bytes by `deadline`: 1, or 0 with a failure recorded. */
static int read_exactly(int fd, void *buf, size_t len, double deadline, const char *what) {
    size_t got = 0;
    while (got < len) {
        struct pollfd pfd = {fd, POLLIN, 0};
        int left = (int)(deadline - now_ms());
        if (left <= 0 || poll(&pfd, 1, left) != 1) {
            KV_FAIL_AT(__FILE__, __LINE__, "%s: nothing in time", what);
            return 0;
        }
        ssize_t n = read(fd, (char *)buf + got, len - got);
        if (n <= 0) {
            KV_FAIL_AT(__FILE__, __LINE__, "%s sent no bootstrap (exited early: see its errors above)", what);
            return 0;
        }
        got += (size_t)n;
    }
    return 1;
}

/* ---- the decode side ---------------------------------------------------------------------- */

/* Compares decode pool `p` (layout b, rank `rank` of direction `dir`) byte for byte with the image
 * the formula gives: the rooms of the phase's pairs into it, the filler elsewhere. */
static void verify_decode(const phase *ph, int dir, uint32_t rank, const lpool *p) {
    const int b = p->g.preset;
    uint8_t *want = (uint8_t *)malloc(p->bytes);
    int8_t *page_room = (int8_t *)malloc(p->g.cap); /* prefill layout a whose room holds the page, or -1 */
    REQUIRE(want != NULL && page_room != NULL);
    memset(want, DECODE_FILLER, p->bytes);
    memset(page_room, -1, p->g.cap);
    uint8_t *tensor = want + p->guard;
    for (int a = 0; a < NPRESETS; ++a) {
        if (pair_dir(ph, a, b) != dir) continue;
        const uint32_t np = prefill_page(ph, dir), nd = p->g.n;
        uint32_t sp[MAX_PAGES], dp[MAX_PAGES];
        src_pages(a, b, np, sp);
        dst_pages(room_slot(ph, dir, a, b), nd, dp);
        for (uint32_t k = 0; k < pages_for(TOKENS, nd); ++k) page_room[dp[k]] = (int8_t)a;
        for (uint32_t t = 0; t < TOKENS; ++t)
            for (uint32_t li = 0; li < LAYERS; ++li)
                for (uint32_t kv = 0; kv < 2; ++kv)
                    for (uint32_t hd = 0; hd < p->g.h; ++hd) {
                        uint8_t *row = tensor + ref_offset(&p->g, li, kv, dp[t / nd], t % nd, hd);
                        for (uint32_t e = 0; e < hb_of(kv); ++e)
                            row[e] = pattern((uint32_t)a, li, kv, rank * p->g.h + hd, sp[t / np] * np + t % np, e);
                    }
    }
    /* Mismatches per room (prefill layout a), plus the bytes of no room (guards, padding, pages of
     * no room): each reported with its first byte. `owner`: the room of each byte's row. */
    int8_t *owner = (int8_t *)malloc(p->bytes);
    REQUIRE(owner != NULL);
    memset(owner, NPRESETS, p->bytes);
    for (uint32_t li = 0; li < LAYERS; ++li)
        for (uint32_t kv = 0; kv < 2; ++kv)
            for (uint32_t pg = 0; pg < p->g.cap; ++pg)
                for (uint32_t s = 0; page_room[pg] >= 0 && s < p->g.n; ++s)
                    for (uint32_t hd = 0; hd < p->g.h; ++hd)
                        memset(owner + p->guard + ref_offset(&p->g, li, kv, pg, s, hd), page_room[pg], hb_of(kv));
    size_t bad[NPRESETS + 1] = {0}, first[NPRESETS + 1] = {0};
    for (size_t i = 0; i < p->bytes; ++i) {
        if (p->memory[i] == want[i]) continue;
        if (bad[owner[i]]++ == 0) first[owner[i]] = i;
    }
    free(owner);
    for (int w = 0; w <= NPRESETS; ++w) {
        if (!bad[w]) continue;
        size_t i = first[w];
        char where[256];
        uint32_t li, kv, pg, s, hd, e;
        if (i < p->guard || i >= p->bytes - p->guard)
            snprintf(where, sizeof where, "the guard %s the tensor", i < p->guard ? "before" : "after");
        else if (!row_at(&p->g, i - p->guard, &li, &kv, &pg, &s, &hd, &e))
            snprintf(where, sizeof where, "tensor byte %zu: padding (in no row)", i - p->guard);
        else {
            int room = page_room[pg];
            uint32_t token = 0;
            if (room >= 0) {
                uint32_t dp[MAX_PAGES];
                dst_pages(room_slot(ph, dir, room, b), p->g.n, dp);
                for (uint32_t k = 0; k < pages_for(TOKENS, p->g.n); ++k)
                    if (dp[k] == pg) token = k * p->g.n + s;
            }
            char tok[64];
            if (room < 0)
                snprintf(tok, sizeof tok, "a page of no room");
            else if (token >= TOKENS)
                snprintf(tok, sizeof tok, "slot %u past the request's end", (unsigned)token);
            else
                snprintf(tok, sizeof tok, "request token %u", (unsigned)token);
            snprintf(where, sizeof where, "tensor byte %zu: layer %u %c page %u slot %u local head %u (global %u) byte %u, %s",
                     i - p->guard, (unsigned)li, "KV"[kv], (unsigned)pg, (unsigned)s, (unsigned)hd, (unsigned)(rank * p->g.h + hd),
                     (unsigned)e, tok);
        }
        if (w < NPRESETS)
            KV_FAIL_AT(__FILE__, __LINE__,
                       "[%s, P%u->D%u] prefill %s -> decode %s (decode rank %u, pad %u): %zu byte(s) differ; first at %s: "
                       "0x%02x, expected 0x%02x",
                       ph->name, (unsigned)prefill_tp(dir), (unsigned)decode_tp(dir), NAMES[w], NAMES[b], (unsigned)rank,
                       (unsigned)p->g.pad, bad[w], where, p->memory[i], want[i]);
        else
            KV_FAIL_AT(__FILE__, __LINE__,
                       "[%s, P%u->D%u] decode %s (decode rank %u, pad %u): %zu byte(s) outside every room's rows changed; "
                       "first at %s: 0x%02x, expected 0x%02x",
                       ph->name, (unsigned)prefill_tp(dir), (unsigned)decode_tp(dir), NAMES[b], (unsigned)rank,
                       (unsigned)p->g.pad, bad[w], where, p->memory[i], want[i]);
    }
    free(page_room);
    free(want);
}

static int decode_main(const phase *ph, int dir, uint32_t rank, int addr_fd, int done_fd) {
    static lpool pools[NPRESETS];
    kvstage_engine *engines[NPRESETS] = {0};
    bootstrap boot;
    memset(&boot, 0, sizeof boot);
    for (int b = 0; b < NPRESETS; ++b) {
        uint32_t rooms = 0;
        for (int a = 0; a < NPRESETS; ++a) rooms += pair_dir(ph, a, b) == dir;
        if (!rooms) continue;
        pool_make(&pools[b], b, rank, decode_tp(dir), decode_page(ph, dir), DCAP_TOKENS, ph->direct ? 0 : decode_pad(dir), ph->direct,
                  DECODE_FILLER);
        engines[b] = new_engine(ph, &pools[b], RING_BYTES);
        REQUIRE(kvstage_engine_listen_address(engines[b], boot.addr[b], ADDR_LEN, NULL) == KVSTAGE_OK);
        for (int a = 0; a < NPRESETS; ++a) {
            if (pair_dir(ph, a, b) != dir) continue;
            const uint32_t nd = decode_page(ph, dir);
            uint32_t dp[MAX_PAGES], chunks = 0;
            dst_pages(room_slot(ph, dir, a, b), nd, dp);
            if (kv_room_open(engines[b], room_id(a), dp, pages_for(TOKENS, nd), CHUNK, NULL, &chunks, &boot.key[b][a]) != KVSTAGE_OK) {
                kv_print_last_error("kv_room_open");
                exit(1);
            }
            CHECK_INT(chunks, NCHUNKS);
        }
    }
    REQUIRE(write(addr_fd, &boot, sizeof boot) == (ssize_t)sizeof boot);
    close(addr_fd);

    for (int b = 0; b < NPRESETS; ++b)
        for (int a = 0; engines[b] && a < NPRESETS; ++a) {
            if (pair_dir(ph, a, b) != dir) continue;
            if (kvstage_room_wait(engines[b], room_id(a), boot.key[b][a], (uint64_t)g_slow * ROOM_WAIT_MS) != KVSTAGE_OK) {
                KV_FAIL_AT(__FILE__, __LINE__, "[%s, P%u->D%u] prefill %s -> decode %s (rank %u): the room did not complete",
                           ph->name, (unsigned)prefill_tp(dir), (unsigned)decode_tp(dir), NAMES[a], NAMES[b], (unsigned)rank);
                kv_print_last_error("kvstage_room_wait");
            }
        }
    /* Every prefill process has exited (late traffic is in) once the done pipe closes. */
    struct pollfd done = {done_fd, POLLIN, 0};
    char c;
    CHECK(poll(&done, 1, g_slow * PHASE_MS) == 1 && read(done_fd, &c, 1) == 0);

    for (int b = 0; b < NPRESETS; ++b) {
        if (!engines[b]) continue;
        uint64_t rooms = 0, writers = prefill_tp(dir); /* each decode rank hears every prefill rank */
        for (int a = 0; a < NPRESETS; ++a) rooms += pair_dir(ph, a, b) == dir;
        verify_decode(ph, dir, rank, &pools[b]);
        kvstage_engine_stats st = engine_stats(engines[b]);
        CHECK_INT(st.chunks_received, rooms * NCHUNKS);
        CHECK_INT(st.bytes_received, rooms * TOKENS * LAYERS * pools[b].g.h * cell());
        CHECK_INT(st.ring_live_allocations, 0);
        if (ph->same_host) {
            CHECK_INT(st.shm_sessions, rooms * writers);
            CHECK_INT(st.shm_direct_sessions, ph->direct ? rooms * writers : 0);
            CHECK_INT(st.shm_direct_chunks, ph->direct ? rooms * writers * NCHUNKS : 0);
        }
        for (int a = 0; a < NPRESETS; ++a)
            if (pair_dir(ph, a, b) == dir) CHECK_OK(kvstage_room_release(engines[b], room_id(a), boot.key[b][a]));
        if (pools[b].shared) {
            size_t still = 99;
            CHECK_OK(kvstage_engine_shutdown(engines[b], (uint64_t)g_slow * ROOM_WAIT_MS, &still));
            CHECK_INT(still, 0);
        }
        kvstage_engine_free(engines[b]);
        pool_free(&pools[b]);
    }
    char name[96];
    snprintf(name, sizeof name, "layouts [%s] P%u->D%u decode rank %u", ph->name, (unsigned)prefill_tp(dir),
             (unsigned)decode_tp(dir), (unsigned)rank);
    return kv_finish(name);
}

/* ---- the prefill side --------------------------------------------------------------------- */

/* Prefill rank `rank` of direction `dir`: for each of the phase's pairs (a, b) of that direction,
 * a session from its engine of layout a to each decode rank's engine of layout b, the request's
 * three chunks on each. */
static int prefill_main(const phase *ph, int dir, uint32_t rank, const bootstrap *boots) {
    static lpool pools[NPRESETS];
    kvstage_engine *engines[NPRESETS] = {0};
    uint8_t *before[NPRESETS] = {0};
    for (int a = 0; a < NPRESETS; ++a) {
        int used = 0;
        for (int b = 0; b < NPRESETS; ++b) used |= pair_dir(ph, a, b) == dir;
        if (!used) continue;
        pool_make(&pools[a], a, rank, prefill_tp(dir), prefill_page(ph, dir), PCAP_TOKENS, prefill_pad(dir), 0, PREFILL_FILLER);
        paint_prefill(&pools[a]);
        before[a] = (uint8_t *)malloc(pools[a].bytes);
        REQUIRE(before[a] != NULL);
        memcpy(before[a], pools[a].memory, pools[a].bytes);
        engines[a] = new_engine(ph, &pools[a], 0);
    }
    uint64_t sessions[NPRESETS] = {0};
    for (int a = 0; a < NPRESETS; ++a)
        for (int b = 0; engines[a] && b < NPRESETS; ++b) {
            if (pair_dir(ph, a, b) != dir) continue;
            const uint32_t np = prefill_page(ph, dir);
            uint32_t sp[MAX_PAGES];
            src_pages(a, b, np, sp);
            for (uint32_t d = 0; d < decode_tp(dir); ++d) {
                char id[64];
                snprintf(id, sizeof id, "%s-%s-p%u-d%u", NAMES[a], NAMES[b], (unsigned)rank, (unsigned)d);
                kvstage_session *s = NULL;
                if (kvstage_session_connect(engines[a], boots[d].addr[b], id, g_slow * CONNECT_MS, &s) != KVSTAGE_OK) {
                    KV_FAIL_AT(__FILE__, __LINE__, "[%s] session %s to %s", ph->name, id, boots[d].addr[b]);
                    kv_print_last_error("kvstage_session_connect");
                    continue;
                }
                ++sessions[a];
                for (uint32_t c = 0; c < NCHUNKS; ++c) {
                    kvstage_transfer_desc desc;
                    REQUIRE(kvstage_transfer_desc_init(&desc, sizeof desc) == KVSTAGE_OK);
                    desc.room = room_id(a);
                    desc.room_key = boots[d].key[b][a];
                    desc.chunk_index = c;
                    desc.src_pages = sp + c * (CHUNK / np); /* chunks start on prefill pages */
                    desc.num_tokens = c + 1 < NCHUNKS ? CHUNK : TOKENS - c * CHUNK;
                    desc.num_pages = pages_for(desc.num_tokens, np);
                    desc.timeout_ms = (uint64_t)g_slow * TRANSFER_MS;
                    if (kvstage_transfer(s, &desc) != KVSTAGE_OK) {
                        KV_FAIL_AT(__FILE__, __LINE__, "[%s] %s: chunk %u", ph->name, id, (unsigned)c);
                        kv_print_last_error("kvstage_transfer");
                        break;
                    }
                }
                kvstage_session_stats st;
                memset(&st, 0, sizeof st);
                st.struct_size = sizeof st;
                CHECK_OK(kvstage_session_stats_get(s, &st));
                if (st.transport != ph->transport)
                    KV_FAIL_AT(__FILE__, __LINE__, "[%s] session %s: transport %s, expected %s", ph->name, id,
                               kv_transport_name(st.transport), kv_transport_name(ph->transport));
                /* Each decode rank gets 2 of the 4 heads from each prefill rank it hears. */
                CHECK_INT(st.bytes_sent, (uint64_t)TOKENS * LAYERS * (HEADS / 2) * cell());
                kvstage_session_free(s);
            }
        }
    for (int a = 0; a < NPRESETS; ++a) {
        if (!engines[a]) continue;
        if (ph->same_host) {
            kvstage_engine_stats st = engine_stats(engines[a]);
            CHECK_INT(st.shm_sessions, sessions[a]);
            CHECK_INT(st.shm_direct_chunks, ph->direct ? sessions[a] * NCHUNKS : 0);
        }
        kvstage_engine_free(engines[a]);
        if (memcmp(before[a], pools[a].memory, pools[a].bytes) != 0) {
            size_t i = 0;
            while (before[a][i] == pools[a].memory[i]) ++i;
            KV_FAIL_AT(__FILE__, __LINE__, "[%s] prefill %s (rank %u): its own pool changed; first at allocation byte %zu", ph->name,
                       NAMES[a], (unsigned)rank, i);
        }
        free(before[a]);
        pool_free(&pools[a]);
    }
    char name[96];
    snprintf(name, sizeof name, "layouts [%s] P%u->D%u prefill rank %u", ph->name, (unsigned)prefill_tp(dir),
             (unsigned)decode_tp(dir), (unsigned)rank);
    return kv_finish(name);
}

/* ---- one phase: both directions at once ---------------------------------------------------- */

static void run_phase(const phase *ph) {
    double deadline = now_ms() + g_slow * PHASE_MS;
    child decode[4], prefill[4];
    bootstrap boots[2][2];
    int done[2], nd = 0, np = 0, ready = 1;
    REQUIRE(pipe(done) == 0);
    for (int dir = 0; dir < 2; ++dir)
        for (uint32_t r = 0; ready && r < decode_tp(dir); ++r, ++nd) {
            int addr[2];
            REQUIRE(pipe(addr) == 0);
            fflush(NULL); /* or the children would print the parent's buffered output again */
            decode[nd].pid = fork();
            REQUIRE(decode[nd].pid >= 0);
            if (decode[nd].pid == 0) {
                *kv_failures() = 0;
                close(done[1]);
                close(addr[0]);
                exit(decode_main(ph, dir, r, addr[1], done[0]));
            }
            snprintf(decode[nd].name, sizeof decode[nd].name, "P%u->D%u decode rank %u", (unsigned)prefill_tp(dir),
                     (unsigned)decode_tp(dir), (unsigned)r);
            close(addr[1]);
            ready = read_exactly(addr[0], &boots[dir][r], sizeof boots[dir][r], deadline, decode[nd].name);
            close(addr[0]);
        }
    close(done[0]);
    for (int dir = 0; ready && dir < 2; ++dir)
        for (uint32_t r = 0; r < prefill_tp(dir); ++r, ++np) {
            fflush(NULL);
            prefill[np].pid = fork();
            REQUIRE(prefill[np].pid >= 0);
            if (prefill[np].pid == 0) {
                *kv_failures() = 0;
                close(done[1]);
                exit(prefill_main(ph, dir, r, boots[dir]));
            }
            snprintf(prefill[np].name, sizeof prefill[np].name, "P%u->D%u prefill rank %u", (unsigned)prefill_tp(dir),
                     (unsigned)decode_tp(dir), (unsigned)r);
        }
    if (!ready) /* a decode process failed before its bootstrap: the others would only wait */
        for (int i = 0; i < nd; ++i) kill(decode[i].pid, SIGKILL);
    reap(ph->name, prefill, np, deadline, g_slow * PHASE_MS);
    close(done[1]);
    reap(ph->name, decode, nd, deadline, g_slow * PHASE_MS);
}

int main(void) {
    static char err_buf[8192];
    signal(SIGPIPE, SIG_IGN);
    if (getenv("KVSTAGE_UNDER_VALGRIND") != NULL) g_slow = 10; /* ctest's TIMEOUT grows by as much */
    /* Line-buffered: each failure line leaves a process in one write, not interleaved with the
     * other ranks' lines. */
    setvbuf(stderr, err_buf, _IOLBF, sizeof err_buf);
    int32_t net = kv_test_transport(KVSTAGE_TRANSPORT_TCP);
    /* Soft-RoCE in rdma_vm's emulated machine: a phase takes 8 to 25 s there (a busy host), 30 s
     * is no margin; the VM's own per-test timeout still bounds the run. */
    if (net == KVSTAGE_TRANSPORT_RDMA && g_slow < 3) g_slow = 3;
    const phase phases[] = {
        {"every pair", net, net == KVSTAGE_TRANSPORT_SHM, 0, 0, 0, 0, 0},
        {"every pair, staged pieces", net, net == KVSTAGE_TRANSPORT_SHM, 0, 0, 1, 0, 0},
        {"every pair, pages 4 <-> 1", net, net == KVSTAGE_TRANSPORT_SHM, 0, 0, 0, 1, 0},
        {"every pair, pages 4 <-> 2", net, net == KVSTAGE_TRANSPORT_SHM, 0, 0, 0, 2, 0},
        {"same host, ring", KVSTAGE_TRANSPORT_SHM, 1, 0, 1, 0, 0, 0},
        {"same host, ring, pages 4 <-> 1", KVSTAGE_TRANSPORT_SHM, 1, 0, 1, 0, 1, 0},
        {"same host, direct", KVSTAGE_TRANSPORT_SHM, 1, 1, 2, 0, 0, 0},
        {"same host, direct, pages 4 <-> 1", KVSTAGE_TRANSPORT_SHM, 1, 1, 2, 0, 1, 0},
        /* V heads of 8 elements (16-byte rows) under K heads of 12: sglang's V tensors of their own,
         * vLLM's cells of 12 + 8, TensorRT-LLM's block halves [H][N][12] then [H][N][8]. */
        {"every pair, head_dim_v 8", net, net == KVSTAGE_TRANSPORT_SHM, 0, 0, 0, 0, 8},
        {"every pair, head_dim_v 8, staged pieces, pages 4 <-> 2", net, net == KVSTAGE_TRANSPORT_SHM, 0, 0, 1, 2, 8},
        {"same host, direct, head_dim_v 8", KVSTAGE_TRANSPORT_SHM, 1, 1, 2, 0, 0, 8},
    };
    printf("layouts: %s for every pair (from the pool's rows; gathered into staging and sent in pieces with checksums; "
           "pages 4 <-> 1 and 4 <-> 2), then the same-host ring and direct mode (pages 4, and 4 <-> 1), then V heads of their own size\n",
           kv_transport_name(net));
    fflush(stdout);
    for (size_t i = 0; i < sizeof phases / sizeof phases[0]; ++i) {
        int before = *kv_failures(), pairs = 0;
        double t0 = now_ms();
        for (int a = 0; a < NPRESETS; ++a)
            for (int b = 0; b < NPRESETS; ++b) pairs += pair_dir(&phases[i], a, b) >= 0;
        g_dv = phases[i].head_dim_v ? phases[i].head_dim_v : HEAD_DIM;
        run_phase(&phases[i]);
        printf("layouts [%s]: %d pairs (transport %s) %s in %.0f ms\n", phases[i].name, pairs,
               kv_transport_name(phases[i].transport), *kv_failures() == before ? "ok" : "FAILED", now_ms() - t0);
        fflush(stdout);
    }
    return kv_finish("layouts");
}
