"""An online body, as vLLM parsed and rendered it, as Vigil requests: which body fields the
online API takes, and vLLM's SamplingParams mapped onto Vigil's request fields (docs/api.md,
"The online API", has the table).

vLLM's protocol models accept (and ignore, with a log line) fields they do not know, and know
fields the fleet cannot honour (beam search, prompt embeddings, KV transfer, tools). Here
every field a body sets is either carried out or refused with a 400 naming it (`param`): never
dropped in silence. The values themselves are then checked by Vigil's own request schema
(app/requests/schemas.py) at submit, as any request's are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from app.errors import INVALID_REQUEST, RequestError
from app.requests.tiers import INTERACTIVE, TIERS, tier_of_celery_priority

COMPLETIONS = "completions"
CHAT = "chat"
# Fields both endpoints carry out (vLLM's SamplingParams, the render's, the stream's).
COMMON = frozenset({
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
    "min_tokens", "logprobs", "prompt_logprobs", "logprob_token_ids", "response_format",
    "structured_outputs", "skip_special_tokens", "stream", "stream_options", "user",
    "request_id", "return_token_ids", "priority", "add_special_tokens",
    "truncate_prompt_tokens", "truncation_side",
})
SUPPORTED = {
    COMPLETIONS: COMMON | {"prompt", "echo"},
    CHAT: COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                    "add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs", "documents", "tool_choice", "parallel_tool_calls",
                    "include_reasoning"},
}
# Vigil's own body fields (the `openai` client sends them with `extra_body`): the tier, the
# deadline, and whether the request runs on when its client goes away.
VIGIL_FIELDS = ("vigil_tier", "vigil_deadline_s", "vigil_detach")

# vLLM's SamplingParams fields mapped onto Vigil's request fields of the same name (a value
# vLLM gives as an empty list is Vigil's None).
SAME_NAME = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "ignore_eos", "max_tokens",
             "min_tokens", "logprobs", "prompt_logprobs", "logprob_token_ids",
             "include_stop_str_in_output", "skip_special_tokens", "detokenize", "stop",
             "stop_token_ids", "bad_words", "allowed_token_ids")
# SamplingParams fields the fleet does not carry: refused unless at vLLM's default.
NOT_CARRIED = {"watermarking": None, "thinking_token_budget": None,
               "repetition_detection": None, "extra_args": None, "flat_logprobs": False,
               "prompt_logprob_token_ids": None, "spaces_between_special_tokens": True}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def bad(param: str, message: str) -> RequestError:
    """A 400 naming the body field (`param` on the error, as OpenAI's shape has it)."""
    err = RequestError.of(INVALID_REQUEST, message)
    err.param = param
    return err


def refuse_unsupported(request, kind: str) -> None:
    """Raise a 400 for the first field `request` (vLLM's parsed body) sets that the fleet
    cannot carry out: a field of vLLM's model outside SUPPORTED[kind] set to anything but its
    default, a field vLLM does not know (it would ignore it), or a value of a supported field
    the fleet has no way to honour (tools, a chat echo)."""
    fields = type(request).model_fields
    for name in sorted(request.model_fields_set):
        if name in SUPPORTED[kind] or name not in fields:  # extras: below
            continue
        default = fields[name].default if name in fields else None
        if getattr(request, name, None) != default:
            raise bad(name, f"'{name}' is not supported by Vigil's online API (docs/api.md, "
                      "\"The online API\")")
    for name in sorted(request.model_extra or {}):
        if name not in VIGIL_FIELDS:
            raise bad(name, f"unknown field '{name}'")
    if kind == CHAT:
        if getattr(request, "tools", None):
            raise bad("tools", "tool calling is not supported by Vigil's online API")
        if getattr(request, "tool_choice", "none") not in (None, "none", "auto"):
            raise bad("tool_choice", "tool calling is not supported by Vigil's online API")
    if getattr(request, "n", 1) and getattr(request, "use_beam_search", False):
        raise bad("use_beam_search", "beam search is not supported")


@dataclass(frozen=True)
class Options:
    """How the fleet runs an online body: its tier, job, deadline, and whether it runs on
    detached when its client goes away."""

    tier: str
    job: str
    deadline_s: float | None
    detach: bool


def options_of(request, headers: dict[str, str], *, key_job: str | None, max_tier: str
               ) -> Options:
    """The body's and the headers' say on tier, job, deadline and detach, within what the API
    key allows: the tier is `vigil_tier` (or the `X-Vigil-Tier` header, or vLLM's `priority`:
    0 names none, 1-9 as Celery's), `interactive` by default, at most `max_tier` (a higher one
    is a 400 naming it, and the default falls to `max_tier`); the job is the key's
    (`key_job`), else the `X-Vigil-Job` header, else `default`."""
    extra = request.model_extra or {}
    tier = extra.get("vigil_tier") or headers.get("x-vigil-tier")
    prio = getattr(request, "priority", 0)
    if tier is None and prio:
        if type(prio) is not int or not 0 <= prio <= 9:
            raise bad("priority", "priority is a tier's Celery priority, 0-9 (0: the "
                      "default, interactive), or name the tier in vigil_tier")
        tier = tier_of_celery_priority(prio)
    if tier is not None and tier not in TIERS:
        raise bad("vigil_tier", f"vigil_tier must be one of {', '.join(TIERS)}")
    allowed = TIERS[TIERS.index(max_tier):]
    if tier is None:
        tier = INTERACTIVE if INTERACTIVE in allowed else max_tier
    elif tier not in allowed:
        raise bad("vigil_tier", f"this API key may ask for tiers {', '.join(allowed)}, not "
                  f"{tier}")
    job = key_job or headers.get("x-vigil-job") or "default"
    deadline = extra.get("vigil_deadline_s", headers.get("x-vigil-deadline"))
    if deadline is not None:
        try:
            deadline = float(deadline)
        except (TypeError, ValueError):
            raise bad("vigil_deadline_s", "vigil_deadline_s must be a number of seconds") \
                from None
    detach = extra.get("vigil_detach", headers.get("x-vigil-detach", False))
    if isinstance(detach, str):
        detach = detach.lower() in ("1", "true", "yes")
    if not isinstance(detach, bool):
        raise bad("vigil_detach", "vigil_detach must be true or false")
    return Options(tier, job, deadline, detach)


def vigil_kwargs(params, token_ids: list[int], target, options: Options,
                 live: bool) -> dict[str, Any]:
    """Vigil request kwargs for one rendered prompt: vLLM's SamplingParams `params` mapped
    field by field (docs/api.md, "The online API"), the prompt as token ids, the model (and
    adapter) of `target`, the tier, job and deadline of `options`, and `live` for a streamed
    body whose pool reads it. Raises a 400 for a SamplingParams value the fleet does not carry
    (a field the body set is refused before this: `refuse_unsupported`)."""
    for name, default in NOT_CARRIED.items():
        if getattr(params, name, default) not in (default, None, [], {}):
            raise bad(name, f"'{name}' is not supported by Vigil's online API")
    out: dict[str, Any] = {"model": target.base, "prompt_token_ids": list(token_ids),
                           "priority": options.tier, "job": options.job}
    if target.adapter:
        out["lora"] = target.adapter
    if options.deadline_s is not None:
        out["deadline_s"] = options.deadline_s
    if live:
        out["live"] = True
    for name in SAME_NAME:
        value = getattr(params, name, None)
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue
        out[name] = list(value) if isinstance(value, (list, tuple)) else value
    if out.get("top_k") == -1:
        out["top_k"] = 0  # both mean "all tokens"
    if params.logit_bias:
        out["logit_bias"] = {str(k): float(v) for k, v in params.logit_bias.items()}
    if params.structured_outputs is not None:
        out["structured"] = structured_of(params.structured_outputs)
    return out


def structured_of(so) -> dict:
    """vLLM's StructuredOutputsParams as Vigil's `structured` (one kind); a 400 for options
    Vigil's constraint does not carry (the model's registry entry sets the backend's)."""
    for name, default in (("disable_any_whitespace", False),
                          ("disable_additional_properties", False),
                          ("whitespace_pattern", None), ("structural_tag", None)):
        if getattr(so, name, default) not in (default, None):
            raise bad("structured_outputs", f"structured_outputs.{name} is not supported (the "
                      "model's registry entry sets its backend's options)")
    given = {k: getattr(so, k) for k in STRUCTURED_KINDS if getattr(so, k, None) not in (None,
                                                                                      False)}
    if len(given) != 1:
        raise bad("response_format", "give one structured output constraint")
    kind, value = next(iter(given.items()))
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad("response_format", "the JSON schema is not valid JSON") from None
    if kind == "json_object":
        value = True
    return {kind: value}
