"""The deadline sweep (beat, every VIGIL_DEADLINE_SWEEP_INTERVAL): every open request past its
deadline ends `deadline_exceeded`, whatever else failed (no worker, a worker stuck, a lost
message). A function of `(store, now)`: chunked reads, per-item failure isolation, a lock so a
second beat never sweeps twice.

The deadline watch (`DeadlineWatch`, a thread of `vigil housekeeper`) runs the same sweep when
the earliest deadline in the index comes, not on a period: a request no worker serves ends
within about a second of its deadline instead of up to a sweep interval after it. Beat's sweep
stays as the backstop (no housekeeper, or its watch stopped).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from app.errors import DEADLINE_EXCEEDED, TerminalError, TransientError
from app.fleet.outcomes import Backend, end_requests_failed
from app.fleet.timed_lock import timed_lock
from app.state.store import RequestStore

log = logging.getLogger("vigil.housekeeping")

SWEEP_CHUNK = 100
# The reconcile's reason is appended when the request's pool had no worker that could take it.
DEADLINE_ERROR = TerminalError.of(DEADLINE_EXCEEDED, "the request did not end before its deadline "
                                  "(no worker finished it in time)")
DEADLINE_SWEEP_LOCK = "deadline_sweep"


def sweep_deadlines(store: RequestStore, now: float, backend: Backend | None, *,
                    chunk: int = SWEEP_CHUNK, lock_ttl_s: float = 60.0,
                    max_items: int | None = None) -> int:
    """Fail every open request whose deadline is before `now` with deadline_exceeded.

    Reads the deadline index `chunk` ids at a time (memory stays bounded whatever the backlog)
    and ends each chunk at once through `end_requests_failed` (one script call for the chunk's
    set-once finishes: a worker's result written first still wins; the ends this sweep won are
    told to `backend` in one pipeline, so a waiting `r.get()` wakes). A request whose pool no
    worker could take says why (the reconcile's reason). Two round trips per chunk (three with
    Celery's backend). Returns how many it failed; 0 without acting when another sweep holds
    the lock."""
    with timed_lock(store, DEADLINE_SWEEP_LOCK, lock_ttl_s, "deadline_sweep") as held:
        if not held:
            return 0
        failed = 0
        while max_items is None or failed < max_items:
            try:
                ids = store.past_deadline(now, chunk)
                if not ids:
                    break
                failed += end_requests_failed(store, ids, DEADLINE_ERROR, now=now,
                                              backend=backend)
            except TransientError as e:  # Redis blip: the next sweep picks the rest up
                log.warning("deadline sweep stopped early: %s", e)
                return failed
    if failed:
        log.warning("deadline sweep failed %d request(s) with deadline_exceeded", failed)
    return failed


# The watch reads the earliest deadline at least this often: a request submitted meanwhile with
# an earlier deadline than the one it sleeps towards is found within this long.
WATCH_REREAD_S = 0.5
# After a sweep, the next look comes this soon (what it could not end, another sweep holding
# the lock or a Redis blip, is due still).
WATCH_AFTER_SWEEP_S = 0.05


class DeadlineWatch:
    """Ends requests at their deadline (module docstring): sleeps until the earliest
    `deadline_at` in the index, or WATCH_REREAD_S when that is later (or no request is open),
    and sweeps once it has passed. `clock` is wall time (deadlines are), injected for tests."""

    def __init__(self, store: RequestStore, backend: Backend | None, *,
                 clock: Callable[[], float] = time.time, reread_s: float = WATCH_REREAD_S):
        self._store = store
        self._backend = backend
        self._clock = clock
        self._reread_s = reread_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> float:
        """One look: sweep when the earliest deadline has passed. Returns how long to sleep
        before the next look: until the earliest deadline, at most the reread period."""
        now = self._clock()
        try:
            head = self._store.next_deadline()
            if head is not None and head <= now:
                sweep_deadlines(self._store, now, self._backend)
                return WATCH_AFTER_SWEEP_S
        except Exception as e:  # Redis away, or a bug: beat's sweep is the backstop
            log.warning("deadline watch: %s", e)
            return self._reread_s
        return self._reread_s if head is None else min(self._reread_s, max(0.0, head - now))

    def run(self) -> None:
        """Look, sleep, look again, until `stop`."""
        while not self._stop.is_set():
            self._stop.wait(self.step())

    def start(self) -> "DeadlineWatch":
        """Run the watch on a daemon thread of its own."""
        self._thread = threading.Thread(target=self.run, name="vigil-deadline-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the watch and wait for its thread (a sweep in progress ends first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
