#!/usr/bin/env python3
"""Real-client check of libkvstage.so from Python (ctypes), as an sglang-shaped engine uses it.

Builds token-major K/V pools per layer ([pool_tokens, local_kv_heads, head_dim] bf16 tensors, one
per TP rank), hands their data pointers to libkvstage, runs staged transfers over loopback TCP
(gather -> write -> scatter) for P4->D2 and P2->D4, and compares every decode rank's pool with a
reshard computed in the array library itself (bit-exact, via the bf16 bit patterns).

Then a layer-wise P2->D1 transfer whose layers are produced on a deliberately slow stream: each
layer's K/V is written there after a spin kernel (torch.cuda._sleep) and marked ready at once, by
an event recorded after the write (even layers) or by the stream itself (odd layers), long before
the stream gets there. The pools held other bytes before, so a gather that read a layer before its
ready point shows as a mismatch. (numpy: host pools written first, marked "now".)

  --backend torch   PyTorch CUDA tensors, memory_kind CUDA (the GPU runner); each case runs with a
                    host staging ring and with a device ring (engine-allocated on the same GPU)
  --backend numpy   host arrays, memory_kind HOST (a dry run of this script on any machine)

Exit 0 all passed, 1 a mismatch or an error, 77 skipped (no torch / no CUDA device, unless
KVSTAGE_REQUIRE_GPU=1). Prints 'N passed, N failed' at the end.

C API 0.4. The ctypes structs below mirror include/kvstage.h whole (field order and types): each
is filled by the library's own _init with this script's sizeof (or, for the output struct, its
struct_size set to it), so a newer library with fields appended keeps their defaults.
"""
import argparse
import ctypes as C
import os
import random
import sys

KVSTAGE_OK = 0
KVSTAGE_PENDING = 1
MEMORY_HOST, MEMORY_CUDA = 0, 1
H, D, LAYERS, PAGE, CAPACITY_PAGES = 8, 128, 4, 16, 64
ROOM_BASE = 1000


class KvLayout(C.Structure):  # kvstage_kv_layout (include/kvstage.h), whole
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("model_kind", C.c_int32),
        ("page_size", C.c_uint32),
        ("local_heads", C.c_uint32),
        ("global_heads", C.c_uint32),
        ("head_dim", C.c_uint32),
        ("dtype_bytes", C.c_uint32),
        ("tp_rank", C.c_uint32),
        ("tp_size", C.c_uint32),
        ("pp_rank", C.c_uint32),
        ("pp_size", C.c_uint32),
        ("layer_ids", C.POINTER(C.c_uint32)),
        ("num_layers", C.c_size_t),
        ("k_bases", C.POINTER(C.c_uint64)),
        ("v_bases", C.POINTER(C.c_uint64)),
        ("capacity_pages", C.c_uint64),
        ("memory_kind", C.c_int32),
        ("cuda_device", C.c_int32),
    ]


class TransferDesc(C.Structure):  # kvstage_transfer_desc, whole
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("room", C.c_uint64),
        ("chunk_index", C.c_uint32),
        ("src_pages", C.POINTER(C.c_uint32)),
        ("num_pages", C.c_size_t),
        ("timeout_ms", C.c_uint64),
        ("cuda_stream", C.c_void_p),
        ("cuda_event", C.c_void_p),
        ("user_tag", C.c_uint64),
        ("room_key", C.c_uint64),
        ("src_token_offset", C.c_uint32),
        ("num_tokens", C.c_uint32),
        ("trace_id", C.c_char_p),
        ("parts", C.c_void_p),  # const kvstage_request_parts* (unused here: NULL)
    ]


class StagingMemory(C.Structure):  # kvstage_staging_memory, whole
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("memory_kind", C.c_int32),
        ("cuda_device", C.c_int32),
        ("memory", C.c_void_p),
        ("bytes", C.c_size_t),
    ]


class RoomDesc(C.Structure):  # kvstage_room_desc, whole
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("room", C.c_uint64),
        ("pages", C.POINTER(C.c_uint32)),
        ("num_pages", C.c_size_t),
        ("chunk_tokens", C.c_uint32),
        ("parts", C.c_void_p),  # const kvstage_request_parts* (unused here: NULL)
        ("prefix_tokens", C.c_uint64),
        ("trace_id", C.c_char_p),
    ]


