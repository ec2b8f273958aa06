"""The engine host: one per worker process, holding one warm engine keyed by model.

Task threads call `generate()`, which hands the request to the host's own asyncio loop thread and
blocks on the answer; the engine sees every request in flight at once and batches them
continuously. The engine is built on that loop (lazily, or by `preload`), never at import.

Rules kept here:
- one model at a time: a request for another model stops new admissions for the current one,
  waits for its in-flight requests to drain, evicts it and loads the new one;
- an engine that dies under load is restarted and its in-flight requests re-run as suspects,
  re-isolated until the guilty one is found (workers/engine/recovery.py; the rules in
  workers/engine/suspects.py); a worker that cannot keep an engine alive leaves (`on_fatal`);
- each start is sized to the memory that is free (workers/engine/memory.py), and a failed start is
  memory pressure (retried) only when the worker had to size below the request;
- a failed load is shared: every request that was waiting for it fails with that error, instead
  of each one retrying an 18 s engine start in turn;
- an engine idle for `idle_cleanup` seconds is shut down (0 keeps it forever).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

from app.errors import WEDGED, TransientError, VigilError, WorkerFatalError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.classify import classify, is_engine_dead
from workers.engine.kinds import EngineOutput
from workers.engine.memory import MemoryPlan
from app.requests.adapters import AdapterRef
from workers.engine.admission import EngineLifecycle
from workers.engine.lora import BASE_LANE, EngineLora, lane_of
from workers.engine.recovery import EngineRecovery
from workers.engine.watchdog import EngineWatch
from workers.engine.suspects import DeathStreak, Ticket

log = logging.getLogger("vigil.engine")

EngineFactory = Callable[[ModelSpec, "MemoryPlan | None"], object]
# Sizes an engine start to free memory; raises TransientError(memory_pressure) below the floor.
MemoryPlanner = Callable[[ModelSpec], MemoryPlan]


class HandedBack(Exception):
    """The worker is stopping and handed this request back to the queue: drop this delivery."""


class Aborted(Exception):
    """The request ended elsewhere while it ran (its job was deleted): it was aborted in the
    engine; the caller answers with the stored outcome."""


class EngineHost(EngineLifecycle, EngineRecovery, EngineWatch, EngineLora):
    """Owns the loop thread and the warm engine. Thread-safe entry points: generate, preload,
    snapshot, shutdown."""

    def __init__(self, factory: EngineFactory, *, idle_cleanup: float,
                 on_change: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, shutdown_timeout: float = 30.0,
                 planner: MemoryPlanner | None = None, death_limit: int = 3,
                 on_fatal: Callable[[WorkerFatalError], None] | None = None,
                 stall_timeout: float = 0.0,
                 on_failure: Callable[[str], None] | None = None,
                 on_success: Callable[[], None] | None = None):
        self._factory = factory
        self._stall_timeout = stall_timeout
        self._on_failure = on_failure or (lambda reason: None)
        self._on_success = on_success or (lambda: None)
        self._paused = False
        self._busy_since = clock()
        self._stall_aborted: dict[concurrent.futures.Future, str] = {}
        self._aborted: dict[concurrent.futures.Future, str] = {}
        self._future_ids: dict[concurrent.futures.Future, str] = {}
        self.stalls = 0
        self._lane = BASE_LANE
        self._lane_wanted: str | None = None
        self._warm_adapters: OrderedDict[str, AdapterRef] = OrderedDict()
        self._adapter_users: dict[str, int] = {}
        self._adapters_engine: object = None
        self._adapter_loading: dict[str, asyncio.Future] = {}
        self.lora_loads = 0
        self.lora_evictions = 0
        self.lora_refused = 0
        self._planner = planner
        self._on_fatal = on_fatal
        self._streak = DeathStreak(death_limit)
        self._counted_death: object = None
        self._suspects: list[Ticket] = []
        self._recovery: asyncio.Task | None = None
        self._fatal: WorkerFatalError | None = None
        self._fatal_handled = False
        self.last_plan: MemoryPlan | None = None
        self.poisoned = 0
        self.canaries = 0
        self._idle_cleanup = idle_cleanup
        self._on_change = on_change or (lambda: None)
        self._clock = clock
        self._shutdown_timeout = shutdown_timeout
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._cond: asyncio.Condition | None = None
        self._engine = None
        self._model: str | None = None
        self._switch_to: str | None = None
        self._last_failure: tuple[str, float, VigilError] | None = None
        self._state = "empty"
        self._inflight = 0
        self._last_used = clock()
        self.loads = 0
        self.evictions = 0
        self.restarts = 0
        self.peak_in_flight = 0
        self.served = 0
        self._draining = False
        self._futures: set[concurrent.futures.Future] = set()
        self._futures_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "EngineHost":
        """Start the loop thread (cheap; no engine is built here)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_loop, name="vigil-engine-loop",
                                            daemon=True)
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._init(), self._loop).result(10)
        return self

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _init(self) -> None:
        self._cond = asyncio.Condition()
        if self._idle_cleanup > 0:
            self._loop.create_task(self._idle_reaper())
        if self._stall_timeout > 0:
            self._loop.create_task(self._watchdog())

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut the engine down (its processes exit) and stop the loop thread. Idempotent."""
        if self._thread is None:
            return
        timeout = self._shutdown_timeout if timeout is None else timeout
        try:
            asyncio.run_coroutine_threadsafe(self._evict_now("shutdown"), self._loop).result(
                timeout + 5)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.warning("engine shutdown did not finish cleanly: %s", e)

        async def _cancel_background():  # watchdog, idle reaper, recovery: end them, then stop
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_background(), self._loop).result(5)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.warning("engine loop tasks did not end cleanly: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._thread = None

    # -- entry points for task threads ----------------------------------------------------------
    def generate(self, req: GenerateRequest, spec: ModelSpec, engine_request_id: str,
                 timeout: float, adapter: AdapterRef | None = None) -> EngineOutput:
        """Run one request to completion in the warm engine (loading it if needed).

        Raises a classified VigilError; on timeout the request is aborted in the engine and
        TransientError(wedged) is raised.
        """
        if self._draining or self._paused:
            raise HandedBack(engine_request_id)
        arrived = self._clock()
        # Scheduled and registered under one lock: a drain or stall abort that snapshots the
        # futures while this request is already running in the engine must see it.
        with self._futures_lock:
            fut = asyncio.run_coroutine_threadsafe(
                self._generate(req, spec, engine_request_id, arrived, adapter), self._loop)
            self._futures.add(fut)
            self._future_ids[fut] = engine_request_id
        try:
            out = fut.result(timeout)
        except concurrent.futures.TimeoutError as e:
            fut.cancel()  # CancelledError inside the engine's generate aborts the request there
            self._on_failure(f"timeout: request {engine_request_id} got no answer from the "
                             f"engine within {timeout:g} s")
            raise classify(e) from None
        except concurrent.futures.CancelledError:
            if self._aborted.pop(fut, None) is not None:
                raise Aborted(engine_request_id) from None
            stalled = self._stall_aborted.pop(fut, None)
            if stalled is not None:
                self._on_failure(f"stall: {stalled}")
                raise TransientError.of(WEDGED, stalled) from None
            if self._draining or self._paused:
                raise HandedBack(engine_request_id) from None
            raise
        except VigilError as e:
            # A fresh exception: vLLM hands one shared error object to every request, and
            # re-raising it from many threads grows one traceback without bound.
            raise type(e)(str(e)) from None
        finally:
            with self._futures_lock:
                self._futures.discard(fut)
                self._future_ids.pop(fut, None)
        self._on_success()
        return out

    def abort_requests(self, request_ids: set[str]) -> int:
        """Abort the named requests (Vigil request ids) wherever they are in this host: in the
        engine, waiting for it, or parked as suspects. Their callers get `Aborted`. Returns how
        many it found."""
        with self._futures_lock:
            hits = [f for f, rid in self._future_ids.items()
                    if rid.rsplit("-", 1)[0] in request_ids]
            for f in hits:
                self._aborted[f] = "aborted"
        for f in hits:
            f.cancel()
        return len(hits)

    @property
    def draining(self) -> bool:
        """True once the worker is stopping: no new request enters the engine."""
        return self._draining

    def refuse_new(self) -> None:
        """Stop taking requests (callers get HandedBack); those in flight carry on."""
        self._draining = True

    def drain(self) -> int:
        """Stop taking requests and abort every one in flight (their callers get HandedBack);
        the worker has handed them back to the queue. Returns how many were aborted."""
        self._draining = True
        with self._futures_lock:
            futures = list(self._futures)
        for f in futures:
            f.cancel()  # the engine aborts the request (CancelledError inside generate)
        return len(futures)

    def preload(self, spec: ModelSpec, timeout: float) -> None:
        """Load `spec`'s engine now (worker start for configured pools)."""
        async def _load():
            await self._acquire(spec, self._clock())
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

        asyncio.run_coroutine_threadsafe(_load(), self._loop).result(timeout)

    def snapshot(self) -> dict:
        """A consistent-enough view for the heartbeat: model, state, counters."""
        return {
            "model": self._model or "",
            "engine_state": self._state,
            "in_flight": self._inflight,
            "peak_in_flight": self.peak_in_flight,
            "engine_loads": self.loads,
            "engine_evictions": self.evictions,
            "engine_restarts": self.restarts,
            "served": self.served,
            "death_streak": self._streak.count,
            "poisoned": self.poisoned,
            "recovering": int(self._recovery is not None),
            "paused": int(self._paused),
            "lora_loads": self.lora_loads, "lora_evictions": self.lora_evictions,
            "lora_refused": self.lora_refused,
            "warm_adapters": ",".join(self._warm_adapters),
            "stalls": self.stalls,
        }

    def child_pids(self) -> list[tuple[int, float]]:
        """Processes of the current engine, for the orphan guard."""
        eng = self._engine
        return eng.child_pids() if eng is not None else []

    # -- on the loop ------------------------------------------------------------------------
    async def _generate(self, req, spec, engine_request_id, arrived, adapter) -> EngineOutput:
        t = Ticket(req, engine_request_id, adapter=adapter)
        engine = await self._acquire(spec, arrived, lane_of(spec, adapter))
        try:
            while True:
                if adapter is not None:
                    await self._gate_or_release(engine, t, spec)
                outcome, value = await self._run_once(engine, t, spec)
                if outcome == "ok":
                    return value
                if outcome == "error":
                    if isinstance(value, WorkerFatalError):
                        self._go_fatal(value)
                    raise value
                engine = await self._await_turn(t)  # died: wait for the recovery's verdict
        finally:
            if adapter is not None:
                self._adapter_done(t)

    async def _run_once(self, engine, t: Ticket, spec: ModelSpec):
        """One run of a ticket in `engine`: ("ok", output) | ("error", VigilError) | ("died", e).
        The bookkeeping after the run happens in one locked step, so the recovery never sees
        the engine empty before every casualty of a death is registered as a suspect."""
        t.runs += 1
        outcome, value = "cancelled", None
        try:
            if t.adapter is None:
                value = await engine.run(t.req, t.engine_request_id())
            else:
                value = await engine.run(t.req, t.engine_request_id(), t.adapter)
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # classified once, here, at the engine boundary
            if getattr(engine, "dead", False) or is_engine_dead(e):
                outcome, value = "died", e
            else:
                outcome, value = "error", classify(e)
                value.__cause__ = e
        finally:
            async with self._cond:
                self._inflight -= 1
                self._last_used = self._clock()
                t.last = outcome
                t.granted = None
                if outcome == "ok":
                    self.served += 1
                    self._streak.success()
                elif outcome == "cancelled":
                    t.gone = True
                elif outcome == "died":
                    self._note_death(engine, value)
                    if not t.in_recovery:
                        t.in_recovery = True
                        self._suspects.append(t)
                        if self._recovery is None:
                            self._recovery = self._loop.create_task(self._recover(spec))
                self._cond.notify_all()
        return outcome, value
