/* The host KV pool of the ctests: its shape, its memory, its fill, its registration.
 *
 * A pool of layout `l` is one allocation of 2 · l.num_layers buffers, layer index i's K buffer at
 * 2i and its V buffer at 2i + 1, each of l.capacity_pages · l.page_size token slots of
 * l.local_heads · l.head_dim · l.dtype_bytes bytes (token-major, as kvstage_kv_layout says).
 *
 *     host_pool p;
 *     kvstage_kv_layout shape = host_pool_shape(LAYERS, HEADS, HEAD_DIM, DTYPE, PAGE, CAPACITY, 0, 1);
 *     host_pool_init(&p, &shape);            // zeroed heap memory (host_pool_init_shared: direct mode)
 *     host_pool_fill(&p, 3);                 // a seeded pattern (0: zeros)
 *     kvstage_engine *e = host_pool_engine(NULL, &p, 1 << 20);  // engine, pool, engine-owned ring
 *     ...
 *     kvstage_engine_free(e);
 *     host_pool_free(&p);
 *
 * A host_pool is not moved or copied once initialised (its layout points into it). Header only
 * (static inline functions); C11 and C++11/17 with -Wall -Wextra -Wpedantic -Werror. */
#ifndef KVSTAGE_HOST_POOL_H
#define KVSTAGE_HOST_POOL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage_check.h"

/* The most layers a host_pool holds (bases arrays are part of the struct). */
#define HOST_POOL_MAX_LAYERS 16

typedef struct host_pool {
    uint8_t *memory; /* every buffer, in one allocation */
    size_t slot;     /* bytes of one token slot of one buffer (one token's heads) */
    size_t buffer;   /* bytes of one buffer (one layer's K or V) */
    size_t bytes;    /* bytes of the allocation: 2 · num_layers · buffer */
    int shared;      /* memory from kvstage_shared_alloc (else the heap) */
    uint64_t k[HOST_POOL_MAX_LAYERS], v[HOST_POOL_MAX_LAYERS];
    kvstage_kv_layout layout; /* the shape given, with k_bases and v_bases set */
} host_pool;

/* An MHA layout without buffers: `layers` layers (ids 0 .. layers-1), `heads` KV heads of the
 * model of `head_dim` elements of `dtype_bytes` bytes, pages of `page_size` tokens, `capacity_pages`
 * pages, TP rank `tp_rank` of `tp_size` (local heads max(1, heads / tp_size)), pipeline stage 0 of 1,
 * host memory. Change any field before host_pool_init (layer_ids, pp_rank, pp_size, ...). */
static inline kvstage_kv_layout host_pool_shape(uint32_t layers, uint32_t heads, uint32_t head_dim, uint32_t dtype_bytes,
                                                uint32_t page_size, uint64_t capacity_pages, uint32_t tp_rank,
                                                uint32_t tp_size) {
    kvstage_kv_layout l;
    memset(&l, 0, sizeof l);
    if (kvstage_kv_layout_init(&l, sizeof l) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_kv_layout_init");
        exit(1);
    }
    l.model_kind = KVSTAGE_MODEL_MHA;
    l.memory_kind = KVSTAGE_MEMORY_HOST;
    l.page_size = page_size;
    l.global_heads = heads;
    l.local_heads = heads / tp_size ? heads / tp_size : 1;
    l.head_dim = head_dim;
    l.dtype_bytes = dtype_bytes;
    l.tp_rank = tp_rank;
    l.tp_size = tp_size;
    l.pp_rank = 0;
    l.pp_size = 1;
    l.layer_ids = NULL;
    l.num_layers = layers;
    l.capacity_pages = capacity_pages;
    return l;
}

/* Sets the bases of `p`'s layout to its buffers in `memory` (of p->bytes bytes). */
static inline void host_pool_place(host_pool *p, const kvstage_kv_layout *shape, uint8_t *memory) {
    size_t l, heads = shape->local_heads ? shape->local_heads : 1;
    REQUIRE(shape->num_layers >= 1 && shape->num_layers <= HOST_POOL_MAX_LAYERS);
    p->layout = *shape;
    p->slot = heads * shape->head_dim * shape->dtype_bytes;
    p->buffer = (size_t)shape->capacity_pages * shape->page_size * p->slot;
    p->bytes = 2 * shape->num_layers * p->buffer;
    p->memory = memory;
    for (l = 0; l < shape->num_layers; ++l) {
        p->k[l] = (uint64_t)(uintptr_t)(memory + (2 * l) * p->buffer);
        p->v[l] = (uint64_t)(uintptr_t)(memory + (2 * l + 1) * p->buffer);
    }
    p->layout.k_bases = p->k;
    p->layout.v_bases = p->v;
    if (kvstage_kv_layout_validate(&p->layout) != KVSTAGE_OK) {
        kv_print_last_error("host_pool: kvstage_kv_layout_validate");
        exit(1);
    }
}

