"""Which worker consumes which queue, repaired from outside (beat): a quarantined worker must stop
consuming its pools (the health tick), and every healthy worker of a pool must consume all of the
pool's job queues (part of the reconcile).

Each worker manages its own consumers (workers/quarantine.py, workers/lifecycle.py); these sweeps
catch the one whose own action failed: a quarantine thread stuck, a cancel or an announcement
lost. Functions of `(store, ...)` that act only through the callbacks they are given (Celery's
control bus in production, app/control.py), lock-guarded.
"""
from __future__ import annotations

import logging
from typing import Callable

from app import metrics
from app.fleet.timed_lock import timed_lock
from app.state.health import QUARANTINED, RESTARTING, HealthLedger
from app.state.queues import is_pool_queue
from app.state.store import RequestStore

log = logging.getLogger("vigil.housekeeping")

HEALTH_TICK_LOCK = "health_tick"
# active_queues(worker name) -> the queue names it consumes, or None when it did not answer.
ActiveQueues = Callable[[str], "list[str] | None"]
# cancel(worker name, queue): tell that worker to stop consuming the queue.
CancelConsumer = Callable[[str, str], None]


def enforce_quarantines(ledger: HealthLedger, store: RequestStore, now: float, active_queues: ActiveQueues,
                        cancel: CancelConsumer, *, lock_ttl_s: float = 60.0) -> int:
    """Make every worker whose health ledger says QUARANTINED or RESTARTING stop consuming its
    pool queues (docs/architecture.md, "Wedge detection and quarantine"): the worker cancels its own consumers, and this catches the
    one that could not (its quarantine thread stuck, its cancel lost). The ledger is read again
    right before each cancel, so a worker that passed its canary meanwhile is left alone.
    Returns how many consumers it cancelled; 0 without acting when another tick holds the lock."""
    with timed_lock(store, HEALTH_TICK_LOCK, lock_ttl_s, "health_tick") as held:
        if not held:
            return 0
        cancelled = 0
        try:
            for entry in store.workers.entries():
                inst, name = entry.instance, entry.name
                if not name or entry.health_state not in (QUARANTINED, RESTARTING):
                    continue
                try:
                    queues = active_queues(name)
                except Exception as e:  # one unreachable worker must not stop the tick
                    log.warning("health tick: cannot ask %s for its queues: %s", name, e)
                    continue
                pools = [q for q in queues or () if is_pool_queue(q)]
                if not pools or ledger.read(inst).state not in (QUARANTINED, RESTARTING):
                    continue
                for q in pools:
                    try:
                        cancel(name, q)
                        cancelled += 1
                    except Exception as e:
                        log.warning("health tick: cannot cancel %s on %s: %s", q, name, e)
                log.warning("health tick: quarantined worker %s was still consuming %s; cancelled",
                            name, ", ".join(pools))
        finally:
            metrics.CONSUMERS_CANCELLED.inc(cancelled)
    return cancelled


RECONCILE_LOCK = "reconcile"
# add(worker name, queue): tell that worker to consume the queue.
AddConsumer = Callable[[str, str], None]


def ensure_job_consumers(store: RequestStore, pools: list[str], active_queues: ActiveQueues,
                         add: AddConsumer, *, lock_ttl_s: float = 60.0) -> int:
    """Make every live, healthy worker of each pool consume all of the pool's job queues
    (app/fleet/jobs.py): repairs an announcement that was lost or a worker that started between a
    job's first request and its own start. Lock-guarded; returns how many consumers it added."""
    with store.locked(RECONCILE_LOCK, lock_ttl_s) as held:
        if not held:
            return 0
        added = 0
        workers = store.workers.entries()
        for pool in pools:
            wanted = store.pool_queues(pool)
            if len(wanted) == 1:
                continue  # no job queues: the pool's own queue is on every worker's -Q
            for name in [w.name for w in workers if w.name and pool in w.pools
                         and w.health_state not in (QUARANTINED, RESTARTING)]:
                try:
                    have = active_queues(name)
                except Exception as e:
                    log.warning("reconcile: cannot ask %s for its queues: %s", name, e)
                    continue
                if have is None:
                    continue
                for q in wanted:
                    if q not in have:
                        add(name, q)
                        added += 1
    if added:
        log.warning("reconcile: added %d missing job-queue consumer(s)", added)
    return added
