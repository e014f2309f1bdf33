// kvstage gather/scatter kernels: one launch moves every (slab, token) row of a CopyPlan piece
// (and direct mode's across kernel: pool rows to pool rows, see KvAcross).
//
// The plan is the one src/geometry/plan.rs builds for the host engine, uploaded as flat arrays:
//   slab_buffer[s], slab_offset[s]  the slab's pool buffer index and its staging byte offset
//   seg_start[g] (g <= nseg)        staging token where segment g starts; seg_start[nseg] = tokens
//   seg_pool[g]                     byte offset in a pool buffer of segment g's first token
// Row (s, t): pool  bases[slab_buffer[s]] + pool_at(t) + pool_head_offset, where pool_at(t) =
//                   seg_pool[g] + (t - seg_start[g]) * pool_token_stride (a segment's tokens are
//                   evenly spaced: one page, or adjacent pages of evenly spaced pages)
//             stage staging + slab_offset[s] + t * row_bytes,        row_bytes bytes each,
// each row `row_bytes / piece_bytes` pieces, pool_piece_stride apart in the pool (heads a pool
// puts apart, as head-major pages do) and packed in staging.
//
// Grid: x = tiles of TILE staging tokens, y = groups of SLABS slabs (both grid-stride). A block
// first maps its TILE tokens to pool token slots (binary search over seg_start, into shared
// memory), then copies TILE x SLABS rows. When the pool rows are whole token slots back to back
// (all local heads of a token-major pool, or MLA latent pages) and the tile lies inside one
// segment, a slab's tile is one flat range on both sides and all threads copy it as such (the page
// copy); otherwise each piece of a row is copied by a group of `bx` threads (the strided copy).
//
// Vector width: V bytes per access, V in {16, 8, 4, 2, 1}; the host picks the widest V dividing
// every base, the staging address, the pool strides and offsets, row_bytes and piece_bytes (16 is
// the aligned fast path, the others the generic path).
//
// Compiled to PTX by scripts/gen-ptx.sh with Debian's clang (no CUDA headers, no CUDA toolkit):
// keep to plain C++ and clang builtins. The CPU tests compile this same file as host C++ under
// an emulator (emu_harness.cpp) that predefines the macros below and the builtins used.

#ifndef KV_GLOBAL
#define KV_GLOBAL extern "C" __attribute__((global))
#define KV_DEVICE static __attribute__((device)) inline
#define KV_SHARED __attribute__((shared))
#define KV_LAUNCH_BOUNDS(n) __attribute__((launch_bounds(n)))
// Global address space: ld.global/st.global instead of generic accesses.
#define KV_AS_GLOBAL __attribute__((address_space(1)))
#endif

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#ifndef KV_V4_DEFINED
typedef u32 v4u32 __attribute__((ext_vector_type(4)));
#endif

#define TILE 32u
#define SLABS 4u
#define THREADS 256u

struct KvJob {
    const u64 *bases;
    const u64 *slab_buffer;
    const u64 *slab_offset;
    const u64 *seg_start;
    const u64 *seg_pool;
    u64 staging;
    u64 nslab;
    u64 nseg;
    u64 tokens;
    u64 pool_token_stride;
    u64 pool_head_offset;
    u64 row_bytes;
    u64 piece_bytes;
    u64 pool_piece_stride;
};

KV_DEVICE u32 tid_x() { return __nvvm_read_ptx_sreg_tid_x(); }
KV_DEVICE u32 ctaid_x() { return __nvvm_read_ptx_sreg_ctaid_x(); }
KV_DEVICE u32 ctaid_y() { return __nvvm_read_ptx_sreg_ctaid_y(); }
KV_DEVICE u32 nctaid_x() { return __nvvm_read_ptx_sreg_nctaid_x(); }
KV_DEVICE u32 nctaid_y() { return __nvvm_read_ptx_sreg_nctaid_y(); }

