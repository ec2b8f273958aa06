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
from app.errors import (DEADLINE_EXCEEDED, PREEMPTED, SCHEMA_TOO_NEW,
                        STRUCTURED_OUTPUT_INVALID, WORKER_LOST, RequestError, TerminalError,
                        TransientError, VigilError, WorkerFatalError, error_from_record)
from app.fleet.outcomes import end_request
from app.request_ids import attempt_id
from app.requests.adapters import files_fingerprint
from app.requests.admit import admit
from app.requests.models import ModelRegistry
from app.requests.record_fields import provisional_fields, record_fields
from app.requests.schemas import newer_version
from app.requests.submit import record_new, resubmit
from app.retry_policy import Attempted, End, decide, exhausted, may_preempt, rule_for
from app.settings import VigilSettings
from app.state.results import ResultKey
from app.state.store import Begin, Outcome, RequestStore
from workers.engine.host import Aborted, HandedBack, Preempted
from workers.result import build_result, check_structured, repeats_output
from workers.runtime import WorkerRuntime

log = logging.getLogger("vigil.service")


# A worker that gives back a request it failed before waits this long first, so another
# worker's consumer, not its own, takes the message back off the queue.
AVOID_PAUSE_S = 0.2


class StaleDelivery(Exception):
    """A superseded copy of a request (an older dispatch); drop it without running."""


class GiveBack(Exception):
    """The worker is stopping: put this message back on its queue untouched for another worker."""


def _outcome(o: Outcome) -> dict:
    if o.status == "SUCCEEDED" and o.result is not None:
        return o.result
    raise error_from_record(o.error_kind, o.error)


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
        return _refused(rt, request_id, dispatch, kwargs, e)
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
        return _not_run(rt, request_id, b, pool)
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
    return _outcome(stored)


def give_back(rt: WorkerRuntime, pool: str, request_ids: list[str], dispatch: int) -> GiveBack:
    """The GiveBack to raise for a delivery of `request_ids` (of `dispatch`) that goes back to
    its queue untouched (the task's Reject(requeue)): counted, and let go from this worker's
    in-flight set, where its consumer noted it as it took the message (best effort: a Redis
    away leaves it there, and the worker's hand-backs then find it moved on or ended)."""
    for _ in request_ids:
        metrics.dropped(pool, "given_back")
    try:
        rt.store.let_go(request_ids, rt.instance_id, dispatch)
    except Exception as e:
        log.warning("could not let go of %s given back: %s", request_ids, e)
    return GiveBack(request_ids[0])


def _refused(rt: WorkerRuntime, request_id: str, dispatch: int, kwargs: object,
             e: RequestError) -> dict:
    """A delivery whose kwargs fail validation: failed with `e`, or handed back when its
    schema_version is newer than this worker reads."""
    model = kwargs.get("model") if isinstance(kwargs, dict) else None
    # A metrics label only for a registered model: a sender's arbitrary strings must not
    # grow the worker's label set.
    known = isinstance(model, str) and model in rt.registry.names()
    if known and newer_version(kwargs) is not None:
        return _hand_back_newer(rt, request_id, dispatch, kwargs, e, model)
    return _fail(rt, request_id, e, model if known else "")


def preemptible(req, b: Begin, s: VigilSettings) -> bool:
    """A bulk request may yield its engine slot to an interactive one, VIGIL_MAX_PREEMPTIONS
    times at most (app/retry_policy.py `may_preempt`; the record counts them), and only while
    its tokens can be resumed from its stream (token streams on)."""
    return req.priority == "bulk" and may_preempt(b.preemptions, s) and s.stream_flush_ms > 0


