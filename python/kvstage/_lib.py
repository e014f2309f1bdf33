"""Finding and loading ``libkvstage.so``, and the ctypes view of ``include/kvstage.h``.

Lookup order (the first that applies wins; an explicit choice that fails is an error, never a
silent fall-through to another copy of the library):

1. the ``path`` argument of :func:`load_library`;
2. the environment variable ``KVSTAGE_LIBRARY`` (a file, or a directory holding the library);
3. a ``libkvstage.so.<major>`` / ``libkvstage.so`` next to this package (``kvstage/``);
4. the system loader (``LD_LIBRARY_PATH``, ``ldconfig`` paths, ``rpath``): ``libkvstage.so.<major>``,
   ``libkvstage.so``, then ``ctypes.util.find_library("kvstage")``.

The library's ``kvstage_version_string()`` must equal the package's ``__version__``.

This module is the bottom of the package: it imports nothing of kvstage but ``_version``. The
library a process uses (:func:`kvstage.load_library`, :func:`kvstage.get_library`) is kept by
``kvstage/library.py``; this module only finds and opens library files (:func:`find_and_load`).
Every ``typedef struct`` of the header has its ``ctypes.Structure`` here, field for field
(``tests/test_header.py`` compares names, offsets and sizes with the header).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_int,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ._version import __version__

ENV_VAR = "KVSTAGE_LIBRARY"
_MAJOR, _MINOR = __version__.split(".")[:2]
# The SONAME's version: MAJOR, or 0.MINOR while the major is 0 (a minor release may break the ABI).
SOVERSION = f"0.{_MINOR}" if _MAJOR == "0" else _MAJOR
LIBRARY_NAMES: Tuple[str, ...] = (f"libkvstage.so.{SOVERSION}", "libkvstage.so")

#: ``KVSTAGE_TIMEOUT_INFINITE``: "no limit" wherever a ``timeout_ms`` is taken (0 there is the
#: engine's ``default_timeout_ms``).
TIMEOUT_INFINITE = (1 << 64) - 1

#: ``KVSTAGE_TRACE_ID_SIZE``: bytes of a trace id field (64 characters and the NUL).
TRACE_ID_SIZE = 65


class LibraryLoadError(ImportError):
    """``libkvstage.so`` could not be found or loaded, or is not a usable kvstage library."""


class LibraryVersionError(LibraryLoadError):
    """The loaded ``libkvstage.so`` has a different version than this Python package."""


# --- enums of the header ---------------------------------------------------------------------------


class Status(enum.IntEnum):
    """``kvstage_status``: 0 success, > 0 informational, < 0 errors grouped by family."""

    OK = 0
    PENDING = 1
    FALLBACK = 2
    E_INVALID_ARG = -1
    E_UNSUPPORTED = -2
    E_OUT_OF_MEMORY = -3
    E_GEOMETRY_MISMATCH = -10
    E_GEOMETRY_INVALID = -11
    E_STAGING_TOO_SMALL = -12
    E_OVERSIZED = -13
    E_TIMEOUT = -20
    E_CANCELED = -21
    E_STALE_ROOM = -22
    E_TRANSPORT = -30
    E_PEER_GONE = -31
    E_PROTOCOL = -40
    E_INTEGRITY = -41
    E_AUTH = -42
    E_CUDA = -50
    E_RDMA = -51
    E_NO_DEVICE = -52
    E_PANIC = -90
    E_POISONED = -91
    E_INTERNAL = -92

    @property
    def c_name(self) -> str:
        """The C name (``"KVSTAGE_E_TIMEOUT"``), as ``kvstage_status_name`` returns it."""
        return "KVSTAGE_" + self.name


class ErrorClass(enum.IntEnum):
    """``kvstage_error_class``: the broad family of a failure, for routing (retry, fall back, alert)."""

    NONE = 0
    CONFIG = 1
    GEOMETRY = 2
    TRANSPORT = 3
    RDMA = 4
    CUDA = 5
    PROTOCOL = 6
    TIMEOUT = 7
    INTERNAL = 8


class Transport(enum.IntEnum):
    """``kvstage_transport``."""

    AUTO = 0
    TCP = 1
    RDMA = 2
    SHM = 3


class ModelKind(enum.IntEnum):
    """``kvstage_model_kind``."""

    MHA = 0
    MLA = 1


class MemoryKind(enum.IntEnum):
    """``kvstage_memory_kind``."""

    HOST = 0
    CUDA = 1


class LayoutPreset(enum.IntEnum):
    """``kvstage_layout_preset``: an engine's named pool layout (:meth:`kvstage.KvLayout.preset`).

    ``SGLANG``: per layer a K and a V tensor ``[slots, heads, head_dim]``. ``VLLM_<ORDER>``: vLLM's
    logical cache ``[L, B, H, N, C]`` (``C = K‖V``) stored in this order of its axes, outermost
    first. ``TRTLLM``: one pool ``[blocks, layers, K/V, heads, tokens, head_dim]``.
    """

    SGLANG = 0
    VLLM_LBHNC = 1
    VLLM_LBNHC = 2
    VLLM_LHBNC = 3
    VLLM_BLHNC = 4
    VLLM_BLNHC = 5
    VLLM_BHLNC = 6
    TRTLLM = 7

    @property
    def preset_name(self) -> str:
        """The name kvstage-bench, Python and the docs use (``"sglang"``, ``"vllm-lbhnc"``, ``"trtllm"``)."""
        return self.name.lower().replace("_", "-")

    @property
    def order(self) -> str:
        """The physical order of vLLM's axes (``"LBHNC"``), ``""`` for the other engines."""
        return self.name[5:] if self.name.startswith("VLLM_") else ""


