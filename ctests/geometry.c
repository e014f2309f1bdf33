/* Geometry from C: kvstage_head_slice_compute(docs/GEOMETRY.md examples, bad input names the argument and
 * leaves *out untouched), kvstage_staging_layout_compute(count query, too-small array, filled entries,
 * errors naming the layout and field; writers per chunk), kvstage_kv_layout_init/validate, the chunk
 * grid and a chunk's span from a room's grid. Also built as C++17. */
#include <stddef.h>
#include "kvstage_check.h"

static void check_error(int status, int expected, const char *needle, int line) {
    const kvstage_error *e = kvstage_error_last();
    if (status != expected || status >= 0 || (int)e->code != expected || strstr(e->message, needle) == NULL) {
        KV_FAIL_AT(__FILE__, line, "status %d (expected %d), message \"%s\" (expected to contain \"%s\")",
                   status, expected, e->message, needle);
    }
}
#define CHECK_ERROR(call, expected, needle) check_error((int)(call), (int)(expected), (needle), __LINE__)

static kvstage_kv_layout layout(uint32_t tp_rank, uint32_t tp_size, size_t num_layers) {
    kvstage_kv_layout l;
    memset(&l, 0, sizeof l);
    CHECK_OK(kvstage_kv_layout_init(&l, sizeof l));
    CHECK_INT(l.struct_size, sizeof(kvstage_kv_layout));
    CHECK_INT(l.model_kind, KVSTAGE_MODEL_MHA);
    CHECK_INT(l.memory_kind, KVSTAGE_MEMORY_HOST);
    CHECK_INT(l.local_heads, 0); /* derived from global_heads and tp_size unless set */
    l.page_size = 16;
    l.global_heads = 8;
    l.local_heads = 8 / tp_size;
    l.head_dim = 128;
    l.dtype_bytes = 2;
    l.tp_rank = tp_rank;
    l.tp_size = tp_size;
    l.layer_ids = NULL; /* layers 0 .. num_layers-1 */
    l.num_layers = num_layers;
    return l;
}

