"""The engine host: one per worker process, holding one warm engine keyed by model.

Task threads call `generate()`, which hands the request to the host's loop (the loop bridge,
workers/engine/bridge.py) and blocks on the answer; the engine sees every request in flight at
once and batches them continuously. The engine is built on that loop (lazily, or by `preload`),
never at import.

The host is one class around one condition, because admission, model switches and recovery all
decide on the same state (the engine, its model, the requests in it, the suspects of a death).
Its collaborators have state of their own: the loop bridge (the thread, the futures, aborting),
the stall watchdog (workers/engine/watchdog.py) and the adapter cache (workers/engine/lora.py).

Rules kept here:
- **one model at a time**: a request for another model stops new admissions for the current
  one, waits for its in-flight requests to drain, evicts it and loads the new one; the same for
  the LoRA lanes, without evicting anything;
- **each start is sized** to the memory that is free (workers/engine/memory.py), and a failed
  start is memory pressure (retried) only when the worker had to size below the request;
- **a failed load is shared**: every request that was waiting for it fails with that error,
  instead of each one retrying an 18 s engine start in turn;
- **an engine that dies under load** is restarted and its in-flight requests re-run as suspects,
  re-isolated until the guilty one is found (the rules: workers/engine/suspects.py): the whole
  set once, then split; a request that dies alone twice after a passing canary is
  `poison_request`; every fresh engine passes a canary first. A worker that cannot keep an
  engine alive (the death streak) leaves (`on_fatal`);
- **an engine idle** for `idle_cleanup` seconds is shut down (0 keeps it forever);
- **a quarantine** restarts the engine and runs the canary (`restart_with_canary`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Callable

from app.errors import (ENGINE_START_FAILED, REPEATED_ENGINE_DEATH, WEDGED, RequestError,
                        TransientError, VigilError, WorkerFatalError)
from app.requests.adapters import AdapterRef
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.bridge import STALLED, Aborted, HandedBack, LoopBridge
from workers.engine.classify import (classify, classify_load_failure, death_cause,
                                     is_engine_dead)
from workers.engine.lora import BASE_LANE, AdapterCache, lane_of
from workers.engine.memory import MemoryPlan
from workers.engine.output import EngineOutput
from workers.engine.suspects import (CANARY_TIMEOUT_S, DeathStreak, Ticket, canary_request,
                                     death_signature, judge, runnable)
from workers.engine.watchdog import StallWatchdog, Watched

__all__ = ["Aborted", "EngineHost", "HandedBack"]

log = logging.getLogger("vigil.engine")

EngineFactory = Callable[[ModelSpec, "MemoryPlan | None"], object]
# Sizes an engine start to free memory; raises TransientError(memory_pressure) below the floor.
MemoryPlanner = Callable[[ModelSpec], MemoryPlan]


class EngineHost:
    """Owns the warm engine. Thread-safe entry points: generate, abort_requests, refuse_new,
    drain, pause, resume, abort_in_flight, preload, restart_with_canary, snapshot, shutdown."""

    def __init__(self, factory: EngineFactory, *, idle_cleanup: float,
                 on_change: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, shutdown_timeout: float = 30.0,
                 planner: MemoryPlanner | None = None, death_limit: int = 3,
                 on_fatal: Callable[[WorkerFatalError], None] | None = None,
                 stall_timeout: float = 0.0, engine_start_timeout: float = 900.0,
                 on_failure: Callable[[str], None] | None = None,
                 on_success: Callable[[], None] | None = None,
                 served_elsewhere: Callable[[str], bool] | None = None):
        self._factory = factory
        self._planner = planner
        self._idle_cleanup = idle_cleanup
        self._on_change = on_change or (lambda: None)
        self._on_fatal = on_fatal
        self._clock = clock
        self._shutdown_timeout = shutdown_timeout
        self._engine_start_timeout = engine_start_timeout
        # Is this model served by another worker right now? Then a start that fails here is
        # this worker's fault (its copy of the weights, its device), not the model's.
        self._served_elsewhere = served_elsewhere or (lambda model: False)
        self._start_took: dict[str, float] = {}  # model -> seconds its last start took
        # collaborators
        self._bridge = LoopBridge(on_failure=on_failure, on_success=on_success)
        self._loop = self._bridge.loop
        self._adapters = AdapterCache()
        self._watchdog = (StallWatchdog(stall_timeout, self._watched, self._stalled, clock)
                          if stall_timeout > 0 else None)
        # the engine and admission, guarded by _cond (created on the loop)
        self._cond: asyncio.Condition | None = None
        self._engine = None
        self._model: str | None = None
        self._switch_to: str | None = None
        self._state = "empty"
        self._inflight = 0
        self._busy_since = clock()
        self._last_used = clock()
        self._last_failure: tuple[str, float, VigilError] | None = None
        self._lane = BASE_LANE
        self._lane_wanted: str | None = None
        self.last_plan: MemoryPlan | None = None
        # recovery, under the same condition
        self._streak = DeathStreak(death_limit)
        self._counted_death: object = None
        self._suspects: list[Ticket] = []
        self._recovery: asyncio.Task | None = None
        self._fatal: WorkerFatalError | None = None
        self._fatal_handled = False
        # counters
        self.loads = 0
        self.evictions = 0
        self.restarts = 0
        self.peak_in_flight = 0
        self._steps_before = (0, 0)  # (steps, outputs) of the engines shut down before this one
        # A snapshot never sees an engine's steps twice, or not at all, while it is shut down.
        self._steps_lock = threading.Lock()
        self.served = 0
        self.poisoned = 0
        self.canaries = 0

    # -- lifecycle (any thread) -----------------------------------------------------------------
    def start(self) -> "EngineHost":
        """Start the loop thread (cheap; no engine is built here)."""
        self._bridge.start(self._init)
        return self

    async def _init(self) -> None:
        self._cond = asyncio.Condition()
        if self._idle_cleanup > 0:
            self._loop.create_task(self._idle_reaper())
        if self._watchdog is not None:
            self._loop.create_task(self._watchdog.run())

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut the engine down (its processes exit) and stop the loop thread. Idempotent."""
        if not self._bridge.running:
            return
        timeout = self._shutdown_timeout if timeout is None else timeout
        try:
            self._bridge.run(self._evict_now("shutdown"), timeout + 5)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.warning("engine shutdown did not finish cleanly: %s", e)
        self._bridge.stop()

    # -- entry points for task threads --------------------------------------------------------
    def generate(self, req: GenerateRequest, spec: ModelSpec, engine_request_id: str,
                 timeout: float, adapter: AdapterRef | None = None, tap=None) -> EngineOutput:
        """Run one request to completion in the warm engine (loading it if needed).

        Raises a classified VigilError; HandedBack / Aborted as the bridge says. `timeout` bounds
        the generation inside a running engine only: past it the request is aborted in the
        engine and TransientError(wedged) is raised (wedge evidence). Waiting for the engine
        (the current model's requests draining, a load, a recovery) is bounded apart, by one
        more `timeout` plus `start_bound`: past that the attempt is given up as
        TransientError(engine_restarting), which is no evidence of a wedge. With a `tap`
        (workers/streaming.py) the tokens are streamed as they come, and every run (a re-run
        after an engine death too) continues from the tokens the tap holds."""
        arrived = self._clock()
        return self._bridge.call(
            lambda: self._generate(req, spec, engine_request_id, arrived, adapter, timeout, tap),
            engine_request_id, timeout + timeout + self.start_bound(spec))

    def start_bound(self, spec: ModelSpec) -> float:
        """How long an engine start of `spec` may take: the engine start timeout, or twice the
        model's last start on this worker if that was slower."""
        return max(self._engine_start_timeout, 2 * self._start_took.get(spec.name, 0.0))

    def abort_requests(self, request_ids: set[str]) -> int:
        """Abort the named requests (Vigil request ids) wherever they are in this host: in the
        engine, waiting for it, or parked as suspects. Their callers get `Aborted`. Returns how
        many it found."""
        return self._bridge.cancel_requests(request_ids)

    def request_ids(self) -> set[str]:
        """The Vigil request ids this host is running or admitting now."""
        return self._bridge.request_ids()

    @property
    def accepting(self) -> bool:
        """False while paused (quarantined) or stopping: deliveries go back to the queue."""
        return self._bridge.accepting

    @property
    def draining(self) -> bool:
        """True once the worker is stopping: no new request enters the engine."""
        return self._bridge.draining

    def refuse_new(self) -> None:
        """Stop taking requests (callers get HandedBack); those in flight carry on."""
        self._bridge.draining = True

    def drain(self) -> int:
        """Stop taking requests and abort every one in flight (their callers get HandedBack);
        the worker has handed them back to the queue. Returns how many were aborted."""
        self._bridge.draining = True
        return self._bridge.cancel_all()

    def pause(self) -> None:
        """Take no new requests (callers get HandedBack) until `resume()`."""
        self._bridge.paused = True
        self._on_change()

    def resume(self) -> None:
        """Take requests again (after a passing canary)."""
        self._bridge.paused = False
        self._on_change()

    def abort_in_flight(self) -> int:
        """Abort every request in the engine or waiting for it; their callers get HandedBack
        (the caller has republished them). Call after `pause()`. Returns how many."""
        return self._bridge.cancel_all()

    def preload(self, spec: ModelSpec, timeout: float) -> None:
        """Load `spec`'s engine now (worker start for configured pools)."""
        async def _load():
            await self._acquire(spec, self._clock())
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

        self._bridge.run(_load(), timeout)

    def restart_with_canary(self, spec: ModelSpec, timeout: float) -> tuple[bool, str]:
        """Kill the current engine (a wedged one cannot shut down politely), start a fresh one
        for `spec` (bounded by `start_bound`) and run the canary on it (bounded by `timeout`).
        Returns (passed, why not)."""
        bound = self.start_bound(spec)
        try:
            return self._bridge.run(self._restart_with_canary(spec, timeout), bound + timeout)
        except concurrent.futures.TimeoutError:
            return False, (f"the engine for {spec.name} did not start and answer its canary "
                           f"within {bound:g} s + {timeout:g} s")

    @property
    def stalls(self) -> int:
        """Stalls the watchdog declared."""
        return self._watchdog.stalls if self._watchdog is not None else 0

    def _steps_through(self, eng) -> tuple[int, int]:
        """(steps, request outputs) of every engine this host ran up to and including `eng`,
        counted from what their EngineCores sent (workers/engine/vllm.py, StepCounter); outputs
        / steps is the mean batch. Engines that do not count (the instant engine) add 0."""
        counter = getattr(eng, "steps", None)
        steps, outputs = self._steps_before
        if counter is not None:
            steps, outputs = steps + counter.steps, outputs + counter.outputs
        return steps, outputs

    def snapshot(self) -> dict:
        """A consistent-enough view for the heartbeat: model, state, counters."""
        with self._steps_lock:
            steps, outputs = self._steps_through(self._engine)
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
            "paused": int(self._bridge.paused),
            "lora_loads": self._adapters.loads, "lora_evictions": self._adapters.evictions,
            "lora_refused": self._adapters.refused,
            "warm_adapters": ",".join(self._adapters.warm),
            "stalls": self.stalls,
            "engine_steps": steps, "engine_step_outputs": outputs,
        }

    def child_pids(self) -> list[tuple[int, float]]:
        """Processes of the current engine, for the orphan guard."""
        eng = self._engine
        return eng.child_pids() if eng is not None else []

    # -- one request, on the loop ---------------------------------------------------------------
    async def _generate(self, req, spec, engine_request_id, arrived, adapter,
                        timeout: float, tap=None) -> EngineOutput:
        t = Ticket(req, engine_request_id, adapter=adapter, timeout=timeout, tap=tap)
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
            if adapter is not None and self._adapters.done(t):
                self._loop.create_task(self._notify())

    async def _run_once(self, engine, t: Ticket, spec: ModelSpec):
        """One run of a ticket in `engine`: ("ok", output) | ("error", VigilError) | ("died", e).
        The bookkeeping after the run happens in one locked step, so the recovery never sees
        the engine empty before every casualty of a death is registered as a suspect."""
        t.runs += 1
        outcome, value = "cancelled", None
        args = (t.req, t.engine_request_id()) + ((t.adapter,) if t.adapter is not None else ())
        try:
            # The request's own timeout counts inside the running engine only.
            # Only an engine that streams (`streams = True`) gets the tap.
            kw = {"tap": t.tap} if t.tap is not None and getattr(engine, "streams", False) else {}
            # In this task, not wait_for's task of its own: one task and hop less per request.
            async with asyncio.timeout(t.timeout):
                value = await engine.run(*args, **kw)
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except TimeoutError:  # vLLM aborted the request when the timeout cancelled it
            outcome, value = "error", TransientError.of(WEDGED, (
                f"request {t.rid} got no answer from the engine within {t.timeout:g} s"))
        except BaseException as e:  # classified once, here, at the engine boundary
            if getattr(engine, "dead", False) or is_engine_dead(e):
                # EngineCore's own account: a CUDA fault is not the requests' (no suspects).
                fault = death_cause(engine)
                outcome, value = ("died", e) if fault is None else ("error", fault)
                if fault is not None:
                    value.__cause__ = e
                    self._note_death(engine, fault)
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

    async def _gate_or_release(self, engine, t: Ticket, spec: ModelSpec) -> None:
        """Make sure `t`'s adapter is loaded in `engine`; on failure give back the ticket's
        engine slot (counted by _acquire or the recovery) and raise the classified error."""
        try:
            await self._adapters.gate(engine, t, spec, self._cond)
        except BaseException:
            async with self._cond:
                self._inflight -= 1
                self._last_used = self._clock()
                self._cond.notify_all()
            raise

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    # -- admission and model switches -----------------------------------------------------------
    def _usable(self, spec: ModelSpec) -> bool:
        eng = self._engine
        return (eng is not None and not eng.dead and self._model == spec.name
                and self._switch_to in (None, spec.name) and self._recovery is None)

    def _lane_ok(self, lane: str) -> bool:
        return ((self._inflight == 0 or self._lane == lane)
                and self._lane_wanted in (None, lane))

    async def _acquire(self, spec: ModelSpec, arrived: float, lane: str = BASE_LANE):
        """Admit one request to a usable engine for `spec` in `lane` (counting it in flight),
        draining and replacing the current engine first if it serves another model or is dead.
        Raises the load error shared by every request that waited for a failed load."""
        async with self._cond:
            while True:
                if self._fatal is not None:
                    # Held until the worker has handed its requests back (on_fatal): the
                    # hand-back aborts this one; it fails only if no hand-back happened.
                    await self._cond.wait_for(lambda: self._fatal_handled)
                    raise self._fresh_fatal()
                if self._usable(spec) and not self._lane_ok(lane):
                    await self._wait_for_lane(lane)
                    continue
                if self._usable(spec):
                    self._switch_to = None
                    if self._inflight == 0:
                        self._busy_since = self._clock()
                        self._lane = lane
                    if self._lane_wanted == lane:
                        self._lane_wanted = None
                    self._inflight += 1
                    if self._inflight > self.peak_in_flight:
                        self.peak_in_flight = self._inflight
                        self._on_change()
                    return self._engine
                failure = self._last_failure
                if failure and failure[0] == spec.name and failure[1] >= arrived:
                    raise type(failure[2])(str(failure[2]))
                if self._recovery is not None:  # suspects run alone first
                    await self._cond.wait()
                    continue
                if self._inflight > 0:
                    await self._wait_for_switch(spec)
                    continue
                if self._streak.broken:
                    self._go_fatal(self._broken_error(spec))
                    continue
                try:
                    self._load(spec)
                except WorkerFatalError as e:  # its requests go back untouched; it leaves
                    self._go_fatal(e)
                    continue
                if self._engine.dead:  # dead on arrival: a death like any other
                    self._note_death(self._engine, RuntimeError(
                        "the engine was dead as soon as it had started"))
                self._cond.notify_all()

    async def _wait_for_switch(self, spec: ModelSpec) -> None:
        """Wait (holding the condition) for the current engine's requests to drain before it is
        replaced by `spec`'s; the first waiter claims the switch, which stops new admissions."""
        claimed = self._switch_to is None
        if claimed:
            self._switch_to = spec.name
        self._state = "draining"
        try:
            await self._cond.wait()
        except asyncio.CancelledError:
            # The request that asked for the switch gave up (timeout): the current model's
            # requests must not stay blocked behind a switch nobody wants.
            if claimed and self._switch_to == spec.name:
                self._switch_to = None
                self._cond.notify_all()
            raise

    async def _wait_for_lane(self, lane: str) -> None:
        """Wait (holding the condition) for the other lane to drain."""
        claimed = self._lane_wanted is None and self._lane != lane
        if claimed:
            self._lane_wanted = lane
        try:
            await self._cond.wait()
        except asyncio.CancelledError:
            if claimed and self._lane_wanted == lane:  # nobody else asked: withdraw
                self._lane_wanted = None
                self._cond.notify_all()
            raise

    def _load(self, spec: ModelSpec) -> None:
        # Synchronous on the loop thread: nothing else interleaves with a build, so two loads
        # can never race, and AsyncLLM binds its output handler to this loop.
        old = self._engine
        if old is not None and old.dead:
            self.restarts += 1
            self._shutdown_engine("")  # a dead engine is replaced, not evicted
        elif old is not None:
            self._shutdown_engine("model change")
        self._state = "loading"
        self._switch_to = None
        started = time.monotonic()
        plan = None
        try:
            if self._planner is not None:
                plan = self._planner(spec)  # memory_pressure here: not even worth trying
                self.last_plan = plan
                log.info("loading engine for model %s (%s)", spec.name, plan.describe())
            else:
                log.info("loading engine for model %s", spec.name)
            self._engine = self._factory(spec, plan)
        except BaseException as e:
            err = classify_load_failure(e, plan, self._planner, spec)
            if isinstance(err, RequestError) and self._served_elsewhere(spec.name):
                err = WorkerFatalError.of(ENGINE_START_FAILED, (
                    f"this worker cannot start {spec.name}, which another worker serves, so "
                    f"the fault is this worker's (its copy of the weights, its configuration "
                    f"or its device): {err}"))
            self._last_failure = (spec.name, self._clock(), err)
            self._state = "failed"
            log.error("engine for %s failed to load: %s", spec.name, err)
            self._on_change()
            raise err from e
        self._model = spec.name
        self._last_failure = None
        self._state = "ready"
        self.loads += 1
        self._last_used = self._clock()
        self._start_took[spec.name] = time.monotonic() - started
        log.info("engine for %s ready in %.1f s (load #%d)", spec.name,
                 self._start_took[spec.name], self.loads)
        self._on_change()

    def _shutdown_engine(self, reason: str) -> None:
        with self._steps_lock:
            eng, self._engine = self._engine, None
            if eng is None:
                return
            self._steps_before = self._steps_through(eng)
        if reason:
            self.evictions += 1
            log.info("evicting engine for %s (%s)", self._model, reason)
        self._model = None
        self._state = "empty"
        try:
            eng.shutdown(self._shutdown_timeout)
        except Exception as e:  # a dead engine may fail to shut down; its processes are gone
            log.warning("engine shutdown raised %s: %s", type(e).__name__, e)
        self._on_change()

    async def _evict_now(self, reason: str) -> None:
        async with self._cond:
            self._shutdown_engine(reason)

    async def _idle_reaper(self) -> None:
        period = max(0.05, min(self._idle_cleanup / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            async with self._cond:
                idle = self._clock() - self._last_used
                if self._engine is not None and self._inflight == 0 and idle >= self._idle_cleanup:
                    self._shutdown_engine(f"idle {idle:.0f} s")

    # -- stalls (the watchdog's view and its verdict) ---------------------------------------------
    def _watched(self) -> Watched:
        return Watched(self._inflight, getattr(self._engine, "progress", None),
                       self._busy_since, self._last_used,
                       self._recovery is not None or self._state == "loading")

    def _stalled(self, reason: str) -> None:
        log.error("engine for %s stalled: %s", self._model, reason)
        self._bridge.cancel_all(STALLED, reason)  # callers get TransientError(wedged)
        self._on_change()

    # -- engine death: suspects, the canary, the death streak -----------------------------------
    async def _await_turn(self, t: Ticket):
        """Park a suspect until the recovery hands it a fresh engine (its inflight slot already
        counted) or a verdict to raise."""
        async with self._cond:
            try:
                await self._cond.wait_for(
                    lambda: t.granted is not None or t.verdict is not None
                    or (self._fatal is not None and self._fatal_handled))
            except asyncio.CancelledError:
                t.gone = True
                if t.granted is not None:  # handed an engine in the same instant: give it back
                    t.granted = None
                    self._inflight -= 1
                    self._cond.notify_all()
                raise
            if t.verdict is not None:
                raise t.verdict
            if t.granted is None:
                raise self._fresh_fatal()
            return t.granted

    def _note_death(self, engine, exc: BaseException) -> None:
        if self._counted_death is engine:  # one death, however many requests saw it
            return
        self._counted_death = engine
        n = self._streak.death(death_signature(exc))
        self._state = "dead"
        log.warning("engine for %s died (%s); %d death(s) in a row", self._model,
                    death_signature(exc), n)

    def _fresh_fatal(self) -> WorkerFatalError:
        return WorkerFatalError(str(self._fatal))

    def _go_fatal(self, err: WorkerFatalError) -> None:
        """This worker cannot serve: refuse everything and let `on_fatal` (the runtime) hand the
        in-flight requests back and stop the worker. Parked requests wait for that hand-back
        (it aborts them) and only then fail with the error."""
        if self._fatal is not None:
            return
        self._fatal = err
        self._state = "fatal"
        log.critical("worker cannot keep an engine: %s", err)
        self._on_change()

        async def _released():
            async with self._cond:
                self._fatal_handled = True
                self._cond.notify_all()

        if self._on_fatal is None:
            self._loop.create_task(_released())
            return
        fut = self._loop.run_in_executor(None, self._on_fatal, err)
        fut.add_done_callback(lambda _f: self._loop.create_task(_released()))

    async def _recover(self, spec: ModelSpec) -> None:
        """Re-run the suspects of an engine death on fresh engines (workers/engine/suspects.py)."""
        plan: list[list[Ticket]] = []
        group: list[Ticket] | None = None
        try:
            async with self._cond:
                while True:
                    await self._cond.wait_for(lambda: self._inflight == 0)
                    if group is None:  # the casualties of a death in normal service
                        plan.append([t for t in self._suspects if not t.gone])
                        self._suspects.clear()
                    else:
                        self._judge(group, plan)
                    plan = [g for g in ([t for t in g if runnable(t)] for g in plan) if g]
                    if not plan:
                        return
                    engine = await self._fresh_engine(spec)
                    group = plan.pop(0)
                    for t in group:
                        t.granted = engine
                        self._inflight += 1
                    log.info("re-running %d suspect(s) alone in the engine (%d group(s) wait)",
                             len(group), len(plan))
                    self._cond.notify_all()
        except WorkerFatalError as e:  # parked suspects wait for the hand-back (on_fatal)
            self._go_fatal(e)
        except VigilError as e:  # the engine cannot be (re)built: every suspect gets the error
            for t in [t for g in plan for t in g]:
                if t.verdict is None:
                    t.verdict = type(e)(str(e))
        finally:
            async with self._cond:
                self._recovery = None
                self._cond.notify_all()

    def _judge(self, group: list[Ticket], plan: list[list[Ticket]]) -> None:
        """After `group` ran alone (suspects.py `judge`); a conviction is counted, and its death
        is explained: it does not count against the engine."""
        convicted = judge(group, plan)
        if convicted is not None:
            self.poisoned += 1
            self._streak.success()
            log.error("request %s killed the engine when run alone %d times: poison",
                      convicted.rid, convicted.solo_deaths)

    async def _fresh_engine(self, spec: ModelSpec):
        """(Re)build the engine until one passes the canary; raises the load error, or
        WorkerFatalError(repeated_engine_death) once the death streak reaches its limit."""
        while True:
            if self._streak.broken:
                raise self._broken_error(spec)
            if self._engine is None or self._engine.dead or self._model != spec.name:
                self._load(spec)
            engine = self._engine
            if await self._canary(engine, spec):
                return engine
            if not engine.dead:  # alive but unable to generate: no better than dead
                self._shutdown_engine("failed its canary")

    async def _canary(self, engine, spec: ModelSpec, count_death: bool = True,
                      timeout: float = CANARY_TIMEOUT_S) -> bool:
        self.canaries += 1
        try:
            await asyncio.wait_for(engine.run(canary_request(spec),
                                              f"vigil-canary-{self.canaries}"),
                                   min(timeout, CANARY_TIMEOUT_S))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.warning("canary on the fresh engine for %s failed: %s", spec.name,
                        death_signature(e))
            if count_death:
                self._note_death(engine, e)
            return False
        self._streak.success()
        return True

    def _broken_error(self, spec: ModelSpec) -> WorkerFatalError:
        return WorkerFatalError.of(REPEATED_ENGINE_DEATH, (
            f"the engine for {spec.name} died {self._streak.count} times in a row with no "
            f"success between ({self._streak.signature})"))

    async def _restart_with_canary(self, spec: ModelSpec, timeout: float) -> tuple[bool, str]:
        async with self._cond:
            await self._cond.wait_for(lambda: self._inflight == 0 and self._recovery is None)
            eng = self._engine
            if eng is not None:
                kill = getattr(eng, "kill", None)
                if kill is not None:
                    kill()
                self.restarts += 1
                self._shutdown_engine("")
            try:
                self._load(spec)
            except VigilError as e:
                return False, f"the engine did not start: {e}"
            if await self._canary(self._engine, spec, count_death=False, timeout=timeout):
                return True, ""
            return False, "the canary generation failed on a fresh engine"
