"""Unit tier: the engine host's rules with fake engines (no vLLM): load once, batch, drain before a
model switch, share a failed load, free an idle engine, abort on timeout, rebuild a dead engine."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.errors import RequestError, TransientError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from tests.unit_helpers import wait_until as _wait_until
from workers.engine.output import EngineOutput

A = ModelSpec(name="model-a")
B = ModelSpec(name="model-b")


def req(model="model-a"):
    return GenerateRequest(model=model, prompt="hi", max_tokens=4)


class FakeEngine:
    """Holds each request until `gate` opens; records how many were in flight at once."""

    def __init__(self, spec, log, gate: threading.Event, fail_with=None):
        self.spec, self.log, self.gate = spec, log, gate
        self.dead = False
        self.in_flight = 0
        self.peak = 0
        self.cancelled = 0
        self.fail_with = fail_with
        log.append(("build", spec.name))

    async def run(self, r, rid):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
            if self.fail_with is not None:
                from vllm.v1.engine.exceptions import EngineDeadError

                self.dead = isinstance(self.fail_with, EngineDeadError)
                raise self.fail_with
            return EngineOutput(self.spec.name, [1], "length", 1)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self.log.append(("shutdown", self.spec.name))


class Factory:
    def __init__(self, gate=None, fail=None):
        self.log: list = []
        self.gate = gate or threading.Event()
        self.fail = fail
        self.engines: list[FakeEngine] = []
        self.fail_runs_with = None
        self.on_build = None

    def __call__(self, spec, plan=None):
        if self.fail is not None:
            self.log.append(("build-failed", spec.name))
            raise self.fail
        e = FakeEngine(spec, self.log, self.gate, self.fail_runs_with)
        self.engines.append(e)
        if self.on_build is not None:
            self.on_build()
        return e

    def builds(self):
        return [x for x in self.log if x[0].startswith("build")]


def wait_until(cond):
    _wait_until(cond, 5.0)


def test_many_concurrent_requests_share_one_engine_load_and_are_in_flight_together(make_host):
    f = Factory()
    host = make_host(f)
    with ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 10) for i in range(32)]
        wait_until(lambda: f.engines and f.engines[0].in_flight == 32)
        f.gate.set()
        outs = [x.result() for x in futs]
    assert len(outs) == 32 and len(f.builds()) == 1 and host.stats.loads == 1
    assert host.stats.peak_in_flight == 32 and f.engines[0].peak == 32


def test_admitting_many_requests_is_not_an_engine_change(make_host):
    """A rise of the peak in flight is not news for the worker: each `changed` walks the
    engine's processes for the orphan guard and pokes the heartbeat, whose beat then reads every
    held request's record. Told once per admission, 4,096 short requests reaching a fresh worker
    paid that 4,096 times on the engine's loop (docs/performance.md, "Where a short request's
    time goes"). The heartbeat reads the peak at its interval."""
    f, changes = Factory(), []
    host = make_host(f, on_change=lambda: changes.append(host.stats.peak_in_flight))
    host.preload(A, timeout=10)
    loaded = len(changes)
    with ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 10) for i in range(32)]
        wait_until(lambda: f.engines[0].in_flight == 32)
        f.gate.set()
        [x.result() for x in futs]
    assert host.stats.peak_in_flight == 32 and host.snapshot()["peak_in_flight"] == 32
    assert len(changes) == loaded


def test_a_model_switch_waits_for_in_flight_requests_then_evicts(make_host):
    f = Factory()
    host = make_host(f)
    with ThreadPoolExecutor(8) as pool:
        a_futs = [pool.submit(host.generate, req(), A, f"a{i}", 10) for i in range(4)]
        wait_until(lambda: f.engines and f.engines[0].in_flight == 4)
        b_fut = pool.submit(host.generate, req("model-b"), B, "b", 10)
        wait_until(lambda: host.snapshot()["engine_state"] == "draining")
        assert f.log == [("build", "model-a")]  # B waits: A's requests are still running
        f.gate.set()
        assert all(x.result().text == "model-a" for x in a_futs)
        assert b_fut.result().text == "model-b"
    assert f.log == [("build", "model-a"), ("shutdown", "model-a"), ("build", "model-b")]
    assert host.stats.evictions == 1


def test_a_failed_load_fails_every_waiting_request_once_not_one_load_each(make_host):
    f = Factory(fail=RuntimeError("Engine core initialization failed"))
    host = make_host(f)
    with ThreadPoolExecutor(16) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 10) for i in range(16)]
        errors = []
        for x in futs:
            with pytest.raises(RequestError) as ei:
                x.result()
            errors.append(ei.value)
    # Requests that arrived while the load was failing share its error; only latecomers retry.
    # Without a memory measurement saying otherwise, a failed start is the model's fault.
    assert len(f.builds()) < 16
    assert all(e.code == "invalid_model_config" for e in errors)


