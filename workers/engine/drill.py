"""A fault-injection engine for tests and fire drills: the real vLLM engine, plus the faults no
real part produces on demand. Never a default; a worker running it logs a warning at every start.

    VIGIL_ENGINE=drill VIGIL_DRILL=poison=POISON-PILL vigil worker --cpu --name drill@%h
    VIGIL_ENGINE=drill VIGIL_DRILL=die_on_start       vigil worker --cpu --name broken@%h

VIGIL_DRILL is a comma-separated list of:
- `poison=<marker>`: a request whose prompt contains <marker> kills the engine (SIGKILL of its
  EngineCore process) once it is in the engine: a poison request. The death itself is real:
  every request in flight gets vLLM's EngineDeadError, exactly as with a real poison.
- `die_on_start`: every engine this worker starts has its EngineCore killed right after it
  starts, so its first generation (a request or the canary) finds it dead: a broken device.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.kinds import EngineOutput, VllmEngine, engine_core_pids
from workers.engine.memory import MemoryPlan

log = logging.getLogger("vigil.drill")


@dataclass(frozen=True)
class Drill:
    """The faults a drill engine injects."""

    poison: str = ""
    die_on_start: bool = False


def parse_drill(text: str) -> Drill:
    """Parse VIGIL_DRILL; an unknown item is an error (a drill that silently does nothing
    would prove nothing)."""
    poison, die = "", False
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item.startswith("poison="):
            poison = item.split("=", 1)[1]
            if not poison:
                raise ValueError("VIGIL_DRILL: poison= needs a marker")
        elif item == "die_on_start":
            die = True
        else:
            raise ValueError(f"VIGIL_DRILL: unknown fault {item!r} (poison=<marker>, die_on_start)")
    return Drill(poison, die)


class DrillEngine(VllmEngine):
    """VllmEngine with the faults of VIGIL_DRILL."""

    def __init__(self, spec: ModelSpec, plan: MemoryPlan | None = None):
        self.drill = parse_drill(os.environ.get("VIGIL_DRILL", ""))
        log.warning("DRILL ENGINE for %s: injecting %s", spec.name, self.drill)
        super().__init__(spec, plan)
        if self.drill.die_on_start:
            self.kill_core()
            deadline = time.monotonic() + 15
            while not self.dead and time.monotonic() < deadline:
                time.sleep(0.05)

    def kill_core(self) -> None:
        """SIGKILL this engine's EngineCore, as a crash in an engine step would end it."""
        log.warning("DRILL: killing EngineCore pid(s) %s", engine_core_pids())
        self.kill()

    async def run(self, req: GenerateRequest, request_id: str, adapter=None) -> EngineOutput:
        if self.drill.poison and req.prompt and self.drill.poison in req.prompt:
            task = asyncio.ensure_future(super().run(req, request_id, adapter))
            await asyncio.sleep(0.05)  # in the engine's batch, then the crash
            self.kill_core()
            return await task
        return await super().run(req, request_id, adapter)
