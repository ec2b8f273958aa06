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

import json
import logging
import re
import time
import uuid
from typing import Any

from kombu.exceptions import OperationalError

from app.celery_ports import CeleryPorts
from app.errors import (INVALID_REQUEST, JOB_DELETED, OVERLOADED, PROMPT_TOO_LONG,
                        REDIS_UNAVAILABLE, TOKEN_OUT_OF_VOCAB, RequestError, TerminalError,
                        TransientError)
from app.requests.adapters import AdapterRef, resolve_adapter
from app.requests.limits import check_limits
from app.requests.models import ModelRegistry, ModelSpec
from app.requests.publish import Send, announce_queue, publish
from app.requests.schemas import JOB_PATTERN, MAX_DEADLINE_S, GenerateRequest, parse_request
from app.requests.structured import backend_of, check_compiles
from app.requests.tiers import tier_of_celery_priority
from app.requests.version_gate import check_served
from app.settings import VigilSettings
from app.state.keys import PENDING
from app.state.queues import DEFAULT_JOB, job_queue_name
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
    req, spec = admit(kwargs, settings, registry)
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


def with_celery_priority(kwargs: object, priority: object) -> object:
    """`kwargs` with the tier that Celery's `priority=` option picks (app/requests/tiers.py),
    unless the request names its own `priority`; RequestError(invalid_request) for a priority
    that is not an int 0-9."""
    if priority is None or not isinstance(kwargs, dict) or "priority" in kwargs:
        return kwargs
    if type(priority) is not int or not 0 <= priority <= 9:
        raise RequestError.of(INVALID_REQUEST, f"priority={priority!r}: Celery's priority is an "
                              "int 0-9 (0 first), or name the tier: priority='interactive', "
                              "'default' or 'bulk'")
    return {**kwargs, "priority": tier_of_celery_priority(priority)}


def with_delivery_priority(kwargs: object, delivery_info: dict | None) -> object:
    """`kwargs` of a delivered message with the tier its Celery message priority picks
    (`with_celery_priority`), unless the request names its own: a message sent around the
    producer (`app.send_task("vigil.generate", kwargs=..., priority=9)`) is bulk as
    `apply_async(priority=9)` would have made it. Priority 0 names no tier here: kombu's Redis
    transport gives every message published without a priority 0, so a plain `send_task`
    cannot be told from one that asked for 0 (it stays default; `priority=1` or 2, or the
    `priority` field, makes it interactive). Vigil's own messages carry their tier in their
    kwargs (app/requests/publish.py). Anything but an int 1-9 is left alone."""
    prio = (delivery_info or {}).get("priority")
    if type(prio) is not int or not 1 <= prio <= 9:
        return kwargs
    return with_celery_priority(kwargs, prio)


def _never_published(store: RequestStore, request_id: str, record: dict, pool: str,
                     job: str) -> bool:
    """True for a record no attempt ever began and no message carries: PENDING at dispatch 0,
    held by no worker, not in its queue nor fetched (RequestStore.message_missing)."""
    if (record.get("status"), record.get("dispatch"), record.get("attempts")) != (
            PENDING, "0", "0"):
        return False
    return store.message_missing(request_id, job_queue_name(pool, job))


