/* A stale writer cannot land in a reopened room: two processes, a decode engine (the child) and a
 * prefill engine (this process), over TCP on 127.0.0.1.
 *
 * The decode side opens room 7 for request A and sends the prefill side its address and A's key,
 * as an engine's bootstrap would. Chunk 0 of A lands. Then A is canceled: the decode side releases
 * room 7 and opens it again for request B, over other pages, and sends B's key. The prefill
 * session that sent A goes on with A's key (chunk 1, and chunk 0 again): each transfer fails with
 * KVSTAGE_E_STALE_ROOM naming room 7, at once. The same session (it survived) and a second one
 * then send B with B's key: B completes, and every byte of B's pages equals B's prefill pages
 * (an independent reference: the fill pattern recomputed here), no byte of A reached them, and
 * every decode page outside B's holds what it held before B opened.
 *
 * Prefill TP 2 -> decode TP 1 (two writers per chunk, each sending its heads). */
#define _DEFAULT_SOURCE

#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "host_pool.h"

enum {
    LAYERS = 2,
    HEADS = 4, /* global KV heads; each prefill rank holds 2 */
    HEAD_DIM = 8,
    DTYPE = 2,
    PAGE = 4,
    CAPACITY = 16,
    CHUNK_PAGES = 2,
    ROOM_PAGES = 4, /* two chunks */
    ROOM = 7,
    PREFILL_TP = 2,
};

/* Request A and B: the prefill pages holding their tokens, and the decode pages they land in. */
static const uint32_t A_SRC[ROOM_PAGES] = {0, 1, 2, 3};
static const uint32_t B_SRC[ROOM_PAGES] = {8, 9, 10, 11};
static const uint32_t A_DST[ROOM_PAGES] = {5, 6, 7, 8};
static const uint32_t B_DST[ROOM_PAGES] = {12, 3, 14, 1};

static size_t slot_bytes(int heads) { return (size_t)heads * HEAD_DIM * DTYPE; }

static void pool_init(host_pool *p, uint32_t tp_rank, uint32_t tp_size) {
    kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, tp_rank, tp_size);
    host_pool_init(p, &shape);
}

/* The byte a prefill pool holds for (buffer kv of layer, token slot, global head, byte in head):
 * distinct for every page, so A's and B's pages differ everywhere. */
static uint8_t pattern(int layer, int kv, uint32_t slot, int head, int byte) {
    uint32_t x = (uint32_t)layer * 2654435761u ^ (uint32_t)kv * 40503u ^ slot * 2246822519u ^ (uint32_t)head * 3266489917u ^ (uint32_t)byte;
    x ^= x >> 15;
    x *= 0x2c1b3c6du;
    x ^= x >> 12;
    return (uint8_t)(x | 1); /* never 0: an untouched decode byte is 0 */
}

static uint8_t *at(const host_pool *p, int layer, int kv, uint32_t slot, int local_head, int byte) {
    int heads = (int)p->layout.local_heads;
    uint8_t *base = (uint8_t *)(uintptr_t)(kv ? p->v[layer] : p->k[layer]);
    return base + (size_t)slot * slot_bytes(heads) + (size_t)local_head * HEAD_DIM * DTYPE + (size_t)byte;
}

static void fill_prefill(host_pool *p) {
    int heads = (int)p->layout.local_heads, first = (int)p->layout.tp_rank * heads;
    for (int l = 0; l < LAYERS; ++l)
        for (int kv = 0; kv < 2; ++kv)
            for (uint32_t s = 0; s < (uint32_t)CAPACITY * PAGE; ++s)
                for (int h = 0; h < heads; ++h)
                    for (int b = 0; b < HEAD_DIM * DTYPE; ++b) *at(p, l, kv, s, h, b) = pattern(l, kv, s, first + h, b);
}

/* A TCP engine with pool `p` and a ring of `ring_bytes` (0: none). */
static kvstage_engine *engine_with(host_pool *p, size_t ring_bytes) {
    kvstage_engine_options o;
    REQUIRE(kvstage_engine_options_init(&o, sizeof o) == KVSTAGE_OK);
    o.transport = KVSTAGE_TRANSPORT_TCP;
    return host_pool_engine(&o, p, ring_bytes);
}

/* --- the decode process ------------------------------------------------------------------------ */

