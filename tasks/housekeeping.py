"""Beat tasks (thin): each calls a `(store, now)` function in app/housekeeping.py."""
from __future__ import annotations

import time

from app import app
from app.celery_app import HOUSEKEEPING_QUEUE
from app.housekeeping import sweep_deadlines
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
