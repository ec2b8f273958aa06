"""Why a request has no outcome yet: where it waits and what it waits for, in plain words.

A waiting request (record `PENDING` or `RUNNING`) is explained from one fleet snapshot
(app/fleet/snapshot.py), the worker in-flight sets and its queue: e.g. "pool tiny-llama: no live
worker serves it", "position ~12 of 40 in queue vigil.pool.tiny-llama", "running on worker
gpu0@h since 12:00:01 (attempt 2 of 3)". `vigil request ID` shows it (app/ops/request_view.py),
and so does `AsyncResult.info` of a request that is not finished (app/requests/async_result.py,
wired by app/celery_app.py).

Where a message sits in its queue is read from the right of the list, at most `SCAN_LIMIT`
entries (app/state/broker.py `position`): a request deeper than that is reported as "not among
the first 10000". The list moves while it is read, so the position is approximate. Read-only:
nothing here changes Redis.
"""
from __future__ import annotations

import datetime as dt
import time
from typing import Any

from app.errors import error_from_record
from app.fleet.snapshot import collect
from app.requests.models import ModelRegistry, get_registry
from app.settings import VigilSettings, get_settings
from app.state import keys
from app.state.health import QUARANTINED, RESTARTING
from app.state.queues import DEFAULT_JOB, job_queue_name
from app.state.store import RequestStore, open_store, shared_store

# The most queue entries a position lookup reads.
SCAN_LIMIT = 10_000


def when(t: float | None, now: float) -> str:
    """A unix time as local date and time with how long ago (or until): '-' for None."""
    if t is None:
        return "-"
    stamp = dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")
    ago = now - t
    return f"{stamp} ({ago:.0f} s ago)" if ago >= 0 else f"{stamp} (in {-ago:.0f} s)"


def num(rec: dict, name: str) -> float | None:
    """A record's field as a float; None when absent or empty."""
    v = rec.get(name)
    return float(v) if v not in (None, "") else None


def error_code(message: str) -> str:
    """The code a stored error message starts with ('' for no message)."""
    return error_from_record("", message).code if message else ""


def why_waiting(request_id: str, *, store: RequestStore | None = None,
                settings: VigilSettings | None = None, registry: ModelRegistry | None = None,
                now: float | None = None) -> dict[str, Any] | None:
    """Why a request has no outcome yet, as plain JSON-ready data; None when it has ended or has
    no record (never submitted, or expired after VIGIL_RESULT_TTL).

    {"request_id", "status" (PENDING | RUNNING, Vigil's record), "summary" (the reasons joined
    with "; "), "reasons" (list of str), "pool", "queue", "queue_length", "position" (1 = next
    delivered; None when not found within SCAN_LIMIT or running), "held_by" (worker names whose
    in-flight set holds it), "worker" and "running_since" (RUNNING only), "attempts",
    "max_attempts", "last_error", "deadline_at", "pool_workers" (healthy live workers serving
    the pool), "why_unserved"}. Defaults: this process's settings, registry and store.
    Costs a few Redis round trips per worker and pool plus a bounded queue scan: fine for a
    person or a poll every few seconds, not for a tight loop over thousands of requests.
    """
    if store is None:
        store = shared_store() if settings is None else open_store(settings)
    settings = settings or get_settings()
    registry = registry or get_registry()
    rec = store.get(request_id)
    if rec is None or rec.get("status") in keys.TERMINAL:
        return None
    return waiting_for(request_id, rec, store, settings, registry,
                    time.time() if now is None else now)


def waiting_for(request_id: str, rec: dict, store: RequestStore, settings: VigilSettings,
             registry: ModelRegistry, now: float) -> dict[str, Any]:
    """Why the open request `rec` waits (why_waiting's dict), from one fleet snapshot."""
    snap = collect(store, settings, registry, now)
    pool = rec.get("pool") or rec.get("model", "")
    queue = job_queue_name(pool, rec.get("job") or DEFAULT_JOB)
    status = rec.get("status", keys.PENDING)
    attempts = int(rec.get("attempts") or 0)
    max_attempts = settings.max_attempts
    last_error = rec.get("last_error", "")
    pool_state = next((p for p in snap["pools"] if p["pool"] == pool), None)
    by_instance = {w["instance_id"]: w for w in snap["workers"]}
    reasons: list[str] = []
    out: dict[str, Any] = {
        "request_id": request_id, "status": status, "pool": pool, "queue": queue,
        "queue_length": None, "position": None, "held_by": [], "worker": None,
        "running_since": None, "attempts": attempts, "max_attempts": max_attempts,
        "last_error": last_error, "deadline_at": num(rec, "deadline_at"),
        "pool_workers": pool_state["workers"] if pool_state else [],
        "why_unserved": pool_state["why_unserved"] if pool_state else "not registered here",
    }
    if status == keys.RUNNING:
        w = by_instance.get(rec.get("instance", ""))
        since = num(rec, "started_at")
        name = rec.get("worker") or (w["name"] if w else "?")
        line = (f"running on worker {name} since {when(since, now)} "
                f"(attempt {attempts} of {max_attempts})")
        if w is None:
            line += "; that worker is no longer registered (stopped or reaped)"
        elif not w["live"]:
            line += (f"; that worker is silent for {w['last_seen_s']:.0f} s: the reaper "
                     "requeues its requests")
        elif w["state"] in (QUARANTINED, RESTARTING):
            line += f"; that worker is {w['state']}: it hands its requests back"
        elif w["engine_state"] not in ("", "ready"):
            line += f"; its engine is {w['engine_state']}"
        reasons.append(line)
        out.update(worker=name, running_since=since)
    else:
        if pool_state is None:
            reasons.append(f"pool {pool}: not in this process's model registry "
                           "(VIGIL_MODELS_FILE differs?)")
        elif pool_state["why_unserved"]:
            reasons.append(f"pool {pool}: {pool_state['why_unserved']}")
        held = set(store.holders(request_id, list(by_instance)))
        holders = [w for w in snap["workers"] if w["instance_id"] in held]
        out["held_by"] = [w["name"] for w in holders]
        if last_error:
            reasons.append(f"waiting for attempt {attempts + 1} of {max_attempts}; the last one "
                           f"ended {error_code(last_error)}")
        for w in holders:
            if not w["live"]:
                reasons.append(f"its message is with worker {w['name']}, silent for "
                               f"{w['last_seen_s']:.0f} s: the reaper requeues it")
            elif w["state"] in (QUARANTINED, RESTARTING):
                reasons.append(f"its message is with worker {w['name']}, which is "
                               f"{w['state']}: it hands it back")
            else:
                reasons.append(f"its message is with worker {w['name']} (received, not begun: "
                               "a retry's countdown, or waiting for a free task thread)")
        position, length = store.broker.position(queue, request_id, limit=SCAN_LIMIT)
        out.update(queue_length=length, position=position)
        if position is not None:
            reasons.append(f"position ~{position} of {length} in queue {queue}")
        elif not holders:
            if length > SCAN_LIMIT:
                reasons.append(f"not among the first {SCAN_LIMIT} of {length} messages in "
                               f"queue {queue}")
            else:
                reasons.append(f"not in queue {queue} and held by no worker: in transit, or "
                               "with a consumer that stopped before recording it (back after "
                               "the visibility timeout, or ended at its deadline)")
    deadline = out["deadline_at"]
    if deadline is not None and now > deadline:
        reasons.append(f"past its deadline by {now - deadline:.0f} s: the deadline sweep fails "
                       "it (deadline_exceeded)")
    out["reasons"] = reasons
    out["summary"] = "; ".join(reasons)
    return out
