"""How a rank's vLLM KV cache tensors are described to kvstage: the layer order, the layout
(``kv_cell`` "split": vLLM's CPU backend; "cell": K‖V per token), and, on the CPU backend, where
its cache-write kernel puts each element of a block (read once at start-up)."""

from __future__ import annotations

import logging
import re
from typing import Any

import kvstage

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")


def _layer_index(name: str, fallback: int) -> int:
    m = re.search(r"\.(\d+)\.", "." + name + ".")
    return int(m.group(1)) if m else fallback


def _split_layout(tensors: list, head_dim: int, global_heads: int, tp_rank: int, tp_size: int):
    """vLLM's CPU attention backend: a layer is [blocks, heads, block_size, 2*head_size], viewed
    by the backend as [blocks, heads, 2*block_size, head_size] and cut in two along the tokens:
    a (block, head) holds K of its block_size tokens, then their V."""
    t = tensors[0]
    if t.dim() != 4 or t.shape[3] != 2 * head_dim:
        raise ValueError(f"KvstageConnector: a layer's KV cache is {tuple(t.shape)}, expected [blocks, heads, block_size, {2 * head_dim}]")
    es = t.element_size()
    for i, x in enumerate(tensors):
        if tuple(x.shape) != tuple(t.shape) or tuple(x.stride()) != tuple(t.stride()):
            raise ValueError(f"KvstageConnector: layer {i}'s KV cache {tuple(x.shape)} strides {x.stride()} differs from layer 0's")
    blocks, heads, block_size, _ = t.shape
    if t.stride(3) != 1 or t.stride(2) != 2 * head_dim or t.stride(1) < 2 * block_size * head_dim:
        raise ValueError(f"KvstageConnector: kv_cell 'split' needs each (block, head) contiguous, the strides are {t.stride()}")
    return kvstage.KvLayout(
        head_dim=head_dim,
        global_heads=global_heads,
        local_heads=heads,
        page_size=block_size,
        dtype_bytes=es,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_layers=len(tensors),
        k_buffers=[x.data_ptr() for x in tensors],
        capacity_pages=blocks,
        page_stride=t.stride(0) * es,
        head_stride=t.stride(1) * es,
        token_stride=head_dim * es,
        v_offset=block_size * head_dim * es,
    )


def _cpu_cache_positions(block_size: int, head_dim: int, cache_dtype: Any, model_dtype: Any, kv_cache_dtype: str):
    """Where vLLM's CPU attention backend puts each element of a (block, head): ``pos[c]`` is the
    position, in the block's ``2 * block_size * head_dim`` elements, of canonical element ``c``
    (K of token ``s``, element ``d`` at ``s * head_dim + d``; V at ``block_size * head_dim + s *
    head_dim + d``). Read from the backend's own cache-write kernel, once, one index bit per call,
    as vLLM calls it: K and V in the model's dtype, the cache in its own (bytes for an fp8
    ``kv_cache_dtype``), ``kv_cache_dtype`` named. None when the backend keeps that canonical order."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    n, d = block_size, head_dim
    isa = _get_attn_isa(model_dtype, n, d, kv_cache_dtype)
    total = 2 * n * d
    canon = torch.arange(total, dtype=torch.long)
    code = torch.zeros(total, dtype=torch.long)
    cache = torch.zeros(1, 1, n, 2 * d, dtype=cache_dtype)
    kc, vc = cache.view(1, 1, 2 * n, d).chunk(2, dim=2)
    slots = torch.arange(n, dtype=torch.long)

    def write(vals):
        cache.zero_()
        ops.cpu_attn_reshape_and_cache(vals[: n * d].view(n, 1, d), vals[n * d :].view(n, 1, d), kc, vc, slots, isa, kv_cache_dtype=kv_cache_dtype)
        return cache.view(-1).clone()

    # What 1 and 2 (exact in every dtype, fp8 included) look like in the cache.
    one, two = (write(torch.full((total,), x, dtype=model_dtype)) for x in (1, 2))
    if not (bool((one == one[0]).all()) and bool((two == two[0]).all())) or bool(one[0] == two[0]) or bool(one[0] == 0):
        raise RuntimeError(f"the CPU backend's cache write ({isa}, {kv_cache_dtype}) does not store 1 and 2 as two values")
    for bit in range(total.bit_length()):
        flat = write((((canon >> bit) & 1) + 1).to(model_dtype))
        if not bool(((flat == one[0]) | (flat == two[0])).all()):
            raise RuntimeError(f"the CPU backend's cache write ({isa}) left elements of a block unwritten")
        code |= (flat == two[0]).to(torch.long) << bit
    pos = torch.empty(total, dtype=torch.long)
    pos[code] = torch.arange(total, dtype=torch.long)
    if not torch.equal(torch.sort(code).values, canon):
        raise RuntimeError(f"the CPU backend's cache write ({isa}) is not a permutation of a block")
    return None if torch.equal(pos, canon) else pos


def _layout_id(positions: Any, block_size: int) -> str:
    """The in-block order of a (block, head): token-major ("canonical"), unknown, or the probed
    permutation's hash; with the block size."""
    import hashlib

    if positions is None:
        kind = "canonical"
    elif isinstance(positions, str):
        kind = positions
    else:
        kind = "perm-" + hashlib.sha1(positions.numpy().tobytes()).hexdigest()[:16]
    return f"{kind}/{block_size}"


def _describe(kv_caches: dict, opts: dict, head_dim: int, global_heads: int, tp_rank: int, tp_size: int, model_dtype: Any, kv_cache_dtype: str):
    """A rank's caches, by layer: ``(cell, tensors, layout, positions)``. The element size is the
    cache tensors' own (1 byte for an fp8 ``kv_cache_dtype``, whatever the model's dtype);
    ``positions`` (kv_cell "split" only) is ``_cpu_cache_positions``' answer, or "unknown" when it
    cannot be read. ``model_dtype`` None: the caches' dtype."""
    names = sorted(kv_caches, key=lambda n: (_layer_index(n, 0), n))
    tensors = [kv_caches[n] for n in names]
    cell = opts["kv_cell"]
    if cell == "auto":
        cell = "split" if tensors[0].device.type == "cpu" else "cell"
    positions = None
    if cell == "split":
        layout = _split_layout(tensors, head_dim, global_heads, tp_rank, tp_size)
        try:
            dtype = tensors[0].dtype
            positions = _cpu_cache_positions(layout.page_size, head_dim, dtype, model_dtype or dtype, kv_cache_dtype or "auto")
        except Exception as e:  # noqa: BLE001 - another backend or vLLM version
            logger.warning(
                "kvstage: cannot read how the CPU backend lays out a block (%s): moving whole blocks; a decode with another block size is refused", e
            )
            positions = "unknown"
    else:
        t = tensors[0]
        if t.dim() != 4 or t.shape[3] != 2 * head_dim:
            # vLLM's GPU backends: [2, blocks, block_size, heads, head_size] or [blocks, 2, ...].
            raise ValueError(
                f"KvstageConnector: a layer's KV cache is {tuple(t.shape)}; kv_cell 'cell' needs [blocks, heads, block_size, "
                f"{2 * head_dim}] (K||V per token): this attention backend's cache is not supported"
            )
        layout = kvstage.KvLayout.from_tensors(tensors, layout=opts["layout"], global_heads=global_heads, tp_rank=tp_rank, tp_size=tp_size)
    return cell, tensors, layout, positions
