"""The recovery half of the engine host: suspects of an engine death, the canary, the death
streak, the worker leaving. The rules and why: workers/engine/suspects.py and docs/failure-modes.md.

`EngineRecovery` is a mixin of `EngineHost` (workers/engine/host.py) and runs on its loop thread.
It works on the host's state, all guarded by `self._cond`: `_engine`, `_model`, `_inflight`,
`_suspects` (tickets that died in normal service, not yet in a plan), `_recovery` (the running
recovery task, None when none), `_streak`, `_fatal` / `_fatal_handled`, `_on_fatal`, and calls
the host's `_load` and `_shutdown_engine`.
"""
from __future__ import annotations

import asyncio
import logging

from app.errors import (ENGINE_RESTARTING, POISON_REQUEST, REPEATED_ENGINE_DEATH, RequestError,
                        TransientError, VigilError, WorkerFatalError)
from app.requests.models import ModelSpec
from workers.engine.suspects import (CANARY_TIMEOUT_S, MAX_RUNS, POISON_STRIKES, Ticket, canary_request,
                              death_signature, split_suspects)

log = logging.getLogger("vigil.engine")


class EngineRecovery:
    """Engine-death recovery for EngineHost (see the module docstring)."""

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
                    plan = [g for g in ([t for t in g if self._runnable(t)] for g in plan) if g]
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
        """After `group` ran alone: members that finished are cleared; if the engine died, the
        members it took down are split again, and a member dying alone is struck (convicted at
        POISON_STRIKES)."""
        died = [t for t in group if t.last == "died" and not t.gone]
        if not died:
            return
        if len(group) == 1:
            t = died[0]
            t.solo_deaths += 1
            if t.solo_deaths >= POISON_STRIKES:
                self.poisoned += 1
                self._streak.success()  # this death is explained: it does not count against the engine
                log.error("request %s killed the engine when run alone %d times: poison",
                          t.rid, t.solo_deaths)
                t.verdict = RequestError.of(POISON_REQUEST, (
                    f"this request killed the engine each time it ran alone "
                    f"({t.solo_deaths} times, after a passing canary); other requests were "
                    f"unaffected"))
                return
            plan.insert(0, [t])
            return
        plan[:0] = split_suspects(died)

    def _runnable(self, t: Ticket) -> bool:
        if t.gone or t.verdict is not None:
            return False
        if t.runs >= MAX_RUNS:  # bounded in this worker: the queue (attempt + 1) takes over
            t.verdict = TransientError.of(ENGINE_RESTARTING, (
                f"re-run {t.runs} times while the engine kept dying; retrying elsewhere"))
            return False
        return True

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
            self._engine_failed_canary(engine)

    async def _canary(self, engine, spec: ModelSpec, count_death: bool = True) -> bool:
        self.canaries += 1
        try:
            await asyncio.wait_for(engine.run(canary_request(spec), f"vigil-canary-{self.canaries}"),
                                   CANARY_TIMEOUT_S)
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

    def _engine_failed_canary(self, engine) -> None:
        if not engine.dead:  # alive but unable to generate: no better than dead
            self._shutdown_engine("failed its canary")

    def _broken_error(self, spec: ModelSpec) -> WorkerFatalError:
        return WorkerFatalError.of(REPEATED_ENGINE_DEATH, (
            f"the engine for {spec.name} died {self._streak.count} times in a row with no "
            f"success between ({self._streak.signature})"))