class CompletionKind(enum.IntEnum):
    """``kvstage_completion_kind``: what a completion reports."""

    #: An asynchronous operation ended (``tag``: its ``user_tag``).
    OP = 1
    #: A decode chunk was scattered or failed (``room``, ``chunk_index``).
    CHUNK = 2
    #: A decode room ended: every chunk and part landed, or the room failed (``room``).
    ROOM = 3


class RoomEventKind(enum.IntEnum):
    """``kvstage_room_event.kind``."""

    #: One chunk reached the KV pool (status OK) or failed.
    CHUNK = 1
    #: The whole request: every chunk and part landed (status OK), or the room failed.
    ROOM = 2


def status_name(code: int) -> str:
    """The C name of a status code (``"KVSTAGE_E_TIMEOUT"``), or ``"KVSTAGE_UNKNOWN"``.

    Pure Python (no library call), so it never disturbs the thread's last error.
    """
    try:
        return Status(code).c_name
    except ValueError:
        return "KVSTAGE_UNKNOWN"


# --- structs of the header -------------------------------------------------------------------------


class kvstage_error(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("code", c_int),
        ("klass", c_int),
        ("session", c_char_p),
        ("message", c_char_p),
        ("cause_count", c_size_t),
        ("causes", POINTER(c_char_p)),
    ]


class kvstage_capabilities(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("tcp", c_uint8),
        ("rdma", c_uint8),
        ("host_memory", c_uint8),
        ("cuda_memory", c_uint8),
    ]


class kvstage_engine_options(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("transport", c_int32),
        ("listen_address", c_char_p),
        ("worker_threads", c_uint32),
        ("default_timeout_ms", c_uint64),
        ("chunk_tokens", c_uint32),
        ("send_staging_bytes", c_uint64),
        ("cluster_token", c_char_p),
        ("integrity", c_int32),
        ("rdma_devices", c_char_p),
        ("rdma_gid_index", c_int32),
        ("rdma_qps_per_device", c_uint32),
        ("rdma_wr_bytes", c_uint32),
        ("rdma_signal_every", c_uint32),
        ("max_connections", c_uint32),
        ("max_handshakes", c_uint32),
        ("handshake_timeout_ms", c_uint32),
        ("max_events", c_uint32),
        ("dead_peer_timeout_ms", c_uint64),
        ("room_timeout_ms", c_uint64),
        ("send_staging_buffers", c_uint32),
        ("transfer_threads", c_uint32),
        ("send_staging_total_bytes", c_uint64),
        ("same_host", c_int32),
        ("stall_warn_ms", c_uint64),
        ("send_piece_bytes", c_uint64),
        ("send_from_pool", c_int32),
        ("same_host_direct", c_int32),
    ]


class kvstage_staging_memory(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("memory_kind", c_int32),
        ("cuda_device", c_int32),
        ("memory", c_void_p),
        ("bytes", c_size_t),
    ]


