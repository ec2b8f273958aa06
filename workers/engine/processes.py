"""The processes a worker's engine started: EngineCore and the rest of its descendants."""
from __future__ import annotations

import psutil


def engine_core_pids() -> list[int]:
    """PIDs of this process's vLLM EngineCore children (found by their process title)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline()) + " " + p.name()
        except psutil.Error:
            continue
        if "EngineCore" in title:
            out.append(p.pid)
    return out


def descendants() -> list[tuple[int, float]]:
    """(pid, create_time) of every live descendant of this process."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append((p.pid, p.create_time()))
        except psutil.Error:
            continue
    return out
