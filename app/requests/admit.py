"""Admitting a request: the one check a request passes before anything of it is written, run
by the producer at submit (app/requests/submit.py) and again by the worker on every delivery (a
message can bypass the producer: `send_task`, a raw queue push).

`admit` validates the request and returns it with its pool's spec and its LoRA adapter; a bad one
raises RequestError: schema (app/requests/schemas.py), model known, prompt bytes under
`max_prompt_bytes`, the bounds that depend on the model or the settings (app/requests/limits.py),
a structured output the model's backend compiles (app/requests/structured.py), a LoRA adapter
allowed. The tier a Celery `priority=` picks is read here too (`with_celery_priority`,
`with_delivery_priority`).
"""
from __future__ import annotations

from app.errors import INVALID_REQUEST, PROMPT_TOO_LONG, TOKEN_OUT_OF_VOCAB, RequestError
from app.requests.adapters import AdapterRef, resolve_adapter
from app.requests.limits import check_limits
from app.requests.models import ModelRegistry, ModelSpec
from app.requests.schemas import GenerateRequest, parse_request
from app.requests.structured import backend_of, check_compiles
from app.requests.tiers import tier_of_celery_priority
from app.settings import VigilSettings


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
    check_limits(req, spec, settings)
    if req.structured is not None:
        check_compiles(req.structured, backend_of(spec.engine_args), spec.name)
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


def adapter_for(req: GenerateRequest, spec: ModelSpec, settings: VigilSettings,
                registry: ModelRegistry) -> AdapterRef:
    """The AdapterRef a LoRA request names; RequestError(invalid_request) if the model serves no
    adapters or the name/path is not allowed (app/requests/adapters.py)."""
    if spec.max_loras == 0:
        raise RequestError.of(INVALID_REQUEST, f"model {spec.name} serves no LoRA adapters")
    return resolve_adapter(req.lora, spec.name, registry.adapters, settings.adapter_roots)


def with_celery_priority(kwargs: object, priority: object) -> object:
    """`kwargs` with the tier that Celery's `priority=` option picks (app/requests/tiers.py),
    unless the request names its own `priority`; RequestError(invalid_request) for a priority
    that is not an int 0-9."""
    if priority is None or not isinstance(kwargs, dict) or "priority" in kwargs:
        return kwargs
    if type(priority) is not int or not 0 <= priority <= 9:
        raise RequestError.of(INVALID_REQUEST, f"priority={priority!r}: Celery's priority is an "
                              "int 0-9 (0 first), or name the tier: priority='interactive', "
                              "'default' or 'bulk'")
    return {**kwargs, "priority": tier_of_celery_priority(priority)}


def with_delivery_priority(kwargs: object, delivery_info: dict | None) -> object:
    """`kwargs` of a delivered message with the tier its Celery message priority picks
    (`with_celery_priority`), unless the request names its own: a message sent around the
    producer (`app.send_task("vigil.generate", kwargs=..., priority=9)`) is bulk as
    `apply_async(priority=9)` would have made it. Priority 0 names no tier here: kombu's Redis
    transport gives every message published without a priority 0, so a plain `send_task`
    cannot be told from one that asked for 0 (it stays default; `priority=1` or 2, or the
    `priority` field, makes it interactive). Vigil's own messages carry their tier in their
    kwargs (app/requests/publish.py). Anything but an int 1-9 is left alone."""
    prio = (delivery_info or {}).get("priority")
    if type(prio) is not int or not 1 <= prio <= 9:
        return kwargs
    return with_celery_priority(kwargs, prio)
