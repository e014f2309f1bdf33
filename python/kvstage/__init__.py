"""kvstage: staged KV-cache transfer for disaggregated LLM serving (ctypes binding of libkvstage).

Importing the package does not load the library; the first object or helper that needs it does
(or :func:`load_library`, which also takes an explicit path). Lookup order: the ``path``
argument, ``$KVSTAGE_LIBRARY``, a ``libkvstage.so.0.4`` next to this package, the system loader.
The library's version must equal ``kvstage.__version__``. Once loaded, its log records go to the
:mod:`logging` loggers ``kvstage.<target>`` (see :func:`route_logs_to_python`;
``KVSTAGE_PYTHON_LOGGING=0`` keeps the library's own stderr output).

Every ``timeout_ms`` means one thing: 0 is the engine's ``default_timeout_ms``,
:data:`TIMEOUT_INFINITE` is no limit (to look at an operation without waiting, ``op.poll()``).

Decode side::

    eng = kvstage.Engine()                              # listens on 127.0.0.1:<free port>
    eng.register_pool(kvstage.KvLayout(head_dim=128, global_heads=8, tp_rank=r, tp_size=2,
                                       page_size=16, k_buffers=ks, v_buffers=vs))
    eng.register_staging(64 << 20)                      # engine-owned staging ring
    with eng.open_room(room_id, decode_pages) as room:  # the opening: room id, key, chunk grid
        send_to_prefill(room_id, room.key)              # your bootstrap
        room.wait(timeout_ms=30_000)

Prefill side::

    st = kvstage.StagingTransfer(prefill_engine)
    rc = st.transfer("req-42/p0-d1", pages, None, None,
                     kvstage.TransferTarget(peer=addr, room=room_id, room_key=key, chunk_index=0))
    if rc == -1:
        st.transfer_slices("req-42/p0-d1", pages, kvstage.TransferTarget(room=room_id, room_key=key))

Modules, each importing only those listed before it: ``_version``; ``_lib`` (the ctypes view of
``include/kvstage.h``, finding a library file); ``errors``; ``_common``, ``_buffers``,
``_tensors`` (engines' tensors: pointers and byte strides), ``_logging``; ``library`` (the
process's library, version, capabilities, log routing); ``stats``; ``pool`` (:class:`KvLayout`,
engines' layouts by name and from their tensors), ``parts`` (request parts); ``room``;
``geometry``; ``op``; ``session``; ``completion``; ``engine``; ``shared``, ``diagnostics``,
``staging``; ``prometheus`` (optional, not imported here).
"""

from ._version import __version__
from ._lib import (
    ENV_VAR,
    TIMEOUT_INFINITE,
    CompletionKind,
    ErrorClass,
    LayoutPreset,
    Library,
    MemoryKind,
    ModelKind,
    RoomEventKind,
    Status,
    Transport,
    status_name,
)
from .errors import (
    ArgumentError,
    ClosedHandleError,
    DeviceError,
    GeometryError,
    InternalError,
    KVStageCause,
    KVStageError,
    LibraryLoadError,
    LibraryVersionError,
    ProtocolError,
    TimeError,
    TransportError,
    error_class_for,
)
from ._buffers import BufferInfo, buffer_address, buffer_info
from ._logging import TRACE
from .library import (
    Capabilities,
    capabilities,
    get_library,
    load_library,
    route_logs_to_python,
    route_logs_to_stderr,
    version,
)
from .stats import EngineStats, SessionStats, TransferTimings
from .pool import KvLayout, layout_preset
from . import parts
from .parts import AuxBuffer, PoolComponent, PoolSpan, RequestParts, StateComponent
from .room import Room, RoomEvent, RoomGrid
from .geometry import (
    ByteRange,
    ChunkSpan,
    HeadSlice,
    StagingLayout,
    StagingWriter,
    chunk_span,
    grid_tokens,
    head_slice,
    pairing_decode_ranks,
    pairing_prefill_ranks,
    staging_layout,
    state_slice,
)
from .op import Operation
from .session import Session
from .engine import Engine
from .shared import SharedMemory
from .diagnostics import doctor_run
from .staging import StagingTransfer, TransferTarget

__all__ = [
    "__version__",
    # whole requests
    "parts",
    "AuxBuffer",
    "StateComponent",
    "PoolComponent",
    "PoolSpan",
    "RequestParts",
    # library
    "load_library",
    "get_library",
    "Library",
    "ENV_VAR",
    "version",
    "capabilities",
    "Capabilities",
    # enums and constants
    "Status",
    "ErrorClass",
    "Transport",
    "ModelKind",
    "MemoryKind",
    "LayoutPreset",
    "CompletionKind",
    "RoomEventKind",
    "TIMEOUT_INFINITE",
    "status_name",
    # objects
    "Engine",
    "SharedMemory",
    "EngineStats",
    "Room",
    "RoomGrid",
    "RoomEvent",
    "KvLayout",
    "layout_preset",
    "Session",
    "Operation",
    "StagingTransfer",
    "TransferTarget",
    # metrics
    "SessionStats",
    "TransferTimings",
    # geometry
    "head_slice",
    "state_slice",
    "ByteRange",
    "HeadSlice",
    "staging_layout",
    "StagingLayout",
    "StagingWriter",
    "pairing_decode_ranks",
    "pairing_prefill_ranks",
    "grid_tokens",
    "chunk_span",
    "ChunkSpan",
    # diagnostics
    "doctor_run",
    # buffers
    "buffer_info",
    "buffer_address",
    "BufferInfo",
    # errors
    "KVStageError",
    "KVStageCause",
    "ArgumentError",
    "ClosedHandleError",
    "GeometryError",
    "TimeError",
    "TransportError",
    "ProtocolError",
    "DeviceError",
    "InternalError",
    "LibraryLoadError",
    "LibraryVersionError",
    "error_class_for",
    # logging (the library's records in the `logging` module, loggers "kvstage.<target>")
    "route_logs_to_python",
    "route_logs_to_stderr",
    "TRACE",
]