// Byte offset in a pool buffer of staging token t: in the last segment starting at or before t.
KV_DEVICE u64 pool_at(const KvJob &j, u64 t) {
    u64 lo = 0, hi = j.nseg;  // seg_start[lo] <= t < seg_start[hi]
    while (hi - lo > 1) {
        u64 mid = lo + (hi - lo) / 2;
        if (j.seg_start[mid] <= t) lo = mid; else hi = mid;
    }
    return j.seg_pool[lo] + (t - j.seg_start[lo]) * j.pool_token_stride;
}

// Units [first, units) step `step` of one flat range, four loads in flight before the stores.
template <typename T, bool GATHER>
KV_DEVICE void copy_flat(u64 pool, u64 stage, u64 first, u64 units, u64 step) {
    const KV_AS_GLOBAL T *src = (const KV_AS_GLOBAL T *)(GATHER ? pool : stage);
    KV_AS_GLOBAL T *dst = (KV_AS_GLOBAL T *)(GATHER ? stage : pool);
    u64 k = first;
    for (; k + 3 * step < units; k += 4 * step) {
        T a = src[k], b = src[k + step], c = src[k + 2 * step], d = src[k + 3 * step];
        dst[k] = a;
        dst[k + step] = b;
        dst[k + 2 * step] = c;
        dst[k + 3 * step] = d;
    }
    for (; k < units; k += step) dst[k] = src[k];
}

#define BATCH 4

// Threads per row for rows of `row_units` units: a power of two <= 32, smaller for short rows.
KV_DEVICE u32 threads_per_row(u64 row_units) {
    u32 bx = 32;
    while (bx > 1 && (u64)(bx / 2) >= row_units) bx /= 2;
    return bx;
}

// Strided copy of the rows [0, rows) of slabs [s0, s0 + ns) of one tile, each row `pieces`
// pieces of `unit_count` units: `bx` threads per piece, BATCH pieces of `THREADS / bx` in flight
// per thread; `at(s, r, p, src, dst)` sets piece p of row (s, r)'s two addresses.
template <typename T, typename At>
KV_DEVICE void copy_rows(u64 s0, u64 ns, u64 rows, u64 pieces, u64 row_units, At at) {
    const u32 tid = tid_x();
    const u32 bx = threads_per_row(row_units), by = THREADS / bx;
    const u32 tx = tid % bx, ty = tid / bx;
    const u64 n = ns * TILE * pieces;
    for (u64 i0 = ty; i0 < n; i0 += BATCH * by) {
        u64 src[BATCH], dst[BATCH];
        bool ok[BATCH];
#pragma unroll
        for (u32 q = 0; q < BATCH; ++q) {
            const u64 i = i0 + q * by, row = i / pieces;
            const u64 s = s0 + row / TILE, r = row % TILE;
            ok[q] = i < n && r < rows;
            src[q] = 0;
            dst[q] = 0;
            if (ok[q]) at(s, r, i % pieces, src[q], dst[q]);
        }
        for (u64 k = tx; k < row_units; k += bx) {
            // Read and written only where ok[q]; zeroed because gcc at -O3 cannot see that.
            T v[BATCH] = {};
#pragma unroll
            for (u32 q = 0; q < BATCH; ++q)
                if (ok[q]) v[q] = ((const KV_AS_GLOBAL T *)src[q])[k];
#pragma unroll
            for (u32 q = 0; q < BATCH; ++q)
                if (ok[q]) ((KV_AS_GLOBAL T *)dst[q])[k] = v[q];
        }
    }
}

