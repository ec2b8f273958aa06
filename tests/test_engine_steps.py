"""Unit tier: the engine's own count of its steps and how full they ran
(workers/engine/step_counter.py, `StepCounter`), and the engine host's sum of it over every engine it ran (a fake AsyncLLM and
fake engines: no vLLM). The real engine's count is checked against the tokens it made in
tests/test_metrics_e2e.py."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from tests.test_engine_host import A, B, Factory, req
from workers.engine.step_counter import StepCounter


class FakeCore:
    """An EngineCore client whose batches of outputs are given in advance."""

    def __init__(self, batches):
        self.batches = list(batches)

    async def get_output_async(self):
        return SimpleNamespace(outputs=self.batches.pop(0))


def test_the_step_counter_counts_each_batch_and_the_outputs_in_it():
    """Given an AsyncLLM whose EngineCore sends batches of 3, 0 and 2 request outputs, when its
    output handler fetches them through the counter, then it gets each batch unchanged and the
    counter reads 3 steps and 5 outputs."""
    core = FakeCore([["a", "b", "c"], [], ["a", "c"]])
    counter = StepCounter(SimpleNamespace(engine_core=core))

    async def handler():
        return [await core.get_output_async() for _ in range(3)]

    got = asyncio.run(handler())
    assert [b.outputs for b in got] == [["a", "b", "c"], [], ["a", "c"]]
    assert (counter.steps, counter.outputs) == (3, 5)


def test_the_host_sums_steps_over_every_engine_it_ran(make_host):
    """Given a host whose engine counted 2 steps of 4 outputs, when a model switch replaces it
    with one that counts 1 more, then the snapshot reads 3 steps and 12 outputs: a counter that
    an engine change does not reset."""
    f = Factory(gate=threading.Event())
    f.gate.set()

    def counting():
        eng = f.engines[-1]
        eng.steps = SimpleNamespace(steps=0, outputs=0)
        run = eng.run

        async def run_and_count(r, rid):
            out = await run(r, rid)
            eng.steps.steps += 1
            eng.steps.outputs += 4
            return out

        eng.run = run_and_count

    f.on_build = counting
    host = make_host(f)
    assert (host.snapshot()["engine_steps"], host.snapshot()["engine_step_outputs"]) == (0, 0)
    for i in range(2):
        host.generate(req(), A, f"a{i}", 10)
    snap = host.snapshot()
    assert (snap["engine_steps"], snap["engine_step_outputs"]) == (2, 8)
    host.generate(req("model-b"), B, "b", 10)
    assert f.log == [("build", "model-a"), ("shutdown", "model-a"), ("build", "model-b")]
    snap = host.snapshot()
    assert (snap["engine_steps"], snap["engine_step_outputs"]) == (3, 12)


def test_an_engine_that_does_not_count_reads_zero(make_host):
    """Given a host whose engine has no step counter (the instant engine), then after a request
    the snapshot reads 0 steps and 0 outputs."""
    f = Factory(gate=threading.Event())
    f.gate.set()
    host = make_host(f)
    host.generate(req(), A, "a", 10)
    snap = host.snapshot()
    assert (snap["engine_steps"], snap["engine_step_outputs"]) == (0, 0)
