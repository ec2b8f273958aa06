"""`vigil.generate`: the producer contract (docs/api.md), and `generate_many`, many requests at
once (few messages, each request its own result).

    from tasks.inference import generate, generate_many
    r = generate.delay(model="tiny-llama", prompt="Hello", max_tokens=32, job="eval-7")
    r.get(timeout=120)  # {"request_id", "model", "text", "token_ids", "finish_reason", ...}
    rs = generate_many([{"model": "tiny-llama", "prompt": p, "max_tokens": 1} for p in ps])
"""
from __future__ import annotations

import logging

from celery.exceptions import Ignore, Reject

from app import app
from app.celery_ports import ports_of
from app.fleet.outcomes import result_key_for, result_keys_for
from app.requests.models import get_registry
from app.requests.admit import with_delivery_priority
from app.requests.submit import submit_many
from app.retry_policy import NEVER_RETRIED, RETRIED
from app.settings import get_settings
from app.state.queues import is_pool_queue
from app.state.store import shared_store
from app.task_names import GENERATE, GENERATE_MANY
from tasks.base import VigilRequest, VigilTask
from workers import lifecycle
from workers.runtime import get_runtime
from workers.delivery_answers import GiveBack, StaleDelivery
from workers.forwarding import forward
from workers.service import serve, serve_many

log = logging.getLogger("vigil.service")

# Importing it connects the worker's start-up/shutdown signal handlers and control commands.
WORKER_HOOKS = lifecycle


# Retried (docs/api.md, "Retries"; the table is app/retry_policy.py's): the fleet's and the
# worker's failures, through the one retry path (VigilTask.retry). Never retried: the request's
# own errors and the ends Vigil decided.
@app.task(base=VigilTask, bind=True, name=GENERATE,
          autoretry_for=RETRIED, dont_autoretry_for=NEVER_RETRIED)
def generate(self, **kwargs) -> dict:
    """Generate text for one request; returns the stored result dict (see GenerateResult). A
    message that reached a queue no pool owns is forwarded to its pool's queue instead. Raises
    the request's typed error when it ends failed; a retryable one is retried by Celery."""
    queue = (self.request.delivery_info or {}).get("routing_key")
    # Sent around the producer with Celery's priority= only: the tier it picks (docs/api.md).
    kwargs = with_delivery_priority(kwargs, self.request.delivery_info)
    try:
        if lifecycle.housekeeper() or (queue and not is_pool_queue(queue)):
            forward(shared_store(), get_registry(), get_settings(), ports_of(self.app),
                    self.request.id, self.request.retries or 0, kwargs)
            raise Ignore()
        rt = get_runtime(self.request.hostname or "", ports_of(self.app))
        request, written = self.request, []

        def result_key():  # Celery's result key, written by the finish that stores the result
            written.append(result_key_for(self.backend, request.id, request))
            return written[0]

        out = serve(rt, request.id, request.retries or 0, kwargs, result_key)
        if written and written[0] is not None and written[0].written:
            request.ignore_result = True  # stored already: Celery's mark_as_done skips its write
        return out
    except StaleDelivery:
        raise Ignore()
    except GiveBack:  # stopping: back on the queue, untouched, for another worker
        raise Reject(requeue=True)


@app.task(bind=True, name=GENERATE_MANY, acks_late=True, reject_on_worker_lost=True,
          ignore_result=True, Request=VigilRequest)
def generate_many_task(self, requests=None) -> dict:
    """Serve one message carrying many requests (workers/service.py): each request ends in
    its own record and result, or goes back alone; returns what happened (no one reads it). A
    message that reached a queue no pool owns has each request forwarded to its pool instead."""
    queue = (self.request.delivery_info or {}).get("routing_key")
    ports = ports_of(self.app)
    if lifecycle.housekeeper() or (queue and not is_pool_queue(queue)):
        for item in requests if isinstance(requests, list) else []:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                try:
                    forward(shared_store(), get_registry(), get_settings(), ports, item["id"],
                            0, item.get("kwargs"))
                except Exception as e:  # its stored error, or Redis away: the sweeps end it
                    log.warning("could not forward %s: %s", item["id"], e)
        raise Ignore()
    rt = get_runtime(self.request.hostname or "", ports)
    try:
        return serve_many(rt, requests, result_keys_for(self.backend))
    except GiveBack:  # stopping: the whole message back on its queue, untouched
        raise Reject(requeue=True)


def generate_many(items: list, task_ids: list[str] | None = None,
                  priority: int | None = None) -> list:
    """Submit many requests at once (app/requests/submit.py): each what
    `generate.delay(**kwargs)` would make of it, published as few Celery messages (up to
    VIGIL_REQUESTS_PER_MESSAGE each); returns one AsyncResult per request, in order.

        rs = generate_many([{"model": "tiny-llama", "prompt": p, "max_tokens": 1} for p in ps])
        outs = [r.get(timeout=600) for r in rs]
    """
    return submit_many(items, task_ids, settings=get_settings(), registry=get_registry(),
                       store=shared_store(), ports=ports_of(app), priority=priority)
