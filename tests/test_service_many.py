"""Redis tier: serving one message that carries many requests (workers/service_many.py) with a
scripted engine, on a real Redis (database 1): one claim round trip, the requests run together,
one finish round trip; each request its own end; a request that needs a retry goes back alone
as its next dispatch; a bad one fails alone; the message goes back whole when the worker takes
nothing new."""
from __future__ import annotations

import time

import pytest

from app.errors import TransientError
from tests.conftest import RecordingPorts
from tests.test_store_and_service import KW, Scripted, create
from workers.engine.host import EngineHost
from workers.engine.output import EngineOutput
from workers.runtime import WorkerRuntime
from workers.service import GiveBack
from workers.service_many import serve_many

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


@pytest.fixture()
def runtime(settings):
    made = []

    def _make(answers=None):
        rt = WorkerRuntime(settings, "w-many", engine="instant", guard=False,
                           ports=RecordingPorts())
        rt.engine = Counting(answers or {})
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


def test_a_message_of_many_holds_every_request_it_carries(runtime):
    from app.state.store import RequestStore
    from app.task_names import GENERATE, GENERATE_MANY

    holder = RequestStore.delivery_holder(7, GENERATE, GENERATE_MANY)
    assert holder({"task": GENERATE_MANY, "id": "msg", "vigil_ids": ["a", "b"]})[1] == ("a", "b")
    assert holder({"task": GENERATE, "id": "one"})[1] == "one"
    assert holder({"task": GENERATE_MANY, "id": "msg", "vigil_ids": "not a list"}) is None
