"""Telling workers what to do, over Celery's control bus (a broadcast through the broker).

Every control message Vigil sends goes through a `ControlBus`: consume a queue, stop consuming
it, abort requests, and the one question it asks (which queues a worker consumes). The bus is
built once by the app factory around its Celery app's `control` (app/celery_ports.py) and handed
to its callers: beat's tasks (the reconcile, the health tick, ending a job), the producer
announcing a new job queue, `vigil job delete`, and a worker stopping its own consumers when it
quarantines or leaves. Broadcasts are fire-and-forget (`reply=False`): each caller has a sweep
that repairs a lost one.
"""
from __future__ import annotations

from typing import Any

# A worker that does not answer `active_queues` within this long is skipped this time.
INSPECT_TIMEOUT_S = 1.0
# The worker-side command that aborts requests (workers/lifecycle.py `vigil_abort`).
ABORT_COMMAND = "vigil_abort"


class ControlBus:
    """Vigil's control messages over one Celery app's control bus (`celery.app.control.Control`,
    or anything with its add_consumer / cancel_consumer / inspect / broadcast)."""

    def __init__(self, control: Any):
        self._control = control

    def add_consumer(self, queue: str, names: list[str]) -> None:
        """Tell the workers `names` (Celery node names) to consume `queue`; nothing for no
        names."""
        if names:
            self._control.add_consumer(queue, destination=list(names), reply=False)

    def cancel_consumer(self, queue: str, names: list[str]) -> None:
        """Tell the workers `names` to stop consuming `queue`; nothing for no names."""
        if names:
            self._control.cancel_consumer(queue, destination=list(names), reply=False)

    def set_consuming(self, name: str, queue: str, on: bool) -> None:
        """Make worker `name` consume `queue` (on) or stop consuming it (off)."""
        (self.add_consumer if on else self.cancel_consumer)(queue, [name])

    def active_queues(self, name: str) -> list[str] | None:
        """The queues worker `name` consumes now; None when it did not answer in time."""
        replies = self._control.inspect(destination=[name],
                                        timeout=INSPECT_TIMEOUT_S).active_queues() or {}
        return [q["name"] for q in replies[name]] if name in replies else None

    def abort_requests(self, request_ids: list[str]) -> None:
        """Tell every worker to abort these requests if it runs them (they ended elsewhere)."""
        self._control.broadcast(ABORT_COMMAND, arguments={"request_ids": list(request_ids)},
                                reply=False)
