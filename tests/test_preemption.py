"""Unit tier: lossless preemption in the engine host (workers/engine/tier_gate.py
`TierGate.preempt_for`) with a fake engine whose batch holds two requests: an interactive
request admitted to a full engine makes the preemptible bulk runs cheapest to rebuild (fewest
prompt and prefix tokens) yield as many slots as it needs (their tokens read first), never a run
whose resume would be refused, and nothing else is ever picked; one batch beyond the engine's
waits inside it (vLLM's queue, in tier order), so the one that yields holds a slot, and the slot
it frees goes to the interactive request, also one whose LoRA adapter had to load first."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest, parse_request
from app.requests.tiers import engine_priority
from app.state.streams import Checkpoint
from tests.unit_helpers import wait_until
from workers.engine.host import Preempted
from workers.engine.output import EngineOutput
from workers.streaming import StreamTap

SPEC = ModelSpec(name="m", path="/x")


def req(prompt, priority="bulk", n=1):
    return GenerateRequest(model="m", prompt=prompt, priority=priority, n=n, max_tokens=1000)


def tap_of(rid, prompt_tokens, made, made_with="", now=""):
    """A run's tap holding a prompt of `prompt_tokens` tokens and `made` generated ones (a
    resumed run's prefix among them), made with the adapter files `made_with` (today's: `now`)."""
    prior = Checkpoint([1] * prompt_tokens, [7] * made, "x" * made, made_with, [made])
    return StreamTap(None, rid, "claim", 1, "m", prior if made else None, now)


class Batch:
    """An engine whose batch holds `max_num_seqs` requests and queues the rest inside it in
    vLLM's priority order (tier, then arrival); a run lasts until `release` is set (or it is
    cancelled: the abort). It records what it read before each abort."""

    def __init__(self, max_num_seqs=2):
        self.max_num_seqs = max_num_seqs
        self.dead = False
        self.running: list[str] = []
        self.waiting: list[tuple[int, int, str]] = []
        self.started: list[str] = []
        self._arrivals = 0
        self.read: list[str] = []
        self.aborted: list[str] = []
        self.release = threading.Event()
        self.adapter_loads = threading.Event()  # cleared: an adapter's load waits for it
        self.adapter_loads.set()
        # Runs it does not schedule yet, as vLLM skips a request whose grammar still compiles.
        self.stalled: set[str] = set()

    def __call__(self, spec, plan=None):
        return self

    async def add_adapter(self, a):
        while not self.adapter_loads.is_set():
            await asyncio.sleep(0.01)

    async def remove_adapter(self, a):
        pass

    async def run(self, r, rid, adapter=None):
        self._arrivals += 1
        me = (engine_priority(r.priority), self._arrivals, rid)
        self.waiting.append(me)
        self.waiting.sort()
        try:
            while not (self._next() is me and len(self.running) < self.max_num_seqs):
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        finally:
            self.waiting.remove(me)
        self.running.append(rid)
        self.started.append(rid)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            return EngineOutput(r.prompt, [1], "length", 1)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        finally:
            self.running.remove(rid)

    def _next(self):
        """The waiting run it schedules next: the first not stalled."""
        return next((w for w in self.waiting if w[2] not in self.stalled), None)

    def generating(self, rid) -> bool:
        """Whether `rid` holds a slot (it runs)."""
        return rid in self.running

    @property
    def queued(self) -> list[str]:
        """The runs waiting inside it for a slot, in the order it schedules them."""
        return [w[2] for w in self.waiting]

    def read_now(self, rid):
        self.read.append(rid)

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        pass


def test_of_runs_as_cheap_to_rebuild_the_youngest_yields_its_slot(make_host):
    eng = Batch()
    host = make_host(eng)
    pool = ThreadPoolExecutor(4)
    old = pool.submit(host.generate, req("old"), SPEC, "old-1", 30, None, None, True)
    wait_until(lambda: "old-1" in eng.running)
    time.sleep(0.05)  # a younger run starts strictly later
    young = pool.submit(host.generate, req("new"), SPEC, "young-1", 30, None, None, True)
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


def test_the_run_cheapest_to_rebuild_yields_not_the_one_started_last(make_host):
    """Given a bulk run with 10 prompt tokens and 5 made, and one started later that resumed
    a 200-token prefix (the run started last is the one a preemption costs most: its prefix is
    prefilled again), then the interactive request makes the first one yield (eb37a72 picked
    the one started last)."""
    eng = Batch()
    host = make_host(eng)
    pool = ThreadPoolExecutor(4)
    cheap = pool.submit(host.generate, req("cheap"), SPEC, "cheap-1", 30, None,
                        tap_of("cheap", 10, 5), True)
    wait_until(lambda: "cheap-1" in eng.running)
    time.sleep(0.05)  # the resumed run starts strictly later
    resumed = pool.submit(host.generate, req("resumed"), SPEC, "resumed-2", 30, None,
                          tap_of("resumed", 10, 200), True)
    wait_until(lambda: len(eng.running) == 2)
    urgent = pool.submit(host.generate, req("now", "interactive"), SPEC, "now-1", 30)
    with pytest.raises(Preempted):
        cheap.result(10)
    assert eng.read == ["cheap-1"]
    eng.release.set()
    assert urgent.result(10).text == "now" and resumed.result(10).text == "resumed"
    assert host.stats.preemptions == 1
    pool.shutdown()


def test_a_run_whose_resume_would_be_refused_is_never_the_victim(make_host):
    """Given the cheaper of two bulk runs holding tokens made with adapter files that changed
    since (its resume would be refused: workers/engine/resume.py `refusal`, and its tokens
    thrown away), then the other one yields, though it costs more to rebuild; with only such
    runs in the batch, none yields and the interactive request waits for a slot."""
    eng = Batch()
    host = make_host(eng)
    pool = ThreadPoolExecutor(4)
    dear = pool.submit(host.generate, req("dear"), SPEC, "dear-1", 30, None,
                       tap_of("dear", 10, 200), True)
    wait_until(lambda: "dear-1" in eng.running)
    time.sleep(0.05)  # the refused one starts strictly later (eb37a72 picked it, the youngest)
    stale = pool.submit(host.generate, req("stale"), SPEC, "stale-1", 30, None,
                        tap_of("stale", 10, 5, made_with="old", now="new"), True)
    wait_until(lambda: len(eng.running) == 2)
    urgent = pool.submit(host.generate, req("now", "interactive"), SPEC, "now-1", 30)
    with pytest.raises(Preempted):
        dear.result(10)
    assert eng.read == ["dear-1"]
    wait_until(lambda: "now-1" in eng.running)
    again = pool.submit(host.generate, req("again", "interactive"), SPEC, "again-1", 30)
    wait_until(lambda: eng.queued == ["again-1"])  # inside, for a slot: nothing yields for it
    assert eng.read == ["dear-1"] and host.stats.preemptions == 1
    eng.release.set()
    assert [f.result(10).text for f in (stale, urgent, again)] == ["stale", "now", "again"]
    pool.shutdown()


def test_an_interactive_request_of_n_samples_frees_as_many_slots(make_host):
    """Given a batch of four full of bulk runs, an interactive request of n=2 (vLLM runs each
    sample in a slot of its own) makes the two cheapest yield, not one (eb37a72: one), and
    enters once both slots are free."""
    eng = Batch(max_num_seqs=4)
    host = make_host(eng)
    pool = ThreadPoolExecutor(6)
    bulk = [pool.submit(host.generate, req(f"b{i}"), SPEC, f"b{i}-1", 30, None,
                        tap_of(f"b{i}", 10, made), True)
            for i, made in enumerate((300, 5, 200, 6))]
    wait_until(lambda: len(eng.running) == 4)
    urgent = pool.submit(host.generate, req("now", "interactive", n=2), SPEC, "now-1", 30)
    for i in (1, 3):
        with pytest.raises(Preempted):
            bulk[i].result(10)
    assert sorted(eng.read) == ["b1-1", "b3-1"] and host.stats.preemptions == 2
    wait_until(lambda: "now-1" in eng.running)
    eng.release.set()
    assert urgent.result(10).text == "now"
    assert [bulk[i].result(10).text for i in (0, 2)] == ["b0", "b2"]
    pool.shutdown()


def test_the_slot_freed_for_an_interactive_request_loading_its_adapter_stays_its_own(
        make_host, tmp_path):
    """Given a full batch of bulk runs, a bulk request waiting inside the engine for a slot,
    and an interactive request whose LoRA adapter is cold (its load takes a while), then no run
    yields while the adapter loads (a slot freed then would go to the bulk request inside the
    engine), and once the interactive request is in the engine a bulk run yields and the slot
    is its own: it runs before the waiting bulk request (eb37a72: the bulk request took the
    slot at once)."""
    from tests.test_engine_lora import make_adapter

    spec = ModelSpec(name="model-a", path="/x", max_loras=1, max_lora_rank=8,
                     lora_mixing_safe=True)
    adapter = make_adapter(tmp_path, "a1")
    eng = Batch()
    host = make_host(eng)
    first = [host.submit(req(f"b{i}"), spec, f"b{i}-1", 30, None, None, True) for i in (0, 1)]
    wait_until(lambda: len(eng.running) == 2)
    waiting = host.submit(req("b2"), spec, "b2-1", 30, None, None, True)
    wait_until(lambda: eng.queued == ["b2-1"])
    eng.adapter_loads.clear()
    pool = ThreadPoolExecutor(1)
    urgent = pool.submit(host.generate, req("now", "interactive"), spec, "now-1", 30, adapter)
    wait_until(lambda: host.snapshot()["in_flight"] == 4)
    time.sleep(0.2)  # its adapter loads: nothing yields meanwhile
    assert eng.read == [] and eng.aborted == [] and host.stats.preemptions == 0
    eng.adapter_loads.set()
    with pytest.raises(Preempted):
        host.result(first[1])
    assert eng.aborted == ["b1-1"]
    wait_until(lambda: "now-1" in eng.running)
    assert eng.started == ["b0-1", "b1-1", "now-1"]  # the waiting bulk request did not take it
    eng.release.set()
    assert urgent.result(10).text == "now"
    assert [host.result(p).text for p in (first[0], waiting)] == ["b0", "b2"]
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
    wait_until(lambda: eng.queued == ["now-1"])  # it waits for a slot, inside the engine
    assert eng.aborted == [] and host.stats.preemptions == 0 and "now-1" not in eng.running
    eng.release.set()
    assert {f.result(10).text for f in (tired, plain, urgent)} == {"tired", "plain", "now"}
    pool.shutdown()


def four_bulk(eng, host):
    """Submit bulk runs b0 to b3, the first alone, the others strictly later, and wait until
    the engine's batch of two is full; their handles (b0's, then the rest's)."""
    first = host.submit(req("b0"), SPEC, "b0-1", 30, None, None, True)
    wait_until(lambda: "b0-1" in eng.running)
    time.sleep(0.05)  # the others start strictly later
    rest = [host.submit(req(f"b{i}"), SPEC, f"b{i}-1", 30, None, None, True) for i in (1, 2, 3)]
    wait_until(lambda: len(eng.running) == 2)
    time.sleep(0.2)
    return first, rest


