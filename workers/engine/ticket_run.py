"""One request's life on the engine host's loop (workers/engine/host.py hands each ticket here):
admitted to an engine of its model and lane, a place in the tier gate's line and its batch
seats, its LoRA adapter gated, the run in the engine under its own timeout (the wedge clock),
and the outcome accounted for in one locked step: a result, a classified error, a re-run at
vLLM's request, or, after an engine death, the recovery's verdict (workers/engine/recovery.py).
It decides on the host's one state (workers/engine/host_state.py), on the host's loop."""
from __future__ import annotations

import asyncio
import time

from app.errors import WEDGED, TransientError, WorkerFatalError
from app.requests.models import ModelSpec
from workers.engine.admission import Admission
from workers.engine.classify import classify, death_cause, is_engine_dead
from workers.engine.host_state import HostState
from workers.engine.lora import AdapterCache, lane_of
from workers.engine.output import EngineOutput
from workers.engine.recovery import Recovery
from workers.engine.ticket import Ticket
from workers.engine.tier_gate import TierGate


class TicketRuns:
    """Runs tickets on the host's loop (module docstring), with the host's state and its
    admission, tier gate, recovery and adapter cache."""

    def __init__(self, st: HostState, admission: Admission, tiers: TierGate, recovery: Recovery,
                 adapters: AdapterCache):
        self._st = st
        self._admission = admission
        self._tiers = tiers
        self._recovery = recovery
        self._adapters = adapters

    async def generate(self, t: Ticket, spec: ModelSpec, arrived: float) -> EngineOutput:
        """Run `t` to its output in an engine of `spec` (admission, its lane, batch seats, its
        adapter, re-runs after an engine death or at vLLM's request); raises its classified
        error, or what the recovery decided."""
        lane = lane_of(spec, t.adapter, t.req, t.attempt_id)
        engine = await self._admission.acquire(spec, arrived, lane)
        self._tiers.join(t)
        try:
            while True:
                # Every run takes its slots: a re-run after an engine death too, so the suspects
                # never enter the fresh engine past its batch (they keep their place in line).
                await self._tiers.seat(t)
                if t.adapter is not None:
                    await self._gate_or_release(engine, t, spec)
                outcome, value = await self._run_once(engine, t, spec)
                if outcome == "ok":
                    return value
                if outcome == "error":
                    if isinstance(value, WorkerFatalError):
                        self._recovery.go_fatal(value)
                    elif await self._recovery.rerun_here(t, value):  # vLLM asked for a retry
                        engine = await self._admission.acquire(spec, self._st.clock(), lane)
                        continue
                    raise value
                engine = await self._recovery.await_turn(t)  # died: the recovery's verdict
        finally:
            self._tiers.leave(t)
            if t.adapter is not None and self._adapters.done(t):
                self._st.loop.create_task(self._st.notify())

    async def _run_once(self, engine, t: Ticket, spec: ModelSpec):
        """One run of a ticket in `engine`: ("ok", output) | ("error", VigilError) | ("died", e).
        The bookkeeping after the run happens in one locked step, so the recovery never sees
        the engine empty before every casualty of a death is registered as a suspect."""
        st = self._st
        t.runs += 1
        self._tiers.hold(t)
        st.run_started(t, time.monotonic())
        outcome, value = "cancelled", None
        args = (t.req, t.engine_request_id()) + ((t.adapter,) if t.adapter is not None else ())
        try:
            # The request's own timeout counts inside the running engine only.
            # Only an engine that streams (`streams = True`) gets the tap.
            kw = {"tap": t.tap} if t.tap is not None and getattr(engine, "streams", False) else {}
            # In this task, not wait_for's task of its own: one task and hop less per request.
            # A run seated ahead of the batch waits inside vLLM for a slot: its clock starts
            # when the gate hands it one (workers/engine/tier_gate.py `_slot_found`).
            async with asyncio.timeout(None if t.ahead else t.timeout) as clock:
                t.clock = clock
                try:
                    if t.ahead:
                        self._tiers.entered(t, engine)
                    value = await engine.run(*args, **kw)
                finally:
                    t.clock = None
            outcome = "ok"
        except asyncio.CancelledError:
            raise
        except TimeoutError:  # vLLM aborted the request when the timeout cancelled it
            outcome, value = "error", TransientError.of(WEDGED, (
                f"request {t.attempt_id} got no answer from the engine within {t.timeout:g} s"))
        except BaseException as e:  # classified once, here, at the engine boundary
            if getattr(engine, "dead", False) or is_engine_dead(e):
                # EngineCore's own account: a CUDA fault is not the requests' (no suspects).
                fault = death_cause(engine)
                outcome, value = ("died", e) if fault is None else ("error", fault)
                if fault is not None:
                    value.__cause__ = e
                    self._recovery.note_death(engine, fault)
            else:
                outcome, value = "error", classify(e)
                value.__cause__ = e
        finally:
            st.run_ended(t)
            self._tiers.leave(t)  # its slots go to the line's head
            async with st.cond:
                st.count_out()
                t.last = outcome
                t.granted = None
                if outcome == "ok":
                    st.stats.served += 1
                    st.streak.success()
                elif outcome == "cancelled":
                    t.gone = True
                elif outcome == "died":
                    self._recovery.casualty(engine, t, value, spec)
                st.cond.notify_all()
        return outcome, value

    async def _gate_or_release(self, engine, t: Ticket, spec: ModelSpec) -> None:
        """Make sure `t`'s adapter is loaded in `engine`; on failure count the ticket out of the
        engine (counted in by admission or the recovery) and raise the classified error."""
        st = self._st
        try:
            await self._adapters.gate(engine, t, spec, st.cond)
        except BaseException:
            async with st.cond:
                st.count_out()
                st.cond.notify_all()
            raise
