"""Cancelling requests: `AsyncResult(id).revoke()`, `app.control.revoke(id)` (Celery's own
cancel, Flower's Revoke and Terminate buttons), and `vigil request cancel ID`.

The request ends `cancelled` (TerminalError) through the set-once finish, so exactly once
however many cancels and workers race, and a result written first still wins; Celery's result
backend is told the stored outcome. Then every worker is told to abort it in its engine (the
control bus' `vigil_abort`): a running generation stops at its next engine step, and its
tokens streamed so far stay readable (the stream's end entry is written by the same finish). A
queued copy, delivered later to any worker, meets the ended record and is dropped unexecuted
(a duplicate delivery). An id with no record, or one that already ended, changes nothing and
gets a clear answer: not even Celery's revoked set, which a revoke fills for 3 h and whose ids a
worker drops unrun as `cancelled`, gets it (a later request under that id, a caller's own
`task_id` or a `generate_many` request's retry, must run). Only `revocable` ids go there.
"""
from __future__ import annotations

import logging

from app.control import ControlBus
from app.errors import CANCELLED, TerminalError
from app.fleet.outcomes import Backend, end_request
from app.state.keys import FAILED, TERMINAL
from app.state.store import RequestStore

log = logging.getLogger("vigil.cancel")

# What a cancel answers per request id.
ENDED_NOW = "cancelled"  # it was open: it ends cancelled now
ALREADY_ENDED = "already ended"  # it had ended before (its outcome stays)
UNKNOWN = "unknown"  # no record: never submitted, or expired after VIGIL_RESULT_TTL


def cancel_requests(store: RequestStore, request_ids: list[str], *, backend: Backend | None,
                    bus: ControlBus | None, now: float | None = None,
                    reason: str = "cancelled by its submitter") -> dict[str, str]:
    """Cancel each of `request_ids` (module docstring); returns id -> ENDED_NOW, ALREADY_ENDED
    (with the stored status, e.g. "already ended (SUCCEEDED)") or UNKNOWN. The abort broadcast
    (`bus`) is best effort: a worker that misses it stops the generation at its next heartbeat
    (it aborts what ended elsewhere). Raises TransientError(redis_unavailable) when Redis
    cannot be reached."""
    out: dict[str, str] = {}
    for rid in dict.fromkeys(request_ids):
        rec = store.get(rid)
        if rec is None:
            out[rid] = UNKNOWN
            continue
        if rec.get("status") in TERMINAL:
            out[rid] = f"{ALREADY_ENDED} ({rec['status']})"
            continue
        won, stored = end_request(store, rid, error=TerminalError.of(CANCELLED, reason),
                                  now=now, backend=backend, tell_always=True)
        out[rid] = ENDED_NOW if won else f"{ALREADY_ENDED} ({stored.status})"
    cancelled = [rid for rid, what in out.items() if what == ENDED_NOW]
    if cancelled and bus is not None:
        try:
            bus.abort_requests(cancelled)
        except Exception as e:  # each worker's heartbeat aborts what ended elsewhere anyway
            log.warning("cancel: the abort broadcast failed (%s); the workers stop these "
                        "requests at their next heartbeat", e)
    return out


def revocable(store: RequestStore, request_ids: list[str]) -> list[str]:
    """The ids among `request_ids` that Celery's revoked set may take: those whose record has
    ended `cancelled` (by this cancel or an earlier one), whose copies are dropped unrun anyway.
    An unknown id, or one that ended any other way, is left out: in that set it would make a
    worker drop a later request under the same id as `cancelled` for 3 h. Raises
    TransientError(redis_unavailable) when Redis cannot be reached."""
    out = []
    for rid in dict.fromkeys(request_ids):
        rec = store.get(rid) or {}
        if rec.get("status") == FAILED and rec.get("error", "").startswith(f"{CANCELLED}:"):
            out.append(rid)
    return out
