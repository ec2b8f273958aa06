"""Vigil's request state in Redis: the record, the in-flight sets, the set-once result.

Every multi-step change is one Lua script, so a crash between steps cannot leave a record half
updated, and two writers of a result cannot both win.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from app import keys, redis_conn
from app.errors import REDIS_UNAVAILABLE, TransientError
from app.settings import VigilSettings

# RequestStore.create outcomes
JOB_DELETED = -1
# Refused by backpressure (nothing written): the job's, or the pool's, open requests are at
# their cap (VIGIL_MAX_PENDING_PER_JOB / _PER_POOL).
OVERLOADED_JOB = -2
OVERLOADED_POOL = -3
EXISTS = 0
CREATED = 1
CREATED_NEW_JOB_QUEUE = 2

# Connections beyond one per task thread: heartbeat, signal handlers, producers in the process.
REDIS_POOL_HEADROOM = 16
# The most attempts a record's `history` keeps (the oldest are dropped past it). Attempts are
# bounded by max_attempts anyway; this only bounds the field whatever the settings.
HISTORY_MAX = 32

# Lua helpers for the record's `history` field, prepended to the scripts that change it: a JSON
# list (cjson) of one entry per attempt, {attempt, dispatch, worker, instance (a string: cjson
# would turn a 63-bit id into a float), started_at, ended_at, outcome, error}. An entry is open
# while its outcome is null. error_code mirrors VigilError.code: the text before the first ':'
# ('unknown' without one), null for no error.
_HISTORY_LUA = """
local function error_code(err)
  if not err or err == '' then return cjson.null end
  local i = string.find(err, ':', 1, true)
  if not i then return 'unknown' end
  return string.match(string.sub(err, 1, i - 1), '^%s*(.-)%s*$')
end
local function read_history(rec)
  local raw = redis.call('HGET', rec, 'history')
  if not raw then return {} end
  return cjson.decode(raw)
end
local function write_history(rec, h)
  while #h > """ + str(HISTORY_MAX) + """ do table.remove(h, 1) end
  redis.call('HSET', rec, 'history', cjson.encode(h))
end
-- Close the attempt `instance` has open (its latest), else the last entry if it is open; an
-- attempt is never invented when none is open (e.g. a PENDING request failed by the sweeper).
local function close_attempt(rec, instance, now, outcome, err)
  local h = read_history(rec)
  local pick = nil
  for i = #h, 1, -1 do
    if h[i].outcome == cjson.null and h[i].instance == instance then pick = i break end
  end
  if not pick and #h > 0 and h[#h].outcome == cjson.null then pick = #h end
  if not pick then return end
  h[pick].ended_at = tonumber(now)
  h[pick].outcome = outcome
  h[pick].error = error_code(err)
  write_history(rec, h)
end
"""

# KEYS[1] record, KEYS[2] deadline index, KEYS[3] job hash, KEYS[4] job's pending set,
# KEYS[5] pool's job set, KEYS[6] jobs zset, KEYS[7] pool's pending set. ARGV: request_id,
# deadline_at, job, now, own_queue (1: the job has its own queue in the pool), max pending per
# job, max pending per pool (0 = no cap), field, value, ...
# -> 1 created, 2 created and the job's queue is new in this pool, 0 already there (never
# overwritten), -1 the job was deleted, -2 / -3 the job's / pool's pending set is at its cap
# (nothing written for any negative answer).
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('HGET', KEYS[3], 'state') == 'deleted' then return -1 end
local max_job, max_pool = tonumber(ARGV[6]), tonumber(ARGV[7])
if max_job > 0 and redis.call('SCARD', KEYS[4]) >= max_job then return -2 end
if max_pool > 0 and redis.call('SCARD', KEYS[7]) >= max_pool then return -3 end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HSETNX', KEYS[3], 'created_at', ARGV[4])
redis.call('HSET', KEYS[3], 'name', ARGV[3], 'last_active', ARGV[4])
redis.call('ZADD', KEYS[6], ARGV[4], ARGV[3])
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('SADD', KEYS[7], ARGV[1])
if ARGV[5] == '1' and redis.call('SADD', KEYS[5], ARGV[3]) == 1 then return 2 end
return 1
"""

