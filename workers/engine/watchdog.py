"""The wedge half of the engine host: the engine-progress watchdog, pausing for a quarantine,
and the engine restart + canary that ends one (DESIGN.md section 5, "Wedge").

A wedged engine raises nothing: its requests just never finish (FIELD-NOTES.md: a SIGSTOPped
EngineCore blocks every task thread silently). Two signals prove it from traffic:
- a request's own timeout (`request_timeout`, enforced in `EngineHost.generate`);
- this watchdog: requests in flight and no engine step for `stall_timeout`. An engine step is
  seen through the engine's `progress` counter (VllmEngine counts every batch of outputs its
  EngineCore sends), a completed request, or the engine becoming busy.
Every request that ends `wedged` (timed out, or aborted by the watchdog) is reported to the
worker's health ledger through `on_failure`; a completed one through `on_success`.

`EngineWatch` is a mixin of `EngineHost` and uses its state (`_engine`, `_inflight`, `_cond`,
`_futures`, `_clock`, ...); see workers/engine/host.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from app.errors import VigilError
from app.requests.models import ModelSpec

log = logging.getLogger("vigil.engine")


class EngineWatch:
    """Stall watchdog, pause/resume and the quarantine restart for EngineHost."""

    async def _watchdog(self) -> None:
        period = max(0.05, min(1.0, self._stall_timeout / 4))
        seen = None
        progress_at = self._clock()
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            count = getattr(self._engine, "progress", None)
            if count != seen:
                seen, progress_at = count, now
            if self._inflight == 0 or self._recovery is not None or self._state == "loading":
                continue
            last = max(progress_at, self._busy_since, self._last_used)
            if now - last >= self._stall_timeout:
                self._abort_stalled(now - last)

    def _abort_stalled(self, quiet: float) -> None:
        self.stalls += 1
        reason = (f"the engine made no progress for {quiet:.0f} s with {self._inflight} "
                  f"request(s) in flight; aborted and requeued")
        log.error("engine for %s stalled: %s", self._model, reason)
        with self._futures_lock:
            futures = list(self._futures)
        for f in futures:
            self._stall_aborted[f] = reason
            f.cancel()  # the engine aborts it; the caller gets TransientError(wedged)
        self._busy_since = self._clock()  # the next stall is measured from here
        self._on_change()

    # -- quarantine ---------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """False while paused (quarantined) or stopping: deliveries go back to the queue."""
        return not (self._paused or self._draining)

    def pause(self) -> None:
        """Take no new requests (callers get HandedBack) until `resume()`."""
        self._paused = True
        self._on_change()

    def resume(self) -> None:
        """Take requests again (after a passing canary)."""
        self._paused = False
        self._on_change()

    def abort_in_flight(self) -> int:
        """Abort every request in the engine or waiting for it; their callers get HandedBack
        (the caller has republished them). Call after `pause()`. Returns how many."""
        with self._futures_lock:
            futures = list(self._futures)
        for f in futures:
            f.cancel()
        return len(futures)

    def restart_with_canary(self, spec: ModelSpec, timeout: float) -> tuple[bool, str]:
        """Kill the current engine (a wedged one cannot shut down politely), start a fresh one
        for `spec` and run the canary on it. Returns (passed, why not)."""
        try:
            return asyncio.run_coroutine_threadsafe(
                self._restart_with_canary(spec), self._loop).result(timeout)
        except concurrent.futures.TimeoutError:
            return False, f"restart and canary took over {timeout:g} s"

    async def _restart_with_canary(self, spec: ModelSpec) -> tuple[bool, str]:
        async with self._cond:
            await self._cond.wait_for(lambda: self._inflight == 0 and self._recovery is None)
            eng = self._engine
            if eng is not None:
                kill = getattr(eng, "kill", None)
                if kill is not None:
                    kill()
                self.restarts += 1
                self._shutdown_engine("")
            try:
                self._load(spec)
            except VigilError as e:
                return False, f"the engine did not start: {e}"
            if await self._canary(self._engine, spec, count_death=False):
                return True, ""
            return False, "the canary generation failed on a fresh engine"
