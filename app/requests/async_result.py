"""The result handle Vigil's app gives producers: `generate.delay(...)`, `app.AsyncResult(id)`.

Celery's AsyncResult, with two things added from Vigil's own record of the request:

- `info` of an unfinished request says where it waits and why (app/ops/request_view.py);
- `get()` never waits on something that cannot come, and keeps its job alive. Celery's `get` waits for the result
  backend's key; Vigil's record is written first, in the same step that decides the outcome.
  While `get` waits, it looks at the record every `RECORD_CHECK_S`: an ended record whose result
  never reached the backend (a Redis restart between the two writes) answers from the record,
  and a request Redis has no record of at all raises `request_lost` (TerminalError) instead of
  waiting for ever. A record can vanish only when Redis loses writes (a crash inside the AOF
  fsync window: docs/reliability.md) or after VIGIL_RESULT_TTL, when the result is gone too.
  The same look renews the request's job lease (at most once a minute per job and process), so a
  caller that only waits in `get()` is not taken for one that abandoned its job.
"""
from __future__ import annotations

import threading
import time

from celery import states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from app.errors import REQUEST_LOST, TerminalError, TransientError, error_from_record
from app.state.queues import DEFAULT_JOB
from app.state.store import Outcome, RequestStore

# How often a waiting `get()` looks at the request's record (one HMGET).
RECORD_CHECK_S = 5.0
# A waiting `get()` renews its request's job lease (app/fleet/jobs.py) at most this often per process
# and job: a caller that only waits is not abandoning its job.
LEASE_TOUCH_S = 60.0
_touched: dict[str, float] = {}
_touched_lock = threading.Lock()


class VigilAsyncResult(AsyncResult):
    """Celery's AsyncResult whose `info`, while the request has no outcome, is why_waiting's dict
    (where it waits and why) instead of Celery's None (PENDING) or the retry's exception (RETRY),
    and whose `get()` also watches Vigil's record (module docstring). `state`, `ready()` and
    `result` are Celery's own and cost nothing more."""

    @property
    def info(self):
        """The result or exception once ready; before that, why_waiting(id) (falling back to
        Celery's own value when Vigil has no record of the id)."""
        meta = self._get_task_meta()
        if meta["status"] in states.READY_STATES:
            return meta["result"]
        why_waiting = getattr(self.app, "vigil_why_waiting", None)
        waiting = why_waiting(self.id) if why_waiting is not None else None
        return waiting if waiting is not None else meta["result"]

    def get(self, timeout=None, propagate=True, interval=0.5, **kwargs):
        """Celery's `get` (same arguments), which also ends when Vigil's record ends: returns
        the result, or raises (propagate) / returns the request's VigilError; raises
        TerminalError `request_lost` when Redis has no record of the request."""
        # Celery's on_interval hook fires only once (a vine promise), so wait in slices and
        # look at the record between them.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            piece = RECORD_CHECK_S if left is None else max(0.0, min(RECORD_CHECK_S, left))
            try:
                return super().get(timeout=piece, propagate=propagate, interval=interval,
                                   **kwargs)
            except CeleryTimeoutError:
                if left is not None and left <= RECORD_CHECK_S:
                    raise
            ended = self._ended_record()
            if ended is None:
                continue
            if ended.status == "SUCCEEDED":
                return ended.result
            err = error_from_record(ended.error_kind, ended.error)
            if propagate:
                raise err
            return err

    def _ended_record(self) -> Outcome | None:
        """The record's outcome once it ended (the backend may never get it); None while it runs
        or Redis cannot be asked. Raises TerminalError request_lost when there is neither a
        record nor a result."""
        store = getattr(self.app, "vigil_store", None)
        if store is None:
            return None
        try:
            status, job, outcome = store.look(self.id)
            if job and outcome is None and status is not None:
                _renew_lease(store, job)
        except TransientError:
            return None  # Redis is away: keep waiting, Celery reconnects and so does this check
        if status is None:
            # Read the backend after the record: a result stored just before its record expired
            # must not be called lost.
            if self.backend.get_task_meta(self.id).get("status") in states.READY_STATES:
                return None
            self.backend.remove_pending_result(self)  # nothing will come: stop listening
            raise TerminalError.of(REQUEST_LOST, f"Redis has no record of request {self.id} "
                                   "(lost by a Redis crash inside the AOF fsync window, or "
                                   "expired after VIGIL_RESULT_TTL); submitting it again is safe")
        if outcome is None:
            return None
        self.backend.remove_pending_result(self)
        return outcome


def _renew_lease(store: RequestStore, job: str) -> None:
    """Renew `job`'s lease if this process has not done so for LEASE_TOUCH_S."""
    if job == DEFAULT_JOB:
        return
    now = time.monotonic()
    with _touched_lock:
        if now - _touched.get(job, -LEASE_TOUCH_S) < LEASE_TOUCH_S:
            return
        _touched[job] = now
    store.touch_job(job)
