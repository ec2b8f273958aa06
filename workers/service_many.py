"""Serving one message that carries many requests (`vigil.generate_many`, published by
app/requests/submit.py): every request lives as one `vigil.generate` delivery would
(workers/service.py: its own record, attempt, stream, deadline and set-once end), but the
message's intake, Celery request and ack are shared, the claims are one round trip
(`begin_many`), the requests run in the engine together from one task thread (handed to the
engine's loop in one hop: the engine host's `submit_many`, then `result`), and each result is
written as its run ends, those ending together in one round trip (`finish_many`, each with
Celery's result key, its meta encoded once for the message: app/fleet/outcomes.py
`result_keys_for`). A short request's result does not wait for a slower sibling.

A request that needs a retry (app/retry_policy.py) goes back alone, as a `vigil.generate`
message of its next dispatch after the decision's countdown; its siblings are not touched. A
worker killed mid-message loses nothing: the message's every request is in the worker's
in-flight set from the moment it was taken (app/state/transport.py), so the reaper hands each
back on its own; the message itself, if it comes back after the visibility timeout, meets
records that moved on and runs nothing twice. An exception that escapes the serving loop (a
Redis error past the outage grace, a bug) strands none of them either: every request not yet
settled is aborted in the engine and goes back alone through the same retry decision, or ends
(`_hand_back_rest`).
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Callable

from app import metrics
from app.errors import (REDIS_UNAVAILABLE, WORKER_LOST, RequestError,
                        TransientError, VigilError, WorkerFatalError)
from app.request_ids import attempt_id
from app.requests.admit import admit
from app.requests.record_fields import record_fields, wire_kwargs
from app.requests.submit import record_new
from app.retry_policy import Attempted, Retry, decide
from app.state.results import ResultKey
from app.state.store import Outcome
from workers.result import build_result, check_structured, repeats_output
from workers.runtime import WorkerRuntime
from workers.delivery_answers import (GiveBack, StaleDelivery, after_run_error, give_back,
                                      not_run, open_tap, preemptible, publish_next, refused,
                                      tell)

log = logging.getLogger("vigil.service")

# Siblings that end within this long of the first of them are finished with it, in one round
# trip (an engine step's outputs reach the loop together, well inside it).
FINISH_GATHER_S = 0.005


@dataclass
class _Run:
    """One request of the message on its way through the engine."""

    request_id: str
    kwargs: dict
    req: object
    spec: object
    adapter: object
    begin: object = None
    tap: object = None
    pending: object = None
    settled: bool = False  # its end or retry is written (or it was not ours to run)


def serve_many(rt: WorkerRuntime, items: object,
               result_key: Callable[[str], ResultKey | None] | None = None) -> dict:
    """Serve every request of one vigil.generate_many message (module docstring). Returns what
    happened, {"requests", "succeeded", "failed", "retried", "dropped"}; every request has its
    outcome in its record and in Celery's result backend (a success through `result_key(id)`,
    written by its finish), or has gone back alone as its next dispatch. Raises GiveBack (the
    whole message goes back untouched) when the worker takes no new requests."""
    tally = {"requests": 0, "succeeded": 0, "failed": 0, "retried": 0, "dropped": 0}
    runs: list[_Run] = []
    for item in items if isinstance(items, list) else []:
        rid, kwargs = _item(item)
        if rid is None:
            log.error("dropped an entry of a generate_many message without a request id")
            continue
        tally["requests"] += 1
        try:
            req, spec, adapter = admit(kwargs, rt.settings, rt.registry)
        except RequestError as e:
            _settle(rt, tally, rid, kwargs, 0, lambda e=e, rid=rid, kw=kwargs: refused(
                rt, rid, 0, kw, e))
            continue
        runs.append(_Run(rid, kwargs, req, spec, adapter))
    if not isinstance(items, list):
        log.error("dropped a generate_many message whose requests are not a list")
    if not runs:
        return tally
    if not rt.host.accepting:  # stopping or quarantined: the whole message goes back
        raise give_back(rt, runs[0].req.pool, [r.request_id for r in runs], 0)
    try:
        _begin(rt, runs)
        _run_all(rt, tally, [r for r in runs if _may_run(rt, tally, r)], result_key)
    except Exception as e:  # none of the message's requests may be stranded by it
        _hand_back_rest(rt, tally, runs, e)
    return tally


def _may_run(rt: WorkerRuntime, tally: dict, r: _Run) -> bool:
    """True when `r`'s claim says run (its tap opened); else its answer settled."""
    if r.begin.action != "run":
        _settle(rt, tally, r.request_id, r.kwargs, 0,
                lambda: not_run(rt, r.request_id, r.begin, r.req.pool))
        r.settled = True
        return False
    metrics.attempt_begun(r.req.pool)
    try:
        r.tap = open_tap(rt, r.request_id, r.req, r.begin, r.adapter)
    except BaseException as e:
        _ended_run(rt, tally, r, e)
        return False
    return True