class kvstage_kv_layout(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("model_kind", c_int32),
        ("page_size", c_uint32),
        ("local_heads", c_uint32),
        ("global_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype_bytes", c_uint32),
        ("tp_rank", c_uint32),
        ("tp_size", c_uint32),
        ("pp_rank", c_uint32),
        ("pp_size", c_uint32),
        ("layer_ids", POINTER(c_uint32)),
        ("num_layers", c_size_t),
        ("k_bases", POINTER(c_uint64)),
        ("v_bases", POINTER(c_uint64)),
        ("capacity_pages", c_uint64),
        ("memory_kind", c_int32),
        ("cuda_device", c_int32),
        ("page_stride", c_uint64),
        ("token_stride", c_uint64),
        ("head_stride", c_uint64),
        ("v_offset", c_uint64),
        ("head_dim_v", c_uint32),
        ("v_page_stride", c_uint64),
        ("v_token_stride", c_uint64),
        ("v_head_stride", c_uint64),
    ]


class kvstage_transfer_timings(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("queued_ns", c_uint64),
        ("watermark_wait_ns", c_uint64),
        ("alloc_wait_ns", c_uint64),
        ("gather_ns", c_uint64),
        ("wire_ns", c_uint64),
        ("ack_ns", c_uint64),
        ("total_ns", c_uint64),
    ]


class kvstage_engine_stats(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("ring_capacity", c_uint64),
        ("ring_live_allocations", c_uint64),
        ("watermark_round", c_uint64),
        ("watermark_offset", c_uint64),
        ("rdma_downgrades", c_uint64),
        ("rdma_sessions", c_uint64),
        ("connections", c_uint64),
        ("accept_errors", c_uint64),
        ("connections_refused", c_uint64),
        ("handshakes_failed", c_uint64),
        ("events_dropped", c_uint64),
        ("rooms_expired", c_uint64),
        ("thread_panics", c_uint64),
        # metrics (appended)
        ("bytes_sent", c_uint64),
        ("chunks_sent", c_uint64),
        ("transfers_ok", c_uint64),
        ("transfers_fallback", c_uint64),
        ("transfers_failed", c_uint64),
        ("transfers_timeout", c_uint64),
        ("transfers_canceled", c_uint64),
        ("transfers_peer_gone", c_uint64),
        ("transfers_failed_other", c_uint64),
        ("transfers_in_flight", c_uint64),
        ("timed_transfers", c_uint64),
        ("timings_sum", kvstage_transfer_timings),
        ("bytes_received", c_uint64),
        ("chunks_received", c_uint64),
        ("scatter_count", c_uint64),
        ("scatter_ns_sum", c_uint64),
        ("scatter_ns_max", c_uint64),
        ("ring_used_bytes", c_uint64),
        ("ring_high_water_bytes", c_uint64),
        ("shm_sessions", c_uint64),
        ("shm_downgrades", c_uint64),
        ("rdma_host_staging_sessions", c_uint64),
        ("shm_direct_sessions", c_uint64),
        ("shm_direct_chunks", c_uint64),
        ("regions_read_into_pool", c_uint64),
    ]


class kvstage_session_stats(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("transport", c_int32),
        ("downgraded", c_uint32),
        ("bytes_sent", c_uint64),
        ("chunks_sent", c_uint64),
        ("transfers_ok", c_uint64),
        ("transfers_fallback", c_uint64),
        ("transfers_failed", c_uint64),
        ("transfers_timeout", c_uint64),
        ("transfers_canceled", c_uint64),
        ("transfers_peer_gone", c_uint64),
        ("transfers_failed_other", c_uint64),
        ("transfers_in_flight", c_uint64),
        ("timed_transfers", c_uint64),
        ("timings_sum", kvstage_transfer_timings),
        ("dead_status", c_int32),
    ]


class kvstage_head_slice(Structure):
    _fields_ = [("src_head_start", c_uint32), ("num_heads", c_uint32), ("dst_head_start", c_uint32)]


class kvstage_state_item(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("outer", c_uint32),
        ("dtype_bytes", c_uint32),
        ("group_dims", POINTER(c_uint32)),
        ("num_groups", c_size_t),
        ("replicated", c_int32),
    ]


