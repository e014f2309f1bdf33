/* Whole requests with every buffer in CUDA device memory: device KV pools, and device components
 * (an aux buffer, a conv-like state of three groups sharded by TP, a head-sliced window pool),
 * from prefill TP 2 to decode TP 1 over TCP, both sides in this process. The prefill components
 * are filled (host to device) with a hash of each element's global coordinates; the decode
 * components are read back and compared byte for byte, the rest of each buffer untouched (0).
 * Runs on the fake driver in CI (ctest cuda_fake_parts) and on a GPU runner (gpu_parts). */
#define _POSIX_C_SOURCE 200809L

#include "gpu_common.h"

enum { AUX_ROW = 64, ITEMS = 4, WPAGE = 4, WUNIT = 16, WINDOW = 6, NCOMP = 3, TOKENS = NPAGES * PAGE };
static const uint32_t GROUPS[3] = {8, 8, 16};
static const uint32_t STATE_LAYERS[2] = {0, 2}, WINDOW_LAYERS[1] = {1};
static const uint32_t SRC_PAGES[NPAGES] = {3, 0, 7, 5}, DST_PAGES[NPAGES] = {2, 6, 1, 4};
static const uint32_t SRC_WINDOW[2] = {1, 3}, DST_WINDOW[2] = {2, 0};
static const uint64_t SRC_SLOT = 3, DST_SLOT = 1, SRC_ROW = 0, DST_ROW = 2;
enum { OUTER = 2, SDT = 2 };

static uint8_t pattern(uint32_t c, uint32_t layer, uint32_t a, uint32_t b, uint32_t byte) {
    uint64_t x = ((uint64_t)c << 56 | (uint64_t)layer << 48 | (uint64_t)a << 32 | (uint64_t)b << 16 | byte) + 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (uint8_t)(x ^ (x >> 31)) | 1;
}

/* One rank's components: host mirrors of what each device buffer should hold, and the buffers. */
typedef struct parts {
    uint32_t rank, tp, heads, row_elems;
    size_t bytes[NCOMP], item[NCOMP];
    uint8_t *want[NCOMP][2];
    unsigned long long dev[NCOMP][2];
    uint64_t bases[NCOMP][2];
} parts;

static uint32_t layers_of(int c) { return c == 0 ? 1 : c == 1 ? 2 : 1; }

static void parts_init(parts *p, uint32_t rank, uint32_t tp) {
    memset(p, 0, sizeof *p);
    p->rank = rank, p->tp = tp, p->heads = HEADS / tp;
    for (int g = 0; g < 3; ++g) p->row_elems += GROUPS[g] / tp;
    p->item[0] = AUX_ROW, p->item[1] = (size_t)OUTER * p->row_elems * SDT, p->item[2] = (size_t)p->heads * WUNIT;
    p->bytes[0] = ITEMS * p->item[0], p->bytes[1] = ITEMS * p->item[1], p->bytes[2] = (size_t)ITEMS * WPAGE * p->item[2];
    for (int c = 0; c < NCOMP; ++c)
        for (uint32_t l = 0; l < layers_of(c); ++l) {
            p->want[c][l] = (uint8_t *)calloc(1, p->bytes[c]);
            REQUIRE(p->want[c][l] != NULL && cu.alloc(&p->dev[c][l], p->bytes[c]) == 0);
            REQUIRE(cu.htod(p->dev[c][l], p->want[c][l], p->bytes[c]) == 0); /* zeroed */
            p->bases[c][l] = p->dev[c][l];
        }
}

