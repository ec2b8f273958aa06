"""Beat tasks (thin): each calls a `(store, now)` function in app/housekeeping.py."""
from __future__ import annotations

import time

from app import app
from app.celery_app import HOUSEKEEPING_QUEUE
from app.housekeeping import reap_workers, republish_request, sweep_deadlines
from app.settings import get_settings
from app.store import RequestStore, connect

_store: RequestStore | None = None


def _get_store() -> RequestStore:
    global _store
    if _store is None:
        s = get_settings()
        _store = RequestStore(connect(s), s.result_ttl)
    return _store


@app.task(name="vigil.deadline_sweep", queue=HOUSEKEEPING_QUEUE, ignore_result=True,
          acks_late=True)
def deadline_sweep() -> int:
    """Fail every request past its deadline (deadline_exceeded); returns how many."""
    return sweep_deadlines(_get_store(), time.time(),
                           lambda rid, err: app.backend.mark_as_failure(rid, err))


@app.task(name="vigil.reap_workers", queue=HOUSEKEEPING_QUEUE, ignore_result=True,
          acks_late=True)
def reap(reap_timeout: float | None = None) -> int:
    """Requeue the in-flight requests of workers silent for `reap_timeout` (beat's setting;
    this worker's VIGIL_WORKER_REAP_TIMEOUT if not given); returns how many were reaped."""
    s = get_settings()
    timeout = s.worker_reap_timeout if reap_timeout is None else float(reap_timeout)
    return len(reap_workers(_get_store(), time.time(), republish_request,
                            lambda rid, err: app.backend.mark_as_failure(rid, err),
                            reap_timeout=timeout, max_attempts=s.max_attempts))
