"""The reaper (beat, every VIGIL_WORKER_REAP_TIMEOUT / 4): a worker silent past its window is
dead; its requests go to other workers now, not after Redis' visibility timeout (an hour by
default; 2,220 s with Vigil's settings).

A function of `(store, now)`: the registry read in chunks, at most MAX_REAPS_PER_RUN workers per
run, one record's failure isolated from the rest, a lock so a second beat never reaps twice.
"""
from __future__ import annotations

import logging

from app import metrics
from app.fleet.handback import Republish, hand_back_one
from app.fleet.message_audit import audit_after_reap
from app.fleet.outcomes import Backend
from app.fleet.timed_lock import timed_lock
from app.settings_defaults import DEFAULT_WORKER_REGISTRATION_GRACE_S
from app.state.store import RequestStore

log = logging.getLogger("vigil.housekeeping")

REAPER_LOCK = "reaper"
# Registry entries read per step.
REAP_CHUNK = 100
# Workers reaped per run at most (each may hold a whole batch to republish); the rest wait for
# the next run, a quarter timeout later.
MAX_REAPS_PER_RUN = 100


def reap_workers(store: RequestStore, now: float, republish: Republish,
                 backend: Backend | None, *, reap_timeout: float, max_attempts: int,
                 lock_ttl_s: float = 60.0,
                 registration_grace: float = DEFAULT_WORKER_REGISTRATION_GRACE_S,
                 chunk: int = REAP_CHUNK, max_reaps: int = MAX_REAPS_PER_RUN,
                 redis_started_at: float = 0.0, audit_lost: bool = True
                 ) -> dict[str, tuple[int, int]]:
    """Reap every worker whose last heartbeat is older than `reap_timeout`, or, for a worker
    that never became ready (has_pinged 0: crashed or stuck in warm-up), older than
    `registration_grace` (never shorter than the timeout). The registry is read `chunk` entries
    at a time; at most `max_reaps` workers are reaped per run (the rest on the next run).

    Each request it held is handed back (app/fleet/handback.py: published again under its next
    dispatch, or ended when out of attempts or past its deadline, told to `backend`); then the
    worker's registry entry, in-flight set and ledger are dropped, only if its `last_seen` is
    still the one the scan read (compare and delete: a worker whose heartbeat, or a finish,
    landed mid-reap is alive and keeps them). Returns {worker name:
    (requeued, failed)}; {} when another reaper holds the lock or `reap_timeout` is 0.

    Silence is counted from `redis_started_at` at the earliest (when Redis last started): no
    heartbeat could land while Redis was down, so a restart never makes live workers look dead.
    After a reap (`audit_lost`), the reaped workers' pools are audited for requests whose message
    the dead consumer took with it (app/fleet/message_audit.py audit_after_reap)."""
    if reap_timeout <= 0:
        return {}
    with timed_lock(store, REAPER_LOCK, lock_ttl_s, "reaper") as held:
        if not held:
            return {}
        report: dict[str, tuple[int, int]] = {}
        reaped_pools: set[str] = set()
        republished: set[str] = set()
        for inst, window, last_seen in _due_workers(store, now, reap_timeout,
                                                    registration_grace, chunk, max_reaps,
                                                    redis_started_at):
            if store.workers.last_seen(inst) != last_seen:
                continue  # it heartbeat since the scan: alive after all
            name = store.workers.name(inst) or f"instance {inst}"
            reaped_pools.update(store.workers.pools(inst))
            requeued = failed = 0
            for rid in store.inflight_ids(inst):
                if store.workers.last_seen(inst) != last_seen:
                    break  # it heartbeat mid-reap: what it still holds stays with it
                try:
                    outcome = hand_back_one(store, now, rid, inst, republish, backend,
                                            max_attempts)
                except Exception as e:  # one bad record must not strand the others
                    log.warning("reaper: request %s of %s not handled: %s", rid, name, e)
                    continue
                requeued += outcome == "requeued"
                failed += outcome == "failed"
                if outcome == "requeued":
                    republished.add(rid)
            if not store.workers.drop_if_unchanged(inst, last_seen):
                # A heartbeat landed mid-reap: it keeps its entry, in-flight set and ledger.
                # What was handed back already runs elsewhere too; the first result wins.
                log.warning("worker %s (instance %s) heartbeat during its reap; kept its entry "
                            "(%d request(s) already handed back)", name, inst, requeued + failed)
                continue
            metrics.REAPED_WORKERS.inc()
            metrics.REAPED_REQUESTS.labels("requeued").inc(requeued)
            metrics.REAPED_REQUESTS.labels("failed").inc(failed)
            report[name] = (requeued, failed)
            log.warning("reaped worker %s (instance %s): no heartbeat for over %.0f s%s; "
                        "requeued %d request(s), failed %d", name, inst, window,
                        "" if window == reap_timeout else " (never ready: registration grace)",
                        requeued, failed)
    if reaped_pools and audit_lost:
        # A consumer killed while it waited in BRPOP can take a message with it, out of every
        # queue, the unacked hash and the in-flight sets (app/fleet/message_audit.py).
        audit_after_reap(store, now, republish, sorted(reaped_pools), requeued=republished)
    return report


def _due_workers(store: RequestStore, now: float, reap_timeout: float, grace: float,
                 chunk: int, max_reaps: int, since: float = 0.0):
    """Yield (instance, window, last_seen) for each worker past its window, least recently seen
    first: `reap_timeout` once it pinged, `grace` before. The caller drops each yielded entry
    before the next chunk is read (or it heartbeat since, which takes it out of the silent range
    too), so only the skipped ones (still in their grace) shift the offset."""
    grace = max(grace, reap_timeout)
    skipped = yielded = 0
    while yielded < max_reaps:
        rows = store.workers.silent(now - reap_timeout, chunk, start=skipped)
        if not rows:
            return
        for inst, last_seen, pinged in rows:
            window = reap_timeout if pinged else grace
            if max(last_seen, since) >= now - window:
                skipped += 1  # within its grace (not ready yet), or Redis started since
                continue
            yield inst, window, last_seen
            yielded += 1
            if yielded >= max_reaps:
                return
