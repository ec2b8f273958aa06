"""The deadline sweep (beat, every VIGIL_DEADLINE_SWEEP_INTERVAL): every open request past its
deadline ends `deadline_exceeded`, whatever else failed (no worker, a worker stuck, a lost
message). A function of `(store, now)`: chunked reads, per-item failure isolation, a lock so a
second beat never sweeps twice.
"""
from __future__ import annotations

import logging

from app.errors import DEADLINE_EXCEEDED, TerminalError, TransientError
from app.fleet.outcomes import Backend, end_request
from app.fleet.timed_lock import timed_lock
from app.state.jobs import unserved_reason
from app.state.store import RequestStore

log = logging.getLogger("vigil.housekeeping")

SWEEP_CHUNK = 100
DEADLINE_SWEEP_LOCK = "deadline_sweep"


def sweep_deadlines(store: RequestStore, now: float, backend: Backend | None, *,
                    chunk: int = SWEEP_CHUNK, lock_ttl_s: float = 60.0,
                    max_items: int | None = None) -> int:
    """Fail every open request whose deadline is before `now` with deadline_exceeded.

    Reads the deadline index ~`chunk` ids at a time (memory stays bounded whatever the backlog)
    and ends each through `end_request` (a worker's result written first still wins; each end
    this sweep won is told to `backend`, so a waiting `r.get()` wakes). A request whose pool no
    worker could take says why (the reconcile's reason). Returns how many it failed; 0 without
    acting when another sweep holds the lock."""
    with timed_lock(store, DEADLINE_SWEEP_LOCK, lock_ttl_s, "deadline_sweep") as held:
        if not held:
            return 0
        failed = 0
        while max_items is None or failed < max_items:
            ids = store.past_deadline(now, chunk)
            if not ids:
                break
            for rid in ids:
                err = TerminalError.of(DEADLINE_EXCEEDED, "the request did not end before its "
                                       "deadline (no worker finished it in time)"
                                       + _unserved_because(store, rid))
                try:
                    won, _ = end_request(store, rid, error=err, now=now, backend=backend)
                except TransientError as e:  # Redis blip: the next sweep picks the rest up
                    log.warning("deadline sweep stopped early: %s", e)
                    return failed
                failed += won
    if failed:
        log.warning("deadline sweep failed %d request(s) with deadline_exceeded", failed)
    return failed


def _unserved_because(store: RequestStore, request_id: str) -> str:
    """'; <the reconcile's reason>' when the request's pool had no worker that could take it."""
    try:
        pool = store.pool_of(request_id)
        reason = unserved_reason(store.r, pool) if pool else ""
    except Exception:  # the reason is a courtesy; the failure itself must go through
        return ""
    return f"; {reason}" if reason else ""
