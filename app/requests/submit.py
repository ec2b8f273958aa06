"""Submitting a request, producer side: admission, the record, then the message.

`submit_request` is what `generate.apply_async` / `.delay` run (tasks/base.py), and what the demo
and `vigil batch` call directly:

1. `admit` validates the request; a bad one raises RequestError in the producer and nothing
   reaches Redis: schema (app/requests/schemas.py), model known, prompt bytes under
   `max_prompt_bytes`, `max_tokens` within the model's context and the cap, token prompts within
   `max_model_len` and the vocabulary, `n`, the token ids and the result's size within their
   bounds (app/requests/limits.py), a structured output the model's backend compiles
   (app/requests/structured.py), a LoRA adapter allowed. A request that uses a schema version 2
   field is refused (TransientError workers_too_old) while a live worker of its pool predates
   version 2 and would fail it (app/requests/version_gate.py). A text prompt's token count needs
   the tokenizer, so `prompt_too_long` for text is found by the engine, at once, on the first
   attempt.
2. The request id is the caller's `task_id` or a new uuid4, and stays the Celery task id for
   every retry and redelivery.
3. The record is created only if new (app/state/store.py `create`), under the backpressure caps
   (`overloaded`, nothing written) and refused for a deleted job (`job_deleted`). The same id
   and the same request again returns the existing request; a different request under that id is
   `invalid_request`. A job's first request in a pool announces the job's queue to the pool's
   workers.
4. The message is published (app/requests/publish.py). If that fails, the record is deleted again
   (no record without a message) and a broker error becomes TransientError(redis_unavailable).
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from kombu.exceptions import OperationalError

from app.celery_ports import CeleryPorts
from app.errors import (INVALID_REQUEST, JOB_DELETED, OVERLOADED, REDIS_UNAVAILABLE,
                        RequestError, TerminalError, TransientError)
from app.requests.admit import admit, with_celery_priority
from app.requests.models import ModelRegistry
from app.requests.publish import Send, announce_queue, publish
from app.requests.record_fields import record_fields, wire_kwargs
from app.requests.schemas import GenerateRequest
from app.requests.version_gate import check_served
from app.settings import VigilSettings
from app.state.keys import PENDING
from app.state.queues import job_queue_name
from app.state.store import CREATED_NEW_JOB_QUEUE, EXISTS
from app.state.store import JOB_DELETED as JOB_REFUSED
from app.state.store import OVERLOADED_JOB, OVERLOADED_POOL, RequestStore

log = logging.getLogger("vigil.submit")


def submit_request(kwargs: object, task_id: str | None = None, *, settings: VigilSettings,
                   registry: ModelRegistry, store: RequestStore, ports: CeleryPorts,
                   send: Send | None = None, **options) -> Any:
    """Admit, record and publish one request (module docstring) through the Celery app's
    `ports` (app/celery_ports.py); returns Celery's AsyncResult for it (Vigil's result class).
    `send` (default: `ports.send`) and `options` are handed to `publish`. Raises RequestError
    for a bad request, TerminalError(job_deleted), TransientError(overloaded) or
    TransientError(redis_unavailable), or TransientError(workers_too_old) for a request of
    schema version 2 while a worker of its pool would fail it (app/requests/version_gate.py)."""
    send = send or ports.send
    if "priority" in options:  # Celery's own priority= picks the tier the request does not name
        kwargs = with_celery_priority(kwargs, options.pop("priority"))
    req, spec, _ = admit(kwargs, settings, registry)
    check_served(req, spec.name, store.workers, settings)  # a rolling upgrade's old workers
    request_id = task_id or str(uuid.uuid4())
    now = time.time()
    fields = record_fields(req, now, settings.request_deadline)
    # Backpressure: the caps are checked in the same script that writes the record.
    created = store.create(request_id, fields, now, max_per_job=settings.max_pending_per_job,
                           max_per_pool=settings.max_pending_per_pool)
    if created in (OVERLOADED_JOB, OVERLOADED_POOL, JOB_REFUSED):
        raise refusal(created, req, settings)
    if created == CREATED_NEW_JOB_QUEUE:  # its pool's workers must consume it
        try:
            announce_queue(ports.bus, store.workers, spec.name, req.job)
        except Exception as e:  # beat's reconcile repairs it
            log.warning("could not announce job %s's queue: %s", req.job, e)
    if created == EXISTS:
        deadline = same_request_again(store, request_id, fields, spec.name, req.job)
        if deadline is not None:
            publish(request_id, wire_kwargs(req), model=req.model, job=req.job, pool=spec.name,
                    deadline_at=deadline, send=send, **options)
        return ports.result(request_id)
    try:
        return publish(request_id, wire_kwargs(req), model=req.model, job=req.job,
                       pool=spec.name, deadline_at=fields["deadline_at"], send=send, **options)
    except BaseException as e:
        try:
            store.delete(request_id)  # nothing half-written: no record without a message
        except TransientError:
            pass  # Redis is gone too; the deadline sweep ends the orphaned record
        if isinstance(e, (OperationalError, OSError)):
            raise TransientError.of(REDIS_UNAVAILABLE,
                                    f"could not publish the request: {e}") from None
        raise


def refusal(created: int, req: GenerateRequest, settings: VigilSettings) -> Exception:
    """The error of a create the store refused (RequestStore.create's answer): `overloaded` for
    a job's or a pool's cap, `job_deleted` for a deleted job."""
    if created in (OVERLOADED_JOB, OVERLOADED_POOL):
        return overloaded(req, settings, pool_full=created == OVERLOADED_POOL)
    if created == JOB_REFUSED:
        return TerminalError.of(JOB_DELETED, f"job {req.job!r} was deleted; its requests are "
                                "refused (use a new job name)")
    return TransientError.of(REDIS_UNAVAILABLE, f"unexpected answer {created!r} from the "
                             "record's create")


def same_request_again(store: RequestStore, request_id: str, fields: dict, pool: str,
                       job: str) -> float | None:
    """An id whose record already exists: the same request again is one request with one
    result; reusing the id for a different request raises RequestError(invalid_request).
    Returns the deadline to publish it again at when no message carries it (its first
    producer stopped between the record and the message: a SIGKILLed `vigil batch`, say; were
    it only slow, the copy costs one duplicate delivery, never a second run), else None."""
    existing = store.get(request_id) or {}
    if existing.get("request") not in (None, fields["request"]):
        raise RequestError.of(INVALID_REQUEST, f"request id {request_id!r} is already used by "
                              "a different request; use a new task_id")
    if _never_published(store, request_id, existing, pool, job):
        log.warning("request %s had a record but no message anywhere; publishing it",
                    request_id)
        return float(existing["deadline_at"])
    return None


def _never_published(store: RequestStore, request_id: str, record: dict, pool: str,
                     job: str) -> bool:
    """True for a record no attempt ever began and no message carries: PENDING at dispatch 0,
    held by no worker, not in its queue nor fetched (RequestStore.message_missing)."""
    if (record.get("status"), record.get("dispatch"), record.get("attempts")) != (
            PENDING, "0", "0"):
        return False
    return store.message_missing(request_id, job_queue_name(pool, job))


def overloaded(req: GenerateRequest, settings: VigilSettings, *, pool_full: bool
               ) -> TransientError:
    """The `overloaded` error for a submit refused by backpressure (the job's cap, or with
    `pool_full` the pool's): says which cap, and when to try again. The advice is the longest
    backoff Vigil itself uses (`retry_backoff_max`): a backlog at a cap of thousands of requests
    does not clear faster than that."""
    if pool_full:
        what, cap, var = f"pool {req.pool!r}", settings.max_pending_per_pool, "POOL"
    else:
        what, cap, var = f"job {req.job!r}", settings.max_pending_per_job, "JOB"
    return TransientError.of(OVERLOADED, f"{what} has {cap} open requests, its cap "
                             f"(VIGIL_MAX_PENDING_PER_{var}); nothing was sent: retry in "
                             f"~{settings.retry_backoff_max:g} s")
