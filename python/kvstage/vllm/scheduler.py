"""The connector's scheduler side: which prompt tokens a decode loads, the blocks it loads into,
and the ``kv_transfer_params`` a prefill answers for its decode (client input: checked, never
raising in vLLM's scheduler)."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .metadata import KvstageConnectorMetadata, _Recv, _Send

try:  # 0.32: the status enum lives with the request
    from vllm.v1.request import RequestStatus
except ImportError:  # pragma: no cover
    RequestStatus = None  # type: ignore

# Under vLLM's own logger tree, so its handler and level apply.
logger = logging.getLogger("vllm.kvstage")


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