# KEYS[1] record, KEYS[2] inflight set of this instance, KEYS[3] stats.
# ARGV: request_id, dispatch, worker, instance, now, max_attempts, inflight key prefix.
# The request leaves its previous holder's in-flight set (a worker keeps a request it released
# for a retry there until someone begins it: see _RELEASE). A run appends an open attempt to
# `history`.
# -> {'missing'} | {'done', status, result, error_kind, error} | {'stale', dispatch}
#  | {'expired'} | {'exhausted', attempts, last_error} | {'run', attempts}
_BEGIN = _HISTORY_LUA + """
local rec = KEYS[1]
local st = redis.call('HGET', rec, 'status')
if not st then return {'missing'} end
if st == 'SUCCEEDED' or st == 'FAILED' then
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'duplicate_deliveries', 1)
  local f = redis.call('HMGET', rec, 'result', 'error_kind', 'error')
  return {'done', st, f[1] or '', f[2] or '', f[3] or ''}
end
local current = tonumber(redis.call('HGET', rec, 'dispatch') or '0')
local dispatch = tonumber(ARGV[2])
if dispatch < current then
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[3], 'stale_deliveries', 1)
  return {'stale', tostring(current)}
end
local deadline = tonumber(redis.call('HGET', rec, 'deadline_at') or '0')
if deadline > 0 and tonumber(ARGV[5]) > deadline then return {'expired'} end
local attempts = tonumber(redis.call('HGET', rec, 'attempts') or '0')
if attempts >= tonumber(ARGV[6]) then
  return {'exhausted', tostring(attempts), redis.call('HGET', rec, 'last_error') or ''}
end
attempts = attempts + 1
local prev = redis.call('HGET', rec, 'instance')
if prev and prev ~= ARGV[4] then redis.call('SREM', ARGV[7] .. prev, ARGV[1]) end
redis.call('HSET', rec, 'status', 'RUNNING', 'attempts', attempts, 'dispatch', dispatch,
           'worker', ARGV[3], 'instance', ARGV[4], 'started_at', ARGV[5])
local h = read_history(rec)
h[#h + 1] = {attempt = attempts, dispatch = dispatch, worker = ARGV[3], instance = ARGV[4],
             started_at = tonumber(ARGV[5]), ended_at = cjson.null, outcome = cjson.null,
             error = cjson.null}
write_history(rec, h)
redis.call('SADD', KEYS[2], ARGV[1])
return {'run', tostring(attempts)}
"""

# KEYS[1] record, KEYS[2] inflight set of the finishing instance, KEYS[3] stats,
# KEYS[4] deadline index. ARGV: request_id, status, result, error_kind, error, now, ttl,
# inflight key prefix (to drop the id from its owner's set too: the sweeper finishes requests
# that a worker holds), finishing instance, job and pool pending-set prefixes.
# -> {1, status, result, error_kind, error} when this write won, {0, ...stored} when it lost.
# Only a winning write closes an attempt in `history` (the finisher's open one, else the last if
# open) as succeeded / failed.
_FINISH = _HISTORY_LUA + """
local rec = KEYS[1]
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
local owner = redis.call('HGET', rec, 'instance')
if owner then redis.call('SREM', ARGV[8] .. owner, ARGV[1]) end
local job = redis.call('HGET', rec, 'job')
if job then redis.call('SREM', ARGV[10] .. job, ARGV[1]) end
local pool = redis.call('HGET', rec, 'pool')
if pool then redis.call('SREM', ARGV[11] .. pool, ARGV[1]) end
local st = redis.call('HGET', rec, 'status')
if st == 'SUCCEEDED' or st == 'FAILED' then
  redis.call('HINCRBY', KEYS[3], 'duplicate_results', 1)
  local f = redis.call('HMGET', rec, 'result', 'error_kind', 'error')
  return {0, st, f[1] or '', f[2] or '', f[3] or ''}
end
redis.call('HSET', rec, 'status', ARGV[2], 'result', ARGV[3], 'error_kind', ARGV[4],
           'error', ARGV[5], 'finished_at', ARGV[6])
close_attempt(rec, ARGV[9], ARGV[6], ARGV[2] == 'SUCCEEDED' and 'succeeded' or 'failed',
              ARGV[5])
redis.call('EXPIRE', rec, tonumber(ARGV[7]))
return {1, ARGV[2], ARGV[3], ARGV[4], ARGV[5]}
"""

