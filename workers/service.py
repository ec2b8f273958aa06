"""Serving deliveries: the worker-side life of requests, one road for a `vigil.generate` message
(one request) and a `vigil.generate_many` message (many): `serve_deliveries` (docs/architecture.md,
"Serve").

Celery-free so it is testable without a broker: the task passes in each delivery's id, dispatch
and kwargs, and an `answer` that acts on what each delivery ends in. Every delivery lives as its
own request: its own record, attempt, stream, deadline and set-once end. The road:

1. admit each again (app/requests/admit.py: a message can bypass the producer); a request that
   fails it ends with that error, or goes back when it is of a newer schema version;
2. the whole message goes back untouched (GiveBack) while the worker takes no new requests;
3. claim each (`begin`; many in one round trip), recording first a request sent around the
   producer (app/requests/submit.py `record_new`); a claim that says not to run answers at once;
4. start every run in the engine in one hop (the engine host's `submit_many`) and finish each as
   it ends: those ending within FINISH_GATHER_S of each other are written in one round trip
   (`finish_many`, each with Celery's result key), so a short request's result never waits for
   a slower sibling;
5. a run that raised is decided by app/retry_policy.py (workers/delivery_answers.py): an end
   written, or a retry whose record names the next dispatch.

Exactly-once: a terminal record is answered as stored (duplicate delivery), an older dispatch
is dropped (StaleDelivery), and the first result written wins. An exception that escapes the
road (a Redis error past the outage grace, a bug) strands no request: every one not yet answered
is aborted in the engine and answered through the same retry decision (`_answer_rest`).

`serve` answers one delivery to its task (the stored result returned, or the stored or
retryable error raised: a retry goes through the task's retry path, tasks/base.py); `serve_many`
answers each request of a message itself: its outcome told to Celery's result backend, a retry
published alone as its next dispatch (`publish_next`). A worker killed mid-message loses
nothing: the message's every request is in the worker's in-flight set from the moment it was
taken (app/state/transport.py), so the reaper hands each back on its own.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Callable

from app import metrics
from app.errors import (REDIS_UNAVAILABLE, WORKER_LOST, RequestError, TransientError,
                        VigilError, WorkerFatalError)
from app.fleet.outcomes import end_many
from app.request_ids import attempt_id
from app.requests.admit import Admitted, admit
from app.requests.record_fields import record_fields
from app.requests.submit import record_new
from app.retry_policy import Attempted, Retry, decide
from app.state.results import ResultKey
from app.state.store import Begin
from app.state.store_reads import Outcome
from workers.delivery_answers import (GiveBack, StaleDelivery, after_run_error, give_back,
                                      not_run, open_tap, outcome, preemptible, publish_next,
                                      refused, tell)
from workers.result import build_result, check_structured, repeats_output
from workers.runtime import WorkerRuntime

log = logging.getLogger("vigil.service")

# Deliveries that end within this long of the first of them are finished with it, in one round
# trip (an engine step's outputs reach the loop together, well inside it).
FINISH_GATHER_S = 0.005


@dataclass
class Delivery:
    """One request of a message, on its way along the road."""

    request_id: str
    dispatch: int
    kwargs: object
    admitted: Admitted | None = None
    begin: Begin | None = None
    tap: object = None
    pending: object = None
    settled: bool = False  # answered (its end or retry written, or not ours to run)

    @property
    def pool(self) -> str:
        return self.admitted.req.pool


# answer(delivery, step, told): act on `step()`, the delivery's stored result or its raised
# answer (workers/delivery_answers.py); `told`: Celery's result key was written with it.
Answer = Callable[[Delivery, Callable[[], dict], bool], None]
# result_key(request id): Celery's result key and meta, for the finish to write with the result.
ResultKeyOf = Callable[[str], ResultKey | None]


def serve(rt: WorkerRuntime, request_id: str, dispatch: int, kwargs: object,
          result_key: Callable[[], ResultKey | None] | None = None) -> dict:
    """Serve one delivery of `vigil.generate` (module docstring); returns the stored result dict
    or raises: the stored VigilError, a retryable one carrying its decision, StaleDelivery or
    GiveBack. With `result_key` (called once the result is ready: Celery's result key and meta,
    app/fleet/outcomes.py `result_key_for`), the finish that stores the result also writes
    Celery's result key and marks it `written`, so the task need not have Celery write it."""
    got: list = []

    def answer(d: Delivery, step: Callable[[], dict], told: bool) -> None:
        try:
            got.append((True, step()))
        except Exception as e:
            got.append((False, e))

    serve_deliveries(rt, [Delivery(request_id, dispatch, kwargs)], answer,
                     (lambda _rid: result_key()) if result_key else None)
    if not got:  # Redis away past the grace: this worker hands it back once Redis returns
        raise TransientError.of(REDIS_UNAVAILABLE, f"could not settle request {request_id}")
    ok, value = got[0]
    if ok:
        return value
    raise value


