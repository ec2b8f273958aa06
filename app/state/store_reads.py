"""Reading a request's record: the record, its attempts, its stored outcome, the fleet's
counters and the open requests. A mixin of `RequestStore` (app/state/store.py), which holds
the client and the outage policy (`_call`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.state import keys


@dataclass(frozen=True)
class Outcome:
    """A terminal outcome as stored: status SUCCEEDED with `result`, or FAILED with an error."""
    status: str
    result: dict[str, Any] | None
    error_kind: str
    error: str

    @classmethod
    def from_reply(cls, status, result, error_kind, error) -> "Outcome":
        def s(x):
            return x.decode() if isinstance(x, bytes) else (x or "")

        res = s(result)
        return cls(s(status), json.loads(res) if res else None, s(error_kind), s(error))


class ReadCalls:
    """Reads of records (`get`, `history`, `pool_of`, `created_at`, `look`, `ended`,
    `any_recorded`), of the fleet's counters (`stats`) and of the open requests (`open_ids`).
    Needs RequestStore's `_r` and `_call`."""

    def get(self, request_id: str) -> dict[str, str] | None:
        """The record as a str->str dict, or None if there is none."""
        raw = self._call(self._r.hgetall, keys.request(request_id))
        if not raw:
            return None
        return {k.decode(): v.decode() for k, v in raw.items()}

    def history(self, request_id: str) -> list[dict[str, Any]]:
        """Every attempt of a request, oldest first (at most HISTORY_MAX, the newest kept), as
        recorded atomically by begin / release / requeue / finish: one dict per attempt begun,
        {"attempt": int, "dispatch": int, "worker": node name, "instance": instance id as a str,
        "started_at": float, "ended_at": float or None, "outcome": None while open, else
        "succeeded" | "failed" | "retry" | "requeued", "error": the error's code or None}.
        Times carry cjson's 14 significant digits (0.1 ms for current Unix times). [] when the
        request has no record or was never begun. An attempt that ended unobserved (its copy
        superseded by another worker's, or its result losing to an earlier one) stays open."""
        raw = self._call(self._r.hget, keys.request(request_id), "history")
        if not raw:
            return []
        parsed = json.loads(raw)
        return parsed if isinstance(parsed, list) else []  # cjson writes an empty list as {}

    def stats(self) -> dict[str, int]:
        """Fleet counters (duplicate_results, duplicate_deliveries, stale_deliveries)."""
        raw = self._call(self._r.hgetall, keys.STATS)
        return {k.decode(): int(v) for k, v in raw.items()}

    def pool_of(self, request_id: str) -> str:
        """A record's pool ('' when it has none)."""
        pool = self._call(self._r.hget, keys.request(request_id), "pool")
        return pool.decode() if pool else ""

    def ended(self, request_ids: list[str]) -> dict[str, Outcome | None]:
        """For each id whose request has ended, its stored Outcome; None for an id with no record
        at all (lost in a Redis crash, deleted, or expired). Ids still open are left out. One
        round trip."""
        pipe = self._call.pipeline()
        for rid in request_ids:
            pipe.hmget(keys.request(rid), "status", "result", "error_kind", "error")
        rows = self._call(pipe.execute) if request_ids else []
        out: dict[str, Outcome | None] = {}
        for rid, (status, result, kind, error) in zip(request_ids, rows):
            if status is None:
                out[rid] = None
            elif status.decode() in keys.TERMINAL:
                out[rid] = Outcome.from_reply(status, result, kind, error)
        return out

    def open_ids(self, pools: list[str] | None = None) -> list[str]:
        """Ids of every open (not yet ended) request, or of those in `pools`: from the deadline
        index, or the pools' pending sets (sorted)."""
        if pools is None:
            return [m.decode() for m in self._call(self._r.zrange, keys.DEADLINES, 0, -1)]
        return sorted({m.decode() for p in pools
                       for m in self._call(self._r.smembers, keys.pool_requests(p))})

    def any_recorded(self, request_ids: list[str]) -> bool:
        """True when any of `request_ids` has a record: one EXISTS of up to 1,000 keys each,
        in one round trip."""
        pipe = self._call.pipeline()
        for start in range(0, len(request_ids), 1000):
            pipe.exists(*[keys.request(rid) for rid in request_ids[start:start + 1000]])
        return any(self._call(pipe.execute)) if request_ids else False

    def created_at(self, request_id: str) -> float | None:
        """When the request was submitted (None without a record)."""
        created = self._call(self._r.hget, keys.request(request_id), "created_at")
        return float(created) if created else None

    def look(self, request_id: str) -> tuple[str | None, str, Outcome | None]:
        """(status, job, stored outcome) in one round trip: status None without a record, the
        outcome None until the request has ended."""
        status, result, kind, err, job = self._call(
            self._r.hmget, keys.request(request_id), "status", "result", "error_kind", "error",
            "job")
        if status is None:
            return None, "", None
        outcome = (Outcome.from_reply(status, result, kind, err)
                   if status.decode() in keys.TERMINAL else None)
        return status.decode(), job.decode() if job else "", outcome
