// kvstage gather/scatter kernels: one launch moves every (slab, token) row of a CopyPlan piece.
//
// The plan is the one src/geometry/plan.rs builds for the host engine, uploaded as flat arrays:
//   slab_buffer[s], slab_offset[s]  the slab's pool buffer index and its staging byte offset
//   seg_start[g] (g <= nseg)        staging token where segment g starts; seg_start[nseg] = tokens
//   seg_pool[g]                     pool token slot of segment g's first token
// Row (s, t): pool  bases[slab_buffer[s]] + pool_token(t) * pool_token_bytes + pool_head_offset
//             stage staging + slab_offset[s] + t * row_bytes,        row_bytes bytes each.
//
// Grid: x = tiles of TILE staging tokens, y = groups of SLABS slabs (both grid-stride). A block
// first maps its TILE tokens to pool token slots (binary search over seg_start, into shared
// memory), then copies TILE x SLABS rows. When the pool rows are whole token slots (all local
// heads, or MLA latent pages) and the tile lies inside one segment, a slab's tile is one flat range
// on both sides and all threads copy it as such (the page copy); otherwise each row is copied by a
// group of `bx` threads (the strided head-slice copy).
//
// Vector width: V bytes per access, V in {16, 8, 4, 2, 1}; the host picks the widest V dividing
// every base, the staging address, pool_token_bytes, pool_head_offset and row_bytes (16 is the
// aligned fast path, the others the generic path).
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
    u64 pool_token_bytes;
    u64 pool_head_offset;
    u64 row_bytes;
};

KV_DEVICE u32 tid_x() { return __nvvm_read_ptx_sreg_tid_x(); }
KV_DEVICE u32 ctaid_x() { return __nvvm_read_ptx_sreg_ctaid_x(); }
KV_DEVICE u32 ctaid_y() { return __nvvm_read_ptx_sreg_ctaid_y(); }
KV_DEVICE u32 nctaid_x() { return __nvvm_read_ptx_sreg_nctaid_x(); }
KV_DEVICE u32 nctaid_y() { return __nvvm_read_ptx_sreg_nctaid_y(); }

// Pool token slot of staging token t: the last segment starting at or before t.
KV_DEVICE u64 pool_token(const KvJob &j, u64 t) {
    u64 lo = 0, hi = j.nseg;  // seg_start[lo] <= t < seg_start[hi]
    while (hi - lo > 1) {
        u64 mid = lo + (hi - lo) / 2;
        if (j.seg_start[mid] <= t) lo = mid; else hi = mid;
    }
    return j.seg_pool[lo] + (t - j.seg_start[lo]);
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

template <typename T, bool GATHER>
KV_DEVICE void run(const KvJob &j) {
    KV_SHARED u64 s_pool[TILE];
    const u64 V = sizeof(T);
    const u32 tid = tid_x();
    const u64 row_units = j.row_bytes / V;
    // Threads per row: a power of two <= 32, smaller for short rows.
    u32 bx = 32;
    while (bx > 1 && (u64)(bx / 2) >= row_units) bx /= 2;
    const u32 by = THREADS / bx;
    const u32 tx = tid % bx, ty = tid / bx;
    const bool contiguous = j.row_bytes == j.pool_token_bytes;
    const u64 ntiles = (j.tokens + TILE - 1) / TILE;
    const u64 ngroups = (j.nslab + SLABS - 1) / SLABS;

    for (u64 tile = ctaid_x(); tile < ntiles; tile += nctaid_x()) {
        const u64 t0 = tile * TILE;
        const u64 rows = j.tokens - t0 < TILE ? j.tokens - t0 : TILE;
        __syncthreads();  // every reader of the previous tile's s_pool is done
        if (tid < rows) s_pool[tid] = pool_token(j, t0 + tid);
        __syncthreads();
        // Flat when every token of the tile follows the previous one in the pool (one segment).
        const int next_ok = tid + 1 < rows ? s_pool[tid + 1] == s_pool[tid] + 1 : 1;
        const bool flat = contiguous && __nvvm_bar0_and(next_ok) != 0;
        for (u64 group = ctaid_y(); group < ngroups; group += nctaid_y()) {
            const u64 s0 = group * SLABS;
            const u64 ns = j.nslab - s0 < SLABS ? j.nslab - s0 : SLABS;
            if (flat) {
                // Page copy: a slab's tile is one range of rows * row_bytes on both sides.
                for (u64 s = s0; s < s0 + ns; ++s) {
                    const u64 pool = j.bases[j.slab_buffer[s]] + s_pool[0] * j.pool_token_bytes + j.pool_head_offset;
                    const u64 stage = j.staging + j.slab_offset[s] + t0 * j.row_bytes;
                    copy_flat<T, GATHER>(pool, stage, tid, rows * row_units, THREADS);
                }
                continue;
            }
            // Head-slice copy: `bx` threads per row, BATCH rows of `by` in flight per thread.
            const u64 n = ns * TILE;
            for (u64 i0 = ty; i0 < n; i0 += BATCH * by) {
                u64 src[BATCH], dst[BATCH];
                bool ok[BATCH];
#pragma unroll
                for (u32 q = 0; q < BATCH; ++q) {
                    const u64 i = i0 + q * by;
                    const u64 s = s0 + i / TILE, r = i % TILE;
                    ok[q] = i < n && r < rows;
                    const u64 pool = ok[q] ? j.bases[j.slab_buffer[s]] + s_pool[r] * j.pool_token_bytes + j.pool_head_offset : 0;
                    const u64 stage = ok[q] ? j.staging + j.slab_offset[s] + (t0 + r) * j.row_bytes : 0;
                    src[q] = GATHER ? pool : stage;
                    dst[q] = GATHER ? stage : pool;
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
