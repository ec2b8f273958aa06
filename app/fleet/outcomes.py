"""Ending a request: the one way any part of Vigil ends one.

`end_request` does the three things an end takes, together: the set-once finish in Redis (the
first outcome written wins; app/state/store.py), the `vigil_requests` metric when this call's
outcome won, and Celery's result backend, so a caller waiting in `r.get()` wakes with the stored
outcome. The worker serving a request, the deadline sweep, the reaper and a stopping worker
handing back, ending a job, a message dropped as malformed, an expired message: all end
requests through it.

Who tells the backend: a task's own return value reaches Celery's backend by itself, so the
worker serving a request passes no backend. Housekeeping passes one and tells it only when its
end won (a worker's result written first is that worker's to tell). Where Celery itself stored
something else or nothing (an expired message it revoked, a malformed message it never ran),
the caller asks to tell the stored outcome whoever wrote it (`tell_always`).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Protocol

from celery import states
from celery.backends.redis import RedisBackend

from app import metrics
from app.errors import VigilError, error_from_record
from app.state.keys import FAILED
from app.state.results import ResultKey, set_and_publish_many
from app.state.store import RequestStore
from app.state.store_reads import Outcome

log = logging.getLogger("vigil.outcomes")

# The instance id an end is attributed to when no worker ends it (beat's sweeps, job deletes).
SWEEPER_INSTANCE = 0


class Backend(Protocol):
    """What `end_request` needs of Celery's result backend (`app.backend`)."""

    def mark_as_failure(self, task_id: str, exc: BaseException) -> object: ...

    def mark_as_done(self, task_id: str, result: dict) -> object: ...


def end_request(store: RequestStore, request_id: str, *, error: VigilError | None = None,
                result: dict | None = None, now: float | None = None,
                instance: int | str = SWEEPER_INSTANCE, pool: str | None = None,
                backend: Backend | None = None, tell_always: bool = False,
                result_key: ResultKey | None = None) -> tuple[bool, Outcome]:
    """End a request with `result` (SUCCEEDED) or `error` (FAILED), once.

    Returns (won, stored outcome): `won` is False when the request had already ended, and the
    stored outcome is then the earlier one. A won end is counted in `vigil_requests` under
    `pool` (read from the record when not given). With `backend`, the stored outcome is written
    to Celery's result backend when this end won, or always with `tell_always` (a backend that
    cannot be written is logged, not raised: a waiting `r.get()` also reads the record). With
    `result_key` (a worker's result, `result_key_for`), a won end with `result` writes Celery's
    result key in the same script and marks it `written`. Raises
    TransientError(redis_unavailable) when Redis cannot be reached (nothing was written)."""
    if (error is None) == (result is None):
        raise ValueError("end a request with exactly one of error or result")
    now = time.time() if now is None else now
    if result is not None:
        won, stored = store.finish(request_id, instance, now, result=result,
                                   result_key=result_key)
    else:
        won, stored = store.finish(request_id, instance, now, error_kind=type(error).__name__,
                                   error=str(error))
    if won:
        metrics.request_ended(pool if pool is not None else _pool_of(store, request_id),
                              stored.status, stored.error)
    if backend is not None and (won or tell_always):
        try:
            tell_backend(backend, request_id, stored)
        except Exception as e:  # the record is the truth: a waiting r.get() reads it too
            log.warning("request %s ended, but Celery's result backend could not be told: %s",
                        request_id, e)
    return won, stored


def end_many(store: RequestStore, results: list[tuple[str, dict, ResultKey | None, str]],
             instance: int | str, now: float | None = None) -> list[tuple[bool, Outcome]]:
    """`end_request` with a result for each (request id, result, Celery's result key or None,
    pool), set-once each, in one round trip (one request = a list of one); (won, stored
    outcome) in order, each won end counted under its pool. A won end with a result key writes
    that key in the same script and marks it `written`. Raises
    TransientError(redis_unavailable) when Redis cannot be reached (nothing was written)."""
    now = time.time() if now is None else now
    ends = store.finish_many([(rid, result, key) for rid, result, key, _ in results], instance,
                             now)
    for (_, _, _, pool), (won, stored) in zip(results, ends):
        if won:
            metrics.request_ended(pool, stored.status, stored.error)
    return ends


def end_requests_failed(store: RequestStore, request_ids: list[str], error: VigilError, *,
                        now: float | None = None, backend: Backend | None = None) -> int:
    """`end_request` with `error` for many requests at once, as the sweeper (instance 0): one
    script call for every finish (each set-once, as `end_request`'s; a request whose pool the
    reconcile found unserved gets its reason after the error), the metric per won end, and the
    won ends told to `backend` (in one pipeline when it is Celery's Redis backend). Returns how
    many this call won. Raises TransientError(redis_unavailable) when Redis cannot be reached
    (nothing was written)."""
    if not request_ids:
        return 0
    now = time.time() if now is None else now
    ends = store.finish_failed_many(request_ids, str(error), type(error).__name__, now)
    won = []
    for rid, (w, stored, pool) in zip(request_ids, ends):
        if w:
            metrics.request_ended(pool, stored.status, stored.error)
            won.append((rid, stored))
    if backend is not None and won:
        try:
            tell_backend_many(backend, won)
        except Exception as e:  # the record is the truth: a waiting r.get() reads it too
            log.warning("%d requests ended, but Celery's result backend could not be told: %s",
                        len(won), e)
    return len(won)


