"""The health ledger: a per-worker failure streak proven by traffic, in Redis
(docs/architecture.md, "Wedge detection and quarantine").

A wedged worker heartbeats and answers every probe, and never finishes a generation, so only
traffic can condemn it. Workers report their own failures (a request that timed out, an engine
that made no progress) and successes (a completed generation); nothing else moves the ledger:
heartbeats and probes cannot reset a streak.

    HEALTHY --failure--> SUSPECT --failures >= threshold within the window--> QUARANTINED
    QUARANTINED --engine restart--> RESTARTING --canary ok--> HEALTHY
                                               --canary failed--> QUARANTINED (again; at
                                                 max_canary_failures the worker leaves)
    SUSPECT --completed generation--> HEALTHY (streak 0)

The streak counts the failures since the last completed generation that are younger than
`window` seconds: a failure stops counting once it is older than the window, so blips spread
over days never add up, while a trickle of one timeout per request timeout still reaches the
threshold (settings require window >= threshold x request_timeout). Every change is one Lua
script, so two reporters (task threads, the watchdog) cannot lose an update.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from app.state import keys
from app.state.calls import Calls, decoded
from app.state.lua_workers import HEALTH_CANARY, HEALTH_FAILURE, HEALTH_SUCCESS

HEALTHY = "HEALTHY"
SUSPECT = "SUSPECT"
QUARANTINED = "QUARANTINED"
RESTARTING = "RESTARTING"
STATES = (HEALTHY, SUSPECT, QUARANTINED, RESTARTING)
# A ledger outlives its worker's registry entry by this much (read by `vigil status` after a
# crash); the reaper and a clean stop delete it.
LEDGER_TTL_S = 7 * 86400


@dataclass(frozen=True)
class Health:
    """One worker's ledger as read."""

    state: str = HEALTHY
    streak: int = 0
    last_failure_reason: str = ""
    last_failure_at: float | None = None
    last_success_at: float | None = None
    quarantines: int = 0
    canary_failures: int = 0


class HealthLedger:
    """Read and change per-worker ledgers (`vigil:health:{instance}`). Every call goes through
    `calls`, the outage policy of the store it came from (`RequestStore.health_ledger`; without
    one, a policy that does not wait): methods raise TransientError(redis_unavailable) when
    Redis cannot be reached within it."""

    def __init__(self, client: redis.Redis, calls: Calls | None = None, *, window: float,
                 threshold: int):
        self.r = client
        self._call = calls or Calls(client)
        self.window = window
        self.threshold = threshold
        self._failure = client.register_script(HEALTH_FAILURE)
        self._success = client.register_script(HEALTH_SUCCESS)
        self._canary = client.register_script(HEALTH_CANARY)

    def failure(self, instance: int | str, now: float, reason: str) -> tuple[str, int, bool]:
        """Count one failure proven by traffic. Returns (state, streak, became_quarantined):
        the last is True for exactly one report, the one that crossed the threshold."""
        state, streak, became = self._call(
            self._failure, keys=[keys.health(instance)],
            args=[now, reason[:300], self.window, self.threshold, LEDGER_TTL_S])
        return _s(state), int(streak), bool(int(became))

    def success(self, instance: int | str, now: float) -> str:
        """A generation completed: a HEALTHY or SUSPECT worker's streak is over. Returns the
        state (a quarantined worker stays quarantined: only its canary brings it back)."""
        return _s(self._call(self._success, keys=[keys.health(instance)],
                             args=[now, LEDGER_TTL_S]))

    def restarting(self, instance: int | str, now: float) -> None:
        """The quarantined worker is restarting its engine."""
        pipe = self._call.pipeline(transaction=True)
        pipe.hset(keys.health(instance), mapping={"state": RESTARTING, "updated_at": now})
        pipe.expire(keys.health(instance), LEDGER_TTL_S)
        self._call(pipe.execute)

    def canary(self, instance: int | str, now: float, ok: bool, reason: str = "") -> tuple[str, int]:
        """Record a canary generation's outcome: HEALTHY on success; QUARANTINED and one more
        failed canary otherwise. Returns (state, failed canaries in a row)."""
        state, n = self._call(self._canary, keys=[keys.health(instance)],
                              args=[now, "1" if ok else "0", reason[:300], LEDGER_TTL_S])
        return _s(state), int(n)

    def read(self, instance: int | str) -> Health:
        """The ledger (a worker never reported on reads HEALTHY)."""
        f = decoded(self._call(self.r.hgetall, keys.health(instance)))

        def num(name):
            return float(f[name]) if f.get(name) else None

        return Health(f.get("state", HEALTHY), int(f.get("streak", 0) or 0),
                      f.get("last_failure_reason", ""), num("last_failure_at"),
                      num("last_success_at"), int(f.get("quarantines", 0) or 0),
                      int(f.get("canary_failures", 0) or 0))

    def forget(self, instance: int | str) -> None:
        """Drop a worker's ledger (clean stop, reaped)."""
        self._call(self.r.delete, keys.health(instance))


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def describe(h: Health) -> str:
    """One line for logs and `vigil status`."""
    out = f"{h.state} streak {h.streak}"
    if h.last_failure_reason:
        out += f"; last failure: {h.last_failure_reason}"
    return out


def as_json(h: Health) -> str:
    """The ledger as JSON (for `vigil status --json`)."""
    return json.dumps(h.__dict__)
