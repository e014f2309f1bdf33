/* The ABI rules of API 0.4 for versioned structs (docs/c-api-conventions.md, section 4), from the
 * caller's side: a caller built against another header than the library's has its structs read
 * and written as large as it says they are, never past them.
 *
 *   a. An older, smaller caller. Every `_init` writes exactly the size the caller passes (the
 *      bytes after it are canaries and stay untouched): this header's sizeof, and the first
 *      published version's size (0.4: up to the end of the last field, without the tail padding),
 *      which the functions that read the struct then take (kvstage_engine_new). A size below the
 *      first version is refused naming `size`, nothing written.
 *   b. A newer, larger caller: struct { kvstage_X base; uint64_t future; } initialised with its
 *      own size gets `future` zeroed and struct_size = its size; a function reading it refuses it
 *      while `future` is not 0 (naming the first byte it does not know) and takes it once it is 0.
 *   c. Arrays of versioned input structs are read at the caller's stride, element 0's
 *      struct_size: kvstage_pairing_decode_ranks over larger layouts answers what it answers for
 *      the plain array; an element whose struct_size differs from element 0's, or that sets a
 *      field the library does not know, is refused naming its index. Components registered as an
 *      array of larger elements take effect: their rows cross the wire (d).
 *   d. Output arrays are written at the caller's stride: a real room (two engines over TCP on
 *      127.0.0.1, the room's descriptor, grid, transfer descriptor and components all of a newer,
 *      larger size) completes; kvstage_engine_poll_events into larger events writes its CHUNK
 *      event and its ROOM event each whole at its own element (its `future` zeroed), and nothing
 *      past them; kvstage_staging_layout_compute fills larger writers as it fills plain ones.
 *   e. kvstage_kv_layout's two versions (0.4; strides appended): a 0.4 caller's layout is read as
 *      token-major (a real chunk lands there) and kvstage_kv_layout_preset refuses it writing
 *      nothing; a newer caller's unknown field is zeroed, kept 0 by the preset, refused once set.
 *
 * Also built as C++17. */
#include <stddef.h>
#include <stdint.h>

#include "host_pool.h"

enum { CANARY = 0xC5, TAIL = 48 };

/* Storage for any struct of the API plus canaries after it, aligned as the structs are. */
typedef union storage {
    unsigned char bytes[1024 + TAIL];
    uint64_t align_u64;
    size_t align_size;
    void *align_ptr;
    double align_double;
} storage;

static int all_bytes_are(const unsigned char *p, size_t n, unsigned char value) {
    size_t i;
    for (i = 0; i < n; ++i)
        if (p[i] != value) return 0;
    return 1;
}

static size_t struct_size_of(const void *p) {
    size_t size;
    memcpy(&size, p, sizeof size);
    return size;
}

/* The last error names `needle` (read before any other kvstage call). */
static int error_names(const char *needle) {
    const kvstage_error *e = kvstage_error_last();
    size_t i;
    if (strstr(e->message, needle) != NULL) return 1;
    for (i = 0; i < e->cause_count; ++i)
        if (strstr(e->causes[i], needle) != NULL) return 1;
    return 0;
}

#define CHECK_NAMES(needle)                                                                          \
    do {                                                                                             \
        if (!error_names(needle)) {                                                                  \
            KV_FAIL_AT(__FILE__, __LINE__, "the last error does not name \"%s\"", (needle));         \
            kv_print_last_error("last error");                                                      \
        }                                                                                            \
    } while (0)

/* a and b for one input struct T (init function `init`, last field of its first version `last`). */
#define CHECK_INIT_SIZES(T, init, last)                                                                  \
    do {                                                                                                 \
        storage s_;                                                                                      \
        T *t_ = (T *)(void *)s_.bytes;                                                                   \
        const size_t full_ = sizeof(T), first_ = offsetof(T, last) + sizeof t_->last;                    \
        struct {                                                                                         \
            T base;                                                                                      \
            uint64_t future;                                                                             \
        } big_;                                                                                          \
        REQUIRE(full_ + TAIL <= sizeof s_.bytes);                                                        \
        /* This header's size: the struct, not one byte after it. */                                    \
        memset(s_.bytes, CANARY, sizeof s_.bytes);                                                       \
        CHECK_OK(init(t_, full_));                                                                       \
        CHECK_INT(struct_size_of(s_.bytes), full_);                                                      \
        CHECK(all_bytes_are(s_.bytes + full_, TAIL, CANARY));                                            \
        /* The first published version's size: up to its last field, not its tail padding. */          \
        memset(s_.bytes, CANARY, sizeof s_.bytes);                                                       \
        CHECK_OK(init(t_, first_));                                                                      \
        CHECK_INT(struct_size_of(s_.bytes), first_);                                                     \
        CHECK(all_bytes_are(s_.bytes + first_, TAIL, CANARY));                                           \
        /* Smaller than that: refused naming `size`, nothing written. */                                \
        memset(s_.bytes, CANARY, sizeof s_.bytes);                                                       \
        CHECK_INT(init(t_, first_ - 1), KVSTAGE_E_INVALID_ARG);                                          \
        CHECK_NAMES("`size`");                                                                           \
        CHECK_INT(init(t_, sizeof(size_t)), KVSTAGE_E_INVALID_ARG);                                      \
        CHECK_NAMES("`size`");                                                                           \
        CHECK(all_bytes_are(s_.bytes, sizeof s_.bytes, CANARY));                                         \
        /* A newer, larger caller: its unknown field zeroed, its size recorded. */                      \
        memset(&big_, 0xEE, sizeof big_);                                                                \
        CHECK_OK(init(&big_.base, sizeof big_));                                                         \
        CHECK_INT(big_.base.struct_size, sizeof big_);                                                   \
        CHECK(big_.future == 0);                                                                         \
        printf("%-24s sizeof %3zu, first version %3zu: init writes exactly the size given\n", #T, full_, \
               first_);                                                                                  \
    } while (0)

