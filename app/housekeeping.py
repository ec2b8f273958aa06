"""Beat housekeeping as plain functions of `(store, now)`: injectable clock, chunked scans,
per-item failure isolation, a lock so a second beat never double-acts.

So far: the deadline sweep. (The reaper, pool reconcile and job leases are planned: DESIGN.md
sections 5 and 6.)
"""
from __future__ import annotations

import logging
import uuid
from typing import Callable

from app.errors import DEADLINE_EXCEEDED, TerminalError, TransientError, VigilError
from app.store import RequestStore

log = logging.getLogger("vigil.housekeeping")

SWEEP_CHUNK = 100
DEADLINE_SWEEP_LOCK = "deadline_sweep"
SWEEPER_INSTANCE = 0  # finishes are attributed to no worker instance

OnFailed = Callable[[str, VigilError], None]


def sweep_deadlines(store: RequestStore, now: float, on_failed: OnFailed, *,
                    chunk: int = SWEEP_CHUNK, lock_ttl_s: float = 60.0,
                    max_items: int | None = None) -> int:
    """Fail every non-terminal request whose deadline is before `now` with deadline_exceeded.

    Reads the deadline index ~`chunk` ids at a time (memory stays bounded whatever the backlog),
    finishes each through the set-once script (a worker's result written first still wins), and
    calls `on_failed(request_id, error)` for each request this sweep failed, so the Celery result
    backend can tell a waiting `r.get()`. Returns how many it failed; 0 without acting when
    another sweep holds the lock.
    """
    owner = uuid.uuid4().hex
    if not store.try_lock(DEADLINE_SWEEP_LOCK, owner, lock_ttl_s):
        return 0
    failed = 0
    try:
        while max_items is None or failed < max_items:
            ids = store.past_deadline(now, chunk)
            if not ids:
                break
            for rid in ids:
                err = TerminalError.of(DEADLINE_EXCEEDED, "the request did not end before its "
                                       "deadline (no worker finished it in time)")
                try:
                    won, stored = store.finish(rid, SWEEPER_INSTANCE, now,
                                               error_kind=type(err).__name__, error=str(err))
                except TransientError as e:  # Redis blip: the next sweep picks the rest up
                    log.warning("deadline sweep stopped early: %s", e)
                    return failed
                if won:
                    failed += 1
                    try:
                        on_failed(rid, err)
                    except Exception as e:  # one bad item must not stop the sweep
                        log.warning("deadline sweep: could not notify %s: %s", rid, e)
    finally:
        store.unlock(DEADLINE_SWEEP_LOCK, owner)
    if failed:
        log.warning("deadline sweep failed %d request(s) with deadline_exceeded", failed)
    return failed
