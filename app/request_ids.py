"""The three forms of a request's id, built and read in one place.

- the **request id**: the Celery task id, the same for every attempt and redelivery (a uuid4
  unless the caller chose one);
- the **attempt id**, `<request id>-<attempt>`: the engine request id of one attempt (the
  attempt counted by the record), so that an aborted attempt's id never collides with the next;
- the **run id**, `<attempt id>.r<run>` for a re-run inside one attempt after an engine death
  (run 1 is the attempt id itself).

A canary generation, which belongs to no request, has an id of its own (`canary_id`).
"""
from __future__ import annotations

from dataclasses import dataclass

RUN_SEP = ".r"
CANARY_PREFIX = "vigil-canary-"


@dataclass(frozen=True)
class EngineId:
    """An engine request id, read: its request, its attempt and its run (1 unless re-run)."""

    request_id: str
    attempt: int
    run: int = 1


def attempt_id(request_id: str, attempt: int) -> str:
    """The engine request id of `request_id`'s attempt `attempt`."""
    return f"{request_id}-{attempt}"


def run_id(attempt: str, run: int) -> str:
    """The engine request id of run `run` of an attempt (its attempt id for run 1)."""
    return attempt if run <= 1 else f"{attempt}{RUN_SEP}{run}"


def canary_id(n: int) -> str:
    """The engine request id of a worker's `n`-th canary generation."""
    return f"{CANARY_PREFIX}{n}"


def parse_engine_id(engine_id: str) -> EngineId:
    """Read an attempt or run id back; raises ValueError for anything else."""
    rid, sep, tail = engine_id.rpartition("-")
    if not sep or not rid:
        raise ValueError(f"not an engine request id: {engine_id!r}")
    attempt, _, run = tail.partition(RUN_SEP)
    return EngineId(rid, int(attempt), int(run or 1))


def request_id_of(engine_id: str) -> str:
    """The request id an attempt or run id belongs to (the id itself if it is neither)."""
    return engine_id.rsplit("-", 1)[0]
