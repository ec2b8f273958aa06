"""The faults a drill engine injects (`VIGIL_DRILL`), parsed once, where the settings check them.

A drill engine (`VIGIL_ENGINE=drill`, workers/engine/drill.py) is the real vLLM engine plus the
faults no real part produces on demand; tests and fire drills use it. `VIGIL_DRILL` is a
comma-separated list of:

- `poison=<marker>`: a request whose prompt contains <marker> kills the engine (SIGKILL of its
  EngineCore process) once it is in the engine: a poison request;
- `die_on_start`: every engine the worker starts has its EngineCore killed right after it starts,
  so its first generation (a request or the canary) finds it dead: a broken device;
- `slow_start=<seconds>`: every engine start takes that much longer (a large model on a network
  disk), whatever the machine;
- `slow_step=<seconds>`: every engine step takes that much longer, inside EngineCore (a large
  model's steps, whatever the model): a request stays in vLLM, scheduled and holding its KV
  cache, for as many slow steps as it makes tokens, and an abort reaches it there
  (workers/engine/drill_steps.py);
- `black_hole`: every generation (the canary's too) fails at once with an engine error, the
  engine staying alive: a worker that fails fast without dying.

An unknown item is an error at start (a drill that silently does nothing would prove nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

FAULTS = "poison=<marker>, die_on_start, slow_start=<seconds>, slow_step=<seconds>, black_hole"


# The key of vLLM's `additional_config` that carries `slow_step`'s seconds to EngineCore.
SLOW_STEP_CONFIG_KEY = "vigil_drill_step_s"


@dataclass(frozen=True)
class Drill:
    """The faults a drill engine injects."""

    poison: str = ""
    die_on_start: bool = False
    slow_start_s: float = 0.0
    slow_step_s: float = 0.0
    black_hole: bool = False


def parse_drill(text: str) -> Drill:
    """Parse a `VIGIL_DRILL` value; ValueError naming the bad item otherwise."""
    poison, die, hole, seconds = "", False, False, {"slow_start": 0.0, "slow_step": 0.0}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, value = item.partition("=")
        if name == "poison":
            poison = value
            if not poison:
                raise ValueError("poison= needs a marker")
        elif item == "die_on_start":
            die = True
        elif item == "black_hole":
            hole = True
        elif name in seconds:
            try:
                seconds[name] = float(value)
            except ValueError:
                raise ValueError(f"{name}= needs a number of seconds") from None
            if not 0 <= seconds[name] <= 3600:
                raise ValueError(f"{name}= must be 0 to 3600 seconds")
        else:
            raise ValueError(f"unknown fault {item!r} (known: {FAULTS})")
    return Drill(poison, die, seconds["slow_start"], seconds["slow_step"], hole)
