"""Redis tier: the one retry path (VigilTask.retry, tasks/base.py) inside a real Celery worker.

pytest-celery's fixtures (re-exported from celery.contrib.pytest): `celery_app` is a Celery app on
Vigil's own configuration (tests/conftest.py, `celery_config`: database 1, flushed per test) and
`inprocess_worker` its in-process worker (threads pool; tests/conftest.py). A task built on VigilTask with
`vigil.generate`'s own autoretry declaration raises scripted errors; Celery's autoretry hands
each to the retry path, which republishes the next dispatch (Celery's `retries` header) after
the delay of its retry decision (app/retry_policy.py: carried by the error, or made there). The worker-side bookkeeping around it
(the record counting attempts) is workers/service.py's, tested in test_store_and_service.py;
the engine path end to end is the worker tier's.
"""
from __future__ import annotations

import threading
import time
from datetime import datetime

import pytest

from app.errors import (LORA_ADAPTER_PENDING, WEDGED, RequestError, TerminalError, TransientError,
                        WorkerFatalError)
from app.retry_policy import Attempted, decide
from app.settings import get_settings
from app.state.queues import HOUSEKEEPING_QUEUE
from tasks.base import VigilTask
from tasks.inference import generate

pytestmark = pytest.mark.redis
NAME = "vigil.test.scripted"
BACKOFF_S = 1.0  # VIGIL_RETRY_BACKOFF and its cap: a backed-off retry waits (0, 1] s


def _decided(e, attempts: int):
    """`e` as the worker's service raises it: carrying its decision (app/retry_policy.py)."""
    e.decision = decide(e, Attempted(attempts, attempts - 1), get_settings(), time.time())
    return e


def _wedged():
    return _decided(TransientError.of(WEDGED, "no answer"), 1)


def _fatal():
    # Undecided, as an error that escaped the service: the task's retry path decides.
    return WorkerFatalError.of("cuda_context_lost", "CUDA error")


# Per case, what each dispatch raises (None: it returns).
SCRIPTS = {
    "at_once_backoff_request_error": [_wedged, lambda: TransientError.of(
        LORA_ADAPTER_PENDING, "still being written"), lambda: RequestError.of(
            "prompt_too_long", "600 > 512")],
    "worker_fatal_then_success": [_fatal, None],
    "terminal": [lambda: TerminalError.of("deadline_exceeded", "too late")],
}


@pytest.fixture()
def scripted(celery_app, monkeypatch):
    """The scripted task on `celery_app`, registered before the worker starts; its deliveries
    (dispatch, eta, when it raised) by case. VIGIL_MAX_ATTEMPTS=1 (one attempt): Celery's own
    count of retries must not end a request the record still allows."""
    monkeypatch.setenv("VIGIL_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("VIGIL_RETRY_BACKOFF", str(BACKOFF_S))
    monkeypatch.setenv("VIGIL_RETRY_BACKOFF_MAX", str(BACKOFF_S))
    get_settings.cache_clear()
    seen: dict[str, list[dict]] = {}
    lock = threading.Lock()

    @celery_app.task(base=VigilTask, bind=True, name=NAME, autoretry_for=generate.autoretry_for,
                     dont_autoretry_for=generate.dont_autoretry_for)
    def run(self, case: str, model: str = "tiny-llama"):
        with lock:
            seen.setdefault(case, []).append({"dispatch": self.request.retries,
                                              "eta": self.request.eta, "at": time.time()})
        make = SCRIPTS[case][self.request.retries]
        if make is None:
            return {"dispatch": self.request.retries}
        raise make()

    yield seen
    monkeypatch.undo()  # the environment back first, then the settings read from it
    get_settings.cache_clear()


def send(app, case: str):
    return app.send_task(NAME, kwargs={"case": case, "model": "tiny-llama"},
                         queue=HOUSEKEEPING_QUEUE)


def eta_s(delivery: dict) -> float | None:
    eta = delivery["eta"]
    return None if eta is None else datetime.fromisoformat(eta).timestamp()


def test_a_wedge_is_retried_at_once_a_pending_adapter_after_backoff_a_request_error_never(
        scripted, celery_app, inprocess_worker):
    """Given a task that raises wedged, then lora_adapter_pending, then prompt_too_long, when a
    real worker runs it with VIGIL_MAX_ATTEMPTS=1, then the wedge's retry (dispatch 1) carries
    no eta, the pending adapter's (dispatch 2) an eta within the backoff of when it raised, and
    the request error ends it: FAILURE with RequestError, three deliveries in all."""
    r = send(celery_app, "at_once_backoff_request_error")
    with pytest.raises(RequestError, match="^prompt_too_long"):
        r.get(timeout=30, propagate=True)
    d = scripted["at_once_backoff_request_error"]
    assert [x["dispatch"] for x in d] == [0, 1, 2]
    assert eta_s(d[1]) is None  # at once
    eta = eta_s(d[2])
    assert eta is not None and d[1]["at"] - 0.5 <= eta <= d[1]["at"] + BACKOFF_S + 0.5
    assert d[2]["at"] >= eta - 0.05  # the worker held it until its eta


def test_a_worker_fatal_error_is_retried_at_once_and_a_terminal_error_never(
        scripted, celery_app, inprocess_worker):
    """Given a task that raises cuda_context_lost then returns, its retry runs at once (no eta)
    and its result is the second dispatch's; a TerminalError is not retried."""
    assert send(celery_app, "worker_fatal_then_success").get(timeout=30) == {"dispatch": 1}
    d = scripted["worker_fatal_then_success"]
    assert [x["dispatch"] for x in d] == [0, 1] and eta_s(d[1]) is None
    with pytest.raises(TerminalError, match="^deadline_exceeded"):
        send(celery_app, "terminal").get(timeout=30)
    assert [x["dispatch"] for x in scripted["terminal"]] == [0]