class kvstage_byte_range(Structure):
    _fields_ = [("src_offset", c_uint64), ("dst_offset", c_uint64), ("len", c_uint64)]


class kvstage_staging_layout(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("total_bytes", c_uint64),
        ("row_bytes", c_uint64),
        ("slab_bytes", c_uint64),
        ("tokens", c_uint32),
        ("num_heads", c_uint32),
        ("buffers_per_layer", c_uint32),
        ("num_writers", c_uint32),
        ("num_tp_writers", c_uint32),
        ("parts_bytes", c_uint64),
        ("v_row_bytes", c_uint64),
        ("v_slab_bytes", c_uint64),
    ]


class kvstage_room_grid(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("key", c_uint64),
        ("chunk_tokens", c_uint32),
        ("num_chunks", c_uint32),
        ("num_pages", c_uint32),
        ("page_size", c_uint32),
        ("prefix_tokens", c_uint64),
    ]


class kvstage_rank(Structure):
    _fields_ = [("tp_rank", c_uint32), ("pp_rank", c_uint32)]


class kvstage_staging_writer(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("offset", c_uint64),
        ("bytes", c_uint64),
        ("layers", c_uint32),
        ("src_tp_rank", c_uint32),
        ("src_pp_rank", c_uint32),
        ("tp_writer", c_uint32),
        ("src_head_start", c_uint32),
        ("num_heads", c_uint32),
        ("dst_head_start", c_uint32),
        ("slab_bytes", c_uint64),
        ("v_slab_bytes", c_uint64),
    ]


class kvstage_component(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", ctypes.c_char_p),
        ("kind", c_int32),
        ("item_bytes", c_uint64),
        ("num_items", c_uint64),
        ("state", POINTER(kvstage_state_item)),
        ("page_size", c_uint32),
        ("head_sliced", c_int32),
        ("layer_ids", POINTER(c_uint32)),
        ("num_layers", c_size_t),
        ("bases", POINTER(c_uint64)),
        ("num_bases", c_size_t),
    ]


class kvstage_pool_span(Structure):
    _fields_ = [
        ("pages", POINTER(c_uint32)),
        ("num_pages", c_size_t),
        ("first_token", c_uint32),
        ("num_tokens", c_uint32),
    ]


class kvstage_request_parts(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("aux_row", c_uint64),
        ("state_slots", POINTER(c_uint64)),
        ("num_state_slots", c_size_t),
        ("pool_spans", POINTER(kvstage_pool_span)),
        ("num_pool_spans", c_size_t),
    ]


class kvstage_room_desc(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("room", c_uint64),
        ("pages", POINTER(c_uint32)),
        ("num_pages", c_size_t),
        ("chunk_tokens", c_uint32),
        ("parts", POINTER(kvstage_request_parts)),
        ("prefix_tokens", c_uint64),
        ("trace_id", c_char_p),
    ]


class kvstage_transfer_desc(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("room", c_uint64),
        ("chunk_index", c_uint32),
        ("src_pages", POINTER(c_uint32)),
        ("num_pages", c_size_t),
        ("timeout_ms", c_uint64),
        ("cuda_stream", c_void_p),
        ("cuda_event", c_void_p),
        ("user_tag", c_uint64),
        ("room_key", c_uint64),
        ("src_token_offset", c_uint32),
        ("num_tokens", c_uint32),
        ("trace_id", ctypes.c_char_p),
        ("parts", POINTER(kvstage_request_parts)),
    ]


class kvstage_chunk_span(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_chunks", c_uint32),
        ("num_tokens", c_uint32),
        ("first_token", c_uint64),
        ("src_first_page", c_uint64),
        ("src_num_pages", c_uint32),
        ("src_token_offset", c_uint32),
        ("dst_first_page", c_uint64),
        ("dst_num_pages", c_uint32),
    ]


class kvstage_completion(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("kind", c_int32),
        ("status", c_int),
        ("tag", c_uint64),
        ("room", c_uint64),
        ("chunk_index", c_uint32),
        ("timings", kvstage_transfer_timings),
        ("scatter_ns", c_uint64),
        ("room_key", c_uint64),
        ("trace_id", ctypes.c_char * TRACE_ID_SIZE),
    ]


# void (*)(void *user_data, const kvstage_completion *completion)
kvstage_completion_fn = ctypes.CFUNCTYPE(None, c_void_p, POINTER(kvstage_completion))


