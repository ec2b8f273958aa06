"""Every Celery queue name Vigil uses, built here and nowhere else.

| queue                              | carries                                              |
| ---------------------------------- | ---------------------------------------------------- |
| vigil.housekeeping                 | beat's tasks (deadline sweep, reaper, health tick,   |
|                                    | reconcile, job leases)                               |
| vigil.pool.{pool}                  | a pool's requests of the default job                 |
| vigil.pool.{pool}.job.{job}        | one job's requests in that pool (app/fleet/jobs.py: |
|                                    | jobs take turns because each has its own queue)     |

kombu's Redis transport keeps each queue as a list of that name (LPUSH by producers, BRPOP by
workers: the next message delivered is the rightmost), so a queue's name is also its Redis key.
A pool's job queues are the jobs in `vigil:pooljobs:{pool}` (app/state/keys.py).
"""
from __future__ import annotations

import redis
from kombu import Queue

from app.state import keys

HOUSEKEEPING_QUEUE = "vigil.housekeeping"
QUEUE_PREFIX = "vigil.pool."
JOB_INFIX = ".job."
# The job a request belongs to when it names none: its requests use the pool's own queue.
DEFAULT_JOB = "default"
# A glob matching every pool queue (the pools' own and their jobs'), for SCAN.
POOL_QUEUE_GLOB = QUEUE_PREFIX + "*"


def pool_queue(pool: str) -> str:
    """The queue of `pool`'s default-job requests: `vigil.pool.<pool>`."""
    return QUEUE_PREFIX + pool


def job_queue_name(pool: str, job: str) -> str:
    """The queue carrying `job`'s requests for `pool` (the pool's own queue for the default
    job)."""
    return pool_queue(pool) if job == DEFAULT_JOB else f"{QUEUE_PREFIX}{pool}{JOB_INFIX}{job}"


def job_queue(pool: str, job: str) -> Queue:
    """`job_queue_name` as a kombu Queue (job queues are not in the app's declared list, so a
    publish names the Queue object itself)."""
    return Queue(job_queue_name(pool, job))


def is_pool_queue(name: str) -> bool:
    """True for any queue of any pool: its own or one of its jobs'."""
    return name.startswith(QUEUE_PREFIX)


def pool_of(name: str) -> str | None:
    """The pool whose *own* queue `name` is; None for a job queue or any other queue."""
    if not is_pool_queue(name):
        return None
    rest = name[len(QUEUE_PREFIX):]
    return None if JOB_INFIX in rest else rest


def declared_queues(pools: list[str]) -> list[str]:
    """Every queue the Celery app declares: housekeeping, then each pool's own queue (job queues
    are created as jobs appear)."""
    return [HOUSEKEEPING_QUEUE] + [pool_queue(p) for p in pools]


def pool_queues(client: redis.Redis, pool: str) -> list[str]:
    """Every queue of `pool`: its own, then one per job that has requests there (sorted)."""
    jobs = sorted(j.decode() for j in client.smembers(keys.pool_jobs(pool)))
    return [pool_queue(pool)] + [job_queue_name(pool, j) for j in jobs]
