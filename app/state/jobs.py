"""Jobs and the pools they ask for, in Redis: job records, their open requests, the jobs with a
queue in each pool, and why a pool has no worker.

The behaviour around them (announcing a job's queue, ending a job, the lease sweep, the
reconcile) is app/fleet/; this module only reads and writes the keys (app/state/keys.py):
`vigil:job:{name}`, `vigil:jobs`, `vigil:jobreqs:{name}`, `vigil:pooljobs:{pool}`,
`vigil:poolstate:{pool}`. Functions raise redis' own errors.
"""
from __future__ import annotations

import time

import redis

from app.errors import JOB_DELETED, TerminalError
from app.state import keys
from app.state.calls import decoded

# A pool's recorded reason outlives the pass that wrote it by this much (it is rewritten or
# deleted by every reconcile pass; this only bounds it if beat stops).
POOL_STATE_TTL_S = 3600
# The most jobs one lease sweep looks at (the rest on its next run).
LEASE_SCAN_LIMIT = 1000


def create_job(client: redis.Redis, name: str, *, replicas: int = 1,
               lease_s: float | None = None, now: float | None = None) -> None:
    """Create (or update) a job. Submitting with `job=name` creates it implicitly. A deleted
    job's name is refused (TerminalError job_deleted) while its tombstone lasts."""
    now = time.time() if now is None else now
    if client.hget(keys.job(name), "state") == b"deleted":
        raise TerminalError.of(JOB_DELETED, f"job {name!r} was deleted; use a new name")
    pipe = client.pipeline(transaction=True)
    pipe.hsetnx(keys.job(name), "created_at", now)
    fields = {"name": name, "last_active": now, "replicas": replicas}
    if lease_s is not None:
        fields["lease_s"] = lease_s
    pipe.hset(keys.job(name), mapping=fields)
    pipe.zadd(keys.JOBS, {name: now})
    pipe.execute()


def touch(client: redis.Redis, name: str, now: float | None = None) -> None:
    """Renew a live job's lease (a poller that submits nothing calls this); nothing for a job
    that is not live."""
    now = time.time() if now is None else now
    if client.zscore(keys.JOBS, name) is not None:
        pipe = client.pipeline(transaction=True)
        pipe.hset(keys.job(name), "last_active", now)
        pipe.zadd(keys.JOBS, {name: now})
        pipe.execute()


def list_jobs(client: redis.Redis) -> list[dict]:
    """Every live job: {name, last_active, pending (open requests), replicas, lease_s,
    created_at}."""
    out = []
    for name, last in client.zrange(keys.JOBS, 0, -1, withscores=True):
        name = name.decode()
        raw = decoded(client.hgetall(keys.job(name)))
        out.append({"name": name, "last_active": last,
                    "pending": client.scard(keys.job_requests(name)),
                    "replicas": int(raw.get("replicas", 1) or 1),
                    "lease_s": float(raw["lease_s"]) if raw.get("lease_s") else None,
                    "created_at": float(raw.get("created_at", last))})
    return out


def tombstone(client: redis.Redis, name: str, now: float, reason: str, ttl_s: float) -> None:
    """Mark a job deleted for `ttl_s` (at least a minute): the create script refuses its new
    requests, and it leaves the live jobs."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.job(name), mapping={"state": "deleted", "deleted_at": now, "reason": reason})
    pipe.expire(keys.job(name), int(max(60, ttl_s)))
    pipe.zrem(keys.JOBS, name)
    pipe.execute()


def open_request_ids(client: redis.Redis, name: str, limit: int) -> list[str]:
    """Up to `limit` ids of the job's open requests (any order)."""
    return [i.decode() for i in client.srandmember(keys.job_requests(name), limit)]


def forget_request(client: redis.Redis, name: str, request_id: str) -> None:
    """Drop a request from its job's open set (finish does it; this covers a record that
    expired meanwhile)."""
    client.srem(keys.job_requests(name), request_id)


def leave_pool(client: redis.Redis, pool: str, name: str) -> bool:
    """Take the job out of `pool`'s jobs; True when it was there (its queue must then go)."""
    return bool(client.srem(keys.pool_jobs(pool), name))


def lapsed_jobs(client: redis.Redis, now: float, default_lease_s: float) -> list[tuple[str, float]]:
    """(name, last_active) of live jobs whose lease lapsed by `now`: no submit or touch for
    their `lease_s`, or `default_lease_s` without one. At most LEASE_SCAN_LIMIT are looked at."""
    out = []
    for name, last in client.zrangebyscore(keys.JOBS, "-inf", now, withscores=True,
                                           start=0, num=LEASE_SCAN_LIMIT):
        name = name.decode()
        lease = client.hget(keys.job(name), "lease_s")
        if last < now - (float(lease) if lease else default_lease_s):
            out.append((name, last))
    return out


def replicas_wanted(client: redis.Redis, pool: str) -> int:
    """The most workers any live job with a queue in `pool` asks for (at least 1)."""
    want = 1
    for job in client.smembers(keys.pool_jobs(pool)):
        r = client.hget(keys.job(job.decode()), "replicas")
        if r:
            want = max(want, int(r))
    return want


def unserved_reason(client: redis.Redis, pool: str) -> str:
    """The reconcile's last word on why `pool` has no worker ('' if none)."""
    r = client.hget(keys.pool_state(pool), "reason")
    return r.decode() if r else ""


def set_unserved(client: redis.Redis, pool: str, reason: str, now: float) -> None:
    """Record why `pool` has no worker (shown by `vigil status` and in the deadline_exceeded of
    its requests); stale after POOL_STATE_TTL_S if no pass rewrites it."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.pool_state(pool), mapping={"reason": reason, "at": now})
    pipe.expire(keys.pool_state(pool), POOL_STATE_TTL_S)
    pipe.execute()


def clear_unserved(client: redis.Redis, pool: str) -> None:
    """`pool` is served (or has nothing waiting): forget why it was not."""
    client.delete(keys.pool_state(pool))