class kvstage_log_record(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("level", c_int32),
        ("target", c_char_p),
        ("session", c_char_p),
        ("message", c_char_p),
    ]


# void (*)(void *user_data, const kvstage_log_record *record)
kvstage_log_fn = ctypes.CFUNCTYPE(None, c_void_p, POINTER(kvstage_log_record))


class kvstage_room_event(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("kind", c_int32),
        ("status", c_int),
        ("room", c_uint64),
        ("room_key", c_uint64),
        ("chunk_index", c_uint32),
        ("scatter_ns", c_uint64),
        ("trace_id", ctypes.c_char * TRACE_ID_SIZE),
    ]


# --- prototypes ------------------------------------------------------------------------------------

_p = POINTER
_TEXT_OUT = [c_char_p, c_size_t, _p(c_size_t)]  # (buf, capacity, needed): a text the library writes
# name: (restype, argtypes), in the header's order of sections. Handles are opaque: c_void_p.
PROTOTYPES: Dict[str, Tuple[object, List[object]]] = {
    # library
    "kvstage_version_string": (c_char_p, []),
    "kvstage_version": (c_uint32, []),
    "kvstage_capabilities_get": (c_int, [_p(kvstage_capabilities)]),
    "kvstage_log_set_callback": (c_int, [kvstage_log_fn, c_void_p, c_int32]),
    # errors
    "kvstage_status_name": (c_char_p, [c_int32]),
    "kvstage_error_last": (_p(kvstage_error), []),
    "kvstage_error_clear": (None, []),
    # engine
    "kvstage_engine_options_init": (c_int, [_p(kvstage_engine_options), c_size_t]),
    "kvstage_engine_new": (c_int, [_p(kvstage_engine_options), _p(c_void_p)]),
    "kvstage_engine_free": (None, [c_void_p]),
    "kvstage_engine_shutdown": (c_int, [c_void_p, c_uint64, _p(c_size_t)]),
    "kvstage_engine_listen_address": (c_int, [c_void_p, *_TEXT_OUT]),
    "kvstage_engine_stats_get": (c_int, [c_void_p, _p(kvstage_engine_stats)]),
    "kvstage_engine_poll_events": (c_int, [c_void_p, _p(kvstage_room_event), c_size_t, _p(c_size_t)]),
    "kvstage_engine_completion_fd": (c_int, [c_void_p, _p(c_int32)]),
    "kvstage_engine_completions_drain": (c_int, [c_void_p, _p(c_uint64)]),
    "kvstage_engine_set_completion_callback": (c_int, [c_void_p, kvstage_completion_fn, c_void_p]),
    # pool and layout
    "kvstage_kv_layout_init": (c_int, [_p(kvstage_kv_layout), c_size_t]),
    "kvstage_kv_layout_preset": (c_int, [_p(kvstage_kv_layout), c_int32, _p(c_uint64)]),
    "kvstage_kv_layout_validate": (c_int, [_p(kvstage_kv_layout)]),
    "kvstage_pool_register": (c_int, [c_void_p, _p(kvstage_kv_layout)]),
    "kvstage_state_item_init": (c_int, [_p(kvstage_state_item), c_size_t]),
    "kvstage_component_init": (c_int, [_p(kvstage_component), c_size_t]),
    "kvstage_pool_register_components": (c_int, [c_void_p, _p(kvstage_component), c_size_t]),
    "kvstage_request_parts_init": (c_int, [_p(kvstage_request_parts), c_size_t]),
    # staging memory
    "kvstage_staging_memory_init": (c_int, [_p(kvstage_staging_memory), c_size_t]),
    "kvstage_staging_register": (c_int, [c_void_p, _p(kvstage_staging_memory)]),
    "kvstage_shared_alloc": (c_int, [c_size_t, _p(c_void_p)]),
    "kvstage_shared_free": (c_int, [c_void_p]),
    # room
    "kvstage_room_desc_init": (c_int, [_p(kvstage_room_desc), c_size_t]),
    "kvstage_room_open": (c_int, [c_void_p, _p(kvstage_room_desc), _p(kvstage_room_grid)]),
    "kvstage_room_wait": (c_int, [c_void_p, c_uint64, c_uint64, c_uint64]),
    "kvstage_room_release": (c_int, [c_void_p, c_uint64, c_uint64]),
    "kvstage_room_poll_events": (c_int, [c_void_p, c_uint64, c_uint64, _p(kvstage_room_event), c_size_t, _p(c_size_t)]),
    # session
    "kvstage_session_connect": (c_int, [c_void_p, c_char_p, c_char_p, c_uint64, _p(c_void_p)]),
    "kvstage_session_free": (None, [c_void_p]),
    "kvstage_session_stats_get": (c_int, [c_void_p, _p(kvstage_session_stats)]),
    "kvstage_session_room_grid_get": (c_int, [c_void_p, c_uint64, c_uint64, c_uint64, _p(kvstage_room_grid)]),
    # transfers and operations
    "kvstage_transfer_desc_init": (c_int, [_p(kvstage_transfer_desc), c_size_t]),
    "kvstage_transfer": (c_int, [c_void_p, _p(kvstage_transfer_desc)]),
    "kvstage_transfer_slices": (c_int, [c_void_p, _p(kvstage_transfer_desc)]),
    "kvstage_transfer_async": (c_int, [c_void_p, _p(kvstage_transfer_desc), _p(c_void_p)]),
    "kvstage_transfer_layerwise_async": (c_int, [c_void_p, _p(kvstage_transfer_desc), _p(c_void_p)]),
    "kvstage_op_layers_ready": (c_int, [c_void_p, c_uint32, c_uint32, c_void_p, c_void_p]),
    "kvstage_op_poll": (c_int, [c_void_p]),
    "kvstage_op_wait": (c_int, [c_void_p, c_uint64]),
    "kvstage_op_cancel": (c_int, [c_void_p]),
    "kvstage_op_free": (None, [c_void_p]),
    "kvstage_op_timings_get": (c_int, [c_void_p, _p(kvstage_transfer_timings)]),
    # geometry helpers
    "kvstage_head_slice_compute": (c_int, [c_uint32, c_uint32, c_uint32, c_uint32, c_uint32, _p(kvstage_head_slice)]),
    "kvstage_state_slice_compute": (
        c_int,
        [_p(kvstage_state_item), c_uint32, c_uint32, c_uint32, c_uint32, _p(kvstage_byte_range), c_size_t, _p(c_size_t)],
    ),
    "kvstage_pairing_decode_ranks": (
        c_int,
        [_p(kvstage_kv_layout), _p(kvstage_component), c_size_t, _p(kvstage_kv_layout), c_size_t, _p(kvstage_rank), c_size_t, _p(c_size_t)],
    ),
    "kvstage_pairing_prefill_ranks": (
        c_int,
        [_p(kvstage_kv_layout), _p(kvstage_component), c_size_t, _p(kvstage_kv_layout), c_size_t, _p(kvstage_rank), c_size_t, _p(c_size_t)],
    ),
    "kvstage_staging_layout_compute": (
        c_int,
        [
            _p(kvstage_kv_layout),
            c_size_t,
            _p(kvstage_kv_layout),
            _p(kvstage_component),
            c_size_t,
            _p(c_uint32),
            c_size_t,
            c_uint32,
            _p(kvstage_staging_layout),
            _p(kvstage_staging_writer),
            c_size_t,
        ],
    ),
    "kvstage_grid_tokens_compute": (c_int, [c_uint32, c_uint32, _p(c_uint32)]),
    "kvstage_chunk_span_compute": (c_int, [_p(kvstage_room_grid), c_uint64, c_uint32, c_uint32, _p(kvstage_chunk_span)]),
    # diagnostics
    "kvstage_engine_describe": (c_int, [c_void_p, *_TEXT_OUT]),
    "kvstage_room_describe": (c_int, [c_void_p, c_uint64, c_uint64, *_TEXT_OUT]),
    "kvstage_op_describe": (c_int, [c_void_p, *_TEXT_OUT]),
    "kvstage_doctor_run": (c_int, [c_int32, *_TEXT_OUT]),
}

