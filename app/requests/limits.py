"""The request's bounds that depend on the model or the settings, checked at submit and again
in the worker (a message can bypass the producer): `n` under VIGIL_MAX_N, token ids inside the
model's vocabulary, `prompt_logprobs` with n > 1 refused on a model serving LoRA adapters, and
the result's size (its logprob entries) under VIGIL_MAX_LOGPROB_ENTRIES. The schema
(app/requests/schemas.py) checks everything else."""
from __future__ import annotations

from app.errors import INVALID_REQUEST, TOKEN_OUT_OF_VOCAB, RequestError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from app.settings import VigilSettings


def check_limits(req: GenerateRequest, spec: ModelSpec, settings: VigilSettings) -> None:
    """RequestError naming the bound `req` breaks: invalid_request for `n`, for
    `prompt_logprobs` with n > 1 on a model with LoRA adapters (max_loras > 0), or for the
    result's size; token_out_of_vocab for a token id the model does not have (when the registry
    knows its vocabulary)."""
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
