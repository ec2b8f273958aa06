"""The OpenAI Batch file format for `vigil batch`: reading input lines, shaping output lines, ids.

Pure functions, no Redis and no Celery (app/ops/batch_run.py runs a file; docs/batch.md describes the
formats). An input line is one JSON object:

    {"custom_id": "q1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16}}

`url` "/v1/chat/completions" takes `messages` instead of `prompt`. A line that cannot become a
request raises RequestError(invalid_request) naming the line and what to fix; a batch never stops
for one bad line.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from app.errors import INVALID_REQUEST, RequestError
from app.requests.openai_shapes import CHAT, COMPLETION, openai_body
from app.requests.schemas import JOB_PATTERN
from app.requests.tiers import BULK

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
KINDS = {COMPLETIONS_URL: COMPLETION, CHAT_URL: CHAT}
# Fixed forever: request ids are uuid5(BATCH_NAMESPACE, job + "\n" + custom_id), so a rerun finds
# the requests an interrupted run already submitted. Changing it orphans every batch in flight.
BATCH_NAMESPACE = uuid.UUID("4f0b7c8e-3c1d-5a8e-9d62-1b7e0a6c2f51")
MAX_CUSTOM_ID = 512
# Body fields passed to GenerateRequest unchanged (its strict schema checks their values):
# OpenAI's, then the extras `vllm serve` takes in the same body.
PASSTHROUGH = ("max_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "n",
               "presence_penalty", "frequency_penalty", "logit_bias",
               "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
               "include_stop_str_in_output", "skip_special_tokens", "bad_words",
               "allowed_token_ids", "prompt_logprobs", "logprob_token_ids")
# Body fields that say how the output is constrained: OpenAI's response_format, vLLM's own
# structured_outputs (one of json, regex, choice, grammar, json_object).
STRUCTURED = ("response_format", "structured_outputs")
# The logprobs fields: completions take `logprobs` (the top count); chat takes `logprobs`
# (a bool) and `top_logprobs` (the count).
LOGPROBS = {COMPLETION: ("logprobs",), CHAT: ("logprobs", "top_logprobs")}
# OpenAI fields accepted only with the value Vigil gives anyway; `user` is metadata.
NO_OP = {"stream": (False,), "user": None}

RenderChat = Callable[[str, list], list[int]]
# chat_budget(model, prompt_tokens): the max_tokens of a chat line that names none (the rest of
# the model's context, as OpenAI's and vLLM's chat endpoints give it), or None when the model's
# context is not known (then the request's own default, 16, applies).
ChatBudget = Callable[[str, int], "int | None"]


def request_id_for(job: str, custom_id: str) -> str:
    """The Vigil request id of a line: the same (job, custom_id) always gives the same id."""
    return str(uuid.uuid5(BATCH_NAMESPACE, f"{job}\n{custom_id}"))


def default_job(path: str | Path) -> str:
    """A job name derived from the input file's name, its last suffix dropped (`eval-7.jsonl` ->
    `eval-7`), always matching JOB_PATTERN: other characters become '-', a name not starting
    with a letter or digit gets a `batch-` prefix."""
    stem = Path(path).stem or "batch"
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", stem)
    if not re.match(r"[A-Za-z0-9]", name):
        name = "batch-" + name
    return name[:128]


def valid_job(job: str) -> bool:
    """True when `job` is an acceptable request `job` field."""
    return re.match(JOB_PATTERN, job) is not None


def _bad(lineno: int, detail: str) -> RequestError:
    return RequestError.of(INVALID_REQUEST, f"line {lineno}: {detail}")


def read_custom_id(text: str, lineno: int) -> tuple[str, dict]:
    """The line's custom_id and its parsed object; RequestError(invalid_request) when the line is
    not a JSON object or has no usable custom_id (a non-empty string of at most 512 characters)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _bad(lineno, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _bad(lineno, f"expected a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        raise _bad(lineno, f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} "
                   f"characters, got {cid!r}"[:300])
    return cid, obj


def to_request(obj: dict, lineno: int, job: str, render_chat: RenderChat,
               chat_budget: ChatBudget) -> tuple[str, dict]:
    """(kind, GenerateRequest kwargs) for a parsed line. `render_chat(model, messages)` turns chat
    messages into prompt token ids with the model's chat template (app/requests/chat.py); a chat
    line without `max_tokens` gets `chat_budget(model, prompt tokens)` (the rest of the context),
    a completions line keeps the request's default, 16, as OpenAI's legacy endpoint does. Raises
    RequestError: invalid_request for a bad envelope or body, or what `render_chat` raises. The
    values themselves (types, bounds) are checked later by `generate.apply_async`."""
    kind, body, model, kwargs = _shape(obj, lineno)
    kwargs["job"] = job
    kwargs["priority"] = BULK  # nobody waits on a batch's line: interactive work goes first
    if kind == CHAT:
        ids = render_chat(model, normalize_messages(body, lineno))
        kwargs["prompt_token_ids"] = ids
        if "max_tokens" not in kwargs:
            budget = chat_budget(model, len(ids))
            if budget is not None:
                kwargs["max_tokens"] = budget
    return kind, kwargs


def check_line(obj: dict, lineno: int) -> str:
    """The line's kind when its envelope and body have the shape of a request (every rule of
    `to_request` but the chat template, which needs the model's tokenizer); RequestError
    (invalid_request) naming the first thing wrong otherwise. What a batch's validation runs."""
    kind, body, _, _ = _shape(obj, lineno)
    if kind == CHAT:
        normalize_messages(body, lineno)
    return kind


def _shape(obj: dict, lineno: int) -> tuple[str, dict, str, dict]:
    """(kind, body, model, kwargs without the chat prompt) of a line, or RequestError."""
    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if extra:
        raise _bad(lineno, f"unknown field(s) {', '.join(extra)}")
    if obj.get("method") != "POST":
        raise _bad(lineno, f"method must be \"POST\", got {obj.get('method')!r}")
    kind = KINDS.get(obj.get("url"))  # type: ignore[arg-type]
    if kind is None:
        raise _bad(lineno, f"url {obj.get('url')!r} is not supported (use {COMPLETIONS_URL} or "
                   f"{CHAT_URL})")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _bad(lineno, "body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(lineno, "body.model must be a non-empty string")
    kwargs = _sampling(body, lineno, kind) | {"model": model}
    if kind == COMPLETION:
        kwargs |= _prompt(body, lineno)
    return kind, body, model, kwargs


def _sampling(body: dict, lineno: int, kind: str) -> dict:
    prompt_field = "prompt" if kind == COMPLETION else "messages"
    known = {"model", prompt_field, *PASSTHROUGH, *NO_OP, *STRUCTURED, *LOGPROBS[kind]}
    if kind == CHAT:
        known.add("max_completion_tokens")
    unknown = sorted(set(body) - known)
    if unknown:
        raise _bad(lineno, f"body field(s) {', '.join(unknown)} not supported for {kind} lines "
                   f"(supported: {', '.join(sorted(known))})")
    for name, allowed in NO_OP.items():
        if allowed is not None and body.get(name) is not None and body[name] not in allowed:
            raise _bad(lineno, f"body.{name} must be {allowed[0]!r} (one choice per line)")
    out = {k: body[k] for k in PASSTHROUGH if body.get(k) is not None}  # null = the default
    mct = body.get("max_completion_tokens")
    if mct is not None:
        if "max_tokens" in out and out["max_tokens"] != mct:
            raise _bad(lineno, "body.max_tokens and body.max_completion_tokens differ")
        out["max_tokens"] = mct
    return out | _logprobs(body, lineno, kind) | _structured(body, lineno)


def _logprobs(body: dict, lineno: int, kind: str) -> dict:
    """The request's `logprobs` from a line's: a completions line's count as it is; a chat
    line's `top_logprobs` when `logprobs` is true (0 without it), as OpenAI reads them."""
    lp = body.get("logprobs")
    if kind == COMPLETION:
        return {} if lp is None else {"logprobs": lp}
    top = body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _bad(lineno, "body.logprobs must be true or false on a chat line")
    if not lp:
        if top:
            raise _bad(lineno, "body.top_logprobs needs body.logprobs true")
        return {}
    return {"logprobs": 0 if top is None else top}


def _structured(body: dict, lineno: int) -> dict:
    """The request's `structured` from a line's response_format (OpenAI's json_schema and
    json_object; text means none) or structured_outputs (vLLM's body field, passed on for the
    request's schema to check)."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise _bad(lineno, "give body.response_format or body.structured_outputs, not both")
    if so is not None:
        return {"structured": so}
    if rf is None:
        return {}
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"structured": {"json_object": True}}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad(lineno, "body.response_format.json_schema.schema must be a JSON schema "
                       "(an object)")
        return {"structured": {"json": schema}}
    raise _bad(lineno, f"body.response_format.type {kind!r} is not supported (use text, "
               "json_object or json_schema)")


def _prompt(body: dict, lineno: int) -> dict:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return {"prompt_token_ids": p}
    raise _bad(lineno, "body.prompt must be a string or a list of token ids (one prompt per line)")


def normalize_messages(body: dict, lineno: int) -> list[dict]:
    """A chat body's `messages` as [{"role", "content": str}] for a chat template. Content may be a
    string or a list of text parts (joined with newlines); other parts are refused."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad(lineno, "body.messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise _bad(lineno, f"body.messages[{i}] must be an object with a role string")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise _bad(lineno, f"body.messages[{i}].content: only text parts are supported")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(lineno, f"body.messages[{i}].content must be a string or text parts")
        out.append({"role": m["role"], "content": content})
    return out


def batch_id(request_id: str) -> str:
    """The output line's `id` for a line that has a request id."""
    return f"batch_req_{request_id}"


def line_id(lineno: int) -> str:
    """The output line's `id` for a line that never got a request id (no usable custom_id, or a
    duplicate one)."""
    return f"batch_req_line_{lineno}"


def success_line(request_id: str, custom_id: str, kind: str, result: dict, created: int) -> dict:
    """An output-file line in the OpenAI Batch shape for a finished request: `response.body` is a
    `text_completion` (choices[i].text) or a `chat.completion` (choices[i].message.content) with
    finish_reason, logprobs in OpenAI's shape when asked for, one choice per sample, and usage;
    `response.request_id` is the Vigil request id (app/requests/openai_shapes.py)."""
    return {"id": batch_id(request_id), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id,
                         "body": openai_body(request_id, kind, result, created)},
            "error": None}


def error_line(id_: str, custom_id: str | None, code: str, message: str) -> dict:
    """An error-file line in the OpenAI Batch shape: `response` null, `error` {code, message},
    `code` being Vigil's error code (app/errors.py)."""
    return {"id": id_, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def dumps(line: dict) -> str:
    """One JSONL line (newline included), UTF-8 kept readable."""
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
