"""`vigil.generate`: the producer contract (docs/api.md).

    from tasks.inference import generate
    r = generate.delay(model="tiny-llama", prompt="Hello", max_tokens=32, job="eval-7")
    r.get(timeout=120)  # {"request_id", "model", "text", "token_ids", "finish_reason", ...}
"""
from __future__ import annotations

from celery.exceptions import Ignore, Reject

from app import app
from app.celery_ports import ports_of
from app.fleet.outcomes import result_key_for
from app.requests.models import get_registry
from app.retry_policy import NEVER_RETRIED, RETRIED
from app.settings import get_settings
from app.state.queues import is_pool_queue
from app.state.store import shared_store
from app.task_names import GENERATE
from tasks.base import VigilTask
from workers import lifecycle
from workers.runtime import get_runtime
from workers.service import GiveBack, StaleDelivery, forward, serve

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
