"""Views on the request store: kombu's queues, the job records and the housekeeping runs, read and
written through the store's one client under its one outage policy (app/state/calls.py).

Code outside app/state/ never holds a Redis client: it opens a `RequestStore` (app/state/store.py
`open_store`) and asks it and these views (`store.broker`, `store.jobs`, `store.housekeeping`,
`store.fleet`, `store.workers`) and what it hands out (`store.batches()`, `store.streams()`,
`store.health_ledger()`), so every read and write of Redis rides out an outage the same way and
fails the same way (TransientError(redis_unavailable)). tests/test_layers.py fails on an import
of redis-py, a call of `connect`, or a `.r`, `.client`, `.raw` or `._call` outside app/state/.
"""
from __future__ import annotations

import json
from typing import Callable

import redis

from app.state import broker, jobs, keys
from app.state.lua_deliveries import MOVE_MESSAGE


class BrokerView:
    """kombu's queue lists and unacked hash (app/state/broker.py), through the store."""

    def __init__(self, client: redis.Redis, call: Callable):
        self._client, self._call = client, call
        self._move = client.register_script(MOVE_MESSAGE)

    def all_pool_queues(self) -> list[str]:
        """Every pool and job queue that exists in Redis now."""
        return self._call(broker.all_pool_queues, self._client)

    def depths(self, queues: list[str]) -> list[int]:
        """Messages waiting in each of `queues` (every priority list of each)."""
        return self._call(broker.depths, self._client, queues)

    def queued_ids(self, queues: list[str], *, unacked: bool = False) -> set[str]:
        """Request ids with a message waiting in `queues` (and, with `unacked`, fetched by a
        consumer and not acked)."""
        return self._call(broker.queued_ids, self._client, queues, unacked=unacked)

    def position(self, queue: str, request_id: str, *, limit: int) -> tuple[int | None, int]:
        """(position, length) of a request's message in `queue` (broker.position)."""
        return self._call(broker.position, self._client, queue, request_id, limit=limit)

    def next_ids(self, queues: list[str]) -> list[str]:
        """The request id of the next message each of `queues` delivers."""
        return self._call(broker.next_ids, self._client, queues)

    def messages_of_task(self, list_key: str, task: str, *, limit: int) -> list[bytes]:
        """The messages of `task` among the first `limit` entries of one queue list."""
        return self._call(broker.messages_of_task, self._client, list_key, task, limit=limit)

    def move_message(self, src: str, dst: str, raw: bytes) -> bool:
        """Move one message, byte for byte, from list `src` to queue `dst` in one step; False
        when it was no longer in `src`."""
        return bool(self._call(self._move, keys=[src, dst], args=[raw]))

    def delete_queue(self, queue: str) -> None:
        """Drop a queue, its messages and kombu's binding records for it."""
        self._call(broker.delete_queue, self._client, queue)


class FleetView:
    """What the fleet is doing, counted for its gauges (app/fleet/fleet_gauges.py)."""

    def __init__(self, client: redis.Redis, call: Callable):
        self._client, self._call = client, call

    def list_depths(self, queue: str) -> list[int]:
        """Messages waiting in each of `queue`'s priority lists, in pop order (step 0, 3, 6,
        9)."""
        return self._call(broker.depths_by_list, self._client, queue)

    def list_requests(self, queue: str) -> list[int]:
        """Requests waiting in each of `queue`'s priority lists, in pop order: a message of
        many counts each request it carries (estimated past the first 32 messages of a list:
        broker.requests_by_list)."""
        return self._call(broker.requests_by_list, self._client, queue)

    def next_per_list(self, queue: str) -> list[str | None]:
        """The request id of the next message in each of `queue`'s priority lists (None for an
        empty one), in pop order."""
        return [(ids[0] if ids else None) for ids in
                (self._call(broker.next_ids, self._client, [key])
                 for key in broker.queue_lists(queue))]

    def running(self, instances: list[str]) -> dict[tuple[str, str], int]:
        """(pool, tier) -> requests RUNNING in these worker instances (their in-flight sets,
        each record's status, pool and tier read in one pipelined round trip per instance)."""
        out: dict[tuple[str, str], int] = {}
        for inst in instances:
            ids = self._call(self._client.smembers, keys.inflight(inst))
            if not ids:
                continue
            pipe = self._client.pipeline(transaction=False)
            for rid in ids:
                pipe.hmget(keys.request(rid.decode()), "status", "pool", "priority")
            for status, pool, tier in self._call(pipe.execute):
                if status == b"RUNNING" and pool:
                    k = (pool.decode(), (tier or b"default").decode())
                    out[k] = out.get(k, 0) + 1
        return out