class RoomGrid(C.Structure):  # kvstage_room_grid (output of kvstage_room_open), whole
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("key", C.c_uint64),
        ("chunk_tokens", C.c_uint32),
        ("num_chunks", C.c_uint32),
        ("num_pages", C.c_uint32),
        ("page_size", C.c_uint32),
        ("prefix_tokens", C.c_uint64),
    ]


class Error(C.Structure):  # kvstage_error
    _fields_ = [
        ("struct_size", C.c_size_t),
        ("code", C.c_int),
        ("klass", C.c_int),
        ("session", C.c_char_p),
        ("message", C.c_char_p),
        ("cause_count", C.c_size_t),
        ("causes", C.POINTER(C.c_char_p)),
    ]


class Lib:
    def __init__(self, path):
        self.lib = C.CDLL(path)
        L = self.lib
        L.kvstage_error_last.restype = C.POINTER(Error)
        for name in ("kvstage_transfer_layerwise_async", "kvstage_op_layers_ready", "kvstage_op_wait"):
            getattr(L, name).restype = C.c_int
        L.kvstage_transfer_layerwise_async.argtypes = [C.c_void_p, C.c_void_p, C.POINTER(C.c_void_p)]
        L.kvstage_op_layers_ready.argtypes = [C.c_void_p, C.c_uint32, C.c_uint32, C.c_void_p, C.c_void_p]
        L.kvstage_op_wait.argtypes = [C.c_void_p, C.c_uint64]
        L.kvstage_op_free.argtypes = [C.c_void_p]
        for name in ("kvstage_engine_new", "kvstage_pool_register", "kvstage_staging_register",
                     "kvstage_engine_listen_address", "kvstage_kv_layout_init", "kvstage_transfer_desc_init",
                     "kvstage_session_connect", "kvstage_transfer", "kvstage_room_desc_init", "kvstage_room_open",
                     "kvstage_room_wait", "kvstage_room_release", "kvstage_staging_memory_init"):
            getattr(L, name).restype = C.c_int
        L.kvstage_engine_new.argtypes = [C.c_void_p, C.POINTER(C.c_void_p)]
        L.kvstage_pool_register.argtypes = [C.c_void_p, C.c_void_p]
        L.kvstage_staging_memory_init.argtypes = [C.c_void_p, C.c_size_t]
        L.kvstage_staging_register.argtypes = [C.c_void_p, C.c_void_p]
        L.kvstage_engine_listen_address.argtypes = [C.c_void_p, C.c_char_p, C.c_size_t, C.c_void_p]
        L.kvstage_kv_layout_init.argtypes = [C.c_void_p, C.c_size_t]
        L.kvstage_transfer_desc_init.argtypes = [C.c_void_p, C.c_size_t]
        L.kvstage_session_connect.argtypes = [C.c_void_p, C.c_char_p, C.c_char_p, C.c_uint64, C.POINTER(C.c_void_p)]
        L.kvstage_transfer.argtypes = [C.c_void_p, C.c_void_p]
        L.kvstage_room_desc_init.argtypes = [C.c_void_p, C.c_size_t]
        L.kvstage_room_open.argtypes = [C.c_void_p, C.c_void_p, C.c_void_p]
        L.kvstage_room_wait.argtypes = [C.c_void_p, C.c_uint64, C.c_uint64, C.c_uint64]
        L.kvstage_room_release.argtypes = [C.c_void_p, C.c_uint64, C.c_uint64]
        L.kvstage_engine_free.argtypes = [C.c_void_p]
        L.kvstage_session_free.argtypes = [C.c_void_p]

    def check(self, status, what):
        if status != KVSTAGE_OK:
            e = self.lib.kvstage_error_last().contents
            causes = [e.causes[i].decode() for i in range(e.cause_count)]
            raise RuntimeError(f"{what} returned {status}: {e.message.decode()} {causes}")

    def struct(self, cls, init):
        """A `cls` filled with its defaults by the library's `init(&x, sizeof x)`."""
        x = cls()
        self.check(getattr(self.lib, init)(C.byref(x), C.sizeof(x)), init)
        return x


