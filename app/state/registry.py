"""The worker registry: who is alive, what each worker serves, and the one reader of it.

Each worker instance heartbeats `vigil:worker:{instance}` (its entry: name, pools, engine state,
device memory, ...) and scores itself in `vigil:workers` with `last_seen` (workers/heartbeat.py
writes through `WorkerRegistry.write`). Everything that asks "who is there" reads it here:
`vigil status`, the reconcile, the job-queue repair, the health tick, the producer announcing a
new job queue, the reaper. A worker is *live* when it heartbeated within the live window
(`VigilSettings.live_window`: the reap timeout, or three heartbeats when reaping is off).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis

from app.state import keys
from app.state.calls import Calls, decoded
from app.state.conn import server_run_id
from app.state.health import HEALTHY
from app.state.lua_workers import DROP_WORKER_IF_UNCHANGED



def _split(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def _num(entry: dict[str, str], name: str) -> int | None:
    v = entry.get(name)
    return int(v) if v not in (None, "") else None


@dataclass
class WorkerEntry:
    """One registered worker instance as its last heartbeat left it."""

    instance: str
    name: str
    last_seen: float
    # False until the worker became ready (Celery ready, preload over): the reaper gives such an
    # entry the registration grace, and a control broadcast sent to it before then is lost.
    has_pinged: bool
    # What its consumer consumes now (the reconcile may lend it pools), and what it was started
    # with.
    pools: list[str]
    configured_pools: list[str]
    model: str
    engine_state: str
    in_flight: int
    engine_loads: int
    engine_restarts: int | None
    device: str
    free_bytes: int | None
    total_bytes: int | None
    # Its health ledger's state (HEALTHY when it never reported).
    health_state: str
    # Its GPUs (`device_cards` in the heartbeat); 0 on the CPU or when the probe failed.
    cards: int = 0
    # The request schema versions it reads (app/requests/schemas.py SUPPORTED_VERSIONS); empty
    # for a worker from before workers said so, which reads version 1 only and fails any other
    # (app/requests/version_gate.py).
    schema_versions: list[int] = field(default_factory=list)

    def live(self, now: float, window: float) -> bool:
        """True when it heartbeated within `window` seconds of `now`."""
        return self.last_seen >= now - window

    @classmethod
    def parse(cls, instance: str, last_seen: float, entry: dict[str, str],
              health_state: str | None) -> "WorkerEntry":
        """An entry from its registry hash (str -> str) and its ledger state."""
        return cls(
            instance=instance, name=entry.get("name", ""), last_seen=float(last_seen),
            has_pinged=entry.get("has_pinged", "1") != "0",
            pools=_split(entry.get("pools", "")),
            configured_pools=_split(entry.get("configured_pools", entry.get("pools", ""))),
            model=entry.get("model", ""), engine_state=entry.get("engine_state", ""),
            in_flight=_num(entry, "in_flight") or 0,
            engine_loads=_num(entry, "engine_loads") or 0,
            engine_restarts=_num(entry, "engine_restarts"), device=entry.get("device", ""),
            free_bytes=_num(entry, "device_free_bytes"),
            total_bytes=_num(entry, "device_total_bytes"),
            health_state=health_state or HEALTHY,
            cards=len(_split(entry.get("device_cards", ""))),
            schema_versions=[int(v) for v in _split(entry.get("schema_versions", ""))
                             if v.isdigit()])


class WorkerRegistry:
    """Reads and writes the worker registry. Methods raise TransientError(redis_unavailable) when
    Redis cannot be reached."""

    def __init__(self, client: redis.Redis, calls: Calls | None = None):
        self.r = client
        self._call = calls or Calls(client)
        self._drop_script = None  # registered on the first drop (the reaper's)

    def server_run_id(self) -> str:
        """The running Redis server's run_id (a new one at every start): how the heartbeat sees
        a restart. TransientError(redis_unavailable) when Redis cannot be reached."""
        return self._call(server_run_id, self.r)

    # -- the one reader ------------------------------------------------------------------------
    def entries(self) -> list[WorkerEntry]:
        """Every registered worker, least recently seen first (two round trips whatever their
        number). An instance whose hash is gone (dropped between the reads) is left out."""
        rows = self._call(self.r.zrange, keys.WORKERS, 0, -1, withscores=True)
        if not rows:
            return []
        pipe = self._call.pipeline()
        for inst, _ in rows:
            pipe.hgetall(keys.worker(inst.decode()))
            pipe.hget(keys.health(inst.decode()), "state")
        replies = self._call(pipe.execute)
        out = []
        for i, (inst, seen) in enumerate(rows):
            raw, state = replies[2 * i], replies[2 * i + 1]
            if raw:
                out.append(WorkerEntry.parse(inst.decode(), seen, decoded(raw),
                                             state.decode() if state else None))
        return out

    def serving(self, pool: str) -> list[str]:
        """Node names of registered workers whose consumer consumes `pool`."""
        return [e.name for e in self.entries() if e.name and pool in e.pools]

    def instances_by_name(self) -> dict[str, str]:
        """Node name -> instance id of every registered worker (the latest wins a reused name)."""
        return {e.name: e.instance for e in self.entries() if e.name}

    def name(self, instance: int | str) -> str:
        """The Celery node name a worker instance registered with ('' if unknown)."""
        name = self._call(self.r.hget, keys.worker(instance), "name")
        return name.decode() if name else ""

    def pools(self, instance: int | str) -> list[str]:
        """The pools a worker instance last said it consumes."""
        raw = self._call(self.r.hget, keys.worker(instance), "pools")
        return _split(raw.decode()) if raw else []

    def silent(self, before: float, limit: int = 100, start: int = 0
               ) -> list[tuple[str, float, bool]]:
        """Up to `limit` workers whose last heartbeat is older than `before`, least recently
        seen first, skipping the first `start`: (instance id, last_seen, has_pinged). An entry
        whose hash is gone or predates has_pinged counts as pinged (judged by the reap timeout).
        Two round trips whatever `limit`."""
        rows = self._call(self.r.zrangebyscore, keys.WORKERS, "-inf", before, start=start,
                          num=limit, withscores=True)
        pipe = self._call.pipeline()
        for inst, _ in rows:
            pipe.hget(keys.worker(inst.decode()), "has_pinged")
        flags = self._call(pipe.execute) if rows else []
        return [(inst.decode(), float(seen), flag != b"0")
                for (inst, seen), flag in zip(rows, flags)]

    # -- writers -------------------------------------------------------------------------------
    def write(self, instance: int | str, entry: dict, now: float) -> None:
        """The heartbeat's write: the entry's fields (None written as ''), and `last_seen` = `now`
        in the sorted set, in one transaction."""
        pipe = self._call.pipeline(transaction=True)
        pipe.hset(keys.worker(instance), mapping={k: ("" if v is None else v)
                                                  for k, v in entry.items()})
        pipe.zadd(keys.WORKERS, {str(instance): now})
        self._call(pipe.execute)

    def last_seen(self, instance: int | str) -> float | None:
        """The worker's last heartbeat (or finish), None when it is not registered."""
        seen = self._call(self.r.zscore, keys.WORKERS, str(instance))
        return float(seen) if seen is not None else None

    def drop_if_unchanged(self, instance: int | str, last_seen: float) -> bool:
        """The reaper's drop: remove the worker (entry, in-flight set, ledger) only if its
        `last_seen` is still `last_seen`, atomically; False when a heartbeat landed since (it is
        alive: it keeps all three)."""
        return bool(self._call(
            self._drop_if_unchanged(),
            keys=[keys.WORKERS, keys.worker(instance), keys.inflight(instance),
                  keys.health(instance)],
            args=[str(instance), repr(float(last_seen))]))

    def _drop_if_unchanged(self):
        if self._drop_script is None:
            self._drop_script = self.r.register_script(DROP_WORKER_IF_UNCHANGED)
        return self._drop_script

    def drop(self, instance: int | str) -> None:
        """Remove a worker instance: its entry, its in-flight set and its health ledger (a clean
        stop, or the reaper once its requests were handed on)."""
        pipe = self._call.pipeline(transaction=True)
        pipe.delete(keys.worker(instance), keys.inflight(instance), keys.health(instance))
        pipe.zrem(keys.WORKERS, str(instance))
        self._call(pipe.execute)
