"""Unit tier: a preempted run's yield on the real VllmEngine (workers/engine/vllm_pause.py
`yield_run`) over a stand-in AsyncLLM that records what it is asked, in order. The run is read
while vLLM is paused and aborted in EngineCore before vLLM goes on, so EngineCore makes no token
between the read and the abort (the e2e, tests/test_tiers_e2e.py, counts EngineCore's tokens);
a pause that never comes still ends in a read, a cancel and a resume; a frozen engine (a
drain) is never resumed by a yield."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from workers.engine.vllm import VllmEngine


class RecordingLLM:
    """What VllmEngine's yield asks of an AsyncLLM, recorded in `calls`."""

    def __init__(self, calls: list, pauses: bool = True):
        self.calls, self.pauses, self.errored = calls, pauses, False
        self.output_processor = SimpleNamespace(
            external_req_ids={"r-1": ["int-r-1"], "r-1~1": ["int-r-1-s1"], "other": ["int-o"]})

        async def abort(ids):
            calls.append(("abort in EngineCore", sorted(ids)))

        self.engine_core = SimpleNamespace(abort_requests_async=abort,
                                           outputs_queue=asyncio.Queue())

    async def pause_generation(self, **kw):
        self.calls.append(("pause", kw["mode"]))
        if not self.pauses:
            await asyncio.sleep(3600)

    async def resume_generation(self):
        self.calls.append(("resume",))


class Engine(VllmEngine):
    """The real VllmEngine's yield over a RecordingLLM (no vLLM built)."""

    def __init__(self, llm: RecordingLLM):
        self._llm, self._watch = llm, None
        self.steps = SimpleNamespace(waiting=True)

    def read_now(self, request_id):
        self._llm.calls.append(("read", request_id))


def yielded(pauses: bool = True, frozen: bool = False) -> list:
    calls: list = []

    async def go():
        engine = Engine(RecordingLLM(calls, pauses))
        engine._frozen = frozen
        done = asyncio.Event()

        def cancel():
            calls.append(("cancel",))
            done.set()

        engine.yield_run("r-1", cancel, timeout=0.2)
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.05)  # the resume comes right after the cancel

    asyncio.run(go())
    return calls


def test_a_yield_reads_and_aborts_the_run_while_vllm_is_paused():
    """Pause, read, abort every engine request of the run (its samples' too) in EngineCore,
    cancel, resume: in that order."""
    assert yielded() == [("pause", "keep"), ("read", "r-1"),
                         ("abort in EngineCore", ["int-r-1", "int-r-1-s1"]), ("cancel",),
                         ("resume",)]


def test_a_pause_that_never_comes_still_reads_cancels_and_resumes():
    """The pause request may reach EngineCore after the yield stopped waiting: the run is read
    and cancelled as it is, and vLLM is resumed anyway (a late pause would leave it stopped)."""
    calls = yielded(pauses=False)
    assert calls == [("pause", "keep"), ("read", "r-1"), ("cancel",), ("resume",)]


def test_a_yield_never_resumes_a_frozen_engine():
    """A drain froze the engine: a yield in its way reads and cancels, and leaves it paused."""
    assert ("resume",) not in yielded(frozen=True)
