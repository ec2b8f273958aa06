"""The result dict of a finished request, built from the engine's output (docs/api.md,
"Results"): what `r.get()` returns and what the record stores.

The top-level fields are sample 0's, so a request with `n` = 1 reads as it always did; with
`n` > 1, `choices` holds every sample (sample 0 first). Logprob fields appear only when the
request asked for them. JSON only; bounded by VIGIL_MAX_LOGPROB_ENTRIES at submit
(app/requests/limits.py).

A structured output is checked against its constraint before a result is built from it
(`check_structured`): one the engine broke is a typed error, never a silently invalid result.
"""
from __future__ import annotations

from app.errors import STRUCTURED_OUTPUT_INVALID, TransientError
from app.requests.schemas import GREEDY_BELOW, GenerateRequest
from app.requests.structured import violation
from workers.engine.output import EngineOutput, Sample


def wants_logprobs(req: GenerateRequest) -> bool:
    """Whether the request asked for the generated tokens' logprobs."""
    return req.logprobs is not None or req.logprob_token_ids is not None


def repeats_output(req: GenerateRequest) -> bool:
    """Whether `req` makes the same output on every attempt: greedy, or sampled with a seed
    (app/retry_policy.py `Attempted.repeats`)."""
    return req.temperature < GREEDY_BELOW or req.seed is not None


def check_structured(req: GenerateRequest, out: EngineOutput) -> None:
    """Raise TransientError(structured_output_invalid) when a sample of `out` that the engine
    ended itself breaks `req`'s structured constraint (app/requests/structured.py `violation`:
    a strict JSON parse and the schema, a regex fullmatch, a choice); the retry decision then
    tries a sampled request again and ends a greedy or seeded one. Left unchecked: a request
    without a constraint or with `detokenize` false (no text), and a sample cut by
    `max_tokens` (`finish_reason` "length") or possibly by the request's own `stop` strings or
    `stop_token_ids` (incomplete by the caller's choice, as in vLLM)."""
    s = req.structured
    if s is None or not req.detokenize or req.stop or req.stop_token_ids:
        return
    samples = out.samples or [Sample(0, out.text, out.token_ids, out.finish_reason)]
    for sample in samples:
        if sample.finish_reason != "stop":
            continue
        why = violation(s, sample.text)
        if why:
            which = f"sample {sample.index}'s output" if req.n > 1 else "the output"
            raise TransientError.of(STRUCTURED_OUTPUT_INVALID, (
                f"{which} broke its {s.kind} constraint: {why} (the engine's structured-"
                "output backend let it through)"))


def build_result(request_id: str, req: GenerateRequest, out: EngineOutput, attempts: int,
                 worker: str) -> dict:
    """The result of `req` answered by `out` in attempt `attempts` on `worker`."""
    result = {
        "request_id": request_id, "model": req.model, "text": out.text,
        "token_ids": out.token_ids, "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
        "attempts": attempts, "worker": worker,
        **({"lora": req.lora} if req.lora is not None else {}),
        **({"resumed_at": out.resumed_at} if out.resumed_at else {}),
    }
    if wants_logprobs(req):
        result["logprobs"] = out.logprobs or []
        result["cumulative_logprob"] = out.cumulative_logprob
    if req.prompt_logprobs is not None:
        result["prompt_logprobs"] = out.prompt_logprobs
    if req.n > 1:
        samples = out.samples or [Sample(0, out.text, out.token_ids, out.finish_reason,
                                          out.logprobs, out.cumulative_logprob, out.resumed_at)]
        result["choices"] = [choice(req, s) for s in samples]
    return result


def choice(req: GenerateRequest, s: Sample) -> dict:
    """One sample of an n > 1 result."""
    c = {"index": s.index, "text": s.text, "token_ids": s.token_ids,
         "finish_reason": s.finish_reason, "completion_tokens": len(s.token_ids)}
    if wants_logprobs(req):
        c["logprobs"] = s.logprobs or []
        c["cumulative_logprob"] = s.cumulative_logprob
    if s.resumed_at:
        c["resumed_at"] = s.resumed_at
    return c
