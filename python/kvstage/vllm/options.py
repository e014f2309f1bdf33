"""The connector's options: ``kv_connector_extra_config`` keys, their defaults and checks."""

from __future__ import annotations

import os
from typing import Any

# kv_connector_extra_config keys and their defaults.
_OPTIONS = {
    # Address the prefill ranks' bootstrap listeners and the decode ranks' kvstage engines bind
    # to and announce. Set it to the host's address on a multi-host deployment.
    "host": None,  # default: $VLLM_HOST_IP, else 127.0.0.1
    # Port of prefill rank 0's bootstrap listener; rank r listens on port + r.
    "bootstrap_port": 17600,
    # Port of decode rank 0's kvstage engine (rank r: port + r); 0: any free port.
    "kvstage_port": 0,
    # Prefill: seconds a finished request's blocks are held for a decode that has not asked yet.
    "lease_s": 60.0,
    # Decode: seconds from a request's allocation to its KV in place; past it the load fails.
    "load_timeout_s": 30.0,
    # Decode: bytes of each rank's kvstage staging ring.
    "staging_bytes": 256 << 20,
    # Decode: tokens per chunk of a room (0: kvstage's default).
    "chunk_tokens": 0,
    # kvstage engine options.
    "transport": None,  # "auto" (default), "tcp", "shm", "rdma"
    "cluster_token": None,
    # How K and V lie in a layer's [blocks, heads, block_size, 2*head_size] cache: "split" (K of
    # the block's tokens, then their V: vLLM's CPU attention backend), "cell" (K‖V per token,
    # the layout named by "layout"), "auto" (split for CPU tensors, cell otherwise).
    "kv_cell": "auto",
    "layout": "vllm-lbhnc",
    # Prefill: blocks of the token-major copy a request is repacked into when the decode's block
    # size differs and the backend keeps K head-dim-major (vLLM's CPU backend); 0: 256.
    "repack_blocks": 0,
    # Prefill: threads that send finished requests.
    "send_threads": 4,
    # A module with optional on_arrival(request_id, tensors, block_ids, layout),
    # before_send(request_id, message) and after_chunk(request_id, chunk, num_chunks) functions
    # (tests, diagnostics).
    "hooks": None,
    # Decode: a file each finished load appends one JSON line to (request, ok, tokens, bytes, ms).
    "stats_file": None,
}


def _options(vllm_config: Any) -> dict:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"KvstageConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(_OPTIONS)}")
    out = dict(_OPTIONS)
    out.update(extra)
    if out["host"] is None:
        out["host"] = os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
    if out["kv_cell"] not in ("auto", "split", "cell"):
        raise ValueError(f"KvstageConnector: kv_cell is {out['kv_cell']!r}, expected 'auto', 'split' or 'cell'")
    return out
