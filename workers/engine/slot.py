"""The engine slot: the one warm engine of a worker process, loaded, switched, evicted and shut
down when idle (one part of the engine host, workers/engine/host.py).

Rules kept here, on the host's loop under its condition (workers/engine/host_state.py):
- **each start is sized** to the memory that is free (the worker's `plan_memory`,
  workers/engine/memory.py), and a failed start is memory pressure (retried) only when the
  worker had to size below the request (workers/engine/classify.py);
- **a failed load is remembered** (`last_failure`) so that every request that waited for it
  fails with that error, instead of each one retrying an 18 s engine start in turn;
- **a start that fails for a model another worker serves** is this worker's fault
  (`engine_start_failed`: it leaves), not the model's;
- **an engine idle** for `idle_cleanup` seconds is shut down (0 keeps it forever);
- **a fresh engine that serves adapters on CUDA** runs its LoRA lane once before it admits
  anything (`warm_up`, workers/engine/warm_up.py): no user's first adapter request compiles the
  kernels.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from app.errors import ENGINE_START_FAILED, RequestError, WorkerFatalError
from app.heap import freeze_heap, thaw_heap
from app.requests.models import ModelSpec
from workers.engine.classify import classify_load_failure
from workers.engine.host_state import HostState
from workers.engine.memory import MemoryPlan
from workers.engine.warm_up import warm_lanes, warms_lora

log = logging.getLogger("vigil.engine")

EngineFactory = Callable[[ModelSpec, "MemoryPlan | None"], object]


class EngineSlot:
    """Loads, replaces and shuts down the engine in `st` (module docstring)."""

    def __init__(self, st: HostState, factory: EngineFactory, *, shutdown_timeout: float,
                 engine_start_timeout: float, freeze: bool = False):
        """`freeze`: freeze the process' heap once each engine is up, thaw it before its
        shutdown (app/heap.py; a worker of a real model engine)."""
        self._st = st
        self._freeze = freeze
        self.factory = factory
        self.shutdown_timeout = shutdown_timeout
        self._engine_start_timeout = engine_start_timeout
        self._start_took: dict[str, float] = {}  # model -> seconds its last start took
        self._platform = "cpu"  # where the last load ran (its memory plan's device)

    def start_bound(self, spec: ModelSpec) -> float:
        """How long an engine start of `spec` may take: the engine start timeout, or twice the
        model's last start on this worker if that was slower."""
        return max(self._engine_start_timeout, 2 * self._start_took.get(spec.name, 0.0))

    def load(self, spec: ModelSpec) -> None:
        """Replace the engine with a fresh one for `spec` (a dead one is restarted, a live one
        of another model evicted). Synchronous on the loop thread: nothing else interleaves
        with a build, so two loads can never race, and AsyncLLM binds its output handler to this
        loop. Raises the classified start failure (also kept as `last_failure`)."""
        st = self._st
        old = st.engine
        if old is not None and old.dead:
            st.stats.restarts += 1
            self.shutdown_engine("")  # a dead engine is replaced, not evicted
        elif old is not None:
            self.shutdown_engine("model change")
        st.loading()
        started = time.monotonic()
        plan = None
        try:
            plan = st.events.plan_memory(spec)  # memory_pressure here: not even worth trying
            if plan is not None:
                st.planned(plan)
                log.info("loading engine for model %s (%s)", spec.name, plan.describe())
            else:
                log.info("loading engine for model %s", spec.name)
            self._platform = plan.probe.device if plan is not None else "cpu"
            engine = self.factory(spec, plan)
        except BaseException as e:
            err = classify_load_failure(e, plan,
                                        st.events.plan_memory if plan is not None else None,
                                        spec)
            if isinstance(err, RequestError) and st.events.served_elsewhere(spec.name):
                err = WorkerFatalError.of(ENGINE_START_FAILED, (
                    f"this worker cannot start {spec.name}, which another worker serves, so "
                    f"the fault is this worker's (its copy of the weights, its configuration "
                    f"or its device): {err}"))
            st.load_failed(spec.name, err)
            log.error("engine for %s failed to load: %s", spec.name, err)
            st.events.changed()
            raise err from e
        st.loaded(engine, spec.name)
        self._start_took[spec.name] = time.monotonic() - started
        if self._freeze:
            freeze_heap()
        log.info("engine for %s ready in %.1f s (load #%d)", spec.name,
                 self._start_took[spec.name], st.stats.loads)
        st.events.changed()

    async def warm_up(self, spec: ModelSpec) -> dict:
        """Warm the engine just loaded for `spec` (its LoRA lane, where the kernels compile at
        first use: workers/engine/warm_up.py) before it admits anything; its parts' seconds, or
        {} when it has nothing to warm. Called on the loop under the condition, so that no
        request enters the engine meanwhile."""
        eng = self._st.engine
        if eng is None or getattr(eng, "dead", False) or not warms_lora(spec, self._platform) \
                or not hasattr(eng, "add_adapter"):
            return {}
        return await warm_lanes(eng, spec)

    def shutdown_engine(self, reason: str) -> None:
        """Shut the engine down now (its processes exit); with a `reason` it counts as an
        eviction. Its step totals join the host's under the steps lock first."""
        st = self._st
        eng = st.take_engine()
        if eng is None:
            return
        if reason:
            st.stats.evictions += 1
            log.info("evicting engine for %s (%s)", st.model, reason)
        st.emptied()
        if self._freeze:
            thaw_heap()  # so that what the engine leaves behind can be collected
        try:
            eng.shutdown(self.shutdown_timeout)
        except Exception as e:  # a dead engine may fail to shut down; its processes are gone
            log.warning("engine shutdown raised %s: %s", type(e).__name__, e)
        st.events.changed()

    async def evict_now(self, reason: str) -> None:
        """`shutdown_engine` under the condition (the host's shutdown)."""
        async with self._st.cond:
            self.shutdown_engine(reason)

    async def idle_reaper(self, idle_cleanup: float) -> None:
        """Forever: shut the engine down once it has had no request for `idle_cleanup` s."""
        st = self._st
        period = max(0.05, min(idle_cleanup / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            async with st.cond:
                idle = st.clock() - st.last_used
                if st.engine is not None and st.inflight == 0 and idle >= idle_cleanup:
                    self.shutdown_engine(f"idle {idle:.0f} s")
