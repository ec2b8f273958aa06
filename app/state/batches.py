"""Batch objects and their files, in Redis (app/state/keys.py has every key).

A file uploaded for a batch is kept as a list of its raw lines (line ends included), so a batch
reads it in chunks and a download gives back the same bytes. A batch is a hash of the fields of
OpenAI's Batch object plus Vigil's own (the job it runs as, the next line to submit, the lines
in flight); its results are two lists of output lines (successes, errors). What the lifecycle
means is app/fleet/batches.py; this module only reads and writes, and every change that must
happen once (a line's result) is one Lua script. Calls raise TransientError(redis_unavailable)
when Redis cannot be reached.
"""
from __future__ import annotations

import json

import redis

from app.state import keys
from app.state.calls import Calls, decoded
from app.state.lua_batches import BATCH_RECORD
from app.state.views import HousekeepingView

# Lines are written and read in chunks of this many (one round trip each).
CHUNK = 1000



class BatchStore:
    """Reads and writes batch objects, their input files and their results."""

    def __init__(self, client: redis.Redis, calls: Calls | None = None):
        self.r = client
        self._call = calls or Calls(client)
        self._record = client.register_script(BATCH_RECORD)
        # When the batch tick (and every other housekeeping task) last ran.
        self.housekeeping = HousekeepingView(client, self._call)

    # -- files -----------------------------------------------------------------------------
    def put_file(self, file_id: str, meta: dict, lines: list[bytes], ttl_s: float) -> None:
        """Store an uploaded file: its metadata hash and its lines, both expiring after
        `ttl_s` unless a batch extends them. The lines go first: a file whose metadata exists
        is complete."""
        key = keys.file_lines(file_id)
        for i in range(0, len(lines), CHUNK):
            pipe = self._call.pipeline()
            pipe.rpush(key, *lines[i:i + CHUNK])
            pipe.expire(key, int(ttl_s))
            self._call(pipe.execute)
        pipe = self._call.pipeline(transaction=True)
        pipe.hset(keys.file(file_id), mapping=meta)
        pipe.expire(keys.file(file_id), int(ttl_s))
        pipe.zadd(keys.FILES, {file_id: float(meta["created_at"])})
        self._call(pipe.execute)

    def file(self, file_id: str) -> dict[str, str] | None:
        """A file's metadata, or None when there is no such file (or it expired)."""
        raw = self._call(self.r.hgetall, keys.file(file_id))
        return decoded(raw) if raw else None

    def put_file_meta(self, file_id: str, meta: dict, ttl_s: float | None) -> None:
        """Write an output file's metadata (its content is a batch's result list); kept for
        `ttl_s`, or for as long as its batch when None."""
        pipe = self._call.pipeline(transaction=True)
        pipe.hset(keys.file(file_id), mapping=meta)
        if ttl_s is not None:
            pipe.expire(keys.file(file_id), int(ttl_s))
        pipe.zadd(keys.FILES, {file_id: float(meta["created_at"])})
        self._call(pipe.execute)

    def file_ids(self) -> list[str]:
        """Every file id (newest first); ids whose file expired are dropped from the index."""
        ids = [i.decode() for i in self._call(self.r.zrevrange, keys.FILES, 0, -1)]
        return self._live(ids, keys.file, keys.FILES)

    def delete_file(self, file_id: str) -> bool:
        """Delete an uploaded file; False when there was none."""
        pipe = self._call.pipeline(transaction=True)
        pipe.delete(keys.file(file_id), keys.file_lines(file_id))
        pipe.zrem(keys.FILES, file_id)
        return bool(self._call(pipe.execute)[0])

    def file_line_count(self, file_id: str) -> int:
        """How many lines an uploaded file has."""
        return int(self._call(self.r.llen, keys.file_lines(file_id)))

    def file_lines(self, file_id: str, start: int, count: int) -> list[bytes]:
        """Lines `start` .. `start + count - 1` of an uploaded file (fewer at its end)."""
        return self._call(self.r.lrange, keys.file_lines(file_id), start, start + count - 1)

    def keep_file(self, file_id: str, ttl_s: float) -> None:
        """Make an uploaded file last at least `ttl_s` more (a batch reads it)."""
        pipe = self._call.pipeline()
        for key in (keys.file(file_id), keys.file_lines(file_id)):
            pipe.expire(key, int(ttl_s), gt=True)
        self._call(pipe.execute)

    def results(self, batch_id: str, errors: bool, start: int, count: int) -> list[bytes]:
        """Output lines `start` .. of a batch (its error lines with `errors`)."""
        key = keys.batch_errors(batch_id) if errors else keys.batch_output(batch_id)
        return self._call(self.r.lrange, key, start, start + count - 1)

    # -- batches ---------------------------------------------------------------------------
    def create(self, batch_id: str, fields: dict, active: bool, job: str | None = None) -> None:
        """Write a new batch; `active` ones are walked by the batch tick; with `job`, it becomes
        the batch that job name finds (`for_job`)."""
        pipe = self._call.pipeline(transaction=True)
        pipe.hset(keys.batch(batch_id), mapping=fields)
        if job is not None:
            pipe.set(keys.batch_job(job), batch_id)
        pipe.zadd(keys.BATCHES, {batch_id: float(fields["created_at"])})
        if active:
            pipe.zadd(keys.BATCHES_ACTIVE, {batch_id: float(fields["created_at"])})
        self._call(pipe.execute)

    def for_job(self, job: str) -> str | None:
        """The id of the last batch created under the job name `job`, if it is still kept."""
        raw = self._call(self.r.get, keys.batch_job(job))
        return raw.decode() if raw else None

    def recorded(self, batch_id: str, lines: list[int]) -> set[int]:
        """Those of the line numbers whose result is recorded."""
        if not lines:
            return set()
        got = self._call(self.r.hmget, keys.batch_done(batch_id), lines)
        return {n for n, v in zip(lines, got) if v is not None}

    def get(self, batch_id: str) -> dict[str, str] | None:
        """A batch's hash, or None when there is no such batch (or it expired)."""
        raw = self._call(self.r.hgetall, keys.batch(batch_id))
        return decoded(raw) if raw else None

    def update(self, batch_id: str, fields: dict) -> None:
        """Set some fields of an existing batch."""
        self._call(self.r.hset, keys.batch(batch_id), mapping=fields)

    def set_status_if(self, batch_id: str, allowed: tuple[str, ...], fields: dict) -> bool:
        """Set `fields` (a new status among them) only if the batch's status is one of
        `allowed`, atomically (WATCH); False when it was not."""
        key = keys.batch(batch_id)

        def change(pipe) -> bool:
            status = pipe.hget(key, "status")
            if status is None or status.decode() not in allowed:
                return False
            pipe.multi()
            pipe.hset(key, mapping=fields)
            return True

        return self._call(self.r.transaction, change, key, value_from_callable=True)

    def forget_active(self, batch_id: str) -> None:
        """Take a batch whose hash is gone (deleted by hand) off the active set."""
        self._call(self.r.zrem, keys.BATCHES_ACTIVE, batch_id)

    def active_ids(self) -> list[str]:
        """The batches not ended yet, oldest first."""
        return [i.decode() for i in self._call(self.r.zrange, keys.BATCHES_ACTIVE, 0, -1)]

    def batch_ids(self, limit: int, after: str | None = None) -> list[str]:
        """Up to `limit` batch ids, newest first, starting after `after` (an id) if given;
        ids whose batch expired are dropped from the index."""
        start = 0
        if after is not None:
            rank = self._call(self.r.zrevrank, keys.BATCHES, after)
            if rank is None:
                return []
            start = rank + 1
        ids = [i.decode() for i in self._call(self.r.zrevrange, keys.BATCHES, start,
                                              start + limit - 1)]
        return self._live(ids, keys.batch, keys.BATCHES)

    def _live(self, ids: list[str], key_of, index: str) -> list[str]:
        pipe = self._call.pipeline()
        for i in ids:
            pipe.exists(key_of(i))
        alive = self._call(pipe.execute) if ids else []
        gone = [i for i, a in zip(ids, alive) if not a]
        if gone:
            self._call(self.r.zrem, index, *gone)
        return [i for i, a in zip(ids, alive) if a]

    def inflight(self, batch_id: str) -> dict[str, dict]:
        """The batch's requests in flight: request id -> {"n": line number, "c": custom_id,
        "k": kind}."""
        raw = self._call(self.r.hgetall, keys.batch_inflight(batch_id))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def add_inflight(self, batch_id: str, entries: dict[str, dict], cursor: int) -> None:
        """Note submitted requests as in flight and move the submit cursor past them, in one
        step."""
        pipe = self._call.pipeline(transaction=True)
        if entries:
            pipe.hset(keys.batch_inflight(batch_id),
                      mapping={rid: json.dumps(e) for rid, e in entries.items()})
        pipe.hset(keys.batch(batch_id), "cursor", cursor)
        self._call(pipe.execute)

    def record(self, batch_id: str, outcomes: list[tuple[int, bool, str, str]]) -> int:
        """Record finished lines once each: (line number, ok, output line, request id or "").
        Returns how many were new."""
        if not outcomes:
            return 0
        args: list = []
        for n, ok, line, rid in outcomes:
            args += [n, "o" if ok else "e", line, rid]
        k = [keys.batch(batch_id), keys.batch_done(batch_id), keys.batch_output(batch_id),
             keys.batch_errors(batch_id), keys.batch_inflight(batch_id)]
        return int(self._call(self._record, keys=k, args=args))

    def close(self, batch_id: str, fields: dict, ttl_s: float, job: str | None = None) -> None:
        """End a batch: write its last fields, take it off the active set, and let its keys
        (and its job name's pointer to it, `job`) expire after `ttl_s`."""
        pipe = self._call.pipeline(transaction=True)
        pipe.hset(keys.batch(batch_id), mapping=fields)
        pipe.zrem(keys.BATCHES_ACTIVE, batch_id)
        pipe.delete(keys.batch_inflight(batch_id))
        for key in (keys.batch(batch_id), keys.batch_done(batch_id),
                    keys.batch_output(batch_id), keys.batch_errors(batch_id)):
            pipe.expire(key, int(ttl_s))
        if job is not None:
            pipe.expire(keys.batch_job(job), int(ttl_s))
        self._call(pipe.execute)
