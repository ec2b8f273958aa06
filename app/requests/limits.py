"""The request's bounds that depend on the model or the settings, part of the one admit
(app/requests/admit.py: at submit and again in the worker): `max_tokens` within the model's
context and VIGIL_MAX_TOKENS_CAP, a token prompt within `max_model_len`, `n` under VIGIL_MAX_N,
token ids inside the model's vocabulary, `prompt_logprobs` with n > 1 refused on a model serving
LoRA adapters, and the result's size (its logprob entries) under VIGIL_MAX_LOGPROB_ENTRIES. The
schema (app/requests/schemas.py) checks everything else."""
from __future__ import annotations

from app.errors import INVALID_REQUEST, PROMPT_TOO_LONG, TOKEN_OUT_OF_VOCAB, RequestError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from app.settings import VigilSettings


def check_limits(req: GenerateRequest, spec: ModelSpec, settings: VigilSettings) -> None:
    """RequestError naming the bound `req` breaks: invalid_request for `max_tokens` or `n`, for
    `prompt_logprobs` with n > 1 on a model with LoRA adapters (max_loras > 0), or for the
    result's size; token_out_of_vocab for a token id the model does not have (when the registry
    knows its vocabulary); prompt_too_long for a token prompt over the model's context."""
    check_model_bounds(req, spec, settings)
    if req.n > settings.max_n:
        raise RequestError.of(INVALID_REQUEST, f"n={req.n} is above {settings.max_n}, the most "
                              "samples of one prompt a request may ask for (VIGIL_MAX_N)")
    if spec.vocab_size:
        for name in ("logprob_token_ids", "stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(req, name)
            if ids and max(int(t) for t in ids) >= spec.vocab_size:
                bad = next(int(t) for t in ids if int(t) >= spec.vocab_size)
                raise RequestError.of(TOKEN_OUT_OF_VOCAB, f"{name}: token id {bad} is out of "
                                      f"vocabulary ({spec.name} has {spec.vocab_size} tokens)")
    if req.n > 1 and req.prompt_logprobs is not None and spec.max_loras:
        # vLLM 0.32 runs the samples as child requests, each computing the prompt's logprobs in
        # one batch: on an engine with LoRA enabled that kills EngineCore (docs/field-notes.md).
        raise RequestError.of(INVALID_REQUEST, f"prompt_logprobs with n > 1 cannot run on "
                              f"{spec.name}, which serves LoRA adapters (vLLM 0.32's engine "
                              "dies computing the prompt's logprobs for several samples at "
                              "once); ask for them with n=1: the prompt's logprobs are the same "
                              "for every sample")
    entries = logprob_entries(req)
    if entries > settings.max_logprob_entries:
        raise RequestError.of(INVALID_REQUEST, f"the result would hold up to {entries:,} "
                              f"logprob entries (n x max_tokens x (1 + logprobs), plus the "
                              f"prompt's); the limit is {settings.max_logprob_entries:,} "
                              "(VIGIL_MAX_LOGPROB_ENTRIES)")


def check_model_bounds(req: GenerateRequest, spec: ModelSpec, settings: VigilSettings) -> None:
    """RequestError when `max_tokens` is over what the model can generate (its context, and
    VIGIL_MAX_TOKENS_CAP), or a token prompt is longer than the model's context
    (prompt_too_long) or names a token the model does not have (token_out_of_vocab). A text
    prompt's length needs the tokenizer: the engine finds it too long, at once."""
    limit = min(settings.max_tokens_cap, spec.max_model_len or settings.max_tokens_cap)
    if req.max_tokens > limit:
        raise RequestError.of(INVALID_REQUEST, f"max_tokens={req.max_tokens} is above {limit}, "
                              f"the most {spec.name} can generate")
    ids = req.prompt_token_ids
    if ids is None:
        return
    if spec.max_model_len and len(ids) > spec.max_model_len:
        raise RequestError.of(PROMPT_TOO_LONG, f"prompt has {len(ids)} tokens; {spec.name} "
                              f"accepts at most {spec.max_model_len}")
    if spec.vocab_size and max(ids) >= spec.vocab_size:
        bad = next(t for t in ids if t >= spec.vocab_size)
        raise RequestError.of(TOKEN_OUT_OF_VOCAB, f"token id {bad} is out of vocabulary "
                              f"({spec.name} has {spec.vocab_size} tokens)")


def per_token(req: GenerateRequest) -> int:
    """Logprob entries per generated token: the sampled token's and its alternatives (the top
    `logprobs`, or the named `logprob_token_ids`); 0 without logprobs."""
    if req.logprobs is None and req.logprob_token_ids is None:
        return 0
    return 1 + max(req.logprobs or 0, len(req.logprob_token_ids or ()))


def logprob_entries(req: GenerateRequest) -> int:
    """The most logprob entries `req`'s result can hold. A text prompt is counted as its bytes
    plus one (no tokenizer here: a token holds at least a byte, and BOS comes first)."""
    out = req.n * req.max_tokens * per_token(req)
    if req.prompt_logprobs is not None:
        prompt = len(req.prompt_token_ids) if req.prompt_token_ids is not None \
            else req.prompt_bytes() + 1
        out += prompt * (1 + req.prompt_logprobs)
    return out
