"""A fault-injection engine for tests and fire drills: the real vLLM engine, plus the faults no
real part produces on demand. Never a default; a worker running it logs a warning at every start.

    VIGIL_ENGINE=drill VIGIL_DRILL=poison=POISON-PILL vigil worker --cpu --name drill@%h
    VIGIL_ENGINE=drill VIGIL_DRILL=die_on_start       vigil worker --cpu --name broken@%h

The faults (app/drills.py) are real where it matters: a poison request's engine death is a
SIGKILL of its EngineCore, so every request in flight gets vLLM's EngineDeadError, exactly as
with a real poison.
"""
from __future__ import annotations

import asyncio
import logging
import time

from app.drills import SLOW_STEP_CONFIG_KEY, Drill
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.memory import MemoryPlan
from workers.engine.output import EngineOutput
from workers.engine.processes import engine_core_pids
from workers.engine.vllm import VllmEngine
from workers.engine.witness import Witness

log = logging.getLogger("vigil.drill")


def slow_step_args(step_s: float) -> dict:
    """The engine args that make every engine step `step_s` seconds slower, inside EngineCore:
    the logits processor of workers/engine/drill_steps.py, named for vLLM to load there, and
    its seconds in vLLM's `additional_config`."""
    return {"logits_processors": ["workers.engine.drill_steps:SlowSteps"],
            "additional_config": {SLOW_STEP_CONFIG_KEY: step_s}}


class DrillEngine(VllmEngine):
    """VllmEngine with the faults of `drill` (the worker's VIGIL_DRILL)."""

    def __init__(self, spec: ModelSpec, plan: MemoryPlan | None = None, *, drill: Drill,
                 witness: Witness | None = None, wave_window: float = 0.0):
        self.drill = drill
        log.warning("DRILL ENGINE for %s: injecting %s", spec.name, self.drill)
        if drill.slow_start_s:
            time.sleep(drill.slow_start_s)  # synchronous, on the loop, as the real build is
        extra = slow_step_args(drill.slow_step_s) if drill.slow_step_s else None
        super().__init__(spec, plan, witness=witness, extra_args=extra,
                         wave_window=wave_window)
        if self.drill.die_on_start:
            self.kill_core()
            deadline = time.monotonic() + 15
            while not self.dead and time.monotonic() < deadline:
                time.sleep(0.05)

    async def _entered(self, request_id: str, bound_s: float = 1.0) -> None:
        """Wait (at most `bound_s`) until the engine's front end holds `request_id`. The crash
        comes before the request's first step, as a real poison's: a fixed time instead let a
        resumed poison finish its last few tokens before the kill, run after run."""
        deadline = time.monotonic() + bound_s
        held = self._llm.output_processor.external_req_ids
        while request_id not in held and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    def kill_core(self) -> None:
        """SIGKILL this engine's EngineCore, as a crash in an engine step would end it."""
        log.warning("DRILL: killing EngineCore pid(s) %s", engine_core_pids())
        self.kill()

    async def run(self, req: GenerateRequest, request_id: str, adapter=None,
                  tap=None) -> EngineOutput:
        if self.drill.black_hole:
            raise RuntimeError("drill: black hole (every generation fails at once)")
        if self.drill.poison and req.prompt and self.drill.poison in req.prompt:
            task = asyncio.ensure_future(super().run(req, request_id, adapter, tap))
            await self._entered(request_id)  # in the engine's batch, then the crash
            self.kill_core()
            return await task
        return await super().run(req, request_id, adapter, tap)
