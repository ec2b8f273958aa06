"""Worker tier: many requests in few messages (`generate_many`) on the shared warm worker (the
real vLLM CPU engine): every request gets its own result through `AsyncResult(id).get()`, also
from another process, its engine ran each exactly once (the witness); a Celery `group` of
single requests runs each as its own request; and a worker SIGKILLed
in the middle of its many-request messages loses none of them: the reaper hands each request
on alone, and each ends once, on the survivor."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from app import app
from app.local.embedded import start_process, stop_process, vigil_env, wait_for
from app.requests.models import get_registry
from app.requests.submit import submit_many
from app.settings import get_settings
from app.state import keys
from app.state.queues import pool_queue
from app.state.store import shared_store
from tasks.inference import generate_many
from tests.worker_procs import (RunningWorker, assert_each_ran_to_a_result_once, assert_witnessed,
                                engine_processes, every_request_taken, stepped_aside,
                                wait_processes_gone)

pytestmark = pytest.mark.worker


def test_sixty_four_requests_in_two_messages_each_end_once_with_its_own_result(
        warm_worker, redis_server):
    job = f"many-{uuid.uuid4().hex[:8]}"
    items = [{"model": "tiny-llama", "prompt": f"count {i}", "max_tokens": 4, "job": job,
              "temperature": 0.0, "ignore_eos": True} for i in range(64)]
    results = generate_many(items)
    outs = [r.get(timeout=240) for r in results]
    assert [o["request_id"] for o in outs] == [r.id for r in results]
    assert all(o["completion_tokens"] == 4 and o["worker"] == warm_worker.name for o in outs)
    assert_witnessed(shared_store(), [r.id for r in results])
    # Another process reads one request's result by its id alone.
    code = ("import json, sys; from app import app\n"
            "print(json.dumps(app.AsyncResult(sys.argv[1]).get(timeout=60)))\n")
    out = subprocess.run([sys.executable, "-c", code, results[17].id], capture_output=True,
                         text=True, env=vigil_env(redis_server.url), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == outs[17]


def test_a_celery_group_of_generate_signatures_runs_each_as_a_request_of_its_own(warm_worker):
    """Celery's canvas as far as Vigil runs it (docs/api.md, "Many requests at once"): a
    `group` of `generate` signatures is six plain requests, each with its own record and
    result, read back in order through the group's result; the engines ran each once."""
    from celery import group

    from tasks.inference import generate

    sigs = [generate.s(model="tiny-llama", prompt=f"group member {i}", max_tokens=3,
                       ignore_eos=True, temperature=0.0) for i in range(6)]
    grouped = group(sigs).apply_async()
    outs = grouped.get(timeout=240)
    ids = [r.id for r in grouped.results]
    assert [o["request_id"] for o in outs] == ids and len(set(ids)) == 6
    assert all(o["completion_tokens"] == 3 and o["worker"] == warm_worker.name for o in outs)
    assert {shared_store().get(i)["status"] for i in ids} == {"SUCCEEDED"}
    assert_witnessed(shared_store(), ids)


def test_a_worker_killed_mid_message_loses_none_of_its_requests(warm_worker, redis_server,
                                                                 tmp_path):
    """Given 24 requests in three messages of eight, all taken by one worker (the warm one
    stops consuming the pool's queue while they are published), when that worker is SIGKILLed
    with their tokens streaming, then beat's reaper hands each request on by itself, and every
    one ends exactly once on the survivor (the engines' witness), continuing from the tokens
    it had streamed."""
    store, queue = shared_store(), pool_queue("tiny-llama")
    beat = None
    victim = RunningWorker(redis_server, "manyvictim@testhost", tmp_path)
    try:
        inst = victim.wait_engine()["instance_id"]
        with stepped_aside(warm_worker.name, queue):
            items = [{"model": "tiny-llama", "prompt": f"a long tale number {i}",
                      "max_tokens": 300, "ignore_eos": True, "temperature": 0.0}
                     for i in range(24)]
            s = get_settings().model_copy(update={"requests_per_message": 8})
            rs = submit_many(items, settings=s, registry=get_registry(), store=store,
                             ports=app.vigil_ports)
            wait_for(lambda: every_request_taken(store, rs, (inst,)), 120,
                     what="the victim to take all three messages")
            held = {x.decode() for x in store.raw.smembers(keys.inflight(inst))}
            assert held == {r.id for r in rs}
            wait_for(lambda: any(int((store.get(r.id) or {}).get("streamed") or 0) > 0
                                 for r in rs), 120, 0.05, "a request's first streamed chunk")
        beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                              "-s", str(tmp_path / "schedule")],
                             vigil_env(redis_server.url, VIGIL_WORKER_REAP_TIMEOUT="8",
                                       VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1"),
                             tmp_path / "beat.log")
        children = engine_processes(victim.proc.pid)
        killed_at = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        wait_processes_gone(children)
        outs = [r.get(timeout=300) for r in rs]
        print(f"\nmany: 24 requests in 3 messages on the killed worker, all done "
              f"{time.monotonic() - killed_at:.1f} s after the kill; "
              f"{sum(bool(o.get('resumed_at')) for o in outs)} resumed from streamed tokens")
        assert [o["request_id"] for o in outs] == [r.id for r in rs]
        assert all(o["completion_tokens"] == 300 and o["worker"] == warm_worker.name
                   for o in outs)
        assert all(int(store.get(r.id)["attempts"]) >= 2 for r in rs)
        assert any(o.get("resumed_at") for o in outs)
        assert_each_ran_to_a_result_once(store, [r.id for r in rs])
    finally:
        victim.stop()
        stop_process(beat)
