"""Engines' own pool layouts from Python: :meth:`KvLayout.preset` and :meth:`KvLayout.from_tensors`.

The pools are numpy arrays in each engine's own shapes: sglang's per-layer K and V tensors
``[slots, heads, head_dim]``, vLLM's ``[L, B, H, N, C]`` (``C = K‖V``) stored in each of its six axis
orders (one logical tensor, the per-layer views a connector gets, views built with ``as_strided``,
padded blocks), TensorRT-LLM's ``[blocks, L, K/V, H, N, D]`` pool and its per-layer slices.

- ``from_tensors`` reads the same strides, ``v_offset``, bases and layer stride from them as the
  library's preset computes from the shape (``kvstage_kv_layout_preset``); padded blocks come
  through as the tensors' block stride.
- Requests move between two engines of different layouts in this process over TCP on 127.0.0.1
  (TP changes, MLA, different page sizes). The reference is numpy alone: every prefill tensor read
  by the engine's own indexing (``pool[layer, pages, :, tokens, K or V cell half]`` …) into a
  logical ``[K/V, layer, token, global head, dim]`` tensor, written into zeroed copies of the
  decode tensors by their engine's indexing; every byte of each decode allocation (padding and
  untouched slots included) must equal the reference.
- Tensors that disagree with what the caller says are refused, naming the tensor and both values.
"""

import zlib
from dataclasses import dataclass, replace
from typing import List, Optional

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import kvref
import kvstage
from kvstage import LayoutPreset

VLLM_ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
ALL = ["sglang"] + [f"vllm-{o.lower()}" for o in VLLM_ORDERS] + ["trtllm"]
ROOM = 7


@dataclass(frozen=True)
class Spec:
    """One side's pool: ``engine`` a layout name; ``variant`` how its tensors are handed over:
    ``"stacked"`` (one tensor: vLLM's logical ``[L, B, H, N, C]``, TensorRT-LLM's pool; sglang's
    per-layer lists), ``"views"`` (per-layer tensors by numpy indexing: a vLLM connector's
    ``[B, H, N, C]`` views, TensorRT-LLM's ``pool[:, l]``), ``"strided"`` (vLLM: per-layer views
    built with ``as_strided`` over the flat allocation); ``pad``: elements of padding after each
    vLLM block."""

    engine: str
    page_size: int
    variant: str = "stacked"
    pad: int = 0


