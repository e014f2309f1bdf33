"""``KvstageConnector``: vLLM's ``KVConnectorBase_V1`` over kvstage, push mode.

The flow (one request, a prefill instance P and a decode instance D, the proxy in front):

1. The proxy sends the request to P with ``kv_transfer_params = {"do_remote_decode": true}`` and
   ``max_tokens = 1``. P computes the prompt; when the request finishes, ``request_finished``
   keeps its blocks (the lease) and answers the params D needs: ``remote_bootstrap`` (P's rank-0
   bootstrap address; rank ``r`` listens on its port ``+ r``), ``remote_request_id``,
   ``remote_tp_size``, ``remote_block_size``, ``remote_num_tokens``.
2. The proxy sends the request to D with those params. D's scheduler counts the prompt tokens
   it does not hold (its own prefix-cache hit stays: only the suffix moves) as loaded
   asynchronously; once their blocks are allocated, each D worker opens a kvstage room on those
   blocks (its own block size, the prefix in whole blocks, trace id = D's request id) and sends
   the prefill ranks that feed it (kvstage's pairing, any TP on either side) one bootstrap
   message: room, key, its kvstage address, its rank, the room's grid.
3. Each P rank sends its share of the request's KV into the room with kvstage sessions (staged
   through D's ring; same host: shared memory) and answers the bootstrap message; once every
   decode rank it feeds was served (or failed), its blocks go back to vLLM (``get_finished``).
   Blocks nobody asks for go back after ``lease_s`` (logged).
4. D's room completes (or fails: a dead prefill, a refused geometry, a deadline): the request
   is reported finished receiving; a failure also reports its blocks through
   ``get_block_ids_with_load_errors``, so vLLM's ``kv_load_failure_policy`` applies ("fail":
   the request ends with an error; "recompute": D computes the prompt itself).

The bootstrap is a small TCP listener per prefill rank inside the vLLM worker (no service to
start); ``kv_connector_extra_config`` holds the options (see ``_OPTIONS``).
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import math
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import kvstage
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

try:  # 0.32: the status enum lives with the request
    from vllm.v1.request import RequestStatus
except ImportError:  # pragma: no cover
    RequestStatus = None  # type: ignore

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")

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
    # A module with optional on_arrival(request_id, tensors, block_ids, layout) and
    # before_send(request_id, message) functions (tests, diagnostics).
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


@dataclass
class _Recv:
    """Decode: a request whose prompt KV comes from a prefill instance."""

    req_id: str
    block_ids: list
    prefix_tokens: int
    num_tokens: int
    bootstrap: str
    remote_request_id: str
    remote_tp_size: int
    remote_block_size: int
    error: str = ""  # the scheduler could not set the load up: it fails at once


@dataclass
class _Send:
    """Prefill: a finished request whose blocks are held until its decode ranks are served."""

    req_id: str
    block_ids: list
    num_tokens: int


class KvstageConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, one per step."""

    def __init__(self) -> None:
        self.recv: dict = {}  # decode: req_id -> _Recv
        self.send: dict = {}  # prefill: req_id -> _Send
        self.release: list = []  # decode: (bootstrap, remote_request_id, remote_tp_size)
        self.aborted: set = set()  # prefill: requests that finished without being held
        self.idle: bool = False  # nothing scheduled this step


