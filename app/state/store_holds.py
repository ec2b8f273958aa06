"""Which worker holds which request, and the restart audit's marks: the books the reaper and
the restart audit read (app/fleet/reaper.py, app/fleet/message_audit.py) and a worker's
consumer writes (app/state/transport.py). A mixin of `RequestStore` (app/state/store.py), which
holds the scripts (REQUEUE) and the outage policy (`_call`).
"""
from __future__ import annotations

import time
from typing import Callable

from app.state import broker, keys
from app.state.conn import server_run


class HoldCalls:
    """In-flight sets (`hold`, `delivery_holder`, `inflight_ids`, `held_ids`, `holders`,
    `held_count`), `requeue` of a dead worker's request, `message_missing`, and the restart
    audit's marks (`redis_run`, `audited_run_id`, `mark_audited`). Needs RequestStore's `_r`,
    `_call` and `_requeue`."""

    def hold(self, request_id: str, instance: int | str) -> None:
        """Note that this worker instance holds a request's message (received, not yet begun),
        so the reaper finds it if the worker dies before running it. A worker's consumer notes
        it as it takes the message (`delivery_holder`); this is the same write on its own."""
        self._call(self._r.sadd, keys.inflight(instance), request_id)

    @staticmethod
    def delivery_holder(instance: int | str, task: str, many_task: str | None = None
                        ) -> Callable[[dict], tuple[str, str | tuple[str, ...]] | None]:
        """For app/state/transport.py `hold_deliveries`: a message of `task` with a usable id is
        held by this worker instance (its in-flight set, as `hold` writes it), and a message of
        `many_task` under each request id its `vigil_ids` header names; others are not."""
        key = keys.inflight(instance)

        def holder(headers: dict) -> tuple[str, str | tuple[str, ...]] | None:
            rid = headers.get("id")
            if headers.get("task") == task and isinstance(rid, str) and rid:
                return key, rid
            if many_task is not None and headers.get("task") == many_task:
                ids = headers.get("vigil_ids")
                if isinstance(ids, list) and ids and all(isinstance(i, str) and i for i in ids):
                    return key, tuple(ids)
            return None

        return holder

    def requeue(self, request_id: str, dead_instance: int | str, dispatch: int, *,
                now: float | None = None, reason: str | None = None,
                drained: bool = False) -> bool:
        """Mark a dead worker's RUNNING request PENDING under `dispatch` (then publish that
        dispatch's message), closing its open attempt 'requeued' at `now` (default: the clock)
        with `reason` (default: worker_lost, reaped). `drained`: a stopping worker's hand-back
        that gives a RUNNING request's attempt back and counts it in the record's `drains`.
        False when it had already ended or moved on."""
        now = time.time() if now is None else now
        args = [request_id, dead_instance, dispatch, now, reason or "", "1" if drained else "0"]
        return bool(self._call(self._requeue,
                               keys=[keys.request(request_id), keys.inflight(dead_instance)],
                               args=args))

    def let_go(self, request_ids: list[str], instance: int | str, dispatch: int) -> None:
        """This worker instance put a message of these requests (of `dispatch`) back on its
        queue untouched (a given-back delivery): it no longer holds them, so its own hand-backs
        and the reaper leave them to whoever takes the message next. A request it still holds
        another way stays: RUNNING under it (a copy of a live run), or at another dispatch
        (another copy of it, such as a retry's delayed message, is this worker's)."""
        let = []
        for rid in request_ids:
            st, inst, disp = self._call(self._r.hmget, keys.request(rid), "status", "instance",
                                        "dispatch")
            running_here = st == b"RUNNING" and inst is not None and inst.decode() == str(
                instance)
            if not running_here and int(disp or 0) == dispatch:
                let.append(rid)
        if let:
            self._call(self._r.srem, keys.inflight(instance), *let)

    def inflight_ids(self, instance: int | str) -> list[str]:
        """A worker instance's in-flight request ids (bounded by its concurrency)."""
        return [r.decode() for r in self._call(self._r.smembers, keys.inflight(instance))]

    def message_missing(self, request_id: str, queue: str, limit: int = 10_000) -> bool:
        """True when no worker holds the request and its message is neither in `queue` (read
        from the head, at most `limit` entries) nor fetched and unacked: its message is gone.
        False when it is somewhere, or when the queue is longer than `limit` and the message
        was not among the entries read (then nobody can tell cheaply)."""
        if request_id in self.held_ids():
            return False
        pos, length = self._call(broker.position, self._r, queue, request_id, limit=limit)
        if pos is not None or length > limit:
            return False
        return request_id not in self._call(broker.queued_ids, self._r, [], unacked=True)

    def held_ids(self) -> set[str]:
        """Every request id some worker instance's in-flight set holds (SCAN over the sets)."""
        held: set[str] = set()
        for key in self._r.scan_iter(match=keys.inflight("*"), count=1000):
            held.update(m.decode() for m in self._call(self._r.smembers, key))
        return held

    def holders(self, request_id: str, instances: list[str]) -> list[str]:
        """Those of `instances` whose in-flight set holds the request (one round trip)."""
        if not instances:
            return []
        pipe = self._call.pipeline()
        for i in instances:
            pipe.sismember(keys.inflight(i), request_id)
        return [i for i, held in zip(instances, self._call(pipe.execute)) if held]

    def held_count(self, instance: int | str) -> int:
        """How many requests a worker instance holds."""
        return int(self._call(self._r.scard, keys.inflight(instance)))

    def redis_run(self) -> tuple[str, float]:
        """The running Redis server's run_id and when it started (app/state/conn.py)."""
        return self._call(server_run, self._r)

    def audited_run_id(self) -> str | None:
        """The Redis run_id the last complete restart audit covered (None before the first)."""
        seen = self._call(self._r.get, keys.REDIS_RUN_ID)
        return seen.decode() if seen is not None else None

    def mark_audited(self, run_id: str) -> None:
        """Record that the restart audit for Redis run `run_id` is complete."""
        self._call(self._r.set, keys.REDIS_RUN_ID, run_id)
