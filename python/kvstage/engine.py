"""Engines (header section "engine", with its registrations: pool, components, staging memory):
:class:`Engine`, the listener, peers, registered memory, rooms and sessions of one rank.

Every ``timeout_ms`` is 0 for the engine's ``default_timeout_ms`` and :data:`TIMEOUT_INFINITE` for
no limit.
"""

from __future__ import annotations

import ctypes
import weakref
from ctypes import byref, c_int32, c_uint64, c_void_p
from typing import Any, List, Optional, Sequence, Union

from . import _lib
from ._buffers import buffer_info
from ._common import Handle, check, enum_arg, init_struct, output_struct, read_json, u32, u64
from ._lib import TIMEOUT_INFINITE, Library, MemoryKind, Transport
from .completion import c_callback, in_callback
from .errors import argument_error
from .library import get_library
from .parts import components_c
from .pool import KvLayout
from .room import Room, RoomEvent, open_room, read_events
from .session import Session
from .stats import EngineStats, from_c

__all__ = ["Engine"]


class Engine(Handle):
    """``kvstage_engine``: listener, peers, the registered pool and staging ring, rooms.

    Options left ``None`` keep the library's defaults (``kvstage_engine_options_init``); the
    default listen address is ``"127.0.0.1:0"`` (a free port on loopback). ``default_timeout_ms``
    is what every ``timeout_ms`` of 0 means on this engine (transfers, waits, connects, the room
    grid, shutdown). The engine keeps the pool and ring memory objects referenced until it is
    closed.
    """

    _kind = "kvstage_engine"
    _free_fn = "kvstage_engine_free"

    def __init__(
        self,
        listen_address: Optional[str] = None,
        *,
        transport: Union[None, str, int, Transport] = None,
        worker_threads: Optional[int] = None,
        default_timeout_ms: Optional[int] = None,
        chunk_tokens: Optional[int] = None,
        send_staging_bytes: Optional[int] = None,
        cluster_token: Optional[str] = None,
        integrity: Optional[int] = None,
        max_connections: Optional[int] = None,
        max_handshakes: Optional[int] = None,
        handshake_timeout_ms: Optional[int] = None,
        max_events: Optional[int] = None,
        dead_peer_timeout_ms: Optional[int] = None,
        room_timeout_ms: Optional[int] = None,
        send_staging_buffers: Optional[int] = None,
        send_staging_total_bytes: Optional[int] = None,
        transfer_threads: Optional[int] = None,
        same_host: Optional[bool] = None,
        stall_warn_ms: Optional[int] = None,
        send_piece_bytes: Optional[int] = None,
        send_from_pool: Optional[bool] = None,
        same_host_direct: Optional[bool] = None,
        library: Optional[Library] = None,
    ):
        lib = library or get_library()
        opts = init_struct(lib, _lib.kvstage_engine_options, "kvstage_engine_options_init")
        address = None if listen_address is None else listen_address.encode("utf-8")
        opts.listen_address = address
        if transport is not None:
            opts.transport = int(enum_arg(Transport, transport, "transport"))
        token = None if cluster_token is None else cluster_token.encode("utf-8")
        opts.cluster_token = token
        if integrity is not None:
            opts.integrity = int(integrity)
        if same_host is not None:
            # kvstage_same_host: AUTO (0) lets transport AUTO take the same-host path, OFF (1) never.
            opts.same_host = 0 if same_host else 1
        if send_from_pool is not None:
            opts.send_from_pool = 1 if send_from_pool else 0
        if same_host_direct is not None:
            opts.same_host_direct = 1 if same_host_direct else 0
        for name, value, conv in (
            ("worker_threads", worker_threads, u32),
            ("default_timeout_ms", default_timeout_ms, u64),
            ("chunk_tokens", chunk_tokens, u32),
            ("send_staging_bytes", send_staging_bytes, u64),
            ("max_connections", max_connections, u32),
            ("max_handshakes", max_handshakes, u32),
            ("handshake_timeout_ms", handshake_timeout_ms, u32),
            ("max_events", max_events, u32),
            ("dead_peer_timeout_ms", dead_peer_timeout_ms, u64),
            ("room_timeout_ms", room_timeout_ms, u64),
            ("send_staging_buffers", send_staging_buffers, u32),
            ("send_staging_total_bytes", send_staging_total_bytes, u64),
            ("transfer_threads", transfer_threads, u32),
            ("stall_warn_ms", stall_warn_ms, u64),
            ("send_piece_bytes", send_piece_bytes, u64),
        ):
            if value is not None:
                setattr(opts, name, conv(value, name))
        out = c_void_p()
        check(lib, lib.kvstage_engine_new(byref(opts), byref(out)), "kvstage_engine_new")
        super().__init__(lib, out.value)
        self._pool: Optional[KvLayout] = None
        self._staging: List[Any] = []
        self._components: list = []
        self._callback: Any = None
        # Callbacks replaced from inside a callback, kept until a replacement from outside one.
        self._retired_callbacks: List[Any] = []
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()

    # -- identity and diagnostics -----------------------------------------------------------------

    @property
    def listen_address(self) -> str:
        """The address the engine listens on (``"127.0.0.1:40123"``)."""
        buf = ctypes.create_string_buffer(256)
        rc = self._lib.kvstage_engine_listen_address(self._handle(), buf, len(buf), None)
        check(self._lib, rc, "kvstage_engine_listen_address")
        return buf.value.decode("utf-8")

    def describe(self) -> dict:
        """``kvstage_engine_describe``: the engine as a dict: ``transport`` (its transport in one
        line: the same-host path with its sessions, those in direct mode and their chunks, RDMA,
        the last downgrades), the decode side's ring with its live allocations oldest first,
        connections and rooms, the sessions it opened with the chunks they are sending; README
        "Troubleshooting" has the schema."""
        return read_json(self._lib, "kvstage_engine_describe", self._handle())

    def stats(self) -> EngineStats:
        """``kvstage_engine_stats_get``: the engine's counters."""
        out = output_struct(_lib.kvstage_engine_stats)
        check(self._lib, self._lib.kvstage_engine_stats_get(self._handle(), byref(out)), "kvstage_engine_stats_get")
        return from_c(EngineStats, out)

    # -- registration -----------------------------------------------------------------------------

    def register_pool(self, layout: KvLayout) -> None:
        """``kvstage_pool_register``: this rank's KV pool (``layout`` must carry its buffers). The
        memory must stay valid while the engine lives; the engine keeps ``layout`` (and so its
        buffers) referenced."""
        if not isinstance(layout, KvLayout):
            raise TypeError(f"layout: expected a KvLayout, got {type(layout).__name__}")
        if not layout.has_buffers:
            raise argument_error("layout", "has no buffers (pass k_buffers/v_buffers to KvLayout)")
        c, _keep = layout._c()
        check(self._lib, self._lib.kvstage_pool_register(self._handle(), byref(c)), "kvstage_pool_register")
        self._pool = layout

    def register_components(self, components: Sequence[Any]) -> None:
        """``kvstage_pool_register_components``: this rank's request parts besides the KV
        (:class:`kvstage.parts.AuxBuffer`, :class:`~kvstage.parts.StateComponent`,
        :class:`~kvstage.parts.PoolComponent`; host memory), once, after :meth:`register_pool` and
        before sessions connect. Both sides register the same components in the same order (the
        handshake compares them field by field). The engine keeps the buffers referenced."""
        array, keep = components_c(self._lib, components)
        rc = self._lib.kvstage_pool_register_components(self._handle(), array, len(components))
        check(self._lib, rc, "kvstage_pool_register_components")
        self._components = keep

    def register_staging(self, size: int, memory: Any = None, device: Optional[int] = None) -> None:
        """``kvstage_staging_register``: the decode-side staging ring of ``size`` bytes.

        ``memory`` None: the engine allocates it, in host memory, or on CUDA device ``device``
        when one is named. Else ``memory`` (an int address, or an array/buffer/tensor of at least
        ``size`` bytes, kept referenced by the engine): device memory when it says so (a CUDA
        tensor, ``__cuda_array_interface__``) or when ``device`` is named for an int address. A
        device ring needs a CUDA pool on the same device; its sessions run over TCP."""
        size = u64(size, "size")
        c = init_struct(self._lib, _lib.kvstage_staging_memory, "kvstage_staging_memory_init")
        c.bytes = size
        kind = MemoryKind.HOST if device is None else MemoryKind.CUDA
        keep = None
        if memory is not None:
            info = buffer_info(memory, "memory", writable=True)
            if info.nbytes is not None and info.nbytes < size:
                raise argument_error("memory", f"holds {info.nbytes} bytes, the ring needs {size}")
            if info.memory is not None:
                if device is not None and info.memory != MemoryKind.CUDA:
                    raise argument_error("device", "is set but memory is host memory")
                kind = info.memory
            c.memory, keep = info.address, info.keepalive
        c.memory_kind = int(kind)
        if device is not None:
            if u32(device, "device") >= 1 << 31:
                raise argument_error("device", f"{device} is not a CUDA device ordinal")
            c.cuda_device = device
        rc = self._lib.kvstage_staging_register(self._handle(), byref(c))
        check(self._lib, rc, "kvstage_staging_register")
        self._staging.append(keep)

    # -- sender side ------------------------------------------------------------------------------

    def connect(self, peer_address: str, session_id: str, timeout_ms: int = 0) -> Session:
        """``kvstage_session_connect``: a session to the decode engine at ``peer_address``
        (handshake: versions, geometry fingerprints, pairing). ``timeout_ms`` 0 = engine default.
        A geometry disagreement raises :class:`GeometryError`, one cause per differing field."""
        out = c_void_p()
        rc = self._lib.kvstage_session_connect(
            self._handle(), peer_address.encode("utf-8"), session_id.encode("utf-8"), u64(timeout_ms, "timeout_ms"), byref(out)
        )
        check(self._lib, rc, "kvstage_session_connect")
        session = Session(self, out.value, peer_address, session_id)
        self._sessions.add(session)
        return session

    # -- receiver side: rooms ---------------------------------------------------------------------

    def open_room(
        self,
        room: int,
        pages: Any,
        chunk_tokens: int = 0,
        *,
        parts: Any = None,
        prefix_tokens: int = 0,
        trace_id: Optional[str] = None,
    ) -> Room:
        """``kvstage_room_open``: the request's new tokens land in ``pages`` (this rank's decode
        pages, token order), cut into chunks of ``chunk_tokens`` (0 = engine default). Returns the
        opening, a :class:`Room`: its ``key`` goes to the prefill ranks with the room id (in the
        engine's own bootstrap message; their transfers pass it as ``room_key``), its ``grid`` is
        the chunk grid. ``prefix_tokens``: tokens the decode side already holds before ``pages``
        (whole decode pages), reported in the grid for :func:`kvstage.chunk_span`. ``parts``
        (:class:`kvstage.parts.RequestParts`): the request's aux row, state slots and extra pools'
        pages on this rank; the room then completes only once they are in place too, the aux rows
        written last. ``trace_id``: the request's id in log lines and describe documents (default:
        the prefill side's, else derived from the opening)."""
        return open_room(self, room, pages, chunk_tokens, parts=parts, prefix_tokens=prefix_tokens, trace_id=trace_id)

    def poll_events(self, max_events: int = 256) -> List[RoomEvent]:
        """``kvstage_engine_poll_events``: up to ``max_events`` queued room events of every room
        (non-blocking): per room its chunks' events, then one ROOM event once it ended.
        :meth:`Room.poll_events` takes one opening's."""
        return read_events(self._lib, "kvstage_engine_poll_events", (self._handle(),), max_events)

    def shutdown(self, timeout_ms: int = TIMEOUT_INFINITE) -> None:
        """``kvstage_engine_shutdown``: stops the engine (sessions closed, rooms failing, nothing
        accepted), then waits up to ``timeout_ms`` (default :data:`TIMEOUT_INFINITE`, no limit; 0 =
        the engine's ``default_timeout_ms``) until no same-host peer maps its staging ring or KV
        pool. Returns when none does: the pool's memory (a :class:`SharedMemory`, a CUDA
        allocation) may then be freed. Raises :class:`TimeError` naming the peers' processes when
        some still do (call again to wait more). Close the engine afterwards as usual."""
        rc = self._lib.kvstage_engine_shutdown(self._handle(), u64(timeout_ms, "timeout_ms"), None)
        check(self._lib, rc, "kvstage_engine_shutdown")

    # -- completions ------------------------------------------------------------------------------

    def completion_fd(self) -> int:
        """``kvstage_engine_completion_fd``: readable whenever an operation of this engine ends or
        a room event is queued. Owned by the engine (do not close it)."""
        fd = c_int32()
        check(self._lib, self._lib.kvstage_engine_completion_fd(self._handle(), byref(fd)), "kvstage_engine_completion_fd")
        return fd.value

    def drain_completions(self) -> int:
        """``kvstage_engine_completions_drain``: resets the descriptor; completions since the last
        drain."""
        n = c_uint64()
        check(self._lib, self._lib.kvstage_engine_completions_drain(self._handle(), byref(n)), "kvstage_engine_completions_drain")
        return n.value

    async def completions(self) -> int:
        """Waits (asyncio) until the completion descriptor is readable, then drains it; returns
        how many completions were signalled. Then poll operations and events."""
        import asyncio

        loop = asyncio.get_running_loop()
        fd = self.completion_fd()
        while True:
            n = self.drain_completions()
            if n:
                return n
            ready = loop.create_future()
            loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(fd)

    def set_completion_callback(self, callback: Optional[Any], metrics: bool = False, trace: bool = False, keys: bool = False) -> None:
        """``kvstage_engine_set_completion_callback``: ``callback(kind, status, tag, room, chunk)``
        runs on a library thread for every completion (keep it short; it must not close this
        engine, and room waits and releases and operation waits are refused inside it). ``kind``
        is a :class:`CompletionKind`: ``OP`` (an operation ended; ``tag``), ``CHUNK`` (a decode
        chunk landed or failed; ``room``, ``chunk``), ``ROOM`` (a decode room ended; ``room``).
        With ``metrics=True`` it also gets ``timings`` (a :class:`TransferTimings`, for ``OP``) and
        ``scatter_ns`` (for ``CHUNK``); with ``trace=True`` the keyword ``trace`` (the request's
        trace id); with ``keys=True`` the keyword ``room_key`` (the room's opening). ``None``
        removes it. Returns once no call of the previous callback runs any more (the library waits
        for them; do not hold a lock the callback takes meanwhile), except when called from
        inside a completion callback, which never waits."""
        c_fn = c_callback(callback, metrics=metrics, trace=trace, keys=keys)
        rc = self._lib.kvstage_engine_set_completion_callback(self._handle(), c_fn, None)
        check(self._lib, rc, "kvstage_engine_set_completion_callback")
        if in_callback():
            # From inside a callback the library does not wait for the calls of the previous
            # callback still running (this one among them): their thunks must outlive them.
            self._retired_callbacks.append(self._callback)
        else:
            # The library waited for every call of the previous callbacks.
            self._retired_callbacks.clear()
        self._callback = c_fn  # kept alive while the library may call it

    # -- testing ----------------------------------------------------------------------------------

    def _testing_panic(self) -> None:
        """Test builds only: panics inside the library (``kvstage_testing_panic``)."""
        fn = getattr(self._lib, "kvstage_testing_panic", None)
        if fn is None:
            raise argument_error("library", "has no test-only exports (build with the feature `testing`)")
        check(self._lib, fn(self._handle()), "kvstage_testing_panic")

    def _before_free(self) -> None:
        for session in list(self._sessions):
            session.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<kvstage.Engine closed>"
        return f"<kvstage.Engine {self.listen_address}>"
