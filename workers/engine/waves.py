"""The engine's waves: runs enter vLLM in waves while others are in it (one part of the real
engine, workers/engine/vllm.py).

vLLM's EngineCore steps as soon as it has a request, with whatever has arrived. Fed one run at a
time by a worker that takes short requests in at its own pace, it made a step for every ~20-27
arrivals (a bare AsyncLLM given them all at once makes one per ~95), at a fixed cost per step,
and the worker woke for every one of them: under 4,096 one-token requests through
`generate_many` EngineCore spent 2.35-2.64 ms of CPU per request and the worker 1.23-1.34 ms,
both against ~1 ms for the bare AsyncLLM (docs/performance.md, "Where a short request's time
goes"). So runs enter vLLM in waves, each wave in one turn of the loop: EngineCore takes them
into one step, and their outputs come back together. A run that arrives while others are in
the engine waits for the next wave: `window` seconds after the first that waited, or as soon as
the wave holds one engine step's worth (the engine's `max_num_seqs` runs, or its
`max_num_batched_tokens` prompt tokens), whichever comes first. A run that arrives at an idle
engine (none inside, no wave for `window`) goes at the loop's next turn, with whatever arrived
in this one (a lone request waits for nothing else); at an engine that has just emptied, it
waits for the window from the last wave.
An interactive run enters at once (its tier is for latency), and so does every run with a
window of 0, and every run that is not short (more than SHORT_RUN_TOKENS tokens a sample,
workers/engine/ticket.py): a long run enters a batch slot a run just left, and each step it
waits for a wave is a step that slot makes nothing. In the main bench workload (512 x 128
tokens, a batch of 128 that ends and refills together) long runs held to the waves filled
122-125 of the 128 slots a step; entering at once, 124-126 (docs/performance.md, "The sixth pass").

A wave does not go because the engine emptied (it did before 2026-12-05): one-token runs empty
the engine after every step, so each wave was what the worker took in during one step, and
EngineCore's steps held 55-61 runs through `generate_many` and ~5 through `.delay`, against
85-100 for a bare AsyncLLM given everything at once, at a fixed cost per step. For the same
reason an engine that has just emptied is not idle: its newcomers wait for the window from the
last wave, or they would go in a small wave of their own after every step. Held for the window
or a full step, the steps hold more, and EngineCore's CPU per request falls
(docs/performance.md, "The ninth pass").

The wait is part of the run (inside its wedge clock, at most `window`); a run cancelled while
it waits (aborted, handed back, preempted) leaves at once, without entering vLLM.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class Waves:
    """Counts the runs in the engine and holds newcomers for the next wave (module docstring).
    Use on the engine's loop: `async with waves.entry():` around a run's time in vLLM."""

    def __init__(self, window: float, step_runs: int = 0, step_tokens: int = 0):
        """Waves at most `window` seconds apart; one goes at once when it holds `step_runs` runs
        or `step_tokens` prompt tokens (0: no such limit)."""
        self.window = window
        self.step_runs = step_runs
        self.step_tokens = step_tokens
        self.inside = 0  # runs in vLLM now
        self.waves = 0  # waves released (a counter for the tests and benches)
        self._wave: asyncio.Future | None = None
        self._runs = 0  # runs the waiting wave holds
        self._tokens = 0  # and their prompt tokens
        self._released_at = float("-inf")  # the loop's time when the last wave went

    @contextlib.asynccontextmanager
    async def entry(self, at_once: bool = False, tokens: int = 0) -> AsyncIterator[None]:
        """A run's time in vLLM (its prompt `tokens` long, 0 if not known): entered with the
        next wave (module docstring; at once with `at_once` or a window of 0), counted inside
        until it leaves."""
        if self.window > 0 and not at_once:
            wave = self._wave
            if wave is None:
                loop = asyncio.get_running_loop()
                wave = self._wave = loop.create_future()
                # A busy engine: the window from now. An empty one: the window from the last
                # wave (the next turn of the loop if that is past: an idle engine's newcomer,
                # with whatever arrives in this turn, waits for nothing else).
                wait = self.window if self.inside else \
                    self.window - (loop.time() - self._released_at)
                if wait > 0:
                    loop.call_later(wait, self._release, wave)
                else:
                    loop.call_soon(self._release, wave)
            self._runs += 1
            self._tokens += tokens
            if (self.step_runs and self._runs >= self.step_runs) or \
                    (self.step_tokens and self._tokens >= self.step_tokens):
                self._release(wave)  # a full step's worth: it goes now
            await asyncio.shield(wave)
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def _release(self, wave: asyncio.Future) -> None:
        if self._wave is wave:
            self._wave = None
            self._runs = self._tokens = 0
        if not wave.done():
            self.waves += 1
            self._released_at = asyncio.get_running_loop().time()
            wave.set_result(None)
