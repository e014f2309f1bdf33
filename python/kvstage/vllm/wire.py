"""The bootstrap's wire format: one JSON object per line over TCP, read within a deadline, the
checks its fields share, and, with a ``cluster_token``, each decode message's MAC (HMAC-SHA256
keyed by the token over the message's canonical JSON, in its ``mac`` field)."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import time
from typing import Any, Optional


class _Failed(Exception):
    pass


def _mac(msg: dict, token: str) -> str:
    body = {k: v for k, v in msg.items() if k != "mac"}
    return hmac.new(token.encode(), json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def _sign(msg: dict, token: Optional[str]) -> dict:
    """``msg`` with its MAC when there is a token."""
    return dict(msg, mac=_mac(msg, token)) if token else msg


def _authentic(msg: Any, token: Optional[str]) -> bool:
    """No token, or ``msg`` carries the MAC the token makes of it."""
    if not token:
        return True
    return isinstance(msg, dict) and isinstance(msg.get("mac"), str) and hmac.compare_digest(msg["mac"], _mac(msg, token))


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




def _is_int(v: Any, lo: int = 0, hi: int = (1 << 64) - 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_addr(v: Any) -> bool:
    if not isinstance(v, str) or ":" not in v or len(v) > 256:
        return False
    host, port = v.rsplit(":", 1)
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