def test_bulk_beyond_the_batch_waits_inside_the_engine_and_only_a_running_one_yields(
        make_host):
    """Given an engine whose batch holds two requests and four bulk requests started together
    (one message of many), then two run and the other two wait inside the engine, one batch
    ahead; an interactive request then makes the younger of the two running ones yield (a run
    in the batch, never one that waits: that would free no slot), and takes its slot before
    the waiting bulk work; an abort of a waiting one ends it; all the rest finish."""
    from workers.engine.host import Aborted

    eng = Batch(max_num_seqs=2)
    host = make_host(eng)
    first, rest = four_bulk(eng, host)
    assert eng.running == ["b0-1", "b1-1"] and eng.queued == ["b2-1", "b3-1"]
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
    assert eng.queued == ["b2-1", "b3-1"]
    assert host.abort_requests({"b3"}) == 1
    with pytest.raises(Aborted):
        host.result(rest[2])
    eng.release.set()
    assert urgent.result(10).text == "now"
    assert [host.result(p).text for p in (first, rest[1])] == ["b0", "b2"]
    assert eng.aborted == ["b1-1", "b3-1"]  # the victim, and the abort of one that waited
    wait_until(lambda: host.snapshot()["in_flight"] == 0)
    pool.shutdown()


def test_a_run_seated_in_the_batch_but_waiting_inside_the_engine_never_yields(make_host):
    """Given an engine whose batch holds two requests and four bulk requests started together,
    the second seated within the batch but not scheduled by the engine (its grammar compiles),
    so the engine runs the first and third; then an interactive request makes the first yield
    (a run the engine made a token for), not the second (cheapest by its start, but it holds
    no slot: the interactive request would wait for a run's end; f25accf's fresh-clone runs
    failed tests/test_tiers_e2e.py so), and it runs before any bulk run ends."""
    eng = Batch(max_num_seqs=2)
    eng.stalled = {"b1-1"}
    host = make_host(eng)
    first, rest = four_bulk(eng, host)
    assert eng.running == ["b0-1", "b2-1"] and eng.queued == ["b1-1", "b3-1"]
    pool = ThreadPoolExecutor(1)
    urgent = pool.submit(host.generate, req("now", "interactive"), SPEC, "now-1", 30)
    with pytest.raises(Preempted):
        host.result(first)
    assert eng.read == ["b0-1"]
    wait_until(lambda: "now-1" in eng.running)  # before any bulk run ended
    eng.stalled.clear()
    eng.release.set()
    assert urgent.result(10).text == "now"
    assert [host.result(p).text for p in rest] == ["b1", "b2", "b3"]
    wait_until(lambda: host.snapshot()["in_flight"] == 0)
    pool.shutdown()