# KEYS[1] record, KEYS[2] inflight set. ARGV: request_id, instance, next_dispatch, last_error,
# now. Hands a RUNNING request back to the queue for a retry, closing its attempt in `history`
# (outcome 'retry', the code of last_error); a no-op (0) if it is no longer ours.
# The id stays in this worker's in-flight set: the retry's message is an ETA message that this
# worker's consumer holds unacked until it is due, so if the worker dies now the reaper must
# still find the request (the next _BEGIN, anywhere, removes it from the set).
_RELEASE = _HISTORY_LUA + """
if redis.call('HGET', KEYS[1], 'status') ~= 'RUNNING' then
  redis.call('SREM', KEYS[2], ARGV[1])
  return 0
end
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'PENDING', 'dispatch', ARGV[3], 'last_error', ARGV[4])
if ARGV[6] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', -1) end
close_attempt(KEYS[1], ARGV[2], ARGV[5], 'retry', ARGV[4])
return 1
"""


# KEYS[1] record, KEYS[2] inflight set of the dead instance. ARGV: request_id, dead instance,
# new dispatch, now. Hands a dead worker's request (RUNNING under it, or PENDING: received but
# not begun, or released for a retry whose ETA message it held) back to PENDING under a newer
# dispatch (the caller then publishes that dispatch's message: a refused requeue publishes
# nothing); a no-op (0) if the request is terminal or no longer the dead worker's. An attempt
# still open in `history` is closed 'requeued' with error worker_lost.
_REQUEUE = _HISTORY_LUA + """
redis.call('SREM', KEYS[2], ARGV[1])
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'RUNNING' and st ~= 'PENDING' then return 0 end
if st == 'RUNNING' and redis.call('HGET', KEYS[1], 'instance') ~= ARGV[2] then return 0 end
local d = tonumber(redis.call('HGET', KEYS[1], 'dispatch') or '0')
if tonumber(ARGV[3]) > d then d = tonumber(ARGV[3]) end
local lost = 'worker_lost: its worker stopped heartbeating and was reaped'
redis.call('HSET', KEYS[1], 'status', 'PENDING', 'dispatch', d, 'last_error', lost)
close_attempt(KEYS[1], ARGV[2], ARGV[4], 'requeued', lost)
return 1
"""

# KEYS[1] lock. ARGV: owner. Deletes the lock only if this owner still holds it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Outcome:
    """A terminal outcome as stored: status SUCCEEDED with `result`, or FAILED with an error."""

    status: str
    result: dict[str, Any] | None
    error_kind: str
    error: str

    @classmethod
    def from_reply(cls, status, result, error_kind, error) -> "Outcome":
        def s(x):
            return x.decode() if isinstance(x, bytes) else (x or "")

        res = s(result)
        return cls(s(status), json.loads(res) if res else None, s(error_kind), s(error))


@dataclass(frozen=True)
class Begin:
    """What a worker should do with a delivery: run / done / stale / expired / exhausted / missing."""

    action: str
    attempts: int = 0
    outcome: Outcome | None = None
    last_error: str = ""


def connect(settings: VigilSettings) -> redis.Redis:
    """A Redis client for Vigil's state with bounded timeouts (an unreachable Redis fails fast).

    The pool blocks (up to redis_timeout) instead of failing when every connection is busy:
    redis-py's default pool raises "Too many connections" past 100, and a worker's whole batch
    of task threads finishes in the same engine step.
    """
    # Any URL shape (password, TLS, Sentinel) goes through the one builder the broker and
    # backend options come from (app/redis_conn.py).
    pool = redis_conn.state_pool(
        settings,
        max_connections=settings.worker_concurrency + REDIS_POOL_HEADROOM,
        socket_timeout=settings.redis_timeout,
        socket_connect_timeout=settings.redis_timeout,
        health_check_interval=30,
    )
    return redis.Redis(connection_pool=pool)


def shared_store() -> "RequestStore":
    """This process's store for `get_settings()`, built on first use (producers, beat tasks)."""
    global _shared
    if _shared is None:
        from app.settings import get_settings

        s = get_settings()
        _shared = RequestStore(connect(s), s.result_ttl)
    return _shared


_shared: "RequestStore | None" = None


