"""Celery's Redis result backend, minus one read per final result and a subscription per send.

Celery's key-value backends read a task's result key before every write, so that a late write
(a lost task's retry, a network partition) never overwrites a SUCCESS. A final outcome of
`vigil.generate` is always the request record's set-once outcome (app/fleet/outcomes.py): every
delivery that writes one writes the same outcome, so for SUCCESS and FAILURE that read (a round
trip per request on the worker) protects nothing and is skipped. Every other state (RETRY) is
written as Celery writes it, read first, so it never replaces a final result. Selected by the
result backend URL (`app.result_backend:VigilRedisBackend+redis://...`, app/celery_app.py).

Celery's Redis backend also subscribes to a task's result channel as the task is sent (its
`on_task_call`), and its AsyncResult unsubscribes again when it is dropped: two commands on the
producer's pub/sub connection for every `.delay`, whether anyone waits or not. Waiting
subscribes anyway: Celery's `get` subscribes first and then reads the result key (its
`on_wait_for_pending`), so a result stored before the subscription is read, not missed. Vigil's
backend subscribes only then (`_SubscribeOnWait`): a send writes one command to Redis less,
a dropped handle none, and a producer that sends many and waits later subscribes to each once,
while it waits.
"""
from __future__ import annotations

from celery import states
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.utils.encoding import bytes_to_str


class _FinalWithoutRead:
    """Store SUCCESS and FAILURE without reading the key first (module docstring)."""

    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        if state not in (states.SUCCESS, states.FAILURE):
            return super()._store_result(task_id, result, state, traceback=traceback,
                                         request=request, **kwargs)
        meta = self._get_result_meta(result=result, state=state, traceback=traceback,
                                     request=request)
        meta["task_id"] = bytes_to_str(task_id)
        self._set_with_state(self.get_key_for_task(task_id), self.encode(meta), state)
        return result


class _SubscribeOnWait:
    """Subscribe to a task's result channel when a caller waits for it, not when it is sent
    (module docstring)."""

    def on_task_call(self, producer, task_id):
        """Nothing: Celery's `get` subscribes, then reads the key, when it waits."""


class VigilRedisBackend(_FinalWithoutRead, _SubscribeOnWait, RedisBackend):
    """Celery's RedisBackend (redis:// and rediss://) without the read before a final write
    and without a subscription per send."""


class VigilSentinelBackend(_FinalWithoutRead, _SubscribeOnWait, SentinelBackend):
    """Celery's SentinelBackend (sentinel://) without the read before a final write and
    without a subscription per send."""


def backend_url(redis_url: str) -> str:
    """The result backend setting for Vigil's Redis URL: this module's class for its scheme."""
    cls = "VigilSentinelBackend" if redis_url.startswith("sentinel") else "VigilRedisBackend"
    return f"app.result_backend:{cls}+{redis_url}"
