"""What the engine host's parts share: one state under one condition, the events it tells the
worker, and its counters.

The engine host (workers/engine/host.py) is correct because of one condition: admission
(workers/engine/admission.py), the engine slot (workers/engine/slot.py) and recovery
(workers/engine/recovery.py) all decide on the same `HostState` (the engine, its model, the
requests in it, the suspects of a death), and every read and write of it happens on the host's
loop while holding `HostState.cond`. None of the three keeps state of its own about the engine,
and none writes a field of it: every change is one of `HostState`'s methods, named for the event
it records (an engine loaded, a request counted in, a ticket seated, ...), so each field has one
writer to read.
"""
from __future__ import annotations

import asyncio
import bisect
import threading
from dataclasses import dataclass
from typing import Callable

from app.errors import VigilError, WorkerFatalError
from app.requests.models import ModelSpec
from workers.engine.lora import BASE_LANE
from workers.engine.memory import MemoryPlan
from workers.engine.suspects import DeathStreak
from workers.engine.ticket import Ticket


class HostEvents:
    """What the engine host tells, and asks, the worker that owns it: one object instead of six
    callbacks. Every method has a harmless default (a host without a worker: tests, benches);
    the worker runtime overrides them (workers/runtime.py). The host calls `changed`, `failure`
    and `success` from its loop thread, `fatal` from an executor thread."""

    def changed(self) -> None:
        """The engine or its state changed (the heartbeat reports it; the orphan guard learns
        the engine's processes). Counters (the peak in flight, served) are not changes: the
        heartbeat reads them at its interval."""

    def fatal(self, err: WorkerFatalError) -> None:
        """This worker cannot keep an engine: hand its requests back and leave. The host holds
        every parked request until this returns."""

    def failure(self, reason: str) -> None:
        """A request proved a failure by traffic (a timeout, a stall): the health ledger's."""

    def success(self) -> None:
        """A request completed a generation: the health ledger's streak is over."""

    def served_elsewhere(self, model: str) -> bool:
        """True when another worker serves `model` now: a start that fails here is then this
        worker's fault, not the model's."""
        return False

    def plan_memory(self, spec: ModelSpec) -> MemoryPlan | None:
        """Size an engine start of `spec` to the free memory (raises
        TransientError(memory_pressure) below its floor); None: no sizing."""
        return None


@dataclass
class HostStats:
    """The host's counters, for `snapshot()` (the heartbeat) and the metrics."""

    loads: int = 0
    evictions: int = 0
    restarts: int = 0
    peak_in_flight: int = 0
    served: int = 0
    poisoned: int = 0
    canaries: int = 0
    preemptions: int = 0


