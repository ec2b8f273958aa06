"""Reading the tokens of the requests in a vLLM engine while they run, at a cost per tick, not
per token: the source of token streams (workers/streaming.py).

vLLM's front end keeps, for every request in the engine, the tokens generated so far and their
text (its OutputProcessor's request states, updated by its output handler on the engine's
loop). Asking it for an output per engine step (RequestOutputKind.DELTA) costs a RequestOutput,
a queue hand-off and a task wake-up per request per step, which on a 2-core machine took ~20%
of the throughput (docs/performance.md, "Token streams"). Instead the engine still asks for the
final output only, and a `StreamWatch` ticking on the same loop reads each watched request's
state every `period` seconds: its new token ids, and the text vLLM would have released by then
(all but the last `stop_buffer_length` characters, which might still begin a stop string). The
reads happen on the loop thread between the output handler's steps, so they see a consistent
state. A tick costs a few microseconds per request in flight.

A resumed run's engine request does not detokenize: its new tokens go through the run's Seam
(workers/engine/resume.py), which makes their text and may find a stop string, which ends the
run (the engine request is cancelled, so vLLM aborts it).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from workers.engine.resume import Cut, Seam

log = logging.getLogger("vigil.engine")


@dataclass
class WatchedRun:
    """One streamed run: its tap, its seam (resumed runs), and how far it has been read."""

    tap: object  # workers.streaming.StreamTap
    seam: Seam | None = None
    fed_chars: int = 0  # characters of the engine's text read so far (runs from the prompt)
    new_ids: list[int] = field(default_factory=list)  # every new token read, in order
    cut: Cut | None = None
    task: asyncio.Future | None = None  # the engine request's task (cancelled on a cut)

    @property
    def fed(self) -> int:
        """New tokens read so far."""
        return len(self.new_ids)

    def feed(self, token_ids: list[int], text: str) -> None:
        """New tokens and the text the engine released with them (a resumed run's text is the
        seam's): to the tap."""
        self.new_ids += token_ids
        if self.seam is None:
            self.tap.add(token_ids, text)
            return
        released, cut = self.seam.feed(token_ids)
        if cut is not None:
            self.cut = cut
            if self.task is not None and not self.task.done():
                self.task.cancel()  # vLLM aborts the request
            return
        self.tap.add(token_ids, released)


class StreamWatch:
    """Reads the watched requests' progress out of an AsyncLLM every `period` seconds."""

    def __init__(self, llm, period: float):
        self._llm = llm
        self.period = period
        self._runs: dict[str, WatchedRun] = {}
        self._task: asyncio.Task | None = None
        self.ticks = 0

    def watch(self, request_id: str, run: WatchedRun) -> None:
        """Start reading `request_id` (call on the engine's loop)."""
        self._runs[request_id] = run
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ticking())

    def unwatch(self, request_id: str) -> None:
        """Stop reading `request_id`."""
        self._runs.pop(request_id, None)

    def stop(self) -> None:
        """Stop ticking and let go of the engine (it shuts down). The cancelled tick task may
        still wait on the loop; holding the AsyncLLM from it would keep the engine alive to
        interpreter exit, where its __del__ fails on half-torn-down modules."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._llm = None
        self._runs.clear()

    async def _ticking(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                self.tick()
            except Exception:  # a tick must never take the engine's loop down
                log.exception("reading the token streams of the engine's requests failed")

    def tick(self) -> None:
        """Read every watched request's new tokens once."""
        if self._llm is None:  # stopped
            return
        self.ticks += 1
        op = self._llm.output_processor
        for request_id, run in list(self._runs.items()):
            if run.cut is not None:
                continue
            internal = op.external_req_ids.get(request_id)
            state = op.request_states.get(internal[-1]) if internal else None
            if state is None:  # not in yet, or finished: the final output has the rest
                continue
            det = state.detokenizer
            ids = det.output_token_ids
            if len(ids) <= run.fed:
                continue
            if run.tap.prompt_ids is None:
                run.tap.set_prompt(list(state.prompt_token_ids or ()))
            text = getattr(det, "output_text", "")
            released = max(run.fed_chars, len(text) - getattr(det, "stop_buffer_length", 0))
            new_text = text[run.fed_chars:released]
            run.fed_chars = released
            run.feed(list(ids[run.fed:]), new_text)
