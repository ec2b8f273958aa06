"""The deadline sweep (beat, every VIGIL_DEADLINE_SWEEP_INTERVAL): every open request past its
deadline ends `deadline_exceeded`, whatever else failed (no worker, a worker stuck, a lost
message). A function of `(store, now)`: chunked reads, per-item failure isolation, a lock so a
second beat never sweeps twice.
"""
from __future__ import annotations

import logging

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
