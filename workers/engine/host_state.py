"""What the engine host's parts share: one state under one condition, the events it tells the
worker, and its counters.

The engine host (workers/engine/host.py) is correct because of one condition: admission
(workers/engine/admission.py), the engine slot (workers/engine/slot.py) and recovery
(workers/engine/recovery.py) all decide on the same `HostState` (the engine, its model, the
requests in it, the suspects of a death), and every read and write of it happens on the host's
loop while holding `HostState.cond`. None of the three keeps state of its own about the engine.
"""
from __future__ import annotations

import asyncio
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
        # when their run started; those holding batch slots (seated: from the gate to the end
        # of their run); the line of those admitted and waiting for slots, in the order they
        # get them
        self.running: dict[Ticket, float] = {}
        self.seated: set[Ticket] = set()
        self.seated_seqs = 0  # the batch slots the seated tickets take (the gate keeps it)
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

    def release_slot(self) -> None:
        """One request left the engine (or never entered it): count it out. Under `cond`."""
        self.inflight -= 1
        self.last_used = self.clock()

    async def notify(self) -> None:
        """Wake every waiter on the condition."""
        async with self.cond:
            self.cond.notify_all()
