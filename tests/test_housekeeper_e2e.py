"""Worker tier: the housekeeper. Beat's tasks run on threads of their own in a process that never
loads an engine, so nothing a worker does (or the absence of any worker) delays a sweep.

On a Redis of its own: the suite's session worker also consumes vigil.housekeeping, and would
run the sweeps that this test must see the housekeeper run.
"""
from __future__ import annotations

import sys

import pytest

from app.celery_app import create_app
from app.errors import TerminalError
from app.local.embedded import (start_housekeeper, start_process, stop_process, vigil_env,
                                wait_for)
from app.requests.models import get_registry
from app.requests.submit import submit_request
from app.settings import load_settings
from app.state.registry import WorkerRegistry
from app.state.store import RequestStore
from tests.conftest import SLOW_START_MODEL, UNSERVED_MODEL
from tests.worker_procs import RunningWorker
from tests.redis_servers import LocalRedis

pytestmark = pytest.mark.worker
SWEEP_S = 2
DEADLINE_S = 5
# The bound the housekeeper keeps: a request nobody serves ends within its deadline, one sweep
# interval and 5 s.
BOUND_S = DEADLINE_S + SWEEP_S + 5
ENV = dict(VIGIL_DEADLINE_SWEEP_INTERVAL=str(SWEEP_S))


@pytest.fixture()
def fleet(tmp_path):
    """A private Redis, beat sweeping every 2 s, and the housekeeper: no worker yet."""
    from app import app as suite_app

    redis = LocalRedis().start()
    procs = []
    try:
        procs.append(start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l",
                                    "INFO", "-s", str(tmp_path / "schedule")],
                                   vigil_env(redis.url, **ENV), tmp_path / "beat.log"))
        procs.append(start_housekeeper(redis.url, tmp_path / "housekeeper.log", **ENV))
        yield redis, procs
    finally:
        for p in procs:
            stop_process(p, timeout=60)
        redis.stop()
        suite_app.set_current()  # the private producer app made itself current


def producer(redis_url: str):
    """A Celery app and store of this test's Redis, and a submit through the real producer path."""
    settings = load_settings(redis_url=redis_url)
    private = create_app(settings)
    store = RequestStore(private.vigil_store.raw, settings.result_ttl)

    def submit(**kwargs):
        r = submit_request(kwargs, settings=settings, registry=get_registry(), store=store,
                           ports=private.vigil_ports)
        return private.AsyncResult(r.id)

    return private, store, submit


def ended_within(store: RequestStore, request_id: str) -> float:
    """Seconds from the request's submission to its end, from its record."""
    rec = store.get(request_id)
    assert rec["status"] == "FAILED", rec
    return float(rec["finished_at"]) - float(rec["created_at"])


def test_the_housekeeper_sweeps_with_no_worker_and_beside_a_worker_whose_threads_are_all_busy(
        fleet, tmp_path):
    """Given beat and the housekeeper and no worker at all, when a request with a 5 s deadline is
    submitted, then it ends deadline_exceeded within its deadline + one sweep + 5 s. Given then a
    worker whose every task thread waits for an engine start (two threads, a start the drill
    slows by 10 s on top of the engine's own ~20 s), the
    same holds for a second request, and a vigil.generate message sent without a queue (onto
    vigil.housekeeping) is forwarded to its pool by the housekeeper and served once the engine
    is up. The housekeeper never registers as a worker and never loads an engine."""
    redis_server, _ = fleet
    private, store, submit = producer(redis_server.url)

    lonely = submit(model=UNSERVED_MODEL, prompt="nobody serves me", deadline_s=DEADLINE_S)
    with pytest.raises(TerminalError, match="^deadline_exceeded: "):
        lonely.get(timeout=60)
    assert ended_within(store, lonely.id) <= BOUND_S
    assert WorkerRegistry(private.vigil_store.raw).entries() == []  # the housekeeper is no worker

    busy = RunningWorker(redis_server, "busy@testhost", tmp_path, pools=SLOW_START_MODEL,
                         concurrency=2, VIGIL_ENGINE="drill", VIGIL_DRILL="slow_start=10",
                         VIGIL_PRELOAD="0", **ENV)
    try:
        wait_for(lambda: (busy.entry() or {}).get("has_pinged") == "1", 120,
                 what="the busy worker to be ready")
        # Its two task threads both wait for the engine start (~30 s, longer than the starved
        # request's whole bound) from here on.
        held = [submit(model=SLOW_START_MODEL, prompt=f"wait for me {i}", max_tokens=4,
                       ignore_eos=True) for i in range(2)]
        wait_for(lambda: all(store.get(r.id)["status"] == "RUNNING" for r in held), 60,
                 what="both of the worker's threads to be busy")
        starved = submit(model=UNSERVED_MODEL, prompt="sweep me anyway", deadline_s=DEADLINE_S)
        misrouted = private.send_task("vigil.generate", kwargs={
            "model": SLOW_START_MODEL, "prompt": "sent without a queue", "max_tokens": 4,
            "ignore_eos": True})
        with pytest.raises(TerminalError, match="^deadline_exceeded: "):
            starved.get(timeout=60)
        assert ended_within(store, starved.id) <= BOUND_S
        assert [r.get(timeout=300)["completion_tokens"] for r in held] == [4, 4]
        assert misrouted.get(timeout=300)["completion_tokens"] == 4
    finally:
        busy.stop()
    log = (tmp_path / "housekeeper.log").read_text()
    assert f"forwarded {misrouted.id}" in log
    assert "loading engine" not in log and "engine for" not in log