def serve_many(rt: WorkerRuntime, items: object, result_key: ResultKeyOf | None = None) -> dict:
    """Serve every request of one `vigil.generate_many` message (module docstring); returns what
    happened, {"requests", "succeeded", "failed", "retried", "dropped"}. Every request has its
    outcome in its record and in Celery's result backend (a success through `result_key(id)`,
    written by its finish), or has gone back alone as its next dispatch. Raises GiveBack (the
    whole message goes back untouched) when the worker takes no new requests."""
    tally = {"requests": 0, "succeeded": 0, "failed": 0, "retried": 0, "dropped": 0}
    deliveries = []
    for item in items if isinstance(items, list) else []:
        rid, kwargs = _item(item)
        if rid is None:
            log.error("dropped an entry of a generate_many message without a request id")
            continue
        deliveries.append(Delivery(rid, 0, kwargs))
    if not isinstance(items, list):
        log.error("dropped a generate_many message whose requests are not a list")
    tally["requests"] = len(deliveries)

    def answer(d: Delivery, step: Callable[[], dict], told: bool) -> None:
        tally[_answer_alone(rt, d, step, told)] += 1

    serve_deliveries(rt, deliveries, answer, result_key)
    return tally


def serve_deliveries(rt: WorkerRuntime, deliveries: list[Delivery], answer: Answer,
                     result_key: ResultKeyOf | None = None) -> None:
    """The one road (module docstring): every delivery is answered once through `answer`, or
    GiveBack is raised before any is claimed (the worker takes no new requests)."""
    runs = []
    for d in deliveries:
        try:
            d.admitted = admit(d.kwargs, rt.settings, rt.registry)
        except RequestError as e:
            _settle(answer, d, lambda d=d, e=e: refused(rt, d.request_id, d.dispatch, d.kwargs,
                                                         e))
            continue
        runs.append(d)
    if not runs:
        return
    if not rt.host.accepting:  # stopping or quarantined: the whole message goes back
        raise give_back(rt, runs[0].pool, [d.request_id for d in runs], runs[0].dispatch)
    try:
        _begin(rt, runs)
        _run_all(rt, answer, [d for d in runs if _may_run(rt, answer, d)], result_key)
    except Exception as e:  # none of the message's requests may be stranded by it
        _answer_rest(rt, answer, runs, e)


def _settle(answer: Answer, d: Delivery, step: Callable[[], dict], told: bool = False) -> None:
    answer(d, step, told)
    d.settled = True


def _answer_alone(rt: WorkerRuntime, d: Delivery, step: Callable[[], dict], told: bool) -> str:
    """A request of a message of many answered by the worker itself (no task returns its
    result): a stored outcome is told to Celery's backend unless its finish wrote it (`told`);
    a retry is published alone as the request's next dispatch, a copy given back as the same
    one; a stale copy is dropped. Returns the tally's key."""
    try:
        stored = step()
    except StaleDelivery:
        return "dropped"
    except GiveBack:  # its last attempt failed here and another worker serves: back, as it is
        publish_next(rt, d.request_id, d.kwargs, d.dispatch, 0.0)
        return "retried"
    except (TransientError, WorkerFatalError) as e:
        decision = e.decision
        if not isinstance(decision, Retry):
            raise
        publish_next(rt, d.request_id, d.kwargs, d.dispatch + 1, decision.countdown)
        return "retried"
    except VigilError as e:  # its stored error (it ended failed)
        if not told:
            tell(rt, d.request_id, Outcome("FAILED", None, type(e).__name__, str(e)))
        return "failed"
    if not told:
        tell(rt, d.request_id, Outcome("SUCCEEDED", stored, "", ""))
    return "succeeded"


