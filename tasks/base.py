"""The house task base class: name, queue, acks, expiry, retry policy and submit-time validation.

The retry policy in Celery's terms: `vigil.generate` declares which errors Celery's autoretry
takes (tasks/inference.py, from app/retry_policy.py's table); the delay of each retry is the
one decision's (app/retry_policy.py `decide`: made by the worker's service, or here for an
error that escaped it undecided), applied by the one retry path, `VigilTask.retry`."""
from __future__ import annotations

from celery import Signature, Task
from celery.worker.request import Request
from kombu.utils.objects import cached_property

from app.celery_ports import ports_of
from app.errors import INVALID_REQUEST, RequestError, TerminalError, TransientError, VigilError
from app.retry_policy import Attempted, Retry, decide
from app.requests.models import get_registry
from app.requests.publish import publish
from app.requests.submit import submit_request
from app.settings import get_settings
from app.state.store import RequestStore, shared_store

# Celery's own bound on a return value's repr (celery.app.task.Task.resultrepr_maxsize).
CELERY_RESULTREPR_MAXSIZE = Task.resultrepr_maxsize


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
    # Expected outcomes: logged at INFO without a traceback, not as worker errors.
    throws = (RequestError, TerminalError, TransientError)
    # No bound on Celery's own count of retries: the request's record counts the attempts
    # (app/retry_policy.py `decide` ends a request out of them, BEGIN refuses one more), while
    # Celery's `retries` counts every dispatch, waits that used no attempt and copies a reaper or
    # a stopping worker republished included, so it never ends a request itself.
    max_retries = None

    @property
    def resultrepr_maxsize(self) -> int:
        """How much of a return value's repr Celery keeps for its success log line and its
        `task-succeeded` event: none unless VIGIL_LOG_PAYLOADS. A result holds generated text
        (user data), and Celery builds that repr for every request whether it is shown or not
        (120 us for a 128-token result here)."""
        return CELERY_RESULTREPR_MAXSIZE if get_settings().log_payloads else 0

    @property
    def store(self) -> RequestStore:
        return shared_store()

    def retry(self, args=None, kwargs=None, exc=None, throw=True, eta=None, countdown=None,
              max_retries=None, **options):
        """The one retry path (Celery's autoretry calls it for `autoretry_for`): a VigilError is
        published again as the next dispatch after the delay of its retry decision
        (app/retry_policy.py): the one the worker's service made and the error carries, or, for
        an error that escaped the service undecided (Redis unreachable mid-delivery: no attempt
        counted), one made here on the dispatch. The record has already counted the attempt and
        named that dispatch (workers/service.py), so Celery's count of retries is not a bound:
        none is passed on (`max_retries`, above), whatever Celery's autoretry hands in."""
        if isinstance(exc, VigilError):
            dispatch = self.request.retries or 0
            decision = exc.decision
            if not isinstance(decision, Retry):
                decision = decide(exc, Attempted(None, dispatch), get_settings(), 0.0)
            countdown, eta, max_retries = getattr(decision, "countdown", 0.0), None, None
        return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                             countdown=countdown, max_retries=max_retries, **options)

    def signature_from_request(self, request=None, args=None, kwargs=None, queue=None,
                               **extra_options):
        """Celery's signature of the next dispatch (what its `retry` publishes), as a
        RetrySignature: publishing it goes to `publish_retry`, never to `apply_async`, which
        only submits."""
        sig = RetrySignature(super().signature_from_request(request, args, kwargs, queue,
                                                            **extra_options), app=self.app)
        sig._type = self
        return sig

    def _send(self, args, kwargs, **options):
        """Celery's own publish of this task (below Vigil's submit)."""
        return super().apply_async(args, kwargs, **options)

    def publish_retry(self, args=None, kwargs=None, task_id=None, retries=0, **options):
        """Publish Celery's retry of a request as its next dispatch (`retries`): the record
        already exists and names it (workers/service.py), so nothing is validated or recorded;
        the message is shaped as every message of a request is (app/requests/publish.py)."""
        kwargs = kwargs or {}
        return publish(task_id, kwargs, model=kwargs.get("model"), job=kwargs.get("job"),
                       dispatch=retries, send=self._send, **options)

    def apply_async(self, args=None, kwargs=None, task_id=None, **options):
        """Submit a request: validated, recorded, published (app/requests/submit.py). Celery's
        canvas works as far as it sends plain messages (`group`, a one-task `chain`); a chain
        of several, a chord or a link (callbacks) is refused here with RequestError
        (invalid_request), nothing recorded: a worker drops a message carrying them
        (workers/consumer.py), and the next request could not take this one's result anyway
        (keyword arguments only)."""
        if args:
            raise RequestError.of(INVALID_REQUEST, "pass the request as keyword arguments, "
                                  "e.g. generate.delay(model=..., prompt=...)")
        carried = [name for name in CANVAS_CALLBACKS if options.get(name)]
        if carried:
            raise RequestError.of(INVALID_REQUEST, (
                f"Vigil runs no Celery callbacks ({', '.join(carried)}): chain requests in your "
                "own code (wait for r.get(), then submit the next), or submit them together "
                "with group() or generate_many()"))
        return submit_request(kwargs or {}, task_id, settings=get_settings(),
                              registry=get_registry(), store=self.store,
                              ports=ports_of(self.app), send=self._send, **options)


# Celery's options that make a message carry other tasks to run after it (its embed's
# callbacks, errbacks, chain and chord: what the worker's message guard drops).
CANVAS_CALLBACKS = ("link", "link_error", "chain", "chord")


class RetrySignature(Signature):
    """The signature Celery's `retry` publishes: through the task's `publish_retry`."""

    @cached_property
    def _apply_async(self):
        return self.type.publish_retry