/* The reference of the request's items as this rank names them (row, slot, window pages). */
static void parts_paint(parts *p, uint64_t row, uint64_t slot, const uint32_t *wpages, uint32_t wfirst) {
    for (uint32_t b = 0; b < AUX_ROW; ++b) p->want[0][0][row * AUX_ROW + b] = pattern(0, 0, 0, 0, b);
    for (uint32_t l = 0; l < 2; ++l)
        for (uint32_t o = 0; o < OUTER; ++o)
            for (uint32_t i = 0, local = 0, global = 0, g = 0; g < 3; local += GROUPS[g] / p->tp, global += GROUPS[g], ++g)
                for (i = 0; i < GROUPS[g] / p->tp; ++i)
                    for (uint32_t b = 0; b < SDT; ++b)
                        p->want[1][l][slot * p->item[1] + ((size_t)o * p->row_elems + local + i) * SDT + b] =
                            pattern(1, STATE_LAYERS[l], o, global + p->rank * (GROUPS[g] / p->tp) + i, b);
    for (uint32_t j = 0; j < WINDOW; ++j) {
        uint32_t t = wfirst + j;
        size_t s = (size_t)wpages[t / WPAGE] * WPAGE + t % WPAGE;
        for (uint32_t h = 0; h < p->heads; ++h)
            for (uint32_t b = 0; b < WUNIT; ++b)
                p->want[2][0][s * p->item[2] + h * WUNIT + b] = pattern(2, WINDOW_LAYERS[0], p->rank * p->heads + h, j, b);
    }
}

static void parts_upload(parts *p) {
    for (int c = 0; c < NCOMP; ++c)
        for (uint32_t l = 0; l < layers_of(c); ++l) REQUIRE(cu.htod(p->dev[c][l], p->want[c][l], p->bytes[c]) == 0);
}

static void parts_register(kvstage_engine *e, parts *p) {
    kvstage_component c[NCOMP];
    kvstage_state_item item;
    REQUIRE(kvstage_state_item_init(&item, sizeof item) == KVSTAGE_OK);
    item.outer = OUTER, item.dtype_bytes = SDT, item.group_dims = GROUPS, item.num_groups = 3;
    for (int i = 0; i < NCOMP; ++i) {
        REQUIRE(kvstage_component_init(&c[i], sizeof c[i]) == KVSTAGE_OK);
        c[i].num_items = ITEMS, c[i].bases = p->bases[i], c[i].num_bases = layers_of(i);
    }
    c[0].name = "output_ids", c[0].kind = KVSTAGE_COMPONENT_AUX, c[0].item_bytes = AUX_ROW;
    c[1].name = "conv", c[1].kind = KVSTAGE_COMPONENT_STATE, c[1].state = &item, c[1].layer_ids = STATE_LAYERS, c[1].num_layers = 2;
    c[2].name = "swa", c[2].kind = KVSTAGE_COMPONENT_POOL, c[2].item_bytes = WUNIT, c[2].page_size = WPAGE, c[2].head_sliced = 1;
    c[2].layer_ids = WINDOW_LAYERS, c[2].num_layers = 1;
    if (kvstage_pool_register_components(e, c, NCOMP) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_pool_register_components");
        REQUIRE(0);
    }
}

static kvstage_request_parts request(uint64_t row, const uint64_t *slot, const uint32_t *wpages, uint32_t wfirst, kvstage_pool_span *span) {
    kvstage_request_parts r;
    REQUIRE(kvstage_request_parts_init(&r, sizeof r) == KVSTAGE_OK);
    r.aux_row = row, r.state_slots = slot, r.num_state_slots = 1;
    span->pages = wpages, span->num_pages = 2, span->first_token = wfirst, span->num_tokens = WINDOW;
    r.pool_spans = span, r.num_pool_spans = 1;
    return r;
}

static kvstage_engine *engine_tcp(void) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_TCP;
    kvstage_engine *e = NULL;
    REQUIRE(kvstage_engine_new(&o, &e) == KVSTAGE_OK);
    return e;
}

