"""`vigil api`'s online endpoints (docs/api.md, "The online API"), beside Files and Batches:

    POST /v1/completions, POST /v1/chat/completions    streamed (SSE) or whole
    GET  /v1/calls/{id}           a call's whole answer (a detached one, later)
    GET  /v1/calls/{id}/stream    a call's stream from `?after=` or `Last-Event-ID`
    POST /v1/calls/{id}/cancel    cancel a call's requests
    GET  /v1/models, GET /health, POST /tokenize, POST /detokenize, GET /tokenizer_info

Every handler is async: a stream is followed on the event loop with no thread of its own
(app/state/live.py), so one process holds thousands. What blocks (a submit, a cancel) runs on a
thread. Errors have OpenAI's shape; a call that is over capacity is a 429 with Retry-After.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.errors import (MODEL_NOT_FOUND, OVERLOADED, RequestError, TerminalError,
                        TransientError, VigilError)
from app.online.calls import Position, Resume, parse_event_id
from app.online.render import Renderers
from app.online.serving import CHAT, COMPLETIONS, Caller, CallNotFound, OnlineCalls, body_json
from app.settings import VigilSettings

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(status: int, message: str, code: str | None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def vigil_error_response(e: VigilError, settings: VigilSettings) -> JSONResponse:
    """A Vigil error as its HTTP answer: a request's fault 400 (unknown model 404), over
    capacity 429 with Retry-After, the fleet briefly unable 503, an ended request 500."""
    if isinstance(e, RequestError):
        status = getattr(e, "status", None) or (404 if e.code == MODEL_NOT_FOUND else 400)
        return error_response(status, str(e), e.code, getattr(e, "param", None))
    if isinstance(e, TransientError):
        if e.code == OVERLOADED:
            return error_response(429, str(e), e.code, headers={
                "Retry-After": str(int(settings.retry_backoff_max))})
        return error_response(503, str(e), e.code)
    status = 500 if not isinstance(e, TerminalError) else 500
    return error_response(status, str(e), e.code)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (a longer one is a 400 before more is read)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise RequestError.of("invalid_request", f"the body has {int(size):,} bytes; at most "
                              f"{limit:,} (VIGIL_API_MAX_BODY_BYTES)")
    chunks, total = [], 0
    async for part in request.stream():
        total += len(part)
        if total > limit:
            raise RequestError.of("invalid_request", f"the body is over {limit:,} bytes "
                                  "(VIGIL_API_MAX_BODY_BYTES)")
        chunks.append(part)
    return b"".join(chunks)


def add_online_routes(api: FastAPI, get: Callable[[], OnlineCalls],
                      renderers: Callable[[], Renderers], settings: VigilSettings,
                      started: float | None = None) -> None:
    """The online endpoints on `api` (module docstring). `get()` is the process' OnlineCalls
    and `renderers()` its vLLM render lanes (both built at the app's start)."""
    started = started or time.time()

    def caller_of(request: Request) -> Caller:
        return request.state.caller

    async def call(kind: str, request: Request):
        calls = get()
        headers = {k.lower(): v for k, v in request.headers.items()}
        caller = caller_of(request)
        raw = await read_body(request, settings.api_max_body_bytes)
        last = headers.get("last-event-id")
        if last:  # a client going on with a stream: the body is that of the call it names
            return await stream_existing(calls, parse_event_id(last), caller)
        body = body_json(raw)
        prepared = await calls.prepare(kind, body, headers, caller)
        await calls.start(prepared, caller)
        if prepared.stream:
            return StreamingResponse(calls.events(prepared, Position.start(
                len(prepared.request_ids))), media_type="text/event-stream",
                headers=SSE_HEADERS)
        return JSONResponse(await calls.whole(prepared, request.is_disconnected))

    async def stream_existing(calls: OnlineCalls, resume: Resume, caller: Caller):
        try:
            prepared, position = await calls.existing(resume, caller)
        except CallNotFound:
            return error_response(404, f"no call {resume.call_id} (never made, expired, or "
                                  "not this key's)", "not_found")
        return StreamingResponse(calls.events(prepared, position),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await call(COMPLETIONS, request)

    @api.post("/v1/chat/completions")
    async def chat(request: Request):
        return await call(CHAT, request)

    @api.get("/v1/calls/{call_id}/stream")
    async def call_stream(call_id: str, request: Request, after: str | None = None):
        last = request.headers.get("last-event-id") or after
        resume = parse_event_id(last) if last else Resume(call_id)
        if resume.call_id != call_id:
            raise RequestError.of("invalid_request", "Last-Event-ID names another call")
        return await stream_existing(get(), resume, caller_of(request))

    async def existing(call_id: str, request: Request):
        """(the call, None), or (None, its 404) for an unknown id or another key's call."""
        try:
            prepared, _ = await get().existing(Resume(call_id), caller_of(request))
            return prepared, None
        except CallNotFound:
            return None, error_response(404, f"no call {call_id}", "not_found")

    @api.get("/v1/calls/{call_id}")
    async def call_whole(call_id: str, request: Request):
        prepared, missing = await existing(call_id, request)
        if missing is not None:
            return missing
        prepared.options = replace(prepared.options, detach=True)  # a reader cancels nothing
        return JSONResponse(await get().whole(prepared, request.is_disconnected))

    @api.post("/v1/calls/{call_id}/cancel")
    async def call_cancel(call_id: str, request: Request):
        prepared, missing = await existing(call_id, request)
        if missing is not None:
            return missing
        return {"id": call_id, "requests": await get().cancel(prepared.request_ids)}

    @api.get("/v1/models")
    async def models():
        r = renderers()
        data = []
        for name in r.registry.names():
            spec = r.registry.get(name)
            data.append({"id": name, "object": "model", "created": int(started),
                         "owned_by": "vigil", "root": spec.path or name, "parent": None,
                         "max_model_len": spec.max_model_len, "permission": []})
        for a in sorted(r.registry.adapters.values(), key=lambda a: a.name):
            if a.base in r.registry:
                data.append({"id": a.name, "object": "model", "created": int(started),
                             "owned_by": "vigil", "root": a.path, "parent": a.base,
                             "max_model_len": r.registry.get(a.base).max_model_len,
                             "permission": []})
        return {"object": "list", "data": data}

    @api.get("/health")
    async def health():
        return JSONResponse({})

    async def tokenization(request: Request, name: str):
        from vllm.entrypoints.serve.tokenize.protocol import (DetokenizeRequest,
                                                              TokenizeChatRequest,
                                                              TokenizeCompletionRequest)

        r = renderers()
        body = body_json(await read_body(request, settings.api_max_body_bytes))
        lane = await (r.lane(r.target(body["model"]).base) if body.get("model")
                      else r.default_lane())
        body = {**body, "model": lane.spec.name}
        try:
            if name == "detokenize":
                req = DetokenizeRequest.model_validate(body)
                out = await lane.tokenization.create_detokenize(req, None)
            else:
                model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
                req = model.model_validate(body)
                out = await lane.tokenization.create_tokenize(req, None)
        except ValueError as e:
            return error_response(400, str(e), "invalid_request")
        if hasattr(out, "error"):
            return error_response(out.error.code, out.error.message, "invalid_request",
                                  out.error.param)
        return JSONResponse(out.model_dump())

    @api.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenization(request, "tokenize")

    @api.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenization(request, "detokenize")

    @api.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None):
        r = renderers()
        lane = await (r.lane(r.target(model).base) if model else r.default_lane())
        out = await lane.tokenization.get_tokenizer_info()
        if hasattr(out, "error"):
            return error_response(out.error.code, out.error.message, "invalid_request")
        return JSONResponse(out.model_dump())
