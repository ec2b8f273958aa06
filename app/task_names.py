"""Every Celery task name Vigil registers, in one place: the task decorators (tasks/), beat's
schedule (app/celery_app.py) and the code that sends or recognises a task (publish, the
consumer's guard, the foreign-queue scan) all use these constants, so a name is typed once."""
from __future__ import annotations

# The producer contract: one generation request (docs/api.md).
GENERATE = "vigil.generate"
# Many requests in one message (tasks.inference `generate_many`): each request keeps its own
# record, id and result (app/requests/submit.py, workers/service.py).
GENERATE_MANY = "vigil.generate_many"
# Beat's housekeeping (tasks/housekeeping.py over app/fleet/).
DEADLINE_SWEEP = "vigil.deadline_sweep"
REAP_WORKERS = "vigil.reap_workers"
HEALTH_TICK = "vigil.health_tick"
RECONCILE = "vigil.reconcile"
JOB_LEASES = "vigil.job_leases"
MESSAGE_AUDIT = "vigil.message_audit"
BATCH_TICK = "vigil.batch_tick"
FOREIGN_QUEUES = "vigil.foreign_queues"

HOUSEKEEPING_TASKS = (DEADLINE_SWEEP, REAP_WORKERS, HEALTH_TICK, RECONCILE, JOB_LEASES,
                      MESSAGE_AUDIT, BATCH_TICK, FOREIGN_QUEUES)
