"""sglang's bootstrap registry, both ends: a prefill rank registers its metadata socket there
(``PUT /route``, sglang's own payload, as the built-in backends do); a decode rank looks up a
prefill server's layout and its ranks' sockets (``GET /route``, :class:`PrefillRegistry`). The
registry itself is sglang's (:class:`KvstageKVBootstrapServer`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Dict, List, Tuple

import requests

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, PrefillServerInfo

from .settings import env_float
from .topology import Topology

logger = logging.getLogger(__name__)

# GET /route's parameters for the server's layout (no rank of it).
_SERVER_QUERY = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}


class KvstageKVBootstrapServer(CommonKVBootstrapServer):
    """sglang's own bootstrap registry (prefill ranks register with ``PUT /route``, decode ranks
    look them up with ``GET /route``): kvstage needs nothing else from it."""


def _load_balance_method(server_args: Any) -> str:
    try:
        from sglang.srt.runtime_context import get_parallel

        return str(get_parallel().load_balance_method)
    except Exception:
        return str(getattr(server_args, "load_balance_method", "follow_bootstrap_room"))


def register_prefill_rank(topo: Topology, server_args: Any, kv_args: Any, rank_ip: str, rank_port: int, page_size: int,
                          http_timeout_s: float) -> None:
    """``PUT /route`` on the prefill server's bootstrap registry (sglang's own payload), retried
    for ``KVSTAGE_SGLANG_REGISTER_TIMEOUT_S``."""
    t = topo
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(t.host, t.host)
    dist = getattr(server_args, "dist_init_addr", None)
    if dist:
        host = str(dist).rsplit(":", 1)[0]
    url = f"http://{host}:{t.bootstrap_port}/route"
    payload = {
        "attn_tp_size": t.attn_tp_size, "attn_tp_rank": t.attn_tp_rank,
        "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": t.attn_dp_size, "attn_dp_rank": t.attn_dp_rank,
        "pp_size": t.pp_size, "pp_rank": t.pp_rank,
        "system_dp_size": t.system_dp_size, "system_dp_rank": t.system_dp_rank,
        "rank_ip": rank_ip, "rank_port": rank_port,
        "page_size": page_size,
        "kv_cache_dtype": getattr(kv_args, "kv_cache_dtype_str", None),
        "load_balance_method": _load_balance_method(server_args),
        "prefill_http_port": getattr(server_args, "port", None),
        "decode_allocation_policy": "early",
    }
    deadline = time.monotonic() + env_float("KVSTAGE_SGLANG_REGISTER_TIMEOUT_S", 60.0)
    last = ""
    while time.monotonic() < deadline:
        try:
            r = requests.put(url, json=payload, timeout=http_timeout_s)
            if r.status_code == 200:
                logger.debug("kvstage: registered prefill rank %s at %s", payload, url)
                return
            last = f"HTTP {r.status_code}: {r.text}"
        except requests.RequestException as e:
            last = str(e)
        time.sleep(0.2)
    raise RuntimeError(f"kvstage backend: prefill rank could not register at the bootstrap server {url}: {last}")


class PrefillRegistry:
    """A decode rank's view of the prefill servers' registries: each server's layout
    (``info``, sglang's ``prefill_info_table``), the last lookup error per server, and the
    metadata socket of each prefill rank, cached until a request from that server fails. Each
    registry request is bounded by ``http_timeout_s``."""

    def __init__(self, http_timeout_s: float, bootstrap_timeout_s: float):
        self.http_timeout_s = http_timeout_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.info: Dict[str, PrefillServerInfo] = {}
        self.errors: Dict[str, str] = {}
        self.rank_info: Dict[Tuple[str, int, int, int], Tuple[str, int]] = {}
        self.lock = threading.Lock()

    def _request(self, bootstrap_addr: str, params: Dict[str, int]) -> requests.Response:
        return requests.get(f"http://{bootstrap_addr}/route", params=params,
                            timeout=(min(self.http_timeout_s, 2.0), self.http_timeout_s))

    def _get(self, bootstrap_addr: str, params: Dict[str, int]) -> Any:
        """``GET /route``, retried while the registry has no ranks yet (503), for the bootstrap
        timeout."""
        deadline = time.monotonic() + self.bootstrap_timeout_s
        last = ""
        while True:
            try:
                r = self._request(bootstrap_addr, params)
            except requests.Timeout:
                raise RuntimeError(
                    f"bootstrap server {bootstrap_addr} did not answer GET /route within {self.http_timeout_s:g}s "
                    "(is it an sglang prefill server's bootstrap port, and is it alive?)"
                )
            except requests.RequestException as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return r.json()
                last = f"HTTP {r.status_code}: {r.text.strip()}"
                if r.status_code not in (503,):
                    raise RuntimeError(f"bootstrap server {bootstrap_addr} refused GET /route {params}: {last}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"bootstrap server {bootstrap_addr}: no prefill ranks within {self.bootstrap_timeout_s:g}s ({last})")
            time.sleep(0.2)

    @staticmethod
    def _server_info(data: Dict[str, Any]) -> PrefillServerInfo:
        known = {f.name for f in dataclasses.fields(PrefillServerInfo)}
        info = PrefillServerInfo(**{k: v for k, v in data.items() if k in known})
        if info.attn_cp_size != 1:
            raise NotImplementedError("kvstage backend: prefill context parallelism is not wired yet")
        return info

    def try_ensure(self, bootstrap_addr: str) -> bool:
        """One registry request for a server's layout unless known (sglang's
        ``try_ensure_parallel_info``); a failure is kept in ``errors``."""
        if bootstrap_addr in self.info:
            return True
        try:
            r = self._request(bootstrap_addr, _SERVER_QUERY)
            if r.status_code != 200:
                self.errors[bootstrap_addr] = f"bootstrap server {bootstrap_addr} answered HTTP {r.status_code}: {r.text.strip()}"
                return False
            self.info[bootstrap_addr] = self._server_info(r.json())
        except requests.Timeout:
            self.errors[bootstrap_addr] = f"bootstrap server {bootstrap_addr} did not answer GET /route within {self.http_timeout_s:g}s"
            return False
        except requests.RequestException as e:
            self.errors[bootstrap_addr] = f"bootstrap server {bootstrap_addr} unreachable: {type(e).__name__}: {e}"
            return False
        self.errors.pop(bootstrap_addr, None)
        return True

    def resolve(self, bootstrap_addr: str, prefill_dp_rank: int) -> Tuple[PrefillServerInfo, List[Tuple[str, int]]]:
        """The prefill server's layout and every rank of its DP group (address of its metadata
        socket); cached per server until a request fails."""
        info = self.info.get(bootstrap_addr)
        if info is None:
            info = self._server_info(self._get(bootstrap_addr, _SERVER_QUERY))
            self.info[bootstrap_addr] = info
        ranks = []
        for tp in range(info.attn_tp_size):
            for pp in range(info.pp_size):
                k = (bootstrap_addr, prefill_dp_rank, tp, pp)
                addr = self.rank_info.get(k)
                if addr is None:
                    r = self._get(bootstrap_addr, {"prefill_dp_rank": prefill_dp_rank, "prefill_cp_rank": 0, "target_tp_rank": tp, "target_pp_rank": pp})
                    addr = (str(r["rank_ip"]), int(r["rank_port"]))
                    with self.lock:
                        self.rank_info[k] = addr
                ranks.append(addr)
        return info, ranks

    def invalidate(self, bootstrap_addr: str) -> None:
        """Forget what the registry said about a prefill server (after a request from it failed:
        the next request looks it up again, a restarted prefill rank has a new address). The
        metadata sockets stay: other requests' messages may still be on their way."""
        with self.lock:
            self.info.pop(bootstrap_addr, None)
            for k in [k for k in self.rank_info if k[0] == bootstrap_addr]:
                self.rank_info.pop(k, None)
