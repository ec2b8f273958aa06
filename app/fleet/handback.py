"""Handing a worker's requests back: each one it holds is published again for another worker,
or ended when it is out of attempts or time.

The one rule, applied by the reaper to a dead worker (app/fleet/reaper.py), by a worker to
itself when it stops, quarantines or finds after a Redis outage what it no longer holds
(workers/runtime.py), and by the lost-message audit (app/fleet/message_audit.py, through
`requeue` + `republish`). A held request is RUNNING under that worker, or PENDING with its
message in that worker's consumer (received but not begun, or a retry's delayed message): both
need a new message. The record moves to the next dispatch first, then that dispatch's message is
published: a requeue refused because another worker took the request meanwhile publishes
nothing, so no newer message is left behind to run the request a second time, and Celery's own
copy, if it comes back after the visibility timeout, is an older dispatch and is dropped
unexecuted.

A stopping worker's hand-back (SIGTERM: a scale-in, a deploy: a drain) is nobody's fault: a
request it was running goes back `drained`, its attempt refunded, VIGIL_MAX_DRAINS times at
most (then `worker_lost`, using the attempt, as a dead worker's). Its tokens are already in its
stream (workers/held.py), so the next attempt resumes from them.
"""
from __future__ import annotations

import logging
from typing import Callable

from app.errors import DEADLINE_EXCEEDED, DRAINED, WORKER_LOST, TerminalError, TransientError
from app.fleet.outcomes import Backend, end_request
from app.retry_policy import Attempted, End, Limits, decide, may_drain
from app.state.keys import PENDING, RUNNING
from app.state.store import RequestStore

log = logging.getLogger("vigil.housekeeping")

# The error a handed-back request is judged by (app/retry_policy.py): retried at once, while it
# has attempts and time left.
LOST = TransientError.of(WORKER_LOST, "its worker stopped heartbeating and was reaped")
# The error a stopping worker's hand-back (SIGTERM: a drain) is judged by, while the request
# has drains left (VIGIL_MAX_DRAINS): retried at once, its attempt refunded; past them, a
# stopping worker's hand-back is judged as LOST_STOPPING, using the attempt.
DRAINED_BACK = TransientError.of(DRAINED, "its worker stopped and handed it back with its "
                                 "tokens; resumes from them")
LOST_STOPPING = TransientError.of(WORKER_LOST, "its worker stopped and handed it back")

# republish(request_id, record, dispatch): publish the request's message again under `dispatch`
# (app/requests/publish.py `republish`).
Republish = Callable[[str, dict, int], None]


def hand_back_one(store: RequestStore, now: float, request_id: str, instance: int | str,
                  republish: Republish, backend: Backend | None, max_attempts: int,
                  max_drains: int | None = None) -> str:
    """Hand one request of worker instance `instance` back: ended (its deadline passed, or it is
    out of attempts: app/retry_policy.py decides, as for any `worker_lost`) or moved to its
    next dispatch and published again. With `max_drains` (a stopping worker's own hand-back:
    a drain), a request it was running is `drained` instead while it was drained fewer than
    `max_drains` times: its attempt is refunded (`may_drain`). Returns "failed",
    "requeued", or "skipped" when it had ended or moved on (nothing done). Raises what the
    publish raises after the record moved (Redis gone between the two steps: the deadline sweep
    ends that request)."""
    rec = store.get(request_id)
    status = rec.get("status") if rec else None
    if status not in (RUNNING, PENDING) or (status == RUNNING
                                            and rec.get("instance") != str(instance)):
        return "skipped"
    err, drained = LOST, False
    if max_drains is not None:
        drained = status == RUNNING and may_drain(int(rec.get("drains") or 0),
                                                  Limits(max_drains=max_drains))
        err = DRAINED_BACK if drained else LOST_STOPPING
    decision = decide(err, Attempted(int(rec.get("attempts", 0)), int(rec.get("dispatch", 0)),
                                     float(rec.get("deadline_at") or 0)), Limits(max_attempts), now)
    if isinstance(decision, End):
        err = decision.error
        if err.code == DEADLINE_EXCEEDED:
            err = TerminalError.of(DEADLINE_EXCEEDED, "its worker died and the deadline has "
                                   "passed")
        won, _ = end_request(store, request_id, error=err, now=now, pool=rec.get("pool", ""),
                             backend=backend)
        return "failed" if won else "skipped"
    dispatch = int(rec.get("dispatch", 0)) + 1
    reason = str(err) if max_drains is not None else None
    if not store.requeue(request_id, instance, dispatch, now=now, reason=reason,
                         drained=drained):
        return "skipped"
    try:
        republish(request_id, rec, dispatch)
    except Exception as e:  # Redis went away between the two steps: the deadline sweep ends it
        log.error("requeued %s but could not publish it (%s); its deadline will end it",
                  request_id, e)
        raise
    return "requeued"


def hand_back_all(store: RequestStore, now: float, instance: int | str, republish: Republish,
                  backend: Backend | None, max_attempts: int,
                  max_drains: int | None = None) -> tuple[int, int]:
    """Hand back every request a worker instance holds (`hand_back_one` each, drains with
    `max_drains`). Returns (requeued, failed)."""
    requeued = failed = 0
    for rid in store.inflight_ids(instance):
        outcome = hand_back_one(store, now, rid, instance, republish, backend, max_attempts,
                                max_drains)
        requeued += outcome == "requeued"
        failed += outcome == "failed"
    return requeued, failed
