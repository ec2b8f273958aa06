"""Which priority lists a worker's consumer pops, and in which order: the tiers' intake.

kombu's Redis transport keeps each queue's messages in one list per priority step (0, 3, 6, 9;
step 0 is the queue itself) and its BRPOP names every list of every consumed queue, lower steps
first, the queues in turn within a step. Vigil publishes each request at its tier's step
(app/requests/tiers.py: interactive 0, default 3, bulk 9), so a worker takes from higher tiers
first and, within a tier, jobs keep sharing round-robin. For a worker that set its limits
(`limit_intake`), Vigil's channel (app/state/transport.py) changes two things:

- **reserved slots**: requests of the bulk tier (messages at steps from `capped_from_step`, 6,
  on) may be at most `lower_cap` of what this process holds at once, counted in requests, not
  messages: a `vigil.generate_many` message counts every request its `vigil_ids` header
  names (up to VIGIL_REQUESTS_PER_MESSAGE). Past the cap, BRPOP names the higher tiers' lists
  only, so the task threads left (worker concurrency - lower_cap) wait for interactive (and
  default) requests. A message is taken whole, so the last bulk message taken may carry the
  count past the cap by up to one message's requests, and its requests count until it is
  acked (its last request ended); the engine host keeps any request beyond its batch out of
  the engine (workers/engine/tier_gate.py, the batch gate);
- **the floor**: every `floor_every`-th BRPOP names the lists lowest tier first, so with a
  backlog in every tier the bulk work still gets at least 1/`floor_every` of the intake.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class IntakeLimits:
    """A worker's intake limits (module docstring): at most `lower_cap` held requests of
    messages at steps `capped_from_step` and above (the bulk tier), and one BRPOP in
    `floor_every` lowest tier first (0: never)."""

    lower_cap: int
    floor_every: int = 0
    capped_from_step: int = 6


_limits: IntakeLimits | None = None
_polls = itertools.count(1)
_lock = threading.Lock()


def limit_intake(limits: IntakeLimits | None) -> None:
    """From now on this process's channels pop by `limits` (None: kombu's own order)."""
    global _limits
    _limits = limits


def intake_limits() -> IntakeLimits | None:
    """The limits in force, if any."""
    return _limits


def requests_carried(message) -> int:
    """How many requests one delivered kombu message carries: each id of a
    `vigil.generate_many` message's `vigil_ids` header, else 1."""
    headers = getattr(message, "headers", None) or {}
    ids = headers.get("vigil_ids") if isinstance(headers, dict) else None
    return max(1, len(ids)) if isinstance(ids, list) else 1


def held_capped(delivered: dict, acked: set, limits: IntakeLimits) -> int:
    """Requests a channel holds (its messages delivered, not acked) in the capped tiers
    (priority step `limits.capped_from_step` and above): a message of many requests counts
    each one (`requests_carried`)."""
    n = 0
    for tag, message in list(delivered.items()):
        if tag in acked:
            continue
        props = getattr(message, "properties", None) or {}
        if (props.get("priority") or 0) >= limits.capped_from_step:
            n += requests_carried(message)
    return n


def brpop_keys(queues: Iterable[str], steps: list[int], list_of: Callable[[str, int], str],
               held_lower: int, limits: IntakeLimits | None) -> list[str]:
    """The lists one BRPOP names, in order: kombu's (every step of every queue, low steps
    first) without limits; with them, only the steps below the capped ones while `held_lower`
    is at the cap, and highest step first on every `floor_every`-th poll."""
    queues = list(queues)
    if limits is not None and held_lower >= limits.lower_cap:
        steps = [s for s in steps if s < limits.capped_from_step]
    elif limits is not None and limits.floor_every:
        with _lock:
            n = next(_polls)
        if n % limits.floor_every == 0:
            steps = list(reversed(steps))
    return [list_of(q, step) for step in steps for q in queues]
