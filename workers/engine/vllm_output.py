"""vLLM's final RequestOutput as an EngineOutput: every sample, its logprobs as Vigil's JSON
entries (workers/engine/logprobs.py), the prompt's logprobs."""
from __future__ import annotations

from app.requests.schemas import GenerateRequest
from workers.engine.logprobs import prompt_entries, sample_entries
from workers.engine.output import EngineOutput, Sample


def top_count(req: GenerateRequest) -> int:
    """The alternatives vLLM gives per generated token: the named ids, else `logprobs`."""
    return len(req.logprob_token_ids) if req.logprob_token_ids else (req.logprobs or 0)


def sample_of(comp, req: GenerateRequest, resumed_at: list[int] | None = None) -> Sample:
    """One of vLLM's CompletionOutputs as a Sample."""
    lps = None
    if comp.logprobs is not None:
        lps = sample_entries(list(comp.token_ids), comp.logprobs, top_count(req),
                             req.logprob_token_ids)
    return Sample(comp.index, comp.text, list(comp.token_ids), comp.finish_reason, lps,
                  comp.cumulative_logprob if lps is not None else None, list(resumed_at or ()))


def prompt_logprobs_of(final, req: GenerateRequest, prompt_len: int | None = None,
                       decode=None):
    """The prompt's logprob entries of `final` (its first `prompt_len` positions: a resumed
    run's prompt goes on with the tokens it continues), None when not asked for."""
    if req.prompt_logprobs is None or final.prompt_logprobs is None:
        return None
    return prompt_logprobs(list(final.prompt_token_ids or ()), list(final.prompt_logprobs), req,
                           prompt_len, decode)


def prompt_logprobs(ids: list[int], raw: list, req: GenerateRequest,
                    prompt_len: int | None = None, decode=None):
    """The entries of vLLM's prompt logprobs `raw` for prompt `ids`, cut at `prompt_len`."""
    n = len(ids) if prompt_len is None else prompt_len
    return prompt_entries(ids[:n], raw[:n], req.prompt_logprobs, decode)


def output_of(final, req: GenerateRequest, resumed_at: list[int] | None = None) -> EngineOutput:
    """The whole answer of a run from the prompt."""
    samples = [sample_of(c, req, resumed_at) for c in sorted(final.outputs, key=lambda c: c.index)]
    return EngineOutput.of(samples, len(final.prompt_token_ids or ()),
                           prompt_logprobs_of(final, req))
