"""The fleet as Redis sees it, as plain JSON-ready data: workers (health state, streak, in
flight, memory), pools (waiting, oldest wait, running, who serves them, why not), jobs, and
when each housekeeping task last ran (app/fleet/housekeeping_runs.py).

`vigil status` renders it (app/ops/status.py); the explanation of a waiting request reads it
(app/fleet/waiting.py). Read-only: it reads the registry entries, health ledgers and queue
lengths; it never acts. Credentials never appear: Redis is shown as host:port/db only.
"""
from __future__ import annotations

import time

from app.fleet.housekeeping_runs import housekeeping_view
from app.housekeeping_schedule import schedule
from app.redis_url import redacted_url
from app.requests.models import ModelRegistry
from app.settings import VigilSettings
from app.state.health import HEALTHY, SUSPECT
from app.state.store import RequestStore


def collect(store: RequestStore, settings: VigilSettings, registry: ModelRegistry,
            now: float | None = None) -> dict:
    """A snapshot of workers and pools (plain data, JSON-ready), read through `store`."""
    now = time.time() if now is None else now
    ledger = store.health_ledger(window=settings.failure_window,
                                 threshold=settings.failure_threshold)
    workers = []
    for e in store.workers.entries():
        h = ledger.read(e.instance)
        workers.append({
            "name": e.name or "?", "instance_id": e.instance, "state": h.state,
            "streak": h.streak, "last_failure": h.last_failure_reason,
            "quarantines": h.quarantines, "live": e.live(now, settings.live_window),
            "last_seen_s": round(now - e.last_seen, 1), "pools": e.pools,
            "model": e.model, "engine_state": e.engine_state, "in_flight": e.in_flight,
            "engine_restarts": e.engine_restarts, "device": e.device,
            "free_bytes": e.free_bytes, "total_bytes": e.total_bytes,
        })
    pools = []
    for name in registry.names():
        serving = [w for w in workers if w["live"] and name in w["pools"]]
        healthy = [w for w in serving if w["state"] in (HEALTHY, SUSPECT)]
        queues = store.pool_queues(name)
        pending = sum(store.broker.depths(queues))
        oldest = oldest_waiting_age(store, queues, now)
        running = sum(w["in_flight"] for w in serving if w["model"] == name)
        why = store.jobs.unserved_reason(name)
        if not serving:
            why = why or "no live worker serves it"
        elif not healthy:
            why = why or "every worker serving it is quarantined or restarting"
        pools.append({"pool": name, "pending": pending, "running": running,
                      "oldest_waiting_s": oldest,
                      "workers": [w["name"] for w in healthy], "why_unserved": why})
    return {"redis": redacted_url(settings.redis_url), "at": now, "workers": workers,
            "pools": pools, "jobs": store.jobs.list(),
            "housekeeping": housekeeping_view(store.housekeeping.runs(), schedule(settings),
                                              now)}


def oldest_waiting_age(store: RequestStore, queues: list[str], now: float) -> float | None:
    """Seconds the oldest message waiting in `queues` has waited since its request was
    submitted (kombu pushes on the left and pops on the right: the oldest is at index -1);
    None when nothing waits."""
    ages = [now - c for c in map(store.created_at, store.broker.next_ids(queues))
            if c is not None]
    return round(max(ages), 1) if ages else None
