"""Beat tasks (thin): each calls a `(store, now)` function in app/housekeeping.py."""
from __future__ import annotations

import time

from app import app
from app.celery_app import HOUSEKEEPING_QUEUE
from app.health import HealthLedger
from app.housekeeping import (enforce_quarantines, reap_workers, republish_request,
                              sweep_deadlines)
from app.settings import get_settings
from app.store import shared_store


def _tell_backend(request_id: str, err) -> None:
    """Store a request's failure in Celery's result backend, waking any `r.get()`."""
    app.backend.mark_as_failure(request_id, err)


@app.task(name="vigil.deadline_sweep", queue=HOUSEKEEPING_QUEUE, ignore_result=True,
          acks_late=True)
def deadline_sweep() -> int:
    """Fail every request past its deadline (deadline_exceeded); returns how many."""
    return sweep_deadlines(shared_store(), time.time(),
                           _tell_backend)


@app.task(name="vigil.reap_workers", queue=HOUSEKEEPING_QUEUE, ignore_result=True,
          acks_late=True)
def reap(reap_timeout: float | None = None, registration_grace: float | None = None) -> int:
    """Requeue the in-flight requests of workers silent for `reap_timeout`, or for
    `registration_grace` if they never became ready (beat's settings; this worker's
    VIGIL_WORKER_REAP_TIMEOUT / VIGIL_WORKER_REGISTRATION_GRACE if not given); returns how many
    were reaped."""
    s = get_settings()
    timeout = s.worker_reap_timeout if reap_timeout is None else float(reap_timeout)
    grace = (s.worker_registration_grace if registration_grace is None
             else float(registration_grace))
    return len(reap_workers(shared_store(), time.time(), republish_request,
                            _tell_backend,
                            reap_timeout=timeout, max_attempts=s.max_attempts,
                            registration_grace=grace))


def _active_queues(name: str) -> list[str] | None:
    replies = app.control.inspect(destination=[name], timeout=1.0).active_queues() or {}
    return [q["name"] for q in replies[name]] if name in replies else None


def _cancel(name: str, queue: str) -> None:
    app.control.cancel_consumer(queue, destination=[name], reply=False)


@app.task(name="vigil.health_tick", queue=HOUSEKEEPING_QUEUE, ignore_result=True, acks_late=True)
def health_tick() -> int:
    """Stop quarantined workers that still consume (app/housekeeping.py enforce_quarantines)."""
    s = get_settings()
    store = shared_store()
    ledger = HealthLedger(store.r, window=s.failure_window, threshold=s.failure_threshold)
    return enforce_quarantines(ledger, store, time.time(), _active_queues, _cancel)
