"""Redis tier: the drain of a stopping worker (workers/held.py `hand_back(drain=True)`,
app/fleet/handback.py), on a real Redis (database 1) with a scripted streaming engine: the
engine is frozen and read before the streams are written and the requests handed back, so
every token it made is in the request's stream and none is counted discarded; a drained
request gets its attempt back, VIGIL_MAX_DRAINS times at most. The real engine's freeze (vLLM's
pause) is tests/test_tiers_e2e.py's drain test."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app import metrics
from app.fleet.handback import hand_back_one
from app.state.conn import connect
from app.state.store import RequestStore
from tests.unit_helpers import RecordingPorts, wait_until
from tests.test_store_and_service import create
from workers.engine.host import EngineHost
from workers.delivery_answers import StaleDelivery
from workers.service import serve

pytestmark = pytest.mark.redis


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def test_a_drained_request_gets_its_attempt_back_max_drains_times_then_uses_it(store):
    """Given a request running on a stopping worker, when the worker hands it back as a drain,
    then it is PENDING for its next dispatch with its attempt refunded and one drain counted
    (history: requeued, `drained`); at VIGIL_MAX_DRAINS drains a further drain is `worker_lost`
    and keeps the attempt; a held request not begun (PENDING) gets nothing back; a reaper's
    hand-back (no drain) keeps the attempt as before."""
    sent = []

    def republish(rid, rec, dispatch):
        sent.append((rid, dispatch))

    def run_and_drain(rid, dispatch, max_drains):
        store.begin(rid, dispatch, "w", 7, time.time(), 3)
        return hand_back_one(store, time.time(), rid, 7, republish, None, 3, max_drains)

    create(store, "d1")
    for dispatch in range(2):
        assert run_and_drain("d1", dispatch, 2) == "requeued"
    rec = store.get("d1")
    assert (rec["status"], rec["dispatch"], rec["attempts"], rec["drains"]) == (
        "PENDING", "2", "0", "2")
    assert [(h["outcome"], h["error"]) for h in store.history("d1")] == [
        ("requeued", "drained")] * 2
    assert run_and_drain("d1", 2, 2) == "requeued"  # its third drain: past VIGIL_MAX_DRAINS 2
    rec = store.get("d1")
    assert (rec["attempts"], rec["drains"]) == ("1", "2")
    assert store.history("d1")[-1]["error"] == "worker_lost"
    assert sent == [("d1", 1), ("d1", 2), ("d1", 3)]

    create(store, "held-not-begun")
    store.hold("held-not-begun", 7)
    assert hand_back_one(store, time.time(), "held-not-begun", 7, republish, None, 3, 2) == \
        "requeued"
    assert "drains" not in store.get("held-not-begun")

    create(store, "reaped")
    store.begin("reaped", 0, "w", 7, time.time(), 3)
    assert hand_back_one(store, time.time(), "reaped", 7, republish, None, 3) == "requeued"
    assert store.get("reaped")["attempts"] == "1"


class Streaming:
    """An engine that streams: each run adds a token to its tap every 5 ms until it is
    frozen; `freeze` stops it and then hands over the tokens made since the last read (as vLLM's
    request state holds them until the stream watch reads them)."""

    streams = True
    dead = False

    def __init__(self):
        self.frozen = False
        self.taps = []

    def __call__(self, spec, plan=None):
        return self

    async def run(self, req, rid, tap=None):
        self.taps.append(tap)
        tap.set_prompt([1, 2])
        i = 0
        while not self.frozen:
            tap.add([100 + i], f"t{i} ")
            i += 1
            await asyncio.sleep(0.005)
        await asyncio.sleep(3600)  # frozen: waits for its abort

    async def freeze(self, timeout):
        self.frozen = True
        for tap in self.taps:
            n = len(tap.token_ids)
            tap.add([100 + n, 101 + n, 102 + n], "made since the last read ")
        return len(self.taps)

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        pass


def test_a_drain_freezes_the_engine_and_writes_every_token_before_handing_back(settings):
    """Given a worker whose engine is making tokens for a running request (streamed every 5
    ms, its flush interval a second), when the worker stops (hand_back with drain), then the
    engine is frozen and read first, so its stream holds every token the run made, those read
    at the freeze included; the request is PENDING for its next dispatch, its attempt given
    back, published once; its delivery ends stale; no token is counted discarded."""
    from workers.runtime import WorkerRuntime
    from workers.stream_sink import StreamSink

    ports = RecordingPorts()
    rt = WorkerRuntime(settings.model_copy(update={"stream_flush_ms": 1000}), "w-drain",
                       engine="instant", guard=False, ports=ports)
    eng = Streaming()
    rt.host = rt.held.host = EngineHost(eng, idle_cleanup=0).start()
    rt.streams = rt.held.streams = StreamSink(rt.store.streams(), 1000, 1 << 20).start()
    pool = ThreadPoolExecutor(1)
    try:
        create(rt.store, "long", max_tokens=500)
        kw = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 500}
        _, discarded_before = metrics.token_totals()
        fut = pool.submit(serve, rt, "long", 0, kw)
        wait_until(lambda: eng.taps and len(eng.taps[0].token_ids) >= 20)
        rt.held.hand_back(drain=True)
        with pytest.raises(StaleDelivery):
            fut.result(10)
        made = eng.taps[0].token_ids
        assert made[-3:] == [100 + len(made) - 3, 101 + len(made) - 3, 102 + len(made) - 3]
        assert rt.store.streams().checkpoint("long").token_ids == made
        rec = rt.store.get("long")
        assert (rec["status"], rec["dispatch"], rec["attempts"], rec["drains"]) == (
            "PENDING", "1", "0", "1")
        assert ports.sent == [("long", 1)]
        assert rt.held.frozen == 1 and rt.held.unwritten == 0
        assert metrics.token_totals()[1] == discarded_before
    finally:
        pool.shutdown()
        rt.host.shutdown(1)
        rt.streams.stop()
