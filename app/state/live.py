"""The online API's reads of Redis, asynchronous: thousands of requests followed by one process
on one event loop, with no thread and no connection per follower (docs/api.md, "The online
API").

- One pub/sub connection per `LiveHub` carries every followed request's two channels: its live
  channel (app/state/keys.py `live`: each chunk a `live` request's stream appends, published by
  the append's own script) and Celery's result channel (`celery-task-meta-<id>`: published when
  the request's result is stored, app/state/lua_records.py FINISH, or by Celery's backend for an
  error). Messages are fanned out to each follower's queue.
- Reads of the stream (XRANGE after an entry) and of the record's outcome go through a small
  pool of the same client.

A subscription may miss messages (the pub/sub connection dropped and came back, a follower's
queue overflowed): the hub then tells every follower to read again (`RESYNC`), and a follower
that hears nothing for a while reads again anyway, so a lost message delays a reader by at most
that while, never loses it anything: the stream and the record are the truth, the channels only
wake readers early.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis

from app.state import keys
from app.state.store_reads import Outcome
from app.state.streams import Entry, parse_entry, parse_published

log = logging.getLogger("vigil.live")

# What a follower's queue receives.
CHUNK = "chunk"  # (CHUNK, Entry): a live chunk, as appended
ENDED = "ended"  # (ENDED, None): the request's result channel spoke (it has likely ended)
RESYNC = "resync"  # (RESYNC, None): messages may have been lost: read the stream and record
# A follower's queue bound: past it the follower is told to resync instead (a slow client
# never makes the hub hold an unbounded backlog).
QUEUE_MAX = 1024
RECONNECT_S = 0.5


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a comparable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Follow:
    """One follower's subscription: its queue of (kind, entry) messages."""

    request_id: str
    channels: tuple[bytes, bytes]
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(QUEUE_MAX))

    def put(self, item: tuple) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:  # drop the backlog: the follower reads the stream again
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait((RESYNC, None))


class LiveHub:
    """The live channels and result channels of the requests this process follows, on one
    pub/sub connection (module docstring), and the async reads of streams and records.
    `result_channel(request_id)` names Celery's result channel of a request (its backend's key).
    Use from one event loop; `close()` when done."""

    def __init__(self, client: aioredis.Redis, result_channel):
        self.r = client
        self._result_channel = result_channel
        self._pubsub = None
        self._follows: dict[bytes, set[Follow]] = {}
        self._reader: asyncio.Task | None = None
        self._closed = False
        self.messages = 0
        self.resyncs = 0

    async def follow(self, request_id: str) -> Follow:
        """Subscribe to `request_id`'s live and result channels; messages come on the returned
        Follow's queue from now on. Call `unfollow` when done."""
        chans = (keys.live(request_id).encode(), _b(self._result_channel(request_id)))
        f = Follow(request_id, chans)
        new = [c for c in chans if c not in self._follows]
        for c in chans:
            self._follows.setdefault(c, set()).add(f)
        if self._pubsub is None:
            self._pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        if new:
            try:
                await self._pubsub.subscribe(*new)
            except (redis.RedisError, OSError):
                f.put((RESYNC, None))  # the reader reconnects and subscribes again
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        return f

    async def unfollow(self, f: Follow) -> None:
        """Stop `f`'s messages (its channels are unsubscribed once nobody follows them)."""
        gone = []
        for c in f.channels:
            subs = self._follows.get(c)
            if subs is not None:
                subs.discard(f)
                if not subs:
                    del self._follows[c]
                    gone.append(c)
        if gone and self._pubsub is not None:
            try:
                await self._pubsub.unsubscribe(*gone)
            except (redis.RedisError, OSError):
                pass  # the reader's reconnect subscribes only to what is still followed

    @property
    def followed(self) -> int:
        """Requests followed now."""
        return len({f for subs in self._follows.values() for f in subs})

    async def _read(self) -> None:
        while not self._closed:
            try:
                msg = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the connection dropped: subscribe again, tell everyone
                if self._closed:
                    return
                log.warning("live channels: %s; reconnecting", e)
                await self._reconnect()
                continue
            if msg is None or msg.get("type") not in ("message", "pmessage"):
                if not self._follows and msg is None:
                    return  # nothing followed: the next follow starts a reader again
                continue
            self.messages += 1
            chan = _b(msg["channel"])
            subs = self._follows.get(chan)
            if not subs:
                continue
            if chan.startswith(keys.LIVE_PREFIX.encode()):
                try:
                    item = (CHUNK, parse_published(msg["data"]))
                except (ValueError, KeyError, TypeError):
                    item = (RESYNC, None)
            else:
                item = (ENDED, None)
            for f in list(subs):
                f.put(item)

    async def _reconnect(self) -> None:
        self.resyncs += 1
        old, self._pubsub = self._pubsub, None
        if old is not None:
            try:
                await old.aclose()
            except Exception:
                pass
        while not self._closed:
            await asyncio.sleep(RECONNECT_S)
            try:
                ps = self.r.pubsub(ignore_subscribe_messages=True)
                if self._follows:
                    await ps.subscribe(*self._follows)
                self._pubsub = ps
                break
            except (redis.RedisError, OSError) as e:
                log.warning("live channels: still no Redis (%s)", e)
        for f in {f for subs in self._follows.values() for f in subs}:
            f.put((RESYNC, None))

    async def entries(self, request_id: str, after: str = "0-0") -> list[Entry]:
        """The request's stream entries after entry id `after` (exclusive)."""
        start = "-" if after == "0-0" else "(" + after
        raw = await self.r.xrange(keys.stream(request_id), start, "+")
        return [parse_entry(i, f) for i, f in raw]

    async def outcome(self, request_id: str) -> tuple[str | None, Outcome | None]:
        """(status, outcome): status None without a record; the outcome once it ended."""
        status, result, kind, err = await self.r.hmget(keys.request(request_id), "status",
                                                       "result", "error_kind", "error")
        if status is None:
            return None, None
        st = status.decode()
        return st, (Outcome.from_reply(status, result, kind, err)
                    if st in keys.TERMINAL else None)

    async def close(self) -> None:
        """Stop the reader and close the connections."""
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        if self._pubsub is not None:
            try:
                await self._pubsub.aclose()
            except Exception:
                pass
        await self.r.aclose()


def _b(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()
