"""Producer-side admission: everything `generate.apply_async` checks before it publishes.

Checks that need only the request and the registry happen here, so a bad request raises a typed
RequestError in the producer and nothing reaches Redis: schema (app/schemas.py), model known,
prompt bytes under `max_prompt_bytes`, `max_tokens` within the model's context and the cap, token
prompts within `max_model_len` and the vocabulary. A text prompt's token count needs the tokenizer,
so `prompt_too_long` for text is found by the engine, at once, on the first attempt.
"""
from __future__ import annotations

import json

from app.errors import INVALID_REQUEST, PROMPT_TOO_LONG, TOKEN_OUT_OF_VOCAB, RequestError
from app.keys import PENDING
from app.models import ModelRegistry, ModelSpec
from app.schemas import GenerateRequest, parse_request
from app.settings import VigilSettings

# A worker refuses a message this long past the request's deadline without running it; the
# deadline itself is enforced by Vigil (a typed deadline_exceeded), this is the backstop.
EXPIRES_GRACE_S = 300.0


def admit(kwargs: object, settings: VigilSettings, registry: ModelRegistry
          ) -> tuple[GenerateRequest, ModelSpec]:
    """Validate a submission; returns the request and its pool's spec or raises RequestError."""
    req = parse_request(kwargs)
    spec = registry.get(req.model)
    size = req.prompt_bytes()
    if size > settings.max_prompt_bytes:
        raise RequestError.of(INVALID_REQUEST, f"prompt is {size} bytes; the limit is "
                              f"{settings.max_prompt_bytes} (VIGIL_MAX_PROMPT_BYTES)")
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


def adapter_for(req: GenerateRequest, spec: ModelSpec, settings: VigilSettings,
                registry: ModelRegistry):
    """The AdapterRef a LoRA request names; RequestError(invalid_request) if the model serves no
    adapters or the name/path is not allowed (app/adapters.py)."""
    from app.adapters import resolve_adapter

    if spec.max_loras == 0:
        raise RequestError.of(INVALID_REQUEST, f"model {spec.name} serves no LoRA adapters")
    return resolve_adapter(req.lora, spec.name, registry.adapters, settings.adapter_roots)


def effective_deadline(req: GenerateRequest, default: float) -> float:
    """Seconds from submission until the request must have ended."""
    return req.deadline_s if req.deadline_s is not None else default


def record_fields(req: GenerateRequest, now: float, default_deadline: float) -> dict:
    """The fields of a new PENDING request record (app/keys.py lists them)."""
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
