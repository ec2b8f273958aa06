"""Prometheus metrics of a worker process, in one place (docs/operations.md, "Metrics").

Each `vigil worker` process serves its own `/metrics` on `VIGIL_METRICS_PORT` (0, the default,
serves nothing). Beat only schedules: its housekeeping tasks run inside workers, so the sweep,
reaper and health-tick metrics come from whichever worker ran them (sum over workers).

Two kinds of numbers:
- **Events** counted where they happen, one counter increment each, no Redis call: requests
  ended by this process (set-once finish won) by pool, outcome and error code; attempts begun;
  retries; deliveries dropped; housekeeping runs (duration histograms), reaped workers and
  requests, consumers cancelled by the health tick.
- **State** read at scrape time by `WorkerCollector`: the engine host's `snapshot()` (loads,
  evictions, restarts, canaries, poisoned, stalls, LoRA loads/evictions/refusals, in flight,
  engine state), the worker's health (state, streak, quarantines), and the depth of every pool's
  queues (one pipelined LLEN per queue: cheap, and only when Prometheus asks).

Metrics live in `REGISTRY`, not prometheus_client's global one: a producer or Flower process that
imports Vigil (Flower serves its own /metrics from the global registry) exposes none of these.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from app.state.store import Outcome
    from workers.runtime import WorkerRuntime

log = logging.getLogger("vigil.metrics")

REGISTRY = CollectorRegistry(auto_describe=True)

# -- events (the hot path: one increment per finished request) ----------------------------------
REQUESTS = Counter(
    "vigil_requests", "Requests this process ended (its set-once finish won), by pool, outcome "
    "(succeeded, failed) and error code ('' on success). Summed over the fleet: every request "
    "ended, once.", ["pool", "outcome", "code"], registry=REGISTRY)
ATTEMPTS = Counter("vigil_attempts", "Attempts begun on this worker (begin said run).",
                   ["pool"], registry=REGISTRY)
RETRIES = Counter("vigil_retries", "Attempts this worker handed back for a retry, by the error "
                  "code that ended them.", ["pool", "code"], registry=REGISTRY)
DROPPED = Counter(
    "vigil_deliveries_dropped", "Deliveries that ran nothing or whose result lost: "
    "duplicate_delivery (the request had ended), stale (an older dispatch), given_back (worker "
    "stopping or quarantined: requeued untouched), duplicate_result (another result won).",
    ["pool", "reason"], registry=REGISTRY)
HOUSEKEEPING = Histogram(
    "vigil_housekeeping_duration_seconds", "Housekeeping runs that held their lock "
    "(deadline_sweep, reaper, health_tick), by duration; _count is the number of runs.",
    ["task"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY)
HOUSEKEEPING_SKIPPED = Counter("vigil_housekeeping_skipped", "Housekeeping runs that did nothing "
                               "because another run held the lock.", ["task"], registry=REGISTRY)
REAPED_WORKERS = Counter("vigil_reaped_workers", "Silent workers the reaper removed.",
                         registry=REGISTRY)
REAPED_REQUESTS = Counter("vigil_reaped_requests", "Requests of reaped workers, by what the "
                          "reaper did (requeued, failed).", ["outcome"], registry=REGISTRY)
CONSUMERS_CANCELLED = Counter("vigil_health_tick_cancelled_consumers", "Pool consumers the "
                              "health tick cancelled on quarantined workers.", registry=REGISTRY)
HOUSEKEEPING_TASKS = ("deadline_sweep", "reaper", "health_tick")
for _task in HOUSEKEEPING_TASKS:  # present (at 0) from the first scrape
    HOUSEKEEPING.labels(_task)
    HOUSEKEEPING_SKIPPED.labels(_task)


def _code(message: str) -> str:
    # VigilError.code's rule: the text before the first ':', 'unknown' without one.
    return message.split(":", 1)[0].strip() if ":" in message else ("unknown" if message else "")


def request_ended(pool: str, outcome: "Outcome") -> None:
    """Count a request this process ended (its finish won)."""
    if outcome.status == "SUCCEEDED":
        REQUESTS.labels(pool, "succeeded", "").inc()
    else:
        REQUESTS.labels(pool, "failed", _code(outcome.error)).inc()


def request_failed(pool: str, code: str) -> None:
    """Count a request this process failed with `code` (housekeeping: its finish won)."""
    REQUESTS.labels(pool, "failed", code).inc()


def attempt_begun(pool: str) -> None:
    """Count an attempt begun on this worker."""
    ATTEMPTS.labels(pool).inc()


def retried(pool: str, code: str) -> None:
    """Count an attempt handed back for a retry, by the code of the error that ended it."""
    RETRIES.labels(pool, code).inc()


def dropped(pool: str, reason: str) -> None:
    """Count a delivery that ran nothing, or whose result lost (see DROPPED)."""
    DROPPED.labels(pool, reason).inc()


def housekeeping_ran(task: str, seconds: float) -> None:
    """Record one housekeeping run that held its lock."""
    HOUSEKEEPING.labels(task).observe(seconds)


def housekeeping_skipped(task: str) -> None:
    """Count a housekeeping run that found the lock taken."""
    HOUSEKEEPING_SKIPPED.labels(task).inc()


# -- state, read at scrape time -------------------------------------------------------------------
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
        from app.state import keys
        from app.state.queues import pool_queues

        rt = self.rt
        try:
            queues = [(p, q) for p in rt.registry.names() for q in pool_queues(rt.client, p)]
            pipe = rt.client.pipeline(transaction=False)
            for _, q in queues:
                pipe.llen(q)
            pipe.scard(keys.inflight(rt.instance_id))
            *depths, held = pipe.execute()
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
    global _server
    from prometheus_client import start_http_server
    from prometheus_client.gc_collector import GCCollector
    from prometheus_client.platform_collector import PlatformCollector
    from prometheus_client.process_collector import ProcessCollector

    global _worker_collector
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