def _begin(rt: WorkerRuntime, runs: list[Delivery]) -> None:
    """Claim every delivery (many in one round trip); a request sent around the producer (no
    record) is recorded first, then claimed alone. A retry (dispatch above 0) avoids this
    worker when its last attempt failed here and another healthy worker serves its pool."""
    s, now = rt.settings, time.time()
    if len(runs) == 1:
        d = runs[0]
        begins = [rt.store.begin(d.request_id, d.dispatch, rt.name, rt.instance_id, now,
                                 s.max_attempts, s.live_window,
                                 avoid_own_failures=d.dispatch > 0 and rt.others_serve(d.pool))]
    else:
        begins = rt.store.begin_many([(d.request_id, d.dispatch) for d in runs], rt.name,
                                     rt.instance_id, now, s.max_attempts, s.live_window)
    for d, b in zip(runs, begins):
        if b.action == "missing":
            record_new(rt.store, rt.ports, [(d.request_id, record_fields(
                d.admitted.req, now, s.request_deadline), d.pool, d.admitted.req.job)])
            b = rt.store.begin(d.request_id, d.dispatch, rt.name, rt.instance_id, now,
                               s.max_attempts, s.live_window)
        d.begin = b


def _may_run(rt: WorkerRuntime, answer: Answer, d: Delivery) -> bool:
    """True when `d`'s claim says run (its tap opened); else its answer settled."""
    if d.begin.action != "run":
        _settle(answer, d, lambda: not_run(rt, d.request_id, d.begin, d.pool))
        return False
    metrics.attempt_begun(d.pool)
    try:
        d.tap = open_tap(rt, d.request_id, d.admitted.req, d.begin, d.admitted.adapter)
    except BaseException as e:
        _ended_run(rt, answer, d, e)
        return False
    return True


def _run_all(rt: WorkerRuntime, answer: Answer, runs: list[Delivery],
             result_key: ResultKeyOf | None) -> None:
    """Start every run in the engine in one hop, then finish each as it ends: the runs that
    end within FINISH_GATHER_S of the first of them are written in one round trip, so a short
    request's result never waits for a slower sibling, and siblings that end in the same engine
    step still share their FINISH pipeline."""
    if not runs:
        return
    s = rt.settings
    try:
        pendings = rt.host.submit_many([
            (d.admitted.req, d.admitted.spec, attempt_id(d.request_id, d.begin.attempts),
             s.request_timeout, d.admitted.adapter, d.tap,
             preemptible(d.admitted.req, d.begin, s)) for d in runs])
    except BaseException as e:  # none started (the host takes nothing new)
        for d in runs:
            _ended_run(rt, answer, d, e)
        return
    ended: queue.SimpleQueue = queue.SimpleQueue()
    for i, (d, p) in enumerate(zip(runs, pendings)):
        d.pending = p
        p.future.add_done_callback(lambda _f, i=i: ended.put(i))
    left = set(range(len(runs)))
    while left:
        done = []
        for i in _next_ended(ended, runs, left):
            d = runs[i]
            left.discard(i)
            try:
                out = rt.host.result(d.pending)
                check_structured(d.admitted.req, out)  # a broken structured output is no result
            except BaseException as e:
                _ended_run(rt, answer, d, e)
                continue
            if d.tap is not None:
                rt.streams.close(d.tap, True)
                d.tap = None
            done.append((d, out))
        _finish(rt, answer, done, result_key)


def _next_ended(ended: queue.SimpleQueue, runs: list[Delivery], left: set[int]) -> list[int]:
    """The runs of `left` to settle next: the first to end and those ending within
    FINISH_GATHER_S of it; or, when none ends before the earliest wait bound of `left`, those
    past their bound (`EngineHost.result` then gives them up)."""
    bound = min(runs[i].pending.deadline for i in left)
    try:
        first = ended.get(timeout=max(0.0, bound - time.monotonic()))
    except queue.Empty:
        now = time.monotonic()
        return [i for i in left if runs[i].pending.deadline <= now]
    ready = [first]
    if len(left) > 1 and ended.qsize() < len(left) - 1:
        time.sleep(FINISH_GATHER_S)  # siblings ending in the same engine step join it
    while True:
        try:
            ready.append(ended.get_nowait())
        except queue.Empty:
            break
    return [i for i in dict.fromkeys(ready) if i in left]


