"""Celery's Redis result backend, minus one read per final result.

Celery's key-value backends read a task's result key before every write, so that a late write
(a lost task's retry, a network partition) never overwrites a SUCCESS. A final outcome of
`vigil.generate` is always the request record's set-once outcome (app/fleet/outcomes.py): every
delivery that writes one writes the same outcome, so for SUCCESS and FAILURE that read (a round
trip per request on the worker) protects nothing and is skipped. Every other state (RETRY) is
written as Celery writes it, read first, so it never replaces a final result. Selected by the
result backend URL (`app.result_backend:VigilRedisBackend+redis://...`, app/celery_app.py).
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


class VigilRedisBackend(_FinalWithoutRead, RedisBackend):
    """Celery's RedisBackend (redis:// and rediss://) without the read before a final write."""


class VigilSentinelBackend(_FinalWithoutRead, SentinelBackend):
    """Celery's SentinelBackend (sentinel://) without the read before a final write."""


def backend_url(redis_url: str) -> str:
    """The result backend setting for Vigil's Redis URL: this module's class for its scheme."""
    cls = "VigilSentinelBackend" if redis_url.startswith("sentinel") else "VigilRedisBackend"
    return f"app.result_backend:{cls}+{redis_url}"
