"""Producer-side admission: everything `generate.apply_async` checks before it publishes.

Checks that need only the request and the registry happen here, so a bad request raises a typed
RequestError in the producer and nothing reaches Redis: schema (app/requests/schemas.py), model known,
prompt bytes under `max_prompt_bytes`, `max_tokens` within the model's context and the cap, token
prompts within `max_model_len` and the vocabulary. A text prompt's token count needs the tokenizer,
so `prompt_too_long` for text is found by the engine, at once, on the first attempt.
"""
from __future__ import annotations

import json

from app.errors import (INVALID_REQUEST, OVERLOADED, PROMPT_TOO_LONG, TOKEN_OUT_OF_VOCAB,
                        RequestError, TransientError)
from app.state.keys import PENDING
from app.requests.models import ModelRegistry, ModelSpec
from app.requests.schemas import GenerateRequest, parse_request
from app.settings import VigilSettings

# A worker refuses a message this long past the request's deadline without running it; the
# deadline itself is enforced by Vigil (a typed deadline_exceeded), this is the backstop.
EXPIRES_GRACE_S = 300.0


def admit(kwargs: object, settings: VigilSettings, registry: ModelRegistry
          ) -> tuple[GenerateRequest, ModelSpec]:
    """Validate a submission; returns the request and its pool's spec or raises RequestError."""
    req = parse_request(kwargs)
    spec = registry.get(req.model)
    check_prompt_size(req, settings)
    limit = min(settings.max_tokens_cap, spec.max_model_len or settings.max_tokens_cap)
    if req.max_tokens > limit:
        raise RequestError.of(INVALID_REQUEST, f"max_tokens={req.max_tokens} is above {limit}, "
                              f"the most {spec.name} can generate")
    ids = req.prompt_token_ids
    if ids is not None:
        if spec.max_model_len and len(ids) > spec.max_model_len:
            raise RequestError.of(PROMPT_TOO_LONG, f"prompt has {len(ids)} tokens; {spec.name} "
                                  f"accepts at most {spec.max_model_len}")
        if spec.vocab_size and max(ids) >= spec.vocab_size:
            bad = next(t for t in ids if t >= spec.vocab_size)
            raise RequestError.of(TOKEN_OUT_OF_VOCAB, f"token id {bad} is out of vocabulary "
                                  f"({spec.name} has {spec.vocab_size} tokens)")
    if req.lora is not None:
        adapter_for(req, spec, settings, registry)
    return req, spec


def check_prompt_size(req: GenerateRequest, settings: VigilSettings) -> None:
    """RequestError(invalid_request) when the prompt is over `max_prompt_bytes`: checked at
    submit and again in the worker, so an oversized prompt sent around the producer never
    reaches the tokenizer."""
    size = req.prompt_bytes()
    if size > settings.max_prompt_bytes:
        raise RequestError.of(INVALID_REQUEST, f"prompt is {size} bytes; the limit is "
                              f"{settings.max_prompt_bytes} (VIGIL_MAX_PROMPT_BYTES)")


def overloaded(req: GenerateRequest, settings: VigilSettings, *, pool_full: bool
               ) -> TransientError:
    """The `overloaded` error for a submit refused by backpressure (the job's cap, or with
    `pool_full` the pool's): says which cap, and when to try again. The advice is the longest
    backoff Vigil itself uses (`retry_backoff_max`): a backlog at a cap of thousands of requests
    does not clear faster than that."""
    if pool_full:
        what, cap, var = f"pool {req.pool!r}", settings.max_pending_per_pool, "POOL"
    else:
        what, cap, var = f"job {req.job!r}", settings.max_pending_per_job, "JOB"
    return TransientError.of(OVERLOADED, f"{what} has {cap} open requests, its cap "
                             f"(VIGIL_MAX_PENDING_PER_{var}); nothing was sent: retry in "
                             f"~{settings.retry_backoff_max:g} s")


def adapter_for(req: GenerateRequest, spec: ModelSpec, settings: VigilSettings,
                registry: ModelRegistry):
    """The AdapterRef a LoRA request names; RequestError(invalid_request) if the model serves no
    adapters or the name/path is not allowed (app/requests/adapters.py)."""
    from app.requests.adapters import resolve_adapter

    if spec.max_loras == 0:
        raise RequestError.of(INVALID_REQUEST, f"model {spec.name} serves no LoRA adapters")
    return resolve_adapter(req.lora, spec.name, registry.adapters, settings.adapter_roots)


def effective_deadline(req: GenerateRequest, default: float) -> float:
    """Seconds from submission until the request must have ended."""
    return req.deadline_s if req.deadline_s is not None else default


def record_fields(req: GenerateRequest, now: float, default_deadline: float) -> dict:
    """The fields of a new PENDING request record (app/state/keys.py lists them)."""
    return {
        "status": PENDING, "model": req.model, "pool": req.pool, "job": req.job,
        **({"lora": req.lora} if req.lora is not None else {}),
        "request": json.dumps(wire_kwargs(req)), "created_at": now,
        "deadline_at": now + effective_deadline(req, default_deadline),
        "attempts": 0, "dispatch": 0,
    }


def wire_kwargs(req: GenerateRequest) -> dict:
    """The message kwargs for a validated request (JSON-safe, defaults omitted)."""
    return req.model_dump(mode="json", exclude_none=True, exclude_defaults=True) | {
        "model": req.model, "schema_version": req.schema_version}
