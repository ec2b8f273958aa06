"""Recovery from engine death: suspects re-run re-isolated, the canary, the death streak, and a
worker that cannot keep an engine leaving (one part of the engine host, workers/engine/host.py).

An engine that dies under load is restarted and its in-flight requests re-run as suspects,
re-isolated until the guilty one is found (the rules: workers/engine/suspects.py): the whole set
once, then split; a request that dies alone twice after a passing canary is `poison_request`;
every fresh engine passes a canary first. A worker that cannot keep an engine alive (the death
streak) is fatal: the worker's `fatal` event hands its requests back and it leaves. A quarantine
restarts the engine and runs the canary (`restart_with_canary`). Everything here runs on the
host's loop under its condition (workers/engine/host_state.py).
"""
from __future__ import annotations

import asyncio
import logging

from app.errors import REPEATED_ENGINE_DEATH, VigilError, WorkerFatalError
from app.request_ids import canary_id
from app.requests.models import ModelSpec
from app.retry_policy import retry_here, rule_for
from workers.engine.host_state import HostState
from workers.engine.slot import EngineSlot
from workers.engine.suspects import (CANARY_TIMEOUT_S, canary_request, death_signature, judge,
                                     runnable)
from workers.engine.ticket import Ticket

log = logging.getLogger("vigil.engine")


