"""Unit tier: lossless preemption in the engine host (workers/engine/host.py `_preempt_for`)
with a fake engine whose batch holds two requests: an interactive request admitted to a full
engine makes the youngest preemptible bulk run yield its slot (its tokens read first), and
nothing else is ever picked; bulk work beyond the batch waits at the bulk gate, outside the
engine, so the one that yields holds a batch slot."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest, parse_request
from tests.conftest import wait_until
from workers.engine.host import Preempted
from workers.engine.output import EngineOutput

SPEC = ModelSpec(name="m", path="/x")


def req(prompt, priority="bulk"):
    return GenerateRequest(model="m", prompt=prompt, priority=priority)


class Batch:
    """An engine whose batch holds `max_num_seqs` requests; a run lasts until `release` is set
    (or it is cancelled: the abort). It records what it read before each abort."""

    def __init__(self, max_num_seqs=2):
        self.max_num_seqs = max_num_seqs
        self.dead = False
        self.running: list[str] = []
        self.read: list[str] = []
        self.aborted: list[str] = []
        self.release = threading.Event()

    def __call__(self, spec, plan=None):
        return self

    async def run(self, r, rid):
        self.running.append(rid)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            return EngineOutput(r.prompt, [1], "length", 1)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        finally:
            self.running.remove(rid)

    def read_now(self, rid):
        self.read.append(rid)

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        pass


def test_an_interactive_request_makes_the_youngest_bulk_run_yield_its_slot(make_host):
    eng = Batch()
    host = make_host(eng)
    pool = ThreadPoolExecutor(4)
    old = pool.submit(host.generate, req("old"), SPEC, "old-1", 30, None, None, True)
    wait_until(lambda: "old-1" in eng.running)
    time.sleep(0.05)  # a younger run starts strictly later
    young = pool.submit(host.generate, req("young"), SPEC, "young-1", 30, None, None, True)
    wait_until(lambda: len(eng.running) == 2)
    urgent = pool.submit(host.generate, req("now", "interactive"), SPEC, "now-1", 30)
    with pytest.raises(Preempted):
        young.result(10)
    assert eng.read == ["young-1"]  # its tokens read into its tap first
    wait_until(lambda: eng.aborted == ["young-1"])  # then aborted in the engine
    wait_until(lambda: "now-1" in eng.running)
    eng.release.set()
    assert urgent.result(10).text == "now" and old.result(10).text == "old"
    assert host.stats.preemptions == 1 and host.snapshot()["preemptions"] == 1
    pool.shutdown()


def test_only_preemptible_bulk_runs_yield_and_only_when_the_batch_is_full(make_host):
    eng = Batch(max_num_seqs=2)
    host = make_host(eng)
    pool = ThreadPoolExecutor(4)
    # A bulk run out of preemptions (not preemptible) and a default-tier run fill the batch.
    tired = pool.submit(host.generate, req("tired"), SPEC, "tired-1", 30, None, None, False)
    plain = pool.submit(host.generate, req("plain", "default"), SPEC, "plain-1", 30, None,
                        None, True)
    wait_until(lambda: len(eng.running) == 2)
    urgent = pool.submit(host.generate, req("now", "interactive"), SPEC, "now-1", 30)
    wait_until(lambda: "now-1" in eng.running)  # the fake runs it beside them: vLLM would queue
    assert eng.aborted == [] and host.stats.preemptions == 0
    eng.release.set()
    assert {f.result(10).text for f in (tired, plain, urgent)} == {"tired", "plain", "now"}
    pool.shutdown()


def test_bulk_beyond_the_batch_waits_outside_the_engine_so_the_victim_holds_a_slot(make_host):
    """Given an engine whose batch holds two requests and four bulk requests started together
    (one message of many), then only two enter the engine and the other two wait at the bulk
    gate; an interactive request then makes the younger of the two running ones yield (a
    request in a batch slot, never one that waits), and takes its slot before the waiting bulk
    work; an abort of a waiting one releases its place; all the rest finish."""
    from workers.engine.host import Aborted

    eng = Batch(max_num_seqs=2)
    host = make_host(eng)
    first = host.submit(req("b0"), SPEC, "b0-1", 30, None, None, True)
    wait_until(lambda: "b0-1" in eng.running)
    time.sleep(0.05)  # the others start strictly later
    rest = [host.submit(req(f"b{i}"), SPEC, f"b{i}-1", 30, None, None, True) for i in (1, 2, 3)]
    wait_until(lambda: len(eng.running) == 2)
    time.sleep(0.2)
    assert eng.running == ["b0-1", "b1-1"]  # b2 and b3 wait outside the engine
    assert host.snapshot()["in_flight"] == 4
    pool = ThreadPoolExecutor(1)
    urgent = pool.submit(host.generate, req("now", "interactive"), SPEC, "now-1", 30)
    with pytest.raises(Preempted):
        host.result(rest[0])
    assert eng.read == ["b1-1"]
    wait_until(lambda: host.stats.preemptions == 1)
    wait_until(lambda: eng.running == ["b0-1", "now-1"])
    time.sleep(0.2)
    assert eng.running == ["b0-1", "now-1"]  # the batch is full again: b2, b3 still wait
    assert host.abort_requests({"b3"}) == 1
    with pytest.raises(Aborted):
        host.result(rest[2])
    eng.release.set()
    assert urgent.result(10).text == "now"
    assert [host.result(p).text for p in (first, rest[1])] == ["b0", "b2"]
    assert "b3-1" not in eng.aborted  # it never entered the engine
    wait_until(lambda: host.snapshot()["in_flight"] == 0)
    pool.shutdown()


@pytest.mark.redis
def test_a_preempted_attempt_goes_back_at_once_using_no_attempt_and_counted(settings):
    """Given a bulk request running on a worker, when it yields its slot (the engine host
    cancels its run PREEMPTED), then serve raises `preempted` carrying an at-once retry, the
    record is PENDING for the next dispatch with its attempt given back and one preemption
    counted; a request preempted VIGIL_MAX_PREEMPTIONS times is no longer preemptible."""
    from app.errors import TransientError
    from tests.conftest import RecordingPorts
    from tests.test_store_and_service import create
    from workers.engine.bridge import PREEMPTED
    from workers.engine.host import EngineHost
    from workers.runtime import WorkerRuntime
    from workers.service import preemptible, serve

    rt = WorkerRuntime(settings, "w-pre", engine="instant", guard=False,
                       ports=RecordingPorts())
    eng = Batch()
    rt.host = EngineHost(eng, idle_cleanup=0).start()
    try:
        kw = {"model": "tiny-llama", "prompt": "long", "priority": "bulk"}
        create(rt.store, "bulk-1", prompt="long", priority="bulk")
        pool = ThreadPoolExecutor(1)
        fut = pool.submit(serve, rt, "bulk-1", 0, kw)
        wait_until(lambda: eng.running)
        rt.host._bridge.cancel_requests({"bulk-1"}, PREEMPTED)
        with pytest.raises(TransientError, match="^preempted: ") as ei:
            fut.result(10)
        d = ei.value.decision
        assert d.countdown == 0.0 and not d.uses_attempt
        rec = rt.store.get("bulk-1")
        assert (rec["status"], rec["dispatch"], rec["attempts"], rec["preemptions"]) == (
            "PENDING", "1", "0", "1")
        b = rt.store.begin("bulk-1", 1, "w-pre", rt.instance_id, time.time(), 3)
        assert b.preemptions == 1
        assert preemptible(parse_request(kw), b, settings)  # 1 of 3
        s = settings.model_copy(update={"max_preemptions": 1})
        assert not preemptible(parse_request(kw), b, s)
        pool.shutdown()
    finally:
        rt.host.shutdown(1)


def test_the_bulk_gate_holds_a_re_run_after_an_engine_death_too(make_host):
    """Given an engine whose batch holds two requests and four bulk requests (two in it, two at
    the bulk gate), when the engine dies, then the four suspects re-run on the fresh engine
    still at most two at a time: the gate holds a ticket's every run, not only its first. (A
    minimal change to workers/engine/host.py, whose tier gate issue 38's items 1, 4 and 5
    rework.) Before, all four re-runs entered the fresh engine at once, bulk work waiting
    inside vLLM ahead of any interactive request."""
    from tests.test_engine_recovery import DyingEngine, World

    class Batched(DyingEngine):
        max_num_seqs = 2

    class Fleet(World):
        def __call__(self, spec, plan=None):
            e = Batched(self)
            self.engines.append(e)
            return e

    w = Fleet()
    host = make_host(w)
    pool = ThreadPoolExecutor(4)
    try:
        futs = [pool.submit(host.generate, req(f"b{i}"), SPEC, f"b{i}-1", 30) for i in range(4)]
        wait_until(lambda: w.engines and len(w.current().in_flight) == 2)
        time.sleep(0.1)
        assert len(w.current().in_flight) == 2  # two wait at the gate, outside the engine
        w.current().die()
        wait_until(lambda: len(w.engines) == 2)
        w.gate.set()  # the fresh engine's canary and the re-runs may finish
        assert sorted(f.result(30).text for f in futs) == ["b0", "b1", "b2", "b3"]
        assert w.engines[1].peak <= 2, w.engines[1].peak
    finally:
        w.gate.set()
        pool.shutdown()