class Backend:
    def __init__(self, name):
        self.name = name
        if name == "torch":
            import torch
            self.t = torch
            self.memory_kind = MEMORY_CUDA
        else:
            import numpy
            self.np = numpy
            self.memory_kind = MEMORY_HOST

    def pool(self, local_heads, rng_seed):
        """Per layer K and V of [tokens, local_heads, D] bf16 (numpy: the bf16 bit patterns)."""
        tokens = CAPACITY_PAGES * PAGE
        if self.name == "torch":
            g = self.t.Generator(device="cuda").manual_seed(rng_seed)
            make = lambda: self.t.randn((tokens, local_heads, D), dtype=self.t.bfloat16, device="cuda", generator=g)
        else:
            r = self.np.random.default_rng(rng_seed)
            make = lambda: r.integers(0, 1 << 16, size=(tokens, local_heads, D), dtype=self.np.uint16)
        return [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]

    def ptr(self, a):
        return a.data_ptr() if self.name == "torch" else a.ctypes.data

    def bits(self, a):
        return a.view(self.t.int16) if self.name == "torch" else a

    def cat_heads(self, parts):
        return self.t.cat(parts, dim=1) if self.name == "torch" else self.np.concatenate(parts, axis=1)

    def equal(self, a, b):
        return bool(self.t.equal(self.bits(a), self.bits(b))) if self.name == "torch" else bool((a == b).all())

    def clone(self, a):
        return a.clone() if self.name == "torch" else a.copy()

    def sync(self):
        if self.name == "torch":
            self.t.cuda.synchronize()

    def zero(self, a):
        if self.name == "torch":
            a.zero_()
        else:
            a.fill(0)

    def assign(self, dst, src):
        if self.name == "torch":
            dst.copy_(src)
        else:
            dst[...] = src