class Recovery:
    """Engine deaths and their suspects, and the worker's fatal end (module docstring)."""

    def __init__(self, st: HostState, slot: EngineSlot):
        self._st = st
        self._slot = slot

    # -- a death, seen by a request ----------------------------------------------------------------
    def casualty(self, engine, t: Ticket, exc: BaseException, spec: ModelSpec) -> None:
        """`t`'s run died with `engine`: count the death once, park `t` as a suspect (unless
        the recovery already owns it) and start the recovery if none runs. Under the
        condition."""
        st = self._st
        self.note_death(engine, exc)
        if not t.in_recovery:
            t.in_recovery = True
            st.add_suspect(t)
            if st.recovery is None:
                st.recovering(st.loop.create_task(self._recover(spec)))

    def note_death(self, engine, exc: BaseException) -> None:
        """Count `engine`'s death in the streak, once however many requests saw it."""
        st = self._st
        if st.counted_death is engine:
            return
        st.died(engine)
        n = st.streak.death(death_signature(exc))
        log.warning("engine for %s died (%s); %d death(s) in a row", st.model,
                    death_signature(exc), n)

    async def await_turn(self, t: Ticket):
        """Park a suspect until the recovery hands it a fresh engine (its inflight slot already
        counted) or a verdict to raise."""
        st = self._st
        async with st.cond:
            try:
                await st.cond.wait_for(
                    lambda: t.granted is not None or t.verdict is not None
                    or (st.fatal is not None and st.fatal_handled))
            except asyncio.CancelledError:
                t.gone = True
                if t.granted is not None:  # handed an engine in the same instant: give it back
                    t.granted = None
                    st.count_out(used=False)
                    st.cond.notify_all()
                raise
            if t.verdict is not None:
                raise t.verdict
            if t.granted is None:
                raise self.fresh_fatal()
            return t.granted

    # -- an error the engine asked to retry -------------------------------------------------------
    async def rerun_here(self, t: Ticket, error: VigilError) -> bool:
        """Whether `t` runs again on this worker's engine after `error` (the retry decision's
        `retry_here`: vLLM asked for a retry), once its pause has passed; False when the error
        leaves the worker (or the worker is leaving). `t` is not counted in the engine meanwhile."""
        pause = retry_here(error, t.reruns_here)
        if pause is None or self._st.fatal is not None or t.gone:
            return False
        t.reruns_here += 1
        log.info("request %s: %s; running it again on this engine in %.1f s (re-run %d of "
                 "%d)", t.attempt_id, error, pause, t.reruns_here, rule_for(error).here)
        await asyncio.sleep(pause)
        return True

    # -- the worker's end ---------------------------------------------------------------------------
    def fresh_fatal(self) -> WorkerFatalError:
        """A new copy of the fatal error (each caller raises its own)."""
        return WorkerFatalError(str(self._st.fatal))

    def go_fatal(self, err: WorkerFatalError) -> None:
        """This worker cannot serve: refuse everything and tell the worker (`fatal`), which
        hands the in-flight requests back and stops. Parked requests wait for that hand-back
        (it aborts them) and only then fail with the error."""
        st = self._st
        if st.fatal is not None:
            return
        st.fatal_now(err)
        log.critical("worker cannot keep an engine: %s", err)
        st.events.changed()

        async def _released():
            async with st.cond:
                st.fatal_told()
                st.cond.notify_all()

        fut = st.loop.run_in_executor(None, st.events.fatal, err)
        fut.add_done_callback(lambda _f: st.loop.create_task(_released()))

    def broken_error(self, spec: ModelSpec) -> WorkerFatalError:
        """The death streak's verdict on this worker."""
        streak = self._st.streak
        return WorkerFatalError.of(REPEATED_ENGINE_DEATH, (
            f"the engine for {spec.name} died {streak.count} times in a row with no "
            f"success between ({streak.signature})"))

    # -- the recovery -------------------------------------------------------------------------------
    async def _recover(self, spec: ModelSpec) -> None:
        """Re-run the suspects of an engine death on fresh engines (workers/engine/suspects.py)."""
        st = self._st
        plan: list[list[Ticket]] = []
        group: list[Ticket] | None = None
        try:
            async with st.cond:
                while True:
                    await st.cond.wait_for(lambda: st.inflight == 0)
                    if group is None:  # the casualties of a death in normal service
                        plan.append(st.take_suspects())
                    else:
                        self._judge(group, plan)
                    plan = [g for g in ([t for t in g if runnable(t)] for g in plan) if g]
                    if not plan:
                        return
                    engine = await self._fresh_engine(spec)
                    group = plan.pop(0)
                    for t in group:
                        t.granted = engine
                        st.count_in()
                    log.info("re-running %d suspect(s) alone in the engine (%d group(s) wait)",
                             len(group), len(plan))
                    st.cond.notify_all()
        except WorkerFatalError as e:  # parked suspects wait for the hand-back (fatal)
            self.go_fatal(e)
        except VigilError as e:  # the engine cannot be (re)built: every suspect gets the error
            for t in [t for g in plan for t in g]:
                if t.verdict is None:
                    t.verdict = type(e)(str(e))
        finally:
            async with st.cond:
                st.recovering(None)
                st.cond.notify_all()

    def _judge(self, group: list[Ticket], plan: list[list[Ticket]]) -> None:
        """After `group` ran alone (suspects.py `judge`); a conviction is counted, and its death
        is explained: it does not count against the engine."""
        convicted = judge(group, plan)
        if convicted is not None:
            self._st.stats.poisoned += 1
            self._st.streak.success()
            log.error("request %s killed the engine when run alone %d times: poison",
                      convicted.attempt_id, convicted.solo_deaths)

    async def _fresh_engine(self, spec: ModelSpec):
        """(Re)build the engine until one passes the canary; raises the load error, or
        WorkerFatalError(repeated_engine_death) once the death streak reaches its limit."""
        st = self._st
        while True:
            if st.streak.broken:
                raise self.broken_error(spec)
            if st.engine is None or st.engine.dead or st.model != spec.name:
                self._slot.load(spec)
            engine = st.engine
            if await self.canary(engine, spec):
                return engine
            if not engine.dead:  # alive but unable to generate: no better than dead
                self._slot.shutdown_engine("failed its canary")

    async def canary(self, engine, spec: ModelSpec, count_death: bool = True,
                     timeout: float = CANARY_TIMEOUT_S) -> bool:
        """One smallest real generation on `engine`; True when it answered. A failure counts
        as a death of `engine` unless `count_death` is False."""
        st = self._st
        st.stats.canaries += 1
        try:
            await asyncio.wait_for(engine.run(canary_request(spec),
                                              canary_id(st.stats.canaries)),
                                   min(timeout, CANARY_TIMEOUT_S))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.warning("canary on the fresh engine for %s failed: %s", spec.name,
                        death_signature(e))
            if count_death:
                self.note_death(engine, e)
            return False
        st.streak.success()
        return True

    async def restart_with_canary(self, spec: ModelSpec, timeout: float) -> tuple[bool, str]:
        """Once the engine is empty: kill it (a wedged one cannot shut down politely), start a
        fresh one for `spec` and run the canary on it. Returns (passed, why not)."""
        st = self._st
        async with st.cond:
            await st.cond.wait_for(lambda: st.inflight == 0 and st.recovery is None)
            eng = st.engine
            if eng is not None:
                kill = getattr(eng, "kill", None)
                if kill is not None:
                    kill()
                st.stats.restarts += 1
                self._slot.shutdown_engine("")
            try:
                self._slot.load(spec)
            except VigilError as e:
                return False, f"the engine did not start: {e}"
            if await self.canary(st.engine, spec, count_death=False, timeout=timeout):
                return True, ""
            return False, "the canary generation failed on a fresh engine"
