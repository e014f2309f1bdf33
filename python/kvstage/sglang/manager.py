"""The manager: one rank's kvstage engine, built from sglang's ``KVArgs`` (KV pool, aux rows,
state pools), its settings, and what the rank's requests share: on a prefill rank its
registration, the decode ranks' metadata (:class:`~.prefill_rooms.PrefillRooms`) and its sessions
to them; on a decode rank its staging ring, the registry lookups
(:class:`~.bootstrap.PrefillRegistry`), its metadata and failure sockets and late room releases."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Dict, Optional, Tuple

import zmq

import kvstage

from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs
from sglang.srt.disaggregation.common.conn import PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode

from .bootstrap import PrefillRegistry, register_prefill_rank
from .channels import FailureInbox, PushSockets
from .messages import DecodeLayout
from .pools import components_from_args, kv_layout_from_args
from .prefill_rooms import PrefillRooms
from .releases import LateReleases
from .settings import env_float, env_int, refuse_staging_buffer, sglang_env
from .topology import host_port, local_ip, topology


class KvstageKVManager(BaseKVManager):
    """One rank's kvstage engine, built from sglang's ``KVArgs``."""

    supports_role_switch = False
    # What sglang's schedulers read off every manager (context parallelism is not wired).
    attn_cp_size = 1
    attn_cp_rank = 0
    enable_all_cp_ranks_for_transfer = False
    enable_staging = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any, is_mla_backend: Optional[bool] = False):
        refuse_staging_buffer()
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.topo = topology(server_args, args)
        policy = getattr(server_args, "disaggregation_decode_allocation_policy", "early") or "early"
        if policy != "early":
            raise NotImplementedError(f"kvstage backend: --disaggregation-decode-allocation-policy {policy} is not wired yet (early is)")
        self.local_ip = local_ip()
        self.layout, self.token_bytes = kv_layout_from_args(args, self.topo, self.is_mla_backend, server_args)
        self.components, self.state_groups, self.part_bytes = components_from_args(args, self.topo.attn_tp_size)
        self.page_size = int(args.page_size)
        self.bootstrap_timeout_s = env_float("KVSTAGE_SGLANG_BOOTSTRAP_TIMEOUT_S", sglang_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0))
        self.waiting_timeout_s = env_float("KVSTAGE_SGLANG_WAITING_TIMEOUT_S", sglang_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0))
        self.http_timeout_s = env_float("KVSTAGE_SGLANG_HTTP_TIMEOUT_S", 5.0)
        self.transfer_timeout_ms = env_int("KVSTAGE_SGLANG_TRANSFER_TIMEOUT_MS", 60_000)
        self.connect_timeout_ms = env_int("KVSTAGE_SGLANG_CONNECT_TIMEOUT_MS", 5_000)
        # A decode room's release waits this long for a writer that still holds its pages, then
        # says "not free yet" and is retried (the scheduler thread is never held longer).
        self.release_timeout_ms = env_int("KVSTAGE_SGLANG_RELEASE_TIMEOUT_MS", 100)
        transport = os.environ.get("KVSTAGE_SGLANG_TRANSPORT") or None
        decode = disaggregation_mode == DisaggregationMode.DECODE
        engine_kwargs: Dict[str, Any] = dict(
            transport=transport,
            # Decode: the only call that takes the default is the room release (its bound).
            default_timeout_ms=self.release_timeout_ms if decode else self.transfer_timeout_ms,
            dead_peer_timeout_ms=env_int("KVSTAGE_SGLANG_DEAD_PEER_TIMEOUT_MS", 10_000),
            room_timeout_ms=int(self.waiting_timeout_s * 1000),
        )
        listen = host_port(self.local_ip, env_int("KVSTAGE_SGLANG_PORT", 0)) if decode else None
        self.engine = kvstage.Engine(listen, **{k: v for k, v in engine_kwargs.items() if v is not None})
        self.engine.register_pool(self.layout)
        if self.components:
            self.engine.register_components(self.components)
        self._zmq = zmq.Context()
        self._closed = threading.Event()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._init_prefill()
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self._init_decode()
        else:
            raise ValueError(f"kvstage backend: unsupported disaggregation mode {disaggregation_mode}")

    # -- prefill side --------------------------------------------------------------------------

    def _init_prefill(self) -> None:
        self.sessions: Dict[str, kvstage.Session] = {}
        self.session_lock = threading.Lock()
        self.rooms = PrefillRooms(
            self._zmq, self.local_ip, self.layout, self.components, self.page_size, self.topo.attn_tp_rank,
            self.bootstrap_timeout_s + self.waiting_timeout_s, self._closed,
        )
        self.rank_port = self.rooms.port
        self.register_to_bootstrap()

    def register_to_bootstrap(self) -> None:
        """``PUT /route`` on the prefill server's bootstrap registry (sglang's own payload)."""
        register_prefill_rank(self.topo, self.server_args, self.kv_args, self.local_ip, self.rank_port, self.page_size,
                              self.http_timeout_s)

    def session_to(self, address: str) -> kvstage.Session:
        with self.session_lock:
            s = self.sessions.get(address)
            if s is None:
                t = self.topo
                sid = f"sglang-p{t.attn_dp_rank}.{t.attn_tp_rank}.{t.pp_rank}-{address}"
                s = self.engine.connect(address, sid, self.connect_timeout_ms)
                self.sessions[address] = s
            return s

    def drop_session_if_dead(self, address: str, session: Optional[kvstage.Session]) -> None:
        """After a failure: ``session``, when it is still the one kept for ``address`` and says
        it is dead (its connection went, or a chunk that gave up with bytes in the stream reset
        it), is closed; the next request connects again. A live one is kept: closing it would fail
        the other requests it carries."""
        try:
            with self.session_lock:
                s = self.sessions.get(address)
                if s is None or s is not session or s.stats().dead_status == 0:
                    return
                del self.sessions[address]
            s.close()
        except Exception:  # called from error handlers: a closed handle is as good as dropped
            pass

    # -- decode side ---------------------------------------------------------------------------

    def _init_decode(self) -> None:
        chunk = env_int("KVSTAGE_SGLANG_CHUNK_TOKENS", 2048)
        self.chunk_tokens_wanted = max(chunk, self.page_size)
        ring = env_int("KVSTAGE_SGLANG_RING_BYTES", 0)
        if ring <= 0:
            # A chunk of the grid (its tokens rounded to whole pages of both sides: prefill pages
            # up to 4x ours assumed here) with a request's parts; room for 4 of them in flight,
            # at least 2, at most 2 GiB beyond those 2, at least 16 MiB.
            chunk = (self.chunk_tokens_wanted + 4 * self.page_size) * self.token_bytes + self.part_bytes
            ring = max(2 * chunk, min(4 * chunk, 2 << 30), 16 << 20)
        self.engine.register_staging(ring)
        self.address = self.engine.listen_address
        self.decode_layout = DecodeLayout.of(self.layout, self.is_mla_backend)
        self.registry = PrefillRegistry(self.http_timeout_s, self.bootstrap_timeout_s)
        self.metadata_out = PushSockets(self._zmq, linger_ms=0, send_timeout_ms=int(self.http_timeout_s * 1000))
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvstage-sglang-bootstrap")
        self.late_releases = LateReleases(self._closed)
        # Failure notices of the prefill ranks, read by the receivers' poll.
        self.failures = FailureInbox(self._zmq, self.local_ip)

    @property
    def prefill_info_table(self) -> Dict[str, PrefillServerInfo]:
        """sglang's decode scheduler reads this table (bootstrap addr -> PrefillServerInfo) to
        pick a request's prefill DP rank, and fills it through try_ensure_parallel_info."""
        return self.registry.info

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """sglang's decode scheduler calls this once per scheduling cycle for a prefill server it
        has no info on yet (one registry request, bounded by KVSTAGE_SGLANG_HTTP_TIMEOUT_S); it
        aborts the server's requests after enough False answers."""
        return self.registry.try_ensure(bootstrap_addr)

    def send_to_prefill(self, addr: Tuple[str, int], payload: bytes) -> None:
        """One metadata message to the prefill rank whose metadata socket is ``addr``."""
        self.metadata_out.send(f"tcp://{host_port(addr[0], addr[1])}", payload)

    # -- shared ----------------------------------------------------------------------------------

    def teardown(self) -> None:
        self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self.rooms.close()
            for s in list(self.sessions.values()):
                try:
                    s.close()
                except Exception:
                    pass
        else:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.metadata_out.close()
            self.failures.close()
        try:
            self.engine.close()
        finally:
            self._zmq.destroy(linger=0)
