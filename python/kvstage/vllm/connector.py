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
start); ``kv_connector_extra_config`` holds the options (see ``options._OPTIONS``).

This module is what vLLM loads (``kv_connector_module_path``: ``kvstage.vllm``, or this module):
the connector class, which hands each call to its side. The modules it is made of, one job each:

- ``options``: the ``kv_connector_extra_config`` keys, their defaults and checks;
- ``scheduler``: the scheduler side (what a decode loads, what a prefill answers);
- ``metadata``: what the scheduler hands the workers each step;
- ``worker``: the worker side, one per TP rank (set-up, every step, what finished), made of
  ``bootstrap`` (the prefill's bootstrap listener), ``prefill`` (holding and sending finished
  requests) and ``decode`` (the loads);
- ``wire``: the bootstrap's line-JSON messages;
- ``layout``: how vLLM's cache tensors are described to kvstage (and the CPU kernel's probe);
- ``repack``: the CPU backend's token-major copies for another block size;
- ``threads``: the bounded thread pools the bootstrap readers, loads and notifications run on.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .metadata import KvstageConnectorMetadata
from .options import _options
from .scheduler import _Scheduler
from .worker import _Worker

__all__ = ["KvstageConnector", "KvstageConnectorMetadata"]


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

