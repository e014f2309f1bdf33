"""The zmq sockets the two sides' messages travel on (:mod:`.messages`): a PULL socket bound on the
rank's address (a prefill rank's metadata socket, a decode rank's failure socket), PUSH sockets
to the other side's, and the decode rank's inbox of failure notices."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Dict, Optional, Tuple

import zmq

from .messages import decode_failure
from .topology import host_port

logger = logging.getLogger(__name__)


def bind_pull(ctx: zmq.Context, ip: str) -> Tuple[zmq.Socket, int]:
    """A PULL socket bound to a free port of ``ip``, and that port."""
    sock = ctx.socket(zmq.PULL)
    if ":" in ip:
        sock.setsockopt(zmq.IPV6, 1)
    bind_ip = f"[{ip}]" if ":" in ip else ip
    return sock, sock.bind_to_random_port(f"tcp://{bind_ip}")


class PushSockets:
    """PUSH sockets to the other side's PULL sockets, one per endpoint (``tcp://host:port``),
    connected on first use; a send blocks at most ``send_timeout_ms`` (``zmq.Again`` then)."""

    def __init__(self, ctx: zmq.Context, linger_ms: int, send_timeout_ms: int):
        self.ctx = ctx
        self.linger_ms = linger_ms
        self.send_timeout_ms = send_timeout_ms
        self.socks: Dict[str, zmq.Socket] = {}
        self.lock = threading.Lock()

    def send(self, endpoint: str, payload: bytes) -> None:
        with self.lock:
            sock = self.socks.get(endpoint)
            if sock is None:
                sock = self.ctx.socket(zmq.PUSH)
                try:
                    sock.setsockopt(zmq.LINGER, self.linger_ms)
                    sock.setsockopt(zmq.SNDTIMEO, self.send_timeout_ms)
                    if "[" in endpoint:
                        sock.setsockopt(zmq.IPV6, 1)
                    sock.connect(endpoint)
                except zmq.ZMQError:  # an endpoint zmq cannot use (a peer's message named it)
                    sock.close(linger=0)
                    raise
                self.socks[endpoint] = sock
            sock.send(payload)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(linger=0)


class FailureInbox:
    """A decode rank's failure socket: the prefill ranks' notices ((room, key) -> reason), read by
    the receivers' poll."""

    def __init__(self, ctx: zmq.Context, ip: str):
        self.sock, port = bind_pull(ctx, ip)
        self.address = f"tcp://{host_port(ip, port)}"  # named in the rank's metadata messages
        self.reasons: "collections.OrderedDict[Tuple[int, int], str]" = collections.OrderedDict()
        self.lock = threading.Lock()

    def pop(self, room: int, key: int) -> Optional[str]:
        """A prefill rank's failure notice for the opening (``room``, ``key``), if one came."""
        with self.lock:
            while True:
                try:
                    raw = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                try:
                    f = decode_failure(raw)
                except Exception as e:
                    logger.error("kvstage backend: bad failure notice: %s", e)
                    continue
                self.reasons.setdefault((f.room, f.room_key), f.reason)
                while len(self.reasons) > 4096:
                    self.reasons.popitem(last=False)
            return self.reasons.pop((room, key), None)

    def close(self) -> None:
        self.sock.close(linger=0)
