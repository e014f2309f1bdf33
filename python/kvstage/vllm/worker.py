"""The connector's worker side, one per TP rank: registers vLLM's KV cache with kvstage, and each
step starts the scheduler's loads (decode) and holds its finished requests (prefill); reports
what finished to vLLM. The prefill's bootstrap listener (``bootstrap``), its sending
(``prefill``) and the decode's loads (``decode``) are the three parts it is made of."""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any, Optional

import kvstage

from .bootstrap import _Bootstrap
from .decode import _Decode
from .layout import _describe, _layout_id
from .metadata import KvstageConnectorMetadata
from .prefill import _Prefill
from .repack import _Repacker

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")


class _Worker(_Bootstrap, _Prefill, _Decode):
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
        # What the CPU backend's cache-write kernel is called with (the layout probe calls it so).
        self.model_dtype = getattr(mc, "dtype", None)
        self.kv_cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        self.host = opts["host"]
        self.hooks = importlib.import_module(opts["hooks"]) if opts["hooks"] else None
        self.engine: Optional[kvstage.Engine] = None
        self.layout: Optional[kvstage.KvLayout] = None
        self.tensors: list = []
        self._cond = threading.Condition()
        self._finished_send: set = set()
        self._finished_recv: set = set()
        self._failed_blocks: set = set()
        self._failed_recv: set = set()  # decode: failed loads with no blocks to name
        self._stop = threading.Event()
        # vLLM's CPU backend keeps K of a block head-dim-major (see layout._cpu_cache_positions):
        # positions[c] is where canonical element c lies; whole_pages: move whole blocks.
        self.positions: Any = None
        self.whole_pages = False
        self.layout_id = "canonical"
        self._repacker: Optional[_Repacker] = None
        self._init_bootstrap()
        self._init_prefill()
        self._init_decode()

    # -- set-up ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        cell, tensors, layout, positions = _describe(
            kv_caches, self.opts, self.head_dim, self.global_heads, self.tp_rank, self.tp_size, self.model_dtype, self.kv_cache_dtype
        )
        self.tensors, self.layout = tensors, layout
        if cell == "split":
            self.positions = positions
            self.whole_pages = positions is not None
            self._repacker = _Repacker(tensors, positions, self.opts, self.head_dim, self.global_heads, self.tp_rank, self.tp_size)
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
            self._start_sending()
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

    def shutdown(self) -> None:
        self._stop.set()
        self._stop_listening()
        self._stop_sending()
        self._stop_decode()
        if self.engine is not None:
            self.engine.close()
        if self._repacker is not None:
            self._repacker.close()

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
                    self._notify.submit(self._send_release, bootstrap, remote_id, remote_tp)
                except Exception as e:  # noqa: BLE001 - the prefill's lease frees them
                    logger.warning("kvstage: releasing request %s on the prefill at %s: %s", remote_id, bootstrap, e)
        if meta.send or meta.aborted:
            self._hold(meta.send.values(), meta.aborted)

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