def admit(kwargs: object, settings: VigilSettings, registry: ModelRegistry
          ) -> tuple[GenerateRequest, ModelSpec]:
    """Validate a submission; returns the request and its pool's spec or raises RequestError."""
    req = parse_request(kwargs)
    spec = registry.get(req.model)
    check_prompt_size(req, settings)
    limit = min(settings.max_tokens_cap, spec.max_model_len or settings.max_tokens_cap)
    if req.max_tokens > limit:
        raise RequestError.of(INVALID_REQUEST, f"max_tokens={req.max_tokens} is above {limit}, "
                              f"the most {spec.name} can generate")
    ids = req.prompt_token_ids
    if ids is not None:
        if spec.max_model_len and len(ids) > spec.max_model_len:
            raise RequestError.of(PROMPT_TOO_LONG, f"prompt has {len(ids)} tokens; {spec.name} "
                                  f"accepts at most {spec.max_model_len}")
        if spec.vocab_size and max(ids) >= spec.vocab_size:
            bad = next(t for t in ids if t >= spec.vocab_size)
            raise RequestError.of(TOKEN_OUT_OF_VOCAB, f"token id {bad} is out of vocabulary "
                                  f"({spec.name} has {spec.vocab_size} tokens)")
    check_limits(req, spec, settings)
    if req.structured is not None:
        check_compiles(req.structured, backend_of(spec.engine_args), spec.name)
    if req.lora is not None:
        adapter_for(req, spec, settings, registry)
    return req, spec


def check_prompt_size(req: GenerateRequest, settings: VigilSettings) -> None:
    """RequestError(invalid_request) when the prompt is over `max_prompt_bytes`: checked at
    submit and again in the worker, so an oversized prompt sent around the producer never
    reaches the tokenizer."""
    size = req.prompt_bytes()
    if size > settings.max_prompt_bytes:
        raise RequestError.of(INVALID_REQUEST, f"prompt is {size} bytes; the limit is "
                              f"{settings.max_prompt_bytes} (VIGIL_MAX_PROMPT_BYTES)")


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


def adapter_for(req: GenerateRequest, spec: ModelSpec, settings: VigilSettings,
                registry: ModelRegistry) -> AdapterRef:
    """The AdapterRef a LoRA request names; RequestError(invalid_request) if the model serves no
    adapters or the name/path is not allowed (app/requests/adapters.py)."""
    if spec.max_loras == 0:
        raise RequestError.of(INVALID_REQUEST, f"model {spec.name} serves no LoRA adapters")
    return resolve_adapter(req.lora, spec.name, registry.adapters, settings.adapter_roots)


def effective_deadline(req: GenerateRequest, default: float) -> float:
    """Seconds from submission until the request must have ended."""
    return req.deadline_s if req.deadline_s is not None else default


def record_fields(req: GenerateRequest, now: float, default_deadline: float) -> dict:
    """The fields of a new PENDING request record (app/state/keys.py lists them)."""
    return {
        "status": PENDING, "model": req.model, "pool": req.pool, "job": req.job,
        "priority": req.priority,
        **({"lora": req.lora} if req.lora is not None else {}),
        "request": json.dumps(wire_kwargs(req)), "created_at": now,
        "deadline_at": now + effective_deadline(req, default_deadline),
        "attempts": 0, "dispatch": 0,
    }


def provisional_fields(kwargs: dict, now: float, default_deadline: float) -> dict | None:
    """The record of a message this code cannot read (a newer schema version, sent around the
    producer), from the fields every version keeps: model, job, deadline_s; the request kept as
    sent. None when its job or deadline cannot be read (the message is refused instead)."""
    job = kwargs.get("job", DEFAULT_JOB)
    deadline = kwargs.get("deadline_s", default_deadline)
    if not isinstance(job, str) or re.match(JOB_PATTERN, job) is None:
        return None
    if type(deadline) not in (int, float) or not 0 < deadline <= MAX_DEADLINE_S:
        return None
    try:
        request = json.dumps(kwargs)
    except (TypeError, ValueError, RecursionError):
        return None
    model = kwargs["model"]
    return {"status": PENDING, "model": model, "pool": model, "job": job, "request": request,
            "created_at": now, "deadline_at": now + deadline, "attempts": 0, "dispatch": 0}


def wire_kwargs(req: GenerateRequest) -> dict:
    """The message kwargs for a validated request (JSON-safe, defaults omitted)."""
    return req.model_dump(mode="json", by_alias=True, exclude_none=True,
                          exclude_defaults=True) | {
        "model": req.model, "schema_version": req.schema_version}