template <typename T, bool GATHER>
KV_DEVICE void run(const KvJob &j) {
    KV_SHARED u64 s_pool[TILE];
    const u64 V = sizeof(T);
    const u32 tid = tid_x();
    const u64 pieces = j.row_bytes / j.piece_bytes, piece_units = j.piece_bytes / V;
    const bool contiguous = pieces == 1 && j.row_bytes == j.pool_token_stride;
    const u64 ntiles = (j.tokens + TILE - 1) / TILE;
    const u64 ngroups = (j.nslab + SLABS - 1) / SLABS;

    for (u64 tile = ctaid_x(); tile < ntiles; tile += nctaid_x()) {
        const u64 t0 = tile * TILE;
        const u64 rows = j.tokens - t0 < TILE ? j.tokens - t0 : TILE;
        __syncthreads();  // every reader of the previous tile's s_pool is done
        if (tid < rows) s_pool[tid] = pool_at(j, t0 + tid);
        __syncthreads();
        // Flat when every token of the tile follows the previous one in the pool (one segment).
        const int next_ok = tid + 1 < rows ? s_pool[tid + 1] == s_pool[tid] + j.row_bytes : 1;
        const bool flat = contiguous && __nvvm_bar0_and(next_ok) != 0;
        for (u64 group = ctaid_y(); group < ngroups; group += nctaid_y()) {
            const u64 s0 = group * SLABS;
            const u64 ns = j.nslab - s0 < SLABS ? j.nslab - s0 : SLABS;
            if (flat) {
                // Page copy: a slab's tile is one range of rows * row_bytes on both sides.
                for (u64 s = s0; s < s0 + ns; ++s) {
                    const u64 pool = j.bases[j.slab_buffer[s]] + s_pool[0] + j.pool_head_offset;
                    const u64 stage = j.staging + j.slab_offset[s] + t0 * j.row_bytes;
                    copy_flat<T, GATHER>(pool, stage, tid, rows * (j.row_bytes / V), THREADS);
                }
                continue;
            }
            copy_rows<T>(s0, ns, rows, pieces, piece_units, [&](u64 s, u64 r, u64 p, u64 &src, u64 &dst) {
                const u64 pool = j.bases[j.slab_buffer[s]] + s_pool[r] + j.pool_head_offset + p * j.pool_piece_stride;
                const u64 stage = j.staging + j.slab_offset[s] + (t0 + r) * j.row_bytes + p * j.piece_bytes;
                src = GATHER ? pool : stage;
                dst = GATHER ? stage : pool;
            });
        }
    }
}

// Direct mode's one pass: the rows a gather plan reads from one pool written where a scatter plan
// of the same region puts them in another (both plans' slabs pair up, rows of the same size):
//   src_bases / dst_bases           the two pools' buffers
//   slab_src[s], slab_dst[s]        slab s's buffer index on each side
//   run_start[g] (g <= nrun)        region token where run g starts; run_start[nrun] = tokens
//   run_src[g], run_dst[g]          byte offset of run g's first token on each side
// Row (s, t) of `row_bytes` bytes: from src_bases[slab_src[s]] + src_at(t) + src_head_offset to the
// same on the dst side, in pieces of `piece_bytes` (a head where either side puts heads apart),
// each side's pieces its piece stride apart. Grid and tiles as the gather/scatter kernels.
struct KvAcross {
    const u64 *src_bases;
    const u64 *dst_bases;
    const u64 *slab_src;
    const u64 *slab_dst;
    const u64 *run_start;
    const u64 *run_src;
    const u64 *run_dst;
    u64 nslab;
    u64 nrun;
    u64 tokens;
    u64 src_token_stride;
    u64 src_head_offset;
    u64 dst_token_stride;
    u64 dst_head_offset;
    u64 row_bytes;
    u64 piece_bytes;
    u64 src_piece_stride;
    u64 dst_piece_stride;
};

// The run holding region token t: the last one starting at or before t.
KV_DEVICE u64 run_of(const KvAcross &j, u64 t) {
    u64 lo = 0, hi = j.nrun;  // run_start[lo] <= t < run_start[hi]
    while (hi - lo > 1) {
        u64 mid = lo + (hi - lo) / 2;
        if (j.run_start[mid] <= t) lo = mid; else hi = mid;
    }
    return lo;
}

