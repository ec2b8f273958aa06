"""Redis tier: what `generate.delay` does before anything reaches a worker."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from app import app
from app.errors import RequestError
from app.local.embedded import free_port, vigil_env
from app.state import broker, keys
from app.state.queues import DEFAULT_JOB
from app.state.store import shared_store
from tasks.inference import generate

pytestmark = pytest.mark.redis


def left_behind(r, rid: str) -> list:
    """What a refused submit of `rid` left in Redis: its record, its place in the deadline
    index, a message in any pool or housekeeping queue (database 0 is shared with the session's
    worker and the other tests: only this request's own traces are looked at)."""
    queues = ["vigil.housekeeping"] + broker.all_pool_queues(r)
    return ([k for k in (keys.request(rid),) if r.exists(k)]
            + ([keys.DEADLINES] if r.zscore(keys.DEADLINES, rid) is not None else [])
            + (["a message"] if rid in broker.queued_ids(r, queues, unacked=True) else []))


def ended(rid: str) -> None:
    """End a request a test created and published nowhere: its record and its places in the
    pending sets and the deadline index go as a finished request's do."""
    shared_store().finish(rid, 0, time.time(), error_kind="RequestError",
                          error="invalid_request: test")


@pytest.fixture()
def r(redis_server):
    return redis_server.client()


@pytest.mark.parametrize("kwargs, code", [
    ({"model": "tiny-llama", "prompt": ""}, "invalid_request"),
    ({"model": "tiny-llama", "prompt": "hi", "max_tokens": -1}, "invalid_request"),
    ({"model": "tiny-llama", "prompt": "hi", "max_tokens": 10**9}, "invalid_request"),
    ({"model": "tiny-llama", "prompt": "hi", "prompt_token_ids": [1]}, "invalid_request"),
    ({"model": "tiny-llama"}, "invalid_request"),
    ({"model": "tiny-llama", "prompt": "x" * 300_000}, "invalid_request"),
    ({"model": "no-such-model", "prompt": "hi"}, "model_not_found"),
    ({"model": "tiny-llama", "prompt_token_ids": [3] * 600}, "prompt_too_long"),
    ({"model": "tiny-llama", "prompt_token_ids": [99999]}, "token_out_of_vocab"),
])
def test_a_bad_request_raises_in_the_producer_and_nothing_is_enqueued(r, kwargs, code):
    rid = f"bad-{uuid.uuid4()}"  # `.delay` with the id chosen here, to look for its traces
    with pytest.raises(RequestError) as ei:
        generate.apply_async(kwargs=kwargs, task_id=rid)
    assert ei.value.code == code and str(ei.value).startswith(code + ": ")
    assert left_behind(r, rid) == []


def test_positional_arguments_are_refused_with_advice(r):
    with pytest.raises(RequestError, match="keyword arguments"):
        generate.delay("tiny-llama", "hello")


def test_a_chain_a_chord_or_a_callback_is_refused_at_submit_and_nothing_is_enqueued(r):
    """A worker drops a message that carries other tasks (workers/consumer.py), so the producer
    refuses them first: a chain of two requests, a link, a link_error, nothing recorded or
    queued; a one-task chain is a plain message and goes through."""
    from celery import chain

    kw = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
    ids = [f"chained-{uuid.uuid4()}" for _ in range(4)]  # ids of this test's own, to look for
    with pytest.raises(RequestError, match="^invalid_request: Vigil runs no Celery callbacks "
                       r"\(chain\)"):
        chain(generate.s(**kw).set(task_id=ids[0]),
              generate.s(**kw).set(task_id=ids[1])).apply_async()
    for rid, option in zip(ids[2:], ("link", "link_error")):
        with pytest.raises(RequestError, match=rf"callbacks \({option}\)"):
            generate.apply_async(kwargs=kw, task_id=rid, **{option: generate.s(**kw)})
    assert [left_behind(r, rid) for rid in ids] == [[]] * 4
    one = chain(generate.s(**kw)).apply_async()
    assert r.exists(f"vigil:req:{one.id}")


def test_an_unreachable_redis_fails_the_submit_fast_with_a_clear_error():
    port = free_port()  # nothing listens here
    code = (
        "import json, time\n"
        "from tasks.inference import generate\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    generate.delay(model='tiny-llama', prompt='hi')\n"
        "except Exception as e:\n"
        "    print(json.dumps([type(e).__name__, str(e), time.monotonic() - t]))\n"
    )
    env = vigil_env(f"redis://127.0.0.1:{port}/0", VIGIL_REDIS_TIMEOUT="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    name, msg, elapsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == "TransientError" and msg.startswith("redis_unavailable: ")
    assert elapsed < 20


def test_the_published_message_is_json_and_hides_the_prompt_from_logs(r, monkeypatch):
    """Given a valid request, when it is published, then the message body is JSON kwargs (no
    pickle), the task id is the request id, and kwargsrepr names model and job only."""
    sent = {}

    def capture(self, name, args=None, kwargs=None, **options):
        sent.update(name=name, args=args, kwargs=kwargs, **options)
        return self.AsyncResult(options["task_id"])

    monkeypatch.setattr(type(app), "send_task", capture)
    job = f"j1-{uuid.uuid4().hex[:8]}"
    res = generate.delay(model="tiny-llama", prompt="secret prompt", max_tokens=3, job=job)
    rec = {k.decode(): v.decode() for k, v in r.hgetall(f"vigil:req:{res.id}").items()}
    try:
        assert sent["task_id"] == res.id
        assert sent["queue"].name == f"vigil.pool.tiny-llama.job.{job}"
        json.dumps(sent["kwargs"])
        assert sent["kwargs"]["prompt"] == "secret prompt" and sent["kwargs"]["schema_version"] == 1
        assert "secret" not in sent["kwargsrepr"] and job in sent["kwargsrepr"]
        assert rec["status"] == "PENDING" and rec["job"] == job and rec["attempts"] == "0"
        assert float(rec["deadline_at"]) - float(rec["created_at"]) == pytest.approx(3600)
        assert sent["expires"].timestamp() > time.time() + 3600
    finally:
        ended(res.id)


def test_reusing_a_request_id_for_a_different_request_is_refused(r, monkeypatch):
    monkeypatch.setattr(type(app), "send_task",
                        lambda self, name, args=None, kwargs=None, **o:
                        self.AsyncResult(o["task_id"]))
    rid = f"reused-id-{uuid.uuid4()}"
    try:
        first = generate.apply_async(kwargs={"model": "tiny-llama", "prompt": "a"}, task_id=rid)
        same = generate.apply_async(kwargs={"model": "tiny-llama", "prompt": "a"}, task_id=rid)
        assert first.id == same.id == rid
        with pytest.raises(RequestError, match="already used by a different request"):
            generate.apply_async(kwargs={"model": "tiny-llama", "prompt": "b"}, task_id=rid)
    finally:
        ended(rid)


def test_a_failed_publish_leaves_no_record_behind(r, monkeypatch):
    from kombu.exceptions import OperationalError

    from app.errors import TransientError

    def boom(self, name, args=None, kwargs=None, **o):
        raise OperationalError("connection refused")

    monkeypatch.setattr(type(app), "send_task", boom)
    rid = f"unpublished-{uuid.uuid4()}"
    with pytest.raises(TransientError, match="^redis_unavailable: "):
        generate.apply_async(kwargs={"model": "tiny-llama", "prompt": "hello"}, task_id=rid)
    assert left_behind(r, rid) == []
    pending = [keys.job_requests(DEFAULT_JOB), keys.pool_requests("tiny-llama")]
    assert not any(r.sismember(k, rid) for k in pending)  # its slot given back