def after_run_error(rt: WorkerRuntime, request_id: str, dispatch: int, b: Begin,
                    e: BaseException, pool: str, tap=None, *, repeats: bool = False) -> dict:
    """What a run that raised `e` ends in: the stored outcome of a request that ended elsewhere
    while it ran (Aborted: a job deleted, a cancel), a retry decided by app/retry_policy.py
    (raised, carrying its decision: a handed-back run, a preempted one, whose tokens are
    written to its stream first from `tap`, the fleet's or the worker's fault), or the
    request's own error written as its end. `repeats`: the request makes the same output on
    every attempt (workers/result.py `repeats_output`), for the decision."""
    if isinstance(e, Preempted):
        if tap is not None:
            rt.streams.write_now(tap)  # every token it made: the next attempt goes on from it
        e = TransientError.of(PREEMPTED, f"yielded its engine slot to an interactive request "
                              f"after {tap.written if tap is not None else 0} tokens; resumes "
                              "from them")
    if isinstance(e, Aborted):
        rec = rt.store.get(request_id) or {}
        if rec.get("status") in ("SUCCEEDED", "FAILED"):
            return _outcome(Outcome.from_reply(rec["status"], rec.get("result", ""),
                                               rec.get("error_kind", ""), rec.get("error", "")))
        raise StaleDelivery(request_id) from None
    if isinstance(e, HandedBack):
        # The stopping worker republished what it held (its record moved to a newer dispatch):
        # this copy is stale. Asked here, not left to the release: a release finds the record
        # PENDING under its next dispatch and this instance, which is also what a release of
        # its own whose reply was lost leaves, and would say yes (a second message of that
        # dispatch). A request begun after that scan is still ours: retried (below).
        rec = rt.store.get(request_id) or {}
        if rec.get("status") != "RUNNING" or rec.get("instance") != str(rt.instance_id):
            raise StaleDelivery(request_id) from None
        e = TransientError.of(WORKER_LOST, "the worker stopped")
    if isinstance(e, (TransientError, WorkerFatalError)):
        return _after_failure(rt, request_id, dispatch, b.attempts, e, pool, repeats=repeats)
    return _fail(rt, request_id, e, pool)


def _not_run(rt: WorkerRuntime, request_id: str, b: Begin, pool: str) -> dict:
    """A delivery whose claim `b` says it must not run: the stored outcome of a duplicate, a
    stale or busy copy dropped, a copy given back, or the request ended (deadline, attempts)."""
    if b.action == "done":
        metrics.dropped(pool, "duplicate_delivery")
        return _outcome(b.outcome)
    if b.action == "stale":
        metrics.dropped(pool, "stale")
        raise StaleDelivery(request_id)
    if b.action == "busy":  # its live owner finishes it (or the reaper requeues it)
        metrics.dropped(pool, "duplicate_delivery")
        raise StaleDelivery(request_id)
    if b.action == "avoid":  # its last attempt failed here, and another healthy worker serves
        metrics.dropped(pool, "avoided")
        time.sleep(AVOID_PAUSE_S)  # let another worker's consumer take it first
        raise GiveBack(request_id)
    if b.action == "expired":
        return _fail(rt, request_id, TerminalError.of(DEADLINE_EXCEEDED, "the request's deadline "
                                                      "passed before a worker could run it"), pool)
    if b.action == "exhausted":
        return _fail(rt, request_id, exhausted(b.attempts, b.last_error), pool)
    raise TransientError.of(WORKER_LOST, f"unexpected record state {b.action!r}")