template <typename T>
KV_DEVICE void run_across(const KvAcross &j) {
    KV_SHARED u64 s_src[TILE];
    KV_SHARED u64 s_dst[TILE];
    const u64 V = sizeof(T);
    const u32 tid = tid_x();
    const u64 pieces = j.row_bytes / j.piece_bytes, piece_units = j.piece_bytes / V;
    const bool contiguous = pieces == 1 && j.row_bytes == j.src_token_stride && j.row_bytes == j.dst_token_stride;
    const u64 ntiles = (j.tokens + TILE - 1) / TILE;
    const u64 ngroups = (j.nslab + SLABS - 1) / SLABS;

    for (u64 tile = ctaid_x(); tile < ntiles; tile += nctaid_x()) {
        const u64 t0 = tile * TILE;
        const u64 rows = j.tokens - t0 < TILE ? j.tokens - t0 : TILE;
        __syncthreads();  // every reader of the previous tile's slots is done
        if (tid < rows) {
            const u64 g = run_of(j, t0 + tid), into = t0 + tid - j.run_start[g];
            s_src[tid] = j.run_src[g] + into * j.src_token_stride;
            s_dst[tid] = j.run_dst[g] + into * j.dst_token_stride;
        }
        __syncthreads();
        // Flat when the tile's tokens follow each other on both sides (whole token slots).
        const int next_ok = tid + 1 < rows ? s_src[tid + 1] == s_src[tid] + j.row_bytes && s_dst[tid + 1] == s_dst[tid] + j.row_bytes : 1;
        const bool flat = contiguous && __nvvm_bar0_and(next_ok) != 0;
        for (u64 group = ctaid_y(); group < ngroups; group += nctaid_y()) {
            const u64 s0 = group * SLABS;
            const u64 ns = j.nslab - s0 < SLABS ? j.nslab - s0 : SLABS;
            if (flat) {
                for (u64 s = s0; s < s0 + ns; ++s) {
                    const u64 from = j.src_bases[j.slab_src[s]] + s_src[0] + j.src_head_offset;
                    const u64 to = j.dst_bases[j.slab_dst[s]] + s_dst[0] + j.dst_head_offset;
                    copy_flat<T, true>(from, to, tid, rows * (j.row_bytes / V), THREADS);
                }
                continue;
            }
            copy_rows<T>(s0, ns, rows, pieces, piece_units, [&](u64 s, u64 r, u64 p, u64 &src, u64 &dst) {
                src = j.src_bases[j.slab_src[s]] + s_src[r] + j.src_head_offset + p * j.src_piece_stride;
                dst = j.dst_bases[j.slab_dst[s]] + s_dst[r] + j.dst_head_offset + p * j.dst_piece_stride;
            });
        }
    }
}

#define KV_ENTRY(name, T, GATHER) \
    KV_GLOBAL void KV_LAUNCH_BOUNDS(THREADS) name(KvJob j) { run<T, GATHER>(j); }

KV_ENTRY(kvstage_gather_v16, v4u32, true)
KV_ENTRY(kvstage_gather_v8, u64, true)
KV_ENTRY(kvstage_gather_v4, u32, true)
KV_ENTRY(kvstage_gather_v2, u16, true)
KV_ENTRY(kvstage_gather_v1, u8, true)
KV_ENTRY(kvstage_scatter_v16, v4u32, false)
KV_ENTRY(kvstage_scatter_v8, u64, false)
KV_ENTRY(kvstage_scatter_v4, u32, false)
KV_ENTRY(kvstage_scatter_v2, u16, false)
KV_ENTRY(kvstage_scatter_v1, u8, false)

#define KV_ACROSS(name, T) \
    KV_GLOBAL void KV_LAUNCH_BOUNDS(THREADS) name(KvAcross j) { run_across<T>(j); }

KV_ACROSS(kvstage_across_v16, v4u32)
KV_ACROSS(kvstage_across_v8, u64)
KV_ACROSS(kvstage_across_v4, u32)
KV_ACROSS(kvstage_across_v2, u16)
KV_ACROSS(kvstage_across_v1, u8)
