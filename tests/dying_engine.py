"""Fake engines that die like vLLM's (every request in flight gets EngineDeadError, the engine is
dead for good), the world they share, and a way to run many prompts through an engine host at
once: the parts of tests/test_engine_recovery.py (and of a test in tests/test_preemption.py)."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from vllm.v1.engine.exceptions import EngineDeadError

from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from tests.unit_helpers import outcomes
from workers.engine.output import EngineOutput

A = ModelSpec(name="model-a")
POISON = "POISON"


class World:
    """Shared state of the fake engines one host builds: the batch gate, the poison marker,
    scripted deaths."""

    def __init__(self, poison: str = "", die_on_start: bool = False):
        self.gate = threading.Event()
        self.poison = poison
        self.die_on_start = die_on_start
        self.engines: list[DyingEngine] = []
        self.kill_on_run: dict[str, int] = {}  # engine request id -> die when it runs
        self.runs: list[str] = []

    def __call__(self, spec, plan=None):
        e = DyingEngine(self)
        self.engines.append(e)
        return e

    def current(self) -> "DyingEngine":
        return self.engines[-1]


class DyingEngine:
    """An engine whose every run waits for the world's gate, batches for one step, and dies
    (failing every run in flight) on a poison prompt or a scripted kill."""

    def __init__(self, world: World):
        self.world = world
        self.dead = world.die_on_start
        self.in_flight: set[str] = set()
        self.peak = 0
        self.died = False  # killed under a run (by the poison or a scripted kill)

    def die(self):
        self.dead = self.died = True

    async def run(self, r: GenerateRequest, rid: str):
        w = self.world
        w.runs.append(rid)
        if self.dead:
            raise EngineDeadError()
        self.in_flight.add(rid)
        self.peak = max(self.peak, len(self.in_flight))
        try:
            while not w.gate.is_set() and not self.dead:
                await asyncio.sleep(0.002)
            if r.prompt and w.poison and w.poison in r.prompt:
                self.die()  # crashes the step it is scheduled in: nobody in it finishes
            await asyncio.sleep(0.01)  # one engine step: the requests that arrive together batch
            if rid in w.kill_on_run:
                del w.kill_on_run[rid]
                self.die()
            if self.dead:
                raise EngineDeadError()
            return EngineOutput(r.prompt or "canary", [1], "length", 1)
        finally:
            self.in_flight.discard(rid)

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self.dead = True


def req(prompt: str) -> GenerateRequest:
    """A request of model-a for `prompt`, 4 tokens."""
    return GenerateRequest(model="model-a", prompt=prompt, max_tokens=4)


def run_all(host, prompts, timeout=30):
    """Submit every prompt from its own thread; return (outputs or exceptions) in order."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(host.generate, req(p), A, f"r{i}", timeout)
                for i, p in enumerate(prompts)]
        return outcomes(futs)
