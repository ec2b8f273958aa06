"""Vigil's request state in Redis: the record, its attempts, the set-once result (the in-flight
sets: app/state/store_holds.py; many at once: app/state/store_many.py; reading a record:
app/state/store_reads.py).

Every multi-step change is one Lua script, so a crash between steps cannot leave a record half
updated, and two writers of a result cannot both win.
"""
from __future__ import annotations

import json
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import redis

from app.settings import VigilSettings, get_settings
from app.state import keys
from app.state.api_keys import ApiKeys
from app.state.batches import BatchStore
from app.state.calls import Calls
from app.state.conn import connect
from app.state.health import HealthLedger
from app.state.lua_records import (BEGIN, CREATE, FINISH, FINISH_FAILED_MANY,
                                   RELEASE, REQUEUE, UNLOCK)
from app.state.queues import pool_queues
from app.state.registry import WorkerRegistry
from app.state.views import BrokerView, FleetView, HousekeepingView, JobsView
from app.state.results import ResultKey
from app.state.store_holds import HoldCalls
from app.state.store_many import ManyCalls
from app.state.store_reads import Outcome, ReadCalls
from app.state.streams import TokenStreams

# RequestStore.create outcomes
JOB_DELETED = -1
# Refused by backpressure (nothing written): the job's, or the pool's, open requests are at
# their cap (VIGIL_MAX_PENDING_PER_JOB / _PER_POOL).
OVERLOADED_JOB = -2
OVERLOADED_POOL = -3
EXISTS = 0
CREATED = 1
CREATED_NEW_JOB_QUEUE = 2


@dataclass(frozen=True)
class Begin:
    """What a worker should do with a delivery: run / done / stale / expired / exhausted / missing."""
    action: str
    attempts: int = 0
    outcome: Outcome | None = None
    last_error: str = ""
    streamed: int = 0  # run: tokens already in the request's token stream (a resume point)
    token: str = ""  # run: this claim's begin token (fences its token stream writes)
    preemptions: int = 0  # run: times it yielded its slot to an interactive request


def open_store(settings: VigilSettings, outage_grace: float = 0.0) -> "RequestStore":
    """A store on a new client of `settings`' Redis (app/state/conn.py `connect`), its calls
    riding out an outage of up to `outage_grace` seconds (a worker's VIGIL_REDIS_OUTAGE_GRACE;
    0, producers and operator tools: they fail at once). How code outside app/state/ reaches
    Redis: through the store and what it hands out, never a client of its own."""
    return RequestStore(connect(settings), settings.result_ttl, outage_grace)


def shared_store() -> "RequestStore":
    """This process's store for `get_settings()`, built on first use (producers, beat tasks)."""
    global _shared
    if _shared is None:
        _shared = open_store(get_settings())
    return _shared


_shared: "RequestStore | None" = None