def tell_backend_many(backend: Backend, outcomes: list[tuple[str, Outcome]]) -> None:
    """`tell_backend` for many outcomes. On Celery's Redis result backend, each result is what
    Celery itself would write (its meta, encoded by the backend, with the backend's expiry,
    published for waiting `get()`s), all in one script call (app/state/results.py) instead of
    two round trips per result (Celery reads the key first, to keep a SUCCESS: a won end here
    has no result before it); the meta is built once per distinct outcome. Any other backend
    is told one by one."""
    if not isinstance(backend, RedisBackend):
        for rid, stored in outcomes:
            tell_backend(backend, rid, stored)
        return
    metas: dict[tuple, dict] = {}
    items = []
    for rid, stored in outcomes:
        if stored.status == FAILED:
            shape = (states.FAILURE, stored.error_kind, stored.error)
        else:
            shape = (states.SUCCESS, json.dumps(stored.result, sort_keys=True))
        meta = metas.get(shape)
        if meta is None:
            value = (error_from_record(stored.error_kind, stored.error)
                     if stored.status == FAILED else stored.result)
            meta = metas[shape] = backend._get_result_meta(
                result=backend.encode_result(value, shape[0]), state=shape[0], traceback=None,
                request=None)
        items.append((backend.get_key_for_task(rid), backend.encode({**meta, "task_id": rid})))
    set_and_publish_many(backend, items)


# Stands for the result in the meta that `result_key_for` encodes, then cuts around.
_RESULT_MARK = "\x00vigil-result\x00"


def result_key_for(backend: Backend, task_id: str, request=None) -> ResultKey | None:
    """Celery's result key for a SUCCESS of `task_id` as Celery's Redis result backend would
    write it now (its meta for `request`, Celery's task context: children, group, the extended
    fields when `result_extended` is on; encoded by the backend; its expiry), cut around the
    result so the finish script can put the result's JSON in. None when the backend is not
    Celery's Redis backend or its encoding cannot be cut that way: Celery then writes the
    result itself."""
    if not isinstance(backend, RedisBackend):
        return None
    meta = backend._get_result_meta(result=_RESULT_MARK, state=states.SUCCESS, traceback=None,
                                    request=request)
    meta["task_id"] = task_id
    encoded = backend.encode(meta)
    if not isinstance(encoded, str):
        return None
    parts = encoded.split(json.dumps(_RESULT_MARK))
    if len(parts) != 2:
        return None
    key = backend.get_key_for_task(task_id)
    return ResultKey(key.decode() if isinstance(key, bytes) else key, parts[0], parts[1],
                     int(backend.expires or 0))


# Stands for the task id in the meta that `result_keys_for` encodes once for many ids.
_ID_MARK = "\x00vigil-task-id\x00"
# How old (seconds) `result_keys_for`'s encoded meta may get before it is built again: its
# `date_done` is the time it was built.
META_REUSE_S = 1.0


def result_keys_for(backend: Backend) -> Callable[[str], ResultKey | None]:
    """`result_key_for(backend, id)` for many ids, with no Celery request context (a message
    carrying many requests, workers/service.py): Celery's meta is built and encoded once,
    cut around the result and the task id, and each id's key is that cut with its id put in
    (JSON-escaped as Celery's encoding would), so each key costs no meta of its own. The meta is
    built again once it is over META_REUSE_S old (its `date_done`). Returns None for every id
    when `result_key_for` would (not Celery's Redis backend, an encoding that cannot be cut)."""
    cut: list = [None, -1.0]  # [(prefix, suffix, id mark) or False, when built (monotonic)]

    def key_for(task_id: str) -> ResultKey | None:
        now = time.monotonic()
        if cut[0] is None or now - cut[1] > META_REUSE_S:
            rk = result_key_for(backend, _ID_MARK)
            mark = json.dumps(_ID_MARK)
            fits = rk is not None and (rk.prefix + rk.suffix).count(mark) == 1
            cut[:] = [(rk.prefix, rk.suffix, mark) if fits else False, now]
        if not cut[0]:
            return None
        prefix, suffix, mark = cut[0]
        put = json.dumps(task_id)
        key = backend.get_key_for_task(task_id)
        return ResultKey(key.decode() if isinstance(key, bytes) else key,
                         prefix.replace(mark, put), suffix.replace(mark, put),
                         int(backend.expires or 0))

    return key_for


def tell_backend(backend: Backend, request_id: str, stored: Outcome) -> None:
    """Write a stored outcome to Celery's result backend: the error rebuilt as its Vigil class,
    or the result."""
    if stored.status == FAILED:
        backend.mark_as_failure(request_id, error_from_record(stored.error_kind, stored.error))
    elif stored.result is not None:
        backend.mark_as_done(request_id, stored.result)


def _pool_of(store: RequestStore, request_id: str) -> str:
    """A record's pool for a metrics label ('' when it cannot be read)."""
    try:
        return store.pool_of(request_id)
    except Exception:  # a metrics label is not worth failing an end over
        return ""
