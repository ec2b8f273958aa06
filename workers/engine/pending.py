"""A request the engine host started on its loop, as the task thread that started it holds it
(`EngineHost.submit`): its future, its engine request id and how long waiting for it may
take."""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

from workers.engine.ticket import Ticket


@dataclass(frozen=True)
class Pending:
    """A request `EngineHost.submit` started: its future on the loop, its engine request id,
    when (time.monotonic) waiting for it gives up before any wait for batch seats (`until`),
    that wait's whole bound, and its ticket."""

    future: concurrent.futures.Future
    engine_request_id: str
    until: float
    bound: float
    ticket: Ticket

    @property
    def deadline(self) -> float:
        """When (time.monotonic) waiting for it gives up: `until`, moved on by the time it has
        waited for engine batch seats (workers/engine/tier_gate.py), and still waits. A slot
        freed as the batch makes progress is not an engine that does not come; an engine that
        makes no progress is the stall watchdog's."""
        since = self.ticket.gate_since  # read first: the loop adds to `gated`, then clears it
        waited = self.ticket.gated
        return self.until + waited + (time.monotonic() - since if since is not None else 0.0)

    def settle(self) -> None:
        """Block until the request ended or its `deadline` passed, whichever first (the
        deadline read again as it moves)."""
        while not self.future.done():
            left = self.deadline - time.monotonic()
            if left <= 0:
                return
            concurrent.futures.wait([self.future], left)