def _finish(rt: WorkerRuntime, answer: Answer, done: list, result_key: ResultKeyOf | None
            ) -> None:
    """Write every finished run's result in one round trip (app/fleet/outcomes.py `end_many`),
    each with Celery's result key, and answer each with its stored outcome (the first result
    written wins)."""
    if not done:
        return
    results = [(d.request_id, build_result(d.request_id, d.admitted.req, out, d.begin.attempts,
                                           rt.name),
                result_key(d.request_id) if result_key else None, d.pool) for d, out in done]
    ends = end_many(rt.store, results, rt.instance_id)
    for (d, _), (rid, _, key, _), (won, stored) in zip(done, results, ends):
        if not won:
            metrics.dropped(d.pool, "duplicate_result")
            log.warning("request %s already had a result; this attempt's result was dropped",
                        rid)
        _settle(answer, d, lambda stored=stored: outcome(stored),
                told=key is not None and key.written)


def _ended_run(rt: WorkerRuntime, answer: Answer, d: Delivery, e: BaseException) -> None:
    """A run that raised `e` (or could not start): its end or retry settled, its tap closed."""
    try:
        if not isinstance(e, Exception):
            raise e
        _settle(answer, d, lambda: after_run_error(rt, d.request_id, d.dispatch, d.begin, e,
                                                   d.pool, d.tap,
                                                   repeats=repeats_output(d.admitted.req)))
    finally:
        if d.tap is not None:
            rt.streams.close(d.tap, False)
            d.tap = None


def _answer_rest(rt: WorkerRuntime, answer: Answer, runs: list[Delivery],
                    e: Exception) -> None:
    """An exception escaped the road: every delivery not yet answered is aborted in the engine
    (its tokens so far written to its stream when Redis takes them) and answered through the
    retry decision on `e` (itself when a VigilError, else `worker_lost`). One whose claim never
    came back (the claim itself failed) is answered with that error decided on its dispatch,
    its record untouched: its next copy takes the request over. When Redis cannot be reached
    for that either, the rest stay in this worker's in-flight set, which it hands back itself
    once Redis returns (workers/held.py `reclaim_orphans`)."""
    rest = [d for d in runs if not d.settled]
    if len(runs) > 1:
        log.error("a message failed with %d of its %d requests unsettled; each goes back "
                  "alone: %s", len(rest), len(runs), e, exc_info=e)
    err = e if isinstance(e, VigilError) else TransientError.of(
        WORKER_LOST, f"its worker failed serving its message: {type(e).__name__}: {e}")
    running = {d.request_id for d in rest if d.pending is not None}
    if running:
        rt.host.abort_requests(running)
    for i, d in enumerate(rest):
        try:
            if d.tap is not None:
                rt.streams.write_now(d.tap)  # the next attempt goes on from them
                rt.streams.close(d.tap, False)
                d.tap = None
            mine = type(err)(str(err))
            if d.begin is None:  # not claimed: the record is untouched, its next copy runs
                mine.decision = decide(mine, Attempted(None, d.dispatch), rt.settings,
                                       time.time())
                _settle(answer, d, lambda mine=mine: _raise(mine))
            elif d.begin.action != "run":
                _settle(answer, d, lambda d=d: not_run(rt, d.request_id, d.begin, d.pool))
            else:
                _settle(answer, d, lambda d=d, mine=mine: after_run_error(
                    rt, d.request_id, d.dispatch, d.begin, mine, d.pool,
                    repeats=repeats_output(d.admitted.req)))
        except Exception as again:
            gone = isinstance(again, TransientError) and again.code == REDIS_UNAVAILABLE
            # Each of the rest would wait out the outage grace again: leave them all.
            left = [x.request_id for x in rest[i:]] if gone else [d.request_id]
            log.error("could not hand back %s (%s); this worker hands back what its in-flight "
                      "set still names once Redis returns", left, again)
            if gone:
                return


def _raise(e: Exception) -> dict:
    raise e


def _item(item: object) -> tuple[str | None, object]:
    """(request id, kwargs) of one entry of a message of many, (None, None) when it has no
    usable id."""
    if not isinstance(item, dict):
        return None, None
    rid = item.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > 200:
        return None, None
    return rid, item.get("kwargs")