@pytest.mark.redis
def test_a_preempted_attempt_goes_back_at_once_using_no_attempt_and_counted(settings):
    """Given a bulk request running on a worker, when it yields its slot (the engine host
    cancels its run PREEMPTED), then serve raises `preempted` carrying an at-once retry, the
    record is PENDING for the next dispatch with its attempt refunded and one preemption
    counted; a request preempted VIGIL_MAX_PREEMPTIONS times is no longer preemptible."""
    from app.errors import TransientError
    from tests.unit_helpers import RecordingPorts
    from tests.test_store_and_service import create
    from workers.engine.bridge import PREEMPTED
    from workers.engine.host import EngineHost
    from workers.runtime import WorkerRuntime
    from workers.delivery_answers import preemptible
    from workers.service import serve

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
    """Given an engine whose batch holds two requests and six bulk requests (four in it: two
    batches, two at the gate), when the engine dies, then the suspects re-run on the fresh
    engine still at most two batches at a time: the gate holds a ticket's every run, not only
    its first. Before, every re-run entered the fresh engine at once."""
    from tests.dying_engine import DyingEngine, World

    class Batched(DyingEngine):
        max_num_seqs = 2

    class Fleet(World):
        def __call__(self, spec, plan=None):
            e = Batched(self)
            self.engines.append(e)
            return e

    w = Fleet()
    host = make_host(w)
    pool = ThreadPoolExecutor(6)
    try:
        futs = [pool.submit(host.generate, req(f"b{i}"), SPEC, f"b{i}-1", 30) for i in range(6)]
        wait_until(lambda: w.engines and len(w.current().in_flight) == 4)
        time.sleep(0.1)
        assert len(w.current().in_flight) == 4  # two wait at the gate, outside the engine
        w.current().die()
        wait_until(lambda: len(w.engines) == 2)
        w.gate.set()  # the fresh engine's canary and the re-runs may finish
        assert sorted(f.result(30).text for f in futs) == [f"b{i}" for i in range(6)]
        assert w.engines[1].peak <= 4, w.engines[1].peak
    finally:
        w.gate.set()
        pool.shutdown()
