"""A request the engine host started on its loop, as the task thread that started it holds it
(`EngineHost.submit`): its future, its engine request id and how long waiting for it may
take."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    """A request `EngineHost.submit` started: its future on the loop, its engine request id,
    when (time.monotonic) waiting for it gives up, and that wait's whole bound."""

    future: concurrent.futures.Future
    engine_request_id: str
    deadline: float
    bound: float
