"""Submitting many requests at once: what `generate_many(list_of_kwargs)` runs (tasks/base.py).

Each request is what `generate.delay(**kwargs)` would make of it (app/requests/submit.py: the
same checks, record, id, result key, stream, deadline and attempts), but the messages carry up to
`VIGIL_REQUESTS_PER_MESSAGE` requests each, and the records are written in one round trip per
thousand:

1. Every request is admitted first; one that is wrong raises RequestError naming its index,
   and nothing is written or published.
2. The records are created (app/state/store_many.py). A refusal (backpressure, a deleted job,
   an id reused for another request) deletes what this call created and raises that error:
   all or nothing. An id submitted before with the same request is that request again (its
   result handle is returned; it is published again only if no message carries it).
3. The requests are grouped by queue (pool and job) and tier, and each group is published as
   messages of up to K requests (app/requests/publish.py `publish_many`). If a publish fails,
   the records of what was not published are deleted and TransientError(redis_unavailable) is
   raised with `.submitted`, the handles of what was.

Returns one AsyncResult per request, in order: `get()` works per request, from any process;
reading one reads the finished siblings after it in the same round trip (app/requests/
async_result.py `Siblings`).
Why not Celery's `chunks`: a chunk is one task over many argument tuples, with one result and
one retry for all; here each request keeps its own id, record, result and retry, and a request
that must go back goes back alone (docs/api.md, "Many requests at once").
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from kombu.exceptions import OperationalError

from app.celery_ports import CeleryPorts
from app.errors import INVALID_REQUEST, REDIS_UNAVAILABLE, RequestError, TransientError
from app.requests.async_result import Siblings
from app.requests.models import ModelRegistry
from app.requests.publish import announce_queue, publish_many
from app.requests.admit import admit, with_celery_priority
from app.requests.record_fields import record_fields, wire_kwargs
from app.requests.submit import refusal, same_request_again
from app.requests.version_gate import check_served
from app.settings import VigilSettings
from app.state.store import CREATED, CREATED_NEW_JOB_QUEUE, EXISTS, RequestStore

log = logging.getLogger("vigil.submit")

# Records written per round trip.
CREATE_CHUNK = 1000
MAX_REQUESTS = 100_000


def submit_many(items: list, task_ids: list[str] | None = None, *, settings: VigilSettings,
                registry: ModelRegistry, store: RequestStore, ports: CeleryPorts,
                priority: int | None = None) -> list[Any]:
    """Admit, record and publish many requests (module docstring); one AsyncResult per item,
    in order. `task_ids` names their ids (default: new uuid4s); `priority` is Celery's
    priority= for the requests that name no tier. Raises RequestError (naming the item's
    index), TerminalError(job_deleted), TransientError(overloaded),
    TransientError(workers_too_old) (app/requests/version_gate.py; nothing written) or
    TransientError(redis_unavailable)."""
    if not isinstance(items, (list, tuple)) or not items:
        raise RequestError.of(INVALID_REQUEST, "generate_many takes a non-empty list of "
                              "request kwargs")
    if len(items) > MAX_REQUESTS:
        raise RequestError.of(INVALID_REQUEST, f"{len(items)} requests in one call; at most "
                              f"{MAX_REQUESTS}")
    ids = list(task_ids) if task_ids is not None else [str(uuid.uuid4()) for _ in items]
    if len(ids) != len(items) or len(set(ids)) != len(ids):
        raise RequestError.of(INVALID_REQUEST, "task_ids must name one distinct id per request")
    admitted = []
    for i, kw in enumerate(items):
        try:
            admitted.append(admit(with_celery_priority(kw, priority), settings, registry))
        except RequestError as e:
            raise type(e).of(e.code, f"request {i}: {e.detail}") from None
    for req, spec, _ in admitted:  # a rolling upgrade's old workers (read once per pool)
        check_served(req, spec.name, store.workers, settings)
    now = time.time()
    fields = [record_fields(req, now, settings.request_deadline) for req, _, _ in admitted]
    created, to_publish = [], []
    try:
        for start in range(0, len(ids), CREATE_CHUNK):
            part = list(zip(ids, fields))[start:start + CREATE_CHUNK]
            answers = store.create_many(part, now, max_per_job=settings.max_pending_per_job,
                                        max_per_pool=settings.max_pending_per_pool)
            for (rid, f), answer, (req, spec, _) in zip(part, answers, admitted[start:]):
                if answer in (CREATED, CREATED_NEW_JOB_QUEUE):
                    created.append(rid)
                    to_publish.append((rid, req, spec, f["deadline_at"]))
                    if answer == CREATED_NEW_JOB_QUEUE:
                        _announce(ports, store, spec.name, req.job)
                elif answer == EXISTS:
                    again = same_request_again(store, rid, f, spec.name, req.job)
                    if again is not None:
                        to_publish.append((rid, req, spec, again))
                else:
                    raise refusal(answer, req, settings)
    except BaseException:
        _forget(store, created)
        raise
    _publish(to_publish, store, ports, settings.requests_per_message,
             {rid for rid in created})
    return Siblings.link([ports.result(rid) for rid in ids])


def _publish(todo: list, store: RequestStore, ports: CeleryPorts, per_message: int,
             created: set[str]) -> None:
    """Publish `todo` ((id, request, spec, deadline)) grouped by queue and tier, K a message."""
    groups: dict[tuple[str, str, str], list] = {}
    for rid, req, spec, deadline in todo:
        groups.setdefault((spec.name, req.job, req.priority), []).append((rid, req, deadline))
    done: list[str] = []
    for (pool, job, tier), members in groups.items():
        for start in range(0, len(members), per_message):
            part = members[start:start + per_message]
            try:
                publish_many([(rid, wire_kwargs(req)) for rid, req, _ in part],
                             model=part[0][1].model, job=job, pool=pool, tier=tier,
                             deadline_at=max(d for _, _, d in part), send_many=ports.send_many,
                             message_id=str(uuid.uuid4()))
            except BaseException as e:
                _forget(store, [rid for rid, *_ in todo if rid not in done and rid in created])
                if isinstance(e, (OperationalError, OSError)):
                    err = TransientError.of(REDIS_UNAVAILABLE,
                                            f"could not publish the requests: {e}")
                    err.submitted = [ports.result(rid) for rid in done]
                    raise err from None
                raise
            done.extend(rid for rid, _, _ in part)


def _announce(ports: CeleryPorts, store: RequestStore, pool: str, job: str) -> None:
    try:
        announce_queue(ports.bus, store.workers, pool, job)
    except Exception as e:  # beat's reconcile repairs it
        log.warning("could not announce job %s's queue: %s", job, e)


def _forget(store: RequestStore, request_ids: list[str]) -> None:
    """Delete records this call created and did not publish (no record without a message)."""
    for rid in request_ids:
        try:
            store.delete(rid)
        except TransientError:
            pass  # Redis is gone too: the deadline sweep ends the orphaned record
