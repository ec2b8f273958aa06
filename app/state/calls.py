"""Calls to Redis that fail one way: `TransientError(redis_unavailable)`, never a bare redis
exception, optionally riding out an outage first.

Every reader and writer of Vigil's state in app/state/ goes through a `Calls`: its store's
(app/state/store.py), which the store's views and everything it hands out share (the batch
objects, the token streams, the health ledger), or, for the callers that must not wait on Redis
(a worker's heartbeat, the engine loop's reads), the store's one other policy, no grace at all
(`RequestStore.without_grace`). Code outside app/state/ holds no client to go around it
(tests/test_layers.py). With `outage_grace` > 0 (workers), a call that cannot reach Redis is
retried with doubling pauses (app/retry_policy.py, `OutagePolicy`) for up to that many seconds
(a Redis restart, a failover, a restarted Redis still reading its AOF) before it raises: a
finished generation is not thrown away for a restart. (Celery's result keys are not Vigil's
state: app/state/results.py writes them on the result backend's own client and raises redis'
own errors; a caller that cannot write them logs it, the record being the truth.) Every Lua script is written so that
running it again after a lost reply is harmless (it finds its own change and reports it).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import redis

from app.errors import REDIS_UNAVAILABLE, TransientError
from app.retry_policy import OutagePolicy

log = logging.getLogger("vigil.store")

# What a call through app/state/ may raise when Redis fails it: TransientError(redis_unavailable)
# when Redis cannot be reached or refuses the credentials, or one of redis' own errors for a
# command Redis answered with an error (a READONLY replica after a failover, a WRONGTYPE). Code
# outside app/state/ catches these, never redis-py's classes by name: it does not import redis.
REDIS_ERRORS: tuple[type[Exception], ...] = (TransientError, redis.RedisError)


class Calls:
    """Runs Redis calls for one client under one outage policy (module docstring)."""

    def __init__(self, client: redis.Redis, outage_grace: float = 0.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.client = client
        self.outage_grace = outage_grace
        self._policy = OutagePolicy(outage_grace)
        self._clock, self._sleep = clock, sleep

    def __call__(self, fn, *a, **kw):
        """`fn(*a, **kw)`; TransientError(redis_unavailable) when Redis cannot be reached (after
        `outage_grace` seconds of retries) or refuses the credentials. A pipeline's `execute`
        is retried with its commands: redis-py empties a pipeline whose execute failed on a
        lost connection, and executing it again would answer [] for what never ran."""
        pipe = getattr(fn, "__self__", None)
        queued = ((list(pipe.command_stack), set(pipe.scripts))
                  if isinstance(pipe, redis.client.Pipeline) else None)
        give_up, pause = None, self._policy.first_pause()
        while True:
            if queued is not None and not pipe.command_stack:
                pipe.command_stack.extend(queued[0])
                pipe.scripts.update(queued[1])
            try:
                return fn(*a, **kw)
            except redis.AuthenticationError as e:  # a wrong password in VIGIL_REDIS_URL
                raise TransientError.of(REDIS_UNAVAILABLE, "Redis refused the credentials of "
                                        f"VIGIL_REDIS_URL ({e})") from None
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # (BusyLoadingError, a restarted Redis still reading its AOF, is one of these.)
                now = self._clock()
                if give_up is None:
                    give_up = now + self.outage_grace
                    if self.outage_grace > 0:
                        log.warning("cannot reach Redis (%s); retrying for up to %.0f s", e,
                                    self.outage_grace)
                if now >= give_up:
                    raise TransientError.of(REDIS_UNAVAILABLE, f"cannot reach Redis: {e}") from None
                self._sleep(min(pause, give_up - now))
                pause = self._policy.next_pause(pause)

    def pipeline(self, transaction: bool = False):
        """A pipeline on this client (run it with `self(pipe.execute)`)."""
        return self.client.pipeline(transaction=transaction)


def decoded(raw: dict) -> dict[str, str]:
    """A Redis hash reply as str -> str."""
    return {k.decode(): v.decode() for k, v in raw.items()}
