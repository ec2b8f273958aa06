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

A `live` request (its tap's `live`: a reader shows its tokens as they come) is read after every
engine step instead, right after vLLM's output processor has taken the step in: the watch wraps
that processor's `process_outputs` (on the same loop, so the read sees the state the step left)
while a live request is watched, and stamps the tokens with the step's time as EngineCore took
it (its monotonic clock, shared by every process of the host, turned into wall time). Each read
costs a few microseconds per live request per step; other requests keep the tick.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from workers.engine.resume import Cut, Seam
from workers.engine.token_tap import TokenTap

log = logging.getLogger("vigil.engine")


# A run's conversion of vLLM's logprobs for new tokens: (sample index, the new token ids, vLLM's
# dicts for them, the sample's tokens this run made before them) -> JSON entries
# (workers/engine/logprobs.py).
Convert = Callable[[int, list, list, list], list]


@dataclass
class Progress:
    """How far one sample of a watched run has been read."""

    new_ids: list[int] = field(default_factory=list)  # every new token read, in order
    fed_chars: int = 0  # characters of the engine's text read so far (runs from the prompt)
    logprobs: list[dict] = field(default_factory=list)  # their entries (with logprobs)


@dataclass
class WatchedRun:
    """One streamed run: its tap, its seam (a run continuing one sample), and how far each of
    its samples has been read. A run from the prompt makes every sample (`index` None: the
    engine's own sample indexes); a continuing run makes sample `index` alone."""

    tap: TokenTap  # workers.streaming.StreamTap implements it
    seam: Seam | None = None
    index: int | None = None
    samples: int = 1  # samples the engine request makes
    convert: Convert | None = None  # set when the request asked for logprobs
    want_prompt_logprobs: bool = False
    progress: dict[int, Progress] = field(default_factory=dict)
    cut: Cut | None = None
    task: asyncio.Future | None = None  # the engine request's task (cancelled on a cut)
    prompt_logprobs: list | None = None  # vLLM's, read once prefill made them
    prompt_ids: list[int] | None = None
    detokenize: bool = True  # False: the seam's text is not streamed (token ids only)

    def of(self, index: int) -> Progress:
        """Sample `index`'s progress (made on first use)."""
        prog = self.progress.get(index)
        if prog is None:
            prog = self.progress[index] = Progress()
        return prog

    @property
    def own(self) -> Progress:
        """The progress of the sample a continuing run makes (sample 0 of a run from the
        prompt)."""
        return self.of(self.index or 0)

    @property
    def fed(self) -> int:
        """New tokens read so far (of `own`)."""
        return len(self.own.new_ids)

    @property
    def new_ids(self) -> list[int]:
        return self.own.new_ids

    @property
    def live(self) -> bool:
        """Read after every engine step (its reader shows tokens as they come)."""
        return bool(getattr(self.tap, "live", False))

    def feed(self, token_ids: list[int], text: str, index: int | None = None,
             logprobs: list[dict] | None = None, made_at: float | None = None) -> None:
        """New tokens of sample `index` and the text the engine released with them (a
        continuing run's text is the seam's): to the tap, with the wall time of the step that
        made them (`made_at`, live runs)."""
        index = (self.index or 0) if index is None else index
        prog = self.of(index)
        prog.new_ids += token_ids
        if logprobs is not None:
            prog.logprobs += logprobs
        stamp = {"made_at": made_at} if made_at is not None else {}
        if self.seam is None:
            self.tap.add(token_ids, text, index=index, logprobs=logprobs, **stamp)
            return
        released, cut = self.seam.feed(token_ids)
        if cut is not None:
            self.cut = cut
            if self.task is not None and not self.task.done():
                self.task.cancel()  # vLLM aborts the request
            return
        self.tap.add(token_ids, released if self.detokenize else "", index=index,
                     logprobs=logprobs, **stamp)


class StreamWatch:
    """Reads the watched requests' progress out of an AsyncLLM every `period` seconds."""

    def __init__(self, llm, period: float):
        self._llm = llm
        self.period = period
        self._runs: dict[str, WatchedRun] = {}
        self._live: dict[str, WatchedRun] = {}  # read after every step (module docstring)
        self._task: asyncio.Task | None = None
        self._hooked = False
        self.ticks = 0
        self.step_reads = 0

    def watch(self, request_id: str, run: WatchedRun) -> None:
        """Start reading `request_id` (call on the engine's loop): every `period`, or after
        every engine step for a live run."""
        self._runs[request_id] = run
        if run.live:
            self._live[request_id] = run
            self._hook_steps()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ticking())

    def unwatch(self, request_id: str) -> None:
        """Stop reading `request_id`."""
        self._runs.pop(request_id, None)
        self._live.pop(request_id, None)

    def _hook_steps(self) -> None:
        """Wrap the output processor's `process_outputs` (once per engine) so that every
        step's outputs are followed by a read of the live runs."""
        if self._hooked or self._llm is None:
            return
        op = self._llm.output_processor
        inner = op.process_outputs

        def process_outputs(outputs, engine_core_timestamp=None, *args, **kwargs):
            out = inner(outputs, engine_core_timestamp, *args, **kwargs)
            if self._live:
                try:
                    self.after_step(engine_core_timestamp)
                except Exception:  # a read must never take the engine's output loop down
                    log.exception("reading the live requests' tokens after a step failed")
            return out

        op.process_outputs = process_outputs
        self._hooked = True

    def after_step(self, engine_core_timestamp: float | None = None) -> None:
        """Read every live run's new tokens now (an engine step's outputs were just taken
        in), stamped with that step's wall time."""
        if self._llm is None:
            return
        made_at = time.time()
        if engine_core_timestamp is not None:  # EngineCore's monotonic clock, the host's
            made_at -= max(0.0, time.monotonic() - engine_core_timestamp)
        self.step_reads += 1
        op = self._llm.output_processor
        for request_id, run in list(self._live.items()):
            self._read_request(op, request_id, run, made_at)

    def stop(self) -> None:
        """Stop ticking and let go of the engine (it shuts down). The cancelled tick task may
        still wait on the loop; holding the AsyncLLM from it would keep the engine alive to
        interpreter exit, where its __del__ fails on half-torn-down modules."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._llm = None
        self._runs.clear()
        self._live.clear()

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
            self._read_request(op, request_id, run)

    def read_all(self) -> int:
        """Read every watched request's new tokens now, out of turn (an engine frozen for a
        drain: every token it made is then in a tap). Returns how many runs it read. Call on
        the engine's loop."""
        if self._llm is None:
            return 0
        op = self._llm.output_processor
        runs = list(self._runs.items())
        for request_id, run in runs:
            self._read_request(op, request_id, run)
        return len(runs)

    def read_one(self, request_id: str) -> None:
        """Read one request's new tokens now, out of turn (before it is preempted: every token
        it made is then in its tap), with each of its samples' engine requests
        (`<id>~<sample>`). Call on the engine's loop."""
        if self._llm is None:
            return
        op = self._llm.output_processor
        for key, run in list(self._runs.items()):
            if key == request_id or key.startswith(request_id + "~"):
                self._read_request(op, key, run)

    def _read_request(self, op, request_id: str, run: WatchedRun,
                      made_at: float | None = None) -> None:
        if run.cut is not None:
            return
        internal = op.external_req_ids.get(request_id)
        if not internal:
            return
        # n > 1: one request state per sample (vLLM's child requests); else the last one.
        for iid in (list(internal) if run.samples > 1 else internal[-1:]):
            state = op.request_states.get(iid)
            if state is None:  # not in yet, or finished: the final output has the rest
                continue
            self._read(run, state, made_at)
            if run.cut is not None:
                break

    @staticmethod
    def _read(run: WatchedRun, state, made_at: float | None = None) -> None:
        """One sample's new tokens, their text and logprobs, out of its vLLM request state."""
        det = state.detokenizer
        ids = det.output_token_ids
        if not ids:  # nothing generated yet (a run waiting inside vLLM for a slot)
            return
        index = run.index if run.index is not None else state.request_index
        prog = run.of(index)
        fed = len(prog.new_ids)
        if run.want_prompt_logprobs and run.prompt_logprobs is None:
            # A token was generated, so the prefill (which made them) is complete.
            run.prompt_logprobs = list(state.logprobs_processor.prompt_logprobs or ())
            run.prompt_ids = list(state.prompt_token_ids or ())
        if len(ids) <= fed:
            return
        if run.tap.prompt_ids is None:
            run.tap.set_prompt(list(state.prompt_token_ids or ()))
        new = list(ids[fed:])
        lps = None
        if run.convert is not None:
            raw = state.logprobs_processor.logprobs or []
            new = new[:max(0, len(raw) - fed)]  # never a token without its logprobs
            if not new:
                return
            lps = run.convert(index, new, list(raw[fed:fed + len(new)]), list(prog.new_ids))
        text = getattr(det, "output_text", "")
        released = max(prog.fed_chars, len(text) - getattr(det, "stop_buffer_length", 0))
        if len(new) < len(ids) - fed:  # tokens held back: so is their text
            released = prog.fed_chars
        new_text = text[prog.fed_chars:released]
        prog.fed_chars = released
        run.feed(new, new_text, index, lps, made_at)
