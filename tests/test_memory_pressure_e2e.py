"""Worker tier: engine starts under a real memory squeeze, and starts that fail for the model's own
fault. The worker measures free memory itself (the node meminfo vLLM reads) before each start;
another process holds real memory to squeeze it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from app.errors import RequestError
from app.local.embedded import REPO, wait_for
from app.requests.models import get_registry
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import CORRUPT_MODEL, MISSING_MODEL, ROOMY_MODEL, fault_test_models
from tests.worker_procs import RunningWorker
from workers.engine.memory import GiB, probe_memory, worker_device

pytestmark = pytest.mark.worker
# The worker is told that roomy-llama needs all but HEADROOM of the memory free at the start of
# the test besides its KV cache (a drill: a big model on a small machine, played by tiny-llama's
# weights). The holder then keeps what the worker measures as free below that need, so the start
# must be refused; after it exits, there is room again.
HEADROOM_GIB = 3.0
# How long the holder keeps the memory once the squeeze began.
HOLD_S = 20
# How far below the model's need (plus its smallest KV cache) the holder keeps free memory.
HOLD_MARGIN_GIB = 0.75
mem_worker_need = [0.0]  # the memory_gib the worker was told (set by the fixture)

# A real squeeze that the rest of the suite cannot undo: it takes memory (touching every page:
# untouched pages cost nothing) until the worker's own probe reads at most `target` bytes free,
# and keeps topping up every 20 ms while other processes free memory, until its stdin closes.
HOLDER = """
import mmap, select, sys
from workers.engine.memory import probe_memory, worker_device
target, chunk, held = int(sys.argv[1]), 32 << 20, []
def top_up():
    while probe_memory(*worker_device()).free > target:
        m = mmap.mmap(-1, chunk)
        for i in range(0, chunk, 4096):
            m[i] = 1
        held.append(m)
top_up()
print("held", flush=True)
while not select.select([sys.stdin], [], [], 0.02)[0]:
    top_up()
"""


def start_mem_worker(redis_server, tmp, name: str, pools: str, **env) -> RunningWorker:
    """A worker on `pools`, no preload, and a models file saying roomy-llama needs (free memory
    right now - HEADROOM_GIB) besides its KV cache."""
    from tests.conftest import CACHE_DIR

    free_gib = probe_memory(*worker_device()).free / GiB
    models = []
    for m in fault_test_models(CACHE_DIR):
        if m["name"] == ROOMY_MODEL:
            m = {**m, "memory_gib": round(free_gib - HEADROOM_GIB, 2)}
            mem_worker_need[0] = m["memory_gib"]
        models.append(m)
    path = tmp / f"{name.split('@')[0]}-models.json"
    path.write_text(json.dumps({"models": models}))
    w = RunningWorker(redis_server, name, tmp, pools=pools, VIGIL_MODELS_FILE=str(path),
                      VIGIL_PRELOAD="0", **env)
    w.wait_registered()
    return w


@pytest.fixture(scope="module")
def mem_worker(redis_server, tmp_path_factory):
    """The fault pools' worker for the tests that need no memory squeeze."""
    w = start_mem_worker(redis_server, tmp_path_factory.mktemp("mem"), "mem@testhost",
                         f"{CORRUPT_MODEL},{MISSING_MODEL}", VIGIL_RETRY_BACKOFF="1",
                         VIGIL_RETRY_BACKOFF_MAX="2")
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def test_a_corrupt_model_dir_fails_once_without_retries(mem_worker, store):
    """Given a model whose config.json is garbage and plenty of free memory, then its request
    fails on the first attempt with invalid_model_config: a start that failed with the requested
    memory free is the model's fault, never retried."""
    r = generate.delay(model=CORRUPT_MODEL, prompt="hello", max_tokens=4)
    with pytest.raises(RequestError, match="^invalid_model_config: ") as ei:
        r.get(timeout=180)
    assert ei.value.code == "invalid_model_config"
    assert [(h["outcome"], h["error"]) for h in store.history(r.id)] == [
        ("failed", "invalid_model_config")]


def test_missing_model_files_fail_once_with_model_not_found(mem_worker, store):
    r = generate.delay(model=MISSING_MODEL, prompt="hello", max_tokens=4)
    with pytest.raises(RequestError, match="^model_not_found: ") as ei:
        r.get(timeout=180)
    assert "missing-weights" in str(ei.value)
    assert [(h["outcome"], h["error"]) for h in store.history(r.id)] == [
        ("failed", "model_not_found")]


@pytest.mark.alone  # it squeezes the machine's free memory: no neighbour may start an engine
def test_memory_pressure_at_engine_start_waits_for_the_memory_and_lands_once_it_frees(
        redis_server, store, tmp_path):
    """Given another process holding memory for 20 s so that the worker measures less free
    memory than the model's floor, when a request arrives, then each start is refused as
    memory_pressure and the request waits for the memory, at the default settings: its start is
    tried again at least every 15 s without using up an attempt, for up to
    VIGIL_MEMORY_PRESSURE_WINDOW (300 s); once the holder exits, a retry starts the engine and
    the request succeeds, on its first counted attempt. (Its own worker, told the model's need
    just now: memory other processes took or freed since cannot skew it.)"""
    worker = start_mem_worker(redis_server, tmp_path, "squeeze@testhost", ROOMY_MODEL)
    try:
        _squeeze_and_release(worker, store)
    finally:
        worker.stop()


def _squeeze_and_release(mem_worker, store):
    floor = mem_worker_need[0] + get_registry().get(ROOMY_MODEL).kv_cache_floor_gib
    target = int((floor - HOLD_MARGIN_GIB) * GiB)
    wait_for(lambda: (mem_worker.entry() or {}).get("has_pinged") == "1", 120,
             what=f"{mem_worker.name} to be ready")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO))
    try:
        assert holder.stdout.readline().strip() == b"held"
        held_at = time.monotonic()
        r = generate.delay(model=ROOMY_MODEL, prompt="room to breathe", max_tokens=8,
                           ignore_eos=True)
        wait_for(lambda: any(h["error"] == "memory_pressure" and h["outcome"] == "retry"
                             for h in store.history(r.id)), 120,
                 what="a start refused for memory pressure")
        # A co-tenant holding the card for 20 s: far more than the old attempt-bounded
        # retries (3 attempts, ~6 s) would have waited.
        wait_for(lambda: time.monotonic() - held_at >= HOLD_S, HOLD_S + 5, interval=0.5,
                 what="the holder's 20 s")
        assert store.get(r.id)["status"] in ("PENDING", "RUNNING")  # still waiting, not failed
    finally:
        holder.kill()
        holder.wait()
    released_at = time.time()
    out = r.get(timeout=300)
    history = store.history(r.id)
    assert out["completion_tokens"] == 8 and out["attempts"] == 1 and len(history) >= 4
    assert [h["outcome"] for h in history] == ["retry"] * (len(history) - 1) + ["succeeded"]
    assert all(h["error"] == "memory_pressure" for h in history[:-1])
    starts = [h["started_at"] for h in history]
    assert max(b - a for a, b in zip(starts, starts[1:])) <= 15 + 5  # tried again at least
    assert history[-1]["started_at"] - released_at <= 15 + 5  # every 15 s (+ engine start)
    log = mem_worker.log.read_text()
    assert "not enough free memory to start roomy-llama" in log
