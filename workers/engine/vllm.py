"""The real engine: a warm vLLM AsyncLLM for one model, built on the host's loop thread.

vLLM is imported inside the functions that need it (it is heavy and optional: the producer side
and the operator tools never load it).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
from typing import Callable

from app.requests.adapters import AdapterRef
from app.requests.model_files import ensure_model_files
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from app.requests.tiers import INTERACTIVE, engine_priority
from workers.engine.classify import classify_core_failure
from workers.engine.logprobs import cumulative, sample_entries
from workers.engine.memory import MemoryPlan
from workers.engine.output import EngineOutput, Sample
from workers.engine.processes import descendants, engine_core_pids
from workers.engine.render import PromptRenderer
from workers.engine.resume import (Seam, fast_decoder, grammar_resumes, logprob_decoder, refusal,
                                   unsound)
from workers.engine.sampling import Continuation, sampling_params
from workers.engine.step_counter import StepCounter
from workers.engine.stream_watch import StreamWatch, WatchedRun
from workers.engine.vllm_args import engine_args, engine_env_defaults
from workers.engine.vllm_output import output_of, prompt_logprobs, top_count
from workers.engine.waves import Waves
from workers.engine.witness import Witness
from workers.engine.token_tap import TokenTap

log = logging.getLogger("vigil.engine")
# A preempted run's pause (`yield_run`): about one engine step, bounded.
YIELD_PAUSE_S = 2.0


class VllmEngine:
    """A warm vLLM AsyncLLM for one model. Build it on the host's event loop thread."""

    streams = True  # `run` takes a token stream tap (workers/streaming.py)
    # (the worker's engine error file, where this engine's records begin): set by its factory
    # (workers/engine/kinds.py), read by `death_cause`.
    core_log = None
    _death_cause: object = False  # not read yet
    grammar_resumes = True  # a continuing run's grammar is advanced in EngineCore (resume.py)
    _frozen = False  # frozen for a drain: a yield does not resume it
    _pause_lock_: asyncio.Lock | None = None

    def __init__(self, spec: ModelSpec, plan: MemoryPlan | None = None, *,
                 witness: Witness | None = None, extra_args: dict | None = None,
                 wave_window: float = 0.0):
        """Build the engine for `spec` (its recipe: workers/engine/vllm_args.py), with
        `extra_args` over the recipe's (the drill engine's additions). Runs that arrive while
        others are in it enter in waves at most `wave_window` seconds apart
        (workers/engine/waves.py; 0: each at once)."""
        engine_env_defaults()
        self.witness = witness
        self._waves = Waves(wave_window)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(spec, plan)
        extra = dict(extra_args or {})
        if "logits_processors" in extra:  # the recipe's processors stay, the extra ones after
            extra["logits_processors"] = [*args.get("logits_processors", ()),
                                          *extra["logits_processors"]]
        args = {**args, **extra}
        self.spec = spec
        self._llm = None
        self._watch: StreamWatch | None = None  # made by the first streamed run
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=ensure_model_files(spec), **args))
        self.max_model_len = self._llm.vllm_config.model_config.max_model_len
        self.max_num_seqs = self._llm.vllm_config.scheduler_config.max_num_seqs
        self.grammar_resumes = grammar_resumes(self._llm.vllm_config)
        self.steps = StepCounter(self._llm)
        self._render = PromptRenderer(self._llm)  # a run's prompt for vLLM (render.py)

    @property
    def progress(self) -> int:
        """Batches of outputs EngineCore sent so far: the stall watchdog's proof of progress."""
        return self.steps.steps

    def read_now(self, request_id: str) -> None:
        """Read `request_id`'s tokens into its tap now (workers/engine/stream_watch.py): the
        engine host calls it on the loop right before the request yields its slot."""
        if self._watch is not None:
            self._watch.read_one(request_id)

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
                    op = self._llm.output_processor
                    ids = [i for key, ids in list(op.external_req_ids.items())
                           if key == request_id or key.startswith(request_id + "~")
                           for i in ids]
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

    def kill(self) -> None:
        """SIGKILL this engine's EngineCore: a stopped or wedged process ignores a polite stop."""
        for pid in engine_core_pids():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    @property
    def dead(self) -> bool:
        return self._llm is None or bool(self._llm.errored)

    async def run(self, req: GenerateRequest, request_id: str,
                  adapter: AdapterRef | None = None, tap: TokenTap | None = None) -> EngineOutput:
        """Generate to completion (with `adapter`, already loaded by `add_adapter`); engine
        exceptions propagate unclassified. With a `tap` (workers/streaming.py) the new tokens
        (and their logprobs) go to the request's token stream while it runs, and the run
        continues from the tap's resume point, if it has one and may (workers/engine/resume.py):
        each of the request's samples from its own tokens."""
        prio = engine_priority(req.priority)
        cp, seams = self._resume_point(req, tap) if tap is not None else (None, None)
        if cp is None and (tap is None or req.max_tokens <= 1):
            # Unstreamed, or it ends within its first step: nothing to read before its result,
            # which carries its token to the stream's readers (workers/streaming.py).
            final = await self._final(self._render(req), sampling_params(req), request_id,
                                      adapter, prio)
            self._witness_final(request_id, final)
            return output_of(final, req, tap.resumed_at if tap is not None else None)
        if cp is None:
            run = WatchedRun(tap, samples=req.n, convert=self._converter(req, None))
            final = await self._watched(self._render(req), sampling_params(req), request_id,
                                        adapter, run, prio)
            self._witness_final(request_id, final)
            return output_of(final, req, tap.resumed_at)
        tap.took_over()
        runs = [self._continue(req, request_id, adapter, tap, cp, i, seams[i])
                for i in range(req.n)]
        done = await _all_or_none(runs)
        return EngineOutput.of([s for s, _ in done], len(cp.prompt_ids), done[0][1])

    def _resume_point(self, req: GenerateRequest, tap: TokenTap | None):
        """The checkpoint this run continues and a seam per sample, or (None, None): nothing
        to continue, or a continuation that would be unsound (refused: the stream restarts)."""
        cp = tap.resume_point()
        if cp is None:
            return None, None
        why = unsound(req, self.grammar_resumes)
        for i in range(req.n):
            why = why or refusal(cp.sample(i), max_tokens=req.max_tokens,
                                 max_model_len=self.max_model_len,
                                 adapter_fingerprint=tap.adapter_fingerprint)
        if not why:
            try:
                dec = fast_decoder(self._llm.tokenizer, req.skip_special_tokens)
                return cp, [Seam(cp.sample(i), req.stop, dec, req.include_stop_str_in_output,
                                 req.min_tokens) for i in range(req.n)]
            except ValueError as e:
                why = str(e)
            except Exception as e:  # a tokenizer `tokenizers` cannot step (not a fast one)
                why = f"its tokens cannot be decoded here ({type(e).__name__}: {e})"
        tap.refuse_resume(why)
        return None, None

    def _converter(self, req: GenerateRequest, context):
        """The logprob conversion of a watched run (None without logprobs). A continuing run
        is not detokenized by vLLM: its entries are decoded here, each sample with the tokens
        it made before (`context(index)`)."""
        if req.logprobs is None and req.logprob_token_ids is None:
            return None
        k, named = top_count(req), req.logprob_token_ids
        decode = self._logprob_decode(req) if context is not None else None

        def convert(index, ids, raw, before):
            ctx = (context(index) + list(before)) if context is not None else None
            return sample_entries(ids, raw, k, named, decode, ctx)

        return convert

    def _logprob_decode(self, req: GenerateRequest):
        """Decoding of logprob tokens for runs vLLM does not detokenize (None: not wanted)."""
        return logprob_decoder(self._llm.tokenizer) if req.detokenize else None

    async def _final(self, prompt: dict, params, request_id: str, adapter, priority: int = 0):
        """One engine request to its end (at vLLM priority `priority`: its tier's,
        app/requests/tiers.py); its final output."""
        final = None
        async with self._waves.entry(priority == engine_priority(INTERACTIVE)):  # waves.py
            async for out in self._llm.generate(prompt, params, request_id=request_id,
                                                lora_request=self._lora(adapter),
                                                priority=priority):
                final = out
        return final

    async def _watched(self, prompt: dict, params, request_id: str, adapter, run: WatchedRun,
                       priority: int = 0):
        """One engine request, read while it runs by the engine's StreamWatch; its final
        output, or None when its seam cut it (a stop string: the request was cancelled)."""
        if self._watch is None:
            self._watch = StreamWatch(self._llm, run.tap.watch_period)
        run.task = asyncio.ensure_future(self._final(prompt, params, request_id, adapter,
                                                     priority))
        self._watch.watch(request_id, run)
        final = None
        try:
            final = await run.task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if run.cut is None or (me is not None and me.cancelling()):
                raise
        finally:
            self._watch.unwatch(request_id)
            if not run.task.done():
                run.task.cancel()
        return final

    async def _continue(self, req: GenerateRequest, request_id: str, adapter, tap, cp,
                        index: int, seam: Seam):
        """Sample `index` continued from its tokens in `cp`: (its Sample, the prompt's logprob
        entries from sample 0's run, else None)."""
        c = cp.sample(index)
        wants = req.logprobs is not None or req.logprob_token_ids is not None
        if c.tokens >= req.max_tokens:
            # It had made them all and only the result was lost (a guard: the engine's last
            # tokens reach the stream only with the result).
            if self.witness is not None:
                self.witness.finished(request_id, 0, c.tokens, sample=index)
            seam.finish()
            return Sample(index, seam.text if req.detokenize else "", c.token_ids, "length",
                          c.logprobs if wants else None,
                          cumulative(c.logprobs or []) if wants else None,
                          tap.resumed_at_of(index)), None
        prompt_ids = list(cp.prompt_ids)
        run = WatchedRun(tap, seam, index=index,
                         convert=self._converter(req, lambda i: list(c.token_ids)),
                         want_prompt_logprobs=req.prompt_logprobs is not None and index == 0,
                         detokenize=req.detokenize)
        eid = request_id if req.n == 1 else f"{request_id}~{index}"  # vLLM ids are unique
        final = await self._watched({"prompt_token_ids": prompt_ids + list(c.token_ids)},
                                    sampling_params(req, Continuation(index, c.tokens)),
                                    eid, adapter, run, engine_priority(req.priority))
        lps_new = run.own.logprobs if wants else None
        if final is not None:  # the tokens after the last tick may hold a stop string too
            comp = final.outputs[0]
            ids, finish = list(comp.token_ids), comp.finish_reason
            if finish == "error":  # e.g. its grammar refused the prefix (resume_grammar.py)
                raise RuntimeError(f"the engine failed the run continuing sample {index} "
                                   f"from its {c.tokens} tokens")
            if run.cut is None:  # "stop" here is a stop token: the engine has no stop strings
                run.cut = run.seam.feed(ids[run.fed:], stop_terminated=finish == "stop")[1]
            if wants and comp.logprobs is not None:
                lps_new = run.convert(index, ids, list(comp.logprobs), [])
        else:
            ids, finish = run.new_ids, "stop"
        if run.cut is not None:  # a stop string: end as an unbroken run ends
            ids, text, finish = ids[:run.cut.tokens], run.cut.text, "stop"
        else:
            run.seam.finish()
            text = run.seam.text
        lps = (list(c.logprobs or []) + list(lps_new or [])[:len(ids)]) if wants else None
        if self.witness is not None:
            self.witness.finished(request_id, len(ids), c.tokens, sample=index)
        plp = None
        if index == 0 and req.prompt_logprobs is not None:
            raw = final.prompt_logprobs if final is not None else run.prompt_logprobs
            if raw is not None:
                plp = prompt_logprobs(prompt_ids + list(c.token_ids), list(raw), req,
                                      len(prompt_ids), self._logprob_decode(req))
        return Sample(index, text if req.detokenize else "", list(c.token_ids) + ids, finish,
                      lps, cumulative(lps) if lps is not None else None,
                      tap.resumed_at_of(index)), plp

    def _witness_final(self, request_id: str, final) -> None:
        """Write down a run from the prompt: its first sample's tokens, and with n > 1 every
        sample's (one engine request made them all)."""
        if self.witness is None:
            return
        lens = [len(c.token_ids) for c in sorted(final.outputs, key=lambda c: c.index)]
        self.witness.finished(request_id, lens[0], samples=lens if len(lens) > 1 else None)

    @staticmethod
    def _lora(adapter: AdapterRef | None):
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.lora_int_id(), adapter.path)

    async def add_adapter(self, adapter: AdapterRef) -> None:
        """Load `adapter` into the live engine; raises (the engine survives) if it is unusable."""
        if not await self._llm.add_lora(self._lora(adapter)):
            raise RuntimeError("the engine refused the adapter")

    async def remove_adapter(self, adapter: AdapterRef) -> None:
        """Unload `adapter` (its slot goes to another one)."""
        await self._llm.remove_lora(adapter.lora_int_id())

    def child_pids(self) -> list[tuple[int, float]]:
        """(pid, create_time) of every process this engine started (EngineCore, workers)."""
        return descendants()

    def death_cause(self):
        """What this dead engine's EngineCore said of its death (read once): a VigilError for a
        CUDA fault (`classify_core_failure`), else None (the requests are suspects)."""
        if self._death_cause is False:
            self._death_cause = None
            if self.core_log is not None:
                log, mark = self.core_log
                self._death_cause = classify_core_failure(log.failure_since(mark),
                                                          self.core_exit_codes())
        return self._death_cause

    def core_exit_codes(self) -> dict:
        """Exit codes of this engine's EngineCore processes that have exited, by name."""
        try:
            return dict(self._llm.engine_core.resources.engine_manager.finished_procs())
        except AttributeError:  # shut down, or an in-process engine core
            return {}

    def shutdown(self, timeout: float) -> None:
        """Stop the engine and its processes; safe to call twice.

        The AsyncLLM is released and collected here, while the interpreter is whole: left to
        interpreter exit, its __del__ calls shutdown again with half-torn-down modules and prints
        a TypeError (docs/field-notes.md).
        """
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._watch is not None:
            self._watch.stop()
        llm.shutdown(timeout=timeout)
        del llm
        gc.collect()


async def _all_or_none(coros: list) -> list:
    """Await every coroutine; when one raises (or this task is cancelled), cancel the rest and
    raise it: the runs of one request's samples live and die together."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