/* Lines to the parent: "addr KEY_A", then "key KEY_B" after "reopen", then "verified BAD STRAY". */
static int decode_main(FILE *in, FILE *out) {
    host_pool p;
    pool_init(&p, 0, 1);
    kvstage_engine *e = engine_with(&p, 64 << 10);
    char addr[64] = {0}, line[128];
    REQUIRE(kvstage_engine_listen_address(e, addr, sizeof addr, NULL) == KVSTAGE_OK);
    uint64_t key_a = 0, key_b = 0;
    uint32_t chunks = 0;
    CHECK_OK(kv_room_open(e, ROOM, A_DST, ROOM_PAGES, CHUNK_PAGES * PAGE, NULL, &chunks, &key_a));
    CHECK_INT(chunks, 2);
    fprintf(out, "%s %" PRIu64 "\n", addr, key_a);
    fflush(out);

    REQUIRE(fgets(line, sizeof line, in) != NULL); /* "reopen": A's chunk 0 landed, A is canceled */
    /* Chunk 0 of A is scattered (acknowledged writers may still be scattering: wait, bounded), so
     * the release leaves at once and the id can be opened again. */
    kvstage_room_event ev[4];
    memset(ev, 0, sizeof ev);
    ev[0].struct_size = sizeof ev[0];
    size_t n = 0;
    for (int i = 0; i < 1000 && n == 0; ++i) {
        CHECK_OK(kvstage_room_poll_events(e, ROOM, key_a, ev, 4, &n));
        if (n == 0) usleep(10000);
    }
    /* One chunk of two landed: its event, and none for the room (not complete). */
    REQUIRE(n == 1 && ev[0].kind == KVSTAGE_ROOM_EVENT_CHUNK && ev[0].chunk_index == 0 && ev[0].status == KVSTAGE_OK);
    CHECK(ev[0].room_key == key_a); /* the event names its opening */
    CHECK_OK(kvstage_room_release(e, ROOM, key_a));
    /* What the pool holds before B opens: outside B's pages nothing may change from here on. */
    uint8_t *before = (uint8_t *)malloc(2 * LAYERS * p.buffer);
    REQUIRE(before != NULL);
    memcpy(before, p.memory, 2 * LAYERS * p.buffer);
    CHECK_OK(kv_room_open(e, ROOM, B_DST, ROOM_PAGES, CHUNK_PAGES * PAGE, NULL, &chunks, &key_b));
    CHECK(key_b != key_a && key_b != 0);
    fprintf(out, "key %" PRIu64 "\n", key_b);
    fflush(out);

    REQUIRE(fgets(line, sizeof line, in) != NULL); /* "wait": the prefill side sent B */
    if (kvstage_room_wait(e, ROOM, key_b, 20000) != KVSTAGE_OK) kv_print_last_error("room_wait B");
    /* B's events: its two chunks, then the whole request; nothing of A's opening. */
    memset(ev, 0, sizeof ev);
    ev[0].struct_size = sizeof ev[0];
    n = 0;
    CHECK_OK(kvstage_room_poll_events(e, ROOM, key_b, ev, 4, &n));
    CHECK_INT(n, 3);
    for (size_t i = 0; i < n && i < 4; ++i) {
        CHECK(ev[i].room_key == key_b);
        CHECK_INT(ev[i].status, KVSTAGE_OK);
        CHECK_INT(ev[i].kind, i + 1 < n ? KVSTAGE_ROOM_EVENT_CHUNK : KVSTAGE_ROOM_EVENT_ROOM);
    }
    uint64_t bad = 0, stray = 0;
    for (int l = 0; l < LAYERS; ++l)
        for (int kv = 0; kv < 2; ++kv)
            for (uint32_t page = 0; page < CAPACITY; ++page) {
                int in_b = -1;
                for (int i = 0; i < ROOM_PAGES; ++i)
                    if (B_DST[i] == page) in_b = i;
                for (uint32_t t = 0; t < PAGE; ++t)
                    for (int h = 0; h < HEADS; ++h)
                        for (int b = 0; b < HEAD_DIM * DTYPE; ++b) {
                            uint32_t slot = page * PAGE + t;
                            uint8_t got = *at(&p, l, kv, slot, h, b);
                            if (in_b >= 0) {
                                bad += got != pattern(l, kv, B_SRC[in_b] * PAGE + t, h, b);
                            } else {
                                size_t off = (size_t)(at(&p, l, kv, slot, h, b) - p.memory);
                                stray += got != before[off];
                            }
                        }
            }
    fprintf(out, "verified %" PRIu64 " %" PRIu64 "\n", bad, stray);
    fflush(out);
    free(before);
    CHECK_OK(kvstage_room_release(e, ROOM, key_b));
    kvstage_engine_free(e);
    host_pool_free(&p);
    return *kv_failures() ? 1 : 0;
}

