"""numpy KV pools for the tests and a reference reshard written from first principles.

The reference does not use kvstage's geometry (head slices, staging layouts, plans): it gathers
every prefill rank's tokens through its page table into one logical tensor
``[kv, layer, token, global head, head_dim]`` (TP ranks split the heads evenly, or with more ranks
than heads each head lives on ``tp / heads`` consecutive ranks), then cuts the decode ranks' heads
out of it and writes them through the decode page tables into copies of the decode pools.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

import kvstage

DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@dataclass(frozen=True)
class Model:
    layers: int
    heads: int
    head_dim: int
    dtype_bytes: int
    page_size: int
    #: Elements per V head where they differ from K's (vLLM ``head_size_v``, sglang ``v_head_dim``).
    head_dim_v: Optional[int] = None

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def dtype(self):
        return DTYPES[self.dtype_bytes]

    def local_heads(self, tp: int) -> int:
        return max(1, self.heads // tp)

    def shape(self, tp_rank: int, tp: int) -> kvstage.KvLayout:
        """A shape-only layout (for staging_layout)."""
        return kvstage.KvLayout(
            head_dim=self.head_dim,
            global_heads=self.heads,
            local_heads=self.local_heads(tp),
            page_size=self.page_size,
            dtype_bytes=self.dtype_bytes,
            tp_rank=tp_rank,
            tp_size=tp,
            num_layers=self.layers,
        )


def make_pool(model: Model, tp_rank: int, tp: int, capacity_pages: int, memory=None):
    """A zeroed pool ``[kv, layer, slot, local head, head_dim]`` and its layout (K = pool[0][l],
    V = pool[1][l], each a contiguous numpy array); in ``memory`` (a :class:`kvstage.SharedMemory`
    of the pool's size) when given."""
    shape = (2, model.layers, capacity_pages * model.page_size, model.local_heads(tp), model.head_dim)
    if memory is None:
        pool = np.zeros(shape, dtype=model.dtype)
    else:
        pool = np.frombuffer(memory.memoryview(), dtype=model.dtype).reshape(shape)
    layout = kvstage.KvLayout(
        head_dim=model.head_dim,
        global_heads=model.heads,
        local_heads=model.local_heads(tp),
        page_size=model.page_size,
        dtype_bytes=model.dtype_bytes,
        tp_rank=tp_rank,
        tp_size=tp,
        k_buffers=list(pool[0]),
        v_buffers=list(pool[1]),
    )
    assert layout.capacity_pages == capacity_pages
    return pool, layout


def pool_bytes(model: Model, tp: int, capacity_pages: int) -> int:
    """Bytes of the pool ``make_pool`` makes."""
    return 2 * model.layers * capacity_pages * model.page_size * model.local_heads(tp) * model.head_dim * model.dtype_bytes


def fill_random(pool: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    info = np.iinfo(pool.dtype)
    pool[...] = rng.integers(0, int(info.max) + 1, size=pool.shape, dtype=pool.dtype)


def slots(pages: Sequence[int], page_size: int) -> np.ndarray:
    """Token slots of ``pages`` in token order."""
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)


def _heads_of_rank(model: Model, tp: int, rank: int) -> List[int]:
    if tp <= model.heads:
        per = model.heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // model.heads)]


def reference_reshard(
    model: Model,
    prefill_pools: Sequence[np.ndarray],
    prefill_pages: Sequence[Sequence[int]],
    decode_pools: Sequence[np.ndarray],
    decode_pages: Sequence[Sequence[int]],
) -> List[np.ndarray]:
    """The decode pools after a correct transfer of the request (copies; inputs are not changed)."""
    p_tp, d_tp = len(prefill_pools), len(decode_pools)
    tokens = len(prefill_pages[0]) * model.page_size
    logical = np.zeros((2, model.layers, tokens, model.heads, model.head_dim), dtype=model.dtype)
    seen = [False] * model.heads
    for rank, (pool, pages) in enumerate(zip(prefill_pools, prefill_pages)):
        gathered = pool[:, :, slots(pages, model.page_size)]  # [kv, layer, token, local head, dim]
        for local, head in enumerate(_heads_of_rank(model, p_tp, rank)):
            if seen[head]:  # a replica (more prefill ranks than heads) must hold the same bytes
                assert np.array_equal(logical[:, :, :, head], gathered[:, :, :, local]), f"replica of head {head} differs"
            else:
                logical[:, :, :, head] = gathered[:, :, :, local]
                seen[head] = True
    assert all(seen)
    expected = []
    for rank, (pool, pages) in enumerate(zip(decode_pools, decode_pages)):
        out = pool.copy()
        heads = _heads_of_rank(model, d_tp, rank)
        out[:, :, slots(pages, model.page_size)] = logical[:, :, :, heads]
        expected.append(out)
    return expected


def describe_difference(got: np.ndarray, want: np.ndarray) -> str:
    """A short description of where two pools differ ("" when equal)."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    diff = np.argwhere(got != want)
    if len(diff) == 0:
        return ""
    kv, layer, slot, head, dim = (int(x) for x in diff[0])
    return (
        f"{len(diff)} of {got.size} elements differ; first at kv {kv} layer {layer} slot {slot} head {head} "
        f"dim {dim}: got {got[tuple(diff[0])]}, want {want[tuple(diff[0])]}"
    )
