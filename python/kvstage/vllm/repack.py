"""vLLM's CPU backend keeps K of a (block, head) head-dim-major (``layout._cpu_cache_positions``):
when the two sides' block sizes or in-block orders differ, the prefill copies the blocks each chunk
reads token-major into a buffer of ``repack_blocks`` blocks (with its own kvstage engine) just
before it sends the chunk from there, and the decode puts the received blocks back into its
kernel's order."""

from __future__ import annotations

import threading
import time
from typing import Any

import kvstage

from .layout import _split_layout
from .wire import _Failed


def _region(t: Any):
    """A layer's cache ``t`` as [blocks, heads, 2 * block_size * head_dim] (a view)."""
    import torch

    b, h, n, c = t.shape
    return torch.as_strided(t, (b, h, n * c), (t.stride(0), t.stride(1), 1))


class _Repacker:
    def __init__(self, tensors: list, positions: Any, opts: dict, head_dim: int, global_heads: int, tp_rank: int, tp_size: int):
        self.tensors, self.positions, self.opts = tensors, positions, opts
        self.head_dim, self.global_heads, self.tp_rank, self.tp_size = head_dim, global_heads, tp_rank, tp_size
        self.engine: Any = None  # the token-major copy's kvstage engine, made on first use
        self._buf: Any = None
        self._free: list = []
        self._cond = threading.Condition()

    def ready_engine(self) -> Any:
        """The kvstage engine that sends from the token-major copy (both made on first use)."""
        with self._cond:
            self._ensure()
            return self.engine

    def _ensure(self) -> None:
        """With the lock."""
        import torch

        if self.engine is None:
            cap = int(self.opts["repack_blocks"]) or 256
            t = self.tensors[0]
            _, h, bs, c = t.shape
            self._buf = torch.zeros(len(self.tensors), cap, h, bs, c, dtype=t.dtype)
            layout = _split_layout(list(self._buf), self.head_dim, self.global_heads, self.tp_rank, self.tp_size)
            engine = kvstage.Engine(None, transport=self.opts["transport"], cluster_token=self.opts["cluster_token"])
            engine.register_pool(layout)
            self.engine, self._free = engine, list(range(cap))

    def alloc(self, n: int, deadline: float) -> list:
        """Blocks of the token-major copy, waiting for free ones."""
        with self._cond:
            self._ensure()
            cap = self._buf.shape[1]
            if n > cap:
                raise _Failed(f"a chunk reads {n} blocks, repack_blocks is {cap}: raise repack_blocks or lower the decode's chunk_tokens")
            while len(self._free) < n:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise _Failed(f"no {n} free repack blocks within load_timeout_s")
            out, self._free = self._free[:n], self._free[n:]
            return out

    def release(self, slots: list) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def out(self, blocks: list, slots: list) -> None:
        """Prefill: the request's blocks into the token-major copy."""
        import torch

        src = torch.tensor(blocks, dtype=torch.long)
        dst = torch.tensor(slots, dtype=torch.long)
        for layer, t in enumerate(self.tensors):
            shadow = self._buf[layer].view(self._buf.shape[1], self._buf.shape[2], -1)
            shadow[dst] = _region(t)[src][:, :, self.positions]

    def back(self, blocks: list) -> None:
        """Decode: the room's blocks, token-major as kvstage wrote them, into the backend's order."""
        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        for t in self.tensors:
            region = _region(t)
            canon = region[idx]
            packed = torch.empty_like(canon)
            packed[:, :, self.positions] = canon
            region[idx] = packed

    def close(self) -> None:
        with self._cond:
            engine = self.engine
        if engine is not None:
            engine.close()