class RequestStore(HoldCalls, ManyCalls, ReadCalls):
    """The request records and worker in-flight sets. Methods raise TransientError(redis_unavailable)
    when Redis cannot be reached, never a bare redis exception."""

    def __init__(self, client: redis.Redis, result_ttl: int, outage_grace: float = 0.0, *,
                 clock=time.monotonic, sleep=time.sleep):
        """`outage_grace` > 0 (workers): a call that cannot reach Redis is retried with backoff
        for up to that many seconds (a Redis restart, a failover) before it raises."""
        self._r = client
        self.result_ttl = result_ttl
        self.outage_grace = outage_grace
        self._call = Calls(client, outage_grace, clock=clock, sleep=sleep)
        # Who is alive (registry entries), kombu's queues and the job records: views under the
        # same outage policy (app/state/views.py).
        self.workers = WorkerRegistry(client, self._call)
        self.broker = BrokerView(client, self._call)
        self.jobs = JobsView(client, self._call)
        self.housekeeping = HousekeepingView(client, self._call)
        self.fleet = FleetView(client, self._call)
        self._create = client.register_script(CREATE)
        self._begin = client.register_script(BEGIN)
        self._finish = client.register_script(FINISH)
        self._finish_failed_many = client.register_script(FINISH_FAILED_MANY)
        self._release = client.register_script(RELEASE)
        self._unlock = client.register_script(UNLOCK)
        self._requeue = client.register_script(REQUEUE)
        # The same store under no grace (`without_grace`): itself when it has none.
        self._no_grace = self if outage_grace <= 0 else RequestStore(client, result_ttl)

    def create(self, request_id: str, fields: dict[str, Any], now: float | None = None, *,
               max_per_job: int = 0, max_per_pool: int = 0) -> int:
        """Write a new PENDING record and count it in its job (app/fleet/jobs.py) and its pool.
        Returns CREATED, CREATED_NEW_JOB_QUEUE (the job's queue in this pool is new: its workers
        must be told to consume it), EXISTS (nothing changed, whatever the caps), JOB_DELETED,
        or OVERLOADED_JOB / OVERLOADED_POOL: the job already has `max_per_job`, or the pool
        `max_per_pool`, open requests (0: no cap). Every refusal writes nothing; the count and
        the write are one script, so concurrent producers cannot overshoot a cap. `create_many`
        of one request."""
        return self.create_many([(request_id, fields)], time.time() if now is None else now,
                                max_per_job=max_per_job, max_per_pool=max_per_pool)[0]

    def delete(self, request_id: str) -> None:
        """Remove a record and its place in its job's and pool's pending sets (used to roll
        back a submit whose publish failed: the backpressure slot is given back)."""
        job, pool = self._call(self._r.hmget, keys.request(request_id), "job", "pool")
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(keys.request(request_id))
        pipe.zrem(keys.DEADLINES, request_id)
        if job:
            pipe.srem(keys.job_requests(job.decode()), request_id)
        if pool:
            pipe.srem(keys.pool_requests(pool.decode()), request_id)
        self._call(pipe.execute)

    def past_deadline(self, now: float, limit: int = 100) -> list[str]:
        """Up to `limit` ids of non-terminal requests whose deadline is before `now`, oldest
        deadline first (the index holds only non-terminal requests)."""
        ids = self._call(self._r.zrangebyscore, keys.DEADLINES, "-inf", now, start=0, num=limit)
        return [i.decode() for i in ids]

    def next_deadline(self) -> float | None:
        """The earliest `deadline_at` among non-terminal requests (the deadline index's head),
        None when no request is open."""
        head = self._call(self._r.zrange, keys.DEADLINES, 0, 0, withscores=True)
        return float(head[0][1]) if head else None

    @property
    def raw(self) -> redis.Redis:
        """The Redis client itself, for tests and benches that look at Redis directly (a
        witness outside the code it checks). Product code outside app/state/ never uses it: it
        goes through this store's methods and views (tests/test_layers.py)."""
        return self._r

    def without_grace(self) -> "RequestStore":
        """This store on the same client under no outage grace, whatever its own: a call that
        cannot reach Redis raises TransientError(redis_unavailable) at once. The one other
        policy, for the callers that must not wait on Redis: a worker's heartbeat (the next
        beat tries again, and a beat that failed is how it sees Redis come back) and reads made
        on the engine loop."""
        return self._no_grace

    def health_ledger(self, *, window: float, threshold: int) -> HealthLedger:
        """The health ledger (app/state/health.py) on this store's client, under this store's
        outage policy."""
        return HealthLedger(self._r, self._call, window=window, threshold=threshold)

    def batches(self) -> BatchStore:
        """The batch objects (app/state/batches.py) on this store's client, under this store's
        outage policy."""
        return BatchStore(self._r, self._call)

    def api_keys(self) -> ApiKeys:
        """The online API's keys (app/state/api_keys.py) on this store's client."""
        return ApiKeys(self._r, self._call)

    def streams(self) -> TokenStreams:
        """The token streams (app/state/streams.py) on this store's client, under this store's
        outage policy: a worker's checkpoint read or flush rides out a Redis restart as its
        record writes do (the flusher has a thread of its own; the tokens wait in the taps)."""
        return TokenStreams(self._r, self._call)

    def pool_queues(self, pool: str) -> list[str]:
        """Every queue of `pool`: its own, then one per job that has requests there (sorted)."""
        return self._call(pool_queues, self._r, pool)

    def try_lock(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take the named lock for `ttl_s` unless someone else holds it."""
        return bool(self._call(self._r.set, keys.lock(name), owner, nx=True, px=int(ttl_s * 1000)))

    def unlock(self, name: str, owner: str) -> None:
        """Release the named lock if `owner` still holds it."""
        self._call(self._unlock, keys=[keys.lock(name)], args=[owner])

    @contextmanager
    def locked(self, name: str, ttl_s: float) -> Iterator[bool]:
        """Hold the named lock (a lease of `ttl_s`, with an owner id of its own) for the block;
        yields True, or False without holding anything when someone else has it. Released on
        the way out if it is still this holder's (a lease that lapsed is not taken from its
        next holder)."""
        owner = uuid.uuid4().hex
        if not self.try_lock(name, owner, ttl_s):
            yield False
            return
        try:
            yield True
        finally:
            self.unlock(name, owner)

    def begin(self, request_id: str, dispatch: int, worker: str, instance: int, now: float,
              max_attempts: int, live_window: float = 0.0, avoid_own_failures: bool = False
              ) -> Begin:
        """Claim a delivery for this worker: mark RUNNING and count the attempt, or say why not
        ("busy": the same copy already runs here, or on a worker seen within `live_window`;
        "avoid": with `avoid_own_failures`, its last attempt failed transiently on this very
        worker, so it is given back untouched for another one)."""
        token, script_keys, args = self.begin_call(request_id, dispatch, worker, instance, now,
                                                   max_attempts, live_window,
                                                   avoid_own_failures)
        return self.begin_reply(self._call(self._begin, keys=script_keys, args=args), token)

    @staticmethod
    def begin_call(request_id: str, dispatch: int, worker: str, instance: int, now: float,
                   max_attempts: int, live_window: float = 0.0,
                   avoid_own_failures: bool = False) -> tuple[str, list[str], list]:
        """(claim token, keys, arguments) of `begin`'s script (BEGIN), for `begin` and for
        many begins on one pipeline (app/state/store_many.py)."""
        # A token per claim: a claim retried after a lost reply finds itself, not a rival.
        token = uuid.uuid4().hex
        return token, [keys.request(request_id), keys.inflight(instance), keys.STATS,
                       keys.WORKERS], [request_id, dispatch, worker, instance, now,
                                       max_attempts, keys.inflight(""), token, live_window,
                                       "1" if avoid_own_failures else "0"]

    @staticmethod
    def begin_reply(reply, token: str) -> Begin:
        """BEGIN's reply as a Begin (the claim `token` for a run)."""
        action = reply[0].decode()
        if action == "done":
            return Begin("done", outcome=Outcome.from_reply(*reply[1:5]))
        if action == "run":
            return Begin("run", attempts=int(reply[1]), streamed=int(reply[2]), token=token,
                         preemptions=int(reply[3]) if len(reply) > 3 else 0)
        if action == "exhausted":
            return Begin("exhausted", attempts=int(reply[1]), last_error=reply[2].decode())
        return Begin(action)

    def finish(self, request_id: str, instance: int, now: float, *, result: dict | None = None,
               error_kind: str = "", error: str = "",
               result_key: ResultKey | None = None) -> tuple[bool, Outcome]:
        """Set the terminal outcome once. Returns (won, stored outcome): a losing writer gets the
        outcome that was already there and the attempt is counted as a duplicate result. A
        worker instance's finish (instance not 0) also moves its registry `last_seen` to `now`,
        if it is registered. With `result_key`, a finish that wins with `result` also writes
        Celery's result key in the same script (and marks it `written`)."""
        script_keys, args = self.finish_call(request_id, instance, now, result=result,
                                             error_kind=error_kind, error=error,
                                             result_key=result_key)
        return self.finish_reply(self._call(self._finish, keys=script_keys, args=args),
                                 result=result, error_kind=error_kind, error=error,
                                 result_key=result_key)

    def finish_call(self, request_id: str, instance: int, now: float, *,
                    result: dict | None = None, error_kind: str = "", error: str = "",
                    result_key: ResultKey | None = None) -> tuple[list[str], list]:
        """The keys and arguments of `finish`'s script (FINISH), for `finish` and for many
        finishes on one pipeline (app/state/store_many.py)."""
        status = keys.SUCCEEDED if result is not None else keys.FAILED
        encoded = json.dumps(result) if result is not None else ""
        tell = result_key is not None and result is not None
        return ([keys.request(request_id), keys.inflight(instance), keys.STATS, keys.DEADLINES,
                 keys.WORKERS, *([result_key.key] if tell else [])],
                [request_id, status, encoded, error_kind, error, now, self.result_ttl,
                 keys.inflight(""), instance, keys.job_requests(""), keys.pool_requests(""),
                 *([result_key.prefix, result_key.suffix, int(result_key.expires_s)]
                   if tell else [])])

    @staticmethod
    def finish_reply(reply, *, result: dict | None, error_kind: str, error: str,
                     result_key: ResultKey | None) -> tuple[bool, Outcome]:
        """FINISH's reply as (won, stored outcome)."""
        status = keys.SUCCEEDED if result is not None else keys.FAILED
        tell = result_key is not None and result is not None
        won = bool(reply[0])
        if not won:
            return False, Outcome.from_reply(*reply[1:5])
        if tell:
            result_key.written = True
        # A won write stored what it was given: its own values, not an echo decoded again.
        return True, Outcome(status, result, error_kind, error)

    def finish_failed_many(self, request_ids: list[str], error: str, error_kind: str,
                           now: float, instance: int = 0) -> list[tuple[bool, Outcome, str]]:
        """`finish` with one error for many requests in one script call (one round trip): each
        ends FAILED with `error_kind` and `error` once, as `finish` would end it; a request
        whose pool the reconcile found unserved gets "; <its reason>" after the error. Returns
        (won, stored outcome, pool) per request, in order."""
        if not request_ids:
            return []
        reply = self._call(
            self._finish_failed_many,
            keys=[keys.STATS, keys.DEADLINES, keys.WORKERS, keys.inflight(instance)],
            args=[error_kind, error, now, self.result_ttl, keys.inflight(""), instance,
                  keys.job_requests(""), keys.pool_requests(""), keys.request(""),
                  keys.pool_state(""), *request_ids],
        )
        return [(bool(reply[i]), Outcome.from_reply(*reply[i + 1:i + 5]),
                 reply[i + 5].decode() if isinstance(reply[i + 5], bytes) else reply[i + 5])
                for i in range(0, len(reply), 6)]

    def release(self, request_id: str, instance: int, next_dispatch: int, last_error: str, *,
                now: float | None = None, refund: bool = False, pressure: bool = False,
                preempted: bool = False) -> bool:
        """Put a RUNNING request of this instance back to PENDING for a retry (dispatch bumped),
        closing its attempt 'retry' at `now` (default: the clock). With `refund`, the attempt is
        not counted against max_attempts (the request was not at fault and did not run: e.g. its
        LoRA adapter is still being written, or no engine could start for memory pressure); its
        deadline still bounds it. With `pressure`, the record keeps when the memory squeeze
        began (`pressure_since`, the first such release); any other release forgets it. With
        `preempted`, the record counts one more preemption (`preemptions`)."""
        now = time.time() if now is None else now
        return bool(self._call(
            self._release,
            keys=[keys.request(request_id), keys.inflight(instance)],
            args=[request_id, instance, next_dispatch, last_error, now, "1" if refund else "0",
                  "1" if pressure else "0", "1" if preempted else "0"],
        ))
