"""Many requests' state changes in one round trip each: what a message carrying many requests
needs (tasks.inference `generate_many`, workers/service.py; submit: app/requests/
submit.py).

The same Lua scripts as one request's (app/state/lua_records.py: BEGIN, FINISH), queued on one
pipeline, and CREATE's loop over a run of many: each request's change is as atomic and as
set-once as alone, and a pipeline sent again after a lost reply is harmless (each script finds
its own change). A mixin of `RequestStore` (app/state/store.py), which holds the scripts and
the outage policy.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from redis.exceptions import NoScriptError

from app.state import keys
from app.state.queues import DEFAULT_JOB
from app.state.results import ResultKey

# The most requests one CREATE call creates: Redis runs a script alone, so a call of
# thousands would hold every other client (a worker's BEGIN, a result's write) for its length.
CREATE_RUN = 256


class ManyCalls:
    """`create_many`, `begin_many`, `finish_many` (module docstring). Needs RequestStore's
    `begin_call`/`begin_reply`, `finish_call`/`finish_reply`, its scripts and
    `_call`."""

    def create_many(self, items: list[tuple[str, dict[str, Any]]], now: float, *,
                    max_per_job: int = 0, max_per_pool: int = 0,
                    ahead: Counter | None = None) -> list[int]:
        """`create` for each (request id, record fields), in one round trip; the answers in
        order (CREATED, CREATED_NEW_JOB_QUEUE, EXISTS, JOB_DELETED, OVERLOADED_*), each request
        under the caps as if created alone, in this order. `ahead` counts requests the caller
        will write after these, by job and by pool (`ahead_of`): they are counted as open
        already against the caps, so a call written in parts is refused in its first part when
        the whole of it would take a job or a pool past its cap. Consecutive requests of one
        job and pool go as one CREATE call (up to CREATE_RUN of them), each request's fields
        as one argument."""
        calls, ahead = [], ahead or Counter()
        for start, end, job, pool in _runs(items):
            args: list[Any] = [job, now, "0" if job == DEFAULT_JOB else "1", max_per_job,
                               max_per_pool, keys.request(""), ahead[("job", job)],
                               ahead[("pool", pool)]]
            for rid, fields in items[start:end]:
                args += [rid, fields.get("deadline_at", "+inf"), _fields_json(fields)]
            calls.append((self._create, [
                keys.DEADLINES, keys.job(job), keys.job_requests(job), keys.pool_jobs(pool),
                keys.JOBS, keys.pool_requests(pool)], args))
        return [int(x) for answers in self._pipelined(calls) for x in answers]

    def begin_many(self, deliveries: list[tuple[str, int]], worker: str, instance: int,
                   now: float, max_attempts: int, live_window: float = 0.0):
        """`begin` for each (request id, dispatch), in one round trip; the Begins in order."""
        calls, tokens = [], []
        for rid, dispatch in deliveries:
            token, script_keys, args = self.begin_call(rid, dispatch, worker, instance, now,
                                                       max_attempts, live_window)
            tokens.append(token)
            calls.append((self._begin, script_keys, args))
        return [self.begin_reply(reply, token)
                for reply, token in zip(self._pipelined(calls), tokens)]

    def finish_many(self, results: list[tuple[str, dict, ResultKey | None]], instance: int,
                    now: float) -> list:
        """`finish` with a result for each (request id, result, Celery's result key or None),
        in one round trip; (won, stored outcome) per request, in order."""
        calls = []
        for rid, result, key in results:
            script_keys, args = self.finish_call(rid, instance, now, result=result,
                                                 result_key=key)
            calls.append((self._finish, script_keys, args))
        return [self.finish_reply(reply, result=result, error_kind="", error="",
                                  result_key=key)
                for reply, (_, result, key) in zip(self._pipelined(calls), results)]

    def _pipelined(self, calls: list[tuple[Any, list, list]]) -> list:
        """Each (registered script, keys, args) as one EVALSHA, all on one pipeline: one round
        trip, the replies in order. redis-py's own way (a script called on a pipeline) asks
        Redis whether it holds the scripts (SCRIPT EXISTS) before every execute, a second round
        trip; here a script Redis does not hold (its script cache emptied by a restart) answers
        NOSCRIPT, having run nothing, and only those calls are sent again once it is loaded.
        Raises the first error any call got, as a pipeline does."""
        replies: list = [None] * len(calls)
        todo = list(range(len(calls)))
        for last in (False, True):
            pipe = self._call.pipeline()
            for i in todo:
                script, script_keys, args = calls[i]
                pipe.evalsha(script.sha, len(script_keys), *script_keys, *args)
            got = self._call(pipe.execute, raise_on_error=False)
            for i, reply in zip(todo, got):
                replies[i] = reply
            todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
            if not todo or last:
                break
            for script in {id(calls[i][0]): calls[i][0] for i in todo}.values():
                self._call(self._call.client.script_load, script.script)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies


def ahead_of(items: list[tuple[Any, dict[str, Any]]]) -> Counter:
    """How many of `items` (request id, record fields) each job and each pool holds: keys
    ("job", name) and ("pool", name), what `create_many`'s `ahead` takes."""
    counts: Counter = Counter()
    for _, fields in items:
        job, pool = job_and_pool(fields)
        counts[("job", job)] += 1
        counts[("pool", pool)] += 1
    return counts


def job_and_pool(fields: dict[str, Any]) -> tuple[str, str]:
    """The job and the pool a record's fields name (the pool defaults to the model)."""
    return str(fields.get("job", DEFAULT_JOB)), str(fields.get("pool", fields.get("model", "")))


def _runs(items: list[tuple[str, dict[str, Any]]]):
    """(start, end, job, pool) of each run of consecutive `items` of one job and pool, at most
    CREATE_RUN long."""
    start = 0
    while start < len(items):
        job, pool = job_and_pool(items[start][1])
        end = start + 1
        while (end < len(items) and end - start < CREATE_RUN
               and job_and_pool(items[end][1]) == (job, pool)):
            end += 1
        yield start, end, job, pool
        start = end


def _fields_json(fields: dict[str, Any]) -> str:
    """A record's fields as CREATE takes them: a JSON array field, value, ..., each value the
    string redis-py would send for it (a number's repr), a value of another type (a list, a
    dict) as JSON."""
    flat: list[str] = []
    for k, v in fields.items():
        if isinstance(v, str):
            flat += [k, v]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            flat += [k, repr(v)]
        elif isinstance(v, bytes):
            flat += [k, v.decode()]
        else:
            flat += [k, json.dumps(v)]
    return json.dumps(flat, ensure_ascii=False)
