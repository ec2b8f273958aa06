"""The tier gate of the engine host (workers/engine/host.py): bulk work enters the engine's
batch only into a free slot, and an interactive request admitted to a full batch makes the
youngest bulk run yield its slot (docs/architecture.md, tiers). It decides on the host's one
state (workers/engine/host_state.py), on the host's loop, holding its condition."""
from __future__ import annotations

import asyncio
import logging

from app.request_ids import request_id_of
from workers.engine.bridge import PREEMPTED, LoopBridge
from workers.engine.host_state import HostState
from workers.engine.ticket import Ticket

log = logging.getLogger("vigil.engine")


class TierGate:
    """The bulk gate and preemption, on the host's state and its loop bridge."""

    def __init__(self, st: HostState, bridge: LoopBridge):
        self._st = st
        self._bridge = bridge

    def batch_used(self, but: Ticket | None = None) -> int:
        """The engine batch slots the runs in the engine take now (`but` left out)."""
        return sum(x.seqs for x in self._st.running if x is not but)

    async def bulk_gate(self, engine, t: Ticket) -> None:
        """The bulk gate: a bulk request's first run enters an engine with a batch
        (`max_num_seqs`) only while the runs in it leave a slot free; until then it waits here,
        admitted (counted in flight, handed back or aborted like any) but not in the engine.
        So no bulk request ever waits inside vLLM: every bulk run in the engine holds a batch
        slot, a preempted one frees it, and work that arrives in messages of many requests
        (vigil.generate_many, batch objects) cannot queue ahead of an interactive request in
        vLLM. Interactive and default requests never wait here. An engine that died meanwhile
        lets it through: its run then meets the death like any other."""
        seqs = getattr(engine, "max_num_seqs", None)
        if not seqs:
            return
        st = self._st
        async with st.cond:
            try:
                await st.cond.wait_for(
                    lambda: self.batch_used() + t.seqs <= seqs or self.batch_used() == 0
                    or getattr(engine, "dead", False) or st.engine is not engine)
            except asyncio.CancelledError:  # aborted while waiting: it never entered
                st.release_slot()
                st.cond.notify_all()
                raise

    def preempt_for(self, urgent: Ticket, engine) -> None:
        """An interactive request was admitted to an engine whose batch is full (its runs take
        every one of its `max_num_seqs` slots): the youngest preemptible bulk run (the one
        started last, whose KV cache costs least to rebuild) yields its slot at the engine's
        next token boundary. The bulk gate (`bulk_gate`) lets a bulk run into the engine only
        into a free slot, so the victim holds one, and vLLM's priority scheduling
        (workers/engine/vllm_args.py) gives the freed slot to the interactive request, not to
        an older default one waiting there. Its tokens so far are read into its tap first
        (nothing is lost), then its run is cancelled with reason PREEMPTED: its caller hands it
        back to resume from them. An engine that can (`yield_run`: vllm.py) pauses first, so
        nothing is made between the read and the abort."""
        st = self._st
        seqs = getattr(engine, "max_num_seqs", None)
        if not seqs or self.batch_used(but=urgent) < seqs:
            return  # a slot is free: it starts at the next step anyway
        pick = [x for x in st.running if x is not urgent and x.preemptible and not x.preempting
                and not x.gone and x.bulk]
        if not pick:
            return
        victim = max(pick, key=lambda x: st.running[x])
        victim.preempting = True

        def cancel() -> None:
            if self._bridge.cancel_requests({request_id_of(victim.rid)}, PREEMPTED):
                st.stats.preemptions += 1
                log.info("request %s yields its slot to interactive %s", victim.rid,
                         urgent.rid)

        yield_run = getattr(engine, "yield_run", None)
        if yield_run is not None:  # paused, read, aborted in EngineCore, then cancelled
            yield_run(victim.engine_request_id(), cancel)
            return
        read_now = getattr(engine, "read_now", None)
        if read_now is not None:
            read_now(victim.engine_request_id())
        cancel()
