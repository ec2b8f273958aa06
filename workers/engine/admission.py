"""The engine's life in the engine host: admitting a request to the warm engine, switching models
(drain, evict, load), building an engine sized to free memory, shutting it down, and the idle
cleanup.

`EngineLifecycle` is a mixin of `EngineHost` and uses its state (`_engine`, `_model`, `_cond`,
`_inflight`, `_switch_to`, `_recovery`, `_streak`, `_planner`, `_factory`, `_clock`, ...); see
workers/engine/host.py. Everything here runs on the host's loop thread.
"""
from __future__ import annotations

import asyncio
import logging
import time

from app.requests.models import ModelSpec
from workers.engine.classify import classify_load_failure
from workers.engine.lora import BASE_LANE

log = logging.getLogger("vigil.engine")


class EngineLifecycle:
    """Admission, model switches, loads, shutdowns and idle cleanup for EngineHost."""

    def _usable(self, spec: ModelSpec) -> bool:
        eng = self._engine
        return (eng is not None and not eng.dead and self._model == spec.name
                and self._switch_to in (None, spec.name) and self._recovery is None)

    async def _acquire(self, spec: ModelSpec, arrived: float, lane: str = BASE_LANE):
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
                    # Drain the current engine (other model, or dead) before replacing it.
                    claimed = self._switch_to is None
                    if claimed:
                        self._switch_to = spec.name
                    self._state = "draining"
                    try:
                        await self._cond.wait()
                    except asyncio.CancelledError:
                        # The request that asked for the switch gave up (timeout): the current
                        # model's requests must not stay blocked behind a switch nobody wants.
                        if claimed and self._switch_to == spec.name:
                            self._switch_to = None
                            self._cond.notify_all()
                        raise
                    continue
                if self._streak.broken:
                    self._go_fatal(self._broken_error(spec))
                    continue
                self._load(spec)
                if self._engine.dead:  # dead on arrival: a death like any other
                    self._note_death(self._engine, RuntimeError(
                        "the engine was dead as soon as it had started"))
                self._cond.notify_all()

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
        log.info("engine for %s ready in %.1f s (load #%d)", spec.name,
                 time.monotonic() - started, self.loads)
        self._on_change()

    def _shutdown_engine(self, reason: str) -> None:
        eng, self._engine = self._engine, None
        if eng is None:
            return
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
