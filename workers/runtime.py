"""The worker process's runtime: built in Celery's start-up hook, torn down at shutdown.

One `WorkerRuntime` per worker process wires together the settings, the Redis state, the model
registry, the engine host, the heartbeat, the health ledger, the orphan guard and the rules for
the requests it holds (workers/held.py); the Celery app's ports (app/celery_ports.py) come in
from the start-up hook. Nothing here runs at import: producers import `tasks.inference` (and so
this module) without starting anything.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid

from app.celery_ports import CeleryPorts
from app.drills import parse_drill
from app.errors import WorkerFatalError
from app.first_imports import WORKER_MODULES, import_first
from app.requests.publish import republisher
from app.requests.version_gate import ADVERTISED
from app.requests.models import ModelRegistry, ModelSpec, get_registry
from app.settings import VigilSettings, get_settings
from app.state.health import HEALTHY
from app.state.queues import pool_of
from app.state.store import open_store
from workers.engine.host import EngineHost, HostEvents
from workers.engine.kinds import ENGINES, MODEL_ENGINES, engine_factory
from workers.engine.memory import MiB, MemoryPlan, plan_memory, probe_memory, worker_device
from workers.engine.vllm_args import engine_env_defaults
from workers.engine.witness import Witness
from workers.heartbeat import Heartbeat, device_fields
from workers.held import HeldRequests
from workers.orphan_guard import OrphanGuard
from workers.quarantine import QuarantineActions, WorkerHealth
from workers.stream_sink import StreamSink

log = logging.getLogger("vigil.worker")

# How long a worker trusts its last look at which other workers serve a pool.
OTHERS_CACHE_S = 2.0

_runtime: "WorkerRuntime | None" = None
_lock = threading.Lock()


def new_instance_id() -> int:
    """A worker instance id: 63 random bits, never the PID (PIDs recur across restarts)."""
    return uuid.uuid4().int & (2**63 - 1)


class WorkerRuntime:
    """Everything a worker process needs to serve requests."""

    def __init__(self, settings: VigilSettings, name: str, *, ports: CeleryPorts,
                 registry: ModelRegistry | None = None, engine: str | None = None,
                 guard: bool = True):
        self.settings = settings
        self.ports = ports
        self.name = name
        self.instance_id = new_instance_id()
        self.registry = registry or get_registry()
        # Writes ride out a Redis restart (a finished generation is not thrown away); so do the
        # token streams and the health ledger, which the store hands out under its policy.
        self.store = open_store(settings, settings.redis_outage_grace)
        engine = engine or settings.engine
        if engine not in ENGINES:
            raise ValueError(f"VIGIL_ENGINE must be one of {sorted(ENGINES)}, got {engine!r}")
        if engine != "vllm":
            log.warning("VIGIL_ENGINE=%s: this worker answers without a model (benchmarks only)",
                        engine)
        engine_env_defaults()
        if engine in MODEL_ENGINES:  # on this thread, before any of the worker's threads runs
            log.info("imported vLLM's modules in %.1f s", import_first(WORKER_MODULES))
        self.engine_kind = engine
        self.device = worker_device()
        # The pools this worker was started with (`vigil worker --pools`, else all it can run:
        # on GPUs, not those whose tensor_parallel_size asks for another number of cards, which
        # `vigil worker` leaves out of its queues too); `pools` follows what its consumer really
        # consumes (beat's reconcile may lend it to others).
        self.configured_pools = list(settings.pools) or self.registry.names()
        if self.device[0] == "cuda" and not settings.pools:
            self.configured_pools = self.registry.split_by_cards(self.configured_pools,
                                                                 len(self.device[1]))[0]
        self.consumer = None  # Celery's consumer, set at worker_ready
        self.guard = OrphanGuard() if guard else None
        witness = Witness(settings.witness_dir) if settings.witness_dir else None
        self.host = EngineHost(engine_factory(engine, parse_drill(settings.drill), witness,
                                              settings.engine_wave_ms / 1000),
                               idle_cleanup=settings.idle_cleanup,
                               events=WorkerEvents(self, sizes_memory=engine in MODEL_ENGINES),
                               death_limit=settings.engine_death_limit,
                               stall_timeout=settings.stall_after,
                               engine_start_timeout=settings.engine_start_timeout,
                               freeze_heap=engine in MODEL_ENGINES)
        # Token streams (workers/streaming.py), for the engines that stream (the real one).
        self.streams: StreamSink | None = None
        if settings.stream_flush_ms > 0 and engine in MODEL_ENGINES:
            self.streams = StreamSink(self.store.streams(), settings.stream_flush_ms,
                                      settings.stream_chunk_tokens)
        self.held = HeldRequests(
            name, self.instance_id, self.store, self.host, self.streams,
            republisher(ports.send), ports.backend, ports.bus, settings.max_attempts,
            pools=lambda: self.pools, stop_heartbeat=lambda: self.heartbeat.stop(
                unregister=False), max_drains=settings.max_drains)
        self._others: dict[str, tuple[float, bool]] = {}  # pool -> (when, others_serve)
        self.health = WorkerHealth(
            self.store.health_ledger(window=settings.failure_window,
                                     threshold=settings.failure_threshold),
            self.instance_id, name, self.host,
            QuarantineActions(pools=lambda: self.pools or list(self.configured_pools),
                              consume=self.held.consume_pools,
                              hand_back=self.held.hand_back_held,
                              canary_spec=self.canary_spec, leave=self.held.leave),
            on_change=lambda: self.heartbeat.poke(), canary_timeout=settings.request_timeout,
            max_canary_failures=settings.max_canary_failures)
        # No outage grace: a beat that cannot land is retried by the next one, and its failure
        # is how the heartbeat sees Redis come back.
        self.heartbeat = Heartbeat(self.store.without_grace().workers, self.instance_id, name,
                                   settings.heartbeat_interval, self._heartbeat_fields,
                                   on_redis_back=self.held.reclaim_orphans,
                                   after_beat=self.held.abort_ended)

    @property
    def pools(self) -> list[str]:
        """The pools this worker consumes now: from its consumer's queues once it runs (the
        reconcile adds and removes pools), else the ones it was started with."""
        try:
            queues = [q.name for q in self.consumer.task_consumer.queues]
        except AttributeError:  # not consuming yet
            return list(self.configured_pools)
        pools = [p for p in map(pool_of, queues) if p]
        # Possibly none: a drained or quarantined worker consumes no pool.
        return sorted(p for p in pools if p in self.registry)

    def others_serve(self, pool: str) -> bool:
        """True when another live, HEALTHY worker consumes `pool` (read from the registry at
        most every OTHERS_CACHE_S per pool): a request that failed here then goes to it rather
        than run here again. False when Redis cannot say."""
        now = time.monotonic()
        cached = self._others.get(pool)
        if cached is not None and now - cached[0] < OTHERS_CACHE_S:
            return cached[1]
        try:
            entries = self.store.workers.entries()
        except Exception as e:
            log.warning("cannot read the registry: %s", e)
            return False
        wall = time.time()
        answer = any(e.instance != str(self.instance_id) and pool in e.pools
                     and e.health_state == HEALTHY and e.live(wall, self.settings.live_window)
                     for e in entries)
        self._others[pool] = (now, answer)
        return answer

    def served_elsewhere(self, model: str) -> bool:
        """True when another live worker's engine holds `model` now: a start of it that fails
        here is then this worker's fault, not the model's. False when Redis cannot say."""
        try:  # no outage grace: this runs on the engine loop, which must not wait on Redis
            entries = self.store.without_grace().workers.entries()
        except Exception as e:
            log.warning("cannot read the registry: %s", e)
            return False
        now = time.time()
        return any(e.instance != str(self.instance_id) and e.model == model
                   and e.live(now, self.settings.live_window) for e in entries)

    def plan_memory(self, spec: ModelSpec) -> MemoryPlan:
        """Measure free memory on this worker's device and size `spec`'s engine start to it."""
        return plan_memory(spec, probe_memory(*self.device),
                           self.settings.gpu_headroom_mib * MiB)

    def _heartbeat_fields(self) -> dict:
        # Every card of the worker, each heartbeat; a card lost under it makes the worker leave.
        device = device_fields(lambda: probe_memory(*self.device), self._card_lost)
        return {**self.host.snapshot(), **self.health.fields(), "pools": ",".join(self.pools),
                "configured_pools": ",".join(self.configured_pools),
                "engine_kind": self.engine_kind, "schema_versions": ADVERTISED, **device}

    def _card_lost(self, err: WorkerFatalError) -> None:
        if self.leaving is None:  # off the heartbeat thread: leaving stops that thread
            threading.Thread(target=self.held.leave, args=(err,), name="vigil-card-lost",
                             daemon=True).start()

    def _engine_changed(self) -> None:
        if self.guard is not None:
            self.guard.report(self.host.child_pids())
        self.heartbeat.poke()

    def start(self) -> "WorkerRuntime":
        """Register (heartbeat), start the engine loop thread. No engine is built here."""
        log.info("worker %s instance %d starting (engine=%s)", self.name, self.instance_id,
                 self.engine_kind)
        self.host.start()
        if self.streams is not None:
            self.streams.start()
        self.heartbeat.start()
        return self

    def preload(self, models: list[str]) -> None:
        """Build the engines of configured pools before the first request (worker start)."""
        for name in models:
            started = time.monotonic()
            spec = self.registry.get(name)
            self.host.preload(spec, timeout=self.host.start_bound(spec))
            log.info("preloaded %s in %.1f s", name, time.monotonic() - started)

    def ready(self) -> None:
        """The worker finished starting (Celery ready, preload over, loaded or failed): its
        registry entry says has_pinged=1 from now on, so the reaper judges it by the reap
        timeout instead of the registration grace."""
        self.heartbeat.mark_ready()
        log.info("worker %s instance %d ready", self.name, self.instance_id)

    def canary_spec(self) -> ModelSpec:
        """The model a quarantined worker proves itself on: its engine's, else its first pool's."""
        return self.registry.get(self.host.snapshot()["model"]
                                 or (self.pools or self.configured_pools)[0])

    @property
    def leaving(self) -> WorkerFatalError | None:
        """Why this worker is leaving broken, once it is (workers/held.py `leave`)."""
        return self.held.leaving

    def hand_back(self) -> tuple[int, int]:
        """Graceful stop (SIGTERM): the held requests go back to the queue, drained: every
        token written, no attempt used (workers/held.py)."""
        return self.held.hand_back(drain=True)

    def stop(self) -> None:
        """Clean stop: engine shut down (no leaked processes or shared memory), unregistered."""
        self.health.close()
        self.heartbeat.stop(unregister=True)
        self.host.shutdown()
        if self.streams is not None:
            self.streams.stop()
        if self.guard is not None:
            self.guard.close()


class WorkerEvents(HostEvents):
    """What the engine host tells and asks this worker (workers/engine/host_state.py): a change
    pokes the heartbeat and the orphan guard, the fatal end hands the held requests back and
    leaves, traffic's failures and successes go to the health ledger, a start is sized to free
    memory (model engines only)."""

    def __init__(self, rt: "WorkerRuntime", *, sizes_memory: bool):
        self._rt = rt
        self._sizes_memory = sizes_memory

    def changed(self) -> None:
        self._rt._engine_changed()

    def fatal(self, err: WorkerFatalError) -> None:
        self._rt.held.leave(err)

    def failure(self, reason: str) -> None:
        self._rt.health.failure(reason)

    def success(self) -> None:
        self._rt.health.success()

    def served_elsewhere(self, model: str) -> bool:
        return self._rt.served_elsewhere(model)

    def plan_memory(self, spec: ModelSpec) -> MemoryPlan | None:
        return self._rt.plan_memory(spec) if self._sizes_memory else None


def install(rt: WorkerRuntime) -> WorkerRuntime:
    """Make `rt` this process's runtime."""
    global _runtime
    with _lock:
        _runtime = rt
    return rt


def installed() -> "WorkerRuntime | None":
    """This process's runtime if one was built, else None (never builds one)."""
    return _runtime


def get_runtime(name: str = "", ports: CeleryPorts | None = None) -> WorkerRuntime:
    """This process's runtime; built (with `ports`, the app's) and started on first use if no
    start-up hook built it (e.g. an in-process test worker). Raises RuntimeError when none is
    built and no ports are given."""
    global _runtime
    with _lock:
        if _runtime is None:
            if ports is None:
                raise RuntimeError("no worker runtime in this process")
            _runtime = WorkerRuntime(get_settings(), name or f"local@{os.uname().nodename}",
                                     ports=ports).start()
        return _runtime


def uninstall() -> None:
    """Stop and forget this process's runtime (worker shutdown)."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.stop()
