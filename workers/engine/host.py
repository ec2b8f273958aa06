"""The engine host: one per worker process, holding one warm engine keyed by model.

Task threads call `generate()`, which hands the request to the host's loop (the loop bridge,
workers/engine/bridge.py) and blocks on the answer; the engine sees every request in flight at
once and batches them continuously. The engine is built on that loop (lazily, or by `preload`),
never at import.

The host is correct because of one condition: its parts all decide on one state (the engine,
its model, the requests in it, the suspects of a death: workers/engine/host_state.py), on the
loop, holding that condition. Its parts, by job:
- admission and lanes (workers/engine/admission.py): one model and one lane at a time (LoRA,
  logprob_token_ids: workers/engine/lora.py), a failed load shared, suspects first;
- the engine slot (workers/engine/slot.py): load sized to free memory, switch, evict, idle;
- recovery (workers/engine/recovery.py): engine death, suspects re-isolated, the canary, the
  death streak, the worker's fatal end;
- the tier gate (workers/engine/tier_gate.py): every request enters the engine's batch only
  into a free slot, in tier order (waiting for it is not on its wedge clock), and an interactive
  request makes the bulk runs cheapest to rebuild yield the slots it needs;
- the in-flight request (workers/engine/ticket.py), what it tells the worker
  (`HostEvents`) and its counters (`HostStats`), both in workers/engine/host_state.py.
Its collaborators have state of their own: the loop bridge (the thread, the futures, aborting),
the stall watchdog (workers/engine/watchdog.py) and the adapter cache (workers/engine/lora.py).
One request's run (admit, gate its adapter, run, account for the outcome) is
workers/engine/ticket_run.py; this module offers the thread-safe entry points.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable

from app.requests.adapters import AdapterRef
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.admission import Admission
from workers.engine.bridge import STALLED, Aborted, HandedBack, LoopBridge, Preempted
from workers.engine.host_state import HostEvents, HostState, HostStats
from workers.engine.lora import AdapterCache
from workers.engine.output import EngineOutput
from workers.engine.pending import Pending
from workers.engine.recovery import Recovery
from workers.engine.slot import EngineFactory, EngineSlot
from workers.engine.ticket import Ticket
from workers.engine.ticket_run import TicketRuns
from workers.engine.tier_gate import TierGate
from workers.engine.watchdog import StallWatchdog, Watched
from workers.engine.token_tap import TokenTap

__all__ = ["Aborted", "EngineFactory", "EngineHost", "HandedBack", "HostEvents", "HostStats",
           "Pending", "Preempted"]

log = logging.getLogger("vigil.engine")


class EngineHost:
    """Owns the warm engine. Thread-safe entry points: generate, abort_requests, refuse_new,
    drain, freeze, pause, resume, abort_in_flight, preload, restart_with_canary, snapshot,
    shutdown."""

    def __init__(self, factory: EngineFactory, *, idle_cleanup: float,
                 events: HostEvents | None = None,
                 clock: Callable[[], float] = time.monotonic, shutdown_timeout: float = 30.0,
                 death_limit: int = 3, stall_timeout: float = 0.0,
                 engine_start_timeout: float = 900.0, freeze_heap: bool = False):
        """`events` is what the host tells and asks its worker (HostEvents: changes, the fatal
        end, failures and successes proven by traffic, whether another worker serves a model,
        the memory plan of a start). `freeze_heap`: the process' heap is frozen while an engine
        is up (app/heap.py: a worker of a real model engine)."""
        events = events or HostEvents()
        self._st = HostState(events, clock, death_limit)
        self._idle_cleanup = idle_cleanup
        self._slot = EngineSlot(self._st, factory, shutdown_timeout=shutdown_timeout,
                                engine_start_timeout=engine_start_timeout, freeze=freeze_heap)
        self._recovery = Recovery(self._st, self._slot)
        self._admission = Admission(self._st, self._slot, self._recovery)
        # collaborators with state of their own
        self._bridge = LoopBridge(on_failure=events.failure, on_success=events.success)
        self._loop = self._bridge.loop
        self._tiers = TierGate(self._st, self._bridge)
        self._adapters = AdapterCache()
        self._runs = TicketRuns(self._st, self._admission, self._tiers, self._recovery,
                                self._adapters)
        self._watchdog = (StallWatchdog(stall_timeout, self._watched, self._stalled, clock)
                          if stall_timeout > 0 else None)

    @property
    def stats(self) -> HostStats:
        """The host's counters (loads, evictions, restarts, peak in flight, served, poisoned,
        canaries)."""
        return self._st.stats

    # -- lifecycle (any thread) -----------------------------------------------------------------
    def start(self) -> "EngineHost":
        """Start the loop thread (cheap; no engine is built here)."""
        self._bridge.start(self._init)
        return self

    async def _init(self) -> None:
        self._st.bind(self._loop)
        if self._idle_cleanup > 0:
            self._loop.create_task(self._slot.idle_reaper(self._idle_cleanup))
        if self._watchdog is not None:
            self._loop.create_task(self._watchdog.run())

    def shutdown(self, timeout: float | None = None) -> None:
        """Shut the engine down (its processes exit) and stop the loop thread. Idempotent."""
        if not self._bridge.running:
            return
        timeout = self._slot.shutdown_timeout if timeout is None else timeout
        try:
            self._bridge.run(self._slot.evict_now("shutdown"), timeout + 5)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.warning("engine shutdown did not finish cleanly: %s", e)
        self._bridge.stop()

    # -- entry points for task threads --------------------------------------------------------
    def generate(self, req: GenerateRequest, spec: ModelSpec, engine_request_id: str,
                 timeout: float, adapter: AdapterRef | None = None, tap: TokenTap | None = None,
                 preemptible: bool = False) -> EngineOutput:
        """Run one request to completion in the warm engine (loading it if needed).

        Raises a classified VigilError; HandedBack / Aborted as the bridge says. `timeout` bounds
        the generation inside a running engine only, from the moment the request holds its
        batch seats (the tier gate: it waits for them outside vLLM): past it the request is
        aborted in the engine and TransientError(wedged) is raised (wedge evidence). Waiting for
        the engine (the current model's requests draining, a load, a recovery) is bounded apart,
        by one more `timeout` plus `start_bound`, not counting the time spent waiting for batch
        slots: past that the attempt is given up as TransientError(engine_restarting), which is
        no evidence of a wedge. With a `tap` (workers/streaming.py) the tokens are streamed as
        they come, and every run (a re-run after an engine death too) continues from the tokens
        the tap holds. A `preemptible` (bulk) request may yield its slot to an interactive one
        at a token boundary: it then raises Preempted, its tokens in its tap (the tier gate)."""
        return self.result(self.submit(req, spec, engine_request_id, timeout, adapter, tap,
                                       preemptible))

    def submit(self, req: GenerateRequest, spec: ModelSpec, engine_request_id: str,
               timeout: float, adapter: AdapterRef | None = None, tap: TokenTap | None = None,
               preemptible: bool = False) -> "Pending":
        """Start `generate`'s request without waiting for it: many requests of one thread run
        together this way (a message carrying many, workers/service.py); `result` waits.
        Raises HandedBack when the host takes nothing new."""
        arrived = self._st.clock()
        t = Ticket(req, engine_request_id, adapter=adapter, timeout=timeout, tap=tap,
                   preemptible=preemptible)
        fut = self._bridge.submit(lambda: self._runs.generate(t, spec, arrived),
                                  engine_request_id)
        bound = timeout + timeout + self.start_bound(spec)
        return Pending(fut, engine_request_id, time.monotonic() + bound, bound, t)

    def submit_many(self, runs: list[tuple]) -> list["Pending"]:
        """`submit` for each tuple of its arguments (req, spec, engine_request_id, timeout,
        adapter, tap, preemptible), handed to the loop in one hop; the Pendings in order.
        Raises HandedBack when the host takes nothing new (none is started then)."""
        arrived = self._st.clock()
        tickets = [Ticket(r[0], r[2], adapter=r[4], timeout=r[3], tap=r[5], preemptible=r[6])
                   for r in runs]
        calls = [((lambda t=t, r=r: self._runs.generate(t, r[1], arrived)), r[2])
                 for t, r in zip(tickets, runs)]
        futures = self._bridge.submit_many(calls)
        now = time.monotonic()
        out = []
        for r, t, fut in zip(runs, tickets, futures):
            bound = r[3] + r[3] + self.start_bound(r[1])
            out.append(Pending(fut, r[2], now + bound, bound, t))
        return out

    def result(self, pending: "Pending") -> EngineOutput:
        """The output of a `submit`ted request, raised as `generate` raises it, within the bound
        `generate` gives it counted from its submit (its deadline moves on while it waits for
        batch seats)."""
        pending.settle()
        return self._bridge.wait(pending.future, pending.engine_request_id,
                                 max(0.0, pending.deadline - time.monotonic()), pending.bound)

    def start_bound(self, spec: ModelSpec) -> float:
        """How long an engine start of `spec` may take (workers/engine/slot.py)."""
        return self._slot.start_bound(spec)

    def abort_requests(self, request_ids: set[str]) -> int:
        """Abort the named requests (Vigil request ids) wherever they are in this host: in the
        engine, waiting for it, or parked as suspects. Their callers get `Aborted`. Returns how
        many it found."""
        return self._bridge.cancel_requests(request_ids)

    def request_ids(self) -> set[str]:
        """The Vigil request ids this host is running or admitting now."""
        return self._bridge.request_ids()

    @property
    def accepting(self) -> bool:
        """False while paused (quarantined) or stopping: deliveries go back to the queue."""
        return self._bridge.accepting

    @property
    def draining(self) -> bool:
        """True once the worker is stopping: no new request enters the engine."""
        return self._bridge.draining

    def refuse_new(self) -> None:
        """Stop taking requests (callers get HandedBack); those in flight carry on."""
        self._bridge.draining = True

    def drain(self) -> int:
        """Stop taking requests and abort every one in flight (their callers get HandedBack);
        the worker has handed them back to the queue. Returns how many were aborted."""
        self._bridge.draining = True
        return self._bridge.cancel_all()

    def freeze(self, timeout: float) -> int:
        """A drain's first step, once the host refuses new requests: stop the engine making
        tokens and read every streamed request's latest tokens into its tap (the engine's
        `freeze`), so that a flush after it writes every token made and none is made after it
        (workers/held.py). The requests stay in the engine, to be aborted by the hand-back.
        Bounded by `timeout` seconds; returns how many runs were read (0: no live engine, or
        one that does not freeze). Never raises: a freeze that fails is logged, and whatever the
        engine makes after the flush then counts as discarded."""
        eng = self._st.engine
        freeze = getattr(eng, "freeze", None)
        if freeze is None or getattr(eng, "dead", True):
            return 0
        try:
            return self._bridge.run(freeze(timeout), timeout + 5)
        except Exception as e:  # a dead engine (its process group signalled too) is expected
            log.log(logging.INFO if getattr(eng, "dead", False) else logging.WARNING,
                    "could not freeze the engine for the drain (%s: %s); its requests are "
                    "read and handed back anyway", type(e).__name__, e)
            return 0

    def pause(self) -> None:
        """Take no new requests (callers get HandedBack) until `resume()`."""
        self._bridge.paused = True
        self._st.events.changed()

    def resume(self) -> None:
        """Take requests again (after a passing canary)."""
        self._bridge.paused = False
        self._st.events.changed()

    def abort_in_flight(self) -> int:
        """Abort every request in the engine or waiting for it; their callers get HandedBack
        (the caller has republished them). Call after `pause()`. Returns how many."""
        return self._bridge.cancel_all()

    def preload(self, spec: ModelSpec, timeout: float) -> None:
        """Load `spec`'s engine now (worker start for configured pools)."""
        st = self._st

        async def _load():
            await self._admission.acquire(spec, st.clock())
            async with st.cond:
                st.count_out(used=False)
                st.cond.notify_all()

        self._bridge.run(_load(), timeout)

    def restart_with_canary(self, spec: ModelSpec, timeout: float) -> tuple[bool, str]:
        """Kill the current engine (a wedged one cannot shut down politely), start a fresh one
        for `spec` (bounded by `start_bound`) and run the canary on it (bounded by `timeout`).
        Returns (passed, why not)."""
        bound = self.start_bound(spec)
        try:
            return self._bridge.run(self._recovery.restart_with_canary(spec, timeout),
                                    bound + timeout)
        except concurrent.futures.TimeoutError:
            return False, (f"the engine for {spec.name} did not start and answer its canary "
                           f"within {bound:g} s + {timeout:g} s")

    @property
    def waiting_for_seats(self) -> int:
        """Requests admitted and waiting for engine batch seats, outside the engine."""
        return self._tiers.waiting

    @property
    def stalls(self) -> int:
        """Stalls the watchdog declared."""
        return self._watchdog.stalls if self._watchdog is not None else 0

    def snapshot(self) -> dict:
        """A consistent-enough view for the heartbeat: model, state, counters."""
        st, stats = self._st, self._st.stats
        steps, outputs = st.steps()
        return {
            "model": st.model or "",
            "engine_state": st.state,
            "in_flight": st.inflight,
            "peak_in_flight": stats.peak_in_flight,
            "engine_loads": stats.loads,
            "engine_evictions": stats.evictions,
            "engine_restarts": stats.restarts,
            "served": stats.served,
            "death_streak": st.streak.count,
            "poisoned": stats.poisoned,
            "recovering": int(st.recovery is not None),
            "paused": int(self._bridge.paused),
            "lora_loads": self._adapters.loads, "lora_evictions": self._adapters.evictions,
            "lora_refused": self._adapters.refused,
            "warm_adapters": ",".join(self._adapters.warm),
            "stalls": self.stalls, "preemptions": stats.preemptions,
            "engine_steps": steps, "engine_step_outputs": outputs,
        }

    def child_pids(self) -> list[tuple[int, float]]:
        """Processes of the current engine, for the orphan guard."""
        eng = self._st.engine
        return eng.child_pids() if eng is not None else []

    # -- stalls (the watchdog's view and its verdict) ---------------------------------------------
    def _watched(self) -> Watched:
        st = self._st
        return Watched(st.inflight, getattr(st.engine, "progress", None), st.busy_since,
                       st.last_used, st.recovery is not None or st.state == "loading")

    def _stalled(self, reason: str) -> None:
        log.error("engine for %s stalled: %s", self._st.model, reason)
        self._bridge.cancel_all(STALLED, reason)  # callers get TransientError(wedged)
        self._st.events.changed()