class RequestStore:
    """The request records and worker in-flight sets. Methods raise TransientError(redis_unavailable)
    when Redis cannot be reached, never a bare redis exception."""

    def __init__(self, client: redis.Redis, result_ttl: int):
        self.r = client
        self.result_ttl = result_ttl
        self._create = client.register_script(_CREATE)
        self._begin = client.register_script(_BEGIN)
        self._finish = client.register_script(_FINISH)
        self._release = client.register_script(_RELEASE)
        self._unlock = client.register_script(_UNLOCK)
        self._requeue = client.register_script(_REQUEUE)

    def _call(self, fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except redis.AuthenticationError as e:  # a wrong password in VIGIL_REDIS_URL
            raise TransientError.of(REDIS_UNAVAILABLE, "Redis refused the credentials of "
                                    f"VIGIL_REDIS_URL ({e})") from None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise TransientError.of(REDIS_UNAVAILABLE, f"cannot reach Redis: {e}") from None

    def create(self, request_id: str, fields: dict[str, Any], now: float | None = None, *,
               max_per_job: int = 0, max_per_pool: int = 0) -> int:
        """Write a new PENDING record and count it in its job (app/jobs.py) and its pool.
        Returns CREATED, CREATED_NEW_JOB_QUEUE (the job's queue in this pool is new: its workers
        must be told to consume it), EXISTS (nothing changed, whatever the caps), JOB_DELETED,
        or OVERLOADED_JOB / OVERLOADED_POOL: the job already has `max_per_job`, or the pool
        `max_per_pool`, open requests (0: no cap). Every refusal writes nothing; the count and
        the write are one script, so concurrent producers cannot overshoot a cap."""
        from app.jobs import DEFAULT_JOB

        job = str(fields.get("job", DEFAULT_JOB))
        pool = str(fields.get("pool", fields.get("model", "")))
        now = time.time() if now is None else now
        flat: list[Any] = [request_id, fields.get("deadline_at", "+inf"), job, now,
                           "0" if job == DEFAULT_JOB else "1", max_per_job, max_per_pool]
        for k, v in fields.items():
            flat += [k, v if isinstance(v, (str, bytes, int, float)) else json.dumps(v)]
        return int(self._call(self._create, keys=[
            keys.request(request_id), keys.DEADLINES, keys.job(job), keys.job_requests(job),
            keys.pool_jobs(pool), keys.JOBS, keys.pool_requests(pool)], args=flat))

    def delete(self, request_id: str) -> None:
        """Remove a record and its place in its job's and pool's pending sets (used to roll
        back a submit whose publish failed: the backpressure slot is given back)."""
        job, pool = self._call(self.r.hmget, keys.request(request_id), "job", "pool")
        pipe = self.r.pipeline(transaction=True)
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
        ids = self._call(self.r.zrangebyscore, keys.DEADLINES, "-inf", now, start=0, num=limit)
        return [i.decode() for i in ids]

    def hold(self, request_id: str, instance: int | str) -> None:
        """Note that this worker instance holds a request's message (received, not yet begun),
        so the reaper finds it if the worker dies before running it."""
        self._call(self.r.sadd, keys.inflight(instance), request_id)

    def requeue(self, request_id: str, dead_instance: int | str, dispatch: int, *,
                now: float | None = None) -> bool:
        """Mark a dead worker's RUNNING request PENDING under `dispatch` (then publish that
        dispatch's message), closing its open attempt 'requeued' at `now` (default: the clock).
        False when it had already ended or moved on."""
        now = time.time() if now is None else now
        return bool(self._call(self._requeue,
                               keys=[keys.request(request_id), keys.inflight(dead_instance)],
                               args=[request_id, dead_instance, dispatch, now]))

    def silent_workers(self, before: float, limit: int = 100, start: int = 0
                       ) -> list[tuple[str, float, bool]]:
        """Up to `limit` workers whose last heartbeat is older than `before`, least recently
        seen first, skipping the first `start`: (instance id, last_seen, has_pinged). An entry
        whose hash is gone or predates has_pinged counts as pinged (judged by the reap timeout).
        Two round trips whatever `limit`."""
        rows = self._call(self.r.zrangebyscore, keys.WORKERS, "-inf", before, start=start,
                          num=limit, withscores=True)
        pipe = self.r.pipeline(transaction=False)
        for inst, _ in rows:
            pipe.hget(keys.worker(inst.decode()), "has_pinged")
        flags = self._call(pipe.execute) if rows else []
        return [(inst.decode(), float(seen), flag != b"0")
                for (inst, seen), flag in zip(rows, flags)]

    def inflight_ids(self, instance: int | str) -> list[str]:
        """A worker instance's in-flight request ids (bounded by its concurrency)."""
        return [r.decode() for r in self._call(self.r.smembers, keys.inflight(instance))]

    def worker_name(self, instance: int | str) -> str:
        """The Celery node name a worker instance registered with ('' if unknown)."""
        name = self._call(self.r.hget, keys.worker(instance), "name")
        return name.decode() if name else ""

    def drop_worker(self, instance: int | str) -> None:
        """Remove a worker instance's registry entry, in-flight set and health ledger."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.worker(instance), keys.inflight(instance), keys.health(instance))
        pipe.zrem(keys.WORKERS, str(instance))
        self._call(pipe.execute)

    def try_lock(self, name: str, owner: str, ttl_s: float) -> bool:
        """Take the named lock for `ttl_s` unless someone else holds it."""
        return bool(self._call(self.r.set, keys.lock(name), owner, nx=True, px=int(ttl_s * 1000)))

    def unlock(self, name: str, owner: str) -> None:
        """Release the named lock if `owner` still holds it."""
        self._call(self._unlock, keys=[keys.lock(name)], args=[owner])

    def begin(self, request_id: str, dispatch: int, worker: str, instance: int, now: float,
              max_attempts: int) -> Begin:
        """Claim a delivery for this worker: mark RUNNING and count the attempt, or say why not."""
        reply = self._call(
            self._begin,
            keys=[keys.request(request_id), keys.inflight(instance), keys.STATS],
            args=[request_id, dispatch, worker, instance, now, max_attempts, keys.inflight("")],
        )
        action = reply[0].decode()
        if action == "done":
            return Begin("done", outcome=Outcome.from_reply(*reply[1:5]))
        if action == "run":
            return Begin("run", attempts=int(reply[1]))
        if action == "exhausted":
            return Begin("exhausted", attempts=int(reply[1]), last_error=reply[2].decode())
        return Begin(action)

    def finish(self, request_id: str, instance: int, now: float, *, result: dict | None = None,
               error_kind: str = "", error: str = "") -> tuple[bool, Outcome]:
        """Set the terminal outcome once. Returns (won, stored outcome): a losing writer gets the
        outcome that was already there and the attempt is counted as a duplicate result."""
        status = keys.SUCCEEDED if result is not None else keys.FAILED
        reply = self._call(
            self._finish,
            keys=[keys.request(request_id), keys.inflight(instance), keys.STATS, keys.DEADLINES],
            args=[request_id, status, json.dumps(result) if result is not None else "",
                  error_kind, error, now, self.result_ttl, keys.inflight(""), instance,
                  keys.job_requests(""), keys.pool_requests("")],
        )
        return bool(reply[0]), Outcome.from_reply(*reply[1:5])

    def release(self, request_id: str, instance: int, next_dispatch: int, last_error: str, *,
                now: float | None = None, refund: bool = False) -> bool:
        """Put a RUNNING request of this instance back to PENDING for a retry (dispatch bumped),
        closing its attempt 'retry' at `now` (default: the clock). With `refund`, the attempt is
        not counted against max_attempts (the request was not at fault and did not run: e.g. its
        LoRA adapter is still being written); its deadline still bounds it."""
        now = time.time() if now is None else now
        return bool(self._call(
            self._release,
            keys=[keys.request(request_id), keys.inflight(instance)],
            args=[request_id, instance, next_dispatch, last_error, now, "1" if refund else "0"],
        ))

    def get(self, request_id: str) -> dict[str, str] | None:
        """The record as a str->str dict, or None if there is none."""
        raw = self._call(self.r.hgetall, keys.request(request_id))
        if not raw:
            return None
        return {k.decode(): v.decode() for k, v in raw.items()}

    def history(self, request_id: str) -> list[dict[str, Any]]:
        """Every attempt of a request, oldest first (at most HISTORY_MAX, the newest kept), as
        recorded atomically by begin / release / requeue / finish: one dict per attempt begun,
        {"attempt": int, "dispatch": int, "worker": node name, "instance": instance id as a str,
        "started_at": float, "ended_at": float or None, "outcome": None while open, else
        "succeeded" | "failed" | "retry" | "requeued", "error": the error's code or None}.
        Times carry cjson's 14 significant digits (0.1 ms for current Unix times). [] when the
        request has no record or was never begun. An attempt that ended unobserved (its copy
        superseded by another worker's, or its result losing to an earlier one) stays open."""
        raw = self._call(self.r.hget, keys.request(request_id), "history")
        if not raw:
            return []
        parsed = json.loads(raw)
        return parsed if isinstance(parsed, list) else []  # cjson writes an empty list as {}

    def stats(self) -> dict[str, int]:
        """Fleet counters (duplicate_results, duplicate_deliveries, stale_deliveries)."""
        raw = self._call(self.r.hgetall, keys.STATS)
        return {k.decode(): int(v) for k, v in raw.items()}
