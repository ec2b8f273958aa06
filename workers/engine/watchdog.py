"""The engine-progress watchdog: requests in flight and no engine step for `stall_timeout` is a
stall (a SIGSTOPped or deadlocked EngineCore raises nothing: its requests just never finish).

It reads the host through `observe()` (a `Watched` snapshot taken on the loop) and owns only its
own state: the last progress count it saw and when, the stalls it declared. A step is seen
through the engine's `progress` counter (VllmEngine counts every batch of outputs its EngineCore
sends), a completed request (the host's `last_used`), or the engine becoming busy
(`busy_since`). Nothing is watched while no request is in flight, while a recovery runs or while
an engine loads. On a stall it calls `on_stall(reason)` (the host aborts every request in flight;
their callers get `wedged` and report it to the health ledger), and measures the next stall from
that moment.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("vigil.engine")


@dataclass(frozen=True)
class Watched:
    """What the watchdog needs to know of the host at one look."""

    in_flight: int
    progress: object  # the engine's step counter (None without an engine)
    busy_since: float
    last_used: float
    quiet_expected: bool  # a recovery or a load is under way: no steps to expect


class StallWatchdog:
    """Declares stalls from traffic (module docstring). Run `run()` on the host's loop."""

    def __init__(self, stall_timeout: float, observe: Callable[[], Watched],
                 on_stall: Callable[[str], None], clock: Callable[[], float]):
        self.stall_timeout = stall_timeout
        self.stalls = 0
        self._observe = observe
        self._on_stall = on_stall
        self._clock = clock
        self._seen: object = None
        self._progress_at = clock()
        self._since = clock()

    async def run(self) -> None:
        """Look every quarter of the timeout (between 50 ms and 1 s) until cancelled."""
        period = max(0.05, min(1.0, self.stall_timeout / 4))
        while True:
            await asyncio.sleep(period)
            self.look()

    def look(self) -> bool:
        """One look; True when it declared a stall."""
        now = self._clock()
        w = self._observe()
        if w.progress != self._seen:
            self._seen, self._progress_at = w.progress, now
        if w.in_flight == 0 or w.quiet_expected:
            return False
        quiet = now - max(self._progress_at, w.busy_since, w.last_used, self._since)
        if quiet < self.stall_timeout:
            return False
        self.stalls += 1
        self._since = now  # the next stall is measured from here
        reason = (f"the engine made no progress for {quiet:.0f} s with {w.in_flight} "
                  f"request(s) in flight; aborted and requeued")
        self._on_stall(reason)
        return True
