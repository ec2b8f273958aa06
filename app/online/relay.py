"""Following one request from the online API's event loop: its stream's chunks from a position
on, as they are appended, then its end (docs/api.md, "How a stream continues").

The same chunks as `VigilAsyncResult.stream(after)` (app/requests/stream_cursor.py), read
without a thread: the request's live channel and result channel wake the follower
(app/state/live.py); the stream itself (XRANGE after the last entry read) and the record are
what it trusts. A chunk published live is taken as it comes when it continues what was read,
else the stream is read; silence longer than `poll_s` reads the stream and the record again
(a lost message delays, never loses). So whatever happens to the worker that runs the request
(SIGKILL, a wedge, an engine death, a preemption, a drain), the follower waits without a
sound and goes on with the chunks of the attempt that continues it, from the same token.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.errors import REQUEST_LOST, TerminalError, VigilError, error_from_record
from app.requests.stream_cursor import StreamCursor
from app.state.calls import REDIS_ERRORS
from app.state.live import CHUNK, LiveHub, entry_key
from app.state.store_reads import Outcome
from app.state.streams import Entry

# How long a follower waits for its channels before it reads the stream and the record anyway:
# the backstop for a message lost (the hub also tells every follower to read again when its
# connection comes back or a queue overflowed). Each read costs Redis two commands per waiting
# stream: 2,000 waiting streams polled every 2 s took a third of a core (bench/gateway_streams.py).
POLL_S = 15.0


@dataclass
class Ended:
    """The request's end: its result (SUCCEEDED) or its error."""

    result: dict | None
    error: VigilError | None


def _restart(chunks: list[dict]) -> bool:
    return any(c.get("restart") for c in chunks)


async def follow(hub: LiveHub, request_id: str, after: int = 0, *,
                 poll_s: float = POLL_S) -> AsyncIterator[dict | Ended]:
    """Yield the request's stream chunks after token `after` (dicts as
    `VigilAsyncResult.stream` yields them, the last ones from the result: each sample's tail,
    marked `final`), then one `Ended`. A request Redis has no record of ends at once with
    TerminalError(request_lost)."""
    sub = await hub.follow(request_id)
    cursor = StreamCursor(after)
    last = "0-0"
    try:
        while True:
            entries, status, outcome = await _read(hub, request_id, last, poll_s)
            for e in entries:
                last = e.entry_id
                for c in cursor.take_all(e):
                    yield c
            if status is None and not entries and last == "0-0":
                yield Ended(None, TerminalError.of(
                    REQUEST_LOST, f"Redis has no record of request {request_id}"))
                return
            if outcome is not None:
                async for x in _end(cursor, outcome):
                    yield x
                return
            # Wait for a live chunk or the end; take live chunks as they come while they
            # continue the stream read so far.
            while True:
                try:
                    kind, entry = await asyncio.wait_for(sub.queue.get(), poll_s)
                except asyncio.TimeoutError:
                    break  # read the stream and the record again
                if kind != CHUNK:
                    break  # the end (or messages lost): read both
                if entry_key(entry.entry_id) <= entry_key(last):
                    continue  # already read
                if not _continues(cursor, entry):
                    break  # a gap: read the stream
                last = entry.entry_id
                for c in cursor.take_all(entry):
                    yield c
    finally:
        await hub.unfollow(sub)


async def _read(hub: LiveHub, request_id: str, last: str, poll_s: float):
    """(the stream's entries after `last`, the record's status, its outcome), once Redis
    answers: a Redis away (or the pool busy) is waited out, `poll_s` at a time. With an
    outcome, the entries include every one written before the end."""
    while True:
        try:
            entries = await hub.entries(request_id, last)
            status, outcome = await hub.outcome(request_id)
            if outcome is not None:
                entries += await hub.entries(request_id,
                                             entries[-1].entry_id if entries else last)
            return entries, status, outcome
        except REDIS_ERRORS:
            await asyncio.sleep(poll_s)


def _continues(cursor: StreamCursor, e: Entry) -> bool:
    """Whether entry `e` is the next one after what the cursor read (its start is where the
    stream it read ends, or it restarts the stream)."""
    return e.reset or e.start == cursor.total


async def _end(cursor: StreamCursor, outcome: Outcome) -> AsyncIterator[dict | Ended]:
    if outcome.status != "SUCCEEDED":
        yield Ended(None, error_from_record(outcome.error_kind, outcome.error))
        return
    for c in cursor.finals(outcome.result or {}):
        yield c
    yield Ended(outcome.result, None)


async def wait(hub: LiveHub, request_id: str, *, poll_s: float = POLL_S) -> Ended:
    """The request's end, waited for without reading its stream: woken by its result
    channel, checked against the record every `poll_s` at the latest."""
    sub = await hub.follow(request_id)
    try:
        while True:
            try:
                status, outcome = await hub.outcome(request_id)
            except REDIS_ERRORS:  # Redis away (or its pool busy): wait for it
                await asyncio.sleep(poll_s)
                continue
            if status is None:
                return Ended(None, TerminalError.of(
                    REQUEST_LOST, f"Redis has no record of request {request_id}"))
            if outcome is not None:
                if outcome.status == "SUCCEEDED":
                    return Ended(outcome.result, None)
                return Ended(None, error_from_record(outcome.error_kind, outcome.error))
            try:
                while True:
                    kind, _ = await asyncio.wait_for(sub.queue.get(), poll_s)
                    if kind != CHUNK:
                        break
            except asyncio.TimeoutError:
                pass
    finally:
        await hub.unfollow(sub)
