"""The fleet's load per pool and tier, for autoscalers: what waits, what runs, how long the
oldest has waited, and who serves it, read from Redis in one place (`vigil metrics`,
app/ops/metrics_exporter.py) rather than from each worker.

An autoscaler (KEDA, an HPA on Prometheus) scales a pool's GPU workers on
`vigil_pool_waiting + vigil_pool_running` over the requests one worker can take, and scales in
by SIGTERM, which hands a worker's requests back with their tokens (docs/operations.md,
"Autoscaling").
"""
from __future__ import annotations

from app.requests.models import ModelRegistry
from app.requests.tiers import TIER_OF_LIST, TIERS
from app.settings import VigilSettings
from app.state.health import HEALTHY, SUSPECT
from app.state.store import RequestStore


def pool_gauges(store: RequestStore, registry: ModelRegistry, settings: VigilSettings,
                now: float) -> list[dict]:
    """One row per pool and tier: {"pool", "tier", "waiting" (requests in the pool's queues
    at that tier: a message of many requests counts each one, estimated past the first 32
    messages of a list), "running" (requests RUNNING on live workers), "oldest_wait_s" (how long the
    oldest waiting request of that tier has waited since it was submitted; None when none
    waits), "workers" (live healthy workers serving the pool, the same on every tier's row)}."""
    entries = store.workers.entries()
    live = [e for e in entries if e.live(now, settings.live_window)]
    running = store.fleet.running([e.instance for e in live])
    rows = []
    for pool in registry.names():
        waiting = dict.fromkeys(TIERS, 0)
        oldest: dict[str, float | None] = dict.fromkeys(TIERS, None)
        for queue in store.pool_queues(pool):
            lengths = store.fleet.list_requests(queue)
            heads = store.fleet.next_per_list(queue)
            for tier, n, head in zip(TIER_OF_LIST, lengths, heads):
                waiting[tier] += n
                created = store.created_at(head) if head else None
                if created is not None:
                    age = max(0.0, now - created)
                    oldest[tier] = age if oldest[tier] is None else max(oldest[tier], age)
        serving = sum(1 for e in live if pool in e.pools and e.health_state in (HEALTHY, SUSPECT))
        for tier in TIERS:
            rows.append({"pool": pool, "tier": tier, "waiting": waiting[tier],
                         "running": running.get((pool, tier), 0),
                         "oldest_wait_s": None if oldest[tier] is None else round(oldest[tier], 1),
                         "workers": serving})
    return rows
