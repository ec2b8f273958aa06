"""Serving one delivery of `vigil.generate`: the worker-side life of a request (docs/architecture.md,
"Serve").

Celery-free so it is testable without a broker: the task passes in the delivery's id and
dispatch number, and gets back the stored result or a VigilError to raise. A retryable error
(TransientError, WorkerFatalError) is raised only once the record names the next dispatch (or,
when Vigil's own state was unreachable, with the record untouched: the next delivery takes the
request over); what happens after an error is app/retry_policy.py's one decision, which the
error carries to the task's one retry path (tasks/base.py) for its delay.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from app import metrics
from app.celery_ports import CeleryPorts
from app.errors import RequestError, VigilError
from app.fleet.outcomes import end_request
from app.request_ids import attempt_id
from app.requests.admit import admit
from app.requests.models import ModelRegistry
from app.requests.record_fields import record_fields
from app.requests.submit import record_new, resubmit
from app.settings import VigilSettings
from app.state.results import ResultKey
from app.state.store import RequestStore
from workers.delivery_answers import (after_run_error, give_back, not_run, open_tap, outcome,
                                      preemptible, refused)
from workers.engine.host import Aborted, HandedBack, Preempted
from workers.result import build_result, check_structured, repeats_output
from workers.runtime import WorkerRuntime

log = logging.getLogger("vigil.service")




def serve(rt: WorkerRuntime, request_id: str, dispatch: int, kwargs: object,
          result_key: Callable[[], ResultKey | None] | None = None) -> dict:
    """Serve one delivery; returns the stored result dict or raises the stored VigilError.

    Exactly-once: a terminal record is returned as stored (duplicate delivery), an older dispatch
    is dropped (StaleDelivery), and the first result written wins. With `result_key` (called
    once the result is ready: Celery's result key and meta, app/fleet/outcomes.py
    `result_key_for`), the finish that stores this attempt's result also writes Celery's result
    key and marks it `written`, so the task need not have Celery write it again.
    """
    now = time.time()
    s = rt.settings
    try:  # the one admit again: a message can bypass the producer (send_task, a raw push)
        req, spec, adapter = admit(kwargs, s, rt.registry)
    except RequestError as e:
        return refused(rt, request_id, dispatch, kwargs, e)
    pool = req.pool
    if not rt.host.accepting:  # stopping or quarantined: another worker takes it
        raise give_back(rt, pool, [request_id], dispatch)
    # A worker seen within the reap window is alive: a copy of what it runs is not run again.
    live = s.live_window
    b = rt.store.begin(request_id, dispatch, rt.name, rt.instance_id, now, s.max_attempts, live,
                       avoid_own_failures=rt.others_serve(pool))
    if b.action == "missing":  # sent around the producer (send_task / raw push): record it now
        record_new(rt.store, rt.ports, [(request_id, record_fields(req, now, s.request_deadline),
                                         pool, req.job)])
        b = rt.store.begin(request_id, dispatch, rt.name, rt.instance_id, now, s.max_attempts,
                           live)
    if b.action != "run":
        return not_run(rt, request_id, b, pool)
    metrics.attempt_begun(pool)
    tap, ok = None, False
    try:
        tap = open_tap(rt, request_id, req, b, adapter)
        out = rt.host.generate(req, spec, attempt_id(request_id, b.attempts),
                               s.request_timeout, adapter, tap=tap,
                               preemptible=preemptible(req, b, s))
        check_structured(req, out)  # a broken structured output is no result
        ok = True
    except (VigilError, Aborted, HandedBack, Preempted) as e:
        return after_run_error(rt, request_id, dispatch, b, e, pool, tap,
                               repeats=repeats_output(req))
    finally:
        if tap is not None:
            rt.streams.close(tap, ok)
    result = build_result(request_id, req, out, b.attempts, rt.name)
    won, stored = end_request(rt.store, request_id, result=result, instance=rt.instance_id,
                              pool=pool, result_key=result_key() if result_key else None)
    if not won:
        metrics.dropped(pool, "duplicate_result")
        log.warning("request %s already had a result; this attempt's result was dropped",
                    request_id)
    return outcome(stored)


def forward(store: RequestStore, registry: ModelRegistry, settings: VigilSettings,
            ports: CeleryPorts, request_id: str, dispatch: int, kwargs: object) -> None:
    """A vigil.generate message that reached a queue no pool owns (vigil.housekeeping, where a
    producer without `queue=` lands, or the housekeeper): sent on to its pool's queue under the
    same id and dispatch (app/requests/submit.py `resubmit`), running nothing here. Raises the
    request's stored error when it cannot be served (ended as `serve` would end it)."""
    try:
        resubmit(request_id, dispatch, kwargs, settings=settings, registry=registry,
                 store=store, ports=ports)
    except RequestError as e:
        _, stored = end_request(store, request_id, error=e, pool="")
        outcome(stored)