class Rank:
    def __init__(self, lib, be, tp_rank, tp_size, seed):
        self.lib, self.be = lib, be
        self.local = max(1, H // tp_size)
        self.k, self.v = be.pool(self.local, seed)
        self.k_bases = (C.c_uint64 * LAYERS)(*[be.ptr(a) for a in self.k])
        self.v_bases = (C.c_uint64 * LAYERS)(*[be.ptr(a) for a in self.v])
        self.engine = C.c_void_p()
        lib.check(lib.lib.kvstage_engine_new(None, C.byref(self.engine)), "kvstage_engine_new")
        self.layout = l = lib.struct(KvLayout, "kvstage_kv_layout_init")
        l.page_size, l.local_heads, l.global_heads, l.head_dim, l.dtype_bytes = PAGE, self.local, H, D, 2
        l.tp_rank, l.tp_size, l.num_layers, l.capacity_pages = tp_rank, tp_size, LAYERS, CAPACITY_PAGES
        l.k_bases, l.v_bases, l.memory_kind = self.k_bases, self.v_bases, be.memory_kind
        lib.check(lib.lib.kvstage_pool_register(self.engine, C.byref(l)), "kvstage_pool_register")
        self.sessions = {}

    def address(self):
        buf = C.create_string_buffer(64)
        self.lib.check(self.lib.lib.kvstage_engine_listen_address(self.engine, buf, 64, None), "listen_address")
        return buf.value

    def free(self):
        for s in self.sessions.values():
            self.lib.lib.kvstage_session_free(s)
        self.lib.lib.kvstage_engine_free(self.engine)


def register_ring(lib, be, engine, ring):
    """The decode ring: engine-owned host memory, or engine-allocated memory of the current CUDA
    device (the scatter kernels then read it directly)."""
    m = lib.struct(StagingMemory, "kvstage_staging_memory_init")  # memory NULL: engine-owned
    m.bytes = 64 << 20
    if ring == "host":
        lib.check(lib.lib.kvstage_staging_register(engine, C.byref(m)), "staging_register (host ring)")
        return
    m.memory_kind, m.cuda_device = MEMORY_CUDA, be.t.cuda.current_device()
    lib.check(lib.lib.kvstage_staging_register(engine, C.byref(m)), "staging_register (device ring)")


SPIN_CYCLES = 50_000_000  # about 25 ms of a GPU clock: far longer than marking every layer takes


def send_layerwise(lib, be, prefill, pairs, room, keys, src_arr, npages):
    """One chunk of every page, layer-wise: each layer is written on a slow side stream and marked
    ready at once (its event, or the stream). Returns how many marks were made before their
    layer's bytes existed, and how many marks there were."""
    truth = [([be.clone(a) for a in rk.k], [be.clone(a) for a in rk.v]) for rk in prefill]
    for rk in prefill:
        for a in rk.k + rk.v:
            be.zero(a)
    be.sync()
    ops = {}
    for p, d in pairs:
        desc = lib.struct(TransferDesc, "kvstage_transfer_desc_init")
        desc.room, desc.room_key, desc.chunk_index, desc.timeout_ms = room, keys[d], 0, 20000
        desc.src_pages, desc.num_pages = C.cast(src_arr, C.POINTER(C.c_uint32)), npages
        op = C.c_void_p()
        status = lib.lib.kvstage_transfer_layerwise_async(prefill[p].sessions[d], C.byref(desc), C.byref(op))
        if status != KVSTAGE_PENDING:
            lib.check(status, f"transfer_layerwise_async P{p}->D{d}")
            raise RuntimeError(f"transfer_layerwise_async P{p}->D{d} returned {status}, not PENDING")
        ops.setdefault(p, []).append(op)
    torch = be.name == "torch"
    side = be.t.cuda.Stream() if torch else None
    events, ahead, marks = [], 0, 0
    for layer in range(LAYERS):
        for p, rk in enumerate(prefill):
            stream = event = None
            if torch:
                with be.t.cuda.stream(side):
                    be.t.cuda._sleep(SPIN_CYCLES)
                    be.assign(rk.k[layer], truth[p][0][layer])
                    be.assign(rk.v[layer], truth[p][1][layer])
                ev = be.t.cuda.Event()
                ev.record(side)
                events.append(ev)  # alive until the operations end
                stream, event = (None, ev.cuda_event) if layer % 2 == 0 else (side.cuda_stream, None)
            else:
                be.assign(rk.k[layer], truth[p][0][layer])
                be.assign(rk.v[layer], truth[p][1][layer])
            for op in ops[p]:
                lib.check(lib.lib.kvstage_op_layers_ready(op, layer, 1, stream, event), f"op_layers_ready layer {layer} P{p}")
            marks += 1
            if torch and not ev.query():
                ahead += 1
    for p in ops:
        for op in ops[p]:
            lib.check(lib.lib.kvstage_op_wait(op, 20000), f"op_wait P{p}")
            lib.lib.kvstage_op_free(op)
    be.sync()
    return ahead, marks


def scenario(lib, be, src_tp, dst_tp, room, seed, ring, layerwise=False):
    rnd = random.Random(seed)
    prefill = [Rank(lib, be, r, src_tp, seed * 100 + r) for r in range(src_tp)]
    decode = [Rank(lib, be, d, dst_tp, seed * 100 + 50 + d) for d in range(dst_tp)]
    before = [([be.clone(a) for a in d.k], [be.clone(a) for a in d.v]) for d in decode]
    npages = 8  # 128 tokens: two chunks of 64 (layer-wise: one chunk of 128)
    src_pages = rnd.sample(range(CAPACITY_PAGES), npages)
    dst_pages = rnd.sample(range(CAPACITY_PAGES), npages)
    chunk_tokens = (npages if layerwise else 4) * PAGE
    dst_arr = (C.c_uint32 * npages)(*dst_pages)
    keys = []  # each decode rank's key of the room's opening (what a bootstrap carries)
    num_chunks = None
    for d in decode:
        register_ring(lib, be, d.engine, ring)
        rd = lib.struct(RoomDesc, "kvstage_room_desc_init")
        rd.room, rd.num_pages, rd.chunk_tokens = room, npages, chunk_tokens
        rd.pages = C.cast(dst_arr, C.POINTER(C.c_uint32))
        grid = RoomGrid()
        grid.struct_size = C.sizeof(grid)
        lib.check(lib.lib.kvstage_room_open(d.engine, C.byref(rd), C.byref(grid)), "room_open")
        keys.append(grid.key)
        num_chunks = grid.num_chunks
    be.sync()  # the pools' producer finished (a ready fence would order this on a stream)
    # Rank pairing: P>D: decode d is fed by prefill [d*r, (d+1)*r); P<D: prefill p feeds [p*r, (p+1)*r).
    pairs = []
    for p in range(src_tp):
        if src_tp >= dst_tp:
            pairs.append((p, p // (src_tp // dst_tp)))
        else:
            r = dst_tp // src_tp
            pairs += [(p, d) for d in range(p * r, (p + 1) * r)]
    src_arr = (C.c_uint32 * npages)(*src_pages)
    for p, d in pairs:
        s = C.c_void_p()
        lib.check(lib.lib.kvstage_session_connect(prefill[p].engine, decode[d].address(), f"py-{room}-{p}-{d}".encode(),
                                                  10000, C.byref(s)), "session_connect")
        prefill[p].sessions[d] = s
    per_chunk = chunk_tokens // PAGE
    if layerwise:
        ahead, marks = send_layerwise(lib, be, prefill, pairs, room, keys, src_arr, npages)
        print(f"  layer-wise: {ahead} of {marks} layer marks made before their layer was written on the slow stream")
        if be.name == "torch" and ahead != marks:
            raise RuntimeError(f"only {ahead} of {marks} marks ran ahead of the stream: kvstage_op_layers_ready waited "
                               "for the producer (or the spin was too short to test the ordering)")
    for c in range(0 if layerwise else num_chunks):
        for p, d in pairs:
            desc = lib.struct(TransferDesc, "kvstage_transfer_desc_init")
            desc.room, desc.room_key, desc.chunk_index, desc.timeout_ms = room, keys[d], c, 20000
            desc.src_pages = C.cast(C.byref(src_arr, 4 * c * per_chunk), C.POINTER(C.c_uint32))
            desc.num_pages = per_chunk
            lib.check(lib.lib.kvstage_transfer(prefill[p].sessions[d], C.byref(desc)), f"transfer chunk {c} P{p}->D{d}")
    for d, key in zip(decode, keys):
        lib.check(lib.lib.kvstage_room_wait(d.engine, room, key, 20000), "room_wait")
    be.sync()
    # Reference reshard: full-head K/V of each source page, then each decode rank's head slice.
    failures = 0
    for which in (0, 1):
        for layer in range(LAYERS):
            for i, (sp, dp) in enumerate(zip(src_pages, dst_pages)):
                rows = slice(sp * PAGE, (sp + 1) * PAGE)
                pool = lambda rk: rk.k if which == 0 else rk.v
                full = be.cat_heads([pool(rk)[layer][rows] for rk in prefill])
                for d, rk in enumerate(decode):
                    h0 = d * rk.local
                    want = full[:, h0:h0 + rk.local, :]
                    got = pool(rk)[layer][dp * PAGE:(dp + 1) * PAGE]
                    if not be.equal(got, want):
                        failures += 1
                        print(f"  MISMATCH {'KV'[which]} layer {layer} page {i} (src {sp} -> dst {dp}) on decode rank {d}")
            # Outside the room's pages nothing changed.
            for d, rk in enumerate(decode):
                pool = rk.k if which == 0 else rk.v
                old = before[d][which][layer]
                mask_pages = [p for p in range(CAPACITY_PAGES) if p not in dst_pages]
                for p in mask_pages:
                    if not be.equal(pool[layer][p * PAGE:(p + 1) * PAGE], old[p * PAGE:(p + 1) * PAGE]):
                        failures += 1
                        print(f"  STRAY WRITE {'KV'[which]} layer {layer} page {p} on decode rank {d}")
    for d, key in zip(decode, keys):
        lib.lib.kvstage_room_release(d.engine, room, key)
    for rk in prefill + decode:
        rk.free()
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.environ.get("KVSTAGE_LIB", "libkvstage.so"))
    ap.add_argument("--backend", choices=["torch", "numpy"], default="torch")
    args = ap.parse_args()
    require = os.environ.get("KVSTAGE_REQUIRE_GPU") == "1"
    try:
        be = Backend(args.backend)
        if args.backend == "torch" and not be.t.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as e:  # noqa: BLE001 - any import/device failure is a skip
        print(f"gpu_torch_check: {e}: skipped")
        return 1 if require and args.backend == "torch" else 77
    lib = Lib(args.lib)
    passed = failed = 0
    rings = ("host", "device") if args.backend == "torch" else ("host",)
    cases = [(f"P{s}->D{d} {ring} ring", s, d, ring, False) for ring in rings for s, d in ((4, 2), (2, 4))]
    cases += [(f"P2->D1 layer-wise, slow producer stream, {ring} ring", 2, 1, ring, True) for ring in rings]
    for i, (name, src_tp, dst_tp, ring, layerwise) in enumerate(cases):
        try:
            n = scenario(lib, be, src_tp, dst_tp, ROOM_BASE + 100 * i + src_tp * 10 + dst_tp, seed=src_tp * 7 + dst_tp, ring=ring,
                         layerwise=layerwise)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {name} ({args.backend}): {e}")
            failed += 1
            continue
        if n:
            print(f"FAIL {name} ({args.backend}): {n} page(s) differ from the reference reshard")
            failed += 1
        else:
            print(f"ok   {name} ({args.backend}): decode pools equal the reference reshard")
            passed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