static void test_init_sizes(void) {
    CHECK_INIT_SIZES(kvstage_engine_options, kvstage_engine_options_init, same_host_direct);
    CHECK_INIT_SIZES(kvstage_kv_layout, kvstage_kv_layout_init, cuda_device);
    CHECK_INIT_SIZES(kvstage_staging_memory, kvstage_staging_memory_init, bytes);
    CHECK_INIT_SIZES(kvstage_component, kvstage_component_init, num_bases);
    CHECK_INIT_SIZES(kvstage_request_parts, kvstage_request_parts_init, num_pool_spans);
    CHECK_INIT_SIZES(kvstage_state_item, kvstage_state_item_init, replicated);
    CHECK_INIT_SIZES(kvstage_transfer_desc, kvstage_transfer_desc_init, parts);
    CHECK_INIT_SIZES(kvstage_room_desc, kvstage_room_desc_init, trace_id);
}

/* a: an options struct of the first version's size (no tail padding: canaries there) is read as
 * large as it says, and its settings count. */
static void test_older_options_are_read(void) {
    storage s;
    kvstage_engine_options *o = (kvstage_engine_options *)(void *)s.bytes;
    const size_t first = offsetof(kvstage_engine_options, same_host_direct) + sizeof o->same_host_direct;
    kvstage_engine *e = NULL;
    memset(s.bytes, CANARY, sizeof s.bytes);
    REQUIRE(kvstage_engine_options_init(o, first) == KVSTAGE_OK);
    o->worker_threads = 0; /* a setting it has: read (and refused) */
    CHECK_INT(kvstage_engine_new(o, &e), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES("options->worker_threads");
    CHECK(e == NULL);
    o->worker_threads = 2;
    o->same_host_direct = 0; /* its last field */
    CHECK_OK(kvstage_engine_new(o, &e));
    CHECK(e != NULL);
    kvstage_engine_free(e);
    CHECK(all_bytes_are(s.bytes + first, TAIL, CANARY));
}

/* b: engine options of a newer, larger header. */
typedef struct options_v2 {
    kvstage_engine_options base;
    uint64_t future_field;
} options_v2;

static void test_newer_options(void) {
    options_v2 o;
    kvstage_engine *e = NULL;
    char want[64], addr[64];
    memset(&o, 0xEE, sizeof o);
    REQUIRE(kvstage_engine_options_init(&o.base, sizeof o) == KVSTAGE_OK);
    CHECK_INT(o.base.struct_size, sizeof o);
    CHECK(o.future_field == 0);
    CHECK_INT(o.base.transport, KVSTAGE_TRANSPORT_AUTO);
    CHECK(o.base.worker_threads >= 1 && o.base.worker_threads <= 256);

    /* A field this library does not know, set: refused, naming its first byte that is not 0. */
    o.future_field = 1;
    CHECK_INT(kvstage_engine_new(&o.base, &e), KVSTAGE_E_INVALID_ARG);
    snprintf(want, sizeof want, "byte %zu", offsetof(options_v2, future_field));
    CHECK_NAMES(want);
    CHECK_NAMES("options");
    CHECK(e == NULL);
    o.future_field = (uint64_t)1 << 56; /* little-endian: the field's last byte */
    CHECK_INT(kvstage_engine_new(&o.base, &e), KVSTAGE_E_INVALID_ARG);
    snprintf(want, sizeof want, "byte %zu", offsetof(options_v2, future_field) + 7);
    CHECK_NAMES(want);
    CHECK(e == NULL);

    /* Left as init set it: taken, with the known settings. */
    o.future_field = 0;
    o.base.listen_address = "127.0.0.1:0";
    o.base.worker_threads = 3;
    CHECK_OK(kvstage_engine_new(&o.base, &e));
    REQUIRE(e != NULL);
    CHECK_OK(kvstage_engine_listen_address(e, addr, sizeof addr, NULL));
    CHECK(strncmp(addr, "127.0.0.1:", 10) == 0);
    kvstage_engine_free(e);
}

/* c: a layout array of a newer, larger element. */
typedef struct layout_v2 {
    kvstage_kv_layout l;
    uint64_t future;
} layout_v2;

enum { HEADS = 8, HEAD_DIM = 16, DTYPE = 2, PAGE = 4 };

static kvstage_kv_layout shape_of(uint32_t tp_rank, uint32_t tp_size, uint32_t pp_rank, uint32_t pp_size, const uint32_t *ids,
                                  uint32_t n) {
    kvstage_kv_layout l = host_pool_shape(n, HEADS, HEAD_DIM, DTYPE, PAGE, 8, tp_rank, tp_size);
    l.pp_rank = pp_rank;
    l.pp_size = pp_size;
    l.layer_ids = ids;
    return l;
}

/* `dst` (of `size` bytes, its struct_size already `size`) takes the fields of `src`. */
static void set_layout(kvstage_kv_layout *dst, const kvstage_kv_layout *src) {
    size_t size = dst->struct_size;
    *dst = *src;
    dst->struct_size = size;
}

static void test_input_arrays(void) {
    /* Prefill TP 2 rank 1, one stage of 7 layers; decode TP 1 in two stages (4 + 3 layers): the
     * prefill rank writes to both decode stages. */
    static const uint32_t all[7] = {0, 1, 2, 3, 4, 5, 6}, low[4] = {0, 1, 2, 3}, high[3] = {4, 5, 6};
    kvstage_kv_layout prefill = shape_of(1, 2, 0, 1, all, 7);
    kvstage_kv_layout plain[2];
    layout_v2 big[2];
    kvstage_rank want[4], got[4];
    size_t want_count = 0, got_count = 0, i;
    char byte[64];

    plain[0] = shape_of(0, 1, 0, 2, low, 4);
    plain[1] = shape_of(0, 1, 1, 2, high, 3);
    REQUIRE(kvstage_pairing_decode_ranks(&prefill, NULL, 0, plain, 2, want, 4, &want_count) == KVSTAGE_OK);
    CHECK_INT(want_count, 2);
    CHECK(want[0].pp_rank == 0 && want[1].pp_rank == 1 && want[0].tp_rank == 0 && want[1].tp_rank == 0);

    memset(big, 0xEE, sizeof big);
    for (i = 0; i < 2; ++i) {
        REQUIRE(kvstage_kv_layout_init(&big[i].l, sizeof big[i]) == KVSTAGE_OK);
        CHECK(big[i].future == 0);
        set_layout(&big[i].l, &plain[i]);
    }
    memset(got, 0xEE, sizeof got);
    CHECK_OK(kvstage_pairing_decode_ranks(&prefill, NULL, 0, &big[0].l, 2, got, 4, &got_count));
    CHECK_INT(got_count, want_count);
    CHECK(memcmp(got, want, want_count * sizeof got[0]) == 0);

    /* The other way round: the same decode stage's writers, larger prefill stages. */
    {
        kvstage_kv_layout d0 = plain[0];
        kvstage_kv_layout p_plain[2];
        layout_v2 p_big[2];
        kvstage_rank a[8], b[8];
        size_t na = 0, nb = 0;
        p_plain[0] = shape_of(0, 2, 0, 2, low, 4);
        p_plain[1] = shape_of(0, 2, 1, 2, high, 3);
        for (i = 0; i < 2; ++i) {
            REQUIRE(kvstage_kv_layout_init(&p_big[i].l, sizeof p_big[i]) == KVSTAGE_OK);
            set_layout(&p_big[i].l, &p_plain[i]);
        }
        d0.pp_size = 2;
        CHECK_OK(kvstage_pairing_prefill_ranks(&d0, NULL, 0, p_plain, 2, a, 8, &na));
        CHECK_OK(kvstage_pairing_prefill_ranks(&d0, NULL, 0, &p_big[0].l, 2, b, 8, &nb));
        CHECK_INT(na, 2); /* both TP ranks of stage 0 */
        CHECK_INT(nb, na);
        CHECK(memcmp(a, b, na * sizeof a[0]) == 0);
    }

    /* An element of another size than element 0: refused, naming it. */
    big[1].l.struct_size = sizeof(kvstage_kv_layout);
    CHECK_INT(kvstage_pairing_decode_ranks(&prefill, NULL, 0, &big[0].l, 2, got, 4, &got_count), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES("[1]");
    CHECK_NAMES("struct_size");
    big[1].l.struct_size = sizeof big[1];
    /* An element that sets a field this library does not know: refused, naming it and the byte. */
    big[1].future = 0x100;
    CHECK_INT(kvstage_pairing_decode_ranks(&prefill, NULL, 0, &big[0].l, 2, got, 4, &got_count), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES("[1]");
    snprintf(byte, sizeof byte, "byte %zu", offsetof(layout_v2, future) + 1);
    CHECK_NAMES(byte);
    big[1].future = 0;
    CHECK_OK(kvstage_pairing_decode_ranks(&prefill, NULL, 0, &big[0].l, 2, got, 4, &got_count));
    CHECK_INT(got_count, want_count);
}

/* d: output arrays, and a real room whose every versioned struct is a newer, larger one. */
typedef struct room_desc_v2 {
    kvstage_room_desc d;
    uint64_t future;
} room_desc_v2;
typedef struct grid_v2 {
    kvstage_room_grid g;
    uint64_t future;
} grid_v2;
typedef struct transfer_desc_v2 {
    kvstage_transfer_desc d;
    uint64_t future;
} transfer_desc_v2;
typedef struct component_v2 {
    kvstage_component c;
    uint64_t future;
} component_v2;
typedef struct event_v2 {
    kvstage_room_event ev;
    uint64_t future;
} event_v2;
typedef struct writer_v2 {
    kvstage_staging_writer w;
    uint64_t future;
} writer_v2;

enum { LAYERS = 2, CAPACITY = 8, NPAGES = 4, ROWS = 4, ROOM = 17 };
static const uint64_t AUX_BYTES[2] = {16, 24};

/* A rank's two aux buffers (ROWS rows each). */
typedef struct aux {
    uint8_t rows[2][ROWS * 24];
    uint64_t base[2][1];
} aux;

/* Registers the rank's two aux components, given as an array of larger elements. */
static int register_aux(kvstage_engine *e, aux *a, uint64_t future_of_1, size_t size_of_1) {
    static const char *const names[2] = {"aux_a", "aux_b"};
    component_v2 c[2];
    int i;
    memset(c, 0xEE, sizeof c);
    for (i = 0; i < 2; ++i) {
        REQUIRE(kvstage_component_init(&c[i].c, sizeof c[i]) == KVSTAGE_OK);
        a->base[i][0] = (uint64_t)(uintptr_t)a->rows[i];
        c[i].c.name = names[i];
        c[i].c.kind = KVSTAGE_COMPONENT_AUX;
        c[i].c.item_bytes = AUX_BYTES[i];
        c[i].c.num_items = ROWS;
        c[i].c.bases = a->base[i];
        c[i].c.num_bases = 1;
    }
    c[1].future = future_of_1;
    c[1].c.struct_size = size_of_1;
    return (int)kvstage_pool_register_components(e, &c[0].c, 2);
}

static kvstage_engine *tcp_engine(const host_pool *p, size_t ring_bytes) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_TCP;
    return host_pool_engine(&o, p, ring_bytes);
}

static void test_room_with_newer_structs(void) {
    static const uint32_t src_pages[NPAGES] = {5, 1, 6, 2}, dst_pages[NPAGES] = {3, 7, 0, 4};
    const uint64_t src_row = 1, dst_row = 2;
    kvstage_kv_layout shape = host_pool_shape(LAYERS, 2, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
    host_pool dp, pp;
    aux da, pa;
    kvstage_request_parts dparts, pparts;
    room_desc_v2 rd;
    grid_v2 grid, seen;
    transfer_desc_v2 td;
    event_v2 ev[4];
    kvstage_engine *decode, *prefill;
    kvstage_session *s = NULL;
    char addr[64], byte[64];
    size_t count = 0, i, pg, b;

    host_pool_init(&dp, &shape);
    host_pool_init(&pp, &shape);
    host_pool_fill(&pp, 11);
    memset(&da, 0, sizeof da);
    memset(&pa, 0, sizeof pa);
    for (i = 0; i < sizeof pa.rows[0]; ++i) {
        pa.rows[0][i] = (uint8_t)(3 * i + 1);
        pa.rows[1][i] = (uint8_t)(7 * i + 2);
    }
    decode = tcp_engine(&dp, 1 << 20);
    prefill = tcp_engine(&pp, 0);

    /* c: the component array at the caller's stride; refused elements register nothing. */
    CHECK_INT(register_aux(decode, &da, 0, sizeof(kvstage_component)), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES("[1]");
    CHECK_INT(register_aux(decode, &da, 1, sizeof(component_v2)), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES("[1]");
    snprintf(byte, sizeof byte, "byte %zu", offsetof(component_v2, future));
    CHECK_NAMES(byte);
    CHECK_OK(register_aux(decode, &da, 0, sizeof(component_v2)));
    CHECK_OK(register_aux(prefill, &pa, 0, sizeof(component_v2)));

    /* The room: a larger descriptor (refused while its unknown field is set) and a larger grid. */
    REQUIRE(kvstage_request_parts_init(&dparts, sizeof dparts) == KVSTAGE_OK);
    dparts.aux_row = dst_row;
    REQUIRE(kvstage_request_parts_init(&pparts, sizeof pparts) == KVSTAGE_OK);
    pparts.aux_row = src_row;
    memset(&rd, 0xEE, sizeof rd);
    REQUIRE(kvstage_room_desc_init(&rd.d, sizeof rd) == KVSTAGE_OK);
    CHECK(rd.future == 0);
    rd.d.room = ROOM;
    rd.d.pages = dst_pages;
    rd.d.num_pages = NPAGES;
    rd.d.chunk_tokens = NPAGES * PAGE;
    rd.d.parts = &dparts;
    memset(&grid, 0xEE, sizeof grid);
    grid.g.struct_size = sizeof grid;
    rd.future = 5;
    CHECK_INT(kvstage_room_open(decode, &rd.d, &grid.g), KVSTAGE_E_INVALID_ARG);
    snprintf(byte, sizeof byte, "byte %zu", offsetof(room_desc_v2, future));
    CHECK_NAMES(byte);
    rd.future = 0;
    REQUIRE(kvstage_room_open(decode, &rd.d, &grid.g) == KVSTAGE_OK);
    CHECK_INT(grid.g.struct_size, sizeof grid);
    CHECK(grid.future == 0); /* written as zeros: a field this library does not know */
    CHECK(grid.g.key != 0);
    CHECK_INT(grid.g.num_chunks, 1);
    CHECK_INT(grid.g.num_pages, NPAGES);
    CHECK_INT(grid.g.page_size, PAGE);

    REQUIRE(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL) == KVSTAGE_OK);
    REQUIRE(kvstage_session_connect(prefill, addr, "abi", 10000, &s) == KVSTAGE_OK);
    memset(&seen, 0xEE, sizeof seen);
    seen.g.struct_size = sizeof seen;
    CHECK_OK(kvstage_session_room_grid_get(s, ROOM, grid.g.key, 10000, &seen.g));
    CHECK(seen.future == 0);
    CHECK(seen.g.key == grid.g.key && seen.g.num_chunks == 1 && seen.g.num_pages == NPAGES && seen.g.page_size == PAGE);

    /* The chunk, with a larger descriptor. */
    memset(&td, 0xEE, sizeof td);
    REQUIRE(kvstage_transfer_desc_init(&td.d, sizeof td) == KVSTAGE_OK);
    CHECK(td.future == 0);
    td.d.room = ROOM;
    td.d.room_key = grid.g.key;
    td.d.chunk_index = 0;
    td.d.src_pages = src_pages;
    td.d.num_pages = NPAGES;
    td.d.timeout_ms = 20000;
    td.d.parts = &pparts;
    td.future = (uint64_t)1 << 16;
    CHECK_INT(kvstage_transfer(s, &td.d), KVSTAGE_E_INVALID_ARG);
    snprintf(byte, sizeof byte, "byte %zu", offsetof(transfer_desc_v2, future) + 2);
    CHECK_NAMES(byte);
    td.future = 0;
    CHECK_OK(kvstage_transfer(s, &td.d));
    CHECK_OK(kvstage_room_wait(decode, ROOM, grid.g.key, 20000));

    /* It took effect: the KV pages and both components' rows (element 1 read where it lies). */
    for (b = 0; b < 2 * LAYERS; ++b)
        for (pg = 0; pg < NPAGES; ++pg)
            CHECK(memcmp(host_pool_at(&dp, b / 2, (int)(b % 2), (size_t)dst_pages[pg] * PAGE),
                         host_pool_at(&pp, b / 2, (int)(b % 2), (size_t)src_pages[pg] * PAGE), PAGE * dp.slot) == 0);
    for (i = 0; i < 2; ++i) {
        CHECK(memcmp(da.rows[i] + dst_row * AUX_BYTES[i], pa.rows[i] + src_row * AUX_BYTES[i], AUX_BYTES[i]) == 0);
        CHECK(all_bytes_are(da.rows[i], dst_row * AUX_BYTES[i], 0)); /* the other rows untouched */
    }

    /* d: the events at the caller's stride, each whole, nothing past the last. */
    memset(ev, 0xEE, sizeof ev);
    ev[0].ev.struct_size = sizeof ev[0];
    CHECK_OK(kvstage_engine_poll_events(decode, &ev[0].ev, 4, &count));
    CHECK_INT(count, 2);
    for (i = 0; i < 2; ++i) {
        CHECK_INT(ev[i].ev.struct_size, sizeof ev[i]);
        CHECK(ev[i].future == 0);
        CHECK_INT(ev[i].ev.room, ROOM);
        CHECK(ev[i].ev.room_key == grid.g.key);
        CHECK_INT(ev[i].ev.status, KVSTAGE_OK);
        CHECK(memchr(ev[i].ev.trace_id, 0, sizeof ev[i].ev.trace_id) != NULL);
    }
    CHECK_INT(ev[0].ev.kind, KVSTAGE_ROOM_EVENT_CHUNK);
    CHECK_INT(ev[0].ev.chunk_index, 0);
    CHECK_INT(ev[1].ev.kind, KVSTAGE_ROOM_EVENT_ROOM);
    CHECK(all_bytes_are((const unsigned char *)&ev[2], 2 * sizeof ev[0], 0xEE));

    CHECK_OK(kvstage_room_release(decode, ROOM, grid.g.key));
    kvstage_session_free(s);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);
    host_pool_free(&dp);
    host_pool_free(&pp);
}

/* d: staging writers at the caller's stride (prefill TP 4 into decode TP 1: 4 writers). */
static void test_writer_arrays(void) {
    kvstage_kv_layout src = host_pool_shape(3, HEADS, HEAD_DIM, DTYPE, PAGE, 8, 0, 4);
    kvstage_kv_layout dst = host_pool_shape(3, HEADS, HEAD_DIM, DTYPE, PAGE, 8, 0, 1);
    kvstage_staging_layout a, b;
    kvstage_staging_writer plain[4];
    writer_v2 big[5];
    size_t i;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    a.struct_size = b.struct_size = sizeof a;
    memset(plain, 0, sizeof plain);
    plain[0].struct_size = sizeof plain[0];
    memset(big, 0xEE, sizeof big);
    big[0].w.struct_size = sizeof big[0];
    CHECK_OK(kvstage_staging_layout_compute(&src, 1, &dst, NULL, 0, NULL, 0, 8, &a, plain, 4));
    CHECK_OK(kvstage_staging_layout_compute(&src, 1, &dst, NULL, 0, NULL, 0, 8, &b, &big[0].w, 5));
    CHECK_INT(a.num_writers, 4);
    CHECK(a.total_bytes == b.total_bytes && a.row_bytes == b.row_bytes && a.slab_bytes == b.slab_bytes);
    CHECK(a.tokens == b.tokens && a.num_heads == b.num_heads && a.num_writers == b.num_writers);
    CHECK(a.buffers_per_layer == b.buffers_per_layer && a.num_tp_writers == b.num_tp_writers && a.parts_bytes == b.parts_bytes);
    for (i = 0; i < 4; ++i) {
        CHECK_INT(big[i].w.struct_size, sizeof big[i]);
        CHECK(big[i].future == 0);
        CHECK(big[i].w.offset == plain[i].offset && big[i].w.bytes == plain[i].bytes);
        CHECK(big[i].w.src_tp_rank == plain[i].src_tp_rank && big[i].w.dst_head_start == plain[i].dst_head_start);
        CHECK(big[i].w.num_heads == plain[i].num_heads && big[i].w.layers == plain[i].layers);
    }
    CHECK_INT(plain[3].src_tp_rank, 3);
    CHECK(all_bytes_are((const unsigned char *)&big[4], sizeof big[4], 0xEE)); /* past the last writer */
}

/* a and b for kvstage_kv_layout across its three versions: 0.4 (up to cuda_device), the one with
 * strides (page_stride, token_stride, head_stride, v_offset appended), and the one with V heads of
 * their own size (head_dim_v, v_page_stride, v_token_stride, v_head_stride appended).
 *
 * - A 0.4 caller: its struct ends at cuda_device and canaries follow (as strides they would be
 *   absurd: 0xC5C5… is no multiple of anything the shape allows). validate and pool_register read
 *   it as large as it says: token-major strides, V in v_bases. kvstage_kv_layout_preset refuses
 *   it naming struct_size, writing nothing (canaries intact). A real chunk over TCP into a pool
 *   registered that way lands where token-major puts it.
 * - A caller with strides but no head_dim_v: preset fills its strides and writes nothing past
 *   its struct (canaries intact); V's heads are K's size.
 * - This header's size: init leaves the strides 0 (token-major), preset fills them.
 * - A newer caller (struct { kvstage_kv_layout; uint64_t future; }): init zeroes `future`,
 *   preset writes the strides and leaves `future` 0 and struct_size the caller's; validate,
 *   pool_register and preset refuse it while `future` is set (naming its byte), take it at 0. */
static void test_layout_versions(void) {
    enum { NPAGES_ROOM = 3, ROOM_ID = 23 };
    static const uint32_t src_pages[NPAGES_ROOM] = {6, 1, 4}, dst_pages[NPAGES_ROOM] = {2, 7, 5};
    const size_t first = offsetof(kvstage_kv_layout, cuda_device) + sizeof(int32_t);
    const size_t strided = offsetof(kvstage_kv_layout, v_offset) + sizeof(uint64_t);
    const size_t full = offsetof(kvstage_kv_layout, v_head_stride) + sizeof(uint64_t);
    kvstage_kv_layout shape = host_pool_shape(2, 2, HEAD_DIM, DTYPE, PAGE, 8, 0, 1);
    host_pool dp, pp;
    storage s;
    kvstage_kv_layout *old = (kvstage_kv_layout *)(void *)s.bytes;
    layout_v2 big;
    kvstage_kv_layout cur;
    kvstage_engine *decode = NULL, *prefill, *probe = NULL;
    kvstage_session *sess = NULL;
    kvstage_transfer_desc td;
    uint64_t layer_stride = 99, key = 0;
    uint32_t chunks = 0;
    char addr[64], byte[64];
    size_t b, pg;

    CHECK_INT(first, offsetof(kvstage_kv_layout, page_stride)); /* the strides start where 0.4 ended */
    CHECK_INT(strided, offsetof(kvstage_kv_layout, head_dim_v)); /* head_dim_v where the strides ended */
    CHECK_INT(full, sizeof(kvstage_kv_layout));                  /* appended at the end, no tail padding */
    host_pool_init(&dp, &shape);
    host_pool_init(&pp, &shape);
    host_pool_fill(&pp, 21);

    /* A 0.4 caller's layout of the decode pool, canaries after it. */
    memset(s.bytes, CANARY, sizeof s.bytes);
    REQUIRE(kvstage_kv_layout_init(old, first) == KVSTAGE_OK);
    CHECK_INT(old->struct_size, first);
    CHECK(all_bytes_are(s.bytes + first, TAIL, CANARY));
    memcpy(old, &dp.layout, first); /* the fields it has, as a 0.4 caller sets them */
    old->struct_size = first;
    CHECK_OK(kvstage_kv_layout_validate(old));
    CHECK_INT(kvstage_kv_layout_preset(old, KVSTAGE_LAYOUT_TRTLLM, &layer_stride), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES("layout->struct_size");
    CHECK_INT(layer_stride, 99);
    CHECK(all_bytes_are(s.bytes + first, TAIL, CANARY));
    CHECK_INT(old->capacity_pages, 8);

    /* It registers, and a chunk lands token-major (the prefill: this header's size, strides 0). */
    {
        kvstage_engine_options o;
        REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
        o.transport = KVSTAGE_TRANSPORT_TCP;
        REQUIRE(kvstage_engine_new(&o, &decode) == KVSTAGE_OK);
    }
    CHECK_OK(kvstage_pool_register(decode, old));
    REQUIRE(kv_staging_register(decode, NULL, 1 << 20) == KVSTAGE_OK);
    CHECK(all_bytes_are(s.bytes + first, TAIL, CANARY));
    prefill = tcp_engine(&pp, 0);
    REQUIRE(kv_room_open(decode, ROOM_ID, dst_pages, NPAGES_ROOM, NPAGES_ROOM * PAGE, NULL, &chunks, &key) == KVSTAGE_OK);
    CHECK_INT(chunks, 1);
    REQUIRE(kvstage_engine_listen_address(decode, addr, sizeof addr, NULL) == KVSTAGE_OK);
    REQUIRE(kvstage_session_connect(prefill, addr, "abi-layout-0.4", 10000, &sess) == KVSTAGE_OK);
    REQUIRE(kvstage_transfer_desc_init(&td, sizeof td) == KVSTAGE_OK);
    td.room = ROOM_ID;
    td.room_key = key;
    td.src_pages = src_pages;
    td.num_pages = NPAGES_ROOM;
    td.timeout_ms = 20000;
    CHECK_OK(kvstage_transfer(sess, &td));
    CHECK_OK(kvstage_room_wait(decode, ROOM_ID, key, 20000));
    for (b = 0; b < 2 * 2; ++b)
        for (pg = 0; pg < 8; ++pg) {
            size_t k = 0;
            const uint8_t *got = host_pool_at(&dp, b / 2, (int)(b % 2), pg * PAGE);
            while (k < NPAGES_ROOM && dst_pages[k] != pg) ++k;
            if (k < NPAGES_ROOM) {
                if (memcmp(got, host_pool_at(&pp, b / 2, (int)(b % 2), (size_t)src_pages[k] * PAGE), PAGE * dp.slot) != 0)
                    KV_FAIL_AT(__FILE__, __LINE__, "0.4-sized decode layout: buffer %zu page %zu is not prefill page %u",
                               b, pg, (unsigned)src_pages[k]);
            } else if (!all_bytes_are(got, PAGE * dp.slot, 0)) {
                KV_FAIL_AT(__FILE__, __LINE__, "0.4-sized decode layout: buffer %zu page %zu (no room's) was written", b, pg);
            }
        }
    CHECK_OK(kvstage_room_release(decode, ROOM_ID, key));
    kvstage_session_free(sess);
    kvstage_engine_free(prefill);
    kvstage_engine_free(decode);

    /* A caller with strides, without head_dim_v: preset fills the strides, nothing past its end. */
    memset(s.bytes, CANARY, sizeof s.bytes);
    REQUIRE(kvstage_kv_layout_init(old, strided) == KVSTAGE_OK);
    CHECK(all_bytes_are(s.bytes + strided, TAIL, CANARY));
    memcpy((char *)old + sizeof(size_t), (const char *)&shape + sizeof(size_t), first - sizeof(size_t));
    CHECK_OK(kvstage_kv_layout_preset(old, KVSTAGE_LAYOUT_TRTLLM, &layer_stride));
    CHECK_INT(old->struct_size, strided);
    CHECK_INT(old->head_stride, PAGE * HEAD_DIM * DTYPE);
    CHECK_INT(old->v_offset, 2 * PAGE * HEAD_DIM * DTYPE);
    CHECK(all_bytes_are(s.bytes + strided, TAIL, CANARY));

    /* This header's size: strides 0 after init (token-major), set by preset. */
    memset(&cur, 0xEE, sizeof cur);
    REQUIRE(kvstage_kv_layout_init(&cur, sizeof cur) == KVSTAGE_OK);
    CHECK(cur.page_stride == 0 && cur.token_stride == 0 && cur.head_stride == 0 && cur.v_offset == 0);
    CHECK(cur.head_dim_v == 0 && cur.v_page_stride == 0 && cur.v_token_stride == 0 && cur.v_head_stride == 0);
    set_layout(&cur, &shape);
    CHECK_OK(kvstage_kv_layout_preset(&cur, KVSTAGE_LAYOUT_VLLM_LBHNC, &layer_stride));
    CHECK_INT(cur.struct_size, sizeof cur);
    CHECK_INT(cur.v_offset, HEAD_DIM * DTYPE);
    CHECK_INT(cur.token_stride, 2 * HEAD_DIM * DTYPE);

    /* A newer caller: its unknown field zeroed by init, left so by preset, refused once set. */
    memset(&big, 0xEE, sizeof big);
    REQUIRE(kvstage_kv_layout_init(&big.l, sizeof big) == KVSTAGE_OK);
    CHECK(big.future == 0);
    CHECK(big.l.page_stride == 0 && big.l.token_stride == 0 && big.l.head_stride == 0 && big.l.v_offset == 0);
    set_layout(&big.l, &dp.layout); /* the token-major pool, bases and all */
    CHECK_OK(kvstage_kv_layout_validate(&big.l));
    big.future = 1;
    snprintf(byte, sizeof byte, "byte %zu", offsetof(layout_v2, future));
    CHECK_INT(kvstage_kv_layout_validate(&big.l), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES(byte);
    REQUIRE(kvstage_engine_new(NULL, &probe) == KVSTAGE_OK);
    CHECK_INT(kvstage_pool_register(probe, &big.l), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES(byte);
    layer_stride = 99;
    CHECK_INT(kvstage_kv_layout_preset(&big.l, KVSTAGE_LAYOUT_SGLANG, &layer_stride), KVSTAGE_E_INVALID_ARG);
    CHECK_NAMES(byte);
    CHECK_INT(layer_stride, 99);
    CHECK(big.l.page_stride == 0 && big.l.token_stride == 0);
    big.future = 0;
    CHECK_OK(kvstage_pool_register(probe, &big.l));
    /* preset on the newer struct: the strides written, `future` still 0, struct_size its own; the
     * sglang preset is the token-major layout the pool already has, so it still validates. */
    CHECK_OK(kvstage_kv_layout_preset(&big.l, KVSTAGE_LAYOUT_SGLANG, &layer_stride));
    CHECK(big.future == 0);
    CHECK_INT(big.l.struct_size, sizeof big);
    CHECK_INT(big.l.token_stride, dp.slot);
    CHECK_INT(big.l.head_stride, HEAD_DIM * DTYPE);
    CHECK_INT(big.l.page_stride, PAGE * dp.slot);
    CHECK_INT(big.l.v_offset, 0);
    CHECK_INT(layer_stride, dp.buffer);
    CHECK_OK(kvstage_kv_layout_validate(&big.l));
    kvstage_engine_free(probe);
    host_pool_free(&dp);
    host_pool_free(&pp);
    printf("kvstage_kv_layout: 0.4 size %zu (strides token-major, preset refused, a chunk landed token-major), "
           "with strides %zu (preset within it), this header's %zu, a newer one's unknown field refused until 0\n",
           first, strided, full);
}

int main(void) {
    test_init_sizes();
    test_older_options_are_read();
    test_newer_options();
    test_input_arrays();
    test_layout_versions();
    test_room_with_newer_structs();
    test_writer_arrays();
    return kv_finish("abi_struct_sizes");
}
