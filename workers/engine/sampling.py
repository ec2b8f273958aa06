"""A request's sampling fields mapped onto vLLM 0.32's SamplingParams: the one place they meet
(docs/api.md, "Request fields", says what vLLM does with each).

A run from the prompt asks for everything the request says, `n` samples in one engine request
(vLLM's parallel sampling: the samples share the prompt's KV cache). A run that continues a
checkpoint (workers/engine/resume.py) continues one sample: its prompt is the request's prompt
followed by that sample's tokens so far, so it asks for one sample, the tokens still to make,
what is left of `min_tokens`, the sample's own seed (vLLM seeds sample i of a request with
`seed + i`), and token ids only: its text and stop strings are Vigil's (the Seam); sample 0's
run alone asks for the prompt's logprobs. It tells EngineCore how many of its prompt's tokens
were generated (workers/engine/resume_marks.py): its structured-output grammar is advanced over
them (workers/engine/resume_grammar.py), and its penalties and bad words count them as
generated (workers/engine/resume_steps.py, which applies the penalties: vLLM is given none).

Each run gets SamplingParams of its own (the request's lists copied into them, as vLLM may
change them in place), so they are marked `skip_clone` where this vLLM has the flag: vLLM then
copies them shallowly as it takes the request in, not deeply (a deep copy was ~20 us of the
engine's loop per request, docs/performance.md).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from app.requests.schemas import GenerateRequest
from workers.engine.resume_marks import Marks, extra_args


@dataclass(frozen=True)
class Continuation:
    """One sample continued from a checkpoint: sample `index`, `made` tokens already generated."""

    index: int
    made: int


def sampling_params(req: GenerateRequest, cont: Continuation | None = None):
    """vLLM's SamplingParams for a run of `req`: from its prompt (`cont` None), or continuing
    one sample (`cont`). Final output only: the front end builds one RequestOutput per request
    instead of one per step (it shares the cores with Celery and Redis: docs/field-notes.md);
    token streams read the progress otherwise (workers/engine/stream_watch.py)."""
    SamplingParams, RequestOutputKind, StructuredOutputsParams = _vllm_types()
    common = dict(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
        stop_token_ids=_copy(req.stop_token_ids), logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs, logprob_token_ids=_copy(req.logprob_token_ids),
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        allowed_token_ids=_copy(req.allowed_token_ids), bad_words=_copy(req.bad_words),
        skip_special_tokens=req.skip_special_tokens, output_kind=RequestOutputKind.FINAL_ONLY,
        **_own(SamplingParams),
    )
    structured = (StructuredOutputsParams(**req.structured.wire())
                  if req.structured is not None else None)
    if cont is None:
        return SamplingParams(
            n=req.n, max_tokens=req.max_tokens, min_tokens=req.min_tokens, seed=req.seed,
            stop=_copy(req.stop), include_stop_str_in_output=req.include_stop_str_in_output,
            detokenize=req.detokenize, structured_outputs=structured, **common)
    # The prompt's logprobs come from sample 0's run (cut at the prompt's end), once.
    common["prompt_logprobs"] = req.prompt_logprobs if cont.index == 0 else None
    penalties = None
    if req.presence_penalty or req.frequency_penalty or req.repetition_penalty != 1.0:
        # Applied in EngineCore over the whole generation (workers/engine/resume_steps.py).
        penalties = (req.presence_penalty, req.frequency_penalty, req.repetition_penalty)
        common.update(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    return SamplingParams(
        n=1, max_tokens=req.max_tokens - cont.made, min_tokens=max(0, req.min_tokens - cont.made),
        seed=None if req.seed is None else req.seed + cont.index, detokenize=False,
        structured_outputs=structured, extra_args=extra_args(Marks(cont.made, penalties)),
        **common)


@functools.cache
def _vllm_types() -> tuple:
    """vLLM's SamplingParams, RequestOutputKind and StructuredOutputsParams, imported once (an
    import statement in `sampling_params` went through vLLM's lazy module attributes for every
    run: ~1.2% of the engine host's loop under one-token requests)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    return SamplingParams, RequestOutputKind, StructuredOutputsParams


def _own(params_type) -> dict:
    """The keyword that marks SamplingParams as this run's own (vLLM need not deep-copy them),
    {} on a vLLM without it."""
    return {"skip_clone": True} if "skip_clone" in getattr(params_type, "__struct_fields__",
                                                           ()) else {}


def _copy(values: list | None) -> list | None:
    """A list of the run's own (None stays None)."""
    return list(values) if values is not None else None
