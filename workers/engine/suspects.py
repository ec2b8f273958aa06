"""Engine death without innocent casualties: suspects, re-isolation, the death streak.

When an engine dies, every request in flight fails with the same EngineDeadError. That does not
prove any of them guilty: most deaths come from outside (the OOM killer, a killed process, a
driver reset). The engine host (workers/engine/host.py) keeps those requests as *suspects* and
re-runs them on a fresh engine, in this order (docs/failure-modes.md, "Engine death"):

1. The whole suspect set, together, once: one restart is all an external death costs.
2. If the engine dies again, the requests still running are split into ceil(sqrt(n)) groups
   (groups of <= SINGLES_BELOW run as singles) and the groups run one after another, alone in the
   engine. A group that finishes clears its members; a group that dies is split again.
3. A request that dies alone twice (POISON_STRIKES), each time on an engine that had just passed
   a canary generation, is failed as `poison_request`. The second strike keeps an unlucky
   innocent, alone in the engine when something else killed it, from being convicted.

Every fresh engine must pass a canary (a one-token generation) before suspects run on it: an
engine that cannot even do that is broken, not poisoned. Deaths with the same signature and no
success between them form the *death streak*; at `DeathStreak.limit` (3) the worker is broken
(`repeated_engine_death`) and leaves.
"""
from __future__ import annotations

import math
import re

from app.errors import ENGINE_RESTARTING, POISON_REQUEST, RequestError, TransientError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from workers.engine.ticket import Ticket

SINGLES_BELOW = 8  # a group this small is split into single requests at once
POISON_STRIKES = 2  # deaths alone before a request is convicted
MAX_RUNS = 8  # runs of one request in one worker before it goes back to the queue instead
CANARY_TIMEOUT_S = 120.0


def split_suspects(group: list[Ticket]) -> list[list[Ticket]]:
    """Split a group that died: singles below SINGLES_BELOW, else ceil(sqrt(n)) near-equal
    groups in their original order. With one poison among n, that is about two more deaths
    to find it whatever n is, and most innocents run batched."""
    n = len(group)
    if n <= SINGLES_BELOW:
        return [[t] for t in group]
    k = math.ceil(math.sqrt(n))
    size = math.ceil(n / k)
    return [group[i:i + size] for i in range(0, n, size)]


def judge(group: list[Ticket], plan: list[list[Ticket]]) -> Ticket | None:
    """After `group` ran alone in a fresh engine: members that finished are cleared; if the
    engine died, the members it took down go back to the front of `plan` split again, and a
    member dying alone is struck. A member struck POISON_STRIKES times gets its verdict,
    `poison_request`, and is returned (None when nobody was convicted)."""
    died = [t for t in group if t.last == "died" and not t.gone]
    if not died:
        return None
    if len(group) == 1:
        t = died[0]
        t.solo_deaths += 1
        if t.solo_deaths >= POISON_STRIKES:
            t.verdict = RequestError.of(POISON_REQUEST, (
                f"this request killed the engine each time it ran alone ({t.solo_deaths} times, "
                f"after a passing canary); other requests were unaffected"))
            return t
        plan.insert(0, [t])
        return None
    plan[:0] = split_suspects(died)
    return None


def runnable(t: Ticket) -> bool:
    """True when a suspect may run again: not gone, no verdict, and under MAX_RUNS runs in this
    worker (past it, its verdict is engine_restarting: the queue, attempt + 1, takes over)."""
    if t.gone or t.verdict is not None:
        return False
    if t.runs >= MAX_RUNS:
        t.verdict = TransientError.of(ENGINE_RESTARTING, (
            f"re-run {t.runs} times while the engine kept dying; retrying elsewhere"))
        return False
    return True


_DIGITS = re.compile(r"\d+")


def death_signature(exc: BaseException) -> str:
    """What makes two deaths "the same": the exception type and its message, numbers removed
    (pids, request ids and counts differ between deaths of one cause)."""
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}:{_DIGITS.sub('#', text)}"


class DeathStreak:
    """Engine deaths in a row with one signature and no success between them."""

    def __init__(self, limit: int = 3):
        self.limit = limit
        self.count = 0
        self.signature = ""

    def death(self, signature: str) -> int:
        """Count a death; returns the streak length (a new signature restarts it at 1)."""
        self.count = self.count + 1 if signature == self.signature else 1
        self.signature = signature
        return self.count

    def success(self) -> None:
        """A generation completed (a request or a canary): the engine works."""
        self.count = 0
        self.signature = ""

    @property
    def broken(self) -> bool:
        """True once the streak reached the limit: this worker cannot keep an engine alive."""
        return self.count >= self.limit


def canary_request(spec: ModelSpec) -> GenerateRequest:
    """The smallest real generation: a few token ids in, one token out, greedy."""
    return GenerateRequest(model=spec.name, prompt_token_ids=[1, 2, 3], max_tokens=1,
                           temperature=0.0)
