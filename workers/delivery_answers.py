"""What a delivery answers when it does not run to a result, and the steps that write it: a
request refused by the admit, a claim that says not to run (a duplicate, a stale copy, an
expired or exhausted request), a run that raised (app/retry_policy.py decides: an end written,
or a retry whose record names the next dispatch), a message given back, and the outcome told to
Celery's result backend or a request published again as its next dispatch. workers/service.py's
one serve calls these for one delivery and for many.

Each answer is the stored result dict, or raises: the stored VigilError (the request ended
failed), a retryable one carrying its decision (the record already names the next dispatch),
StaleDelivery (drop this copy) or GiveBack (back on the queue, untouched).
"""
from __future__ import annotations

import logging
import time

from app import metrics
from app.errors import (DEADLINE_EXCEEDED, INVALID_REQUEST, PREEMPTED, SCHEMA_TOO_NEW,
                        STRUCTURED_OUTPUT_INVALID, WORKER_LOST, RequestError, TerminalError,
                        TransientError, VigilError, WorkerFatalError, error_from_record)
from app.fleet.outcomes import end_request, tell_backend
from app.requests.adapters import files_fingerprint
from app.requests.publish import publish
from app.requests.record_fields import provisional_fields
from app.requests.schemas import newer_version
from app.requests.submit import record_new
from app.retry_policy import Attempted, End, decide, exhausted, may_preempt, rule_for
from app.settings import VigilSettings
from app.state.store import Begin
from app.state.store_reads import Outcome
from workers.engine.host import Aborted, HandedBack, Preempted
from workers.runtime import WorkerRuntime

log = logging.getLogger("vigil.service")

# A worker that gives back a request it failed before waits this long first, so another
# worker's consumer, not its own, takes the message back off the queue.
AVOID_PAUSE_S = 0.2


class StaleDelivery(Exception):
    """A superseded copy of a request (an older dispatch); drop it without running."""


class GiveBack(Exception):
    """The worker is stopping: put this message back on its queue untouched for another worker."""


def outcome(o: Outcome) -> dict:
    """The result dict of a stored success; raises the stored error of a failure."""
    if o.status == "SUCCEEDED" and o.result is not None:
        return o.result
    raise error_from_record(o.error_kind, o.error)


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


def refused(rt: WorkerRuntime, request_id: str, dispatch: int, kwargs: object,
             e: RequestError) -> dict:
    """A delivery whose kwargs fail validation: failed with `e`, or handed back when its
    schema_version is newer than this worker reads."""
    model = kwargs.get("model") if isinstance(kwargs, dict) else None
    # A metrics label only for a registered model: a sender's arbitrary strings must not
    # grow the worker's label set.
    known = isinstance(model, str) and model in rt.registry.names()
    if known and newer_version(kwargs) is not None:
        return retry_newer(rt, request_id, dispatch, kwargs, e, model)
    return fail(rt, request_id, e, model if known else "")


def preemptible(req, b: Begin, s: VigilSettings) -> bool:
    """A bulk request may yield its batch seat to an interactive one, VIGIL_MAX_PREEMPTIONS
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
        e = TransientError.of(PREEMPTED, f"yielded its batch seat to an interactive request "
                              f"after {tap.written if tap is not None else 0} tokens; resumes "
                              "from them")
    if isinstance(e, Aborted):
        rec = rt.store.get(request_id) or {}
        if rec.get("status") in ("SUCCEEDED", "FAILED"):
            return outcome(Outcome.from_reply(rec["status"], rec.get("result", ""),
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
        return after_failure(rt, request_id, dispatch, b.attempts, e, pool, repeats=repeats)
    return fail(rt, request_id, e, pool)


def not_run(rt: WorkerRuntime, request_id: str, b: Begin, pool: str) -> dict:
    """A delivery whose claim `b` says it must not run: the stored outcome of a duplicate, a
    stale or busy copy dropped, a copy given back, or the request ended (deadline, attempts)."""
    if b.action == "done":
        metrics.dropped(pool, "duplicate_delivery")
        return outcome(b.outcome)
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
        return fail(rt, request_id, TerminalError.of(DEADLINE_EXCEEDED, "the request's deadline "
                                                      "passed before a worker could run it"), pool)
    if b.action == "exhausted":
        return fail(rt, request_id, exhausted(b.attempts, b.last_error), pool)
    raise TransientError.of(WORKER_LOST, f"unexpected record state {b.action!r}")


def retry_newer(rt: WorkerRuntime, request_id: str, dispatch: int, kwargs: dict,
                     err: RequestError, pool: str) -> dict:
    """A message of a schema_version newer than this worker reads (a newer producer sent it
    during a rolling upgrade): never failed as invalid here. Its claim is released without
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
            return fail(rt, request_id, err, pool)
        record_new(rt.store, rt.ports, [(request_id, fields, pool, fields["job"])])
        b = rt.store.begin(request_id, dispatch, rt.name, rt.instance_id, now, s.max_attempts,
                           s.live_window)
    if b.action != "run":
        return not_run(rt, request_id, b, pool)
    e = TransientError.of(SCHEMA_TOO_NEW, f"{err.detail}; handed back for a worker that reads it")
    log.warning("request %s: %s", request_id, e)
    return after_failure(rt, request_id, dispatch, b.attempts, e, pool)


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


def after_failure(rt: WorkerRuntime, request_id: str, dispatch: int, attempts: int,
                   e: VigilError, pool: str, *, repeats: bool = False) -> dict:
    """The fleet's or the worker's fault: app/retry_policy.py decides. An end is written; a
    retry releases the record to the next dispatch (refunding the attempt when the rule says
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
        return fail(rt, request_id, decision.error, pool)
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


def fail(rt: WorkerRuntime, request_id: str, err: VigilError, pool: str) -> dict:
    won, stored = end_request(rt.store, request_id, error=err, instance=rt.instance_id,
                              pool=pool)
    if not won:
        metrics.dropped(pool, "duplicate_result")
    return outcome(stored)


def tell(rt: WorkerRuntime, request_id: str, stored: Outcome) -> None:
    """Write a stored outcome to Celery's result backend (best effort: the record is the
    truth, and a waiting `get()` reads it too)."""
    try:
        tell_backend(rt.ports.backend, request_id, stored)
    except Exception as e:  # the record is the truth: a waiting r.get() reads it too
        log.warning("request %s ended, but Celery's result backend could not be told: %s",
                    request_id, e)


def publish_next(rt: WorkerRuntime, request_id: str, kwargs: object, dispatch: int,
                 countdown: float) -> None:
    """Publish a request of a message again, alone, as `dispatch` after `countdown`, through
    the one publish (app/requests/publish.py), to its record's pool and deadline; a request
    whose kwargs are no mapping ends invalid_request instead."""
    rec = rt.store.get(request_id) or {}
    if not isinstance(kwargs, dict):
        end_request(rt.store, request_id, error=RequestError.of(
            INVALID_REQUEST, "its kwargs are not a mapping"), instance=rt.instance_id)
        return
    deadline = float(rec.get("deadline_at") or time.time() + rt.settings.request_deadline)
    publish(request_id, kwargs, model=kwargs.get("model"), job=kwargs.get("job", "default"),
            pool=rec.get("pool") or kwargs.get("model"), deadline_at=deadline,
            dispatch=dispatch, send=rt.ports.send,
            **({"countdown": countdown} if countdown > 0 else {}))

