"""The house task base class: name, queue, acks, expiry, retry policy and submit-time validation."""
from __future__ import annotations

import datetime as dt
import logging
import time
import uuid

from celery import Task
from celery.worker.request import Request
from kombu.exceptions import OperationalError

from app.celery_app import outage_retry_policy
from app.errors import JOB_DELETED, REDIS_UNAVAILABLE, RequestError, TerminalError, TransientError
from app.fleet.jobs import announce_queue
from app.state.queues import job_queue
from app.requests.models import get_registry
from app.settings import get_settings
from app.state.store import (CREATED_NEW_JOB_QUEUE, OVERLOADED_JOB, OVERLOADED_POOL, RequestStore,
                       shared_store)
from app.state.store import JOB_DELETED as JOB_DELETED_CODE
from app.requests.submit import (EXPIRES_GRACE_S, admit, effective_deadline, overloaded, record_fields,
                        wire_kwargs)

log = logging.getLogger("vigil.submit")


def kwargs_repr(model: object, job: object) -> str:
    """What Flower, events and logs show of a request's kwargs: its model and job, never the
    prompt (user data)."""
    return f"{{model: {model!r}, job: {job!r}}}"


class VigilRequest(Request):
    """A Vigil message inside the worker. Celery answers `inspect reserved` and `inspect
    scheduled` (Flower's worker view asks both) with each request's real args and kwargs, prompt
    included; Vigil's answer carries the message's argsrepr and kwargsrepr (model and job) instead,
    as `inspect active` does when asked with safe=True."""

    def info(self, safe=False):
        """The request as inspect commands report it, always in its safe form."""
        return super().info(safe=True)


class VigilTask(Task):
    """Base for Vigil's tasks. `apply_async` validates before publishing (a bad request raises
    RequestError in the producer and nothing is enqueued), writes the request record, then
    publishes to the pool's queue with the request id as the Celery task id."""

    abstract = True
    Request = VigilRequest
    acks_late = True
    reject_on_worker_lost = True
    max_retries = None  # bounded by Vigil's own attempt count (VIGIL_MAX_ATTEMPTS)
    # Expected outcomes: logged at INFO without a traceback, not as worker errors.
    throws = (RequestError, TerminalError, TransientError)

    @property
    def store(self) -> RequestStore:
        return shared_store()

    def apply_async(self, args=None, kwargs=None, task_id=None, **options):
        if options.get("retries"):  # Celery's own republish of a retry: the record exists
            # Celery would repr the kwargs, prompt included, into the retried message's headers
            # (and from there into Flower and the worker's events): keep model and job only.
            options.setdefault("argsrepr", "()")
            options.setdefault("kwargsrepr", kwargs_repr((kwargs or {}).get("model"),
                                                         (kwargs or {}).get("job")))
            # The record already moved to this dispatch: keep trying through a Redis restart.
            options.setdefault("retry_policy", outage_retry_policy(get_settings()))
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        if args:
            raise RequestError("invalid_request: pass the request as keyword arguments, "
                               "e.g. generate.delay(model=..., prompt=...)")
        settings = get_settings()
        req, spec = admit(kwargs or {}, settings, get_registry())
        request_id = task_id or str(uuid.uuid4())
        now = time.time()
        fields = record_fields(req, now, settings.request_deadline)
        # Backpressure: the caps are checked in the same script that writes the record.
        created = self.store.create(request_id, fields, now,
                                    max_per_job=settings.max_pending_per_job,
                                    max_per_pool=settings.max_pending_per_pool)
        if created in (OVERLOADED_JOB, OVERLOADED_POOL):  # nothing written, nothing published
            raise overloaded(req, settings, pool_full=created == OVERLOADED_POOL)
        if created == JOB_DELETED_CODE:
            raise TerminalError.of(JOB_DELETED, f"job {req.job!r} was deleted; its requests are "
                                   "refused (use a new job name)")
        if created == CREATED_NEW_JOB_QUEUE:  # the pool's workers must consume the job's queue
            try:
                announce_queue(self.store.r, spec.name, req.job)
            except Exception as e:  # beat's reconcile repairs it
                log.warning("could not announce job %s's queue: %s", req.job, e)
        if not created:
            # The same id submitted again is one request with one result, as long as it is the
            # same request; reusing an id for a different request is a mistake worth a loud error.
            existing = self.store.get(request_id) or {}
            if existing.get("request") not in (None, fields["request"]):
                raise RequestError(f"invalid_request: request id {request_id!r} is already used "
                                   "by a different request; use a new task_id")
            return self.AsyncResult(request_id)
        expires = dt.datetime.fromtimestamp(
            now + effective_deadline(req, settings.request_deadline) + EXPIRES_GRACE_S,
            tz=dt.timezone.utc)
        options.setdefault("queue", job_queue(spec.name, req.job))
        try:
            return super().apply_async(
                (), wire_kwargs(req), task_id=request_id, expires=expires,
                # Flower and logs show the model and job, never the prompt (user data).
                argsrepr="()", kwargsrepr=kwargs_repr(req.model, req.job),
                **options)
        except BaseException as e:
            try:
                self.store.delete(request_id)  # nothing half-written: no record without a message
            except TransientError:
                pass  # Redis is gone too; the deadline sweep ends the orphaned record
            if isinstance(e, (OperationalError, OSError)):
                raise TransientError.of(REDIS_UNAVAILABLE,
                                        f"could not publish the request: {e}") from None
            raise
