"""The lock every housekeeping run holds, timed: a second beat (or a second housekeeper) never
acts twice, and the metrics show how long each run held it or that it skipped."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from app import metrics
from app.state.store import RequestStore


@contextmanager
def timed_lock(store: RequestStore, lock: str, ttl_s: float, task: str) -> Iterator[bool]:
    """`store.locked(lock, ttl_s)`, counted in the housekeeping metrics: `task` skipped when
    another run holds the lock (yields False), else the time this run held it (yields True)."""
    with store.locked(lock, ttl_s) as held:
        if not held:
            metrics.housekeeping_skipped(task)
            yield False
            return
        started = time.monotonic()
        try:
            yield True
        finally:
            metrics.housekeeping_ran(task, time.monotonic() - started)
