"""kvstage: staged KV-cache transfer for disaggregated LLM serving (ctypes binding of libkvstage).

Importing the package does not load the library; the first object or helper that needs it does
(or :func:`load_library`, which also takes an explicit path). Lookup order: the ``path``
argument, ``$KVSTAGE_LIBRARY``, a ``libkvstage.so.0.3`` next to this package, the system loader.
The library's version must equal ``kvstage.__version__``. Once loaded, its log records go to the
:mod:`logging` loggers ``kvstage.<target>`` (see :func:`route_logs_to_python`;
``KVSTAGE_PYTHON_LOGGING=0`` keeps the library's own stderr output).

Decode side::

    eng = kvstage.Engine()                              # listens on 127.0.0.1:<free port>
    eng.register_pool(kvstage.KvLayout(head_dim=128, global_heads=8, tp_rank=r, tp_size=2,
                                       page_size=16, k_buffers=ks, v_buffers=vs))
    eng.register_staging(64 << 20)                      # engine-owned staging ring
    with eng.room(room_id, decode_pages) as room:
        room.wait(timeout_ms=30_000)

Prefill side::

    st = kvstage.StagingTransfer(prefill_engine)
    rc = st.transfer("req-42/p0-d1", pages, None, None,
                     kvstage.TransferTarget(peer=addr, room=room_id, chunk_index=0))
    if rc == -1:
        st.transfer_slices("req-42/p0-d1", pages, kvstage.TransferTarget(room=room_id))
"""

from ._buffers import BufferInfo, buffer_address, buffer_info
from ._core import (
    Capabilities,
    ChunkEvent,
    ChunkSpan,
    Engine,
    EngineStats,
    HeadSlice,
    KvLayout,
    Operation,
    Room,
    Session,
    RoomGrid,
    RoomOpening,
    SessionStats,
    StagingLayout,
    StagingWriter,
    capabilities,
    chunk_span,
    grid_tokens,
    head_slice,
    state_slice,
    ByteRange,
    staging_layout,
    transfer_timings_last,
    TransferTimings,
    version,
    writers_per_chunk,
    pairing_decode_ranks,
    pairing_prefill_ranks,
)
from ._lib import (
    DEADLINE_INFINITE,
    ENV_VAR,
    ErrorClass,
    Library,
    MemoryKind,
    ModelKind,
    Status,
    Transport,
    get_library,
    load_library,
    status_name,
)
from ._version import __version__
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
from ._logging import TRACE, route_logs_to_python, route_logs_to_stderr
from .staging import StagingTransfer, TransferTarget
from .shared import SharedMemory
from . import parts
from .parts import AuxBuffer, PoolComponent, PoolSpan, RequestParts, StateComponent

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
    "DEADLINE_INFINITE",
    "status_name",
    # objects
    "Engine",
    "SharedMemory",
    "EngineStats",
    "ChunkEvent",
    "Room",
    "KvLayout",
    "Session",
    "Operation",
    "StagingTransfer",
    # metrics
    "RoomGrid",
    "RoomOpening",
    "SessionStats",
    "TransferTimings",
    "transfer_timings_last",
    "TransferTarget",
    # geometry
    "head_slice",
    "state_slice",
    "ByteRange",
    "HeadSlice",
    "staging_layout",
    "StagingLayout",
    "StagingWriter",
    "writers_per_chunk",
    "pairing_decode_ranks",
    "pairing_prefill_ranks",
    "grid_tokens",
    "chunk_span",
    "ChunkSpan",
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
