"""The engine's intake: runs enter vLLM in waves while others are in it (one part of the real
engine, workers/engine/vllm.py).

vLLM's EngineCore steps as soon as it has a request, with whatever has arrived. Fed one run at a
time by a worker that takes short requests in at its own pace, it made a step for every ~20-27
arrivals (a bare AsyncLLM given them all at once makes one per ~95), at a fixed cost per step,
and the worker woke for every one of them: under 4,096 one-token requests through
`generate_many` EngineCore spent 2.35-2.64 ms of CPU per request and the worker 1.23-1.34 ms,
both against ~1 ms for the bare AsyncLLM (docs/performance.md, "Where a short request's time
goes"). So a run that arrives while other runs are in the engine waits for the next wave, at
most `window` seconds after the first run that waited, and the runs of a wave enter vLLM
together, in one turn of the loop: EngineCore takes them into one step, and their outputs come
back together. A run that arrives at an engine with no run in it enters at once, so a lone
request never waits; nor does any run with a window of 0.

The wait is part of the run (inside its wedge clock, at most `window`); a run cancelled while
it waits (aborted, handed back, preempted) leaves at once, without entering vLLM.
"""
from __future__ import annotations

import asyncio


class Intake:
    """Counts the runs in the engine and holds newcomers for the next wave (module docstring).
    Use on the engine's loop: `async with intake:` around a run's time in vLLM."""

    def __init__(self, window: float):
        self.window = window
        self.inside = 0  # runs in vLLM now
        self.waves = 0  # waves released (a counter for the tests and benches)
        self._wave: asyncio.Future | None = None

    async def __aenter__(self) -> "Intake":
        if self.window > 0 and self.inside > 0:
            if self._wave is None:
                loop = asyncio.get_running_loop()
                self._wave = loop.create_future()
                loop.call_later(self.window, self._release, self._wave)
            await asyncio.shield(self._wave)
        self.inside += 1
        return self

    async def __aexit__(self, *exc) -> None:
        self.inside -= 1

    def _release(self, wave: asyncio.Future) -> None:
        if self._wave is wave:
            self._wave = None
        self.waves += 1
        if not wave.done():
            wave.set_result(None)
