"""Beat tasks (thin): each calls a `(store, now)` function in app/fleet/housekeeping.py."""
from __future__ import annotations

import time

from app import app
from app.state.queues import HOUSEKEEPING_QUEUE
from app.state.health import HealthLedger
from app.fleet.housekeeping import (enforce_quarantines, ensure_job_consumers, reap_workers,
                              republish_request, sweep_deadlines)
from app.fleet.jobs import end_job, expire_jobs
from app.settings import get_settings
from app.state.store import shared_store


def _tell_backend(request_id: str, err) -> None:
    """Store a request's failure in Celery's result backend, waking any `r.get()`."""
    app.backend.mark_as_failure(request_id, err)


@app.task(name="vigil.deadline_sweep", queue=HOUSEKEEPING_QUEUE, ignore_result=True,
          acks_late=True)
def deadline_sweep() -> int:
    """Fail every request past its deadline (deadline_exceeded); returns how many. First, if
    Redis restarted since the last look, publish again the open requests whose message the
    restart lost (app/fleet/message_audit.py)."""
    from app.fleet.message_audit import audit_after_restart

    store = shared_store()
    audit_after_restart(store, time.time(), republish_request)
    return sweep_deadlines(store, time.time(), _tell_backend)


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
    store = shared_store()
    return len(reap_workers(store, time.time(), republish_request,
                            _tell_backend,
                            reap_timeout=timeout, max_attempts=s.max_attempts,
                            registration_grace=grace, redis_started_at=store.redis_run()[1]))


def _active_queues(name: str) -> list[str] | None:
    replies = app.control.inspect(destination=[name], timeout=1.0).active_queues() or {}
    return [q["name"] for q in replies[name]] if name in replies else None


def _cancel(name: str, queue: str) -> None:
    app.control.cancel_consumer(queue, destination=[name], reply=False)


@app.task(name="vigil.health_tick", queue=HOUSEKEEPING_QUEUE, ignore_result=True, acks_late=True)
def health_tick() -> int:
    """Stop quarantined workers that still consume (app/fleet/housekeeping.py enforce_quarantines)."""
    s = get_settings()
    store = shared_store()
    ledger = HealthLedger(store.r, window=s.failure_window, threshold=s.failure_threshold)
    return enforce_quarantines(ledger, store, time.time(), _active_queues, _cancel)


def _add(name: str, queue: str) -> None:
    app.control.add_consumer(queue, destination=[name], reply=False)


def _abort_everywhere(request_ids: list[str]) -> None:
    """Tell every worker to abort these requests if it runs them (workers/lifecycle.py)."""
    app.control.broadcast("vigil_abort", arguments={"request_ids": request_ids}, reply=False)


def _cancel_everywhere(queue: str, names: list[str]) -> None:
    if names:
        app.control.cancel_consumer(queue, destination=names, reply=False)


def _control(name: str, queue: str, add: bool) -> None:
    if add:
        app.control.add_consumer(queue, destination=[name], reply=False)
    else:
        app.control.cancel_consumer(queue, destination=[name], reply=False)


@app.task(name="vigil.reconcile", queue=HOUSEKEEPING_QUEUE, ignore_result=True, acks_late=True)
def reconcile() -> dict:
    """Give unserved pools a worker (app/fleet/reconcile.py) and make every worker of a pool consume
    all of its job queues; returns what it did."""
    from app.requests.models import get_registry
    from app.fleet.reconcile import reconcile_pools

    s = get_settings()
    store = shared_store()
    reg = get_registry()
    with store.locked("pool_reconcile", 60) as held:
        if not held:
            return {}
        done = reconcile_pools(store, reg, time.time(), _control,
                               live_window=s.live_window,
                               concurrency=s.reconcile_concurrency)
    done["job_consumers_added"] = ensure_job_consumers(store, reg.names(), _active_queues, _add)
    return done


@app.task(name="vigil.job_leases", queue=HOUSEKEEPING_QUEUE, ignore_result=True, acks_late=True)
def job_leases() -> int:
    """End jobs whose lease lapsed (abandoned): their open requests fail job_deleted."""
    from app.requests.models import get_registry

    s = get_settings()
    store = shared_store()
    now = time.time()

    def end(name: str, reason: str) -> int:
        return end_job(store, name, now, reason, _tell_backend, _cancel_everywhere,
                       get_registry().names(), s.request_deadline, abort=_abort_everywhere)

    return expire_jobs(store, now, s.job_lease_s, end)
