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

from typing import NamedTuple

from app.errors import INVALID_REQUEST, RequestError
from app.requests.adapters import AdapterRef, resolve_adapter
from app.requests.limits import check_limits
from app.requests.models import ModelRegistry, ModelSpec
from app.requests.schemas import GenerateRequest, parse_request
from app.requests.structured import backend_of, check_compiles
from app.requests.tiers import tier_of_celery_priority
from app.settings import VigilSettings


class Admitted(NamedTuple):
    """A request that passed `admit`: the request, its pool's spec, its LoRA adapter (None
    without one)."""

    req: GenerateRequest
    spec: ModelSpec
    adapter: AdapterRef | None


def admit(kwargs: object, settings: VigilSettings, registry: ModelRegistry) -> Admitted:
    """Validate a request (module docstring): the same checks at submit and in the worker.
    Returns the Admitted request or raises RequestError."""
    req = parse_request(kwargs)
    spec = registry.get(req.model)
    check_prompt_size(req, settings)
    check_limits(req, spec, settings)
    if req.structured is not None:
        check_compiles(req.structured, backend_of(spec.engine_args), spec.name)
    adapter = adapter_for(req, spec, settings, registry) if req.lora is not None else None
    return Admitted(req, spec, adapter)


def check_prompt_size(req: GenerateRequest, settings: VigilSettings) -> None:
    """RequestError(invalid_request) when the prompt is over `max_prompt_bytes`: part of
    `admit`, so an oversized prompt sent around the producer never
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
