"""Redis tier: `vigil request ID` and `why_waiting`: one request's record, its attempts, and why it
waits (the pool's state, a worker holding it, its place in the real kombu queue), on a real
redis-server (database 1, flushed per test). Workers are registry entries written by the real
Heartbeat and HealthLedger; queue messages are published by a real Celery app on database 1."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from celery import states

from app.celery_app import create_app
from app.errors import TransientError
from app.fleet.waiting import SCAN_LIMIT, why_waiting
from app.local.embedded import vigil_env
from app.ops.request_view import describe
from app.requests.models import get_registry
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.state import keys
from app.state.broker import position as queue_position
from app.state.conn import connect
from app.state.health import HealthLedger
from app.state.store import RequestStore
from app.state.registry import WorkerRegistry
from workers.heartbeat import Heartbeat

pytestmark = pytest.mark.redis
QUEUE = "vigil.pool.tiny-llama"
KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def create(store, rid, now=None, **kw):
    req = parse_request({**KW, **kw})
    assert store.create(rid, record_fields(req, now or time.time(), 3600))
    return req


def publish(app, rid):
    app.send_task("vigil.generate", kwargs=KW, task_id=rid, queue=QUEUE)


def worker(client, instance, name, pools="tiny-llama"):
    Heartbeat(WorkerRegistry(client), instance, name, 10,
              lambda: {"pools": pools, "in_flight": 0, "model": "tiny-llama",
                       "engine_state": "ready"}).beat()


def view(store, settings, rid, **kw):
    return why_waiting(rid, store=store, settings=settings, registry=get_registry(), **kw)


def test_a_queued_request_with_no_worker_says_so_and_gives_its_place_in_the_queue(
        store, settings, celery_app):
    """Given no worker for tiny-llama and eight messages in its queue, the sixth published being
    ours, then the request waits because no live worker serves the pool, five messages ahead."""
    for i in range(5):
        publish(celery_app, f"before-{i}")
    create(store, "r1")
    publish(celery_app, "r1")
    for i in range(2):
        publish(celery_app, f"after-{i}")
    w = view(store, settings, "r1")
    assert w["status"] == "PENDING" and w["queue"] == QUEUE
    assert (w["position"], w["queue_length"]) == (6, 8)
    assert w["reasons"] == ["pool tiny-llama: no live worker serves it",
                            f"position ~6 of 8 in queue {QUEUE}"]
    assert w["summary"] == "; ".join(w["reasons"]) and w["held_by"] == []


def test_a_get_that_times_out_says_why_the_request_waits(store, settings, celery_app):
    """Given a queued request whose pool no worker serves, when `r.get(timeout=...)` gives up,
    then Celery's TimeoutError says so (the wait's summary), not only that time ran out."""
    from celery.exceptions import TimeoutError as CeleryTimeoutError

    app = create_app(settings)
    create(store, "r-timeout")
    publish(celery_app, "r-timeout")
    with pytest.raises(CeleryTimeoutError) as ei:
        app.AsyncResult("r-timeout").get(timeout=0.3)
    msg = str(ei.value)
    assert msg.startswith("request r-timeout did not end within 0.3 s: ")
    assert "pool tiny-llama: no live worker serves it" in msg and "position ~1 of 1" in msg


def test_every_worker_of_the_pool_quarantined_is_the_reason(store, settings, celery_app):
    """Given the only worker serving tiny-llama quarantined by three failures, then a queued
    request says every worker serving its pool is quarantined."""
    worker(store.raw, 7, "sick@h")
    ledger = HealthLedger(store.raw, window=3600, threshold=3)
    for i in range(3):
        ledger.failure(7, time.time() + i, "stall: no progress")
    create(store, "r1")
    publish(celery_app, "r1")
    w = view(store, settings, "r1")
    assert w["reasons"][0] == ("pool tiny-llama: every worker serving it is quarantined or "
                               "restarting")
    assert w["position"] == 1 and w["pool_workers"] == []


def test_a_served_pool_gives_only_the_queue_position(store, settings, celery_app):
    worker(store.raw, 5, "ok@h")
    create(store, "r1")
    publish(celery_app, "r1")
    w = view(store, settings, "r1")
    assert w["reasons"] == [f"position ~1 of 1 in queue {QUEUE}"]
    assert w["pool_workers"] == ["ok@h"] and w["why_unserved"] == ""


def test_a_running_request_names_its_worker_start_and_attempt(store, settings):
    worker(store.raw, 5, "ok@h")
    create(store, "r1")
    started = time.time()
    assert store.begin("r1", 0, "ok@h", 5, started, settings.max_attempts).action == "run"
    w = view(store, settings, "r1")
    assert w["status"] == "RUNNING" and w["worker"] == "ok@h"
    assert w["running_since"] == pytest.approx(started)
    assert len(w["reasons"]) == 1
    assert w["reasons"][0].startswith("running on worker ok@h since ")
    assert w["reasons"][0].endswith(f"(attempt 1 of {settings.max_attempts})")


def test_a_request_released_for_a_retry_names_the_worker_holding_it(store, settings):
    """Given a request whose first attempt ended wedged and was released for a retry by ok@h
    (which keeps it in its in-flight set until someone begins it), then it waits for attempt 2,
    its message with ok@h; it is not reported missing from the queue."""
    worker(store.raw, 5, "ok@h")
    create(store, "r1")
    store.begin("r1", 0, "ok@h", 5, time.time(), settings.max_attempts)
    assert store.release("r1", 5, 1, "wedged: no answer in 600 s")
    w = view(store, settings, "r1")
    assert w["held_by"] == ["ok@h"] and w["position"] is None
    assert w["reasons"] == [
        f"waiting for attempt 2 of {settings.max_attempts}; the last one ended wedged",
        "its message is with worker ok@h (received, not begun: a retry's countdown, or waiting "
        "for a free task thread)"]


def test_a_request_neither_queued_nor_held_and_past_its_deadline(store, settings):
    worker(store.raw, 5, "ok@h")
    create(store, "r1", now=time.time() - 4000)  # deadline 3600 s after creation: passed
    w = view(store, settings, "r1")
    assert w["reasons"][0].startswith(f"not in queue {QUEUE} and held by no worker")
    assert w["reasons"][1].startswith("past its deadline by ")
    assert w["reasons"][1].endswith("the deadline sweep fails it (deadline_exceeded)")


def test_the_queue_scan_is_chunked_bounded_and_matches_the_header_id_only(store):
    """Messages LPUSHed as kombu does (the next delivered is the rightmost); one decoy carries the
    id in its body only."""
    msgs = [{"headers": {"id": f"m{i}"}, "body": ""} for i in range(7)]
    msgs[1]["body"] = "target"  # decoy: mentions the id, is not it
    msgs[4] = {"headers": {"id": "target"}, "body": ""}
    for m in msgs:  # m0 published first: it is delivered first
        store.raw.lpush("q", json.dumps(m))
    assert queue_position(store.raw, "q", "target", limit=SCAN_LIMIT, chunk=2) == (5, 7)
    assert queue_position(store.raw, "q", "target", limit=4, chunk=2) == (None, 7)
    assert queue_position(store.raw, "q", "nobody", limit=SCAN_LIMIT, chunk=3) == (None, 7)
    assert queue_position(store.raw, "empty", "target", limit=SCAN_LIMIT) == (None, 0)
    assert SCAN_LIMIT == 10_000


def test_ended_or_unknown_requests_have_no_waiting_reason(store, settings):
    create(store, "r1")
    store.finish("r1", 0, time.time(), error_kind="TerminalError",
                 error="deadline_exceeded: too late")
    assert view(store, settings, "r1") is None
    assert view(store, settings, "never-submitted") is None


def test_describe_shows_history_and_result_summary_without_the_text_unless_asked(store, settings):
    create(store, "r1", job="eval-7")
    store.begin("r1", 0, "a@h", 5, 1000.0, 3)
    store.release("r1", 5, 1, "engine_restarting: the engine died", now=1001.0)
    store.begin("r1", 1, "b@h", 6, 1002.0, 3)
    store.finish("r1", 6, 1003.0, result={"text": "secret words", "token_ids": [1, 2],
                                          "finish_reason": "length", "prompt_tokens": 3,
                                          "completion_tokens": 2, "attempts": 2,
                                          "worker": "b@h"})
    v = describe("r1", store=store, settings=settings, registry=get_registry())
    assert v["status"] == "SUCCEEDED" and v["job"] == "eval-7" and v["waiting"] is None
    assert [(h["worker"], h["outcome"], h["error"]) for h in v["history"]] == [
        ("a@h", "retry", "engine_restarting"), ("b@h", "succeeded", None)]
    assert v["result"] == {"finish_reason": "length", "prompt_tokens": 3,
                           "completion_tokens": 2, "attempts": 2, "worker": "b@h",
                           "text_chars": 12}
    assert "secret" not in json.dumps(v) and "hello" not in json.dumps(v)  # nor the prompt
    shown = describe("r1", store=store, settings=settings, registry=get_registry(),
                     show_text=True)
    assert shown["result"]["text"] == "secret words" and shown["result"]["token_ids"] == [1, 2]


def test_describe_shows_the_error_code_of_a_failed_request(store, settings):
    create(store, "r1")
    store.finish("r1", 0, time.time(), error_kind="RequestError",
                 error="prompt_too_long: 700 tokens > 512")
    v = describe("r1", store=store, settings=settings, registry=get_registry())
    assert v["error"] == {"kind": "RequestError", "code": "prompt_too_long",
                          "message": "prompt_too_long: 700 tokens > 512"}


def test_async_result_info_of_a_waiting_request_is_the_summary(store, settings):
    """Given a queued request with no worker, then AsyncResult.info (PENDING, and RETRY after a
    retry is stored) is the waiting summary, while `result` stays Celery's own value; once the
    request has a result, info is that result. (Vigil's own app class: pytest-celery's
    `celery_app` is a plain Celery app, whose results know nothing of Vigil.)"""
    celery_app = create_app(settings, get_registry())
    create(store, "r1")
    publish(celery_app, "r1")
    r = celery_app.AsyncResult("r1")
    assert r.state == states.PENDING and r.result is None
    assert r.info["summary"] == f"pool tiny-llama: no live worker serves it; position ~1 of 1 " \
                                f"in queue {QUEUE}"
    celery_app.backend.mark_as_retry("r1", TransientError("wedged: slow"))
    r = celery_app.AsyncResult("r1")
    assert r.state == states.RETRY and isinstance(r.result, TransientError)
    assert r.info["request_id"] == "r1" and r.info["position"] == 1
    celery_app.backend.mark_as_done("r1", {"text": "x"})
    assert celery_app.AsyncResult("r1").info == {"text": "x"}
    assert celery_app.AsyncResult("unknown-id").info is None  # no record: Celery's own None


def test_vigil_request_command_json_and_not_found(store, settings, celery_app):
    url = settings.redis_url
    create(store, "r1")
    publish(celery_app, "r1")
    out = subprocess.run([sys.executable, "-m", "app.ops.cli", "request", "r1", "--json"],
                         env=vigil_env(url), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout)
    assert v["found"] and v["status"] == "PENDING"
    assert v["waiting"]["reasons"] == ["pool tiny-llama: no live worker serves it",
                                       f"position ~1 of 1 in queue {QUEUE}"]
    human = subprocess.run([sys.executable, "-m", "app.ops.cli", "request", "r1"],
                           env=vigil_env(url, COLUMNS="200"), capture_output=True, text=True,
                           timeout=60)
    assert human.returncode == 0 and "no live worker serves it" in human.stdout
    missing = subprocess.run([sys.executable, "-m", "app.ops.cli", "request", "nope", "--json"],
                             env=vigil_env(url), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and json.loads(missing.stdout) == {"request_id": "nope",
                                                                      "found": False}
    assert store.raw.exists(keys.request("r1"))  # read-only


def test_a_request_of_a_job_is_found_in_its_jobs_queue(store, settings, celery_app):
    """Given a request of job eval-7 behind another of the same job, then its place is counted in
    the job's own queue (app/fleet/jobs.py), not the pool's."""
    from app.state.queues import job_queue

    create(store, "r1", job="eval-7")
    for rid in ("ahead", "r1"):
        celery_app.send_task("vigil.generate", kwargs={**KW, "job": "eval-7"}, task_id=rid,
                             queue=job_queue("tiny-llama", "eval-7"))
    w = view(store, settings, "r1")
    assert w["queue"] == "vigil.pool.tiny-llama.job.eval-7" and w["position"] == 2
    assert w["reasons"][-1] == "position ~2 of 2 in queue vigil.pool.tiny-llama.job.eval-7"