def _hand_back_newer(rt: WorkerRuntime, request_id: str, dispatch: int, kwargs: dict,
                     err: RequestError, pool: str) -> dict:
    """A message of a schema_version newer than this worker reads (a newer producer sent it
    during a rolling upgrade): never failed as invalid here. Its claim is given back without
    using an attempt and it is retried with backoff (TransientError schema_too_new), for a
    worker that reads its version; its deadline bounds the wait. A message with no record (sent
    around the producer) is recorded first from the fields every version keeps (model, job,
    deadline_s); one whose job cannot be read is refused (`err`, unsupported_version)."""
    s, now = rt.settings, time.time()
    if not rt.host.accepting:
        raise give_back(rt, pool, [request_id], dispatch)
    b = rt.store.begin(request_id, dispatch, rt.name, rt.instance_id, now, s.max_attempts,
                       s.live_window, avoid_own_failures=rt.others_serve(pool))
    if b.action == "missing":
        fields = provisional_fields(kwargs, now, s.request_deadline)
        if fields is None:
            return _fail(rt, request_id, err, pool)
        record_new(rt.store, rt.ports, [(request_id, fields, pool, fields["job"])])
        b = rt.store.begin(request_id, dispatch, rt.name, rt.instance_id, now, s.max_attempts,
                           s.live_window)
    if b.action != "run":
        return _not_run(rt, request_id, b, pool)
    e = TransientError.of(SCHEMA_TOO_NEW, f"{err.detail}; handed back for a worker that reads it")
    log.warning("request %s: %s", request_id, e)
    return _after_failure(rt, request_id, dispatch, b.attempts, e, pool)


def open_tap(rt: WorkerRuntime, request_id: str, req, b: Begin, adapter):
    """The attempt `b`'s token stream tap (workers/streaming.py), continuing from the tokens
    already in the request's stream; None with token streams off. Close it with
    `rt.streams.close(tap, ok)` once the run ended. Raises TransientError(redis_unavailable)
    when the stream cannot be read past the outage grace (retried like any)."""
    if rt.streams is None:
        return None
    prior = rt.streams.streams.checkpoint(request_id) if b.streamed else None
    tap = rt.streams.open(request_id, b.token, b.attempts, req.pool, prior,
                          files_fingerprint(adapter.path) if adapter else "", req.n, req.live)
    if b.streamed and prior is None:  # its tokens are not there to continue
        tap.refuse_resume("the stream holds no tokens to continue")
    elif b.streamed and req.structured is not None and str(
            (rt.store.get(request_id) or {}).get("last_error", "")).startswith(
                f"{STRUCTURED_OUTPUT_INVALID}:"):
        # Its last attempt's output broke its constraint: another sample starts afresh, not
        # from tokens that may hold the break.
        tap.refuse_resume("its last attempt's output broke its structured constraint")
    return tap


def _after_failure(rt: WorkerRuntime, request_id: str, dispatch: int, attempts: int,
                   e: VigilError, pool: str, *, repeats: bool = False) -> dict:
    """The fleet's or the worker's fault: app/retry_policy.py decides. An end is written; a
    retry releases the record to the next dispatch (giving the attempt back when the rule says
    so: a pending adapter, a memory wait) and raises `e`, carrying the decision, for the task's
    retry path. A release refused means someone else owns the request now: StaleDelivery."""
    s = rt.settings
    now = time.time()
    since = None
    if rule_for(e).memory_window:  # the wait is bounded by time from its first refusal
        rec = rt.store.get(request_id) or {}
        since = float(rec.get("pressure_since") or now)
    decision = decide(e, Attempted(attempts, dispatch, pressure_since=since, repeats=repeats),
                      s, now)
    if isinstance(decision, End):
        return _fail(rt, request_id, decision.error, pool)
    if rt.store.release(request_id, rt.instance_id, dispatch + 1, str(e), now=now,
                        refund=not decision.uses_attempt, pressure=decision.pressure,
                        preempted=e.code == PREEMPTED):
        metrics.retried(pool, e.code)
        if decision.pressure:
            log.info("request %s: %s; waiting for memory (%.0f s so far)", request_id, e,
                     now - since)
        else:
            log.info("request %s attempt %d: %s; retrying", request_id, attempts, e)
        e.decision = decision
        raise e from None
    metrics.dropped(pool, "stale")
    raise StaleDelivery(request_id) from None


def _fail(rt: WorkerRuntime, request_id: str, err: VigilError, pool: str) -> dict:
    won, stored = end_request(rt.store, request_id, error=err, instance=rt.instance_id,
                              pool=pool)
    if not won:
        metrics.dropped(pool, "duplicate_result")
    return _outcome(stored)


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
        _outcome(stored)