def test_an_idle_engine_is_freed_after_idle_cleanup(make_host):
    now = [1000.0]
    f = Factory()
    f.gate.set()
    host = make_host(f, idle_cleanup=0.2, clock=lambda: now[0])
    host.generate(req(), A, "r", 5)
    assert host.snapshot()["engine_state"] == "ready"
    now[0] += 0.5
    wait_until(lambda: host.snapshot()["engine_state"] == "empty")
    assert ("shutdown", "model-a") in f.log and host.stats.evictions == 1
    host.generate(req(), A, "r2", 5)  # comes back on demand
    assert host.stats.loads == 2


def test_a_request_that_times_out_is_aborted_in_the_engine_and_reported_wedged(make_host):
    f = Factory()
    host = make_host(f)
    with pytest.raises(TransientError, match="^wedged: "):
        host.generate(req(), A, "slow", 0.3)
    wait_until(lambda: f.engines[0].cancelled == 1 and host.snapshot()["in_flight"] == 0)


def test_a_request_whose_engine_died_is_rerun_on_a_rebuilt_engine(make_host):
    from vllm.v1.engine.exceptions import EngineDeadError

    f = Factory()
    f.gate.set()
    f.fail_runs_with = EngineDeadError()
    host = make_host(f)
    first = []
    f.on_build = lambda: first.append(1) or setattr(f, "fail_runs_with", None)
    assert host.generate(req(), A, "r1", 5).text == "model-a"
    assert host.stats.loads == 2 and len(f.builds()) == 2
    assert host.stats.restarts == 1 and host.stats.evictions == 0 and host.stats.canaries == 1


def test_a_switch_whose_requester_gave_up_does_not_block_the_current_model(make_host):
    """Given model A busy, a request for B that gives up waiting for the switch (its wait for an
    engine is bounded: its timeout twice plus the engine start timeout) ends engine_restarting,
    not wedged (it never ran), and the switch it asked for is withdrawn: A's next request runs on
    A's engine."""
    f = Factory()
    host = make_host(f, engine_start_timeout=0.2)
    with ThreadPoolExecutor(8) as pool:
        a_fut = pool.submit(host.generate, req(), A, "a-long", 10)
        wait_until(lambda: f.engines and f.engines[0].in_flight == 1)
        with pytest.raises(TransientError, match="^engine_restarting: .*waited over 0.6 s"):
            host.generate(req("model-b"), B, "b-impatient", 0.2)
        f.gate.set()
        assert a_fut.result().text == "model-a"
        assert host.generate(req(), A, "a-next", 5).text == "model-a"
    assert f.builds() == [("build", "model-a")]


def test_request_errors_from_the_engine_are_not_retryable(make_host):
    from vllm.exceptions import VLLMValidationError

    f = Factory()
    f.gate.set()
    f.fail_runs_with = VLLMValidationError("Token id 9999 is out of vocabulary")
    host = make_host(f)
    with pytest.raises(RequestError, match="^token_out_of_vocab: "):
        host.generate(req(), A, "r1", 5)


def test_drain_aborts_in_flight_requests_and_refuses_new_ones(make_host):
    from workers.engine.host import HandedBack

    f = Factory()
    host = make_host(f)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 10) for i in range(3)]
        wait_until(lambda: f.engines and f.engines[0].in_flight == 3)
        assert host.drain() == 3
        for x in futs:
            with pytest.raises(HandedBack):
                x.result()
    wait_until(lambda: f.engines[0].cancelled == 3)
    with pytest.raises(HandedBack):
        host.generate(req(), A, "late", 5)


# -- waiting is not wedging ---------------------------------------------------------------------
class SlowStarts(Factory):
    """Every engine start takes `start_s` (a large model on a GPU, two workers starting at once);
    the engines answer at once."""

    def __init__(self, start_s: float):
        super().__init__()
        self.gate.set()
        self.start_s = start_s

    def __call__(self, spec, plan=None):
        import time

        time.sleep(self.start_s)  # synchronous on the loop, as vLLM's AsyncLLM build is
        return super().__call__(spec, plan)


def test_an_engine_start_slower_than_the_request_timeout_is_not_a_wedge(make_host):
    """Given engine starts that take 3x the request timeout, when requests arrive before the
    engine is up and then force a model switch, then every request is served and no failure
    reaches the health ledger: only time inside a running engine counts against a request."""
    f = SlowStarts(start_s=0.9)
    failures: list[str] = []
    host = make_host(f, on_failure=failures.append, engine_start_timeout=5)
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(host.generate, req(), A, f"a{i}", 0.3) for i in range(4)]
        assert [x.result(10).text for x in first] == ["model-a"] * 4
        assert host.generate(req("model-b"), B, "b-switch", 0.3).text == "model-b"
    assert failures == [] and f.builds() == [("build", "model-a"), ("build", "model-b")]


