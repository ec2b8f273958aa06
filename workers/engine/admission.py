"""Admission: which request may enter the engine now (one part of the engine host,
workers/engine/host.py).

Rules kept here, on the host's loop under its condition (workers/engine/host_state.py):
- **one model at a time**: a request for another model stops new admissions for the current
  one (it claims the switch), waits for its in-flight requests to drain, and the engine slot
  evicts it and loads the new one (workers/engine/slot.py);
- **one lane at a time**: the same for the lanes (workers/engine/lora.py: adapter requests,
  requests naming logprob_token_ids), without evicting anything;
- **a fresh engine is warmed** before its first admission (its LoRA lane on CUDA: the engine
  slot's `warm_up`); a restart after a death is not (the recovery's canary runs the base lane,
  and the kernels a first start compiled load from Triton's disk cache);
- **a failed load is shared**: a request that waited for a load that failed fails with that
  error;
- **suspects first**: while a recovery runs (workers/engine/recovery.py), new requests wait;
- **a broken worker admits nothing**: once fatal, requests are held until the worker has handed
  them back, and fail only if no hand-back happened.
"""
from __future__ import annotations

import asyncio

from app.errors import WorkerFatalError
from app.requests.models import ModelSpec
from workers.engine.host_state import HostState
from workers.engine.lora import BASE_LANE
from workers.engine.recovery import Recovery
from workers.engine.slot import EngineSlot


class Admission:
    """Admits requests to the engine in `st` (module docstring)."""

    def __init__(self, st: HostState, slot: EngineSlot, recovery: Recovery):
        self._st = st
        self._slot = slot
        self._recovery = recovery

    def _lane_ok(self, lane: str) -> bool:
        st = self._st
        return (st.inflight == 0 or st.lane == lane) and st.lane_wanted in (None, lane)

    async def acquire(self, spec: ModelSpec, arrived: float, lane: str = BASE_LANE):
        """Admit one request to a usable engine for `spec` in `lane` (counting it in flight),
        draining and replacing the current engine first if it serves another model or is dead.
        Raises the load error shared by every request that waited for a failed load."""
        st = self._st
        async with st.cond:
            while True:
                if st.fatal is not None:
                    # Held until the worker has handed its requests back (fatal): the
                    # hand-back aborts this one; it fails only if no hand-back happened.
                    await st.cond.wait_for(lambda: st.fatal_handled)
                    raise self._recovery.fresh_fatal()
                if st.usable(spec) and not self._lane_ok(lane):
                    await self._wait_for_lane(lane)
                    continue
                if st.usable(spec):
                    st.enter(lane)
                    # A counter the heartbeat reads at its interval, not news: a `changed` per
                    # rise walked the engine's processes on this loop for every admission.
                    st.stats.peak_in_flight = max(st.stats.peak_in_flight, st.inflight)
                    return st.engine
                failure = st.last_failure
                if failure and failure[0] == spec.name and failure[1] >= arrived:
                    raise type(failure[2])(str(failure[2]))
                if st.recovery is not None:  # suspects run alone first
                    await st.cond.wait()
                    continue
                if st.inflight > 0:
                    await self._wait_for_switch(spec)
                    continue
                if st.streak.broken:
                    self._recovery.go_fatal(self._recovery.broken_error(spec))
                    continue
                try:
                    self._slot.load(spec)
                except WorkerFatalError as e:  # its requests go back untouched; it leaves
                    self._recovery.go_fatal(e)
                    continue
                await self._slot.warm_up(spec)  # its LoRA lane, before any request enters
                if st.engine.dead:  # dead on arrival: a death like any other
                    self._recovery.note_death(st.engine, RuntimeError(
                        "the engine was dead as soon as it had started"))
                st.cond.notify_all()

    async def _wait_for_switch(self, spec: ModelSpec) -> None:
        """Wait (holding the condition) for the current engine's requests to drain before it is
        replaced by `spec`'s; the first waiter claims the switch, which stops new admissions."""
        st = self._st
        claimed = st.switch_to is None
        st.claim_switch(spec.name, claimed)
        try:
            await st.cond.wait()
        except asyncio.CancelledError:
            # The request that asked for the switch gave up (timeout): the current model's
            # requests must not stay blocked behind a switch nobody wants.
            if claimed and st.withdraw_switch(spec.name):
                st.cond.notify_all()
            raise

    async def _wait_for_lane(self, lane: str) -> None:
        """Wait (holding the condition) for the other lane to drain."""
        st = self._st
        claimed = st.lane_wanted is None and st.lane != lane
        if claimed:
            st.want_lane(lane)
        try:
            await st.cond.wait()
        except asyncio.CancelledError:
            if claimed and st.withdraw_lane(lane):  # nobody else asked: withdraw
                st.cond.notify_all()
            raise
