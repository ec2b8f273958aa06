"""Unit-tier helpers (docs/testing.md): waiting on a condition, many futures' outcomes, the
engine host's events from plain callables, and stand-ins for Celery's result backend and app
ports."""
from __future__ import annotations

import pytest


def wait_until(cond, timeout: float = 10.0) -> None:
    """Poll `cond` every 10 ms until it is true; fail after `timeout` seconds (unit tier)."""
    from app.local.embedded import wait_for

    wait_for(cond, timeout, 0.01, "the condition")


def outcomes(futures) -> list:
    """Each future's result, or the exception it raised, in order (waiting for each)."""
    out = []
    for f in futures:
        try:
            out.append(f.result())
        except Exception as e:
            out.append(e)
    return out


def callback_events(*, on_change=None, on_fatal=None, on_failure=None, on_success=None,
                    served_elsewhere=None, planner=None):
    """The engine host's events (workers/engine/host_state.py HostEvents) from plain callables,
    for unit tests: each one given replaces that event's harmless default."""
    from workers.engine.host import HostEvents

    class Events(HostEvents):
        def changed(self):
            if on_change is not None:
                on_change()

        def fatal(self, err):
            if on_fatal is not None:
                on_fatal(err)

        def failure(self, reason):
            if on_failure is not None:
                on_failure(reason)

        def success(self):
            if on_success is not None:
                on_success()

        def served_elsewhere(self, model):
            return served_elsewhere(model) if served_elsewhere is not None else False

        def plan_memory(self, spec):
            return planner(spec) if planner is not None else None

    return Events()


EVENT_KWARGS = ("on_change", "on_fatal", "on_failure", "on_success", "served_elsewhere",
                "planner")



class Told(list):
    """A stand-in for Celery's result backend (`end_request`'s `backend`): records each failure
    it is told as (request id, error message), each result in `done`. Thread-safe appends."""

    def __init__(self):
        super().__init__()
        self.done: list[tuple[str, dict]] = []

    def mark_as_failure(self, task_id, exc):
        self.append((task_id, str(exc)))

    def mark_as_done(self, task_id, result):
        self.done.append((task_id, result))

    @property
    def ids(self) -> list[str]:
        return [rid for rid, _ in self]


class NeverTold:
    """A result backend that fails the test if it is told anything."""

    def mark_as_failure(self, task_id, exc):
        pytest.fail(f"told the backend that {task_id} failed: {exc}")

    def mark_as_done(self, task_id, result):
        pytest.fail(f"told the backend that {task_id} succeeded")


class RecordingPorts:
    """A Celery app's ports (app/celery_ports.py) that publish nothing: `sent` records each
    vigil.generate message as (request id, dispatch); no result backend; control broadcasts
    recorded in `broadcasts`. For Redis-tier tests of worker-side rules."""

    def __init__(self):
        from app.control import ControlBus

        self.sent: list[tuple[str, int]] = []
        self.broadcasts: list[tuple] = []
        self.backend = None
        ports = self

        class _Control:
            def add_consumer(self, queue, **kw):
                ports.broadcasts.append(("add_consumer", queue, kw.get("destination")))

            def cancel_consumer(self, queue, **kw):
                ports.broadcasts.append(("cancel_consumer", queue, kw.get("destination")))

            def broadcast(self, command, **kw):
                ports.broadcasts.append((command, kw.get("arguments")))

        self.bus = ControlBus(_Control())

    def send(self, args, kwargs, task_id, **options):
        self.sent.append((task_id, options.get("retries", 0)))

    def result(self, request_id):
        return request_id
