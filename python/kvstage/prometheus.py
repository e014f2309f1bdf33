"""An engine's statistics as Prometheus metrics, through ``prometheus_client`` (an optional
dependency: ``pip install prometheus_client``; the C library stays dependency-free).

    import prometheus_client, kvstage, kvstage.prometheus
    engine = kvstage.Engine("0.0.0.0:5000")
    phases = kvstage.prometheus.register(engine)                    # default registry
    engine.set_completion_callback(phases.on_completion, metrics=True)
    prometheus_client.start_http_server(9400)

:func:`register` adds a collector that reads :meth:`Engine.stats` at every scrape (counters of
transfers by outcome, bytes, chunks, downgrades, refusals, expired rooms, panics; gauges of the
ring and of the transfers in flight) and returns :class:`PhaseHistograms`, which turns each
transfer's phase timings (from a completion callback or :meth:`Operation.timings`) into
histograms. Every metric carries an ``engine`` label
(the engine's listen address, or the name given).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ._lib import CompletionKind
from .engine import Engine
from .stats import TransferTimings

__all__ = ["EngineCollector", "PhaseHistograms", "register"]

# Transfer outcomes: (label, EngineStats field).
_OUTCOMES = (
    ("ok", "transfers_ok"),
    ("fallback", "transfers_fallback"),
    ("timeout", "transfers_timeout"),
    ("canceled", "transfers_canceled"),
    ("peer_gone", "transfers_peer_gone"),
    ("failed_other", "transfers_failed_other"),
)
# Plain counters: (metric name without the prefix, EngineStats field, help).
_COUNTERS = (
    ("bytes_sent", "bytes_sent", "Payload bytes written completely by this engine's senders."),
    ("chunks_sent", "chunks_sent", "Chunks written completely by this engine's senders."),
    ("bytes_received", "bytes_received", "Bytes received by this engine's decode side."),
    ("chunks_received", "chunks_received", "Chunks that reached this engine's KV pool."),
    ("rdma_downgrades", "rdma_downgrades", "Sessions that asked for RDMA (transport auto) and run on TCP."),
    ("shm_downgrades", "shm_downgrades", "Sessions that could not take the same-host path."),
    ("connections_refused", "connections_refused", "Connections refused or cut for load."),
    ("handshakes_failed", "handshakes_failed", "Handshakes refused (geometry, token, protocol)."),
    ("accept_errors", "accept_errors", "Failed accept calls."),
    ("rooms_expired", "rooms_expired", "Decode rooms failed by room_timeout_ms."),
    ("events_dropped", "events_dropped", "Room events dropped because the queue was full."),
    ("thread_panics", "thread_panics", "Panics caught in library threads."),
)
_GAUGES = (
    ("ring_capacity_bytes", "ring_capacity", "Bytes of the decode staging ring."),
    ("ring_used_bytes", "ring_used_bytes", "Span of the ring held by live allocations."),
    ("ring_live_allocations", "ring_live_allocations", "Live allocations of the ring."),
    ("transfers_in_flight", "transfers_in_flight", "Transfers running or queued now."),
    ("connections", "connections", "Sender connections served now."),
)
PHASES = ("queued", "watermark_wait", "alloc_wait", "gather", "wire", "ack", "total")


def _client() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 - the metric families of custom collectors
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("kvstage.prometheus needs prometheus_client: pip install prometheus_client") from e
    return prometheus_client


class EngineCollector:
    """A ``prometheus_client`` collector of engines' :meth:`Engine.stats`, read at each scrape,
    one ``engine`` label value per engine; a closed engine yields nothing."""

    def __init__(self, prefix: str = "kvstage"):
        self.prefix = prefix
        self.engines: List[Tuple[str, Engine]] = []
        self._lock = threading.Lock()

    def add(self, engine: Engine, name: str) -> None:
        with self._lock:
            self.engines.append((name, engine))

    def collect(self) -> Iterator[Any]:
        core = _client().core
        with self._lock:
            engines = list(self.engines)
        stats = [(name, e.stats()) for name, e in engines if not e.closed]
        p = self.prefix
        outcomes = core.CounterMetricFamily(f"{p}_transfers", "Transfers ended, by outcome.", labels=["engine", "outcome"])
        for name, s in stats:
            for label, field in _OUTCOMES:
                outcomes.add_metric([name, label], getattr(s, field))
        yield outcomes
        for metric, field, doc in _COUNTERS:
            c = core.CounterMetricFamily(f"{p}_{metric}", doc, labels=["engine"])
            for name, s in stats:
                c.add_metric([name], getattr(s, field))
            yield c
        for metric, field, doc in _GAUGES:
            g = core.GaugeMetricFamily(f"{p}_{metric}", doc, labels=["engine"])
            for name, s in stats:
                g.add_metric([name], getattr(s, field))
            yield g


class PhaseHistograms:
    """Histograms of transfer phase timings (seconds), one series per phase, and of the decode
    side's arrival-to-scatter times. Feed it :class:`TransferTimings` with :meth:`observe`, or
    install :meth:`on_completion` as the engine's completion callback (``metrics=True``)."""

    def __init__(self, name: str, registry: Any = None, prefix: str = "kvstage"):
        self.name = name
        self.phases, self.scatter = _shared(registry, prefix)[1:]

    def observe(self, timings: TransferTimings) -> None:
        """One transfer's phases (a phase of 0 ns did not happen and is not observed)."""
        for phase in PHASES:
            ns = getattr(timings, f"{phase}_ns")
            if ns:
                self.phases.labels(self.name, phase).observe(ns / 1e9)

    def on_completion(self, kind: int, status: Any, tag: int, room: int, chunk: int, timings: Optional[TransferTimings], scatter_ns: int) -> None:
        """A completion callback (``Engine.set_completion_callback(..., metrics=True)``)."""
        if kind == CompletionKind.OP and timings is not None:
            self.observe(timings)
        elif kind == CompletionKind.CHUNK and scatter_ns:
            self.scatter.labels(self.name).observe(scatter_ns / 1e9)


# One collector and one set of histograms per (registry, prefix): every engine registered there
# is a label value of the same metrics.
_SHARED: Dict[Tuple[int, str], Tuple[EngineCollector, Any, Any]] = {}
_SHARED_LOCK = threading.Lock()


def _shared(registry: Any, prefix: str) -> Tuple[EngineCollector, Any, Any]:
    client = _client()
    registry = registry if registry is not None else client.REGISTRY
    with _SHARED_LOCK:
        found = _SHARED.get((id(registry), prefix))
        if found is None:
            collector = EngineCollector(prefix)
            registry.register(collector)
            phases = client.Histogram(f"{prefix}_transfer_phase_seconds", "Where transfers spent their time, by phase.", ["engine", "phase"], registry=registry)
            scatter = client.Histogram(f"{prefix}_scatter_seconds", "Decode chunks: last writer's arrival to the end of the scatter.", ["engine"], registry=registry)
            found = _SHARED[(id(registry), prefix)] = (collector, phases, scatter)
        return found


def register(engine: Engine, registry: Any = None, name: Optional[str] = None, prefix: str = "kvstage") -> PhaseHistograms:
    """Adds ``engine`` to the registry's kvstage collector (``registry`` default
    ``prometheus_client.REGISTRY``; ``name`` default its listen address) and returns the
    :class:`PhaseHistograms` to feed with its transfers' timings."""
    name = name if name is not None else engine.listen_address
    _shared(registry, prefix)[0].add(engine, name)
    return PhaseHistograms(name, registry, prefix)
