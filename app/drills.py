"""The faults a drill engine injects (`VIGIL_DRILL`), parsed once, where the settings check them.

A drill engine (`VIGIL_ENGINE=drill`, workers/engine/drill.py) is the real vLLM engine plus the
faults no real part produces on demand; tests and fire drills use it. `VIGIL_DRILL` is a
comma-separated list of:

- `poison=<marker>`: a request whose prompt contains <marker> kills the engine (SIGKILL of its
  EngineCore process) once it is in the engine: a poison request;
- `die_on_start`: every engine the worker starts has its EngineCore killed right after it starts,
  so its first generation (a request or the canary) finds it dead: a broken device.

An unknown item is an error at start (a drill that silently does nothing would prove nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

FAULTS = "poison=<marker>, die_on_start"


@dataclass(frozen=True)
class Drill:
    """The faults a drill engine injects."""

    poison: str = ""
    die_on_start: bool = False


def parse_drill(text: str) -> Drill:
    """Parse a `VIGIL_DRILL` value; ValueError naming the bad item otherwise."""
    poison, die = "", False
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item.startswith("poison="):
            poison = item.split("=", 1)[1]
            if not poison:
                raise ValueError("poison= needs a marker")
        elif item == "die_on_start":
            die = True
        else:
            raise ValueError(f"unknown fault {item!r} (known: {FAULTS})")
    return Drill(poison, die)
