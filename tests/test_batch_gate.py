"""Unit tier: waiting is not wedging, for any tier (docs/failure-modes.md, "Wedges").

The engine host lets about one batch of each tier past the engine's own wait inside vLLM for
its slots (the batch gate, workers/engine/tier_gate.py, "One batch ahead"), and
`VIGIL_REQUEST_TIMEOUT` (the wedge clock) of such a run starts only when the gate hands it a
slot, so it never counts time a request spends queued inside vLLM behind `max_num_seqs` running
ones. The engine here queues
as vLLM does: it runs at most `max_num_seqs` requests, the rest wait inside it in vLLM's
priority order (tier, then arrival), and each request, once scheduled, takes `work_s`."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.errors import TransientError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from app.requests.tiers import engine_priority
from tests.unit_helpers import wait_until
from workers.engine.output import EngineOutput

SPEC = ModelSpec(name="m", path="/x")


def req(prompt: str, priority: str = "default", max_tokens: int = 64) -> GenerateRequest:
    """A request; by default not a short run (more than 16 tokens): held to one batch."""
    return GenerateRequest(model="m", prompt=prompt, priority=priority, max_tokens=max_tokens)


class Queueing:
    """An engine that queues past `max_num_seqs` as vLLM does (module docstring). It records
    the order runs were scheduled in and the most requests that ever waited inside it.
    `stepping` cleared: scheduled runs make no progress (a SIGSTOPped EngineCore)."""

    def __init__(self, max_num_seqs: int = 2, work_s: float = 0.3):
        self.max_num_seqs = max_num_seqs
        self.work_s = work_s
        self.dead = False
        self.progress = 0
        self.stepping = threading.Event()
        self.stepping.set()
        self.release: threading.Event | None = None  # set: runs last until it is set instead
        self.hang: set[str] = set()  # prompts whose runs never end (until aborted)
        self.running: list[str] = []
        self.waiting: list[tuple[int, int, str]] = []
        self.started: list[str] = []
        self.peak_waiting = 0
        self.waited: list[str] = []  # the runs that waited inside it
        self.inside_at_entry: dict[str, int] = {}  # run -> the runs inside it as it entered
        self._arrivals = 0
        self._turn = None

    def __call__(self, spec, plan=None):
        return self

    async def run(self, r, rid):
        if self._turn is None:
            self._turn = asyncio.Condition()
        self._arrivals += 1
        me = (engine_priority(r.priority), self._arrivals, rid)
        async with self._turn:
            self.inside_at_entry[rid] = len(self.running) + len(self.waiting)
            self.waiting.append(me)
            self.waiting.sort()
            self.peak_waiting = max(self.peak_waiting, len(self.waiting) - (
                self.max_num_seqs - len(self.running)))
            if not (self.waiting[0] is me and len(self.running) < self.max_num_seqs):
                self.waited.append(rid)
            try:
                await self._turn.wait_for(lambda: self.waiting[0] is me
                                          and len(self.running) < self.max_num_seqs)
            finally:
                self.waiting.remove(me)
                self._turn.notify_all()
            self.running.append(rid)
            self.started.append(rid)
        try:
            end = time.monotonic() + self.work_s
            while r.prompt in self.hang or (time.monotonic() < end if self.release is None
                                            else not self.release.is_set()):
                if self.stepping.is_set():
                    self.progress += 1
                await asyncio.sleep(0.01)
            return EngineOutput(r.prompt, [1], "length", 1)
        finally:
            async with self._turn:
                self.running.remove(rid)
                self._turn.notify_all()

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self.dead = True


def assert_wedged(host, pending, request_id: str) -> None:
    """`pending`, a run that never finishes, ends `wedged` within 10 s (a run whose clock never
    starts never ends: the wait is bounded here, and the run aborted after)."""
    pool = ThreadPoolExecutor(1)
    try:
        with pytest.raises(TransientError,
                           match=f"^wedged: request {request_id}-1 got no answer"):
            pool.submit(host.result, pending).result(timeout=10)
    finally:
        pool.shutdown(wait=False)
        host.abort_requests({request_id})


def test_a_message_of_eight_on_two_slots_waits_for_slots_and_nothing_wedges(make_host):
    """The issue's scenario: an engine of 2 slots, 0.3 s per request, a request timeout of
    0.5 s, one message of 8 (the host's `submit_many`, as workers/service.py starts one).
    Every request ends ok and no health failure is reported, though two at a time waited
    inside the engine (0.3 s) before their run (0.3 s): the wedge clock ran only while each
    held a slot (eb37a72: 2 ok, 6 wedged, 6 failures; a clock started at the entry into
    vLLM: the waiting ones wedged)."""
    eng = Queueing(max_num_seqs=2, work_s=0.3)
    failures: list[str] = []
    host = make_host(eng, on_failure=failures.append)
    pendings = host.submit_many([(req(f"p{i}"), SPEC, f"r{i}-1", 0.5, None, None, False)
                                 for i in range(8)])
    assert [host.result(p).text for p in pendings] == [f"p{i}" for i in range(8)]
    assert failures == []
    assert eng.peak_waiting == 2  # one batch ahead, never more
    assert eng.waited == [f"r{i}-1" for i in range(2, 8)]
    assert eng.started == [f"r{i}-1" for i in range(8)]  # in arrival order


def test_a_run_waiting_inside_the_engine_starts_its_wedge_clock_when_it_gets_a_slot(make_host):
    """Given an engine of one slot running a request for 0.8 s and a second request, with a
    request timeout of 0.5 s, that never finishes once scheduled, then the second waits inside
    the engine past its timeout without ending, and ends `wedged` only after it got the slot:
    its clock starts when the gate hands it the slot the first one freed (red when the clock
    runs from its entry into vLLM: wedged before it ever ran; red when it never starts: no
    end at all)."""
    eng = Queueing(max_num_seqs=1, work_s=0.8)
    eng.hang.add("hang")
    failures: list[str] = []
    host = make_host(eng, on_failure=failures.append)
    first = host.submit(req("first"), SPEC, "first-1", 5)
    wait_until(lambda: eng.running == ["first-1"])
    hung = host.submit(req("hang"), SPEC, "hang-1", 0.5)
    wait_until(lambda: eng.waited == ["hang-1"])
    assert host.result(first).text == "first"
    assert_wedged(host, hung, "hang")
    assert eng.started == ["first-1", "hang-1"] and len(failures) == 1


def test_a_request_of_more_samples_than_the_batch_runs_alone_on_its_wedge_clock(make_host):
    """Given an engine of 2 slots and a request of n = 3 (more seats than the batch) that never
    finishes, with a timeout of 0.5 s, then it enters the empty engine within the batch, not
    ahead of it, and ends `wedged` (red when it is seated ahead: no slot ever fits it, its
    clock never starts, it never ends)."""
    eng = Queueing(max_num_seqs=2)
    eng.hang.add("wide")
    failures: list[str] = []
    host = make_host(eng, on_failure=failures.append)
    wide = host.submit(GenerateRequest(model="m", prompt="wide", n=3, temperature=1.0,
                                       max_tokens=64), SPEC, "wide-1", 0.5)
    assert_wedged(host, wide, "wide")
    assert eng.started == ["wide-1"] and len(failures) == 1


def test_every_tier_gets_slots_in_tier_order_then_arrival_order(make_host):
    """Given a full batch and default, bulk and interactive requests arriving in that order,
    then freed slots go to the interactive request first, then the default ones by arrival,
    then bulk: a bulk run waiting inside the engine does not keep a later default one out of
    it (the seats a run counts are those of its tier and the more urgent ones), and vLLM's
    order inside does the rest."""
    eng = Queueing(max_num_seqs=2)
    eng.release = threading.Event()
    host = make_host(eng)
    first = [host.submit(req(f"f{i}"), SPEC, f"f{i}-1", 30) for i in range(2)]
    wait_until(lambda: len(eng.running) == 2)
    later = [host.submit(req("d1"), SPEC, "d1-1", 30),
             host.submit(req("b1", "bulk"), SPEC, "b1-1", 30),
             host.submit(req("d2"), SPEC, "d2-1", 30)]
    wait_until(lambda: host.snapshot()["in_flight"] == 5)
    urgent = host.submit(req("i1", "interactive"), SPEC, "i1-1", 30)
    wait_until(lambda: host.snapshot()["in_flight"] == 6)
    eng.release.set()
    assert [host.result(p).text for p in first + later + [urgent]] == [
        "f0", "f1", "d1", "b1", "d2", "i1"]
    assert eng.started[2:] == ["i1-1", "d1-1", "d2-1", "b1-1"] and eng.peak_waiting == 4


def test_waiting_for_a_slot_does_not_use_up_the_wait_for_an_engine(make_host):
    """Given a wait bound for an engine (2 x timeout + the engine start bound = 1.05 s) shorter
    than the last requests' wait for a slot (4 x 0.3 s: three in the line, the last inside the
    engine) plus their run, then they still end ok, not engine_restarting: a slot that frees
    as the batch makes progress is not an engine that does not come, wherever it is waited
    for."""
    eng = Queueing(max_num_seqs=2, work_s=0.3)
    failures: list[str] = []
    host = make_host(eng, on_failure=failures.append, engine_start_timeout=0.05)
    pendings = host.submit_many([(req(f"p{i}"), SPEC, f"r{i}-1", 0.5, None, None, False)
                                 for i in range(10)])
    assert [host.result(p).text for p in pendings] == [f"p{i}" for i in range(10)]
    assert failures == []


def test_an_engine_that_makes_no_steps_is_still_a_stall_for_the_runs_and_those_waiting(
        make_host):
    """Given two runs in the engine and two requests waiting for a slot, when the engine makes
    no step for the stall timeout, then the watchdog aborts all four (wedged, each reported),
    as it did before requests waited outside the engine."""
    eng = Queueing(max_num_seqs=2, work_s=30)
    eng.stepping.clear()
    failures: list[str] = []
    host = make_host(eng, stall_timeout=0.3, on_failure=failures.append)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(host.generate, req(f"p{i}"), SPEC, f"r{i}-1", 30) for i in range(4)]
        for f in futs:
            with pytest.raises(TransientError, match="^wedged: the engine made no progress"):
                f.result(timeout=10)
    assert host.stalls == 1 and len(failures) == 4
    assert len(eng.started) == 2  # the two waiting never entered the engine
    wait_until(lambda: eng.running == [] and host.snapshot()["in_flight"] == 0)


def test_short_runs_queue_batches_inside_the_engine_and_a_long_run_waits_for_two(make_host):
    """Given an engine of 2 slots, 2 x SHORT_RUN_BATCHES + 2 one-token runs, then a long one,
    then 2 more one-token runs (one message), when they run, then the short runs take
    SHORT_RUN_BATCHES batches (2 run, the rest of those seats wait inside vLLM, never more: the
    last 2 wait outside until seats free), and the long run enters only when the runs inside
    are back within BATCHES_IN_ENGINE batches, as do the short runs behind it."""
    from workers.engine.tier_gate import BATCHES_IN_ENGINE, SHORT_RUN_BATCHES

    seats = 2 * SHORT_RUN_BATCHES
    eng = Queueing(max_num_seqs=2, work_s=0.05)
    eng.release = threading.Event()
    host = make_host(eng)
    shorts = [req(f"s{i}", max_tokens=1) for i in range(seats + 2)]
    reqs = shorts + [req("long")] + [req(f"t{i}", max_tokens=1) for i in range(2)]
    pendings = host.submit_many([(r, SPEC, f"{r.prompt}-1", 30, None, None, False)
                                 for r in reqs])
    wait_until(lambda: len(eng.running) == 2 and len(eng.waiting) == seats - 2)
    assert host.snapshot()["in_flight"] == len(reqs) and eng.started == ["s0-1", "s1-1"]
    held, eng.release = eng.release, None  # from here each run takes work_s
    held.set()
    assert [host.result(p).text for p in pendings] == [r.prompt for r in reqs]
    assert eng.peak_waiting == seats - 2  # the batches short runs may take, and no more
    assert eng.waited == [f"s{i}-1" for i in range(2, seats + 2)] + ["long-1", "t0-1", "t1-1"]
    assert eng.inside_at_entry["long-1"] < BATCHES_IN_ENGINE * 2
    assert max(eng.inside_at_entry[f"t{i}-1"] for i in range(2)) < BATCHES_IN_ENGINE * 2
    assert eng.started == [f"{r.prompt}-1" for r in reqs]
