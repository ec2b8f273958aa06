"""The GPU check's deadline (bench/gpu_check.py): its steps, their limits and the facts each
prints, and the running of them within the budget.

The check ends within --budget seconds (DEFAULT_BUDGET_S, 470: the issue's 8 minutes with room
for its first and last lines). Each step runs in a process group of its own under a limit
(STEP_LIMITS_S), cut to what is left of the budget: a step past its limit is stopped (SIGTERM, so
it stops what it started; SIGKILL STOP_GRACE_S later) and each fact it did not print is a FAIL
saying so; a step with no time left is a SKIP saying so.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from typing import Callable

from bench.gpu_facts import Fact

# The whole check's seconds: the 8 minutes, less room for the first and last lines.
DEFAULT_BUDGET_S = 470.0
# Each step's most seconds, in the order they run (their sum is the budget: a step that finishes
# early leaves its time to the later ones). The engine smoke's two starts of a tiny model
# dominate.
STEP_LIMITS_S = {"memory": 45.0, "sized_down": 60.0, "same_card": 30.0, "tp_context": 45.0,
                 "request_cpu": 60.0, "engine_smoke": 230.0}
# The facts each step prints (a step stopped early: a FAIL for each it did not print).
STEP_FACTS = {"memory": ("nvml_agrees", "context_cost"), "sized_down": ("sized_down_start",),
              "same_card": ("same_card",), "tp_context": ("tp_context_cost",),
              "request_cpu": ("request_cpu",), "engine_smoke": ("engine_smoke", "restart_s")}
STOP_GRACE_S = 10.0  # after SIGTERM, a stopped step's time to stop what it started
MIN_STEP_S = 5.0  # less left than this: the step is not started (SKIP)


def step_limit(limit_s: float, left_s: float) -> float | None:
    """The seconds a step may run: its own limit, cut to what is left of the budget once a
    stopped step's grace is kept aside; None when less than MIN_STEP_S would be left."""
    allowed = min(limit_s, left_s - STOP_GRACE_S)
    return allowed if allowed >= MIN_STEP_S else None


def ran_out(name: str, limit_s: float, budget_s: float) -> Fact:
    """The FAIL of a fact whose step was stopped at its limit."""
    return Fact(name, False, f"its step did not finish within {limit_s:.0f} s (its share of the "
                f"check's {budget_s:.0f} s budget) and was stopped")


def no_time(name: str, budget_s: float) -> Fact:
    """The SKIP of a fact whose step had no time left to start."""
    return Fact(name, None, f"not run: the check's {budget_s:.0f} s budget was spent by the "
                "steps before it")


def run_step(argv: list[str], facts: tuple[str, ...], limit_s: float, budget_s: float,
             env: dict | None = None) -> list[Fact]:
    """Run one step's process (`argv`, printing `wire()` lines) in a process group of its own
    for at most `limit_s` seconds: the facts it printed, a FAIL (`ran_out`) for each of `facts`
    it did not print when it was stopped, and a FAIL naming its exit and last stderr lines for
    each it did not print when it crashed. The step gets SIGTERM at its limit (so that it stops
    the processes it started) and its whole group SIGKILL STOP_GRACE_S later. Its output goes to
    files, not pipes: a process it started that outlives it cannot hold the check up."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True, env=env)
        stopped = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stopped = True
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
        out.seek(0)
        err.seek(0)
        printed, last_words = out.read(), err.read()
    got = [f for f in map(Fact.from_wire, printed.splitlines()) if f is not None]
    seen = {f.name for f in got}
    missing = [n for n in facts if n not in seen]
    if stopped:
        return got + [ran_out(n, limit_s, budget_s) for n in missing]
    why = " | ".join(last_words.strip().splitlines()[-3:]) or "nothing on stderr"
    return got + [Fact(n, False, f"its step ended (exit {proc.returncode}) without this fact: "
                       f"{why}") for n in missing]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


Step = tuple[str, tuple[str, ...], float, Callable[[float], list[str]]]
INNER_MARGIN_S = 2.0  # a step aims to end this long before it would be stopped


def run_steps(steps: list[Step], budget_s: float, clock: Callable[[], float] = time.monotonic,
              emit: Callable[[Fact], None] = lambda f: print(f.line(), flush=True),
              env: dict | None = None) -> list[Fact]:
    """Run `steps` ((name, its facts, its limit, its argv for a time limit), in order) within
    `budget_s` seconds of `clock`: each under `step_limit` (its argv told INNER_MARGIN_S less, so
    it ends by itself first), or SKIPped (`no_time`) once the budget is spent; each fact is
    passed to `emit` as it comes."""
    start = clock()
    facts: list[Fact] = []
    for _name, names, limit_s, argv in steps:
        allowed = step_limit(limit_s, budget_s - (clock() - start))
        new = ([no_time(n, budget_s) for n in names] if allowed is None
               else run_step(argv(max(allowed - INNER_MARGIN_S, allowed / 2)), names, allowed,
                             budget_s, env))
        for f in new:
            emit(f)
        facts += new
    return facts
