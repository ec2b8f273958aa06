"""The online API's calls (docs/api.md, "The online API"): POST /v1/completions and
/v1/chat/completions, streamed or not, and going on with a call's stream from where its client
stopped (`Last-Event-ID`, or the call's id).

A call: the body is parsed by vLLM's own protocol model and checked field by field
(app/online/fields.py), rendered by vLLM's renderer for its model (app/online/render.py), and
each of its prompts becomes one Vigil request (record, pool, job, tier, deadline, exactly once),
submitted through the producer's submit like `generate.delay` (one message of many for several
prompts). The call's record (app/state/online_calls.py) names them, so any gateway can go on
with it. A streamed call's requests are `live` where every worker of the pool reads it (their
tokens come after every engine step); the answer follows them (app/online/sse.py). A whole
answer waits for every request's end. A client that goes away cancels the call's requests
(their engines stop them at the next step) unless the call was made detached.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ValidationError

from app.errors import INVALID_REQUEST, RequestError
from app.online.calls import (Position, Resume, call_prefix, new_base, parse_event_id,
                              request_ids)
from app.online.fields import (CHAT, COMPLETIONS, Options, bad, options_of, refuse_unsupported,
                               vigil_kwargs)
from app.online.relay import Ended, wait
from app.online.render import Lane, Renderers, Target
from app.online.shapes import Format, response
from app.online.sse import sse, status_of
from app.state.live import LiveHub
from app.state.online_calls import CallRecords

log = logging.getLogger("vigil.online")

NOT_FOUND_STATUS = 404


class CallNotFound(Exception):
    """No call of this id (never made, expired, or another key's)."""


@dataclass
class Caller:
    """Who calls: the key's name (`admin` for VIGIL_API_TOKEN, `` with auth off), the job its
    requests must run under (None: any), and the highest tier it may ask for."""

    name: str
    job: str | None
    max_tier: str


@dataclass
class Prepared:
    """A call ready to submit or to follow."""

    call_id: str
    fmt: Format
    request_ids: list[str]
    kwargs: list[dict]
    options: Options
    stream: bool


class OnlineCalls:
    """The calls of one gateway process. `submit(items, ids)` submits Vigil requests (a thread:
    it blocks), `cancel(ids)` cancels them, `pool_is_live(pool)` says whether every live worker
    of a pool reads `live` requests, `deadline_s` is the default request deadline and
    `result_ttl` how long results are kept."""

    def __init__(self, renderers: Renderers, hub: LiveHub, records: CallRecords, *,
                 submit: Callable[[list[dict], list[str]], Any],
                 cancel: Callable[[list[str]], Any], pool_is_live: Callable[[str], bool],
                 deadline_s: float, result_ttl: float, clock=time.time):
        self.renderers = renderers
        self.hub = hub
        self.records = records
        self._submit = submit
        self._cancel = cancel
        self._pool_is_live = pool_is_live
        self.deadline_s = deadline_s
        self.result_ttl = result_ttl
        self._clock = clock
        self.stopping = False  # the gateway is stopping: its clients' streams are not theirs

    # -- a new call --------------------------------------------------------------------------
    async def prepare(self, kind: str, body: dict, headers: dict[str, str],
                      caller: Caller) -> Prepared:
        """Parse, check and render `body`; nothing is submitted. Raises RequestError (with a
        `param` where a field is at fault)."""
        request = _parse(kind, body)
        refuse_unsupported(request, kind)
        target = self.renderers.target(request.model)
        options = options_of(request, headers, key_job=caller.job, max_tier=caller.max_tier)
        lane = await self.renderers.lane(target.base)
        request.model = target.base
        rendered = await _render(lane, kind, request)
        stream = bool(request.stream)
        live = stream and await asyncio.to_thread(self._pool_is_live, target.base)
        client_id = headers.get("x-request-id") or (
            request.request_id if "request_id" in request.model_fields_set else None)
        base = new_base(client_id)
        ids = request_ids(base, len(rendered))
        kwargs = [vigil_kwargs(g.sampling_params, g.token_ids, target, options, live)
                  for g in rendered]
        fmt = _format(kind, call_prefix(kind) + base, int(self._clock()), target, request,
                      rendered, lane)
        return Prepared(fmt.call_id, fmt, ids, kwargs, options, stream)

    async def start(self, call: Prepared, caller: Caller) -> None:
        """Record the call (or find it: the same request id again is the same call, which
        must be the same caller's) and submit its requests (a submit of a request that exists
        is that request again: nothing runs twice)."""
        ttl = (call.options.deadline_s or self.deadline_s) + self.result_ttl
        new, stored = await self.records.create(call.call_id, {
            "caller": caller.name, "kind": call.fmt.kind, "requests": call.request_ids,
            "format": call.fmt.wire(), "detach": call.options.detach}, ttl)
        if not new and stored.get("caller") != caller.name:
            raise RequestError.of(INVALID_REQUEST, "this request id is taken")
        await asyncio.to_thread(self._submit, call.kwargs, call.request_ids)

    # -- answers -------------------------------------------------------------------------------
    async def whole(self, call: Prepared, disconnected: Callable[[], Any]) -> dict:
        """The whole answer of a call, once every request ended. Cancels the requests when the
        client goes away first (`disconnected()` true), unless the call is detached. Raises
        the first request's error."""
        waits = [asyncio.create_task(wait(self.hub, rid)) for rid in call.request_ids]
        try:
            while not all(w.done() for w in waits):
                await asyncio.wait(waits, timeout=0.5)
                if not all(w.done() for w in waits) and await disconnected():
                    raise asyncio.CancelledError
        except asyncio.CancelledError:
            await self.client_gone(call)
            raise
        finally:
            for w in waits:
                w.cancel()
        ends: list[Ended] = [w.result() for w in waits]
        for e in ends:
            if e.error is not None:
                raise e.error
        lane = await self.renderers.lane(_base_of(call))
        return response(call.fmt, [e.result for e in ends], lane.tokenizer.decode)

    async def events(self, call: Prepared, start: Position):
        """The call's SSE text from `start`; the client going away (the generator closed
        early) cancels its requests unless the call is detached."""
        lane = await self.renderers.lane(_base_of(call))
        finished = False
        try:
            async for text in sse(self.hub, call.fmt, call.request_ids, lane.tokenizer.decode,
                                  start):
                yield text
            finished = True
        finally:
            if not finished:
                await self.client_gone(call)

    async def cancel(self, request_ids: list[str]) -> dict[str, str]:
        """Cancel requests: {id: what the cancel did} (app/fleet/cancel.py's answers)."""
        return await asyncio.to_thread(self._cancel, request_ids)

    async def client_gone(self, call: Prepared) -> None:
        """The client of `call` went away before its end: cancel its requests, unless the call
        is detached or this gateway is stopping (the client reconnects elsewhere)."""
        if call.options.detach or self.stopping:
            return
        try:
            await asyncio.shield(asyncio.to_thread(self._cancel, call.request_ids))
        except Exception as e:
            log.warning("call %s: its client went away, and cancelling its requests failed: "
                        "%s", call.call_id, e)

    # -- an existing call ----------------------------------------------------------------------
    async def existing(self, resume: Resume, caller: Caller) -> tuple[Prepared, Position]:
        """The call a reconnect names and where to go on from; CallNotFound for an unknown id
        or another caller's call (it reads nothing of it)."""
        rec = await self.records.get(resume.call_id)
        if rec is None or rec.get("caller") != caller.name:
            raise CallNotFound(resume.call_id)
        fmt = Format.of(rec["format"])
        ids = list(rec["requests"])
        position = resume.position or Position.start(len(ids))
        if len(position.prompts) != len(ids):
            raise RequestError.of(INVALID_REQUEST, "Last-Event-ID does not fit this call")
        opts = Options("", "", None, bool(rec.get("detach")))
        return Prepared(fmt.call_id, fmt, ids, [], opts, True), position


def _base_of(call: Prepared) -> str:
    return call.fmt.base or call.fmt.model


def _parse(kind: str, body: dict):
    """vLLM's protocol model of `body`; a 400 naming the first bad field."""
    if kind == CHAT:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as M
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as M
    try:
        return M.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        raise bad(param or "body", f"{param}: {first.get('msg', e)}" if param else str(e)
                  ) from None


async def _render(lane: Lane, kind: str, request) -> list:
    """vLLM's render of the body: one GenerateRequest (token ids, SamplingParams) per prompt;
    vLLM's own error as a RequestError."""
    try:
        if kind == CHAT:
            out = await lane.render.render_chat_request(request)
        else:
            out = await lane.render.render_completion_request(request)
    except Exception as e:  # vLLM's VLLMValidationError (not a ValueError) names the parameter
        if not isinstance(e, (ValueError, TypeError)) and not hasattr(e, "parameter"):
            raise
        param = getattr(e, "parameter", None)
        raise bad(param or "body", str(e)) from None
    if hasattr(out, "error"):  # vLLM's ErrorResponse
        err = bad(out.error.param or "body", out.error.message)
        err.status = out.error.code
        raise err
    return out if isinstance(out, list) else [out]


def _format(kind: str, call_id: str, created: int, target: Target, request, rendered,
            lane: Lane) -> Format:
    params = rendered[0].sampling_params
    stream_options = getattr(request, "stream_options", None)
    if kind == CHAT:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        echo = False
    else:
        logprobs = request.logprobs
        echo = bool(request.echo)
        if echo and request.stream and logprobs is not None:
            raise bad("echo", "echo with logprobs is not supported in a streamed answer (the "
                      "prompt's logprobs come with the result): send it without stream")
    texts = []
    if echo:
        prompts = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        for p, g in zip(prompts, rendered):
            texts.append(p if isinstance(p, str) else lane.tokenizer.decode(list(g.token_ids)))
    fmt = Format(kind=kind, call_id=call_id, created=created, model=target.served_as,
                 n=params.n, logprobs=logprobs,
                 named_logprobs=bool(getattr(request, "logprob_token_ids", None)), echo=echo,
                 prompt_texts=texts, prompt_ids=[list(g.token_ids) for g in rendered],
                 return_token_ids=bool(getattr(request, "return_token_ids", False)),
                 include_usage=bool(stream_options and stream_options.include_usage),
                 continuous_usage=bool(stream_options and
                                       stream_options.continuous_usage_stats),
                 prompt_logprobs=params.prompt_logprobs is not None and not echo,
                 base=target.base)
    return fmt


def body_json(raw: bytes) -> dict:
    """A request body as a JSON object; a 400 otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise RequestError.of(INVALID_REQUEST, f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError.of(INVALID_REQUEST, "the body must be a JSON object")
    return body


__all__ = ["OnlineCalls", "Caller", "CallNotFound", "body_json", "parse_event_id",
           "status_of", "COMPLETIONS", "CHAT"]
