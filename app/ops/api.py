"""`vigil api`: OpenAI's online endpoints (app/ops/api_online.py: completions and chat,
streamed, whose streams survive a dying worker and a restarted gateway) and its Files and
Batches endpoints over the fleet's batch objects.

    vigil api --port 8000 [--workers N]   # VIGIL_API_TOKEN required (or VIGIL_API_AUTH_DISABLED=1)

    client = openai.OpenAI(base_url="http://host:8000/v1", api_key=token)
    f = client.files.create(file=open("eval.jsonl", "rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                              completion_window="24h")
    client.batches.retrieve(b.id).status          # ... "completed"
    client.files.content(b.output_file_id).text

Served (docs/batch.md, "HTTP API"): POST/GET /v1/files, GET/DELETE /v1/files/{id},
GET /v1/files/{id}/content, POST/GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel. Every request needs `Authorization: Bearer <token>` (401
otherwise): VIGIL_API_TOKEN (every endpoint, any job and tier), or an API key made with `vigil
api-key create` (the online endpoints only, under its job and up to its tier: app/state/
api_keys.py); errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}.
The process holds no state of its own: any number of them can serve one fleet (`--workers N`
processes on one host, and any number of hosts behind a load balancer, no sticky sessions).
The batch handlers are plain functions (FastAPI runs them on its thread pool): every one is a
few Redis calls.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from app.errors import VigilError
from app.fleet import batches
from app.online.serving import Caller
from app.ops.api_online import add_online_routes, vigil_error_response
from app.ops.gateway import Gateway
from app.settings import VigilSettings, get_settings
from app.state.batches import BatchStore

log = logging.getLogger("vigil.api")
ADMIN = "admin"
# The online endpoints: an API key may call these; Files and Batches need VIGIL_API_TOKEN.
ONLINE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/calls", "/v1/models",
                "/tokenize", "/detokenize", "/tokenizer_info", "/health")
# Threads for what blocks (submits, cancels): a stream holds none.
BLOCKING_THREADS = 64

DEFAULT_API_PORT = 8000
API_LOCAL_ADDRESS = "127.0.0.1"  # where `vigil api` listens when it runs without a token
# The most batches or files one list call returns (OpenAI's cap for batches).
MAX_LIST = 100
# What a multipart upload may add around the file itself (boundaries, the purpose field).
UPLOAD_OVERHEAD = 64 * 1024


class ApiAuthMissing(Exception):
    """`vigil api` has no token and auth was not disabled: it must not start."""


class ApiError(Exception):
    """An error answered in OpenAI's shape with `status`."""

    def __init__(self, status: int, message: str, code: str | None,
                 type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = (status, message, code,
                                                                       type_, param)


class Gate:
    """The API's gate (auth, the upload bound) as a plain ASGI middleware: `admit(request)`
    answers the refusal, or None to let the request through. Starlette's `@app.middleware`
    (BaseHTTPMiddleware) carried every chunk of a stream through memory streams of its own:
    15.6% of the gateway's CPU under 64 streams (bench/online.py's profile)."""

    def __init__(self, app, admit):
        self.app = app
        self.admit = admit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = await self.admit(Request(scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BatchCreate(BaseModel):
    """The body of POST /v1/batches (OpenAI's fields; others are refused)."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def listen_address(args: argparse.Namespace, settings: VigilSettings) -> str:
    """Where `vigil api` listens: `--address`, else every interface with a token, else
    127.0.0.1 (auth disabled). Raises ApiAuthMissing with neither a token nor
    VIGIL_API_AUTH_DISABLED."""
    if settings.api_token.get_secret_value():
        return args.address or "0.0.0.0"
    if settings.api_auth_disabled:
        return args.address or API_LOCAL_ADDRESS
    raise ApiAuthMissing("refusing to start without a token: set VIGIL_API_TOKEN (or, for "
                         "local use only, VIGIL_API_AUTH_DISABLED=1; it then listens on "
                         f"{API_LOCAL_ADDRESS})")


def create_api(bs: BatchStore, settings: VigilSettings, clock=time.time,
               gateway: Gateway | None = None) -> FastAPI:
    """The ASGI app: the endpoints of the module docstring over `bs` (and, with `gateway`,
    the online endpoints; it is started with the app and closed with it), behind the bearer
    token of `settings` or an API key (none when auth is disabled and no token is set)."""

    @asynccontextmanager
    async def lifespan(app):
        if gateway is not None:
            asyncio.get_running_loop().set_default_executor(
                ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="vigil-api"))
            await gateway.start()
        try:
            yield
        finally:
            if gateway is not None:
                await gateway.close()

    api = FastAPI(title="Vigil", description="OpenAI's online API, Files and Batches over a "
                  "Vigil fleet", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    token = settings.api_token.get_secret_value()

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param,
                                       "code": e.code}}, status_code=e.status)

    async def admit(request: Request) -> JSONResponse | None:
        """Who calls (request.state.caller), or the refusal: before any body is read, so an
        unauthenticated client cannot make the server spool an upload, and an upload over the
        limit is refused from its Content-Length."""
        online = request.url.path.startswith(ONLINE_PATHS)
        request.state.caller = Caller("", None, "interactive")
        if token:
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            value = value.strip()
            if scheme.lower() == "bearer" and hmac.compare_digest(value.encode(),
                                                                  token.encode()):
                request.state.caller = Caller(ADMIN, None, "interactive")
            else:
                grant = None
                if scheme.lower() == "bearer" and online and gateway is not None:
                    try:
                        grant = await gateway.keys.grant(value)
                    except Exception as e:  # Redis away: the key cannot be checked
                        return error(ApiError(503, f"could not check the API key: {e}",
                                              "redis_unavailable", "server_error"))
                if grant is None:
                    return error(ApiError(401, "Incorrect API key provided (Authorization: "
                                          "Bearer <VIGIL_API_TOKEN or an API key>).",
                                          "invalid_api_key"))
                request.state.caller = Caller(grant["name"], grant["job"], grant["max_tier"])
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > settings.batch_max_bytes + UPLOAD_OVERHEAD:
            return error(ApiError(400, f"the request has {int(length):,} bytes; a batch file "
                                  f"may have at most {settings.batch_max_bytes:,} "
                                  "(VIGIL_BATCH_MAX_BYTES)", "invalid_request"))
        return None

    api.add_middleware(Gate, admit=admit)

    @api.exception_handler(ApiError)
    def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error(e)

    @api.exception_handler(VigilError)
    def _vigil_error(request: Request, e: VigilError) -> JSONResponse:
        return vigil_error_response(e, settings)

    @api.exception_handler(batches.BatchNotFound)
    def _not_found(request: Request, e: batches.BatchNotFound) -> JSONResponse:
        return error(ApiError(404, str(e.args[0]), "not_found"))

    @api.exception_handler(HTTPException)
    def _http(request: Request, e: HTTPException) -> JSONResponse:  # unknown path or method
        return error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail} "
                              "(Vigil serves OpenAI's completions, chat completions, Files and "
                              "Batches endpoints)",
                              "not_found" if e.status_code == 404 else "invalid_request"))

    @api.exception_handler(RequestValidationError)
    def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error(ApiError(400, f"invalid request: {first.get('msg', e)}", "invalid_request",
                              param=param))

    if gateway is not None:
        add_online_routes(api, lambda: gateway.calls, lambda: gateway.renderers, settings)

    @api.post("/v1/files")
    def upload(file: UploadFile = File(...), purpose: str = Form(...)) -> dict:
        data = file.file.read(settings.batch_max_bytes + 1)
        return batches.upload_file(bs, data, file.filename or "upload.jsonl", purpose, clock(),
                                   settings)

    @api.get("/v1/files")
    def list_files(purpose: str | None = None) -> dict:
        rows = [batches.file_object(m) for m in map(bs.file, bs.file_ids()) if m]
        rows = [r for r in rows if purpose is None or r["purpose"] == purpose]
        return _page(rows, False)

    @api.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> dict:
        return batches.file_object(batches.get_file_meta(bs, file_id))

    @api.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> StreamingResponse:
        return StreamingResponse(batches.file_content(bs, file_id),
                                 media_type="application/octet-stream")

    @api.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict:
        return batches.delete_file(bs, file_id)

    @api.post("/v1/batches")
    def create(body: BatchCreate) -> dict:
        return batches.create_batch(bs, body.input_file_id, body.endpoint,
                                    body.completion_window, body.metadata, clock(), settings)

    @api.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None) -> dict:
        limit = max(1, min(limit, MAX_LIST))
        ids = bs.batch_ids(limit + 1, after)
        tick = batches.tick_status(bs, settings, clock())
        rows = [batches.with_tick(batches.batch_object(b), tick)
                for b in map(bs.get, ids[:limit]) if b]
        return _page(rows, len(ids) > limit)

    @api.get("/v1/batches/{batch_id}")
    def retrieve(batch_id: str) -> dict:
        return batches.with_tick(batches.get_batch(bs, batch_id),
                                 batches.tick_status(bs, settings, clock()))

    @api.post("/v1/batches/{batch_id}/cancel")
    def cancel(batch_id: str) -> dict:
        return batches.cancel_batch(bs, batch_id, clock())

    return api


def _page(rows: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": rows, "first_id": rows[0]["id"] if rows else None,
            "last_id": rows[-1]["id"] if rows else None, "has_more": has_more}


def gateway_app() -> FastAPI:
    """The whole API of one `vigil api` process, from the settings (uvicorn's factory: each of
    `--workers N` processes builds its own)."""
    settings = get_settings()
    gateway = Gateway.from_settings(settings)
    return create_api(gateway.store.batches(), settings, gateway=gateway)


def serve(args: argparse.Namespace, settings: VigilSettings) -> None:
    """Run the API with uvicorn (`args.workers` processes) until stopped: SIGTERM/SIGINT end
    it, letting open streams go without cancelling their requests (their clients reconnect
    to another gateway)."""
    address = listen_address(args, settings)
    level = (args.loglevel or settings.log_level).lower()
    if getattr(args, "workers", 1) > 1:
        uvicorn.run("app.ops.api:gateway_app", factory=True, host=address, port=args.port,
                    workers=args.workers, log_level=level, access_log=False,
                    timeout_graceful_shutdown=2)
        return
    uvicorn.run(gateway_app(), host=address, port=args.port, log_level=level,
                access_log=False, timeout_graceful_shutdown=2)
