"""Where this rank is and how it is reached: its attention TP/DP and PP place (sglang's published
``ParallelContext`` or its ``ServerArgs``), the bootstrap registry's host and port, and the
address other hosts reach the rank at."""

from __future__ import annotations

import socket
from typing import Any

import msgspec

from sglang.srt.disaggregation.base.conn import KVArgs


class Topology(msgspec.Struct):
    attn_tp_size: int
    attn_tp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    pp_size: int
    pp_rank: int
    system_dp_size: int
    system_dp_rank: int
    host: str
    bootstrap_port: int


def topology(server_args: Any, args: KVArgs) -> Topology:
    """This rank's place: from sglang's ``ParallelContext`` (``get_parallel()``: what a launched
    server publishes for each scheduler process) and its serving/disagg config, each read where
    it can be; else from ``server_args``' fields and ``KVArgs.engine_rank`` (a process that builds
    a manager by hand, without publishing)."""
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    attn_dp = int(getattr(server_args, "attn_dp_size", 0) or 0) or (dp if getattr(server_args, "enable_dp_attention", False) else 1)
    attn_tp = max(1, tp // attn_dp)
    rank = int(args.engine_rank)
    values = dict(
        attn_tp_size=attn_tp, attn_tp_rank=rank % attn_tp, attn_dp_size=attn_dp, attn_dp_rank=rank // attn_tp,
        pp_size=int(getattr(server_args, "pp_size", 1) or 1), system_dp_size=1 if attn_dp > 1 else dp,
    )
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        values = dict(
            attn_tp_size=int(p.attn_tp_size), attn_tp_rank=int(p.attn_tp_rank),
            attn_dp_size=int(p.attn_dp_size), attn_dp_rank=int(p.attn_dp_rank),
            pp_size=int(p.pp_size), system_dp_size=int(p.dp_size),
        )
    except Exception:  # nothing published or stamped in this process
        pass
    # The HTTP host: only the bootstrap registry's URL follows it (as in sglang's common
    # manager); the rank's own address is local_ip().
    host = str(getattr(server_args, "host", "127.0.0.1") or "127.0.0.1")
    port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
    try:
        from sglang.srt.runtime_context import get_disagg, get_serving

        host, port = str(get_serving().host), int(get_disagg().disaggregation_bootstrap_port)
    except Exception:
        pass
    return Topology(
        pp_rank=int(getattr(args, "pp_rank", 0) or 0), system_dp_rank=int(getattr(args, "system_dp_rank", 0) or 0),
        host=host, bootstrap_port=port, **values,
    )


def local_ip() -> str:
    """The address other hosts reach this rank at: sglang's own ``get_local_ip_auto()`` (what its
    common manager registers as ``rank_ip`` and binds to; ``SGLANG_HOST_IP``/``HOST_IP`` override
    it), never the HTTP ``--host`` (127.0.0.1 by default)."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto
    except ImportError:  # an sglang without it: the interface the default route leaves by
        get_local_ip_auto = None
    if get_local_ip_auto is not None:
        return get_local_ip_auto()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent
        return s.getsockname()[0]
    finally:
        s.close()


def host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip and not ip.startswith("[") else f"{ip}:{port}"
