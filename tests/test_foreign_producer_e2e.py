"""Worker tier: a producer from another codebase, sending vigil.generate without a queue.

The producer is a bare `Celery(broker=..., backend=...)` in a process whose path does not include
this repository (it cannot import tasks/ or app/): its `send_task("vigil.generate", kwargs=...)`
lands on Celery's default queue, `celery`. A real beat scans that queue every second
(VIGIL_FOREIGN_QUEUE_SCAN_INTERVAL) and moves Vigil's messages to vigil.housekeeping, where the
warm worker forwards them to their pools (app/fleet/foreign_queues.py, workers/service.py).
"""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
import uuid

import pytest

from app.local.embedded import start_process, stop_process, vigil_env
from app.state import broker
from app.state.store import RequestStore
from tests.worker_procs import assert_each_ran_to_a_result_once

pytestmark = pytest.mark.worker

@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


PRODUCER = textwrap.dedent('''
    import json, sys
    sys.path.append(sys.argv[2])  # site-packages only: no .pth, so not this repository
    try:
        import app  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    from celery import Celery

    url, tag = sys.argv[1], sys.argv[3]
    other = Celery("other", broker=url, backend=url)
    print(json.dumps({"vigil_importable": importable}), flush=True)
    before = [other.send_task("other.add", kwargs={"x": i}).id for i in range(3)]
    good = other.send_task("vigil.generate", kwargs={
        "model": "tiny-llama", "prompt": "hello from elsewhere", "max_tokens": 5,
        "ignore_eos": True, "job": "foreign-" + tag})
    bad = other.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": 42})
    after = [other.send_task("other.add", kwargs={"x": 9}).id]
    print(json.dumps({"others": before + after, "good": good.id, "bad": bad.id}), flush=True)
    out = {"result": good.get(timeout=120)}
    try:
        bad.get(timeout=60)
        out["bad"] = None
    except Exception as e:
        out["bad"] = str(e)
    print(json.dumps(out), flush=True)
''')


def mine(sent: dict) -> set[str]:
    """The task ids the foreign producer sent (its own tasks and the two vigil.generate)."""
    return set(sent["others"]) | {sent["good"], sent["bad"]}


def test_a_foreign_producers_request_without_a_queue_gets_its_result_and_others_stay_put(
        warm_worker, redis_server, store, tmp_path):
    """Given a bare Celery app outside this repository's path that sends three tasks of its
    own, then vigil.generate without `queue=` (a good request and one whose prompt is not a
    string), then one more task of its own, all onto `celery`, when a beat scans every second,
    then the good request's `r.get()` returns Vigil's result (run once, witnessed by the
    engine), the bad one's raises invalid_request, and the four other tasks are still in
    `celery`, in their order."""
    beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                          "-s", str(tmp_path / "beat-schedule")],
                         vigil_env(redis_server.url, VIGIL_FOREIGN_QUEUE_SCAN_INTERVAL="1"),
                         tmp_path / "beat.log")
    script = tmp_path / "producer.py"
    script.write_text(PRODUCER)
    client = store.raw
    sent = None
    try:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        out = subprocess.run([sys.executable, "-S", str(script), redis_server.url,
                              sysconfig.get_paths()["purelib"], uuid.uuid4().hex[:8]],
                             cwd=str(tmp_path), env=env, capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        assert lines[0] == {"vigil_importable": False}
        sent, got = lines[1], lines[2]
        assert got["result"]["request_id"] == sent["good"]
        assert got["result"]["completion_tokens"] == 5 and got["result"]["attempts"] == 1
        assert got["bad"] and "invalid_request" in got["bad"]
        assert store.get(sent["bad"])["status"] == "FAILED"
        assert_each_ran_to_a_result_once(store, [sent["good"]])  # the witness's too
        # `celery` is a list other producers of the suite's database may use too: only this
        # test's own entries are looked at (in delivery order), and removed.
        left = [i for i in reversed([broker.message_id(raw) for raw in
                                     client.lrange("celery", 0, -1)]) if i in mine(sent)]
        assert left == sent["others"]
    finally:
        stop_process(beat)
        if sent is not None:
            for raw in client.lrange("celery", 0, -1):
                if broker.message_id(raw) in mine(sent):
                    client.lrem("celery", 1, raw)