class JobsView:
    """The job records and the pools' unserved reasons (app/state/jobs.py), through the store."""

    def __init__(self, client: redis.Redis, call: Callable):
        self._client, self._call = client, call

    def create(self, name: str, *, replicas: int = 1, lease_s: float | None = None,
               now: float | None = None) -> None:
        """Create or update a job (jobs.create_job); TerminalError(job_deleted) for a deleted
        name."""
        self._call(jobs.create_job, self._client, name, replicas=replicas, lease_s=lease_s,
                   now=now)

    def touch(self, name: str, now: float | None = None) -> None:
        """Renew a live job's lease."""
        self._call(jobs.touch, self._client, name, now)

    def list(self) -> list[dict]:
        """Every live job (jobs.list_jobs)."""
        return self._call(jobs.list_jobs, self._client)

    def tombstone(self, name: str, now: float, reason: str, ttl_s: float) -> None:
        """Mark a job deleted: its new requests are refused while the tombstone lasts."""
        self._call(jobs.tombstone, self._client, name, now, reason, ttl_s)

    def open_request_ids(self, name: str, limit: int) -> list[str]:
        """Up to `limit` ids of a job's open requests."""
        return self._call(jobs.open_request_ids, self._client, name, limit)

    def forget_request(self, name: str, request_id: str) -> None:
        """Drop a request from its job's open set."""
        self._call(jobs.forget_request, self._client, name, request_id)

    def leave_pool(self, pool: str, name: str) -> bool:
        """Drop a job from a pool's jobs; True when it was there."""
        return self._call(jobs.leave_pool, self._client, pool, name)

    def lapsed(self, now: float, default_lease_s: float) -> list[tuple[str, float]]:
        """(name, last active) of every job whose lease lapsed."""
        return self._call(jobs.lapsed_jobs, self._client, now, default_lease_s)

    def replicas_wanted(self, pool: str) -> int:
        """The most workers any of the pool's jobs asks for (at least 1)."""
        return self._call(jobs.replicas_wanted, self._client, pool)

    def unserved_reason(self, pool: str) -> str:
        """Why no worker serves `pool` (empty when it is served)."""
        return self._call(jobs.unserved_reason, self._client, pool)

    def set_unserved(self, pool: str, reason: str, now: float) -> None:
        """Record why no worker can take `pool`."""
        self._call(jobs.set_unserved, self._client, pool, reason, now)

    def clear_unserved(self, pool: str) -> None:
        """Forget a pool's unserved reason (it is served, or has nothing waiting)."""
        self._call(jobs.clear_unserved, self._client, pool)


class HousekeepingView:
    """When each housekeeping task last ran (vigil:housekeeping), through the store."""

    def __init__(self, client: redis.Redis, call: Callable):
        self._client, self._call = client, call

    def note_run(self, task: str, at: float, took: float, error: str = "") -> None:
        """Record the last run of housekeeping task `task`: when it ended, how long it took,
        and its error if it failed (empty when it succeeded)."""
        self._call(self._client.hset, keys.HOUSEKEEPING_RUNS, task,
                   json.dumps({"at": at, "took": round(took, 3), "error": error[:300]}))

    def runs(self) -> dict[str, dict]:
        """task name -> {at, took, error} of its last run (`note_run`)."""
        out = {}
        for k, v in self._call(self._client.hgetall, keys.HOUSEKEEPING_RUNS).items():
            try:
                out[k.decode()] = json.loads(v)
            except ValueError:
                continue
        return out