class HostState:
    """The engine, its model and the requests in it, as the engine host's parts share them.
    Every field but the counters and the step totals is read and written on the host's loop
    under `cond` (created there by `bind`)."""

    def __init__(self, events: HostEvents, clock: Callable[[], float], death_limit: int):
        self.events = events
        self.clock = clock
        self.stats = HostStats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.cond: asyncio.Condition | None = None
        # the engine slot
        self.engine = None
        self.model: str | None = None
        self.state = "empty"
        self.last_plan: MemoryPlan | None = None
        self.last_failure: tuple[str, float, VigilError] | None = None
        # admission
        self.switch_to: str | None = None
        self.inflight = 0
        self.busy_since = clock()
        self.last_used = clock()
        self.lane = BASE_LANE
        self.lane_wanted: str | None = None
        # recovery
        self.streak = DeathStreak(death_limit)
        self.counted_death: object = None
        self.suspects: list[Ticket] = []
        # the tier gate (workers/engine/tier_gate.py): the tickets running in the engine now ->
        # when their run started; those holding batch seats (seated: from the gate to the end
        # of their run); the line of those admitted and waiting for slots, in the order they
        # get them
        self.running: dict[Ticket, float] = {}
        self.seated: set[Ticket] = set()
        self.seated_seqs = 0  # the batch seats the seated tickets take (the gate keeps it)
        self.seated_long = 0  # of them, the seats of runs that are not short (Ticket.short)
        self.seated_tier = [0, 0, 0]  # of them, the seats of each engine priority (0: first)
        # Of them, those seated past the engine's batch (`Ticket.ahead`: waiting inside vLLM
        # for a slot), in their places' order, and their seats.
        self.ahead: list[Ticket] = []
        self.ahead_seqs = 0
        self.line: list[Ticket] = []
        self.lined: set[Ticket] = set()  # the line's tickets (asked of thousands at once)
        self.recovery: asyncio.Task | None = None
        self.fatal: WorkerFatalError | None = None
        self.fatal_handled = False
        # (steps, outputs) of the engines shut down before this one; a snapshot never sees an
        # engine's steps twice, or not at all, while it is shut down.
        self.steps_before = (0, 0)
        self.steps_lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the condition on the host's loop (call on that loop)."""
        self.loop = loop
        self.cond = asyncio.Condition()

    def usable(self, spec: ModelSpec) -> bool:
        """True when the engine serves `spec` now and may take a request (alive, no switch to
        another model claimed, no recovery running)."""
        eng = self.engine
        return (eng is not None and not eng.dead and self.model == spec.name
                and self.switch_to in (None, spec.name) and self.recovery is None)

    # -- the engine slot (workers/engine/slot.py) --

    def loading(self) -> None:
        """An engine start begins: any switch claimed is being served."""
        self.state = "loading"
        self.switch_to = None

    def planned(self, plan: MemoryPlan) -> None:
        """The memory plan the start is sized by."""
        self.last_plan = plan

    def load_failed(self, model: str, err: VigilError) -> None:
        """The start of `model` failed with `err` (kept for the next admission to raise)."""
        self.last_failure = (model, self.clock(), err)
        self.state = "failed"

    def loaded(self, engine, model: str) -> None:
        """`engine` serves `model` now, ready for requests."""
        self.engine = engine
        self.model = model
        self.last_failure = None
        self.state = "ready"
        self.stats.loads += 1
        self.last_used = self.clock()

    def take_engine(self):
        """The engine, taken out of the state for its shutdown (None when there is none); its
        step totals join `steps_before` under the steps lock, so a snapshot never sees them
        twice or not at all. Call `emptied` once it is shut down."""
        with self.steps_lock:
            eng, self.engine = self.engine, None
            if eng is not None:
                self.steps_before = steps_through(self.steps_before, eng)
        return eng

    def emptied(self) -> None:
        """No engine, no model."""
        self.model = None
        self.state = "empty"

    def steps(self) -> tuple[int, int]:
        """(steps, request outputs) of every engine this host ran, the current one included."""
        with self.steps_lock:
            return steps_through(self.steps_before, self.engine)

    # -- admission (workers/engine/admission.py) and the requests in the engine --

    def enter(self, lane: str) -> None:
        """A request enters the engine in LoRA `lane`: counted in; the first of a busy spell
        sets the lane and the spell's start, and a lane it wanted is served."""
        self.switch_to = None
        if self.inflight == 0:
            self.busy_since = self.clock()
            self.lane = lane
        if self.lane_wanted == lane:
            self.lane_wanted = None
        self.inflight += 1

    def count_in(self) -> None:
        """A request re-enters the engine (a suspect re-run alone by the recovery)."""
        self.inflight += 1

    def count_out(self, used: bool = True) -> None:
        """A request left the engine; `used`: it ran there (the idle clock restarts), else it
        never used it (a preload's admission, a suspect given up before its re-run)."""
        self.inflight -= 1
        if used:
            self.last_used = self.clock()

    def claim_switch(self, model: str, claimed: bool) -> None:
        """The engine drains for a switch to `model` (`claimed`: this waiter asked for it)."""
        if claimed:
            self.switch_to = model
        self.state = "draining"

    def withdraw_switch(self, model: str) -> bool:
        """A switch to `model` nobody waits for any more is withdrawn; True when it was."""
        if self.switch_to == model:
            self.switch_to = None
            return True
        return False

    def want_lane(self, lane: str) -> None:
        """A request waits for the engine to drain into LoRA `lane`."""
        self.lane_wanted = lane

    def withdraw_lane(self, lane: str) -> bool:
        """The wait for `lane` is withdrawn unless another asked since; True when it was."""
        if self.lane_wanted == lane:
            self.lane_wanted = None
            return True
        return False

    def run_started(self, t: Ticket, at: float) -> None:
        """`t`'s run in the engine started at `at` (monotonic)."""
        self.running[t] = at

    def run_ended(self, t: Ticket) -> None:
        """`t`'s run in the engine ended."""
        self.running.pop(t, None)

    # -- recovery (workers/engine/recovery.py) --

    def add_suspect(self, t: Ticket) -> None:
        """`t` was in the engine when it died: it waits for the recovery's re-run."""
        self.suspects.append(t)

    def take_suspects(self) -> list[Ticket]:
        """The suspects still waiting (none gone), taken for a re-run; the list empties."""
        out = [t for t in self.suspects if not t.gone]
        self.suspects.clear()
        return out

    def recovering(self, task: asyncio.Task | None) -> None:
        """The recovery now running (None: it ended)."""
        self.recovery = task

    def died(self, engine) -> None:
        """`engine` died; its death is counted once."""
        self.counted_death = engine
        self.state = "dead"

    def fatal_now(self, err: WorkerFatalError) -> None:
        """This worker cannot keep an engine."""
        self.fatal = err
        self.state = "fatal"

    def fatal_told(self) -> None:
        """The worker was told of the fatal error (its requests handed back)."""
        self.fatal_handled = True

    # -- the tier gate (workers/engine/tier_gate.py) --

    def join_line(self, t: Ticket) -> None:
        """`t` waits in the line for batch seats, in its place's order."""
        if not self.line or self.line[-1].place <= t.place:
            self.line.append(t)  # the usual case: the last of its tier to arrive
        else:
            bisect.insort(self.line, t, key=lambda x: x.place)
        self.lined.add(t)

    def leave_line(self, t: Ticket) -> None:
        """`t` leaves the line (seated, or gone)."""
        if t in self.lined:
            self.lined.discard(t)
            self.line.remove(t)

    def pop_line(self) -> Ticket:
        """The line's head, taken off it."""
        head = self.line.pop(0)
        self.lined.discard(head)
        return head

    def seat(self, t: Ticket, ahead: bool = False) -> None:
        """`t` holds its batch seats; `ahead`: past the engine's batch (it waits inside vLLM
        for a slot, `Ticket.ahead`)."""
        if t not in self.seated:
            self.seated.add(t)
            self.seated_seqs += t.seqs
            self.seated_long += 0 if t.short else t.seqs
            self.seated_tier[t.tier] += t.seqs
            if ahead:
                t.ahead = True
                self.ahead_seqs += t.seqs
                bisect.insort(self.ahead, t, key=lambda x: x.place)  # after equal places

    def unseat(self, t: Ticket) -> None:
        """`t` gave its batch seats back."""
        if t in self.seated:
            self.seated.discard(t)
            self.seated_seqs -= t.seqs
            self.seated_long -= 0 if t.short else t.seqs
            self.seated_tier[t.tier] -= t.seqs
            if t.ahead:
                self.ahead.remove(t)
                self.ahead_seqs -= t.seqs
                t.ahead = False

    @property
    def running_seqs(self) -> int:
        """The seats of the seated tickets within the engine's batch (not `ahead`)."""
        return self.seated_seqs - self.ahead_seqs

    def fits_batch(self, t: Ticket, seqs: int) -> bool:
        """`t`'s seats fit beside the runs within the engine's batch of `seqs`; one larger than
        the batch fits an empty batch (it runs alone: vLLM runs the samples that fit)."""
        return self.running_seqs == 0 or self.running_seqs + t.seqs <= seqs

    def seats_from(self, tier: int) -> int:
        """The seats held by seated tickets of engine priority `tier` or a more urgent one
        (vLLM schedules those first)."""
        return sum(self.seated_tier[:tier + 1])

    def promote(self, seqs: int | None) -> list[Ticket]:
        """The `ahead` tickets that now have a slot of the engine's `seqs` (None: every one),
        no longer ahead: those whose run is inside vLLM (`Ticket.clock` set), in vLLM's order
        (their places': priority, then arrival), as far as the slots go."""
        out = []
        i = 0
        while i < len(self.ahead):
            t = self.ahead[i]
            if seqs is not None:
                if t.clock is None:  # not inside vLLM yet: vLLM schedules the next one
                    i += 1
                    continue
                if not self.fits_batch(t, seqs):
                    break
            self.ahead.pop(i)
            self.ahead_seqs -= t.seqs
            t.ahead = False
            out.append(t)
        return out

    async def notify(self) -> None:
        """Wake every waiter on the condition."""
        async with self.cond:
            self.cond.notify_all()


def steps_through(before: tuple[int, int], eng) -> tuple[int, int]:
    """`before` plus the (steps, request outputs) `eng` counted from what its EngineCore sent
    (workers/engine/step_counter.py, StepCounter); outputs / steps is the mean batch. Engines
    that do not count (the instant engine) add 0."""
    counter = getattr(eng, "steps", None)
    steps, outputs = before
    if counter is not None:
        steps, outputs = steps + counter.steps, outputs + counter.outputs
    return steps, outputs
