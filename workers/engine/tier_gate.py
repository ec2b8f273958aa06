"""The tier gate of the engine host (workers/engine/host.py): every request enters the engine
in tier order, about one batch of each tier past the engine's own waits inside vLLM for its
slots, and an interactive request admitted to a full batch makes the bulk runs cheapest to
rebuild yield as many slots as it needs (docs/architecture.md, "Tiers"). It decides on the
host's one state (workers/engine/host_state.py), on the host's loop.

Why a gate: vLLM runs `max_num_seqs` requests and queues the rest inside it, in its priority
order (tier, then arrival), and a request's own timeout (`VIGIL_REQUEST_TIMEOUT`, the wedge
clock) runs from its entry into the engine, so a request queued in vLLM behind long runs would
end `wedged` and report a health failure against a healthy engine; and an interactive request
must find few runs ahead of it. Here a request waits for its seats outside vLLM, admitted
(counted in flight, handed back or aborted like any); the time it waits is not counted against
its wait for an engine either (`Ticket.gated`, workers/engine/pending.py). The stall watchdog
still watches the engine: a batch that makes no step aborts the runs and those waiting alike.

The line: the tickets admitted and waiting for seats, ordered by tier (interactive, default,
bulk), then arrival. Seats go to its head only, whenever a run ends or a ticket joins or leaves
the line: a request of n samples at the head (vLLM runs each sample in a slot of its own) waits
for n free seats and nobody behind passes it; one larger than the whole batch runs alone. A
ticket holds its seat (`HostState.seated`) from the gate until its run ends, also while its LoRA
adapter loads, so a slot freed for an interactive request stays its own. The seats a ticket
counts are those of its own tier and the more urgent ones: vLLM schedules those first.

One batch ahead: a run may enter vLLM with `BATCHES_IN_ENGINE` (2) batches of its tier and the
more urgent ones seated, so when runs end, the next ones are already inside and EngineCore fills
their slots in the same step, as a bare AsyncLLM given them all would. Held to one batch, every
slot stayed empty from the step its run ended until the worker's loop had taken in that run's
output and added the next run: in 512 runs of 128 tokens (all ending together) the worker's
engine made 518-536 steps of 122-127 runs against the bare engine's 514-515 of 127-128, and
one batch ahead made 513-518 of 126-128 (docs/performance.md, "The fifteenth pass"). A run
seated past the batch is `ahead`: it waits inside vLLM, and its wedge clock and its wait for
a slot (`gated`) go on until the gate hands it a slot that a run's end freed (`_slot_found`),
in the order vLLM schedules them (tier, then arrival). An interactive request enters ahead of
the bulk runs waiting inside vLLM, and preemption frees the slots it lacks among the runs in
the batch only.

Short runs (`Ticket.short`: eval scoring, classification, at most 16 tokens a sample) may take
`SHORT_RUN_BATCHES` times the batch while every seated run is short: the batches past the first
wait inside vLLM, ready for EngineCore's next steps while this one's outputs come back, as they
would with a bare AsyncLLM given them all. Held to one batch, EngineCore stepped with whatever
had come back in time: 29-39 one-token runs a step against the bare engine's ~95; with two
batches 43-59, with four 65-78, with eight no more (docs/performance.md, "Short requests"). A
run queued there waits a few steps at most, behind short runs only, on its wedge clock; a run
that is not short waits in the line until they are within `BATCHES_IN_ENGINE` batches.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time

from app.requests.tiers import engine_priority
from workers.engine.bridge import PREEMPTED, LoopBridge
from workers.engine.host_state import HostState
from workers.engine.resume import refusal, resumable, unsound
from workers.engine.ticket import Ticket

log = logging.getLogger("vigil.engine")

# The batches short runs may take while every seated run is short (module docstring).
SHORT_RUN_BATCHES = 4
# The batches every other run may take: the engine's and one more waiting inside vLLM for its
# slots (module docstring, "One batch ahead").
BATCHES_IN_ENGINE = 2


class TierGate:
    """The batch gate, its line and preemption, on the host's state and its loop bridge."""

    def __init__(self, st: HostState, bridge: LoopBridge):
        self._st = st
        self._bridge = bridge
        self._arrivals = itertools.count()
        self._seats: dict[Ticket, asyncio.Future] = {}  # tickets at the gate -> their wake-up

    def room(self, t: Ticket, seqs: int) -> int:
        """The batch seats `t` may be seated within, for an engine of `seqs`: SHORT_RUN_BATCHES
        times that for a short run while every seated run is short, else BATCHES_IN_ENGINE
        times (module docstring)."""
        return (SHORT_RUN_BATCHES if self._among_shorts(t) else BATCHES_IN_ENGINE) * seqs

    def _among_shorts(self, t: Ticket) -> bool:
        """`t` is short and so is every seated run: short runs may take SHORT_RUN_BATCHES
        batches, and none waits past the batch on no clock (module docstring)."""
        return t.short and not self._st.seated_long

    def batch_used(self, t: Ticket) -> int:
        """The engine batch seats taken now by seated runs vLLM schedules before `t` or with
        it: those of its tier and of more urgent ones."""
        return self._st.seats_from(t.tier)

    @property
    def waiting(self) -> int:
        """Requests in the line: admitted, waiting for batch seats outside the engine."""
        return len(self._st.line)

    def join(self, t: Ticket) -> None:
        """`t` takes its place in the line, as it is admitted: before its adapter loads and
        before a preemption for it is decided, so the slots freed for it are its own."""
        st = self._st
        if t in st.lined or t in st.seated:
            return
        if not t.place:
            t.place = (engine_priority(getattr(t.req, "priority", None)), next(self._arrivals))
        st.join_line(t)

    async def seat(self, t: Ticket) -> None:
        """Return once `t` holds its batch seats (module docstring). Cancelled while it waits
        (aborted, handed back, its caller gone), it leaves the line and its admission is
        counted out: it never entered the engine."""
        st = self._st
        self.join(t)
        wake = asyncio.get_running_loop().create_future()
        self._seats[t] = wake
        self.fill()
        if t in st.seated:
            self._seats.pop(t, None)
            return
        t.gate_since = time.monotonic()
        try:
            await wake
        except asyncio.CancelledError:
            self.leave(t)
            async with st.cond:
                st.count_out()
                st.cond.notify_all()
            raise
        finally:
            self._seats.pop(t, None)
            if not t.ahead:  # else it goes on inside vLLM, to `_slot_found`
                wait_over(t)

    def hold(self, t: Ticket) -> None:
        """`t` runs now: it holds its slots (a re-run after an engine death comes here without
        waiting in the line)."""
        self._st.seat(t)

    def leave(self, t: Ticket) -> None:
        """`t` gave up its place or its slots (its run ended, it was aborted while waiting, its
        adapter failed): they go to the line's head."""
        st = self._st
        st.leave_line(t)
        if t.ahead:
            self._slot_found(t)  # its wait for a slot ends with it
        st.unseat(t)
        self.fill()

    def _batch(self) -> int | None:
        """The engine's batch (`max_num_seqs`); None when the engine is gone or dead, or has
        none: every ticket may enter (its run meets that like any other, or has no batch to
        wait for)."""
        eng = self._st.engine
        seqs = getattr(eng, "max_num_seqs", None)
        return None if not seqs or getattr(eng, "dead", True) else seqs

    def fill(self) -> None:
        """Hand the free slots to `ahead` runs inside vLLM, then seat the line's head while
        its seats are free (module docstring): within the batch, or past it (`ahead`)."""
        st = self._st
        seqs = self._batch()
        for t in st.promote(seqs):
            self._slot_found(t)
        while st.line:
            head = st.line[0]
            used = self.batch_used(head)
            if seqs is not None and used > 0 and used + head.seqs > self.room(head, seqs):
                return
            st.pop_line()
            # Past the batch, a run waits inside vLLM on no clock; not a short run among short
            # ones only (a few steps, and none of them yields).
            st.seat(head, ahead=seqs is not None and not self._among_shorts(head)
                    and not st.fits_batch(head, seqs))
            if head.ahead and head.gate_since is None:  # its wait for a slot goes on inside
                head.gate_since = time.monotonic()
            wake = self._seats.get(head)
            if wake is not None and not wake.done():
                wake.set_result(None)

    def _slot_found(self, t: Ticket) -> None:
        """`t`, seated ahead, has a slot of the batch now (or left): its wait for a slot ends
        (counted as `gated`, workers/engine/pending.py) and its wedge clock starts."""
        wait_over(t)
        clock = t.clock
        if clock is not None and not clock.expired():
            clock.reschedule(self._st.loop.time() + t.timeout)

    def entered(self, t: Ticket, engine) -> None:
        """`t`, seated ahead, has entered vLLM (its run's clock is set, not started): an
        interactive one makes bulk runs yield the slots it lacks (`preempt_for`), and any
        slot free now is handed out."""
        if t.urgent:
            self.preempt_for(t, engine)
        self.fill()

    def preempt_for(self, urgent: Ticket, engine) -> None:
        """An interactive request entered vLLM past the batch (`ahead`, its adapter loaded):
        when the runs in the batch and those inside vLLM ahead of it leave it short of slots
        (vLLM gives a freed slot to the most urgent run inside it), the preemptible bulk runs
        cheapest to rebuild (fewest prompt and prefix tokens to prefill again: `rebuild_cost`;
        of equals, the one started last) yield as many slots as it lacks, at the engine's next
        token boundary. Never a run whose resume would be refused (its tokens would be thrown away:
        workers/engine/resume.py). Each victim's tokens are read into its tap first, then its
        run is cancelled with reason PREEMPTED: its caller hands it back to resume from them.
        An engine that can (`yield_run`: vllm_pause.py) pauses first, so nothing is made between
        the read and the abort. Runs inside vLLM that wait for a slot never yield: that frees
        none. A short run never yields: its seat is free within a few steps anyway."""
        st = self._st
        seqs = getattr(engine, "max_num_seqs", None)
        if not seqs or not urgent.ahead:
            return
        # The slots taken by the runs in the batch, by those inside vLLM that it schedules
        # before `urgent`, and by `urgent`, against the batch.
        batch = (SHORT_RUN_BATCHES if self._among_shorts(urgent) else 1) * seqs
        need = sum(x.seqs for x in st.seated if not x.preempting and not x.ahead) - batch
        need += sum(x.seqs for x in st.ahead if x.place < urgent.place and not x.preempting
                    and x.clock is not None) + urgent.seqs
        if need <= 0:
            return  # its slots are free, or are being freed for it
        # Runs vLLM made a token for first: a run seated within the batch may still wait
        # inside vLLM (its grammar compiling) while one seated ahead took its slot.
        generating = getattr(engine, "generating", None)
        picks = []
        for x in st.running:
            if (x is not urgent and x.preemptible and x.bulk and not x.short
                    and not x.preempting and not x.gone and not x.ahead):
                cost = rebuild_cost(x, engine)
                if cost is not None:
                    idle = generating is not None and not generating(x.engine_request_id())
                    picks.append((idle, cost, -st.running[x], id(x), x))
        for *_, victim in sorted(picks):
            if need <= 0:
                return
            need -= victim.seqs
            self._preempt(victim, urgent, engine)

    def _preempt(self, victim: Ticket, urgent: Ticket, engine) -> None:
        st = self._st
        victim.preempting = True

        def cancel() -> None:
            if self._bridge.cancel_requests({victim.request_id}, PREEMPTED):
                st.stats.preemptions += 1
                log.info("request %s yields its slot to interactive %s", victim.attempt_id,
                         urgent.attempt_id)

        yield_run = getattr(engine, "yield_run", None)
        if yield_run is not None:  # paused, read, aborted in EngineCore, then cancelled
            yield_run(victim.engine_request_id(), cancel)
            return
        read_now = getattr(engine, "read_now", None)
        if read_now is not None:
            read_now(victim.engine_request_id())
        cancel()


