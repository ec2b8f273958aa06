"""The real engine's pauses (workers/engine/vllm.py `VllmEngine`): a preempted run yields its
slot with every token EngineCore made for it read, and a drain freezes the engine, both through
vLLM's own pause (`pause_generation(mode="keep")`), one at a time.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

log = logging.getLogger("vigil.engine")
# A preempted run's pause (`yield_run`): about one engine step, bounded.
YIELD_PAUSE_S = 2.0


class Pauses:
    """`yield_run`, `freeze` and `read_now` of a VllmEngine. Needs its `_llm` (vLLM's
    AsyncLLM), `steps` (workers/engine/step_counter.py), `_watch` (the stream watch or None)
    and `dead`."""

    _frozen = False  # frozen for a drain: a yield does not resume it
    _pause_lock_: asyncio.Lock | None = None

    def read_now(self, request_id: str) -> None:
        """Read `request_id`'s tokens into its tap now (workers/engine/stream_watch.py): the
        engine host calls it on the loop right before the request yields its slot."""
        if self._watch is not None:
            self._watch.read_one(request_id)

    def generating(self, request_id: str) -> bool:
        """Whether vLLM made a token for `request_id` in this run (in any of its engine
        requests): it holds a slot of the batch, so its preemption frees one. A run that made
        none may still wait inside vLLM (the tier gate's victims: workers/engine/tier_gate.py).
        Call on the loop."""
        if self._llm is None:
            return False
        states = self._llm.output_processor.request_states
        return any(s is not None and s.detokenizer.num_output_tokens() > 0
                   for s in map(states.get, self._engine_ids(request_id)))

    def _engine_ids(self, request_id: str) -> list[str]:
        """vLLM's own ids of `request_id`'s engine requests (`<id>`, or `<id>~<sample>` for a
        continuing run's samples)."""
        op = self._llm.output_processor
        return [i for key, ids in list(op.external_req_ids.items())
                if key == request_id or key.startswith(request_id + "~") for i in ids]

    def yield_run(self, request_id: str, cancel: Callable[[], object],
                  timeout: float = YIELD_PAUSE_S) -> None:
        """Make `request_id`'s run yield its slot (a preemption: workers/engine/tier_gate.py)
        with every token EngineCore made for it in its tap, then call `cancel()` (its caller
        hands it back). Reading first and aborting after let EngineCore make a token or two
        in between that nobody read (counted from EngineCore's own log: tests/test_tiers_e2e.py).
        So, on the loop, in a task: vLLM's pause (the step in progress ends, none begins), every
        output processed, the run read (`read_now`), aborted in EngineCore, `cancel()`, then
        vLLM resumes. An engine that does not pause in time (or died) is read and cancelled as
        it is. Calls on the loop; returns at once."""
        asyncio.get_running_loop().create_task(self._yield_run(request_id, cancel, timeout))

    @property
    def _pause_lock(self) -> asyncio.Lock:
        """One pause at a time: yields, a freeze (made on the loop, at first use)."""
        if self._pause_lock_ is None:
            self._pause_lock_ = asyncio.Lock()
        return self._pause_lock_

    async def _yield_run(self, request_id: str, cancel, timeout: float) -> None:
        async with self._pause_lock:
            paused = False
            try:
                paused = await self._pause_drained(timeout)
                self.read_now(request_id)
                if paused:
                    ids = self._engine_ids(request_id)
                    if ids:
                        await self._llm.engine_core.abort_requests_async(ids)
            except Exception as e:  # the engine died or did not pause: read it as it is
                log.warning("request %s: yielding without a pause (%s: %s)", request_id,
                            type(e).__name__, e)
                self.read_now(request_id)
            finally:
                cancel()
                # Even when the pause timed out: its request may still reach EngineCore, and
                # the resume, sent after it, undoes it (vLLM ignores a resume of no pause).
                if not self._frozen and not self.dead:
                    try:
                        await self._llm.resume_generation()
                    except Exception as e:
                        log.warning("the engine did not resume after a yield: %s", e)

    async def _pause_drained(self, timeout: float) -> bool:
        """vLLM's pause, and every output EngineCore sent processed by the front end, within
        `timeout` seconds: True. Raises TimeoutError, or RuntimeError for an engine found dead
        meanwhile."""
        llm = self._llm
        pause = asyncio.ensure_future(llm.pause_generation(mode="keep", clear_cache=False))
        try:
            async with asyncio.timeout(timeout):
                while not pause.done():
                    if self.dead:
                        raise RuntimeError("the engine died before it paused")
                    await asyncio.sleep(0.005)
                pause.result()
                queue = getattr(llm.engine_core, "outputs_queue", None)
                while not (self.steps.waiting and (queue is None or queue.empty())):
                    await asyncio.sleep(0.002)
        finally:
            if not pause.done():
                pause.cancel()
        return True

    async def freeze(self, timeout: float) -> int:
        """Stop this engine making tokens and read every streamed request's tokens into its tap
        (a drain: workers/held.py). vLLM's own pause (`pause_generation(mode="keep")`: EngineCore
        finishes the step it is in, then schedules nothing; the requests stay in it, to be
        aborted) and then every output it sent processed by the front end (its output handler
        back waiting for the next batch, its queue empty), all within `timeout` seconds; then
        the stream watch reads every run once more. Returns how many runs it read. Raises
        TimeoutError when the engine did not pause in time, RuntimeError as soon as it is found
        dead meanwhile (an EngineCore that got the SIGTERM too, from a signal to the process
        group, answers no pause); the runs are read anyway (what the engine makes after that
        counts as discarded when their taps close)."""
        self._frozen = True  # a yield in progress does not resume it
        try:
            async with asyncio.timeout(timeout):
                async with self._pause_lock:
                    await self._pause_drained(timeout)
        finally:
            read = self._watch.read_all() if self._watch is not None else 0
        return read
