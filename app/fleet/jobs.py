"""Jobs: named submitter sessions, each with its own queue per pool, so a pool serves jobs
round-robin instead of first come, first served (docs/architecture.md, "Jobs, fairness and the pool reconcile").

    vigil job create eval-7 [--replicas N] [--lease S]   # or just submit with job="eval-7"
    generate.delay(model="tiny-llama", prompt="...", job="eval-7")
    vigil job list
    vigil job delete eval-7                              # its open requests fail job_deleted

**Fairness.** A request of job J for pool P is published to the queue `vigil.pool.P.job.J`
(the `default` job uses the pool's own queue `vigil.pool.P`). Every worker serving P consumes all
of P's job queues, and kombu's Redis transport pops from a worker's queues in round-robin order,
rotating the queue it just served to the back: jobs take turns, oldest first within a job, the
job served longest ago first. A job that enqueues 2,000 requests does not hold up one that
enqueues 20 after it.

**Consumers follow jobs.** The first request of a job in a pool (the create script says so)
tells the pool's live workers to consume the new queue (Celery `add_consumer`); a worker
starting later consumes every job queue of its pools at start; beat's reconcile repairs any
broadcast that got lost.

**Ending a job.** `end_job` (`vigil job delete`) marks the job deleted (a tombstone until the request deadline:
later submits to it fail `job_deleted`), fails every request still open with `job_deleted`,
drops its queues and their messages, and tells workers to stop consuming them, all under the
job's lock. A job whose lease lapsed (no submit or `touch` for `job_lease`, the request
deadline by default) is abandoned: the lease sweep ends it the same way, so its requests stop
occupying GPUs.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from app.celery_ports import CeleryPorts
from app.errors import JOB_DELETED, TerminalError, TransientError
from app.fleet.outcomes import Backend, end_request
from app.requests.models import get_registry
from app.settings import get_settings
from app.state.queues import DEFAULT_JOB, job_queue_name
from app.state.store import RequestStore

log = logging.getLogger("vigil.jobs")

JOB_LOCK = "job:{}"
CHUNK = 100


Cancel = Callable[[str, list[str]], None]  # (queue, worker names): app/control.py ControlBus
Abort = Callable[[list[str]], None]  # request ids that workers should stop running


def end_job(store: RequestStore, name: str, now: float, reason: str, backend: Backend | None,
            cancel: Cancel, pools: list[str], tombstone_s: float, lock_ttl_s: float = 120.0,
            abort: Abort | None = None, code: str = JOB_DELETED) -> int:
    """Delete a job: tombstone first (no new request is accepted for it), then end every open
    request `<code>: <reason>` (`job_deleted` unless a batch ending names its own code; told
    to `backend`), each chunk right after workers were
    told to abort the ones they are running (`abort`: an aborted request whose record is not
    failed yet is dropped as stale, and failed here a moment later), drop its queues (and their
    messages) in `pools`, and tell their workers to stop consuming them. Under the job's lock;
    returns how many requests it failed, or -1 when another process is ending the job right
    now."""
    with store.locked(JOB_LOCK.format(name), lock_ttl_s) as held:
        if not held:
            return -1
        failed = 0
        store.jobs.tombstone(name, now, reason, tombstone_s)
        err = TerminalError.of(code, reason)
        while True:
            ids = store.jobs.open_request_ids(name, CHUNK)
            if not ids:
                break
            if abort is not None:
                try:  # first: a worker running one frees its batch seat, and does not
                    abort(ids)  # finish it after it was failed here (a wasted run)
                except Exception as e:
                    log.warning("ending job %s: abort broadcast failed: %s", name, e)
            for rid in ids:
                try:
                    won, _ = end_request(store, rid, error=err, now=now, backend=backend)
                except TransientError as e:
                    log.warning("ending job %s stopped early: %s", name, e)
                    return failed
                store.jobs.forget_request(name, rid)  # a record that expired meanwhile
                failed += won
        for pool in pools:
            if store.jobs.leave_pool(pool, name):
                names = store.workers.serving(pool)
                store.broker.delete_queue(job_queue_name(pool, name))
                try:
                    cancel(job_queue_name(pool, name), names)
                except Exception as e:  # the queue is empty and gone; a consumer is harmless
                    log.warning("ending job %s: cancel_consumer failed: %s", name, e)
    log.warning("job %s ended (%s): failed %d open request(s)", name, reason, failed)
    return failed


def expire_jobs(store, now: float, default_lease_s: float, end: Callable[[str, str], int],
                lock_ttl_s: float = 60.0) -> int:
    """End every job whose lease lapsed (no submit or touch for its lease): abandoned, its
    requests fail instead of occupying GPUs. The default job never lapses. Lock-guarded;
    returns how many jobs it ended."""
    with store.locked("job_leases", lock_ttl_s) as held:
        if not held:
            return 0
        ended = 0
        for name, last in store.jobs.lapsed(now, default_lease_s):
            if name == DEFAULT_JOB:
                continue
            if end(name, f"job {name!r} abandoned: no submit or poll for "
                   f"{now - last:.0f} s (its lease)") >= 0:
                ended += 1
    return ended


def delete_job(store: RequestStore, ports: CeleryPorts, name: str, reason: str,
               now: float | None = None, code: str = JOB_DELETED) -> int:
    """`end_job` with this process's settings and registry, and the Celery app's result backend
    and control bus (its `ports`, app/celery_ports.py): what `vigil job delete` and the lease
    sweep run. Returns how many requests it failed, or -1 when someone else is ending the job
    right now."""
    return end_job(store, name, time.time() if now is None else now, reason, ports.backend,
                   ports.bus.cancel_consumer, get_registry().names(),
                   get_settings().request_deadline, abort=ports.bus.abort_requests, code=code)