# Test builds only (cargo feature `testing`); bound when the library exports them.
OPTIONAL_PROTOTYPES: Dict[str, Tuple[object, List[object]]] = {
    "kvstage_testing_panic": (c_int, [c_void_p]),
    "kvstage_testing_log": (c_int, [c_int32, c_char_p, c_char_p]),
}


class Library:
    """One loaded ``libkvstage.so`` with typed prototypes (``lib.kvstage_engine_new(...)``).

    Its version must be this package's (:data:`kvstage.__version__`): the prototypes and structs
    above are those of that version's header. A library of another version is refused
    (:class:`LibraryVersionError`); one that lacks an export is refused too. The versioned
    structs (``struct_size`` first) tell the library the binding's size of each struct, so no
    size probe is needed here.
    """

    def __init__(self, cdll: ctypes.CDLL, path: str, expected_version: str = __version__):
        self.path = path
        self._cdll = cdll
        missing = [name for name in PROTOTYPES if not hasattr(cdll, name)]
        if "kvstage_version_string" in missing:
            raise LibraryLoadError(f"{path} is not a kvstage library (it does not export kvstage_version_string)")
        for name, (restype, argtypes) in list(PROTOTYPES.items()) + list(OPTIONAL_PROTOTYPES.items()):
            if name in missing or not hasattr(cdll, name):
                continue
            fn = getattr(cdll, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
        raw = self.kvstage_version_string()
        self.version = raw.decode("ascii", "replace") if raw else "?"
        if self.version != expected_version:
            raise LibraryVersionError(
                f"{path} is libkvstage {self.version}, but the Python package kvstage is {expected_version}; "
                f"they must be the same version (rebuild the library from the same checkout, or point "
                f"{ENV_VAR} at the matching libkvstage.so)"
            )
        if missing:
            raise LibraryLoadError(f"{path} (libkvstage {self.version}) lacks the exports {', '.join(missing)}")
        #: True when the library has the test-only exports (cargo feature ``testing``).
        self.testing = hasattr(self, "kvstage_testing_panic")

    def __repr__(self) -> str:
        return f"<kvstage.Library {self.version} at {self.path!r}>"


def _open(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def _resolve_dir(path: str) -> str:
    """A directory stands for the library inside it."""
    if os.path.isdir(path):
        for name in LIBRARY_NAMES:
            candidate = os.path.join(path, name)
            if os.path.exists(candidate):
                return candidate
        return os.path.join(path, LIBRARY_NAMES[0])
    return path


def find_and_load(
    path: Optional[str] = None,
    *,
    environ: Optional[Mapping[str, str]] = None,
    package_dir: Optional[str] = None,
    system_names: Optional[Sequence[str]] = None,
    expected_version: str = __version__,
) -> Library:
    """Finds and loads the library in the documented order (see the module docstring).

    The keyword arguments exist for tests: they replace ``os.environ``, this package's directory
    and the names given to the system loader.
    """
    environ = os.environ if environ is None else environ
    package_dir = os.path.dirname(os.path.abspath(__file__)) if package_dir is None else package_dir

    def load(candidate: str, how: str) -> Library:
        candidate = _resolve_dir(os.fspath(candidate))
        try:
            cdll = _open(candidate)
        except OSError as e:
            raise LibraryLoadError(f"cannot load libkvstage from {how} ({candidate}): {e}") from None
        return Library(cdll, candidate, expected_version)

    if path is not None:
        return load(path, "the path argument")
    env = environ.get(ENV_VAR)
    if env:
        return load(env, f"{ENV_VAR}={env}")

    tried: List[str] = []
    for name in LIBRARY_NAMES:
        candidate = os.path.join(package_dir, name)
        if os.path.exists(candidate):
            return load(candidate, "the kvstage package directory")
        tried.append(f"{candidate}: no such file")
    names = list(LIBRARY_NAMES if system_names is None else system_names)
    if system_names is None:
        found = ctypes.util.find_library("kvstage")
        if found and found not in names:
            names.append(found)
    for name in names:
        try:
            cdll = _open(name)
        except OSError as e:
            tried.append(f"system loader {name}: {e}")
            continue
        return Library(cdll, getattr(cdll, "_name", name), expected_version)
    raise LibraryLoadError(
        "libkvstage.so not found. Build it (cmake --workflow --preset dev puts it in build/dev/lib/) and "
        f"set {ENV_VAR}=/path/to/libkvstage.so.{SOVERSION}, call kvstage.load_library(path), copy it next to the "
        "kvstage package, or make it visible to the system loader (LD_LIBRARY_PATH). Tried: " + "; ".join(tried)
    )
