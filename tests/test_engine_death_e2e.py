"""Worker tier: engine death on the real vLLM CPU engine. The EngineCore process is SIGKILLed for
real (by the test, or by the drill engine when a poison request reaches it); recovery happens
inside the worker: suspects re-run on a fresh engine, a poison is convicted alone, innocents
finish, and a worker that cannot keep an engine alive hands its requests back and leaves."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from app.errors import RequestError
from app.local.embedded import wait_for
from app.state.queues import pool_queue
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import DRILL_MODEL
from tests.worker_procs import (RunningWorker, assert_each_ran_to_a_result_once,
                                every_request_taken, stepped_aside)

pytestmark = pytest.mark.worker
POISON = "POISON-PILL"
DRILL_QUEUE = pool_queue(DRILL_MODEL)


@pytest.fixture(scope="module")
def drill_worker(redis_server, tmp_path_factory):
    """A worker serving tiny-llama-drill on the drill engine: the real engine, where a prompt
    holding POISON-PILL kills EngineCore once it is in the batch."""
    # Steps slowed (10 ms each, inside EngineCore: logits untouched): the poison test's 200-token
    # innocents must still be generating when its check sees them all running; unslowed, on
    # a quiet moment, all 32 ran to their end first and the check waited in vain (1 run in 3
    # since the batch gate, which lets no request wait in vLLM's queue).
    w = RunningWorker(redis_server, "drill@testhost", tmp_path_factory.mktemp("drill"),
                      pools=DRILL_MODEL, VIGIL_ENGINE="drill",
                      VIGIL_DRILL=f"poison={POISON},slow_step=0.01")
    try:
        w.wait_engine()
        yield w
    finally:
        w.stop()


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def fresh_entry(worker) -> dict:
    seen = float(worker.entry()["last_seen"])
    return wait_for(lambda: (e := worker.entry()) and float(e["last_seen"]) > seen and e, 30,
                    what="a fresh heartbeat")


def test_killing_engine_core_with_64_in_flight_fails_none_of_them(drill_worker, store):
    """Given 64 requests generating in one warm engine, when its EngineCore process is SIGKILLed,
    then every request still succeeds, exactly once, on its first attempt (re-run inside the
    worker on one fresh engine), and the engine was restarted once."""
    before = fresh_entry(drill_worker)
    inst = before["instance_id"]
    rs = [generate.delay(model=DRILL_MODEL, prompt=f"story number {i}", max_tokens=200,
                         ignore_eos=True) for i in range(64)]
    wait_for(lambda: every_request_taken(store, rs, (inst,), DRILL_QUEUE), 120,
             what="all 64 requests to reach the worker")
    wait_for(lambda: int(drill_worker.entry()["in_flight"]) == 64, 60,
             what="64 requests in the engine")
    cores = drill_worker.engine_core_pids()
    assert len(cores) == 1
    killed_at = time.monotonic()
    os.kill(cores[0], signal.SIGKILL)
    outs = [r.get(timeout=300) for r in rs]
    print(f"\n64 requests in flight when EngineCore was killed: all done "
          f"{time.monotonic() - killed_at:.1f} s after the kill")
    assert [o["request_id"] for o in outs] == [r.id for r in rs]
    assert all(o["completion_tokens"] == 200 and o["attempts"] == 1 for o in outs)
    assert_each_ran_to_a_result_once(store, [r.id for r in rs])
    after = fresh_entry(drill_worker)
    assert int(after["engine_restarts"]) == int(before["engine_restarts"]) + 1
    assert int(after["poisoned"]) == int(before["poisoned"])


def test_a_poison_request_among_32_innocents_is_the_only_failure(drill_worker, store):
    """Given 32 innocent requests generating in one engine, when a request that kills the
    engine whenever it runs joins them, then only the poison fails, with poison_request on its
    first attempt (`r.get()` raises the RequestError), the 32 succeed exactly once, and the
    engine was restarted exactly 5 times (docs/failure-modes.md: the batch, the suspects
    together, the poison's group, the poison alone, alone again). Two of the innocents are a
    request of n=2 samples and a structured (regex) one: each ends correct (both samples whole;
    text that holds to the regex) exactly once."""
    before = fresh_entry(drill_worker)
    inst = before["instance_id"]
    log_mark = drill_worker.log.stat().st_size
    # Innocents long enough (200 tokens) to be still generating when the poison arrives: all
    # 33 are then suspects of the first death, which is what makes the count exact (below).
    rs = [generate.delay(model=DRILL_MODEL, prompt=f"innocent request {i}", max_tokens=200,
                         ignore_eos=True) for i in range(30)]
    rs.append(generate.delay(model=DRILL_MODEL, prompt="innocent samples", max_tokens=200, n=2,
                             temperature=1.0, seed=3, ignore_eos=True))
    # Held to letters for longer than max_tokens allows: it runs to its length.
    rs.append(generate.delay(model=DRILL_MODEL, prompt="innocent letters:", max_tokens=200,
                             temperature=0.0, structured={"regex": "[a-z]{4000}"}))
    wait_for(lambda: every_request_taken(store, rs, (inst,), DRILL_QUEUE)
             and all(store.get(r.id)["status"] == "RUNNING" for r in rs), 120,
             what="the 32 innocents to run")
    poison = generate.delay(model=DRILL_MODEL, prompt=f"a {POISON} in the batch", max_tokens=48,
                            ignore_eos=True)
    with pytest.raises(RequestError, match="^poison_request: ") as ei:
        poison.get(timeout=600)
    assert ei.value.code == "poison_request"
    outs = [r.get(timeout=600) for r in rs]
    assert all(o["completion_tokens"] == 200 for o in outs[:-1])
    assert [c["completion_tokens"] for c in outs[-2]["choices"]] == [200, 200]
    assert re.fullmatch("[a-z]+", outs[-1]["text"]) and outs[-1]["finish_reason"] == "length"
    assert_each_ran_to_a_result_once(store, [r.id for r in rs])
    assert [(h["outcome"], h["error"]) for h in store.history(poison.id)] == [
        ("failed", "poison_request")]
    # The engine serves again. (When the poison's group ran last and it was its last member,
    # nothing was left to run after its conviction: this request starts the 5th engine.)
    assert generate.delay(model=DRILL_MODEL, prompt="after the poison", max_tokens=4,
                          ignore_eos=True).get(timeout=120)["completion_tokens"] == 4
    after = fresh_entry(drill_worker)
    restarts = int(after["engine_restarts"]) - int(before["engine_restarts"])
    log = drill_worker.log.read_bytes()[log_mark:].decode(errors="replace")
    deaths = len(re.findall(r"death\(s\) in a row", log))
    groups = [int(n) for n in re.findall(r"re-running (\d+) suspect\(s\)", log)]
    print(f"\npoison convicted after {deaths} engine deaths ({restarts} restarts); suspects "
          f"re-run in turn as {groups}")
    assert int(after["poisoned"]) == int(before["poisoned"]) + 1
    # The rules (workers/engine/suspects.py) for 33 suspects, one a poison: death 1 (the
    # batch); the 33 together, death 2; split into ceil(sqrt(33)) = 6 groups of at most 6,
    # run one at a time: the poison's group dies, death 3; its members as singles: the poison
    # alone, death 4 (strike 1), alone again, death 5 (strike 2: convicted). A fresh engine
    # after each: 5 restarts.
    assert groups[:1] == [33], f"the suspects' first re-run held {groups[:1]}, not all 33"
    assert max(groups[1:]) <= 6
    assert deaths == 5 and restarts == 5
    assert int(after["death_streak"]) == 0


def test_a_worker_whose_engine_dies_on_every_start_leaves_and_its_requests_land_elsewhere(
        drill_worker, redis_server, store, tmp_path):
    """Given a worker whose every engine dies as soon as it starts, holding 16 requests, then
    after engine_death_limit deaths in a row it hands them back at once (same ids, attempt + 1),
    stops consuming and exits with status 70; all 16 complete on the healthy worker, none lost,
    none twice."""
    # A limit of 2 (the default is 3, covered by tests/test_engine_recovery.py): one engine
    # start less for the same path, to keep the suite short.
    broken = RunningWorker(redis_server, "broken@testhost", tmp_path, pools=DRILL_MODEL,
                           VIGIL_ENGINE="drill", VIGIL_DRILL="die_on_start", VIGIL_PRELOAD="0",
                           VIGIL_ENGINE_DEATH_LIMIT="2")
    healthy = drill_worker.name
    try:
        inst = broken.wait_registered()["instance_id"]
        # The healthy worker steps aside so that the broken one takes every request.
        with stepped_aside(healthy, DRILL_QUEUE):
            rs = [generate.delay(model=DRILL_MODEL, prompt=f"request {i}", max_tokens=16)
                  for i in range(16)]
            wait_for(lambda: every_request_taken(store, rs, (inst,), DRILL_QUEUE), 120,
                     what="the broken worker to take every request")
        outs = [r.get(timeout=600) for r in rs]
        assert broken.proc.wait(timeout=120) == 70
        assert all(o["worker"] == healthy and o["attempts"] == 2 for o in outs)
        for r in rs:
            first = store.history(r.id)[0]
            assert first["instance"] == inst and first["outcome"] == "requeued"
        assert_each_ran_to_a_result_once(store, [r.id for r in rs])
        log = broken.log.read_text()
        assert "repeated_engine_death" in log and "is broken and leaves" in log
    finally:
        broken.stop()
