"""Beat housekeeping as plain functions of `(store, now)`: injectable clock, chunked scans,
per-item failure isolation, a lock so a second beat never double-acts.

So far: the deadline sweep and the reaper. (Pool reconcile and job leases are planned: DESIGN.md
section 6.)
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from app import metrics
from app.errors import (ATTEMPTS_EXHAUSTED, DEADLINE_EXCEEDED, TerminalError, TransientError,
                        VigilError)
from app.settings import DEFAULT_WORKER_REGISTRATION_GRACE_S
from app.state.store import RequestStore

log = logging.getLogger("vigil.housekeeping")

SWEEP_CHUNK = 100
DEADLINE_SWEEP_LOCK = "deadline_sweep"
SWEEPER_INSTANCE = 0  # finishes are attributed to no worker instance

OnFailed = Callable[[str, VigilError], None]
# republish(request_id, record, dispatch): publish the request's message again under `dispatch`.
Republish = Callable[[str, dict, int], None]
REAPER_LOCK = "reaper"
# Workers reaped per run at most (each may hold a whole batch to republish); the rest wait for
# the next run, a quarter timeout later.
MAX_REAPS_PER_RUN = 100


@contextmanager
def _timed_lock(store: RequestStore, lock: str, ttl_s: float, task: str) -> Iterator[bool]:
    """`store.locked`, counted in the housekeeping metrics: `task` skipped when another run holds
    the lock, else the time this run held it."""
    with store.locked(lock, ttl_s) as held:
        if not held:
            metrics.housekeeping_skipped(task)
            yield False
            return
        started = time.monotonic()
        try:
            yield True
        finally:
            metrics.housekeeping_ran(task, time.monotonic() - started)


def sweep_deadlines(store: RequestStore, now: float, on_failed: OnFailed, *,
                    chunk: int = SWEEP_CHUNK, lock_ttl_s: float = 60.0,
                    max_items: int | None = None) -> int:
    """Fail every non-terminal request whose deadline is before `now` with deadline_exceeded.

    Reads the deadline index ~`chunk` ids at a time (memory stays bounded whatever the backlog),
    finishes each through the set-once script (a worker's result written first still wins), and
    calls `on_failed(request_id, error)` for each request this sweep failed, so the Celery result
    backend can tell a waiting `r.get()`. Returns how many it failed; 0 without acting when
    another sweep holds the lock.
    """
    with _timed_lock(store, DEADLINE_SWEEP_LOCK, lock_ttl_s, "deadline_sweep") as held:
        if not held:
            return 0
        failed = 0
        while max_items is None or failed < max_items:
            ids = store.past_deadline(now, chunk)
            if not ids:
                break
            for rid in ids:
                err = TerminalError.of(DEADLINE_EXCEEDED, "the request did not end before its "
                                       "deadline (no worker finished it in time)"
                                       + _unserved_because(store, rid))
                try:
                    won, stored = store.finish(rid, SWEEPER_INSTANCE, now,
                                               error_kind=type(err).__name__, error=str(err))
                except TransientError as e:  # Redis blip: the next sweep picks the rest up
                    log.warning("deadline sweep stopped early: %s", e)
                    return failed
                if won:
                    failed += 1
                    metrics.request_failed(_pool_of(store, rid), DEADLINE_EXCEEDED)
                    try:
                        on_failed(rid, err)
                    except Exception as e:  # one bad item must not stop the sweep
                        log.warning("deadline sweep: could not notify %s: %s", rid, e)
    if failed:
        log.warning("deadline sweep failed %d request(s) with deadline_exceeded", failed)
    return failed


def reap_workers(store: RequestStore, now: float, republish: Republish, on_failed: OnFailed, *,
                 reap_timeout: float, max_attempts: int, lock_ttl_s: float = 60.0,
                 registration_grace: float = DEFAULT_WORKER_REGISTRATION_GRACE_S,
                 chunk: int = SWEEP_CHUNK, max_reaps: int = MAX_REAPS_PER_RUN,
                 redis_started_at: float = 0.0, audit_lost: bool = True
                 ) -> dict[str, tuple[int, int]]:
    """Reap every worker whose last heartbeat is older than `reap_timeout`, or, for a worker
    that never became ready (has_pinged 0: crashed or stuck in warm-up), older than
    `registration_grace` (never shorter than the timeout). The registry is read `chunk` entries
    at a time; at most `max_reaps` workers are reaped per run (the rest on the next run).

    Each request it held (RUNNING, or PENDING with its message in that worker's consumer:
    received but not begun, or a retry's delayed message) is moved back to PENDING under
    dispatch + 1 and published again (same id), or failed when out of attempts
    (attempts_exhausted) or past its deadline (deadline_exceeded); then the worker's registry
    entry and in-flight set are dropped. The record moves before the message is published, so a
    requeue refused because another worker took the request meanwhile publishes nothing; Celery's
    own copy, if it comes back after the visibility timeout, is an older dispatch and is dropped
    unexecuted. Returns {worker name: (requeued, failed)}; {} when another reaper holds
    the lock or `reap_timeout` is 0.

    Silence is counted from `redis_started_at` at the earliest (when Redis last started): no
    heartbeat could land while Redis was down, so a restart never makes live workers look dead.
    After a reap (`audit_lost`), the reaped workers' pools are audited for requests whose message
    the dead consumer took with it (app/fleet/message_audit.py audit_after_reap).
    """
    if reap_timeout <= 0:
        return {}
    with _timed_lock(store, REAPER_LOCK, lock_ttl_s, "reaper") as held:
        if not held:
            return {}
        report: dict[str, tuple[int, int]] = {}
        reaped_pools: set[str] = set()
        republished: set[str] = set()
        for inst, window in _due_workers(store, now, reap_timeout, registration_grace, chunk,
                                         max_reaps, redis_started_at):
            name = store.workers.name(inst) or f"instance {inst}"
            reaped_pools.update(store.workers.pools(inst))
            requeued = failed = 0
            for rid in store.inflight_ids(inst):
                try:
                    outcome = reap_one(store, now, rid, inst, republish, on_failed, max_attempts)
                except Exception as e:  # one bad record must not strand the others
                    log.warning("reaper: request %s of %s not handled: %s", rid, name, e)
                    continue
                requeued += outcome == "requeued"
                failed += outcome == "failed"
                if outcome == "requeued":
                    republished.add(rid)
            store.workers.drop(inst)
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
        from app.fleet.message_audit import audit_after_reap

        audit_after_reap(store, now, republish, sorted(reaped_pools), requeued=republished)
    return report


def _pool_of(store: RequestStore, request_id: str) -> str:
    """A record's pool, for metrics labels ('' when it cannot be read)."""
    try:
        return store.pool_of(request_id)
    except Exception:  # a metrics label is not worth failing a sweep over
        return ""


def _due_workers(store: RequestStore, now: float, reap_timeout: float, grace: float,
                 chunk: int, max_reaps: int, since: float = 0.0):
    """Yield (instance, window) for each worker past its window, least recently seen first:
    `reap_timeout` once it pinged, `grace` before. The caller drops each yielded entry before
    the next chunk is read, so only the skipped ones (still in their grace) shift the offset."""
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
            yield inst, window
            yielded += 1
            if yielded >= max_reaps:
                return


def republish_request(request_id: str, record: dict, dispatch: int) -> None:
    """Publish a request again (same id, its pool's queue) under `dispatch` (Celery's `retries`
    header, which the worker reads as the dispatch number)."""
    from app import app
    from app.celery_app import outage_retry_policy
    from app.state.queues import DEFAULT_JOB, job_queue
    from app.settings import get_settings
    from app.requests.submit import EXPIRES_GRACE_S

    kwargs = json.loads(record["request"])
    expires = dt.datetime.fromtimestamp(float(record["deadline_at"]) + EXPIRES_GRACE_S,
                                        tz=dt.timezone.utc)
    app.send_task("vigil.generate", kwargs=kwargs, task_id=request_id, retries=dispatch,
                  queue=job_queue(record["pool"], record.get("job", DEFAULT_JOB)),
                  expires=expires, argsrepr="()",
                  retry_policy=outage_retry_policy(get_settings()),
                  kwargsrepr=f"{{model: {record['model']!r}, job: {record['job']!r}}}")


def hand_back(store: RequestStore, now: float, instance: int | str, republish: Republish,
              on_failed: OnFailed, max_attempts: int) -> tuple[int, int]:
    """Requeue (or fail, when out of attempts or time) every request a worker instance holds:
    the reaper's rule, applied by a worker to itself at shutdown. Returns (requeued, failed)."""
    requeued = failed = 0
    for rid in store.inflight_ids(instance):
        outcome = reap_one(store, now, rid, instance, republish, on_failed, max_attempts)
        requeued += outcome == "requeued"
        failed += outcome == "failed"
    return requeued, failed


def reap_one(store, now, rid, inst, republish, on_failed, max_attempts) -> str:
    """Hand one request of worker instance `inst` back: failed (deadline passed, or out of
    attempts) or moved to its next dispatch and published again. Returns "failed", "requeued",
    or "skipped" when it had ended or moved on (nothing done)."""
    rec = store.get(rid)
    # RUNNING under the dead worker, or PENDING with its message held by the dead worker's
    # consumer (received but not begun, or a retry's ETA message): both need a new message.
    status = rec.get("status") if rec else None
    if status not in ("RUNNING", "PENDING") or (status == "RUNNING"
                                                  and rec.get("instance") != str(inst)):
        return "skipped"
    attempts = int(rec.get("attempts", 0))
    err = None
    if float(rec.get("deadline_at") or 0) and float(rec["deadline_at"]) < now:
        err = TerminalError.of(DEADLINE_EXCEEDED, "its worker died and the deadline has passed")
    elif attempts >= max_attempts:
        err = TerminalError.of(ATTEMPTS_EXHAUSTED, f"{attempts} attempts used; last error: "
                               "worker_lost: its worker stopped heartbeating and was reaped")
    if err is not None:
        won, _ = store.finish(rid, SWEEPER_INSTANCE, now, error_kind=type(err).__name__,
                              error=str(err))
        if won:
            metrics.request_failed(rec.get("pool", ""), err.code)
            on_failed(rid, err)
        return "failed" if won else "skipped"
    dispatch = int(rec.get("dispatch", 0)) + 1
    # The record moves to the new dispatch first, then that dispatch's message is published:
    # a requeue refused because another worker took the request meanwhile publishes nothing, so
    # no newer message is left behind to run the request a second time.
    if not store.requeue(rid, inst, dispatch, now=now):
        return "skipped"
    try:
        republish(rid, rec, dispatch)
    except Exception as e:  # Redis went away between the two steps: the deadline sweep ends it
        log.error("requeued %s but could not publish it (%s); its deadline will end it", rid, e)
        raise
    return "requeued"


HEALTH_TICK_LOCK = "health_tick"
# active_queues(worker name) -> the queue names it consumes, or None when it did not answer.
ActiveQueues = Callable[[str], "list[str] | None"]
# cancel(worker name, queue): tell that worker to stop consuming the queue.
CancelConsumer = Callable[[str, str], None]


def enforce_quarantines(ledger, store: RequestStore, now: float, active_queues: ActiveQueues,
                        cancel: CancelConsumer, *, lock_ttl_s: float = 60.0) -> int:
    """Make every worker whose health ledger says QUARANTINED or RESTARTING stop consuming its
    pool queues (DESIGN.md section 5): the worker cancels its own consumers, and this catches the
    one that could not (its quarantine thread stuck, its cancel lost). The ledger is read again
    right before each cancel, so a worker that passed its canary meanwhile is left alone.
    Returns how many consumers it cancelled; 0 without acting when another tick holds the lock."""
    from app.state.health import QUARANTINED, RESTARTING
    from app.state.queues import is_pool_queue

    with _timed_lock(store, HEALTH_TICK_LOCK, lock_ttl_s, "health_tick") as held:
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
    from app.state.health import QUARANTINED, RESTARTING
    from app.state.queues import pool_queues

    with store.locked(RECONCILE_LOCK, lock_ttl_s) as held:
        if not held:
            return 0
        added = 0
        workers = store.workers.entries()
        for pool in pools:
            wanted = pool_queues(store.r, pool)
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


def _unserved_because(store: RequestStore, request_id: str) -> str:
    """'; <the reconcile's reason>' when the request's pool had no worker that could take it."""
    from app.state.jobs import unserved_reason

    try:
        pool = store.pool_of(request_id)
        reason = unserved_reason(store.r, pool) if pool else ""
    except Exception:  # the reason is a courtesy; the failure itself must go through
        return ""
    return f"; {reason}" if reason else ""
