"""Beat's schedule of Vigil's housekeeping, in one place: how often each task runs and what it
is handed. Beat's schedule (app/celery_app.py) is built from it, and so is the check that a
task is overdue (app/fleet/housekeeping_runs.py: no beat, or beat stuck).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from app.settings import VigilSettings
from app.task_names import (BATCH_TICK, DEADLINE_SWEEP, FOREIGN_QUEUES, HEALTH_TICK, JOB_LEASES,
                            MESSAGE_AUDIT, REAP_WORKERS, RECONCILE)


@dataclass(frozen=True)
class Scheduled:
    """One housekeeping task as beat runs it: every `every` seconds, with `kwargs`."""

    task: str
    every: float
    kwargs: dict = field(default_factory=dict)


def schedule(s: VigilSettings) -> list[Scheduled]:
    """Every housekeeping task beat runs with these settings, and how often."""
    # Beat's own settings decide the timing; the reap timeout and registration grace travel with
    # the task so the worker that runs it reaps by the same rule beat was configured with.
    out = [Scheduled(DEADLINE_SWEEP, s.deadline_sweep_interval)]
    if s.worker_reap_timeout > 0:  # reap_timeout/4: a dead worker is found within 1.25 timeouts
        out.append(Scheduled(REAP_WORKERS, s.worker_reap_timeout / 4,
                             {"reap_timeout": s.worker_reap_timeout,
                              "registration_grace": s.worker_registration_grace}))
    # Quarantined workers must really stop consuming: the worker cancels its own consumers,
    # and this tick does it from outside when the worker could not.
    out.append(Scheduled(HEALTH_TICK, s.health_tick_interval))
    # Jobs: repair lost job-queue announcements; end jobs whose lease lapsed (app/fleet/jobs.py).
    out.append(Scheduled(RECONCILE, s.reconcile_interval))
    out.append(Scheduled(JOB_LEASES, s.deadline_sweep_interval))
    # Open requests whose message is nowhere (a producer that died between record and publish).
    out.append(Scheduled(MESSAGE_AUDIT, s.message_audit_interval))
    # Batch objects: validate, submit the next lines, record results, end (app/fleet/batches.py).
    out.append(Scheduled(BATCH_TICK, s.batch_tick_interval))
    # vigil.generate sent to another app's default queue (no `queue=`): moved to be forwarded.
    if s.foreign_queue_names:
        out.append(Scheduled(FOREIGN_QUEUES, s.foreign_queue_scan_interval))
    return out
