"""The house task base class: name, queue, acks, expiry, retry policy and submit-time validation."""
from __future__ import annotations

from celery import Task
from celery.worker.request import Request

from app.errors import INVALID_REQUEST, RequestError, TerminalError, TransientError
from app.requests.models import get_registry
from app.requests.publish import publish
from app.requests.submit import submit_request
from app.settings import get_settings
from app.state.store import RequestStore, shared_store


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
    publishes to the pool's queue with the request id as the Celery task id
    (app/requests/submit.py)."""

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
        """Submit a request (validated, recorded, published), or publish Celery's own retry of
        one (the record already exists and names the new dispatch)."""
        def send(a, kw, **opts):
            return super(VigilTask, self).apply_async(a, kw, **opts)

        kwargs = kwargs or {}
        if options.get("retries"):  # Celery's own republish of a retry
            dispatch = options.pop("retries")
            return publish(task_id, kwargs, model=kwargs.get("model"), job=kwargs.get("job"),
                           dispatch=dispatch, send=send, **options)
        if args:
            raise RequestError.of(INVALID_REQUEST, "pass the request as keyword arguments, "
                                  "e.g. generate.delay(model=..., prompt=...)")
        return submit_request(kwargs, task_id, settings=get_settings(), registry=get_registry(),
                              store=self.store, send=send, **options)