int main(void) {
    kvstage_head_slice hs;
    uint32_t rank, n = 0;
    static const uint32_t p4d2[4] = {0, 2, 0, 2}, p1d4[4] = {0, 0, 1, 1};

    /* docs/GEOMETRY.md: P4->D2, H=8: dst_start for prefill ranks 0..3 = [0, 2, 0, 2], n = 2. */
    for (rank = 0; rank < 4; rank++) {
        CHECK_OK(kvstage_head_slice_compute(4, 2, rank, rank / 2, 8, &hs));
        CHECK_INT(hs.src_head_start, 0);
        CHECK_INT(hs.num_heads, 2);
        CHECK_INT(hs.dst_head_start, p4d2[rank]);
    }
    /* P2->D4, H=8: src_start for decode ranks 0..3 = [0, 2, 0, 2]. */
    for (rank = 0; rank < 4; rank++) {
        CHECK_OK(kvstage_head_slice_compute(2, 4, rank / 2, rank, 8, &hs));
        CHECK_INT(hs.src_head_start, p4d2[rank]);
        CHECK_INT(hs.num_heads, 2);
    }
    /* P1->D4, H=2 (replication): src_start = [0, 0, 1, 1], n = 1. */
    for (rank = 0; rank < 4; rank++) {
        CHECK_OK(kvstage_head_slice_compute(1, 4, 0, rank, 2, &hs));
        CHECK_INT(hs.src_head_start, p1d4[rank]);
        CHECK_INT(hs.num_heads, 1);
    }
    /* Equal TP: (0, H/tp, 0). */
    CHECK_OK(kvstage_head_slice_compute(4, 4, 3, 3, 8, &hs));
    CHECK_INT(hs.src_head_start, 0);
    CHECK_INT(hs.num_heads, 2);
    CHECK_INT(hs.dst_head_start, 0);

    /* Bad input: a negative code, a message naming the argument, *out untouched. */
    hs.src_head_start = 77;
    CHECK_ERROR(kvstage_head_slice_compute(4, 2, 4, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "`src_rank`");
    CHECK_ERROR(kvstage_head_slice_compute(4, 2, 0, 2, 8, &hs), KVSTAGE_E_INVALID_ARG, "`dst_rank`");
    CHECK_ERROR(kvstage_head_slice_compute(0, 2, 0, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "`src_tp`");
    CHECK_ERROR(kvstage_head_slice_compute(4, 2, 0, 0, 6, &hs), KVSTAGE_E_INVALID_ARG, "`total_kv_heads`");
    CHECK_ERROR(kvstage_head_slice_compute(4, 2, 2, 0, 8, &hs), KVSTAGE_E_INVALID_ARG, "does not write to decode rank 0");
    CHECK_ERROR(kvstage_head_slice_compute(4, 2, 0, 0, 8, NULL), KVSTAGE_E_INVALID_ARG, "`out`");
    CHECK_INT(hs.src_head_start, 77);

    CHECK_OK(kvstage_grid_tokens_compute(8200, 64, &n));
    CHECK_INT(n, 8192);
    CHECK_INT(KVSTAGE_DEFAULT_CHUNK_TOKENS, 8192);
    CHECK_ERROR(kvstage_grid_tokens_compute(8192, 0, &n), KVSTAGE_E_INVALID_ARG, "`page_size`");

    {
        /* Prefill pages of 64, decode pages of 16, 16 tokens cached on the decode side, chunks of
           128: chunk 1 is request tokens 144..272, from slot 16 of prefill page 2 on. The decode
           side's numbers come in its room's grid (as kvstage_room_open and
           kvstage_session_room_grid_get give it): 284 new tokens in 18 pages, 3 chunks. */
        kvstage_room_grid g;
        kvstage_chunk_span sp;
        memset(&g, 0, sizeof g);
        g.struct_size = sizeof g;
        g.key = 1;
        g.chunk_tokens = 128;
        g.num_chunks = 3;
        g.num_pages = 18;
        g.page_size = 16;
        g.prefix_tokens = 16;
        memset(&sp, 0, sizeof sp);
        sp.struct_size = sizeof sp;
        CHECK_OK(kvstage_chunk_span_compute(&g, 300, 64, 1, &sp));
        CHECK_INT(sp.num_chunks, 3);
        CHECK_INT(sp.first_token, 144);
        CHECK_INT(sp.num_tokens, 128);
        CHECK_INT(sp.src_first_page, 2);
        CHECK_INT(sp.src_num_pages, 3);
        CHECK_INT(sp.src_token_offset, 16);
        CHECK_INT(sp.dst_first_page, 8);
        CHECK_INT(sp.dst_num_pages, 8);
        CHECK_OK(kvstage_chunk_span_compute(&g, 300, 64, 2, &sp));
        CHECK_INT(sp.num_tokens, 28);
        CHECK_INT(sp.dst_num_pages, 2);
        CHECK_ERROR(kvstage_chunk_span_compute(&g, 300, 64, 3, &sp), KVSTAGE_E_INVALID_ARG, "`chunk_index`: 3 is past");
        g.prefix_tokens = 8;
        g.num_pages = 19;
        CHECK_ERROR(kvstage_chunk_span_compute(&g, 300, 64, 0, &sp), KVSTAGE_E_INVALID_ARG, "not whole decode pages");
    }

    {
        /* 70B-shaped, P4->D2, 8192 tokens: 2 writers of 640 MiB. */
        kvstage_kv_layout src = layout(0, 4, 80), dst = layout(1, 2, 80);
        kvstage_staging_layout out;
        kvstage_staging_writer w[3], one[1];
        kvstage_kv_layout stages[1]; /* a plain array of layouts (no pointers, no const to cast) */
        const kvstage_error *e;
        stages[0] = src;
        memset(&out, 0, sizeof out);
        memset(w, 0, sizeof w);
        memset(one, 0, sizeof one);
        w[0].struct_size = sizeof w[0]; /* writer arrays: the caller's element size in the first */
        one[0].struct_size = sizeof one[0];
        out.struct_size = sizeof out;
        CHECK_OK(kvstage_staging_layout_compute(stages, 1, &dst, NULL, 0, NULL, 0, 8192, &out, NULL, 0)); /* count query */
        CHECK_INT(out.num_writers, 2);
        CHECK_INT(out.total_bytes, 1280ull << 20);
        CHECK_INT(out.row_bytes, 512);
        CHECK_INT(out.slab_bytes, 8192ull * 512);
        CHECK_INT(out.buffers_per_layer, 2);
        out.num_writers = 0;
        CHECK_ERROR(kvstage_staging_layout_compute(stages, 1, &dst, NULL, 0, NULL, 0, 8192, &out, one, 1), KVSTAGE_E_INVALID_ARG, "`writers_len`");
        CHECK_INT(out.num_writers, 2); /* the required count is reported */
        CHECK_OK(kvstage_staging_layout_compute(stages, 1, &dst, NULL, 0, NULL, 0, 8192, &out, w, 3));
        CHECK_INT(w[1].offset, 640ull << 20);
        CHECK_INT(w[1].bytes, 640ull << 20);
        CHECK_INT(w[1].layers, 80);
        CHECK_INT(w[1].src_tp_rank, 3);
        CHECK_INT(w[1].num_heads, 2);
        CHECK_INT(w[1].dst_head_start, 2);

        dst.local_heads = 2; /* should be 4 on a TP-2 rank of 8 heads */
        CHECK_ERROR(kvstage_staging_layout_compute(stages, 1, &dst, NULL, 0, NULL, 0, 8192, &out, w, 3), KVSTAGE_E_GEOMETRY_INVALID, "`dst`");
        e = kvstage_error_last();
        REQUIRE(e->cause_count >= 1);
        CHECK_CONTAINS(e->causes[0], "`local_heads`: 2 != 4");
        dst.local_heads = 0; /* derived: max(1, 8 / 2) = 4, the same layout as above */
        memset(w, 0xAB, sizeof w);
        w[0].struct_size = sizeof w[0];
        CHECK_OK(kvstage_staging_layout_compute(stages, 1, &dst, NULL, 0, NULL, 0, 8192, &out, w, 3));
        CHECK_INT(w[1].struct_size, sizeof w[1]); /* every element written whole, at the caller's stride */
        CHECK_INT(w[1].bytes, 640ull << 20);
        CHECK_INT(w[1].num_heads, 2);
        CHECK_INT(w[1].dst_head_start, 2);
        dst.local_heads = 4;
        dst.head_dim = 64;
        CHECK_ERROR(kvstage_staging_layout_compute(stages, 1, &dst, NULL, 0, NULL, 0, 8192, &out, w, 3), KVSTAGE_E_GEOMETRY_MISMATCH, "mismatch");
        e = kvstage_error_last();
        REQUIRE(e->cause_count == 1);
        CHECK_STR(e->causes[0], "head_dim: local 64 != remote 128"); /* local: the decode rank */
    }
    {
        /* TP sizes that do not divide one another: P3->D2 with 12 heads. Decode rank 0 takes heads
         * 0..4 from prefill rank 0 and 4..6 from prefill rank 1: two regions of different sizes,
         * each with its own slab bytes; the layout-wide row sizes are 0. */
        kvstage_kv_layout src = layout(0, 3, 2), dst = layout(0, 2, 2);
        kvstage_staging_layout out;
        kvstage_staging_writer w[2];
        const uint64_t head = 128 * 2, tokens = 64;
        src.global_heads = dst.global_heads = 12;
        src.local_heads = 4;
        dst.local_heads = 6;
        memset(w, 0, sizeof w);
        w[0].struct_size = sizeof w[0];
        memset(&out, 0, sizeof out);
        out.struct_size = sizeof out;
        CHECK_OK(kvstage_staging_layout_compute(&src, 1, &dst, NULL, 0, NULL, 0, (uint32_t)tokens, &out, w, 2));
        CHECK_INT(out.num_writers, 2);
        CHECK_INT(out.num_heads, 0);
        CHECK_INT(out.row_bytes, 0);
        CHECK_INT(out.slab_bytes, 0);
        CHECK_INT(w[0].num_heads, 4);
        CHECK_INT(w[1].num_heads, 2);
        CHECK_INT(w[1].src_tp_rank, 1);
        CHECK_INT(w[1].dst_head_start, 4);
        CHECK_INT(w[0].slab_bytes, tokens * 4 * head);
        CHECK_INT(w[1].v_slab_bytes, tokens * 2 * head);
        CHECK_INT(w[1].bytes, 2 * 2 * w[1].slab_bytes);
        CHECK_INT(w[1].offset, w[0].bytes);
        CHECK_INT(out.total_bytes, tokens * 6 * head * 2 * 2);
        /* A writer array of a header older than the per-writer slab sizes cannot place these. */
        w[0].struct_size = offsetof(kvstage_staging_writer, slab_bytes);
        CHECK_ERROR(kvstage_staging_layout_compute(&src, 1, &dst, NULL, 0, NULL, 0, (uint32_t)tokens, &out, w, 2), KVSTAGE_E_INVALID_ARG,
                    "`writers[0].struct_size`");
        CHECK_INT(out.num_writers, 2);
        /* Prefill rank 1 sends its other two heads (local 2..4) to decode rank 1's 0..2. */
        CHECK_OK(kvstage_head_slice_compute(3, 2, 1, 1, 12, &hs));
        CHECK_INT(hs.src_head_start, 2);
        CHECK_INT(hs.num_heads, 2);
        CHECK_INT(hs.dst_head_start, 0);
        CHECK_ERROR(kvstage_head_slice_compute(3, 2, 2, 0, 12, &hs), KVSTAGE_E_INVALID_ARG, "its writers are prefill ranks 0..2");
    }
    {
        /* Uneven pipeline stages: 4 + 3 layers (ids 0..3 and 4..6) into one decode rank of 7. */
        uint32_t first[4] = {0, 1, 2, 3}, second[3] = {4, 5, 6};
        kvstage_kv_layout s0 = layout(0, 1, 4), s1 = layout(0, 1, 3), dst = layout(0, 1, 7);
        kvstage_kv_layout stages[2];
        kvstage_staging_layout out;
        kvstage_staging_writer w[2];
        memset(w, 0, sizeof w);
        w[0].struct_size = sizeof w[0];
        s0.layer_ids = first;
        s0.pp_size = 2;
        s1.layer_ids = second;
        s1.pp_rank = 1;
        s1.pp_size = 2;
        stages[0] = s0;
        stages[1] = s1;
        memset(&out, 0, sizeof out);
        out.struct_size = sizeof out;
        CHECK_OK(kvstage_staging_layout_compute(stages, 2, &dst, NULL, 0, NULL, 0, 64, &out, w, 2));
        CHECK_INT(out.num_writers, 2);
        CHECK_INT(out.num_tp_writers, 1);
        CHECK_INT(w[0].layers, 4);
        CHECK_INT(w[1].layers, 3);
        CHECK_INT(w[1].src_pp_rank, 1);
        CHECK_INT(w[1].offset, w[0].bytes);
        CHECK_INT(out.total_bytes, w[0].bytes + w[1].bytes);
        /* Stage 1 missing: layers 4..6 of the decode rank are held by nobody. */
        stages[0].pp_size = 1;
        CHECK_ERROR(kvstage_staging_layout_compute(stages, 1, &dst, NULL, 0, NULL, 0, 64, &out, w, 2), KVSTAGE_E_GEOMETRY_MISMATCH, "do not cover");
    }
    {
        /* A complete layout with (fake, never dereferenced) addresses: validate checks them. */
        kvstage_kv_layout l = layout(0, 2, 2);
        uint64_t bytes = 4ull * 16 * 4 * 128 * 2;
        uint64_t k[2], v[2];
        k[0] = 0x100000;
        k[1] = k[0] + bytes;
        v[0] = k[0] + 2 * bytes;
        v[1] = k[0] + 3 * bytes;
        l.capacity_pages = 4;
        l.k_bases = k;
        l.v_bases = v;
        CHECK_OK(kvstage_kv_layout_validate(&l));
        v[1] = v[0] + 64;
        CHECK_ERROR(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`");
        v[1] = 0;
        CHECK_ERROR(kvstage_kv_layout_validate(&l), KVSTAGE_E_GEOMETRY_INVALID, "`layout`");
        l.model_kind = 9;
        CHECK_ERROR(kvstage_kv_layout_validate(&l), KVSTAGE_E_INVALID_ARG, "`layout->model_kind`");
        CHECK_ERROR(kvstage_kv_layout_validate(NULL), KVSTAGE_E_INVALID_ARG, "`layout`");
    }
    {
        /* Pairing: prefill stages holding 4 and 3 of 7 layers (TP 2) into one decode stage (TP 1). */
        static const uint32_t first[4] = {0, 1, 2, 3}, second[3] = {4, 5, 6};
        kvstage_kv_layout p0 = layout(0, 2, 4), p1 = layout(1, 2, 3), d = layout(0, 1, 7);
        kvstage_kv_layout prefill_stages[2], decode_stages[1];
        kvstage_rank ranks[8];
        size_t count = 0;
        p0.pp_size = p1.pp_size = 2;
        p1.pp_rank = 1;
        p0.layer_ids = first;
        p1.layer_ids = second;
        prefill_stages[0] = p0;
        prefill_stages[1] = p1;
        decode_stages[0] = d;
        CHECK_OK(kvstage_pairing_decode_ranks(&p1, NULL, 0, decode_stages, 1, ranks, 8, &count));
        CHECK_INT(count, 1);
        CHECK_INT(ranks[0].tp_rank, 0);
        CHECK_INT(ranks[0].pp_rank, 0);
        /* The decode rank is written by both TP ranks of both stages; out NULL and capacity 0 is a
         * count query: OK, the count set, no error left behind. */
        CHECK_OK(kvstage_pairing_prefill_ranks(&d, NULL, 0, prefill_stages, 2, NULL, 0, &count));
        CHECK_INT(count, 4);
        CHECK_INT(kvstage_error_last()->code, KVSTAGE_OK);
        CHECK_ERROR(kvstage_pairing_prefill_ranks(&d, NULL, 0, prefill_stages, 2, NULL, 0, NULL), KVSTAGE_E_INVALID_ARG, "`count`");
        CHECK_ERROR(kvstage_pairing_prefill_ranks(&d, NULL, 0, prefill_stages, 2, ranks, 1, &count), KVSTAGE_E_INVALID_ARG, "`capacity`");
        CHECK_INT(count, 4);
        CHECK_OK(kvstage_pairing_prefill_ranks(&d, NULL, 0, prefill_stages, 2, ranks, count, &count));
        CHECK_INT(ranks[1].tp_rank, 1);
        CHECK_INT(ranks[1].pp_rank, 0);
        CHECK_INT(ranks[2].tp_rank, 0);
        CHECK_INT(ranks[2].pp_rank, 1);
        /* Stages out of order are named. */
        prefill_stages[0] = p1;
        prefill_stages[1] = p0;
        CHECK_ERROR(kvstage_pairing_prefill_ranks(&d, NULL, 0, prefill_stages, 2, ranks, 8, &count), KVSTAGE_E_INVALID_ARG,
                    "`prefill_stages[0]`");
        CHECK_ERROR(kvstage_pairing_decode_ranks(&p0, NULL, 0, NULL, 1, ranks, 8, &count), KVSTAGE_E_INVALID_ARG,
                    "`decode_stages`");
        /* Every stage must come from the same header: a differing struct_size is named. */
        prefill_stages[0] = p0;
        prefill_stages[1] = p1;
        prefill_stages[1].struct_size += 8;
        CHECK_ERROR(kvstage_pairing_prefill_ranks(&d, NULL, 0, prefill_stages, 2, ranks, 8, &count), KVSTAGE_E_INVALID_ARG,
                    "`prefill_stages[1].struct_size`");
        /* Writers per chunk (kvstage_staging_layout_compute's num_writers). MHA, 8 heads, prefill
         * TP 8 in 2 stages into decode TP 2, 1 stage: 4 head groups from each stage. */
        static const uint32_t low[4] = {0, 1, 2, 3}, high[4] = {4, 5, 6, 7};
        kvstage_kv_layout w0 = layout(0, 8, 4), w1 = layout(0, 8, 4), wd = layout(0, 2, 8);
        kvstage_kv_layout wstages[2];
        kvstage_staging_layout out;
        memset(&out, 0, sizeof out);
        out.struct_size = sizeof out;
        w0.layer_ids = low;
        w1.layer_ids = high;
        w0.pp_size = w1.pp_size = 2;
        w1.pp_rank = 1;
        wstages[0] = w0;
        wstages[1] = w1;
        CHECK_OK(kvstage_staging_layout_compute(wstages, 2, &wd, NULL, 0, NULL, 0, 64, &out, NULL, 0));
        CHECK_INT(out.num_writers, 8);
        CHECK_INT(out.num_tp_writers, 4);
        /* MLA: one designated TP writer per decode rank and stage, whatever the TP sizes. */
        for (int i = 0; i < 2; ++i) {
            wstages[i].model_kind = KVSTAGE_MODEL_MLA;
            wstages[i].global_heads = 1;
            wstages[i].local_heads = 1;
            wstages[i].head_dim = 576;
        }
        wd.model_kind = KVSTAGE_MODEL_MLA;
        wd.global_heads = 1;
        wd.local_heads = 1;
        wd.head_dim = 576;
        CHECK_OK(kvstage_staging_layout_compute(wstages, 2, &wd, NULL, 0, NULL, 0, 64, &out, NULL, 0));
        CHECK_INT(out.num_writers, 2);
        CHECK_INT(out.buffers_per_layer, 1);
        wstages[0].model_kind = 7;
        CHECK_ERROR(kvstage_staging_layout_compute(wstages, 2, &wd, NULL, 0, NULL, 0, 64, &out, NULL, 0), KVSTAGE_E_INVALID_ARG, "model_kind");
        /* Prefill-side replication (TP 8, 4 KV heads) into TP 2: one writer per head group. */
        kvstage_kv_layout r0 = layout(0, 8, 8), rd = layout(0, 2, 8);
        r0.global_heads = rd.global_heads = 4;
        r0.local_heads = 1;
        rd.local_heads = 2;
        CHECK_OK(kvstage_staging_layout_compute(&r0, 1, &rd, NULL, 0, NULL, 0, 64, &out, NULL, 0));
        CHECK_INT(out.num_writers, 2);
        {
            /* The same replication pair by pair: prefill ranks 0 and 1 hold head 0 (one each);
             * rank 0 sends it to decode rank 0, rank 1 sends nothing (the pairing helper leaves it
             * out): an error naming the rank that sends. Rank 2 sends head 1. */
            kvstage_head_slice hs;
            CHECK_OK(kvstage_head_slice_compute(8, 2, 0, 0, 4, &hs));
            CHECK_INT(hs.num_heads, 1);
            CHECK_ERROR(kvstage_head_slice_compute(8, 2, 1, 0, 4, &hs), KVSTAGE_E_INVALID_ARG, "prefill rank 0 holds the same heads");
            CHECK_OK(kvstage_head_slice_compute(8, 2, 2, 0, 4, &hs));
            CHECK_INT(hs.dst_head_start, 1);
        }
    }
    {
        /* A conv state of 4 rows, groups key, key, value (8, 8, 16 elements of 2 bytes), prefill
         * TP 2 into decode TP 1: prefill rank 1 holds elements 4..8, 12..16 and 24..32 of each
         * row, 3 ranges a row (adjacent ones merged), its share lands at those places. */
        static const uint32_t groups[3] = {8, 8, 16};
        kvstage_state_item item;
        kvstage_byte_range r[16];
        size_t count = 0;
        CHECK_OK(kvstage_state_item_init(&item, sizeof item));
        item.outer = 4;
        item.dtype_bytes = 2;
        item.group_dims = groups;
        item.num_groups = 3;
        CHECK_OK(kvstage_state_slice_compute(&item, 2, 1, 1, 0, NULL, 0, &count)); /* count query */
        CHECK_INT(count, 12);
        CHECK_ERROR(kvstage_state_slice_compute(&item, 2, 1, 1, 0, r, 4, &count), KVSTAGE_E_INVALID_ARG, "`capacity`");
        CHECK_OK(kvstage_state_slice_compute(&item, 2, 1, 1, 0, r, 16, &count));
        CHECK_INT(r[0].src_offset, 0);
        CHECK_INT(r[0].dst_offset, 8);
        CHECK_INT(r[0].len, 8);
        CHECK_INT(r[2].src_offset, 16);
        CHECK_INT(r[2].dst_offset, 48);
        CHECK_INT(r[2].len, 16);
        CHECK_INT(r[3].dst_offset, 64 + 8); /* row 1 of the decode slot (32 elements a row) */
        /* Equal TP: the whole slot in one range; prefill 2 into decode 4: rank 0 has nothing for 3. */
        CHECK_OK(kvstage_state_slice_compute(&item, 2, 2, 1, 1, r, 16, &count));
        CHECK_INT(count, 1);
        CHECK_INT(r[0].len, 4 * 16 * 2);
        CHECK_OK(kvstage_state_slice_compute(&item, 2, 4, 0, 3, r, 16, &count));
        CHECK_INT(count, 0);
        /* Replicated (an SSM state kept whole): once, from prefill rank dst * src_tp / dst_tp. */
        item.replicated = 1;
        CHECK_OK(kvstage_state_slice_compute(&item, 4, 8, 2, 5, r, 16, &count));
        CHECK_INT(count, 1);
        CHECK_INT(r[0].len, 4 * 32 * 2);
        CHECK_OK(kvstage_state_slice_compute(&item, 4, 8, 1, 5, r, 16, &count));
        CHECK_INT(count, 0);
        /* A group that does not split among the ranks is named with both values. */
        item.replicated = 0;
        CHECK_ERROR(kvstage_state_slice_compute(&item, 16, 1, 0, 0, r, 16, &count), KVSTAGE_E_INVALID_ARG, "`group_dims[0]`");
        CHECK_CONTAINS(kvstage_error_last()->message, "8 elements do not split among src_tp 16");
    }
    return kv_finish("geometry");
}