class EnginePool:
    """One rank's pool as the engine allocates and indexes it, over ``backing`` (its allocation,
    whose bytes the test compares)."""

    def __init__(self, spec: Spec, model: kvref.Model, mla: bool, tp_rank: int, tp: int, capacity: int, backing: Optional[np.ndarray] = None):
        self.spec, self.model, self.mla, self.tp_rank, self.tp, self.capacity = spec, model, mla, tp_rank, tp, capacity
        self.kvn = 1 if mla else 2
        self.heads = 1 if mla else model.local_heads(tp)
        self.global_heads = 1 if mla else model.heads
        d, ps, layers, h = model.head_dim, spec.page_size, model.layers, self.heads
        dv = 0 if mla else model.dv
        engine = spec.engine
        if engine == "sglang" and dv not in (0, d):
            # K and V tensors of their own head sizes (sglang's `v_head_dim`), in one allocation.
            k_elems = layers * capacity * ps * h * d
            self.backing = np.zeros(k_elems + layers * capacity * ps * h * dv, model.dtype) if backing is None else backing
            ks = self.backing[:k_elems].reshape(layers, capacity * ps, h, d)
            vs = self.backing[k_elems:].reshape(layers, capacity * ps, h, dv)
            self.tensors = (list(ks), list(vs))
        elif engine == "sglang":
            shape = (self.kvn, layers, capacity * ps, h, d)
            self.backing = np.zeros(shape, model.dtype) if backing is None else backing
            ks = list(self.backing[0])
            self.tensors = ks if mla else (ks, list(self.backing[1]))
        elif engine == "trtllm":
            shape = (capacity, layers, self.kvn, h, ps, d)
            self.backing = np.zeros(shape, model.dtype) if backing is None else backing
            self.tensors = self.backing if spec.variant == "stacked" else [self.backing[:, l] for l in range(layers)]
        else:
            order = LayoutPreset[engine.upper().replace("-", "_")].order
            ext = dict(L=layers, B=capacity, H=h, N=ps, C=d + dv)
            if spec.variant == "stacked" and not spec.pad:
                # The physical allocation in the order's shape, permuted to the logical view.
                self.backing = np.zeros([ext[a] for a in order], model.dtype) if backing is None else backing
                self.logical = self.backing.transpose([order.index(a) for a in "LBHNC"])
                self.tensors = self.logical
            else:
                # A flat allocation; element strides of the order, blocks padded by `pad`.
                strides, step = {}, 1
                for a in reversed(order):
                    strides[a] = step + (spec.pad if a == "B" else 0)
                    step = strides[a] * ext[a]
                self.backing = np.zeros(step, model.dtype) if backing is None else backing
                item = self.backing.itemsize
                self.logical = as_strided(self.backing, shape=[ext[a] for a in "LBHNC"], strides=[strides[a] * item for a in "LBHNC"])
                if spec.variant == "strided":
                    self.tensors = [
                        as_strided(self.backing[l * strides["L"] :], shape=[ext[a] for a in "BHNC"], strides=[strides[a] * item for a in "BHNC"])
                        for l in range(layers)
                    ]
                else:
                    self.tensors = self.logical
            if spec.variant == "views":
                self.tensors = list(self.logical)  # what a connector gets: [B, H, N, C] per layer

    def like(self, backing: np.ndarray) -> "EnginePool":
        """The same engine's tensors over another allocation of the same shape."""
        return EnginePool(self.spec, self.model, self.mla, self.tp_rank, self.tp, self.capacity, backing)

    def layout(self, **extra) -> kvstage.KvLayout:
        return kvstage.KvLayout.from_tensors(
            self.tensors,
            layout=self.spec.engine,
            model="mla" if self.mla else "mha",
            global_heads=self.global_heads,
            tp_rank=self.tp_rank,
            tp_size=self.tp,
            page_size=self.spec.page_size,
            dtype_bytes=self.model.dtype_bytes,
            head_dim=self.model.head_dim,
            head_dim_v=None if self.mla else self.model.dv,
            **extra,
        )

    def _index(self, layer: int, kv: int, pages: np.ndarray, tokens: np.ndarray):
        """(array, index) of K (kv 0) or V of ``layer`` at token ``tokens[i]`` of page
        ``pages[i]``, every local head: ``array[index]`` is ``[tokens, heads, dim]``, by the
        engine's own indexing of its tensors."""
        d, engine, t = self.model.head_dim, self.spec.engine, self.tensors
        dv = self.model.dv
        if engine == "sglang":
            buf = (t if self.mla else t[kv])[layer]
            return buf, (pages * self.spec.page_size + tokens,)
        if engine == "trtllm":
            if isinstance(t, list):
                return t[layer], (pages, kv, slice(None), tokens, slice(None))
            return t, (pages, layer, kv, slice(None), tokens, slice(None))
        cell = slice(0, d) if kv == 0 else slice(d, d + dv)  # C = K‖V: K the first head_size elements
        if isinstance(t, list):
            return t[layer], (pages, slice(None), tokens, cell)
        return t, (layer, pages, slice(None), tokens, cell)

    def get(self, layer, kv, pages, tokens) -> np.ndarray:
        array, index = self._index(layer, kv, pages, tokens)
        return array[index]

    def set(self, layer, kv, pages, tokens, values) -> None:
        array, index = self._index(layer, kv, pages, tokens)
        array[index] = values