/* --- the prefill process ----------------------------------------------------------------------- */

static kvstage_status send_chunk(kvstage_session *s, uint64_t key, const uint32_t *src, uint32_t chunk) {
    kvstage_transfer_desc d;
    REQUIRE(kvstage_transfer_desc_init(&d, sizeof d) == KVSTAGE_OK);
    d.room = ROOM;
    d.room_key = key;
    d.chunk_index = chunk;
    d.src_pages = src + chunk * CHUNK_PAGES;
    d.num_pages = CHUNK_PAGES;
    d.timeout_ms = 10000;
    return kvstage_transfer(s, &d);
}

int main(void) {
    int to_child[2], from_child[2];
    REQUIRE(pipe(to_child) == 0 && pipe(from_child) == 0);
    pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        alarm(120); /* never outlive a failed parent */
        close(to_child[1]);
        close(from_child[0]);
        _exit(decode_main(fdopen(to_child[0], "r"), fdopen(from_child[1], "w")));
    }
    close(to_child[0]);
    close(from_child[1]);
    FILE *cmd = fdopen(to_child[1], "w"), *reply = fdopen(from_child[0], "r");
    REQUIRE(cmd != NULL && reply != NULL);
    char line[256], addr[64];
    uint64_t key_a = 0, key_b = 0;
    REQUIRE(fgets(line, sizeof line, reply) != NULL);
    REQUIRE(sscanf(line, "%63s %" SCNu64, addr, &key_a) == 2);

    host_pool pp[PREFILL_TP];
    kvstage_engine *pe[PREFILL_TP];
    kvstage_session *s[PREFILL_TP];
    for (int r = 0; r < PREFILL_TP; ++r) {
        pool_init(&pp[r], (uint32_t)r, PREFILL_TP);
        fill_prefill(&pp[r]);
        pe[r] = engine_with(&pp[r], 0);
        char id[32];
        snprintf(id, sizeof id, "stale-p%d", r);
        CHECK_OK(kvstage_session_connect(pe[r], addr, id, 10000, &s[r]));
    }
    /* Request A: chunk 0 lands (both writers). */
    for (int r = 0; r < PREFILL_TP; ++r) CHECK_OK(send_chunk(s[r], key_a, A_SRC, 0));
    fputs("reopen\n", cmd);
    fflush(cmd);
    REQUIRE(fgets(line, sizeof line, reply) != NULL);
    REQUIRE(sscanf(line, "key %" SCNu64, &key_b) == 1);

    /* Rank 0's sender of A goes on with A's key: refused as stale, nothing written. */
    for (uint32_t chunk = 0; chunk < 2; ++chunk) {
        CHECK_INT(send_chunk(s[0], key_a, A_SRC, chunk), KVSTAGE_E_STALE_ROOM);
        const kvstage_error *e = kvstage_error_last();
        CHECK_INT(e->code, KVSTAGE_E_STALE_ROOM);
        CHECK_CONTAINS(e->message, "room 7");
        CHECK_STR(e->session, "stale-p0");
    }
    /* Request B with B's key, over the same (surviving) sessions. */
    for (uint32_t chunk = 0; chunk < 2; ++chunk)
        for (int r = 0; r < PREFILL_TP; ++r) CHECK_OK(send_chunk(s[r], key_b, B_SRC, chunk));
    fputs("wait\n", cmd);
    fflush(cmd);
    unsigned long long bad = 1, stray = 1;
    REQUIRE(fgets(line, sizeof line, reply) != NULL);
    REQUIRE(sscanf(line, "verified %llu %llu", &bad, &stray) == 2);
    CHECK_INT(bad, 0);   /* every byte of B's pages is B's */
    CHECK_INT(stray, 0); /* nothing outside B's pages changed since B opened */

    for (int r = 0; r < PREFILL_TP; ++r) {
        kvstage_session_free(s[r]);
        kvstage_engine_free(pe[r]);
        host_pool_free(&pp[r]);
    }
    fclose(cmd);
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    fclose(reply);
    if (*kv_failures()) {
        fprintf(stderr, "%d check(s) failed\n", *kv_failures());
        return 1;
    }
    return 0;
}
