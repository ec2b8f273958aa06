"""The real engine: a warm vLLM AsyncLLM for one model, built on the host's loop thread.

vLLM is imported inside the functions that need it (it is heavy and optional: the producer side
and the operator tools never load it).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os

from app.requests.adapters import AdapterRef
from app.requests.model_files import ensure_model_files
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from app.requests.tiers import INTERACTIVE, engine_priority
from workers.engine.add_batch import AddBatch
from workers.engine.classify import classify_core_failure
from workers.engine.front_end import lighten, release
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
from workers.engine.vllm_pause import Pauses
from workers.engine.ticket import is_short
from workers.engine.waves import Waves
from workers.engine.witness import Witness
from workers.engine.token_tap import TokenTap

log = logging.getLogger("vigil.engine")


class VllmEngine(Pauses):
    """A warm vLLM AsyncLLM for one model. Build it on the host's event loop thread."""

    streams = True  # `run` takes a token stream tap (workers/streaming.py)
    # (the worker's engine error file, where this engine's records begin): set by its factory
    # (workers/engine/kinds.py), read by `death_cause`.
    core_log = None
    _death_cause: object = False  # not read yet
    grammar_resumes = True  # a continuing run's grammar is advanced in EngineCore (resume.py)

    def __init__(self, spec: ModelSpec, plan: MemoryPlan | None = None, *,
                 witness: Witness | None = None, extra_args: dict | None = None,
                 wave_window: float = 0.0):
        """Build the engine for `spec` (its recipe: workers/engine/vllm_args.py), with
        `extra_args` over the recipe's (the drill engine's additions). Runs that arrive while
        others are in it enter in waves at most `wave_window` seconds apart, or as soon as a
        wave fills one engine step (workers/engine/waves.py; 0: each at once)."""
        engine_env_defaults()
        self.witness = witness
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
        scheduler = self._llm.vllm_config.scheduler_config
        self.max_num_seqs = scheduler.max_num_seqs
        self._waves = Waves(wave_window, self.max_num_seqs, scheduler.max_num_batched_tokens)
        self.grammar_resumes = grammar_resumes(self._llm.vllm_config)
        self.steps = StepCounter(self._llm)
        # A turn's adds reach EngineCore together: its next step can take the whole wave
        # (add_batch.py).
        self.add_batch = AddBatch.install(self._llm.engine_core)
        self._render = PromptRenderer(self._llm)  # a run's prompt for vLLM (render.py)
        lighten(self._llm)  # vLLM's per-request constants, worked out once (front_end.py)

    @property
    def progress(self) -> int:
        """Batches of outputs EngineCore sent so far: the stall watchdog's proof of progress."""
        return self.steps.steps

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
        app/requests/tiers.py); its final output. A short run of a tier that is not interactive
        enters with the engine's next wave, every other run at once (workers/engine/waves.py)."""
        final = None
        at_once = priority == engine_priority(INTERACTIVE) or not is_short(params.max_tokens)
        tokens = len(prompt.get("prompt_token_ids") or ()) if isinstance(prompt, dict) else 0
        async with self._waves.entry(at_once, tokens):  # waves.py
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
        release()  # the environment cache `lighten` made (front_end.py)
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