int main(void) {
    void *lib = NULL;
    int started = start_cuda(&lib);
    if (started != 0) return started;
    find_fake_counters(lib);

    pool dpool;
    pool_init(&dpool, 0, 1, 1);
    parts dparts;
    parts_init(&dparts, 0, 1);
    kvstage_engine *decode = engine_tcp();
    REQUIRE(kvstage_pool_register(decode, &dpool.layout) == KVSTAGE_OK);
    parts_register(decode, &dparts);
    REQUIRE(kv_staging_register(decode, NULL, 1 << 20) == KVSTAGE_OK);
    kvstage_pool_span dspan;
    uint64_t dslot = DST_SLOT;
    kvstage_request_parts dreq = request(DST_ROW, &dslot, DST_WINDOW, 0, &dspan);
    uint32_t chunks = 0;
    uint64_t key = 0;
    REQUIRE(kv_room_open(decode, ROOM, DST_PAGES, NPAGES, CHUNK, &dreq, &chunks, &key) == KVSTAGE_OK);
    CHECK_INT(chunks, TOKENS / CHUNK);
    char addr[64];
    REQUIRE(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL) == KVSTAGE_OK);

    pool ppool[2];
    parts pparts[2];
    kvstage_engine *prefill[2];
    kvstage_session *s[2];
    uint64_t pslot = SRC_SLOT;
    kvstage_pool_span pspan;
    kvstage_request_parts preq = request(SRC_ROW, &pslot, SRC_WINDOW, 1, &pspan);
    for (uint32_t r = 0; r < 2; ++r) {
        pool_init(&ppool[r], r, 2, 7 + r);
        parts_init(&pparts[r], r, 2);
        parts_paint(&pparts[r], SRC_ROW, SRC_SLOT, SRC_WINDOW, 1);
        parts_upload(&pparts[r]);
        prefill[r] = engine_tcp();
        REQUIRE(kvstage_pool_register(prefill[r], &ppool[r].layout) == KVSTAGE_OK);
        parts_register(prefill[r], &pparts[r]);
        char id[16];
        snprintf(id, sizeof id, "p%u", (unsigned)r);
        REQUIRE(kvstage_session_connect(prefill[r], addr, id, 10000, &s[r]) == KVSTAGE_OK);
    }
    for (uint32_t k = chunks; k-- > 0;)
        for (uint32_t r = 0; r < 2; ++r) {
            kvstage_transfer_desc d;
            REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
            d.room = ROOM, d.room_key = key, d.chunk_index = k, d.timeout_ms = 15000;
            d.src_pages = SRC_PAGES + k * (CHUNK / PAGE), d.num_pages = CHUNK / PAGE;
            d.parts = k + 1 == chunks ? &preq : NULL;
            CHECK_OK(kvstage_transfer(s[r], &d));
        }
    CHECK_OK(kvstage_room_wait(decode, ROOM, key, 15000));

    /* The decode side's reference: the request's row, slot and window (its own pages). */
    parts_paint(&dparts, DST_ROW, DST_SLOT, DST_WINDOW, 0);
    static const char *names[NCOMP] = {"output_ids", "conv", "swa"};
    for (int c = 0; c < NCOMP; ++c)
        for (uint32_t l = 0; l < layers_of(c); ++l) {
            uint8_t *got = (uint8_t *)malloc(dparts.bytes[c]);
            REQUIRE(got != NULL && cu.dtoh(got, dparts.dev[c][l], dparts.bytes[c]) == 0);
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < dparts.bytes[c]; ++i)
                if (got[i] != dparts.want[c][l][i] && bad++ == 0) first = i;
            if (bad)
                KV_FAIL_AT(__FILE__, __LINE__, "%s layer index %u: %zu byte(s) differ, first %zu: 0x%02x, expected 0x%02x", names[c], (unsigned)l, bad, first,
                           got[first], dparts.want[c][l][first]);
            free(got);
        }
    for (uint32_t r = 0; r < 2; ++r) {
        kvstage_session_free(s[r]);
        kvstage_engine_free(prefill[r]);
    }
    CHECK_OK(kvstage_room_release(decode, ROOM, key));
    kvstage_engine_free(decode);
    return finish("gpu_parts");
}
