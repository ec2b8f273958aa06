"""A worker's Prometheus endpoint: `/metrics` on `VIGIL_METRICS_PORT` (0, the default, serves
nothing), one per `vigil worker` process (docs/operations.md, "Metrics").

Besides the event counters of app/metrics.py, `WorkerCollector` reads the worker's state when
Prometheus scrapes: the engine host's `snapshot()` (loads, evictions, restarts, canaries,
poisoned, stalls, steps and their outputs, LoRA loads/evictions/refusals, in flight, engine
state), the worker's health (state, streak, quarantines), and the depth of every pool's queues
(one pipelined LLEN per queue: cheap, and only when Prometheus asks). Nothing is kept between
scrapes.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from app.metrics import REGISTRY

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime

log = logging.getLogger("vigil.metrics")

ENGINE_STATES = ("empty", "loading", "ready", "draining", "failed", "dead", "fatal")
HEALTH_STATES = ("HEALTHY", "SUSPECT", "QUARANTINED", "RESTARTING")
# snapshot() counter -> (metric name without _total, help)
ENGINE_COUNTERS = {
    "engine_loads": ("vigil_engine_loads", "Engines built (restarts included)."),
    "engine_evictions": ("vigil_engine_evictions", "Engines shut down for a model change, idle "
                         "cleanup or a failed canary."),
    "engine_restarts": ("vigil_engine_restarts", "Dead or quarantined engines replaced."),
    "poisoned": ("vigil_engine_poisoned", "Requests convicted as poison (poison_request)."),
    "stalls": ("vigil_engine_stalls", "Stalls declared by the engine-progress watchdog."),
    "served": ("vigil_engine_generations", "Generations the engine completed."),
    "lora_loads": ("vigil_lora_loads", "LoRA adapters loaded into the engine."),
    "lora_evictions": ("vigil_lora_evictions", "LoRA adapters evicted (LRU within max_loras)."),
    "lora_refused": ("vigil_lora_refused", "LoRA adapters refused by the gate before the engine."),
    "engine_steps": ("vigil_engine_steps", "Batches of outputs the engine's EngineCore sent "
                     "(about one per engine step)."),
    "engine_step_outputs": ("vigil_engine_step_outputs", "Request outputs in those batches (one "
                            "per request per token made); over vigil_engine_steps: the mean "
                            "batch, how full the engine runs."),
}
ENGINE_GAUGES = {
    "in_flight": ("vigil_engine_in_flight", "Requests in the engine now."),
    "peak_in_flight": ("vigil_engine_peak_in_flight", "Most requests in the engine at once."),
    "death_streak": ("vigil_engine_death_streak", "Engine deaths in a row with no success."),
    "recovering": ("vigil_engine_recovering", "1 while a dead engine is being recovered."),
    "paused": ("vigil_engine_paused", "1 while the worker is quarantined (engine paused)."),
}


class WorkerCollector:
    """Reads a worker runtime's state when Prometheus scrapes (nothing is kept between scrapes)."""

    def __init__(self, rt: "WorkerRuntime"):
        self.rt = rt

    def describe(self):
        """Nothing up front: the families are produced at collect time."""
        return []

    def collect(self):
        """The engine snapshot, the worker's health and the pools' queue depths."""
        rt = self.rt
        info = GaugeMetricFamily("vigil_worker_info", "This worker process (value 1).",
                                 labels=["worker", "instance_id", "engine_kind"])
        info.add_metric([rt.name, str(rt.instance_id), rt.engine_kind], 1)
        yield info
        snap = rt.host.snapshot()
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(snap.get(key) or 0))
        yield CounterMetricFamily("vigil_engine_canaries", "Canary generations run (after an "
                                  "engine death or a quarantine restart).",
                                  value=float(getattr(rt.host, "canaries", 0)))
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(snap.get(key) or 0))
        state = GaugeMetricFamily("vigil_engine_state", "The engine's state (1 for the current "
                                  "one) and its model.", labels=["state", "model"])
        for s in ENGINE_STATES:
            state.add_metric([s, snap.get("model") or ""], 1 if snap.get("engine_state") == s
                             else 0)
        yield state
        warm = snap.get("warm_adapters") or ""
        yield GaugeMetricFamily("vigil_lora_warm_adapters", "LoRA adapters warm in the engine.",
                                value=len([a for a in warm.split(",") if a]))
        health = rt.health
        hs = GaugeMetricFamily("vigil_health_state", "This worker's health state (1 for the "
                               "current one).", labels=["state"])
        for s in HEALTH_STATES:
            hs.add_metric([s], 1 if health.state == s else 0)
        yield hs
        yield GaugeMetricFamily("vigil_health_streak", "Failures proven by traffic since the "
                                "last completed generation.", value=health.streak)
        yield CounterMetricFamily("vigil_quarantines", "Times this worker quarantined itself.",
                                  value=health.quarantines)
        yield from self._redis_state()

    def _redis_state(self):
        rt = self.rt
        try:
            queues = [(p, q) for p in rt.registry.names() for q in rt.store.pool_queues(p)]
            depths = rt.store.broker.depths([q for _, q in queues])
            held = rt.store.held_count(rt.instance_id)
        except Exception as e:  # a scrape must still return the local metrics
            log.warning("metrics: cannot read queue depths from Redis: %s", e)
            return
        depth = GaugeMetricFamily("vigil_queue_depth", "Messages waiting in each queue of each "
                                  "pool (LLEN at scrape time; the same value from every worker).",
                                  labels=["pool", "queue"])
        for (p, q), n in zip(queues, depths):
            depth.add_metric([p, q], n)
        yield depth
        yield GaugeMetricFamily("vigil_requests_held", "Requests this worker holds: received, "
                                "running, or released for a retry whose message it holds.",
                                value=held)


_server_lock = threading.Lock()
_server = None
_worker_collector: WorkerCollector | None = None


def serve(rt: "WorkerRuntime", port: int, address: str = "0.0.0.0"):
    """Serve `/metrics` for this worker process on `address:port` (a daemon thread), once per
    process. A port that cannot be bound is logged, not fatal: the worker serves requests
    anyway, and Prometheus shows the target down. Returns the server, or None."""
    global _server, _worker_collector
    with _server_lock:
        if _server is not None:
            return _server
        try:
            server, _thread = start_http_server(port, addr=address, registry=REGISTRY)
        except OSError as e:
            log.error("metrics: cannot listen on %s:%d (%s); this worker serves no metrics",
                      address, port, e)
            return None
        if _worker_collector is None:  # registered once per process (a name is taken for good)
            ProcessCollector(registry=REGISTRY)
            PlatformCollector(registry=REGISTRY)
            GCCollector(registry=REGISTRY)
            _worker_collector = WorkerCollector(rt)
            REGISTRY.register(_worker_collector)
        _worker_collector.rt = rt
        _server = server
        log.info("metrics on http://%s:%d/metrics", address, port)
        return server


def stop() -> None:
    """Stop serving metrics (worker shutdown)."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        server.shutdown()
        server.server_close()
