"""Redis tier: serving a message that carries many requests, or one (workers/service.py, the
one road), with a scripted engine, on a real Redis (database 1): one claim round trip, the requests run together,
one finish round trip for those that end together; each request its own end, written as it
ends (a short one never waits for a slower sibling); a request that needs a retry or yields
its slot (a preemption) goes back alone as its next dispatch; a sibling the reaper requeued is
dropped alone; a bad one fails alone; the message goes back whole when the worker takes nothing
new."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.errors import TransientError
from tests.unit_helpers import RecordingPorts, wait_until
from tests.test_store_and_service import KW, Scripted, create
from workers.engine.host import EngineHost
from workers.engine.output import EngineOutput
from workers.runtime import WorkerRuntime
from workers.delivery_answers import GiveBack
from workers.service import serve_many

pytestmark = pytest.mark.redis


class Counting(Scripted):
    """A scripted engine that answers by prompt and counts the most requests it ran at once."""

    def __init__(self, answers):
        super().__init__([])
        self.answers, self.now, self.peak = answers, 0, 0

    async def run(self, req, rid, *a, **kw):
        import asyncio

        self.calls += 1
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.05)
            step = self.answers.get(req.prompt, EngineOutput("ok", [1, 2], "length", 1))
            if isinstance(step, BaseException):
                raise step
            return step
        finally:
            self.now -= 1


class Held(Counting):
    """Counting, except that a prompt in `held` runs until `release` is set (or is cancelled:
    the abort), with a batch of `max_num_seqs` runs (the engine host preempts for an
    interactive request only when it is full)."""

    def __init__(self, held, max_num_seqs=128):
        super().__init__({})
        self.held, self.max_num_seqs = set(held), max_num_seqs
        self.release = threading.Event()
        self.running: list[str] = []
        self.aborted: list[str] = []

    async def run(self, req, rid, *a, **kw):
        if req.prompt not in self.held:
            return await super().run(req, rid)
        self.running.append(rid)
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            return EngineOutput(req.prompt, [1], "length", 1)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        finally:
            self.running.remove(rid)

    def read_now(self, rid):  # a preempted run's tokens read into its tap (none here)
        pass


@pytest.fixture()
def runtime(settings):
    made = []

    def _make(answers=None, engine=None):
        rt = WorkerRuntime(settings, "w-many", engine="instant", guard=False,
                           ports=RecordingPorts())
        rt.engine = engine or Counting(answers or {})
        rt.host = EngineHost(rt.engine, idle_cleanup=0).start()
        made.append(rt)
        return rt

    yield _make
    for rt in made:
        rt.host.shutdown(1)


def items(n, **kw):
    return [{"id": f"m{i}", "kwargs": {**KW, "prompt": f"p{i}", **kw}} for i in range(n)]


def test_many_requests_end_each_and_run_together(runtime):
    rt = runtime()
    batch = items(6)
    for it in batch:
        create(rt.store, it["id"], prompt=it["kwargs"]["prompt"])
    tally = serve_many(rt, batch)
    assert tally == {"requests": 6, "succeeded": 6, "failed": 0, "retried": 0, "dropped": 0}
    assert rt.engine.peak == 6  # one task thread, all six in the engine at once
    for it in batch:
        rec = rt.store.get(it["id"])
        assert rec["status"] == "SUCCEEDED" and rec["attempts"] == "1"
    again = serve_many(rt, batch)  # the message delivered again: nothing runs twice
    assert again["succeeded"] == 6 and rt.engine.calls == 6


def test_a_retry_goes_back_alone_and_a_bad_request_fails_alone(runtime):
    rt = runtime({"p1": TransientError.of("allocation_failed", "KV blocks")})
    batch = items(3)
    batch[2]["kwargs"] = {**KW, "prompt": ""}  # invalid
    for it in batch[:2]:
        create(rt.store, it["id"], prompt=it["kwargs"]["prompt"])
    tally = serve_many(rt, batch)
    assert (tally["succeeded"], tally["retried"], tally["failed"]) == (1, 1, 1)
    assert rt.store.get("m0")["status"] == "SUCCEEDED"
    rec = rt.store.get("m1")
    assert (rec["status"], rec["dispatch"]) == ("PENDING", "1")
    assert rt.ports.sent == [("m1", 1)]  # alone, as its next dispatch
    assert rt.store.get("m2")["error"].startswith("invalid_request: ")


def test_a_request_is_finished_as_it_ends_without_waiting_for_a_slower_sibling(runtime):
    """Given a message of three requests, one of which runs until released, when the other
    two end, then their results are stored (and their waiters told) while the slow one still
    runs; it ends later in its own finish."""
    rt = runtime(engine=Held({"p2"}))
    batch = items(3)
    for it in batch:
        create(rt.store, it["id"], prompt=it["kwargs"]["prompt"])
    pool = ThreadPoolExecutor(1)
    try:
        fut = pool.submit(serve_many, rt, batch)
        wait_until(lambda: rt.store.get("m0")["status"] == rt.store.get("m1")["status"]
                   == "SUCCEEDED")
        assert rt.engine.running == ["m2-1"] and rt.store.get("m2")["status"] == "RUNNING"
        assert not fut.done()
        rt.engine.release.set()
        assert fut.result(10) == {"requests": 3, "succeeded": 3, "failed": 0, "retried": 0,
                                  "dropped": 0}
        assert rt.store.get("m2")["status"] == "SUCCEEDED"
    finally:
        rt.engine.release.set()
        pool.shutdown()


def test_a_sibling_preempted_for_an_interactive_request_goes_back_alone(runtime):
    """Given a message of three bulk requests (not short runs) filling the engine's batch
    (max_num_seqs 3), when an interactive request arrives, then the youngest sibling yields its
    slot (the host's own preemption, workers/engine/host.py `_preempt_for`) and goes back
    alone: published as its next dispatch, its record PENDING with its attempt refunded and one
    preemption counted; its two siblings and the interactive request end SUCCEEDED, nothing
    else is published."""
    from workers.service import serve

    rt = runtime(engine=Held({"p0", "p1", "p2", "now"}, max_num_seqs=3))
    # 64 tokens: not short runs, which take more than the batch and never yield
    # (workers/engine/tier_gate.py)
    batch = items(3, priority="bulk", max_tokens=64)
    for it in batch:
        create(rt.store, it["id"], prompt=it["kwargs"]["prompt"], priority="bulk",
               max_tokens=64)
    create(rt.store, "i1", prompt="now", priority="interactive")
    pool = ThreadPoolExecutor(2)
    try:
        many = pool.submit(serve_many, rt, batch)
        wait_until(lambda: len(rt.engine.running) == 3)
        youngest = rt.engine.running[-1].rsplit("-", 1)[0]
        urgent = pool.submit(serve, rt, "i1", 0, {**KW, "prompt": "now",
                                                   "priority": "interactive"})
        wait_until(lambda: rt.ports.sent)
        assert rt.ports.sent == [(youngest, 1)]  # alone, as its next dispatch
        assert rt.engine.aborted == [f"{youngest}-1"]
        rec = rt.store.get(youngest)
        assert (rec["status"], rec["dispatch"], rec["attempts"], rec["preemptions"]) == (
            "PENDING", "1", "0", "1")
        rt.engine.release.set()
        assert many.result(10) == {"requests": 3, "succeeded": 2, "failed": 0, "retried": 1,
                                   "dropped": 0}
        assert urgent.result(10)["text"] == "now"
        others = [it["id"] for it in batch if it["id"] != youngest]
        assert [rt.store.get(rid)["status"] for rid in others] == ["SUCCEEDED"] * 2
        assert rt.ports.sent == [(youngest, 1)]
    finally:
        rt.engine.release.set()
        pool.shutdown()


def test_a_sibling_whose_structured_output_broke_is_no_result_and_ends_or_goes_back_alone(
        runtime):
    """Given a message of three structured (JSON schema) requests whose engine output breaks
    the schema for two of them (a raw control character in a string: what xgrammar 0.2.8 lets
    through), when it is served, then neither broken output is stored as a result: the greedy
    one ends at once (attempts_exhausted: it would make the same output again), the sampled one
    goes back alone as its next dispatch (another sample may hold), and the valid one
    succeeds."""
    schema = {"type": "object", "required": ["s"],
              "properties": {"s": {"type": "string", "maxLength": 4}}}
    broken = EngineOutput('{"s": "\x1a"}', [1, 2], "stop", 1)
    rt = runtime({"p0": broken, "p1": broken,
                  "p2": EngineOutput('{"s": "ok"}', [1, 2], "stop", 1)})
    batch = items(3, structured={"json": schema})
    batch[0]["kwargs"]["temperature"] = 0.0
    for it in batch:
        create(rt.store, it["id"], **{k: v for k, v in it["kwargs"].items() if k != "model"})
    tally = serve_many(rt, batch)
    assert (tally["succeeded"], tally["failed"], tally["retried"]) == (1, 1, 1)
    greedy = rt.store.get("m0")
    assert greedy["status"] == "FAILED" and greedy["error"].startswith(
        "attempts_exhausted: 1 attempt used, and another would make the same output")
    assert "structured_output_invalid: the output broke its json constraint: not strict " \
        "JSON: Invalid control character" in greedy["error"]
    sampled = rt.store.get("m1")
    assert (sampled["status"], sampled["dispatch"], sampled["attempts"]) == ("PENDING", "1", "1")
    assert sampled["last_error"].startswith("structured_output_invalid: ")
    assert rt.ports.sent == [("m1", 1)]
    assert rt.store.get("m2")["status"] == "SUCCEEDED"


@pytest.mark.parametrize("fault, code", [
    (TransientError.of("redis_unavailable", "cannot reach Redis (past the outage grace)"),
     "redis_unavailable"),
    (RuntimeError("a bug in the finish"), "worker_lost"),
])
def test_an_exception_out_of_the_serving_loop_strands_none_of_the_messages_requests(
        runtime, fault, code):
    """Given a message of three requests, one of which ends at once while two still run, when
    the finish of the first raises (a Redis error past the outage grace, or any bug: injected
    into the store's `finish_many`, Redis itself staying up to witness), then no request is
    left RUNNING under this live worker until the deadline sweep: the two still running are
    aborted in the engine, and all three go back alone as their next dispatch, through the one
    retry decision (`redis_unavailable` as itself, anything else as `worker_lost`), each
    published; serve_many returns what it did."""
    rt = runtime(engine=Held({"p1", "p2"}))
    batch = items(3)
    for it in batch:
        create(rt.store, it["id"], prompt=it["kwargs"]["prompt"])

    def failing(*_a, **_kw):
        raise fault
    rt.store.finish_many = failing
    pool = ThreadPoolExecutor(1)
    try:
        tally = pool.submit(serve_many, rt, batch).result(30)
    finally:
        rt.engine.release.set()
        pool.shutdown()
    assert (tally["retried"], tally["succeeded"], tally["failed"]) == (3, 0, 0)
    recs = [rt.store.get(it["id"]) for it in batch]
    assert [(r["status"], r["dispatch"]) for r in recs] == [("PENDING", "1")] * 3
    assert all(r["last_error"].startswith(f"{code}: ") for r in recs)
    assert sorted(rt.ports.sent) == [("m0", 1), ("m1", 1), ("m2", 1)]
    assert sorted(rt.engine.aborted) == ["m1-1", "m2-1"]


@pytest.mark.parametrize("fault, code", [
    (TransientError.of("redis_unavailable", "cannot reach Redis (past the outage grace)"),
     "redis_unavailable"),
    (RuntimeError("a bug in the finish"), "worker_lost"),
])
def test_an_exception_out_of_one_delivery_is_decided_as_of_many(runtime, fault, code):
    """The same road for one request (vigil.generate's `serve`): given a delivery whose finish
    raises, then its record is released to its next dispatch through the one retry decision
    (`redis_unavailable` as itself, anything else as `worker_lost`) and `serve` raises that
    error carrying the decision, for the task's retry path; nothing is published here (the
    task's retry publishes it once). Before the one road, a bug escaping `serve` left the
    request RUNNING under a live worker until the deadline sweep."""
    from workers.service import serve

    rt = runtime()
    create(rt.store, "solo")

    def failing(*_a, **_kw):
        raise fault
    rt.store.finish_many = failing
    with pytest.raises(TransientError) as ei:
        serve(rt, "solo", 0, KW)
    assert ei.value.code == code and ei.value.decision.countdown >= 0
    rec = rt.store.get("solo")
    assert (rec["status"], rec["dispatch"]) == ("PENDING", "1")
    assert rec["last_error"].startswith(f"{code}: ") and rt.ports.sent == []


def test_a_request_sent_around_the_producer_with_a_new_job_announces_its_queue(runtime):
    """Given no record (sent around the producer: send_task, a raw push) and a job no request
    used before, when a worker serves it alone (vigil.generate) or in a message of many, then
    it records the request and tells the pool's workers to consume the job's new queue, as the
    producer's submit does (its retries are published there). Before, no broadcast: they waited
    there for beat's reconcile to repair the announcement."""
    from app.state.queues import job_queue_name
    from workers.service import serve

    rt = runtime()
    rt.store.workers.write(7, {"name": "w-many", "instance_id": 7, "pools": "tiny-llama",
                               "has_pinged": 1}, time.time())
    assert serve(rt, "solo", 0, {**KW, "prompt": "alone", "job": "fresh-a"})["text"] == "ok"
    tally = serve_many(rt, [{"id": "many", "kwargs": {**KW, "prompt": "m", "job": "fresh-b"}}])
    assert tally["succeeded"] == 1
    assert [b for b in rt.ports.broadcasts if b[0] == "add_consumer"] == [
        ("add_consumer", job_queue_name("tiny-llama", job), ["w-many"])
        for job in ("fresh-a", "fresh-b")]


def test_a_sibling_the_reaper_requeued_is_dropped_alone(runtime):
    """Given a message of three whose middle request the reaper already requeued (its record
    at dispatch 1, its copy published by the reaper), when the message is served, then that
    request is dropped as a stale copy (not run, not published again) and its siblings run."""
    rt = runtime()
    batch = items(3)
    for it in batch:
        create(rt.store, it["id"], prompt=it["kwargs"]["prompt"])
    rt.store.begin("m1", 0, "w-dead", 99, time.time(), 3)
    assert rt.store.requeue("m1", 99, 1)
    tally = serve_many(rt, batch)
    assert tally == {"requests": 3, "succeeded": 2, "failed": 0, "retried": 0, "dropped": 1}
    assert rt.ports.sent == [] and rt.engine.calls == 2
    assert rt.store.get("m1")["dispatch"] == "1"


def test_the_message_goes_back_whole_when_the_worker_takes_nothing_new(runtime):
    rt = runtime()
    batch = items(2)
    for it in batch:
        create(rt.store, it["id"], prompt=it["kwargs"]["prompt"])
    rt.host.refuse_new()
    with pytest.raises(GiveBack):
        serve_many(rt, batch)
    assert {rt.store.get(it["id"])["status"] for it in batch} == {"PENDING"}
    assert rt.engine.calls == 0


def test_a_delivery_given_back_leaves_the_givers_in_flight_set(runtime):
    """Given a worker that takes nothing new (stopping or quarantined) and deliveries its
    consumer took (each held in its in-flight set, as app/state/transport.py writes it), when
    it gives them back to their queue untouched (a message of one request, one of many), then
    it no longer holds them: nothing it does later (a hand-back, an orphan reclaim) nor the
    reaper takes them for its own. A request it still runs (a copy of a live run) stays held.
    Before, every given-back id stayed in the giver's set."""
    from workers.service import serve

    rt = runtime()
    batch = items(2)
    for rid in ("g1", "busy", *(it["id"] for it in batch)):
        create(rt.store, rid, prompt="back")
        rt.store.hold(rid, rt.instance_id)
    assert rt.store.begin("busy", 0, rt.name, rt.instance_id, time.time(), 3).action == "run"
    rt.host.refuse_new()
    for rid in ("g1", "busy"):
        with pytest.raises(GiveBack):
            serve(rt, rid, 0, {**KW, "prompt": "back"})
    with pytest.raises(GiveBack):
        serve_many(rt, batch)
    assert rt.store.inflight_ids(rt.instance_id) == ["busy"]


def test_a_message_of_many_holds_every_request_it_carries(runtime):
    from app.state.store import RequestStore
    from app.task_names import GENERATE, GENERATE_MANY

    holder = RequestStore.delivery_holder(7, GENERATE, GENERATE_MANY)
    assert holder({"task": GENERATE_MANY, "id": "msg", "vigil_ids": ["a", "b"]})[1] == ("a", "b")
    assert holder({"task": GENERATE, "id": "one"})[1] == "one"
    assert holder({"task": GENERATE_MANY, "id": "msg", "vigil_ids": "not a list"}) is None
