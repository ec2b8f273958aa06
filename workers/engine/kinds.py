"""The engines a worker can run (`VIGIL_ENGINE`): the real vLLM engine, the fault drill built on
it, and the instant engine for overhead benchmarks.
"""
from __future__ import annotations

import functools
from typing import Callable

from app.drills import Drill
from workers.engine.drill import DrillEngine
from workers.engine.instant import InstantEngine
from workers.engine.vllm import VllmEngine
from workers.engine.witness import Witness

ENGINES = {"vllm": VllmEngine, "instant": InstantEngine, "drill": DrillEngine}
# Engines that run a real model (and so are sized to free memory).
MODEL_ENGINES = ("vllm", "drill")


def engine_factory(kind: str, drill: Drill = Drill(),
                   witness: Witness | None = None) -> Callable:
    """The factory `(spec, plan) -> engine` of engine `kind` (a key of ENGINES); a drill engine
    gets the faults of `drill`; the model engines write their finished generations to
    `witness` when there is one."""
    if kind == "drill":
        return functools.partial(DrillEngine, drill=drill, witness=witness)
    if kind == "vllm":
        return functools.partial(VllmEngine, witness=witness)
    return ENGINES[kind]
