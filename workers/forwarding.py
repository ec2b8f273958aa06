"""A request message that reached a queue no pool owns (vigil.housekeeping, where a producer
without `queue=` lands, or the housekeeper's): sent on to its pool's queue, run nowhere here.
The task (tasks/inference.py) calls `forward` for such a message of one request and for each
request of such a message of many."""
from __future__ import annotations

from app.celery_ports import CeleryPorts
from app.errors import RequestError
from app.fleet.outcomes import end_request
from app.requests.models import ModelRegistry
from app.requests.submit import resubmit
from app.settings import VigilSettings
from app.state.store import RequestStore
from workers.delivery_answers import outcome


def forward(store: RequestStore, registry: ModelRegistry, settings: VigilSettings,
            ports: CeleryPorts, request_id: str, dispatch: int, kwargs: object) -> None:
    """A vigil.generate message that reached a queue no pool owns (vigil.housekeeping, where a
    producer without `queue=` lands, or the housekeeper): sent on to its pool's queue under the
    same id and dispatch (app/requests/submit.py `resubmit`), running nothing here. Raises the
    request's stored error when it cannot be served (ended as workers/service.py `serve` would
    end it)."""
    try:
        resubmit(request_id, dispatch, kwargs, settings=settings, registry=registry,
                 store=store, ports=ports)
    except RequestError as e:
        _, stored = end_request(store, request_id, error=e, pool="")
        outcome(stored)
