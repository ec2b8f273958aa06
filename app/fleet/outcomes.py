"""Ending a request: the one way any part of Vigil ends one.

`end_request` does the three things an end takes, together: the set-once finish in Redis (the
first outcome written wins; app/state/store.py), the `vigil_requests` metric when this call's
outcome won, and Celery's result backend, so a caller waiting in `r.get()` wakes with the stored
outcome. The worker serving a request, the deadline sweep, the reaper and a stopping worker
handing back, ending a job, a message dropped as malformed, an expired message: all end
requests through it.

Who tells the backend: a task's own return value reaches Celery's backend by itself, so the
worker serving a request passes no backend. Housekeeping passes one and tells it only when its
end won (a worker's result written first is that worker's to tell). Where Celery itself stored
something else or nothing (an expired message it revoked, a malformed message it never ran),
the caller asks to tell the stored outcome whoever wrote it (`tell_always`).
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

from app import metrics
from app.errors import VigilError, error_from_record
from app.state.keys import FAILED
from app.state.store import Outcome, RequestStore

log = logging.getLogger("vigil.outcomes")

# The instance id an end is attributed to when no worker ends it (beat's sweeps, job deletes).
SWEEPER_INSTANCE = 0


class Backend(Protocol):
    """What `end_request` needs of Celery's result backend (`app.backend`)."""

    def mark_as_failure(self, task_id: str, exc: BaseException) -> object: ...

    def mark_as_done(self, task_id: str, result: dict) -> object: ...


def end_request(store: RequestStore, request_id: str, *, error: VigilError | None = None,
                result: dict | None = None, now: float | None = None,
                instance: int | str = SWEEPER_INSTANCE, pool: str | None = None,
                backend: Backend | None = None, tell_always: bool = False
                ) -> tuple[bool, Outcome]:
    """End a request with `result` (SUCCEEDED) or `error` (FAILED), once.

    Returns (won, stored outcome): `won` is False when the request had already ended, and the
    stored outcome is then the earlier one. A won end is counted in `vigil_requests` under
    `pool` (read from the record when not given). With `backend`, the stored outcome is written
    to Celery's result backend when this end won, or always with `tell_always` (a backend that
    cannot be written is logged, not raised: a waiting `r.get()` also reads the record). Raises
    TransientError(redis_unavailable) when Redis cannot be reached (nothing was written)."""
    if (error is None) == (result is None):
        raise ValueError("end a request with exactly one of error or result")
    now = time.time() if now is None else now
    if result is not None:
        won, stored = store.finish(request_id, instance, now, result=result)
    else:
        won, stored = store.finish(request_id, instance, now, error_kind=type(error).__name__,
                                   error=str(error))
    if won:
        metrics.request_ended(pool if pool is not None else _pool_of(store, request_id),
                              stored.status, stored.error)
    if backend is not None and (won or tell_always):
        try:
            tell_backend(backend, request_id, stored)
        except Exception as e:  # the record is the truth: a waiting r.get() reads it too
            log.warning("request %s ended, but Celery's result backend could not be told: %s",
                        request_id, e)
    return won, stored


def tell_backend(backend: Backend, request_id: str, stored: Outcome) -> None:
    """Write a stored outcome to Celery's result backend: the error rebuilt as its Vigil class,
    or the result."""
    if stored.status == FAILED:
        backend.mark_as_failure(request_id, error_from_record(stored.error_kind, stored.error))
    elif stored.result is not None:
        backend.mark_as_done(request_id, stored.result)


def _pool_of(store: RequestStore, request_id: str) -> str:
    """A record's pool for a metrics label ('' when it cannot be read)."""
    try:
        return store.pool_of(request_id)
    except Exception:  # a metrics label is not worth failing an end over
        return ""
