"""The engines a worker can run (`VIGIL_ENGINE`): the real vLLM engine, the fault drill built on
it, and the instant engine for overhead benchmarks.
"""
from __future__ import annotations

import functools
from typing import Callable

from app.core_log import CoreLog
from app.drills import Drill
from workers.engine.classify import log_recognised
from workers.engine.drill import DrillEngine
from workers.engine.instant import InstantEngine
from workers.engine.vllm import VllmEngine
from workers.engine.witness import Witness

ENGINES = {"vllm": VllmEngine, "instant": InstantEngine, "drill": DrillEngine}
# Engines that run a real model (and so are sized to free memory).
MODEL_ENGINES = ("vllm", "drill")


def engine_factory(kind: str, drill: Drill = Drill(), witness: Witness | None = None,
                   wave_window: float = 0.0) -> Callable:
    """The factory `(spec, plan) -> engine` of engine `kind` (a key of ENGINES); a drill engine
    gets the faults of `drill`; the model engines write their finished generations to
    `witness` when there is one, and take runs in waves `wave_window` seconds apart while
    others are in them (workers/engine/waves.py)."""
    if kind == "drill":
        return with_core_log(functools.partial(DrillEngine, drill=drill, witness=witness,
                                               wave_window=wave_window))
    if kind == "vllm":
        return with_core_log(functools.partial(VllmEngine, witness=witness,
                                               wave_window=wave_window))
    return ENGINES[kind]


class StartFailure(RuntimeError):
    """An engine start that failed, with what its EngineCore logged on the way down (the parent
    sees only "Engine core initialization failed"): read by classify_load_failure."""

    def __init__(self, cause: BaseException, logged: str):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.logged = logged


def with_core_log(build: Callable) -> Callable:
    """`build` (spec, plan) -> engine, reading the worker's engine error file (app/core_log.py):
    a start that fails raises StartFailure carrying what EngineCore logged after the start
    began; a started engine keeps `core_log` (the file, and where its own records begin) for
    `death_cause`."""
    def start(spec, plan=None):
        log = CoreLog.from_env()
        mark = log.mark() if log is not None else 0
        try:
            engine = build(spec, plan)
        except Exception as e:
            logged = log.failure_since(mark) if log is not None else ""
            if logged:
                raise StartFailure(e, logged) from e
            raise
        if log is not None:
            engine.core_log = (log, mark)
        log_recognised()  # once per process: which of vLLM's failure types this worker reads
        return engine

    return start
