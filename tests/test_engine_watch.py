"""Unit tier: the stall watchdog, pause/resume and the quarantine restart of the engine host, with
fake engines that hang like a SIGSTOPped EngineCore (no error, no progress)."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.errors import TransientError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from tests.conftest import wait_until
from workers.engine.host import HandedBack
from workers.engine.output import EngineOutput

A = ModelSpec(name="model-a")


class Hanging:
    """Holds requests until released; `progress` moves only while `stepping` is set."""

    def __init__(self, world):
        self.world = world
        self.dead = False
        self.progress = 0
        self.killed = False
        self.in_flight = 0

    async def run(self, r, rid):
        self.in_flight += 1
        try:
            while not self.world.release.is_set():
                if self.world.stepping.is_set():
                    self.progress += 1
                await asyncio.sleep(0.01)
            return EngineOutput("done", [1], "length", 1)
        finally:
            self.in_flight -= 1

    def kill(self):
        self.killed = True

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self.dead = True


class World:
    def __init__(self):
        self.release = threading.Event()
        self.stepping = threading.Event()
        self.engines: list[Hanging] = []

    def __call__(self, spec, plan=None):
        e = Hanging(self)
        self.engines.append(e)
        return e


def req():
    return GenerateRequest(model="model-a", prompt="hi", max_tokens=4)


def test_a_stalled_engine_is_caught_before_the_request_timeout_and_each_request_reported(
        make_host):
    """Given requests in an engine that makes no progress, then after stall_timeout the watchdog
    aborts them all: each caller gets TransientError(wedged) long before its own timeout, and each
    is reported as one failure."""
    failures = []
    w = World()
    host = make_host(w, stall_timeout=0.3, on_failure=failures.append)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 30) for i in range(4)]
        for f in futs:
            with pytest.raises(TransientError, match="^wedged: the engine made no progress"):
                f.result(timeout=10)
    assert len(failures) == 4 and all(f.startswith("stall: ") for f in failures)
    assert host.stalls == 1
    wait_until(lambda: w.engines[0].in_flight == 0)  # aborted in the engine too


def test_an_engine_that_keeps_stepping_is_not_stalled(make_host):
    """Given a long generation whose engine keeps producing steps, then no stall is declared
    however long it takes, and the completion is reported as a success."""
    failures, successes = [], []
    w = World()
    w.stepping.set()
    host = make_host(w, stall_timeout=0.2, on_failure=failures.append,
                     on_success=lambda: successes.append(1))
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(host.generate, req(), A, "long", 30)
        wait_until(lambda: w.engines and w.engines[0].progress > 100)  # > 1 s of steps
        w.release.set()
        assert fut.result().text == "done"
    assert failures == [] and successes == [1] and host.stalls == 0


def test_a_request_timeout_is_reported_as_a_failure(make_host):
    failures = []
    w = World()
    w.stepping.set()  # progressing, just slow: the request's own timeout catches it
    host = make_host(w, stall_timeout=5, on_failure=failures.append)
    with pytest.raises(TransientError, match="^wedged: "):
        host.generate(req(), A, "slow", 0.3)
    assert len(failures) == 1 and failures[0].startswith("timeout: request slow")


def test_pause_hands_requests_back_and_the_quarantine_restart_runs_a_canary(make_host):
    """Given a paused host, then in-flight requests are aborted with HandedBack and new ones are
    refused; the quarantine restart kills the old engine, starts a fresh one and passes a canary;
    after resume() the host serves again."""
    w = World()
    host = make_host(w)
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 30) for i in range(2)]
        wait_until(lambda: w.engines and w.engines[0].in_flight == 2)
        host.pause()
        assert not host.accepting and host.abort_in_flight() == 2
        for f in futs:
            with pytest.raises(HandedBack):
                f.result(timeout=5)
    with pytest.raises(HandedBack):
        host.generate(req(), A, "while-paused", 5)
    w.release.set()  # the fresh engine answers
    ok, why = host.restart_with_canary(A, timeout=10)
    assert ok and why == "" and w.engines[0].killed and len(w.engines) == 2
    assert host.stats.restarts == 1
    host.resume()
    assert host.generate(req(), A, "after", 5).text == "done"


def test_named_requests_are_aborted_wherever_they_are(make_host):
    """Given requests in the engine, when some are aborted by request id (their job was
    deleted), then exactly those callers get Aborted, the engine drops them, and the others
    finish."""
    from workers.engine.host import Aborted

    w = World()
    host = make_host(w)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(host.generate, req(), A, f"job-req-{i}-1", 30) for i in range(4)]
        wait_until(lambda: w.engines and w.engines[0].in_flight == 4)
        assert host.abort_requests({"job-req-0", "job-req-2", "not-here"}) == 2
        for i in (0, 2):
            with pytest.raises(Aborted):
                futs[i].result(timeout=5)
        wait_until(lambda: w.engines[0].in_flight == 2)
        w.release.set()
        assert [futs[i].result(timeout=5).text for i in (1, 3)] == ["done", "done"]
