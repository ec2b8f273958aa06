"""A worker's own side of the health ledger: report what traffic proves, quarantine itself at the
threshold, come back only through a canary (docs/architecture.md, "Wedge detection and
quarantine"; app/state/health.py).

Reports come from task threads (a request that ended `wedged`, a completed generation). A
success costs a Redis call only while the worker is SUSPECT: the local mirror of the ledger
knows when there is a streak to end (only this worker writes its failures).

Quarantine, on its own thread, once:
1. pause the engine host (deliveries go back to the queue untouched) and cancel this worker's
   pool consumers (Celery `cancel_consumer`);
2. hand every request it holds back to the queue (same id, next dispatch) and abort them in the
   engine: they land on other workers now, not after a timeout;
3. RESTARTING: kill the engine, start a fresh one, run the canary;
4. canary passed -> HEALTHY: resume and consume again (`add_consumer`); failed -> try again with
   backoff; after `max_canary_failures` in a row the worker leaves (WorkerFatalError).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from app.errors import CANARY_FAILED, TransientError, WorkerFatalError
from app.requests.models import ModelSpec
from app.state.health import HEALTHY, QUARANTINED, RESTARTING, SUSPECT, HealthLedger
from workers.engine.host import EngineHost

log = logging.getLogger("vigil.health")
CANARY_BACKOFF_MAX_S = 60.0


@dataclass(frozen=True)
class QuarantineActions:
    """What a quarantine does to its worker, handed in by the worker runtime."""

    # The pools the worker consumes now (what to consume again after the canary).
    pools: Callable[[], list[str]]
    # Start (True) or stop (False) consuming these pools' queues.
    consume: Callable[[list[str], bool], None]
    # Publish every request the worker holds again and abort them in the engine: (requeued,
    # failed).
    hand_back: Callable[[], tuple[int, int]]
    # The model the canary runs on.
    canary_spec: Callable[[], ModelSpec]
    # The worker gives up and leaves (canaries kept failing).
    leave: Callable[[WorkerFatalError], None]


def canary_backoff(failures: int) -> float:
    """Seconds to wait after `failures` failed canaries in a row before the next engine restart:
    2, 4, 8... doubling, at most CANARY_BACKOFF_MAX_S."""
    return min(CANARY_BACKOFF_MAX_S, 2.0 ** failures)


class WorkerHealth:
    """Reports to this worker's ledger and runs its quarantine (module docstring)."""

    def __init__(self, ledger: HealthLedger, instance_id: int, name: str, host: EngineHost,
                 actions: QuarantineActions, *, on_change: Callable[[], None],
                 canary_timeout: float, max_canary_failures: int,
                 clock: Callable[[], float] = time.time,
                 pause: Callable[[float], object] | None = None):
        """`clock` stamps the ledger's reports (wall-clock seconds); `pause(s)` waits between
        failed canaries (default: a wait that `close` cuts short). Both injectable for tests."""
        self.ledger = ledger
        self.instance_id = instance_id
        self.name = name
        self.host = host
        self.actions = actions
        self._on_change = on_change
        self.canary_timeout = canary_timeout
        self.max_canary_failures = max_canary_failures
        self.state = HEALTHY
        self.streak = 0
        self.reason = ""
        self.quarantines = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._clock = clock
        self._pause = pause or self._stop.wait
        self._pools: list[str] = []

    def fields(self) -> dict:
        """For the heartbeat record."""
        return {"health_state": self.state, "health_streak": self.streak,
                "health_reason": self.reason, "quarantines": self.quarantines}

    def failure(self, reason: str) -> None:
        """A request this worker held ended `wedged` (timeout or stall). Never raises."""
        try:
            state, streak, became = self.ledger.failure(self.instance_id, self._clock(), reason)
        except TransientError as e:
            log.warning("could not report a failure to the health ledger: %s", e)
            return
        with self._lock:
            self.state, self.streak, self.reason = state, streak, reason
        log.warning("health: %s (streak %d): %s", state, streak, reason)
        self._on_change()
        if became:
            self.quarantine(reason)

    def success(self) -> None:
        """A generation completed. Ends a streak (one Redis call, only while SUSPECT)."""
        if self.state != SUSPECT:
            return
        try:
            state = self.ledger.success(self.instance_id, self._clock())
        except TransientError as e:
            log.warning("could not report a success to the health ledger: %s", e)
            return
        with self._lock:
            if self.state == SUSPECT:
                self.state, self.streak = state, 0
        self._on_change()

    def quarantine(self, reason: str) -> None:
        """Start the quarantine (once; a second call while it runs does nothing)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self.state = QUARANTINED
            self.quarantines += 1
            self._thread = threading.Thread(target=self._run, args=(reason,),
                                             name="vigil-quarantine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop waiting between canaries (worker shutdown)."""
        self._stop.set()

    # -- the quarantine ---------------------------------------------------------------------------
    def _run(self, reason: str) -> None:
        log.error("worker %s QUARANTINED: %s", self.name, reason)
        self.host.pause()
        self._pools = self.actions.pools()  # what to consume again after
        self.actions.consume(self._pools, False)
        try:
            requeued, failed = self.actions.hand_back()
            log.warning("quarantine: handed back %d request(s), failed %d", requeued, failed)
        except Exception as e:  # the reaper and timeouts remain the backstop
            log.error("quarantine: handing back failed: %s", e)
        self._on_change()
        failures = 0
        while not self._stop.is_set():
            self._set(RESTARTING)
            try:
                self.ledger.restarting(self.instance_id, self._clock())
            except TransientError as e:
                log.warning("quarantine: %s", e)
            ok, why = self.host.restart_with_canary(self.actions.canary_spec(),
                                                    self.canary_timeout)
            try:
                state, failures = self.ledger.canary(self.instance_id, self._clock(), ok, why)
            except TransientError as e:
                log.warning("quarantine: %s", e)
                state, failures = (HEALTHY, 0) if ok else (QUARANTINED, failures + 1)
            if ok:
                break
            self._set(QUARANTINED, why)
            log.error("quarantine: canary %d failed: %s", failures, why)
            if failures >= self.max_canary_failures:
                self.actions.leave(WorkerFatalError.of(CANARY_FAILED, (
                    f"{failures} canary generations failed in a row after a quarantine "
                    f"({why})")))
                return
            self._pause(canary_backoff(failures))
        if self._stop.is_set():
            return
        with self._lock:
            self.state, self.streak, self.reason = HEALTHY, 0, ""
        self.host.resume()
        self.actions.consume(self._pools, True)
        self._on_change()
        log.warning("worker %s passed its canary: HEALTHY, consuming again", self.name)

    def _set(self, state: str, reason: str | None = None) -> None:
        with self._lock:
            self.state = state
            if reason is not None:
                self.reason = reason
        self._on_change()
