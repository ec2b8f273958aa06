"""A call's answer as Server-Sent Events, from any position (docs/api.md, "How a stream
continues").

Each prompt's request is followed (app/online/relay.py) from its first token: the events a
client already had (its position, app/online/calls.py) are made again and not sent, so every
event after them has exactly the text offsets and running counts it had the first time, and the
client gets no gap and no duplicate. Events of the call's prompts interleave as their tokens
come; each carries `id: <call id>/<position after it>`. The end: every choice's finish_reason
(one event per prompt), the usage chunk when asked, `data: [DONE]`. A request that fails ends
the stream as vLLM ends one after its first byte: a `data: {"error": ...}` event, then
`data: [DONE]`. A stream whose run had to start over from its prompt (a refused resume: the
tokens the client has were thrown away) is such an error (`stream_restarted`), unless the
client had none of them yet.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from app.errors import MODEL_NOT_FOUND, RequestError, VigilError
from app.online.calls import DONE, Position
from app.online.relay import Ended, follow
from app.online.shapes import Chunks, Format
from app.state.live import LiveHub

STREAM_RESTARTED = "stream_restarted"


@dataclass
class StreamError(Exception):
    """The call's stream ends with this error event."""

    code: str
    message: str
    status: int = 500


def event(data: str, event_id: str | None = None) -> str:
    """One SSE event's text."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {data}\n\n"


def error_data(code: str, message: str, status: int) -> str:
    """An error after the first byte, as vLLM sends one: a `data:` event holding the error in
    the API's error shape, {"error": {message, type, param, code}} (`code`: Vigil's)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}})


def status_of(err: VigilError) -> int:
    """The HTTP status of a request's error: a request's own fault 400 (404 for an unknown
    model), anything else 500."""
    if isinstance(err, RequestError):
        return 404 if err.code == MODEL_NOT_FOUND else 400
    return 500


async def sse(hub: LiveHub, fmt: Format, request_ids: list[str], decode, start: Position,
              *, poll_s: float = 2.0) -> AsyncIterator[str]:
    """The call's SSE text after position `start` (module docstring)."""
    chunks = Chunks(fmt, decode)
    pos = Position(list(start.prompts), start.usage_sent)
    sent = Position([-1] * len(request_ids))  # what this generator has made (sent or not)
    queue: asyncio.Queue = asyncio.Queue()
    results: list[dict | None] = [None] * len(request_ids)

    async def one(p: int) -> None:
        try:
            async for x in follow(hub, request_ids[p], 0, poll_s=poll_s):
                await queue.put((p, x))
        except Exception as e:  # Redis gone past the client's patience: say so in the stream
            await queue.put((p, StreamError("redis_unavailable", f"{type(e).__name__}: {e}",
                                            503)))

    tasks = [asyncio.create_task(one(p)) for p in range(len(request_ids))]
    held: dict[tuple[int, int], str] = {}  # text that came with no token: goes with the end
    try:
        for p in range(len(request_ids)):
            opening = chunks.opening(p)  # made again on a reconnect: offsets start after it
            if pos.prompts[p] == -1:
                pos.prompts[p] = 0
                if opening is not None:
                    yield event(opening, pos.encode(fmt.call_id))
        left = len(request_ids)
        while left:
            p, x = await queue.get()
            if isinstance(x, StreamError):
                yield event(error_data(x.code, x.message, x.status))
                break
            if isinstance(x, Ended):
                left -= 1
                if x.error is not None:
                    yield event(error_data(x.error.code, str(x.error), status_of(x.error)))
                    break
                results[p] = x.result
                finish = chunks.finish_event(p, x.result, {
                    i: t for (q, i), t in held.items() if q == p})
                if pos.prompts[p] != DONE:
                    pos.prompts[p] = DONE
                    yield event(finish, pos.encode(fmt.call_id))
                continue
            if x.get("restart"):
                if pos.tokens(p) > 0 or pos.prompts[p] == DONE:
                    yield event(error_data(STREAM_RESTARTED, (
                        f"request {request_ids[p]} had to start over from its prompt (its "
                        "tokens could not be continued): the text sent so far is void"), 500))
                    break
                sent.prompts[p] = 0
            if not x["token_ids"]:  # a tail with text only: it goes with the finish
                if x.get("text"):
                    key = (p, x.get("index", 0))
                    held[key] = held.get(key, "") + x["text"]
                continue
            data = chunks.tokens_event(p, x, len(fmt.prompt_ids[p]) if p < len(
                fmt.prompt_ids) else 0)
            sent.prompts[p] = sent.tokens(p) + len(x["token_ids"])
            if pos.prompts[p] != DONE and sent.tokens(p) > pos.tokens(p):
                pos.prompts[p] = sent.tokens(p)
                yield event(data, pos.encode(fmt.call_id))
        else:
            if fmt.include_usage and not pos.usage_sent and all(r is not None for r in results):
                pos.usage_sent = True
                yield event(chunks.usage_event(results), pos.encode(fmt.call_id))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def parse_sse(lines) -> Iterator[tuple[str | None, str]]:
    """The events of an SSE text, line by line (a client's reading of what `sse` writes):
    (the event's id, or None when it has none, its data) per event; comments are skipped."""
    event_id, data = None, []
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield event_id, "\n".join(data)