def test_a_canary_after_a_slow_restart_passes(make_host):
    """Given an engine start slower than the canary's timeout, when a quarantine restarts the
    engine, then the restart has its own bound (the engine start timeout) and the canary passes."""
    f = SlowStarts(start_s=0.6)
    host = make_host(f, engine_start_timeout=5)
    assert host.restart_with_canary(A, timeout=0.3) == (True, "")


def test_a_restart_slower_than_its_own_bound_fails_the_canary_naming_the_start(make_host):
    f = SlowStarts(start_s=1.5)
    host = make_host(f, engine_start_timeout=0.3)
    ok, why = host.restart_with_canary(A, timeout=0.2)
    assert not ok and "did not start and answer its canary within 0.3 s" in why


def test_a_request_stuck_in_a_running_engine_is_a_wedge_reported_to_the_ledger(make_host):
    """Given an engine that holds a request, when its timeout passes inside the engine, then the
    request is aborted there and ends wedged, and the failure reaches the health ledger."""
    f = Factory()
    failures: list[str] = []
    host = make_host(f, on_failure=failures.append)
    with pytest.raises(TransientError, match="^wedged: request stuck got no answer"):
        host.generate(req(), A, "stuck", 0.2)
    wait_until(lambda: f.engines[0].cancelled == 1)
    assert len(failures) == 1 and failures[0].startswith("timeout: request stuck")


# -- a worker that fails without dying -------------------------------------------------------------
class BlackHole(Factory):
    """A live engine that answers every request at once with an error (it never dies)."""

    def __init__(self):
        super().__init__()
        self.gate.set()
        self.fail_runs_with = RuntimeError("the engine refused it at once")


def test_fast_failures_of_a_live_engine_reach_the_health_ledger(make_host):
    """Given a live engine that fails every request at once with an engine error, then each
    failure is retried (engine_error) and reported like a wedge, so the worker's ledger can
    quarantine it; a completed request reports a success."""
    f = BlackHole()
    failures: list[str] = []
    host = make_host(f, on_failure=failures.append)
    for i in range(3):
        with pytest.raises(TransientError, match="^engine_error: "):
            host.generate(req(), A, f"void{i}", 5)
    assert len(failures) == 3 and all(x.startswith("fast failure: engine_error: ") for x in failures)
    assert f.builds() == [("build", "model-a")]  # alive all along: never rebuilt


def test_a_start_that_fails_for_a_model_another_worker_serves_is_this_workers_fault(make_host):
    """Given a model whose files this worker cannot load while another worker serves it, then
    the start failure is not the model's (no model_not_found for the request) but this
    worker's: engine_start_failed, and the worker leaves (on_fatal) with its requests handed
    back; without another worker serving it, it is the model's fault as before."""
    from app.errors import WorkerFatalError

    fatal: list = []
    gone = Factory(fail=FileNotFoundError("no such file: /models/tiny-llama"))
    host = make_host(gone, served_elsewhere=lambda model: True, on_fatal=fatal.append)
    with pytest.raises(WorkerFatalError, match="^engine_start_failed: .*another worker serves"):
        host.generate(req(), A, "r1", 5)
    assert len(fatal) == 1 and fatal[0].code == "engine_start_failed"
    alone = make_host(Factory(fail=FileNotFoundError("no such file: /models/tiny-llama")),
                      served_elsewhere=lambda model: False)
    with pytest.raises(RequestError, match="^model_not_found: "):
        alone.generate(req(), A, "r2", 5)


def test_a_real_engines_heap_is_frozen_while_it_is_up_and_thawed_for_its_shutdown(
        make_host, heap_restored):
    """A worker of a real engine freezes its heap once the engine is up (app/heap.py):
    Python's full collections then skip the ~700,000 objects that live as long as the engine,
    each of which stopped the engine's loop for ~0.3 s under short requests. The shutdown thaws
    it, so that the engine's leftovers can be collected."""
    import gc

    f = Factory()
    host = make_host(f, freeze_heap=True)
    host.preload(A, timeout=10)
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] >= 20_000
    host.shutdown(timeout=1)
    assert f.log[-1] == ("shutdown", "model-a") and gc.get_freeze_count() == 0
    plain = make_host(Factory())  # a host of fake engines leaves the heap alone
    plain.preload(A, timeout=10)
    assert gc.get_freeze_count() == 0