/* A pool of `shape` in zeroed heap memory. */
static inline void host_pool_init(host_pool *p, const kvstage_kv_layout *shape) {
    size_t heads = shape->local_heads ? shape->local_heads : 1;
    size_t bytes = 2 * shape->num_layers * (size_t)shape->capacity_pages * shape->page_size * heads * shape->head_dim *
                   shape->dtype_bytes;
    uint8_t *memory = (uint8_t *)calloc(1, bytes);
    REQUIRE(memory != NULL);
    p->shared = 0;
    host_pool_place(p, shape, memory);
}

/* A pool of `shape` in zeroed memory of kvstage_shared_alloc (a same-host sender maps it: direct
 * mode). Freed by host_pool_free, which the library refuses while a peer may map it. */
static inline void host_pool_init_shared(host_pool *p, const kvstage_kv_layout *shape) {
    size_t heads = shape->local_heads ? shape->local_heads : 1;
    size_t bytes = 2 * shape->num_layers * (size_t)shape->capacity_pages * shape->page_size * heads * shape->head_dim *
                   shape->dtype_bytes;
    void *memory = NULL;
    if (kvstage_shared_alloc(bytes, &memory) != KVSTAGE_OK) {
        kv_print_last_error("kvstage_shared_alloc");
        exit(1);
    }
    memset(memory, 0, bytes);
    p->shared = 1;
    host_pool_place(p, shape, (uint8_t *)memory);
}

/* Frees the pool's memory (a failed check when kvstage refuses to free shared memory). */
static inline void host_pool_free(host_pool *p) {
    if (p->shared)
        CHECK_OK(kvstage_shared_free(p->memory));
    else
        free(p->memory);
    p->memory = NULL;
}

/* splitmix64: the fill's word generator (no kvstage code involved). */
static inline uint64_t host_pool_mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The byte the fill of `seed` (nonzero) puts at `offset` of a pool's allocation: distinct from
 * page to page and buffer to buffer (a hash of the seed and the 8-byte word's index). */
static inline uint8_t host_pool_byte(uint64_t seed, size_t offset) {
    uint64_t word = host_pool_mix(seed << 40 ^ (uint64_t)(offset / 8));
    return (uint8_t)(word >> (8 * (offset % 8)));
}

/* Fills every byte of the pool with the pattern of `seed` (host_pool_byte); seed 0: zeros. */
static inline void host_pool_fill(host_pool *p, uint64_t seed) {
    size_t i, j;
    if (seed == 0) {
        memset(p->memory, 0, p->bytes);
        return;
    }
    for (i = 0; i < p->bytes; i += 8) { /* host_pool_byte, a word at a time */
        uint64_t word = host_pool_mix(seed << 40 ^ (uint64_t)(i / 8));
        for (j = 0; j < 8 && i + j < p->bytes; ++j) p->memory[i + j] = (uint8_t)(word >> (8 * j));
    }
}

/* Token slot `slot` of the buffer `kv` (0: K, 1: V) of layer index `layer` (into the pool's
 * layers, not a model layer id): its first byte. */
static inline uint8_t *host_pool_at(const host_pool *p, size_t layer, int kv, size_t slot) {
    return p->memory + (2 * layer + (size_t)(kv != 0)) * p->buffer + slot * p->slot;
}

/* kvstage_pool_register of the pool's layout. */
static inline int host_pool_register(const kvstage_engine *engine, const host_pool *p) {
    return (int)kvstage_pool_register(engine, &p->layout);
}

/* A new engine (`options`, NULL: defaults) with `p` registered as its pool and, when `ring_bytes`
 * is not 0, an engine-owned host staging ring of that size. Exits on any failure. */
static inline kvstage_engine *host_pool_engine(const kvstage_engine_options *options, const host_pool *p, size_t ring_bytes) {
    kvstage_engine *e = NULL;
    if (kvstage_engine_new(options, &e) != KVSTAGE_OK) {
        kv_print_last_error("host_pool_engine: kvstage_engine_new");
        exit(1);
    }
    if (host_pool_register(e, p) != KVSTAGE_OK) {
        kv_print_last_error("host_pool_engine: kvstage_pool_register");
        exit(1);
    }
    if (ring_bytes != 0 && kv_staging_register(e, NULL, ring_bytes) != KVSTAGE_OK) {
        kv_print_last_error("host_pool_engine: kvstage_staging_register");
        exit(1);
    }
    return e;
}

#endif /* KVSTAGE_HOST_POOL_H */
