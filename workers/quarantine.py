"""A worker's own side of the health ledger: report what traffic proves, quarantine itself at the
threshold, come back only through a canary (DESIGN.md section 5, "Wedge"; app/state/health.py).

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
from typing import TYPE_CHECKING

from app.errors import CANARY_FAILED, TransientError, WorkerFatalError
from app.state.health import HEALTHY, QUARANTINED, RESTARTING, SUSPECT, HealthLedger
from app.state.queues import pool_queues

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime

log = logging.getLogger("vigil.health")
CANARY_BACKOFF_MAX_S = 60.0


class WorkerHealth:
    """Reports to this worker's ledger and runs its quarantine."""

    def __init__(self, rt: "WorkerRuntime", ledger: HealthLedger):
        self.rt = rt
        self.ledger = ledger
        self.state = HEALTHY
        self.streak = 0
        self.reason = ""
        self.quarantines = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pools: list[str] = []

    def fields(self) -> dict:
        """For the heartbeat record."""
        return {"health_state": self.state, "health_streak": self.streak,
                "health_reason": self.reason, "quarantines": self.quarantines}

    def failure(self, reason: str) -> None:
        """A request this worker held ended `wedged` (timeout or stall). Never raises."""
        try:
            state, streak, became = self.ledger.failure(self.rt.instance_id, time.time(), reason)
        except TransientError as e:
            log.warning("could not report a failure to the health ledger: %s", e)
            return
        with self._lock:
            self.state, self.streak, self.reason = state, streak, reason
        log.warning("health: %s (streak %d): %s", state, streak, reason)
        self.rt.heartbeat.poke()
        if became:
            self.quarantine(reason)

    def success(self) -> None:
        """A generation completed. Ends a streak (one Redis call, only while SUSPECT)."""
        if self.state != SUSPECT:
            return
        try:
            state = self.ledger.success(self.rt.instance_id, time.time())
        except TransientError as e:
            log.warning("could not report a success to the health ledger: %s", e)
            return
        with self._lock:
            if self.state == SUSPECT:
                self.state, self.streak = state, 0
        self.rt.heartbeat.poke()

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
        rt = self.rt
        log.error("worker %s QUARANTINED: %s", rt.name, reason)
        rt.host.pause()
        self._pools = rt.pools or list(rt.configured_pools)  # what to consume again after
        self._consume(False)
        try:
            requeued, failed = rt.hand_back_held()
            log.warning("quarantine: handed back %d request(s), failed %d", requeued, failed)
        except Exception as e:  # the reaper and timeouts remain the backstop
            log.error("quarantine: handing back failed: %s", e)
        rt.heartbeat.poke()
        failures = 0
        while not self._stop.is_set():
            self._set(RESTARTING)
            try:
                self.ledger.restarting(rt.instance_id, time.time())
            except TransientError as e:
                log.warning("quarantine: %s", e)
            ok, why = rt.host.restart_with_canary(rt.canary_spec(),
                                                  rt.settings.request_timeout)
            try:
                state, failures = self.ledger.canary(rt.instance_id, time.time(), ok, why)
            except TransientError as e:
                log.warning("quarantine: %s", e)
                state, failures = (HEALTHY, 0) if ok else (QUARANTINED, failures + 1)
            if ok:
                break
            self._set(QUARANTINED, why)
            log.error("quarantine: canary %d failed: %s", failures, why)
            if failures >= rt.settings.max_canary_failures:
                rt.leave(WorkerFatalError.of(CANARY_FAILED, (
                    f"{failures} canary generations failed in a row after a quarantine "
                    f"({why})")))
                return
            self._stop.wait(min(CANARY_BACKOFF_MAX_S, 2.0 ** failures))
        if self._stop.is_set():
            return
        with self._lock:
            self.state, self.streak, self.reason = HEALTHY, 0, ""
        rt.host.resume()
        self._consume(True)
        rt.heartbeat.poke()
        log.warning("worker %s passed its canary: HEALTHY, consuming again", rt.name)

    def _set(self, state: str, reason: str | None = None) -> None:
        with self._lock:
            self.state = state
            if reason is not None:
                self.reason = reason
        self.rt.heartbeat.poke()

    def _consume(self, on: bool) -> None:
        from app import app

        for pool in self._pools:
            try:
                for queue in pool_queues(self.rt.client, pool):
                    if on:
                        app.control.add_consumer(queue, destination=[self.rt.name], reply=False)
                    else:
                        app.control.cancel_consumer(queue, destination=[self.rt.name],
                                                    reply=False)
            except Exception as e:  # beat's health tick enforces the cancel from outside
                log.warning("quarantine: could not %s consuming %s: %s",
                            "resume" if on else "stop", pool, e)
