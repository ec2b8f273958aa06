"""Worker tier: SIGTERM (a PaaS stop) hands in-flight requests to another worker at once, and
the worker stops cleanly, leaking nothing, with its model in a process of its own (vLLM's "mp"
layout: a GPU engine over several devices, or a registry entry asking for it), the layout whose
stop can overrun vLLM's exit grace (docs/failure-modes.md, "Kills under load")."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from app.local.embedded import wait_for
from app.state import keys
from app.state.store import RequestStore
from tasks.inference import generate
from tests.worker_procs import (RunningWorker, assert_each_ran_to_a_result_once, engine_processes,
                                every_request_taken, stepped_aside, wait_processes_gone)

pytestmark = pytest.mark.worker


def mp_models_file(tmp: Path) -> Path:
    """The suite's registry with tiny-llama's entry asking for vLLM's "mp" executor: the model
    runs in a process of its own below EngineCore (on the CPU Vigil otherwise runs it inside
    EngineCore: workers/engine/vllm_args.py `executor_args`). Same weights, same pool."""
    from app.requests.models import get_registry

    models = json.loads(Path(os.environ["VIGIL_MODELS_FILE"]).read_text())["models"]
    tiny = get_registry().get("tiny-llama").model_dump(mode="json")
    tiny["engine_args"] = {**tiny["engine_args"], "distributed_executor_backend": "mp"}
    path = tmp / "mp-models.json"
    path.write_text(json.dumps({"models": [*models, tiny]}))
    return path


def test_sigterm_mid_generation_hands_requests_to_another_worker_at_once(
        warm_worker, redis_server, tmp_path):
    """Given two workers and no beat at all (so no reaper can help), the leaving one running its
    model in a process of its own (the "mp" layout), when it gets SIGTERM with long generations
    in flight, then it hands them back at once: every request completes exactly once, those it
    held on the other worker, and the stopped worker exits 0 after shutting its engine down:
    no engine process left, no leaked shared memory, no model process SIGTERMed past its exit
    grace and no __del__ noise in its log, its registry entry gone."""
    store = RequestStore(redis_server.client(), 3600)
    # The victim's engine steps are slowed (the drill's slow_step, inside the model's process:
    # logits untouched), so what it holds is still generating when SIGTERM's hand-back comes,
    # however fast the engine or loaded the machine: 480 tokens take it 9.6 s at least.
    victim = RunningWorker(redis_server, "leaver@testhost", tmp_path,
                           VIGIL_MODELS_FILE=str(mp_models_file(tmp_path)),
                           VIGIL_ENGINE="drill", VIGIL_DRILL="slow_step=0.02")
    try:
        inst = victim.wait_engine()["instance_id"]
        # The leaving worker alone takes the requests; the other consumes again before the stop.
        with stepped_aside(warm_worker.name):
            rs = [generate.delay(model="tiny-llama", prompt=f"a very long tale {i}",
                                 max_tokens=480, ignore_eos=True) for i in range(24)]
            wait_for(lambda: every_request_taken(store, rs, (inst,)), 120,
                     what="the leaving worker to take every request")
        held = {x.decode() for x in store.raw.smembers(keys.inflight(inst))}
        assert held, "the leaving worker took no request"
        children = engine_processes(victim.proc.pid)
        titles = [" ".join(p.cmdline()) + " " + p.name() for p in children]
        assert any("EngineCore" in t for t in titles), titles
        # The layout under test: the model in a process of its own below EngineCore.
        assert any("Worker" in t and "EngineCore" not in t for t in titles), titles
        stopped_at = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        outs = [r.get(timeout=300) for r in rs]
        done_s = time.monotonic() - stopped_at
        print(f"\n{len(held)} requests handed back by SIGTERM; all {len(rs)} done "
              f"{done_s:.1f} s later")
        by_id = {o["request_id"]: o for o in outs}
        moved = [rid for rid in held if by_id[rid]["worker"] == "warm@testhost"]
        # Each held request (running, or received and not begun yet) was handed back and
        # completed on the other one (its slowed steps outlast the stop); none was lost or
        # doubled.
        assert set(moved) == held, {rid: by_id[rid]["worker"] for rid in held}
        assert_each_ran_to_a_result_once(store, [r.id for r in rs])
        # A clean stop: exit 0 after shutting the engine down, no engine process left, no
        # leaked shared memory or __del__ noise in the log, and the registry entry gone.
        assert victim.proc.wait(timeout=120) == 0
        wait_processes_gone(children)
        assert victim.entry() is None
        log = victim.log.read_text()
        assert "handed back" in log
        # vLLM SIGTERMs an engine model process that overruns its exit grace; a SIGTERMed one
        # may leave its shared memory behind (docs/failure-modes.md).
        for bad in ("leaked shared_memory", "__del__", "orphan guard",
                    "still running after grace period"):
            assert bad not in log, f"{bad!r} in worker log"
        # Celery logs the expected give-back of a delivery that arrived during the stop
        # (Reject, requeued untouched) with a traceback; any other traceback is a crash.
        blocks = re.split(r"\n(?=\[\d{4}-)", log)
        crashes = [b for b in blocks if "Traceback" in b and "celery.exceptions.Reject" not in b]
        assert not crashes, crashes[0][-2000:]
    finally:
        victim.stop()
