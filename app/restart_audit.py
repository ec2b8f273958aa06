"""After Redis restarts: find the open requests that lost their message, and publish them again.

With `appendfsync everysec`, a Redis that crashes (SIGKILL, power loss) comes back from its AOF
without its last second or so of writes (docs/reliability.md). A request's record and its message
are written one after the other, so after such a restart a record can be PENDING with no message
anywhere: nothing would run it, and only its deadline would end it. A clean restart loses nothing,
but a worker's retry published during the outage can still fail after VIGIL_REDIS_OUTAGE_GRACE.

Beat's deadline sweep calls `audit_after_restart` on every run. It is a no-op (one INFO and one GET)
unless Redis' run_id differs from the one recorded after the last audit, i.e. Redis restarted
since. Then, under a lock, every open request that is PENDING, held by no worker (in no in-flight
set: a worker that holds one hands it back itself, workers/runtime.py reclaim_orphans, and a dead
worker's are the reaper's), created before the restart (a later submit published its message
after it), and whose id is in no pool queue and not in kombu's unacked hash, is moved to its next
dispatch and published again. A copy of its old message that turns up later is an older
dispatch and is dropped unexecuted, so an audit that republishes needlessly costs one delivery,
never a second run.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable

from app import keys
from app.store import RequestStore

log = logging.getLogger("vigil.restart_audit")

RUN_ID_KEY = keys.PREFIX + "redis_run_id"
AUDIT_LOCK = "restart_audit"
# kombu's Redis transport: messages delivered and not yet acked (delivery tag -> [message, ...]).
UNACKED_KEY = "unacked"
QUEUE_PATTERN = "vigil.pool.*"
CHUNK = 1000
RESTART_REASON = "redis_unavailable: its message was lost in a Redis restart"

Republish = Callable[[str, dict, int], None]


def redis_start(store: RequestStore) -> tuple[str, float]:
    """The running Redis server's run_id (a new one at every start) and when it started (unix
    seconds, to the second)."""
    info = store._call(store.r.info, "server")
    return str(info["run_id"]), time.time() - float(info["uptime_in_seconds"])


def queued_ids(store: RequestStore) -> set[str]:
    """Request ids that have a message somewhere kombu keeps one: a pool or job queue (a list of
    JSON messages whose headers.id is the request id) or the unacked hash (fetched by a consumer,
    not yet acked: running, or a retry's delayed message)."""
    ids: set[str] = set()
    for q in store.r.scan_iter(match=QUEUE_PATTERN, count=CHUNK, _type="list"):
        start = 0
        while True:
            items = store._call(store.r.lrange, q, start, start + CHUNK - 1)
            ids.update(i for i in map(_message_id, items) if i)
            if len(items) < CHUNK:
                break
            start += CHUNK
    for _, raw in store.r.hscan_iter(UNACKED_KEY, count=CHUNK):
        try:
            ids.add(json.loads(raw)[0]["headers"]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    return ids


def _message_id(raw: bytes) -> str | None:
    try:
        return json.loads(raw)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None


def _held_ids(store: RequestStore) -> set[str]:
    held: set[str] = set()
    for key in store.r.scan_iter(match=keys.inflight("*"), count=CHUNK):
        held.update(m.decode() for m in store._call(store.r.smembers, key))
    return held


def audit_after_restart(store: RequestStore, now: float, republish: Republish, *,
                        lock_ttl_s: float = 120.0) -> int | None:
    """Republish the orphans a Redis restart left (module docstring). Returns how many were
    published again; None when Redis did not restart since the last audit, or another beat is
    auditing. The run_id is recorded only after a complete audit, so one that fails is redone."""
    run_id, started = redis_start(store)
    seen = store._call(store.r.get, RUN_ID_KEY)
    if seen is not None and seen.decode() == run_id:
        return None
    with store.locked(AUDIT_LOCK, lock_ttl_s) as held:
        if not held:
            return None
        timer = time.monotonic()
        published = 0
        # Open ids first, then what holds them: a request that moves from a queue to a worker in
        # between is seen held or queued, never neither.
        open_ids = [m.decode() for m in store._call(store.r.zrange, keys.DEADLINES, 0, -1)]
        holding = _held_ids(store)
        queued = queued_ids(store)
        for rid in open_ids:
            if rid in holding or rid in queued:
                continue
            rec = store.get(rid)
            # Only requests from before the restart: a later one's message was published
            # after it. (`started` is to the second: one submitted in the first second after the
            # restart may be published twice, which costs a delivery, never a second run.)
            if (not rec or rec.get("status") != keys.PENDING
                    or float(rec.get("created_at") or now) >= started):
                continue
            dispatch = int(rec.get("dispatch", 0)) + 1
            if not store.requeue(rid, "", dispatch, now=now, reason=RESTART_REASON):
                continue
            republish(rid, rec, dispatch)
            published += 1
        store._call(store.r.set, RUN_ID_KEY, run_id)
    if published or seen is not None:
        log.warning("Redis restarted (run_id %s): %d open request(s) had lost their message and "
                    "were published again (%.1f s)", run_id[:12], published,
                    time.monotonic() - timer)
    return published
