"""`vigil api`: OpenAI's Files and Batches endpoints over the fleet's batch objects.

    vigil api --port 8000            # VIGIL_API_TOKEN required (or VIGIL_API_AUTH_DISABLED=1)

    client = openai.OpenAI(base_url="http://host:8000/v1", api_key=token)
    f = client.files.create(file=open("eval.jsonl", "rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                              completion_window="24h")
    client.batches.retrieve(b.id).status          # ... "completed"
    client.files.content(b.output_file_id).text

Served (docs/batch.md, "HTTP API"): POST/GET /v1/files, GET/DELETE /v1/files/{id},
GET /v1/files/{id}/content, POST/GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel. Every request needs `Authorization: Bearer <VIGIL_API_TOKEN>`
(401 otherwise); errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}.
The process holds no state of its own: any number of them can serve one fleet. Handlers are
plain functions (FastAPI runs them on its thread pool): every one is a few Redis calls.
"""
from __future__ import annotations

import argparse
import hmac
import time

import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from app.errors import RequestError, TransientError
from app.fleet import batches
from app.settings import VigilSettings
from app.state.batches import BatchStore

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


def create_api(bs: BatchStore, settings: VigilSettings, clock=time.time) -> FastAPI:
    """The ASGI app: the endpoints of the module docstring over `bs`, behind the bearer token of
    `settings` (none when auth is disabled and no token is set)."""
    api = FastAPI(title="Vigil", description="OpenAI Files and Batches over a Vigil fleet",
                  docs_url=None, redoc_url=None, openapi_url=None)
    token = settings.api_token.get_secret_value()

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param,
                                       "code": e.code}}, status_code=e.status)

    @api.middleware("http")
    async def gate(request: Request, call_next):
        # Before any body is read: an unauthenticated client cannot make the server spool an
        # upload, and an upload over the limit is refused from its Content-Length.
        if token:
            scheme, _, value = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(),
                                                                     token.encode()):
                return error(ApiError(401, "Incorrect API key provided (Authorization: Bearer "
                                      "<VIGIL_API_TOKEN>).", "invalid_api_key"))
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > settings.batch_max_bytes + UPLOAD_OVERHEAD:
            return error(ApiError(400, f"the request has {int(length):,} bytes; a batch file "
                                  f"may have at most {settings.batch_max_bytes:,} "
                                  "(VIGIL_BATCH_MAX_BYTES)", "invalid_request"))
        return await call_next(request)

    @api.exception_handler(ApiError)
    def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error(e)

    @api.exception_handler(RequestError)
    def _request_error(request: Request, e: RequestError) -> JSONResponse:
        return error(ApiError(400, str(e), e.code))

    @api.exception_handler(batches.BatchNotFound)
    def _not_found(request: Request, e: batches.BatchNotFound) -> JSONResponse:
        return error(ApiError(404, str(e.args[0]), "not_found"))

    @api.exception_handler(TransientError)
    def _unavailable(request: Request, e: TransientError) -> JSONResponse:
        # 503: the openai client retries it (its max_retries) as it does OpenAI's own outages.
        return error(ApiError(503, str(e), e.code, "server_error"))

    @api.exception_handler(HTTPException)
    def _http(request: Request, e: HTTPException) -> JSONResponse:  # unknown path or method
        return error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail} "
                              "(Vigil serves the Files and Batches endpoints only)",
                              "not_found" if e.status_code == 404 else "invalid_request"))

    @api.exception_handler(RequestValidationError)
    def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error(ApiError(400, f"invalid request: {first.get('msg', e)}", "invalid_request",
                              param=param))

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


def serve(args: argparse.Namespace, settings: VigilSettings, bs: BatchStore) -> None:
    """Run the API with uvicorn until stopped (SIGTERM/SIGINT end it cleanly)."""
    address = listen_address(args, settings)
    uvicorn.run(create_api(bs, settings), host=address, port=args.port,
                log_level=(args.loglevel or settings.log_level).lower(), access_log=False)