class KvstageConnector(KVConnectorBase_V1):
    """kvstage as vLLM's KV connector: ``kv_connector_module_path = "kvstage.vllm"``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._opts = _options(vllm_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise ValueError(
                f"KvstageConnector: this model has {len(groups)} KV cache groups (a hybrid or sliding-window model): "
                "only models with one (full attention) are supported"
            )
        self._scheduler: Optional[_Scheduler] = None
        self._worker: Optional[_Worker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(vllm_config, self._opts)
        else:
            self._worker = _Worker(vllm_config, self._opts)

    # -- scheduler ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list):
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any):
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Any):
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any):
        return None  # any: register_kv_caches reads the strides

    # -- worker ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvstageConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole requests: the load completes before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the prefill sends once the request finished

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids: set):
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        idle = isinstance(meta, KvstageConnectorMetadata) and meta.idle
        sending, recving = self._worker.take_finished(idle)
        failed = self._worker.take_failed_recv()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set:
        return self._worker.take_failed_blocks() if self._worker else set()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()


# ------------------------------------------------------------------------------------------------
# scheduler side


class _Scheduler:
    def __init__(self, vllm_config: Any, opts: dict):
        ktc = vllm_config.kv_transfer_config
        self.engine_id = ktc.engine_id
        self.is_producer = ktc.is_kv_producer
        self.is_consumer = ktc.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.bootstrap = f"{opts['host']}:{int(opts['bootstrap_port'])}"
        self._recv: dict = {}
        self._send: dict = {}
        self._release: list = []
        self._aborted: set = set()
        self._held: set = set()  # prefill requests whose blocks wait for get_finished

    @staticmethod
    def _remote(params: Any) -> bool:
        return isinstance(params, dict) and bool(params.get("do_remote_prefill"))

    def _bad_params(self, request: Any) -> Optional[str]:
        """What is wrong with a request's ``kv_transfer_params`` (they come from a client), or None."""
        params = request.kv_transfer_params
        if not self.is_consumer:
            return "do_remote_prefill sent to an instance whose kv_role is not a consumer"
        b = params.get("remote_bootstrap")
        if not isinstance(b, str) or ":" not in b:
            return f"remote_bootstrap is {b!r}, expected 'host:port'"
        host, port = b.rsplit(":", 1)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"remote_bootstrap is {b!r}, expected 'host:port' with a port in 1..65535"
        rid = params.get("remote_request_id")
        if not isinstance(rid, str) or not rid or len(rid) > 1024:
            return f"remote_request_id is {rid!r}, expected a non-empty string"
        for key, default in (("remote_tp_size", 1), ("remote_block_size", self.block_size)):
            v = params.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= (1 << 20):
                return f"{key} is {v!r}, expected a positive integer"
        if int(port) + int(params.get("remote_tp_size", 1)) - 1 > 65535:
            return f"remote_bootstrap {b!r} with remote_tp_size {params.get('remote_tp_size')!r} runs past port 65535"
        n = params.get("remote_num_tokens")
        total = len(request.prompt_token_ids or ())
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != total):
            return f"remote_num_tokens is {n!r}, this prompt has {total} tokens"
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        params = request.kv_transfer_params
        if not self._remote(params):
            return 0, False
        bad = self._bad_params(request)
        if bad:
            # Never raise here (the scheduler would die with every request): compute it locally.
            logger.warning("kvstage: request %s: bad kv_transfer_params: %s: computing the prompt here", request.request_id, bad)
            params["do_remote_prefill"] = False
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        params = request.kv_transfer_params
        if not self._remote(params):
            return
        params["do_remote_prefill"] = False  # one load per request
        try:
            self._after_alloc(request, params, blocks, num_external_tokens)
        except Exception as e:  # noqa: BLE001 - never kill the scheduler for one request
            logger.warning("kvstage: request %s: %s: %s", request.request_id, type(e).__name__, e)
            if num_external_tokens > 0:
                # vLLM waits for this request's load (WAITING_FOR_REMOTE_KVS): end it as failed.
                try:
                    ids = list(blocks.get_unhashed_block_ids_all_groups()[0])[: math.ceil(num_external_tokens / self.block_size)]
                except Exception:  # noqa: BLE001
                    ids = []
                self._recv[request.request_id] = _Recv(request.request_id, ids, 0, 0, "", "", 1, self.block_size, error=f"{type(e).__name__}: {e}")

    def _after_alloc(self, request: Any, params: dict, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            bad = self._bad_params(request)  # the params may have changed since the count
            if bad:
                raise ValueError(f"bad kv_transfer_params: {bad}")
        total = len(request.prompt_token_ids or ())
        remote = (params["remote_bootstrap"], params["remote_request_id"], int(params.get("remote_tp_size", 1)))
        if num_external_tokens <= 0:
            if self._bad_params(request) is None:
                self._release.append(remote)  # nothing to move: let the prefill free its blocks now
            return
        groups = blocks.get_unhashed_block_ids_all_groups()
        if len(groups) != 1:
            raise NotImplementedError(f"{len(groups)} KV cache groups (hybrid models) are not supported")
        need = math.ceil(num_external_tokens / self.block_size)
        block_ids = list(groups[0])
        if len(block_ids) < need:
            raise RuntimeError(f"{num_external_tokens} tokens to load need {need} blocks, vLLM allocated {len(block_ids)} new ones")
        self._recv[request.request_id] = _Recv(
            req_id=request.request_id,
            block_ids=block_ids[:need],
            prefix_tokens=total - num_external_tokens,
            num_tokens=total,
            bootstrap=remote[0],
            remote_request_id=remote[1],
            remote_tp_size=remote[2],
            remote_block_size=int(params.get("remote_block_size", self.block_size)),
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KvstageConnectorMetadata()
        meta.recv, self._recv = self._recv, {}
        meta.send, self._send = self._send, {}
        meta.release, self._release = self._release, []
        meta.aborted, self._aborted = self._aborted, set()
        meta.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        return meta

    def request_finished(self, request: Any, block_ids: Any):
        params = request.kv_transfer_params
        if not params:
            return False, None
        if not isinstance(params, dict):
            return False, None
        if params.get("do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: the prefill may free its own.
            if self._bad_params(request) is None:
                self._release.append((params["remote_bootstrap"], params["remote_request_id"], int(params.get("remote_tp_size", 1))))
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not self.is_producer:
            logger.warning("kvstage: request %s: do_remote_decode sent to an instance whose kv_role is not a producer: ignored", request.request_id)
            return False, None
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            block_ids = block_ids[0]
        finished_ok = RequestStatus is None or request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not finished_ok or not block_ids:
            self._aborted.add(request.request_id)
            return False, None
        total = len(request.prompt_token_ids or ())
        self._send[request.request_id] = _Send(request.request_id, list(block_ids), total)
        self._held.add(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_bootstrap": self.bootstrap,
            "remote_request_id": request.request_id,
            "remote_engine_id": self.engine_id,
            "remote_tp_size": self.tp_size,
            "remote_block_size": self.block_size,
            "remote_num_tokens": total,
        }

    def update_connector_output(self, connector_output: Any):
        for req_id in connector_output.finished_sending or ():
            self._held.discard(req_id)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping while blocks are held (their sends and leases end in
        # get_finished) or a release has not gone out yet.
        return bool(self._held or self._release or self._send)


# ------------------------------------------------------------------------------------------------
# worker side


class _Failed(Exception):
    pass


@dataclass
class _Held:
    send: _Send
    deadline: float
    expected: Optional[set] = None  # decode tp ranks this rank feeds (known at the first push)
    served: set = field(default_factory=set)
    in_flight: int = 0


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


def _cpu_cache_positions(block_size: int, head_dim: int, dtype: Any):
    """Where vLLM's CPU attention backend puts each element of a (block, head): ``pos[c]`` is the
    position, in the block's ``2 * block_size * head_dim`` elements, of canonical element ``c``
    (K of token ``s``, element ``d`` at ``s * head_dim + d``; V at ``block_size * head_dim + s *
    head_dim + d``). Read from the backend's own cache-write kernel, once, one index bit per call.
    None when the backend keeps that canonical order."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    n, d = block_size, head_dim
    isa = _get_attn_isa(dtype, n, d)
    total = 2 * n * d
    canon = torch.arange(total, dtype=torch.long)
    code = torch.zeros(total, dtype=torch.long)
    cache = torch.zeros(1, 1, n, 2 * d, dtype=dtype)
    kc, vc = cache.view(1, 1, 2 * n, d).chunk(2, dim=2)
    slots = torch.arange(n, dtype=torch.long)
    for bit in range(total.bit_length()):
        vals = (((canon >> bit) & 1) + 1).to(dtype)  # 1 or 2: exact in every dtype
        cache.zero_()
        ops.cpu_attn_reshape_and_cache(vals[: n * d].view(n, 1, d), vals[n * d :].view(n, 1, d), kc, vc, slots, isa)
        flat = cache.view(-1)
        if bool((flat == 0).any()):
            raise RuntimeError(f"the CPU backend's cache write ({isa}) left elements of a block unwritten")
        code |= (flat == 2).to(torch.long) << bit
    pos = torch.empty(total, dtype=torch.long)
    pos[code] = torch.arange(total, dtype=torch.long)
    if not torch.equal(torch.sort(code).values, canon):
        raise RuntimeError(f"the CPU backend's cache write ({isa}) is not a permutation of a block")
    return None if torch.equal(pos, canon) else pos


def _send_line(sock: socket.socket, obj: dict) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def _read_line(sock: socket.socket, limit: int = 1 << 16, deadline: Optional[float] = None) -> Optional[dict]:
    """One JSON line; with ``deadline`` (time.monotonic()) the whole line must come by then
    (socket.timeout otherwise: a peer that trickles bytes cannot hold a thread longer)."""
    buf = b""
    while not buf.endswith(b"\n"):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the bootstrap message did not arrive in time")
            sock.settimeout(left)
        part = sock.recv(4096)
        if not part:
            return None
        buf += part
        if len(buf) > limit:
            raise _Failed(f"bootstrap message over {limit} bytes")
    return json.loads(buf)


# The prefill's bootstrap listener: seconds a peer has to send its whole message, connections
# open at once (being read or parked until the request's blocks are held: beyond it the oldest
# parked one is answered with an error), and how many / how long finished request ids are kept.
_MSG_DEADLINE_S = 10.0
_MAX_CONNS = 512
_MAX_PARKED = 256
_GONE_MAX = 4096
_GONE_MIN_AGE_S = 600.0


def _is_int(v: Any, lo: int = 0, hi: int = (1 << 64) - 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_addr(v: Any) -> bool:
    if not isinstance(v, str) or ":" not in v or len(v) > 256:
        return False
    host, port = v.rsplit(":", 1)
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


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


class _Worker:
    def __init__(self, vllm_config: Any, opts: dict):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        ktc = vllm_config.kv_transfer_config
        self.opts = opts
        self.is_producer = ktc.is_kv_producer
        self.is_consumer = ktc.is_kv_consumer
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.block_size = vllm_config.cache_config.block_size
        mc = vllm_config.model_config
        self.head_dim = mc.get_head_size()
        self.global_heads = mc.get_total_num_kv_heads()
        self.host = opts["host"]
        self.bootstrap_addr = f"{self.host}:{int(opts['bootstrap_port']) + self.tp_rank}"
        self.hooks = importlib.import_module(opts["hooks"]) if opts["hooks"] else None
        self.engine: Optional[kvstage.Engine] = None
        self.layout: Optional[kvstage.KvLayout] = None
        self.tensors: list = []
        self._cond = threading.Condition()
        self._finished_send: set = set()
        self._finished_recv: set = set()
        self._failed_blocks: set = set()
        self._failed_recv: set = set()  # decode: failed loads with no blocks to name
        self._held: dict = {}  # prefill: req_id -> _Held
        self._parked: dict = {}  # prefill: req_id -> [(conn, msg, since)] pushes before the blocks
        self._gone: dict = {}  # prefill: req_id -> why it is not held (recent ones)
        self._sessions: dict = {}
        self._sessions_lock = threading.Lock()
        self._rooms = itertools.count(1)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._listener: Optional[socket.socket] = None
        self._stop = threading.Event()
        self._stats_lock = threading.Lock()
        self._receiving = 0  # decode loads in flight
        self._unreleased: list = []  # decode: (recv, ok, room) whose room.release() raised: retried
        self._conns = 0  # prefill: bootstrap connections being read
        self._accept_errors = 0
        # vLLM's CPU backend keeps K of a block head-dim-major (see _cpu_cache_positions):
        # positions[c] is where canonical element c lies; whole_pages: move whole blocks.
        self.positions: Any = None
        self.whole_pages = False
        self.layout_id = "canonical"
        self._shadow_engine: Optional[kvstage.Engine] = None
        self._shadow_buf: Any = None
        self._shadow_free: list = []

    # -- set-up ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        names = sorted(kv_caches, key=lambda n: (_layer_index(n, 0), n))
        tensors = [kv_caches[n] for n in names]
        cell = self.opts["kv_cell"]
        if cell == "auto":
            cell = "split" if tensors[0].device.type == "cpu" else "cell"
        if cell == "split":
            layout = _split_layout(tensors, self.head_dim, self.global_heads, self.tp_rank, self.tp_size)
        else:
            t = tensors[0]
            if t.dim() != 4 or t.shape[3] != 2 * self.head_dim:
                # vLLM's GPU backends: [2, blocks, block_size, heads, head_size] or [blocks, 2, ...].
                raise ValueError(
                    f"KvstageConnector: a layer's KV cache is {tuple(t.shape)}; kv_cell 'cell' needs [blocks, heads, block_size, "
                    f"{2 * self.head_dim}] (K||V per token): this attention backend's cache is not supported"
                )
            layout = kvstage.KvLayout.from_tensors(
                tensors, layout=self.opts["layout"], global_heads=self.global_heads, tp_rank=self.tp_rank, tp_size=self.tp_size
            )
        self.tensors, self.layout = tensors, layout
        if cell == "split":
            try:
                self.positions = _cpu_cache_positions(layout.page_size, self.head_dim, tensors[0].dtype)
            except Exception as e:  # noqa: BLE001 - another backend or vLLM version
                logger.warning(
                    "kvstage: cannot read how the CPU backend lays out a block (%s): moving whole blocks; a decode with another block size is refused", e
                )
                self.positions = "unknown"
            self.whole_pages = self.positions is not None
        self.layout_id = _layout_id(self.positions, layout.page_size)
        listen = None
        if self.is_consumer:
            port = int(self.opts["kvstage_port"])
            listen = f"{self.host}:{port + self.tp_rank if port else 0}"
        self.engine = kvstage.Engine(listen, transport=self.opts["transport"], cluster_token=self.opts["cluster_token"])
        self.engine.register_pool(layout)
        if self.is_consumer:
            self.engine.register_staging(int(self.opts["staging_bytes"]))
        if self.is_producer:
            self._pool = ThreadPoolExecutor(int(self.opts["send_threads"]), thread_name_prefix="kvstage-send")
            self._listen()
        logger.info(
            "kvstage: rank %d/%d registered %d layers (%s, cell %s: page %d B, token %d B, head %d B, v_offset %d B), %d blocks of %d%s%s",
            self.tp_rank,
            self.tp_size,
            len(tensors),
            tuple(tensors[0].shape),
            cell + (" (K head-dim-major in a block: whole blocks move, other block sizes are repacked)" if self.whole_pages else ""),
            layout.page_stride,
            layout.token_stride,
            layout.head_stride,
            layout.v_offset,
            layout.capacity_pages,
            layout.page_size,
            f"; kvstage engine at {self.engine.listen_address}" if self.is_consumer else "",
            f"; bootstrap at {self.bootstrap_addr}" if self.is_producer else "",
        )

    def _listen(self) -> None:
        host, port = self.bootstrap_addr.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError as e:
            raise RuntimeError(f"KvstageConnector: prefill rank {self.tp_rank} cannot listen for its bootstrap on {self.bootstrap_addr}: {e}") from e
        sock.listen(256)
        sock.settimeout(0.5)
        self._listener = sock
        threading.Thread(target=self._accept_loop, name="kvstage-bootstrap", daemon=True).start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._sessions_lock:
            for s in self._sessions.values():
                s.close()
            self._sessions.clear()
        if self.engine is not None:
            self.engine.close()
        if self._shadow_engine is not None:
            self._shadow_engine.close()

    # -- every step --------------------------------------------------------------------------

    def start(self, meta: KvstageConnectorMetadata) -> None:
        """Every step (start_load_kv): never raises (it runs inside vLLM's forward)."""
        for recv in meta.recv.values():
            try:
                self._start_recv(recv)
            except Exception as e:  # noqa: BLE001 - e.g. no thread: the load fails, it never hangs
                logger.error("kvstage: request %s: starting its load failed: %s", recv.req_id, e)
                self._complete_recv(recv, False, None)
        if meta.release and self.tp_rank == 0:
            for bootstrap, remote_id, remote_tp in meta.release:
                try:
                    threading.Thread(target=self._send_release, args=(bootstrap, remote_id, remote_tp), daemon=True).start()
                except Exception as e:  # noqa: BLE001 - the prefill's lease frees them
                    logger.warning("kvstage: releasing request %s on the prefill at %s: %s", remote_id, bootstrap, e)
        if meta.send or meta.aborted:
            now = time.monotonic()
            with self._cond:
                for send in meta.send.values():
                    if send.req_id in self._gone:  # released by its decode before we held it
                        self._finished_send.add(send.req_id)
                        self._parked.pop(send.req_id, None)
                        continue
                    self._held[send.req_id] = _Held(send, now + float(self.opts["lease_s"]))
                    for conn, msg, _ in self._parked.pop(send.req_id, []):
                        self._dispatch(conn, msg)
                for req_id in meta.aborted:
                    self._forget(req_id, "it was aborted on the prefill")

    def take_finished(self, idle: bool):
        with self._cond:
            busy = self._held or self._parked or self._receiving or self._unreleased
            if idle and busy and not (self._finished_send or self._finished_recv):
                self._cond.wait(0.02)  # an idle engine loop polls us: do not spin a core
            self._reap()
            self._retry_releases()
            sending, self._finished_send = self._finished_send, set()
            recving, self._finished_recv = self._finished_recv, set()
        return sending, recving

    def take_failed_recv(self) -> set:
        with self._cond:
            out, self._failed_recv = self._failed_recv, set()
        return out

    def take_failed_blocks(self) -> set:
        with self._cond:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    # -- prefill: bootstrap and sending --------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self._stop.is_set() or self._listener.fileno() < 0:
                    return  # shut down
                # EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: transient, keep listening.
                self._accept_errors += 1
                if self._accept_errors in (1, 10, 100) or self._accept_errors % 1000 == 0:
                    logger.warning("kvstage: bootstrap %s: accept failed (%d so far): %s", self.bootstrap_addr, self._accept_errors, e)
                time.sleep(0.05)
                continue
            try:
                with self._cond:
                    if self._conns + self._parked_count() >= _MAX_CONNS and not self._drop_oldest_parked("too many bootstrap connections"):
                        self._reply(conn, False, f"prefill {self.bootstrap_addr}: too many bootstrap connections")
                        continue
                    self._conns += 1
                threading.Thread(target=self._serve, args=(conn,), name="kvstage-bootstrap-conn", daemon=True).start()
            except Exception as e:  # noqa: BLE001 - no thread: drop this one, keep listening
                with self._cond:
                    self._conns -= 1
                logger.warning("kvstage: bootstrap %s: %s", self.bootstrap_addr, e)
                conn.close()

    def _parked_count(self) -> int:
        return sum(len(v) for v in self._parked.values())

    def _drop_oldest_parked(self, why: str) -> bool:
        """With the lock: answer the oldest parked message with an error; False when none is."""
        oldest = None
        for req_id, entries in self._parked.items():
            for i, (_, _, since) in enumerate(entries):
                if oldest is None or since < oldest[2]:
                    oldest = (req_id, i, since)
        if oldest is None:
            return False
        req_id, i, _ = oldest
        conn, _, _ = self._parked[req_id].pop(i)
        if not self._parked[req_id]:
            del self._parked[req_id]
        self._reply(conn, False, f"prefill {self.bootstrap_addr}: request {req_id} is not held and {why}: dropped")
        return True

    def _validate(self, msg: Any) -> str:
        """What is wrong with a bootstrap message ("" when nothing); fills msg["_expected"]."""
        if not isinstance(msg, dict):
            return "the message is not a JSON object"
        op, req = msg.get("op"), msg.get("req")
        if op not in ("push", "release", "none"):
            return f"unknown bootstrap op {op!r}"
        if not isinstance(req, str) or not req or len(req) > 1024:
            return f"req is {req!r}, expected a request id"
        if op == "release":
            return ""
        tp, rank, grid = msg.get("decode_tp"), msg.get("decode_rank"), msg.get("grid")
        if not _is_int(tp, 1, 1 << 16):
            return f"decode_tp is {tp!r}"
        if not _is_int(rank, 0, tp - 1):
            return f"decode_rank is {rank!r} (decode_tp {tp})"
        if not isinstance(grid, list) or len(grid) != len(kvstage.RoomGrid._fields) or not all(_is_int(x) for x in grid):
            return f"grid is {grid!r}"
        g = kvstage.RoomGrid(*grid)
        if not (1 <= g.page_size <= 1 << 20 and 1 <= g.num_chunks <= 1 << 20 and g.chunk_tokens >= 1):
            return f"grid is {grid!r}"
        try:
            feeds = self._decode_ranks(tp, g.page_size)
        except Exception as e:  # noqa: BLE001
            return f"decode_tp {tp} with page size {g.page_size} does not pair with this prefill (TP {self.tp_size}): {e}"
        if op == "push":
            if rank not in feeds:
                return f"prefill rank {self.tp_rank} of {self.tp_size} does not feed decode rank {rank} of {tp} (it feeds {sorted(feeds)})"
            if not _is_int(msg.get("room")) or not _is_int(msg.get("key")):
                return f"room {msg.get('room')!r} / key is not an unsigned integer"
            if not _check_addr(msg.get("addr")):
                return f"addr is {msg.get('addr')!r}, expected 'host:port'"
            if not isinstance(msg.get("trace", ""), str) or len(msg.get("trace", "")) > 1024:
                return "trace is not a string"
            if "layout" in msg and not isinstance(msg["layout"], str):
                return f"layout is {msg['layout']!r}"
        # Every decode rank sends each prefill rank a push or a "none": all of them are expected.
        msg["_expected"] = set(range(tp))
        return ""

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                msg = _read_line(conn, deadline=time.monotonic() + _MSG_DEADLINE_S)
            except (OSError, ValueError, _Failed) as e:
                logger.warning("kvstage: bootstrap %s: a bad or slow message: %s", self.bootstrap_addr, e)
                self._reply(conn, False, f"prefill {self.bootstrap_addr}: a bad or slow message: {e}")
                return
            if msg is None:
                conn.close()
                return
            bad = self._validate(msg)
            if bad:
                logger.warning("kvstage: bootstrap %s: refused a message: %s", self.bootstrap_addr, bad)
                self._reply(conn, False, f"prefill {self.bootstrap_addr}: {bad}")
                return
            conn.settimeout(10)
            op, req_id = msg["op"], msg["req"]
            with self._cond:
                if op == "release":
                    if req_id in self._held and not self._held[req_id].in_flight:
                        del self._held[req_id]
                        self._finished_send.add(req_id)
                        self._cond.notify_all()
                    for c, _, _ in self._parked.pop(req_id, []):
                        self._reply(c, False, f"prefill {self.bootstrap_addr}: request {req_id} was released by the decode")
                    self._note_gone(req_id, "released by the decode")
                    conn.close()
                elif req_id in self._held:
                    self._dispatch(conn, msg)
                elif req_id in self._gone:
                    self._reply(conn, False, f"prefill {self.bootstrap_addr}: request {req_id} is not held: {self._gone[req_id][0]}")
                else:  # the decode was faster than the prefill's next step: wait for the blocks
                    if self._parked_count() >= _MAX_PARKED:
                        self._drop_oldest_parked("too many messages wait for requests not held yet")
                    self._parked.setdefault(req_id, []).append((conn, msg, time.monotonic()))
        except Exception as e:  # noqa: BLE001 - a malformed peer must not take the listener down
            logger.warning("kvstage: bootstrap %s: a bad message: %s", self.bootstrap_addr, e)
            conn.close()
        finally:
            with self._cond:
                self._conns -= 1

    def _reply(self, conn: socket.socket, ok: bool, error: str = "", **more: Any) -> None:
        try:
            _send_line(conn, {"ok": ok, "error": error, **more})
        except OSError:
            pass
        finally:
            conn.close()

    def _note_gone(self, req_id: str, why: str) -> None:
        """With the lock: remember why ``req_id`` is not held (bounded: old entries expire)."""
        now = time.monotonic()
        self._gone.pop(req_id, None)
        self._gone[req_id] = (why, now)
        min_age = max(_GONE_MIN_AGE_S, 2 * float(self.opts["lease_s"]))
        while self._gone:
            k = next(iter(self._gone))
            if len(self._gone) > _GONE_MAX or now - self._gone[k][1] > min_age:
                del self._gone[k]
            else:
                break

    def _forget(self, req_id: str, why: str) -> None:
        """With the lock: ``req_id`` will not be sent; tell the decodes that asked."""
        self._note_gone(req_id, why)
        for conn, msg, _ in self._parked.pop(req_id, []):
            self._reply(conn, msg.get("op") == "none", f"prefill {self.bootstrap_addr}: request {req_id} is not held: {why}")

    def _maybe_done(self, req_id: str, held: "_Held") -> None:
        """With the lock: every decode rank was served (or said it needs nothing): free the blocks."""
        if held.expected is not None and held.served >= held.expected and not held.in_flight and self._held.get(req_id) is held:
            del self._held[req_id]
            self._note_gone(req_id, "sent already")
            self._finished_send.add(req_id)
            self._cond.notify_all()

    def _dispatch(self, conn: socket.socket, msg: dict) -> None:
        """With the lock: a validated message for a held request: send it, or note the decode
        rank that needs nothing from this rank. Never raises."""
        req_id = msg["req"]
        held = self._held[req_id]
        if held.expected is None:
            held.expected = msg["_expected"]
        if msg["op"] == "none":
            held.served.add(msg["decode_rank"])
            self._reply(conn, True)
            self._maybe_done(req_id, held)
            return
        held.in_flight += 1
        try:
            self._pool.submit(self._push, held, conn, msg)
        except Exception as e:  # noqa: BLE001 - shut down
            held.in_flight -= 1
            self._reply(conn, False, f"prefill {self.bootstrap_addr}: request {req_id}: {e}")

    def _decode_ranks(self, decode_tp: int, decode_page: int) -> set:
        if decode_tp == self.tp_size:
            return {self.tp_rank}
        me = kvstage.KvLayout(
            head_dim=self.head_dim, global_heads=self.global_heads, page_size=self.block_size, dtype_bytes=self.layout.dtype_bytes,
            tp_rank=self.tp_rank, tp_size=self.tp_size, num_layers=self.layout.num_layers,
        )
        dec = kvstage.KvLayout(
            head_dim=self.head_dim, global_heads=self.global_heads, page_size=decode_page, dtype_bytes=self.layout.dtype_bytes,
            tp_rank=0, tp_size=decode_tp, num_layers=self.layout.num_layers,
        )
        return {tp for tp, _pp in kvstage.pairing_decode_ranks(me, [dec])}

    def _session(self, addr: str, repack: bool) -> kvstage.Session:
        with self._sessions_lock:
            s = self._sessions.get((addr, repack))
            if s is None:
                engine = self._shadow_engine if repack else self.engine
                name = f"vllm-p{self.tp_rank}{'-repack' if repack else ''}->{addr}"
                try:
                    s = engine.connect(addr, name, int(float(self.opts["load_timeout_s"]) * 1000))
                except kvstage.KVStageError as e:
                    raise _Failed(f"the decode's kvstage engine at {addr} is not reachable: {e}") from e
                self._sessions[(addr, repack)] = s
            return s

    def _drop_session_if_dead(self, addr: str, repack: bool) -> None:
        """After a failure: a session whose connection is gone (the peer went, or this side cut it)
        is closed; the next request connects again. Called from error handlers: never raises."""
        try:
            with self._sessions_lock:
                s = self._sessions.get((addr, repack))
                if s is None or s.stats().dead_status == 0:
                    return
                del self._sessions[(addr, repack)]
            s.close()
        except Exception:  # noqa: BLE001 - a closed handle is as good as dropped
            pass

    # -- the CPU backend's head-dim-major K: repacking for another block size ---------------------

    def _region(self, layer: int):
        """Layer ``layer``'s cache as [blocks, heads, 2 * block_size * head_dim] (a view)."""
        import torch

        t = self.tensors[layer]
        b, h, n, c = t.shape
        return torch.as_strided(t, (b, h, n * c), (t.stride(0), t.stride(1), 1))

    def _shadow_alloc(self, n: int, deadline: float) -> list:
        """Blocks of the token-major copy (made on first use), waiting for free ones."""
        import torch

        with self._cond:
            if self._shadow_engine is None:
                cap = int(self.opts["repack_blocks"]) or 256
                t = self.tensors[0]
                _, h, bs, c = t.shape
                self._shadow_buf = torch.zeros(len(self.tensors), cap, h, bs, c, dtype=t.dtype)
                layout = _split_layout(list(self._shadow_buf), self.head_dim, self.global_heads, self.tp_rank, self.tp_size)
                engine = kvstage.Engine(None, transport=self.opts["transport"], cluster_token=self.opts["cluster_token"])
                engine.register_pool(layout)
                self._shadow_engine, self._shadow_free = engine, list(range(cap))
            cap = self._shadow_buf.shape[1]
            if n > cap:
                raise _Failed(f"the request needs {n} blocks repacked, repack_blocks is {cap}")
            while len(self._shadow_free) < n:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise _Failed(f"no {n} free repack blocks within load_timeout_s")
            out, self._shadow_free = self._shadow_free[:n], self._shadow_free[n:]
            return out

    def _shadow_release(self, slots: list) -> None:
        with self._cond:
            self._shadow_free.extend(slots)
            self._cond.notify_all()

    def _repack_out(self, blocks: list, slots: list) -> None:
        """Prefill: the request's blocks into the token-major copy."""
        import torch

        src = torch.tensor(blocks, dtype=torch.long)
        dst = torch.tensor(slots, dtype=torch.long)
        for layer in range(len(self.tensors)):
            shadow = self._shadow_buf[layer].view(self._shadow_buf.shape[1], self._shadow_buf.shape[2], -1)
            shadow[dst] = self._region(layer)[src][:, :, self.positions]

    def _repack_in(self, blocks: list) -> None:
        """Decode: the room's blocks, token-major as kvstage wrote them, into the backend's order."""
        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        for layer in range(len(self.tensors)):
            region = self._region(layer)
            canon = region[idx]
            packed = torch.empty_like(canon)
            packed[:, :, self.positions] = canon
            region[idx] = packed

    def _push(self, held: _Held, conn: socket.socket, msg: dict) -> None:
        req_id, addr = held.send.req_id, msg["addr"]
        t0 = time.monotonic()
        ok, error, sent, repack, slots = False, "", 0, False, []
        try:
            if self.hooks is not None and hasattr(self.hooks, "before_send"):
                self.hooks.before_send(req_id, msg)
            grid = kvstage.RoomGrid(*msg["grid"])
            total = held.send.num_tokens
            nblocks = math.ceil(total / self.block_size)
            blocks = held.send.block_ids[:nblocks]
            if self.whole_pages:
                # K lies head-dim-major in a block: a token's K is no row kvstage can address.
                # Same in-block order and block size on both sides: whole blocks move as they
                # are (the slots after the prompt carry whatever they held; the decode writes
                # them before it reads them). Otherwise: send a token-major copy, and say so.
                theirs = msg.get("layout")
                repack = grid.page_size != self.block_size or theirs != self.layout_id
                if repack and self.positions == "unknown":
                    raise _Failed(
                        f"the decode's block layout {theirs} differs from this prefill's {self.layout_id} and this backend's block layout is unknown"
                    )
                if repack:
                    slots = self._shadow_alloc(nblocks, t0 + float(self.opts["load_timeout_s"]))
                    self._repack_out(blocks, slots)
                    blocks = slots
                else:
                    total = nblocks * self.block_size
            session = self._session(addr, repack)
            timeout_ms = int(float(self.opts["load_timeout_s"]) * 1000)
            for k in range(grid.num_chunks):
                sp = kvstage.chunk_span(grid, total, self.block_size, k)
                pages = sp.src_pages(blocks)
                kw = dict(room_key=int(msg["key"]), src_token_offset=sp.src_token_offset, num_tokens=sp.num_tokens, trace_id=str(msg["trace"]))
                if session.transfer(int(msg["room"]), k, pages, timeout_ms, **kw) == kvstage.Status.FALLBACK:
                    session.transfer_slices(int(msg["room"]), k, pages, timeout_ms, **kw)
                sent += sp.num_tokens
            ok = True
        except _Failed as e:
            error = f"prefill {self.bootstrap_addr}: request {req_id}: {e}"
        except kvstage.KVStageError as e:
            self._drop_session_if_dead(addr, repack)
            error = f"prefill {self.bootstrap_addr}: request {req_id}: sending to the decode at {addr} failed: {e}"
        except Exception as e:  # noqa: BLE001 - reported to the decode, never lost
            error = f"prefill {self.bootstrap_addr}: request {req_id}: {type(e).__name__}: {e}"
        finally:
            if slots:
                self._shadow_release(slots)
        ms = (time.monotonic() - t0) * 1000
        if ok:
            logger.debug("kvstage: request %s: sent %d tokens to decode rank %s at %s in %.1f ms", req_id, sent, msg.get("decode_rank"), addr, ms)
        else:
            logger.error("kvstage: %s", error)
        self._reply(conn, ok, error, tokens=sent, ms=ms, token_major=bool(repack or not self.whole_pages))
        with self._cond:
            held.in_flight -= 1
            held.served.add(msg["decode_rank"])
            self._maybe_done(req_id, held)

    def _reap(self) -> None:
        """With the lock: leases that ran out, pushes whose blocks never came."""
        now = time.monotonic()
        lease = float(self.opts["lease_s"])
        for req_id, held in list(self._held.items()):
            if held.deadline <= now and not held.in_flight:
                served = f"{len(held.served)} of {len(held.expected)} decode ranks served" if held.expected else "no decode asked"
                logger.warning(
                    "kvstage: request %s: freeing its %d blocks after the %.0f s lease (%s)", req_id, len(held.send.block_ids), lease, served
                )
                del self._held[req_id]
                self._finished_send.add(req_id)
                self._forget(req_id, f"its lease of {lease:.0f} s ran out")
        for req_id, parked in list(self._parked.items()):
            if parked and now - parked[0][2] > lease:
                self._forget(req_id, "the prefill never finished it")
            elif not parked:
                del self._parked[req_id]

    # -- decode: receiving -------------------------------------------------------------------

    def _prefill_ranks(self, recv: _Recv) -> list:
        if recv.remote_tp_size == self.tp_size:
            return [self.tp_rank]
        pre = kvstage.KvLayout(
            head_dim=self.head_dim, global_heads=self.global_heads, page_size=recv.remote_block_size, dtype_bytes=self.layout.dtype_bytes,
            tp_rank=0, tp_size=recv.remote_tp_size, num_layers=self.layout.num_layers,
        )
        return sorted({tp for tp, _pp in kvstage.pairing_prefill_ranks(self.layout, [pre])})

    def _start_recv(self, recv: _Recv) -> None:
        with self._cond:
            self._receiving += 1
        threading.Thread(target=self._recv, args=(recv,), name="kvstage-recv", daemon=True).start()

    def _recv(self, recv: _Recv) -> None:
        """One request's load, on its own thread. Every step is inside the try: whatever
        happens, the request finishes receiving (failed or not): none stays waiting."""
        t0 = time.monotonic()
        deadline = t0 + float(self.opts["load_timeout_s"])
        left = lambda: max(0.001, deadline - time.monotonic())  # noqa: E731
        room = None
        socks = []
        ok, error, landed = False, "", 0
        contacted: set = set()
        ranks: list = []
        try:
            if recv.error:
                raise _Failed(recv.error)
            host, port = recv.bootstrap.rsplit(":", 1)
            port = int(port)
            ranks = self._prefill_ranks(recv)
            try:
                room = self.engine.open_room(
                    next(self._rooms), recv.block_ids, int(self.opts["chunk_tokens"]), prefix_tokens=recv.prefix_tokens, trace_id=recv.req_id
                )
            except kvstage.KVStageError as e:
                raise _Failed(f"opening its kvstage room failed: {e}") from e
            msg = {
                "op": "push",
                "req": recv.remote_request_id,
                "trace": recv.req_id,
                "room": room.room,
                "key": room.key,
                "grid": list(room.grid),
                "addr": self.engine.listen_address,
                "decode_rank": self.tp_rank,
                "decode_tp": self.tp_size,
                "layout": self.layout_id,
                "block_size": self.block_size,
            }
            for p in ranks:
                where = f"{host}:{port + p}"
                try:
                    s = socket.create_connection((host, port + p), timeout=min(left(), 10.0))
                except OSError as e:
                    raise _Failed(f"the prefill's kvstage bootstrap at {where} (prefill rank {p}) is not reachable: {e}") from e
                socks.append((where, s))
                contacted.add(p)
                _send_line(s, msg)
            token_major = set()
            for where, s in socks:
                s.settimeout(left())
                try:
                    rep = _read_line(s, deadline=deadline)
                except socket.timeout:
                    raise _Failed(f"the prefill at {where} did not send request {recv.remote_request_id} within load_timeout_s {self.opts['load_timeout_s']} s") from None
                except (OSError, ValueError) as e:
                    raise _Failed(f"the bootstrap connection to the prefill at {where} failed: {e}") from e
                if rep is None:
                    raise _Failed(f"the prefill at {where} closed the bootstrap connection before it sent request {recv.remote_request_id}: it is gone or restarting")
                if not isinstance(rep, dict) or not rep.get("ok"):
                    raise _Failed(str(rep.get("error") if isinstance(rep, dict) else rep) or f"the prefill at {where} refused the request")
                # Whether it sent token-major data (a repacked copy) or whole blocks in the
                # in-block order both sides share (the push named ours).
                token_major.add(bool(rep.get("token_major", recv.remote_block_size != self.block_size)))
            if len(token_major) > 1:
                raise _Failed("the prefill ranks disagree on whether they sent token-major blocks")
            try:
                room.wait(int(left() * 1000))
                d = room.describe()
            except kvstage.KVStageError as e:
                raise _Failed(f"its kvstage room failed: {e}") from e
            landed = sum(w.get("landed", 0) for c in d.get("chunks", ()) for w in c.get("writers", ()))
            if self.whole_pages and token_major == {True}:
                if self.positions == "unknown":
                    raise _Failed("the prefill sent token-major blocks and this backend's block layout is unknown")
                self._repack_in(recv.block_ids)
            if self.hooks is not None and hasattr(self.hooks, "on_arrival"):
                self.hooks.on_arrival(recv.req_id, self.tensors, recv.block_ids, self.layout)
            ok = True
        except _Failed as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a failed load, never a hung request
            error = f"{type(e).__name__}: {e}"
        finally:
            for _, s in socks:
                try:
                    s.close()
                except Exception:  # noqa: BLE001
                    pass
        try:
            ms = (time.monotonic() - t0) * 1000
            moved = recv.num_tokens - recv.prefix_tokens
            if ok:
                logger.info(
                    "kvstage: request %s: %d tokens (%d cached here) in %d blocks, %d bytes from %s in %.1f ms",
                    recv.req_id, moved, recv.prefix_tokens, len(recv.block_ids), landed, recv.bootstrap, ms,
                )
            else:
                logger.error("kvstage: request %s: loading its KV from the prefill at %s failed: %s", recv.req_id, recv.bootstrap, error)
                # The prefill ranks this rank did not reach yet would hold the blocks until
                # their lease: tell them it needs nothing (best effort, off this thread's path).
                rest = [p for p in range(recv.remote_tp_size) if p not in contacted] if recv.bootstrap else []
                if rest:
                    threading.Thread(target=self._send_none, args=(recv, rest, error), daemon=True).start()
            if ok and ranks:
                rest = [p for p in range(recv.remote_tp_size) if p not in ranks]
                if rest:  # left out by the pairing (they replicate heads another rank sent)
                    threading.Thread(target=self._send_none, args=(recv, rest, ""), daemon=True).start()
            self._stat(
                {"request": recv.req_id, "ok": ok, "tokens": moved, "prefix_tokens": recv.prefix_tokens, "blocks": len(recv.block_ids),
                 "bytes": landed, "ms": round(ms, 3), "error": error}
            )
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstage: request %s: after its load: %s", recv.req_id, e)
        self._complete_recv(recv, ok, room)

    def _complete_recv(self, recv: _Recv, ok: bool, room: Any) -> None:
        """The load ended: release its room, then report it to vLLM. A release that raises
        (a same-host writer still holds the pages) is retried on later steps: until it
        succeeds vLLM must not get the blocks back."""
        released = self._try_release(recv, room, first=True)
        with self._cond:
            self._receiving -= 1
            if released:
                self._report_recv(recv, ok)
            else:
                self._unreleased.append((recv, ok, room))

    def _try_release(self, recv: _Recv, room: Any, first: bool = False) -> bool:
        if room is None:
            return True
        try:
            room.release()
            return True
        except Exception as e:  # noqa: BLE001
            if first:
                logger.warning("kvstage: request %s: releasing its room: %s: its blocks stay out until a later release succeeds", recv.req_id, e)
            return False

    def _report_recv(self, recv: _Recv, ok: bool) -> None:
        """With the lock."""
        self._finished_recv.add(recv.req_id)
        if not ok:
            if recv.block_ids:
                self._failed_blocks.update(recv.block_ids)
            else:
                self._failed_recv.add(recv.req_id)
        self._cond.notify_all()

    def _retry_releases(self) -> None:
        """With the lock: rooms whose release raised before."""
        if not self._unreleased:
            return
        still = []
        for recv, ok, room in self._unreleased:
            if self._try_release(recv, room):
                logger.info("kvstage: request %s: its room is released now", recv.req_id)
                self._report_recv(recv, ok)
            else:
                still.append((recv, ok, room))
        self._unreleased = still

    def _send_none(self, recv: _Recv, ranks: list, error: str) -> None:
        """Tell prefill ranks that this decode rank needs nothing from them for the request."""
        try:
            host, port = recv.bootstrap.rsplit(":", 1)
            msg = {"op": "none", "req": recv.remote_request_id, "decode_rank": self.tp_rank, "decode_tp": self.tp_size,
                   "grid": [0, 1, 1, 1, self.block_size, 0], "error": error[:512]}
        except Exception:  # noqa: BLE001
            return
        for p in ranks:
            try:
                with socket.create_connection((host, int(port) + p), timeout=2) as s:
                    _send_line(s, msg)
                    s.settimeout(2)
                    _read_line(s, deadline=time.monotonic() + 2)
            except Exception as e:  # noqa: BLE001 - its lease frees them
                logger.debug("kvstage: request %s: telling prefill rank %d at %s: %s", recv.remote_request_id, p, recv.bootstrap, e)

    def _send_release(self, bootstrap: str, remote_id: str, remote_tp: int) -> None:
        try:
            host, port = bootstrap.rsplit(":", 1)
            port = int(port)
        except Exception:  # noqa: BLE001
            return
        for p in range(remote_tp):
            try:
                with socket.create_connection((host, port + p), timeout=5) as s:
                    _send_line(s, {"op": "release", "req": remote_id})
            except OSError as e:
                logger.warning("kvstage: releasing request %s on the prefill at %s:%d: %s", remote_id, host, port + p, e)

    def _stat(self, row: dict) -> None:
        path = self.opts["stats_file"]
        if path:
            with self._stats_lock, open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