def _run_all(rt: WorkerRuntime, tally: dict, runs: list[_Run], result_key) -> None:
    """Start every run in the engine in one hop, then finish each as it ends: the runs that
    end within FINISH_GATHER_S of the first of them are written in one round trip, so a short
    request's result never waits for a slower sibling, and siblings that end in the same engine
    step still share their FINISH pipeline."""
    if not runs:
        return
    s = rt.settings
    try:
        pendings = rt.host.submit_many([
            (r.req, r.spec, attempt_id(r.request_id, r.begin.attempts), s.request_timeout,
             r.adapter, r.tap, preemptible(r.req, r.begin, s)) for r in runs])
    except BaseException as e:  # none started (the host takes nothing new)
        for r in runs:
            _ended_run(rt, tally, r, e)
        return
    ended: queue.SimpleQueue = queue.SimpleQueue()
    for i, (r, p) in enumerate(zip(runs, pendings)):
        r.pending = p
        p.future.add_done_callback(lambda _f, i=i: ended.put(i))
    left = set(range(len(runs)))
    while left:
        ready = _next_ended(ended, runs, left)
        done = []
        for i in ready:
            r = runs[i]
            left.discard(i)
            try:
                out = rt.host.result(r.pending)
                check_structured(r.req, out)  # a broken structured output is no result
            except BaseException as e:
                _ended_run(rt, tally, r, e)
                continue
            if r.tap is not None:
                rt.streams.close(r.tap, True)
                r.tap = None
            done.append((r, out))
        _finish(rt, tally, done, result_key)


def _next_ended(ended: queue.SimpleQueue, runs: list[_Run], left: set[int]) -> list[int]:
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


def _item(item: object) -> tuple[str | None, object]:
    """(request id, kwargs) of one entry, (None, None) when it has no usable id."""
    if not isinstance(item, dict):
        return None, None
    rid = item.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > 200:
        return None, None
    return rid, item.get("kwargs")


def _begin(rt: WorkerRuntime, runs: list[_Run]) -> None:
    """Claim every request in one round trip; a request sent around the producer (no record)
    is recorded first, then claimed alone."""
    s, now = rt.settings, time.time()
    begins = rt.store.begin_many([(r.request_id, 0) for r in runs], rt.name, rt.instance_id,
                                 now, s.max_attempts, s.live_window)
    for r, b in zip(runs, begins):
        if b.action == "missing":
            record_new(rt.store, rt.ports, [(r.request_id, record_fields(
                r.req, now, s.request_deadline), r.req.pool, r.req.job)])
            b = rt.store.begin(r.request_id, 0, rt.name, rt.instance_id, now, s.max_attempts,
                               s.live_window)
        r.begin = b


def _ended_run(rt: WorkerRuntime, tally: dict, r: _Run, e: BaseException) -> None:
    """A run that raised `e` (or could not start): its end or retry settled, its tap closed."""
    try:
        if not isinstance(e, Exception):
            raise e
        _settle(rt, tally, r.request_id, r.kwargs, 0,
                lambda: after_run_error(rt, r.request_id, 0, r.begin, e, r.req.pool, r.tap,
                                        repeats=repeats_output(r.req)))
        r.settled = True
    finally:
        if r.tap is not None:
            rt.streams.close(r.tap, False)
            r.tap = None


