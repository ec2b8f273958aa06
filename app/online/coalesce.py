"""Concurrent online calls' requests submitted together: messages of many (one part of the
gateway, app/ops/gateway.py).

An eval harness with `num_concurrent` requests in flight sends that many HTTP calls of one
prompt each. Submitted one by one, each is a `vigil.generate` message of its own, the road a
worker serves at 0.15-0.19x of the engine's speed for one-token requests, where messages of many
(`generate_many`) reach 0.58-0.59x (docs/performance.md, "Where a short request's time goes").
So calls whose submits overlap are submitted as one: while one call's submit is in flight, the
calls that arrive wait, and the next of them submits the calls waiting then (oldest first, up
to the most requests one submit takes) in one `submit(items)` (app/requests/submit.py: messages
grouped by queue and tier, up to VIGIL_REQUESTS_PER_MESSAGE each). A lone call is submitted at once, as it was; nothing waits on
a timer. Every request keeps its own id, record and result: a call learns nothing of the
others.

A submit of many is all or nothing (one refusal, `overloaded` say, refuses them all), so a
batch of several calls that raises is submitted again call by call: each caller gets its own
outcome, and what the batch had already recorded or published is found again under its ids
(the same id and the same request again is that request: nothing runs twice).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

# submit(items, ids): one call's requests (blocking; raises what the submit raises).
Submit = Callable[[list[dict], list[str]], object]


@dataclass(eq=False)
class _Call:
    items: list[dict]
    ids: list[str]
    finished: bool = False
    error: BaseException | None = None


class Coalescer:
    """Submits calls' requests, together when their submits overlap (module docstring).
    Thread-safe: `submit` blocks its caller's thread until its requests are submitted."""

    def __init__(self, submit: Submit, max_items: int):
        """`max_items`: the most requests one submit takes (several calls go together only
        up to it; a call over it goes alone, and its submit refuses it)."""
        self._submit = submit
        self._max_items = max_items
        self._cond = threading.Condition()
        self._waiting: list[_Call] = []
        self._busy = False
        self.batches = 0  # submits made (a counter for the tests and benches)

    @property
    def waiting(self) -> int:
        """Calls waiting for the submit in flight."""
        with self._cond:
            return len(self._waiting)

    def submit(self, items: list[dict], ids: list[str]) -> None:
        """Submit one call's requests (with whatever calls wait meanwhile); raises what its
        own submit raised."""
        me = _Call(list(items), list(ids))
        with self._cond:
            self._waiting.append(me)
        while True:
            with self._cond:
                while self._busy and not me.finished:
                    self._cond.wait()
                if me.finished:
                    break
                self._busy = True  # this thread submits the calls waiting now, oldest first
                batch = self._take()
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        if me.error is not None:
            raise me.error

    def _take(self) -> list[_Call]:
        """The waiting calls, oldest first, up to `max_items` requests (at least one call);
        the rest wait for the next submit."""
        n, items = 0, 0
        while n < len(self._waiting) and (n == 0 or items + len(self._waiting[n].items)
                                          <= self._max_items):
            items += len(self._waiting[n].items)
            n += 1
        batch, self._waiting = self._waiting[:n], self._waiting[n:]
        return batch

    def _run(self, batch: list[_Call]) -> None:
        """Submit `batch` as one; if that raises and it holds several calls, each alone."""
        try:
            self.batches += 1
            self._submit([i for c in batch for i in c.items], [r for c in batch for r in c.ids])
            errors = [None] * len(batch)
        except BaseException as e:
            if len(batch) == 1:
                errors = [e]
            else:
                errors = [self._alone(c) for c in batch]
        with self._cond:
            for c, err in zip(batch, errors):
                c.error, c.finished = err, True
            self._cond.notify_all()

    def _alone(self, call: _Call) -> BaseException | None:
        try:
            self.batches += 1
            self._submit(call.items, call.ids)
            return None
        except BaseException as e:
            return e
