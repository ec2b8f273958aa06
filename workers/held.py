"""What a worker does with the requests it holds when it cannot finish them here.

The policy half of a worker process (workers/runtime.py is the wiring): the worker hands its
requests back to the queue when it stops (SIGTERM), quarantines or leaves broken; after Redis
was away it hands back the ones its in-flight set names but it no longer holds; after every
heartbeat it aborts, in the engine, the ones that ended elsewhere. Handing back is the reaper's
rule applied by the worker to itself (app/fleet/handback.py): same id, the next dispatch, ended
instead when out of attempts or time.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from celery.worker import state as worker_state

from app.control import ControlBus
from app.errors import WorkerFatalError
from app.fleet.handback import Republish, hand_back_all, hand_back_one
from app.state.store import RequestStore
from app.state.transport import arriving
from app.task_names import GENERATE_MANY
from workers.engine.host import EngineHost
from workers.stream_sink import StreamSink

log = logging.getLogger("vigil.worker")


def carried(request) -> list[str]:
    """The request ids a Celery request of vigil.generate_many carries ([] for any other)."""
    if getattr(request, "name", None) != GENERATE_MANY and \
            getattr(getattr(request, "task", None), "name", None) != GENERATE_MANY:
        return []
    items = (getattr(request, "kwargs", None) or {}).get("requests")
    return [i["id"] for i in items if isinstance(i, dict) and isinstance(i.get("id"), str)] \
        if isinstance(items, list) else []

# A drain's bounds: how long the engine may take to stop making tokens (it finishes the step it
# is in), and how long the token streams may take to be written before the hand-back.
FREEZE_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0

# Exit status of a worker that left because it is broken (repeated engine death, lost CUDA
# context): non-zero, so its supervisor restarts it (EX_SOFTWARE).
EXIT_WORKER_BROKEN = 70


@dataclass
class HeldRequests:
    """One worker's rules for the requests it holds (module docstring). Built by the runtime
    with the worker's collaborators; `pools` says what the worker consumes now,
    `stop_heartbeat` stops its heartbeat thread without unregistering."""

    name: str
    instance_id: int
    store: RequestStore
    host: EngineHost
    streams: StreamSink | None
    republish: Republish
    backend: Any
    bus: ControlBus
    max_attempts: int
    pools: Callable[[], list[str]]
    stop_heartbeat: Callable[[], None]
    max_drains: int = 0
    leaving: WorkerFatalError | None = None
    aborted: int = 0
    frozen: int = 0  # runs read out of the frozen engine by the last drain
    unwritten: int = 0  # tokens its taps still held unwritten when the last hand-back began

    def hand_back_held(self, drain: bool = False) -> tuple[int, int]:
        """Publish every request this worker holds again (same id, next dispatch; failed when
        out of attempts or time) and abort them in the engine, whose callers drop their stale
        copies; their token streams are written first, so the next attempts continue them. The
        engine host must already refuse new requests. Returns (requeued, failed).

        A `drain` (the worker stops: SIGTERM) loses no token and uses no attempt: the engine is
        frozen first (it finishes its step and makes no more tokens) and every streamed
        request's latest tokens are read out of vLLM into its tap, every tap is written, and
        only then are the requests handed back, `drained` (app/fleet/handback.py: the attempt
        refunded, VIGIL_MAX_DRAINS times at most) and aborted. Without it (a quarantine, whose
        engine may be wedged) what was read so far is written, the rest is made again."""
        if drain:
            self.frozen = self.host.freeze(FREEZE_TIMEOUT_S)
        if self.streams is not None:  # what they generated so far: the next attempts go on
            self.unwritten = self.streams.write_all(WRITE_TIMEOUT_S)
            if self.unwritten:
                log.warning("%d generated token(s) could not be written to their streams "
                            "before the hand-back", self.unwritten)
        done = hand_back_all(self.store, time.time(), self.instance_id, self.republish,
                             self.backend, self.max_attempts,
                             self.max_drains if drain else None)
        self.aborted = self.host.abort_in_flight()
        return done

    def abort_ended(self) -> int:
        """Abort, in the engine, every request this worker runs whose record has ended elsewhere
        (the deadline sweep, a job delete, the reaper's decision) or is gone: nobody will read
        what it generates. Run after each heartbeat, so such work stops within one heartbeat
        interval. Returns how many it aborted."""
        running = self.host.request_ids()
        if not running:
            return 0
        ended = set(self.store.ended(sorted(running)))
        if not ended:
            return 0
        n = self.host.abort_requests(ended)
        if n:
            log.warning("aborted %d request(s) that ended elsewhere while they ran", n)
        return n

    def reclaim_orphans(self) -> int:
        """After Redis was away or restarted: hand back (same id, next dispatch) every request
        this worker's in-flight set names but the worker does not hold. Celery's consumer drops
        the messages it held but had not started (a retry's delayed message) when it loses the
        broker, and a Redis crash can roll a finished request back to RUNNING here; either would
        otherwise wait for the visibility timeout or the deadline. Returns how many."""
        listed = self.store.inflight_ids(self.instance_id)  # before the local view: see below
        # A delivery is added to the set as the consumer takes it, and listed in `arriving()`
        # from before that write until Celery has it as reserved, scheduled or active
        # (app/state/transport.py). Read in this order, one that arrives now is missing from
        # `listed`, in `arriving`, or (if it moved on in between) in Celery's groups.
        held = set(arriving())
        for group in (worker_state.active_requests, worker_state.reserved_requests,
                      worker_state.scheduled_requests):
            for r in tuple(group):
                held.add(r.id)
                held.update(carried(r))  # a message of many requests holds each of them
        n = 0
        for rid in listed:
            if rid in held:
                continue
            try:
                outcome = hand_back_one(self.store, time.time(), rid, self.instance_id,
                                        self.republish, self.backend, self.max_attempts)
            except Exception as e:  # the next Redis return tries again
                log.warning("could not hand back orphan %s: %s", rid, e)
                continue
            n += outcome in ("requeued", "failed")
        if n:
            log.warning("handed back %d request(s) this worker no longer held after Redis came "
                        "back", n)
        return n

    def hand_back(self, drain: bool = False) -> tuple[int, int]:
        """Graceful stop (SIGTERM, `drain`) or a broken worker's exit: stop heartbeating,
        publish every request this worker holds again (same id, next dispatch) so another
        worker takes it now instead of after the reap timeout, abort them in the engine, and
        unregister. A drain freezes the engine and writes every token first, and gives the
        attempts back (`hand_back_held`). Returns (requeued, failed)."""
        # Order matters: refuse new deliveries first (they go back on the queue untouched), then
        # freeze the engine and write what it made, then republish what is held, then abort it
        # in the engine. A delivery that slipped in between is still RUNNING here when
        # aborted, and retries itself (service.serve).
        t0 = time.monotonic()
        self.host.refuse_new()
        self.stop_heartbeat()
        done = self.hand_back_held(drain)
        self.store.workers.drop(self.instance_id)
        log.warning("worker %s stopping: handed back %d request(s) (%d aborted in the engine, "
                    "%d read from it frozen, %d token(s) left unwritten), failed %d out of "
                    "attempts or time, in %.2f s", self.name, done[0], self.aborted,
                    self.frozen, self.unwritten, done[1], time.monotonic() - t0)
        return done

    def leave(self, err: WorkerFatalError) -> None:
        """A broken worker leaves (docs/failure-modes.md): stop consuming, hand every request it
        holds back to the queue at once (same id, next dispatch), and stop the worker with a
        non-zero status for its supervisor to restart it. Called once, off the engine loop."""
        self.leaving = err
        log.critical("worker %s is broken and leaves: %s", self.name, err)
        self.consume_pools(self.pools(), False)  # refuse_new() below sends the rest back anyway
        try:
            self.hand_back()
        except Exception as e:  # the reaper remains the backstop
            log.error("handing back in-flight requests failed: %s", e)
        worker_state.should_stop = EXIT_WORKER_BROKEN

    def consume_pools(self, pools: list[str], on: bool) -> None:
        """Make this worker consume (on) or stop consuming (off) every queue of `pools`, its own
        and its jobs', through Celery's control bus. A pool that fails is logged and skipped:
        beat's health tick and reconcile repair consumers from outside."""
        for pool in pools:
            try:
                for queue in self.store.pool_queues(pool):
                    self.bus.set_consuming(self.name, queue, on)
            except Exception as e:
                log.warning("could not %s consuming %s: %s", "resume" if on else "stop", pool, e)
