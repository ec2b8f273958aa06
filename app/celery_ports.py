"""What the code below the Celery app needs of it, built once by the app factory and passed down.

Nothing under app/ or workers/ looks the Celery app up: app/celery_app.py `create_app` builds a
`CeleryPorts` around the app it made (`app.vigil_ports`), and the entry points hand it to what
they call (the producer's submit, beat's tasks, the worker runtime, the operator commands):

- `send(args, kwargs, task_id=..., **options)`: publish one `vigil.generate` message
  (app/requests/publish.py shapes every message), and `send_many` one `vigil.generate_many`
  (many requests in one message);
- `result(request_id)`: the result handle (Vigil's AsyncResult) of a request;
- `backend`: Celery's result backend (ending a request writes the outcome there too);
- `bus`: the control bus (app/control.py).
"""
from __future__ import annotations

from typing import Any

from app.control import ControlBus
from app.task_names import GENERATE, GENERATE_MANY


class CeleryPorts:
    """The four handles of one Celery app that Vigil's lower floors use (module docstring)."""

    def __init__(self, celery: Any):
        self._celery = celery
        self.bus = ControlBus(celery.control)

    def send(self, args: tuple, kwargs: dict, task_id: str, **options) -> Any:
        """Publish one vigil.generate message through the app; returns Celery's AsyncResult."""
        return self._celery.send_task(GENERATE, args=args, kwargs=kwargs, task_id=task_id,
                                      **options)

    def send_many(self, kwargs: dict, task_id: str, **options) -> Any:
        """Publish one vigil.generate_many message (many requests) through the app."""
        return self._celery.send_task(GENERATE_MANY, args=(), kwargs=kwargs, task_id=task_id,
                                      **options)

    def result(self, request_id: str) -> Any:
        """The app's result handle for `request_id` (nothing is read until it is asked)."""
        return self._celery.AsyncResult(request_id)

    @property
    def backend(self) -> Any:
        """Celery's result backend (built by the app on first use)."""
        return self._celery.backend


def ports_of(celery: Any) -> CeleryPorts:
    """The ports of a Celery app: the ones its factory built (Vigil's app), else new ones around
    it (a plain Celery app, e.g. a test harness' or a foreign producer's)."""
    ports = getattr(celery, "vigil_ports", None)
    return ports if isinstance(ports, CeleryPorts) else CeleryPorts(celery)