def wait_over(t: Ticket) -> None:
    """`t`'s wait for a slot, if it waits, ends now: counted into `gated` before `gate_since`
    clears (the order workers/engine/pending.py reads them in)."""
    since = t.gate_since
    if since is not None:
        t.gated += time.monotonic() - since
        t.gate_since = None


def rebuild_cost(t: Ticket, engine) -> int | None:
    """The tokens a resume of `t`'s run would prefill again: for each of its samples, the
    prompt and the tokens it made (a run that made none restarts from its prompt, once); None
    when its resume would be refused (workers/engine/resume.py decides: `unsound`, `refusal`)
    and a preemption would throw its tokens away. Until the engine has read the prompt's token
    ids into the tap, the prompt's length in characters stands in for them. None too for a
    run whose resume would not equal its unbroken run (`resumable`: seeded sampling)."""
    if unsound(t.req) or not resumable(t.req):
        return None
    tap = t.tap
    prompt_ids = getattr(tap, "prompt_ids", None)
    prompt = (len(prompt_ids) if prompt_ids is not None
              else len(t.req.prompt_token_ids or ()) or len(t.req.prompt or ""))
    cp = tap.resume_point() if tap is not None else None
    if cp is None:
        return prompt
    limit = getattr(engine, "max_model_len", None) or sys.maxsize
    samples = [cp.sample(i) for i in range(t.seqs)]
    if any(refusal(c, max_tokens=t.req.max_tokens, max_model_len=limit,
                   adapter_fingerprint=tap.adapter_fingerprint) for c in samples if c.tokens):
        return None
    return sum(prompt + c.tokens for c in samples)