def _place(page_list: List[int], page_size: int, count: int):
    """(page, token within the page) of the request's first ``count`` tokens."""
    t = np.arange(count)
    return np.asarray(page_list, dtype=np.int64)[t // page_size], t % page_size


def _heads_of_rank(model, mla, tp, rank):
    return [0] if mla else kvref._heads_of_rank(model, tp, rank)


def _describe(pool: EnginePool, got: np.ndarray, want: np.ndarray) -> str:
    """Where two allocations first differ: the byte, and the (layer, K/V, page, token, head, dim)
    the engine's indexing puts on it (or padding)."""
    g, w = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    diff = np.flatnonzero(g != w)
    if len(diff) == 0:
        return ""
    byte = int(diff[0])
    element = byte // got.itemsize
    ids = pool.like(np.arange(got.size, dtype=np.int64).reshape(got.shape))
    pages = np.repeat(np.arange(pool.capacity), pool.spec.page_size)
    tokens = np.tile(np.arange(pool.spec.page_size), pool.capacity)
    where = "padding or an unaddressed byte"
    for layer in range(pool.model.layers):
        for kv in range(pool.kvn):
            hit = np.argwhere(ids.get(layer, kv, pages, tokens) == element)
            if len(hit):
                slot, head, dim = (int(x) for x in hit[0])
                where = f"layer {layer} {'KV'[kv]} page {pages[slot]} token {tokens[slot]} local head {head} dim {dim}"
    return f"{len(diff)} of {g.size} bytes differ; the first at byte {byte} ({where}): got {g[byte]:#04x}, want {w[byte]:#04x}"


def run_request(model, mla, src: Spec, dst: Spec, p_tp, d_tp, total=100, chunk_tokens=64):
    """One request from ``p_tp`` prefill engines to ``d_tp`` decode engines over TCP; returns
    (decode pools, expected decode allocations)."""
    rng = np.random.default_rng(zlib.crc32(repr((src, dst, p_tp, d_tp)).encode()))
    src_cap = -(-total // src.page_size) + 3
    dst_cap = -(-total // dst.page_size) + 3
    prefill = [EnginePool(src, model, mla, r, p_tp, src_cap) for r in range(p_tp)]
    decode = [EnginePool(dst, model, mla, r, d_tp, dst_cap) for r in range(d_tp)]
    for i, p in enumerate(prefill):
        kvref.fill_random(p.backing, seed=100 + i)  # padding too: it must not travel
    src_pages = [rng.permutation(src_cap)[: -(-total // src.page_size)].tolist() for _ in range(p_tp)]
    dst_pages = [rng.permutation(dst_cap)[: -(-total // dst.page_size)].tolist() for _ in range(d_tp)]
    if mla:
        for p in prefill[1:]:  # every prefill rank holds the whole latent: the same bytes
            for layer in range(model.layers):
                p.set(layer, 0, *_place(src_pages[p.tp_rank], src.page_size, total), prefill[0].get(layer, 0, *_place(src_pages[0], src.page_size, total)))

    pairs = []
    for rs in range(p_tp):
        for rd in range(d_tp):
            try:
                kvstage.head_slice(p_tp, d_tp, rs, rd, 1 if mla else model.heads)
            except kvstage.ArgumentError:
                continue
            pairs.append((rs, rd))
    engines, sessions, rooms = [], {}, []
    try:
        dec_engines = []
        for pool in decode:
            e = kvstage.Engine("127.0.0.1:0", transport="tcp")
            engines.append(e)
            e.register_pool(pool.layout())
            e.register_staging(1 << 20)
            dec_engines.append(e)
        for rd, e in enumerate(dec_engines):
            rooms.append(e.open_room(ROOM, dst_pages[rd], chunk_tokens=chunk_tokens))
        pre_engines = []
        for pool in prefill:
            e = kvstage.Engine("127.0.0.1:0", transport="tcp")
            engines.append(e)
            e.register_pool(pool.layout())
            pre_engines.append(e)
        for rs, rd in pairs:
            sessions[rs, rd] = pre_engines[rs].connect(dec_engines[rd].listen_address, f"layouts-p{rs}-d{rd}")
        for k in range(rooms[0].num_chunks):
            for rs, rd in pairs:
                span = kvstage.chunk_span(rooms[rd].grid, total, src.page_size, k)
                status = sessions[rs, rd].transfer(
                    ROOM, k, span.src_pages(src_pages[rs]), timeout_ms=20000, room_key=rooms[rd].key,
                    src_token_offset=span.src_token_offset, num_tokens=span.num_tokens,
                )
                assert status == kvstage.Status.OK
        for room in rooms:
            room.wait(20000)
    finally:
        for s in sessions.values():
            s.close()
        for e in engines:
            e.close()

    # The reference: the request's logical KV [K/V, layer, token, global head, dim] read through
    # the prefill engines' own indexing, written through the decode engines' own indexing.
    kvn = 1 if mla else 2
    heads = 1 if mla else model.heads
    logical = [np.zeros((model.layers, total, heads, dim), model.dtype) for dim in (model.head_dim, model.dv)[:kvn]]
    for pool in prefill:
        place = _place(src_pages[pool.tp_rank], src.page_size, total)
        for layer in range(model.layers):
            for kv in range(kvn):
                logical[kv][layer][:, _heads_of_rank(model, mla, p_tp, pool.tp_rank)] = pool.get(layer, kv, *place)
    expected = []
    for pool in decode:
        want = pool.like(np.zeros_like(pool.backing))
        place = _place(dst_pages[pool.tp_rank], dst.page_size, total)
        for layer in range(model.layers):
            for kv in range(kvn):
                want.set(layer, kv, *place, logical[kv][layer][:, _heads_of_rank(model, mla, d_tp, pool.tp_rank)])
        expected.append(want)
    return decode, expected


MODEL = kvref.Model(layers=3, heads=4, head_dim=8, dtype_bytes=2, page_size=16)

TRANSFERS = {
    "sglang->vllm-lbhnc": (MODEL, False, Spec("sglang", 1), Spec("vllm-lbhnc", 16), 1, 1),
    "vllm-lbhnc->trtllm": (MODEL, False, Spec("vllm-lbhnc", 16, "views"), Spec("trtllm", 32), 1, 1),
    "trtllm->sglang P1-D2": (replace(MODEL, dtype_bytes=4), False, Spec("trtllm", 8, "views"), Spec("sglang", 16), 1, 2),
    "sglang P2-D1->vllm-blhnc": (MODEL, False, Spec("sglang", 16), Spec("vllm-blhnc", 16, "views"), 2, 1),
    "vllm-bhlnc P1-D2->sglang": (replace(MODEL, dtype_bytes=1), False, Spec("vllm-bhlnc", 16, "strided"), Spec("sglang", 1), 1, 2),
    "vllm-lbhnc padded->vllm-blnhc padded": (MODEL, False, Spec("vllm-lbhnc", 16, "stacked", pad=24), Spec("vllm-blnhc", 8, "strided", pad=8), 1, 1),
    "vllm-lhbnc P2-D1->vllm-lbnhc": (MODEL, False, Spec("vllm-lhbnc", 16, "views"), Spec("vllm-lbnhc", 16), 2, 1),
    "trtllm->vllm-bhlnc P2-D2": (MODEL, False, Spec("trtllm", 16), Spec("vllm-bhlnc", 16), 2, 2),
    "mla vllm-blnhc->trtllm": (replace(MODEL, head_dim=24), True, Spec("vllm-blnhc", 16, "views"), Spec("trtllm", 32), 1, 1),
    "mla trtllm P1-D2->sglang": (replace(MODEL, head_dim=24), True, Spec("trtllm", 16), Spec("sglang", 1), 1, 2),
    # V heads of another size than K's: vLLM's `head_size_v` (cells of K‖V of 8 + 4), sglang's
    # `v_head_dim` (V tensors of their own).
    "head_dim_v vllm-lbhnc P2-D1->sglang": (replace(MODEL, head_dim_v=4), False, Spec("vllm-lbhnc", 16, "views"), Spec("sglang", 8), 2, 1),
    "head_dim_v sglang P1-D2->vllm-blnhc padded": (replace(MODEL, head_dim_v=12), False, Spec("sglang", 16), Spec("vllm-blnhc", 16, "strided", pad=8), 1, 2),
}


@pytest.mark.parametrize("name", list(TRANSFERS))
def test_a_request_between_engine_layouts(lib, name):
    model, mla, src, dst, p_tp, d_tp = TRANSFERS[name]
    decode, expected = run_request(model, mla, src, dst, p_tp, d_tp)
    for rd, (got, want) in enumerate(zip(decode, expected)):
        assert want.backing.any(), "the reference is not trivial"
        problem = _describe(got, got.backing, want.backing)
        assert not problem, f"{name}: decode rank {rd}: {problem}"


# --- from_tensors against the library's presets ----------------------------------------------------


def _preset_of(pool: EnginePool) -> kvstage.KvLayout:
    """The library's preset for the pool's shape, placed in its (dense) allocation."""
    return kvstage.KvLayout.preset(
        pool.spec.engine,
        head_dim=pool.model.head_dim,
        capacity_pages=pool.capacity,
        global_heads=pool.global_heads,
        page_size=pool.spec.page_size,
        dtype_bytes=pool.model.dtype_bytes,
        model="mla" if pool.mla else "mha",
        tp_rank=pool.tp_rank,
        tp_size=pool.tp,
        num_layers=pool.model.layers,
        base=pool.backing,
    )


def _placement(layout: kvstage.KvLayout):
    return dict(
        strides=layout.strides,
        v_offset=layout.v_offset,
        k=layout.k_addresses,
        v=layout.v_addresses,
        layer_stride=layout.layer_stride,
        shape=(layout.local_heads, layout.global_heads, layout.head_dim, layout.dtype_bytes, layout.page_size, layout.capacity_pages, layout.num_layers),
    )


VARIANTS = {"sglang": ["stacked"], "trtllm": ["stacked", "views"]}


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("engine", ALL)
def test_from_tensors_equals_the_library_preset(lib, engine, mla):
    model = kvref.Model(layers=3, heads=4, head_dim=8, dtype_bytes=2, page_size=0)
    for variant in VARIANTS.get(engine, ["stacked", "views", "strided"]):
        pool = EnginePool(Spec(engine, 4, variant), model, mla, tp_rank=1, tp=2, capacity=5)
        got = pool.layout()
        want = _preset_of(pool if variant != "strided" else pool.like(pool.backing))
        assert got.preset_name == want.preset_name == LayoutPreset[engine.upper().replace("-", "_")].preset_name
        assert _placement(got) == _placement(want), f"{engine} {variant}"
        got.validate()
        # The raw struct carries what the library's preset wrote.
        c, _keep = got._c()
        assert (c.page_stride, c.token_stride, c.head_stride, c.v_offset) == (*want.strides, want.v_offset)
        assert want.tensor_bytes == pool.backing.nbytes


def test_from_tensors_sglang_stacked_layers_and_page_size(lib):
    pool = np.zeros((2, 3, 64, 2, 8), np.uint16)
    got = kvstage.KvLayout.from_tensors((pool[0], pool[1]), layout="sglang", page_size=16, global_heads=4, tp_size=2, tp_rank=1)
    want = kvstage.KvLayout.preset("sglang", head_dim=8, capacity_pages=4, global_heads=4, tp_size=2, tp_rank=1, page_size=16, num_layers=3, base=pool)
    assert _placement(got) == _placement(want)
    assert got.capacity_pages == 4 and got.strides == (16 * 32, 32, 16)


@pytest.mark.parametrize("order, pad", [("LBHNC", 40), ("BLNHC", 8), ("BHLNC", 16)])
def test_padded_blocks_come_from_the_tensors(lib, order, pad):
    """A block stride larger than the dense block: the tensors' page stride, every other stride
    (and, for the orders whose layers hold all blocks, the layer stride) as the preset's."""
    model = kvref.Model(layers=3, heads=4, head_dim=8, dtype_bytes=2, page_size=0)
    engine = f"vllm-{order.lower()}"
    dense = EnginePool(Spec(engine, 4), model, False, 0, 2, 5)
    for variant in ("stacked", "strided"):
        pool = EnginePool(Spec(engine, 4, variant, pad=pad), model, False, 0, 2, 5)
        got = pool.layout()
        want = _preset_of(dense)
        item = model.dtype_bytes
        assert got.strides == (want.strides[0] + pad * item, *want.strides[1:]), variant
        assert got.v_offset == want.v_offset
        blocks_inside_layers = order.index("L") < order.index("B")
        layer_stride = want.layer_stride + (5 * pad * item if blocks_inside_layers else 0)
        assert got.layer_stride == layer_stride
        assert got.k_addresses == tuple(pool.backing.ctypes.data + i * layer_stride for i in range(3))
        got.validate()
        # The padding is never addressed: the buffers' rows fit the allocation.
        assert max(got.k_addresses) + got.v_offset + got.buffer_bytes <= pool.backing.ctypes.data + pool.backing.nbytes


# --- torch ------------------------------------------------------------------------------------------


class FakeTorch:
    """What from_tensors reads of a torch tensor (data_ptr, stride in elements, element_size,
    shape, is_cuda, device), over a numpy array: the torch path without torch."""

    def __init__(self, array, cuda=False):
        self.array, self.shape, self.is_cuda = array, array.shape, cuda
        self.device = type("device", (), {"index": 0 if cuda else None})()

    def data_ptr(self):
        return self.array.__array_interface__["data"][0]

    def element_size(self):
        return self.array.itemsize

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def __getitem__(self, i):
        return FakeTorch(self.array[i], self.is_cuda)


def test_torch_style_tensors_without_torch(lib):
    model = kvref.Model(layers=3, heads=4, head_dim=8, dtype_bytes=2, page_size=0)
    pool = EnginePool(Spec("vllm-blhnc", 4), model, False, 0, 1, 5)
    want = _preset_of(pool)
    got = kvstage.KvLayout.from_tensors(FakeTorch(pool.logical), layout="BLHNC", dtype_bytes=2)
    assert _placement(got) == _placement(want) and got.memory == kvstage.MemoryKind.HOST
    views = kvstage.KvLayout.from_tensors([FakeTorch(pool.logical)[l] for l in range(3)], layout="BLHNC")
    assert _placement(views) == _placement(want)
    cuda = kvstage.KvLayout.from_tensors(FakeTorch(pool.logical, cuda=True), layout="BLHNC")
    assert cuda.memory == kvstage.MemoryKind.CUDA and cuda.strides == want.strides


def test_torch_tensors(lib):
    torch = pytest.importorskip("torch")
    L, B, H, N, D = 3, 5, 2, 4, 8
    phys = torch.zeros((B, L, N, H, 2 * D), dtype=torch.bfloat16)  # BLNHC
    logical = phys.permute(1, 0, 3, 2, 4)
    got = kvstage.KvLayout.from_tensors(logical, layout="vllm-blnhc", dtype_bytes=2)
    want = kvstage.KvLayout.preset("vllm-blnhc", head_dim=D, capacity_pages=B, global_heads=H, page_size=N, num_layers=L, base=phys)
    assert _placement(got) == _placement(want)
    per_layer = kvstage.KvLayout.from_tensors([logical[l] for l in range(L)], layout="vllm-blnhc")
    assert _placement(per_layer) == _placement(want)
    trt = torch.zeros((B, L, 2, H, N, D), dtype=torch.float16)
    got = kvstage.KvLayout.from_tensors(trt, layout="trtllm")
    assert got.k_addresses[1] - got.k_addresses[0] == H * N * D * 2 * 2 and got.v_offset == H * N * D * 2


# --- names and the preset itself ---------------------------------------------------------------------


def test_layout_names(lib):
    assert [p.preset_name for p in LayoutPreset] == ALL
    assert kvstage.layout_preset("LBHNC") is LayoutPreset.VLLM_LBHNC
    assert kvstage.layout_preset("vllm_bhlnc") is LayoutPreset.VLLM_BHLNC
    assert kvstage.layout_preset("TRTLLM") is LayoutPreset.TRTLLM
    assert kvstage.layout_preset(0) is LayoutPreset.SGLANG
    assert LayoutPreset.VLLM_BLNHC.order == "BLNHC" and LayoutPreset.SGLANG.order == ""
    with pytest.raises(kvstage.ArgumentError, match=r"'nhd' is not a layout name \(sglang, vllm-lbhnc"):
        kvstage.layout_preset("nhd")
    with pytest.raises(kvstage.ArgumentError, match="8 is not a kvstage_layout_preset value"):
        kvstage.layout_preset(8)


def test_preset_shape_only_and_errors(lib):
    shape = kvstage.KvLayout.preset("vllm-lhbnc", head_dim=8, capacity_pages=5, global_heads=4, tp_size=2, page_size=4, num_layers=3)
    cell = 2 * 8 * 2
    assert shape.strides == (4 * cell, cell, 5 * 4 * cell) and shape.v_offset == 16 and not shape.has_buffers
    assert shape.layer_stride == 2 * 5 * 4 * cell and shape.tensor_bytes == 3 * 2 * 5 * 4 * cell
    with pytest.raises(kvstage.ArgumentError, match="capacity_pages"):
        kvstage.KvLayout.preset("trtllm", head_dim=8, capacity_pages=0, num_layers=2)
    with pytest.raises(kvstage.ArgumentError, match=r"`base`: holds 100 bytes, a trtllm pool of 2 pages needs 128"):
        kvstage.KvLayout.preset("trtllm", head_dim=8, capacity_pages=2, num_layers=2, base=bytearray(100))


def test_kv_layout_strides_and_v_offset(lib):
    cells = np.zeros((2, 5, 4, 2, 16), np.uint16)  # [L, B, N, H, K‖V], LBNHC
    with pytest.raises(kvstage.ArgumentError, match="v_offset.*not both"):
        kvstage.KvLayout(head_dim=8, global_heads=2, page_size=4, k_buffers=list(cells), v_buffers=list(cells), v_offset=16)
    with pytest.raises(kvstage.ArgumentError, match="v_buffers.*or v_offset"):
        kvstage.KvLayout(head_dim=8, global_heads=2, page_size=4, k_buffers=list(cells))
    with pytest.raises(kvstage.ArgumentError, match="MLA pool has no V"):
        kvstage.KvLayout(model="mla", head_dim=8, num_layers=1, v_offset=16)
    # Buffer objects: the capacity from their size, K's holding V's rows at v_offset.
    ks = [c.reshape(-1)[: c.size - 8] for c in cells]  # the last V row is not in the K buffer
    with pytest.raises(kvstage.ArgumentError, match=r"k_buffers\[0\].*v_offset 16 bytes after"):
        kvstage.KvLayout(head_dim=8, global_heads=2, page_size=4, k_buffers=ks, v_offset=16, token_stride=64, head_stride=32, capacity_pages=5)
    derived = kvstage.KvLayout(head_dim=8, global_heads=2, page_size=4, k_buffers=ks, v_offset=16, token_stride=64, head_stride=32)
    assert derived.capacity_pages == 4 and derived.strides == (256, 64, 32)
    layout = kvstage.KvLayout(head_dim=8, global_heads=2, page_size=4, k_buffers=list(cells), v_offset=16, token_stride=64, head_stride=32)
    assert layout.capacity_pages == 5 and layout.buffer_bytes == 4 * 256 + 3 * 64 + 32 + 16
    assert layout.v_addresses == tuple(a + 16 for a in layout.k_addresses)
    layout.validate()
    assert "strides page 256 token 64 head 32, v_offset=16" in repr(layout)


# --- tensors that disagree with what the caller says -----------------------------------------------


def _vllm(order="LBHNC", dtype=np.uint16, L=3, B=5, H=2, N=4, C=16):
    ext = dict(L=L, B=B, H=H, N=N, C=C)
    phys = np.zeros([ext[a] for a in order], dtype)
    return phys.transpose([order.index(a) for a in "LBHNC"])


def test_a_mismatched_dtype_is_refused(lib):
    with pytest.raises(kvstage.ArgumentError, match=r"`tensors`: has 2-byte elements, dtype_bytes is 4"):
        kvstage.KvLayout.from_tensors(_vllm(), layout="vllm-lbhnc", dtype_bytes=4)
    trt = np.zeros((5, 3, 2, 2, 4, 8), np.uint8)
    with pytest.raises(kvstage.ArgumentError, match=r"has 1-byte elements, dtype_bytes is 2"):
        kvstage.KvLayout.from_tensors(trt, layout="trtllm", dtype_bytes=2)
    ks = [np.zeros((16, 2, 8), np.uint16) for _ in range(2)]
    vs = [np.zeros((16, 2, 8), np.uint32) for _ in range(2)]
    with pytest.raises(kvstage.ArgumentError, match=r"`tensors\[1\]\[0\]`: has 4-byte elements, tensors\[0\]\[0\] has 2-byte elements \(V is shaped as K\)"):
        kvstage.KvLayout.from_tensors((ks, vs), layout="sglang")
    mixed = [np.zeros((5, 2, 4, 16), np.uint16), np.zeros((5, 2, 4, 16), np.uint8)]
    with pytest.raises(kvstage.ArgumentError, match=r"`tensors\[1\]`: has 1-byte elements, tensors\[0\] has 2-byte elements \(every layer's tensor is alike\)"):
        kvstage.KvLayout.from_tensors(mixed, layout="LBHNC")


def test_strides_that_do_not_match_the_order_are_refused(lib):
    # An LBNHC pool named LBHNC: H is inside N, not outside it.
    with pytest.raises(kvstage.ArgumentError, match=r"`tensors`: the H axis has stride 32 bytes, but vllm-lbhnc \(\[L, B, H, N, C\] stored as LBHNC\) puts it outside the N, C axes \(224 bytes\): the strides do not match the order LBHNC \(strides L 1280, B 256, H 32, N 64, C 2\)"):
        kvstage.KvLayout.from_tensors(_vllm("LBNHC"), layout="vllm-lbhnc")
    # The per-layer views of a BLHNC pool named LBHNC: each block holds every layer.
    views = list(_vllm("BLHNC"))
    with pytest.raises(kvstage.ArgumentError, match=r"the L axis has stride 256 bytes, but .* puts it outside the B, H, N, C axes"):
        kvstage.KvLayout.from_tensors(views, layout="LBHNC")
    # A TensorRT-LLM pool whose heads lie inside its tokens.
    trt = np.zeros((5, 3, 2, 4, 2, 8), np.uint16).transpose(0, 1, 2, 4, 3, 5)
    with pytest.raises(kvstage.ArgumentError, match=r"`tensors`: the H axis has stride 16 bytes, but trtllm puts it outside the N, D axes \(112 bytes\): the strides do not match the order \[blocks, L, K/V, H, N, D\]"):
        kvstage.KvLayout.from_tensors(trt, layout="trtllm")
    # Cells that are not contiguous elements.
    with pytest.raises(kvstage.ArgumentError, match=r"the C axis has stride 4 bytes, .* contiguous elements"):
        kvstage.KvLayout.from_tensors(np.zeros((3, 5, 2, 4, 32), np.uint16)[..., ::2], layout="LBHNC")
    # Layers of a BL.. order that are not one tensor.
    apart = [np.zeros((5, 2, 4, 16), np.uint16) for _ in range(2)]
    with pytest.raises(kvstage.ArgumentError, match="do not lie evenly apart, but BLHNC keeps every layer in one block"):
        kvstage.KvLayout.from_tensors(apart + [np.zeros((5, 2, 4, 16), np.uint16)], layout="BLHNC")


def test_other_disagreements_are_refused(lib):
    t = _vllm()
    with pytest.raises(kvstage.ArgumentError, match=r"has cells \(axis C\) of 16 elements, an MHA cell is K‖V: more than head_dim 16"):
        kvstage.KvLayout.from_tensors(t, layout="LBHNC", head_dim=16)
    with pytest.raises(kvstage.ArgumentError, match=r"has 4 tokens per block \(axis N\), page_size is 16"):
        kvstage.KvLayout.from_tensors(t, layout="LBHNC", page_size=16)
    with pytest.raises(kvstage.ArgumentError, match=r"has 2 heads \(axis H\), global_heads 8 over tp_size 2 puts 4 on a rank"):
        kvstage.KvLayout.from_tensors(t, layout="LBHNC", global_heads=8, tp_size=2)
    with pytest.raises(kvstage.ArgumentError, match=r"holds 5 pages \(axis B\), capacity_pages is 6"):
        kvstage.KvLayout.from_tensors(t, layout="LBHNC", capacity_pages=6)
    with pytest.raises(kvstage.ArgumentError, match=r"has 2 heads .* an MLA pool has one latent"):
        kvstage.KvLayout.from_tensors(t, layout="LBHNC", model="mla")
    with pytest.raises(kvstage.ArgumentError, match=r"has 1 entries on the K/V axis .* an MHA pool has 2"):
        kvstage.KvLayout.from_tensors(np.zeros((5, 3, 1, 2, 4, 8), np.uint16), layout="trtllm")
    with pytest.raises(kvstage.ArgumentError, match=r"has shape \(5, 2, 4, 16\): expected 5 dimensions"):
        kvstage.KvLayout.from_tensors(t[0], layout="LBHNC")
    with pytest.raises(kvstage.ArgumentError, match="sglang's MHA pool is \\(k_tensors, v_tensors\\)"):
        kvstage.KvLayout.from_tensors([np.zeros((16, 2, 8), np.uint16)] * 3, layout="sglang")
    read_only = np.zeros((16, 2, 8), np.uint16)
    read_only.flags.writeable = False
    with pytest.raises(kvstage.ArgumentError, match="read-only"):
        kvstage.KvLayout.from_tensors(([read_only], [np.zeros((16, 2, 8), np.uint16)]), layout="sglang")
    with pytest.raises(TypeError, match="expected an array or tensor"):
        kvstage.KvLayout.from_tensors([[1, 2]], layout="LBHNC")
    with pytest.raises(kvstage.ArgumentError, match="layer_ids"):
        kvstage.KvLayout.from_tensors(t, layout="LBHNC", layer_ids=[0, 1])