def _hand_back_rest(rt: WorkerRuntime, tally: dict, runs: list[_Run], e: Exception) -> None:
    """An exception escaped the serving loop: every request of the message not yet settled is
    aborted in the engine (its tokens so far written to its stream when Redis takes them) and
    goes back alone as its next dispatch, or ends, by the retry decision on `e` (itself when a
    VigilError, else `worker_lost`). One whose claim never came back (the claim itself failed)
    is published as its next dispatch with its record untouched, which the next delivery takes
    over. When Redis cannot be reached for that either, the rest stay in this worker's
    in-flight set, which it hands back itself once Redis returns (workers/held.py
    `reclaim_orphans`)."""
    rest = [r for r in runs if not r.settled]
    log.error("a generate_many message failed with %d of its %d requests unsettled; each goes "
              "back alone: %s", len(rest), len(runs), e, exc_info=e)
    err = e if isinstance(e, VigilError) else TransientError.of(
        WORKER_LOST, f"its worker failed serving its message: {type(e).__name__}: {e}")
    running = {r.request_id for r in rest if r.pending is not None}
    if running:
        rt.host.abort_requests(running)
    for i, r in enumerate(rest):
        try:
            if r.tap is not None:
                rt.streams.write_now(r.tap)  # the next attempt goes on from them
                rt.streams.close(r.tap, False)
                r.tap = None
            mine = type(err)(str(err))
            if r.begin is None:  # not claimed: the record is untouched, its next copy runs
                d = decide(mine, Attempted(None, 0), rt.settings, time.time())
                publish_next(rt, r.request_id, r.kwargs, 1, getattr(d, "countdown", 0.0))
                tally["retried"] += 1
            elif r.begin.action != "run":
                _settle(rt, tally, r.request_id, r.kwargs, 0,
                        lambda r=r: not_run(rt, r.request_id, r.begin, r.req.pool))
            else:
                _settle(rt, tally, r.request_id, r.kwargs, 0,
                        lambda r=r, mine=mine: after_run_error(
                            rt, r.request_id, 0, r.begin, mine, r.req.pool,
                            repeats=repeats_output(r.req)))
            r.settled = True
        except Exception as again:
            gone = isinstance(again, TransientError) and again.code == REDIS_UNAVAILABLE
            # Each of the rest would wait out the outage grace again: leave them all.
            left = [x.request_id for x in rest[i:]] if gone else [r.request_id]
            log.error("could not hand back %s (%s); this worker hands back what its in-flight "
                      "set still names once Redis returns", left, again)
            if gone:
                return


def _settle(rt: WorkerRuntime, tally: dict, request_id: str, kwargs: object, dispatch: int,
            step: Callable[[], dict]) -> None:
    """Run one of service.py's steps for a request and act on its answer: a stored outcome is
    told to Celery's backend (nobody else will: this task returns no per-request result); a
    retry is published alone as the request's next dispatch; a stale copy is dropped."""
    try:
        stored = step()
    except StaleDelivery:
        tally["dropped"] += 1
        return
    except GiveBack:  # its last attempt failed here and another worker serves: back, as it is
        publish_next(rt, request_id, kwargs, dispatch, 0.0)
        tally["retried"] += 1
        return
    except (TransientError, WorkerFatalError) as e:
        decision = e.decision
        if not isinstance(decision, Retry):
            raise
        publish_next(rt, request_id, kwargs, dispatch + 1, decision.countdown)
        tally["retried"] += 1
        return
    except VigilError as e:  # its stored error (it ended failed)
        tell(rt, request_id, Outcome("FAILED", None, type(e).__name__, str(e)))
        tally["failed"] += 1
        return
    tell(rt, request_id, Outcome("SUCCEEDED", stored, "", ""))
    tally["succeeded"] += 1


def _finish(rt: WorkerRuntime, tally: dict, done: list, result_key) -> None:
    """Write every finished run's result in one round trip, each with Celery's result key."""
    if not done:
        return
    results = [(r.request_id, build_result(r.request_id, r.req, out, r.begin.attempts, rt.name),
                result_key(r.request_id) if result_key else None) for r, out in done]
    ends = rt.store.finish_many(results, rt.instance_id, time.time())
    for (r, _), (rid, _, key), (won, stored) in zip(done, results, ends):
        r.settled = True
        tally["succeeded" if stored.status == "SUCCEEDED" else "failed"] += 1
        if won:
            metrics.request_ended(r.req.pool, stored.status, stored.error)
        else:
            metrics.dropped(r.req.pool, "duplicate_result")
            log.warning("request %s already had a result; this attempt's result was dropped",
                        rid)
        if key is None or not key.written:
            tell(rt, rid, stored)


__all__ = ["serve_many", "wire_kwargs"]
