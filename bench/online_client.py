"""The online bench's client: streamed `/v1/completions` through one asyncio HTTP client (httpx,
no thread per stream), every event's receipt time recorded (bench/online.py).

A `Stream` is one request as its client saw it: when it was sent, and for every SSE event that
carried tokens, when it arrived (the monotonic clock for TTFT and inter-token gaps, the wall
clock for the live delay against the engine's step time) and the token ids it carried (the
body asks `return_token_ids`, on both sides). Latencies are counted as vLLM's own benchmark
counts them (`vllm bench serve`, vllm/benchmarks/lib/endpoint_request_func.py): TTFT is the
first event with tokens, inter-token latency (ITL) one gap per later event with tokens, so an
event that carries several tokens is one gap (`tokens_per_event` says how often that happened).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

MODEL = "tiny-llama"


@dataclass
class Stream:
    """One streamed request as its client saw it (module docstring)."""

    key: str  # the request id the client named (X-Request-Id): Vigil's request id
    sent: float = 0.0  # time.monotonic() when the request was sent
    sent_wall: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # monotonic, per event with tokens
    walls: list[float] = field(default_factory=list)  # wall clock, per event with tokens
    counts: list[int] = field(default_factory=list)  # tokens per event
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    done: bool = False  # `data: [DONE]` arrived
    error: str | None = None
    status: int = 0
    events: int = 0  # every data event, [DONE] included

    @property
    def ok(self) -> bool:
        """Ended with [DONE], a finish_reason and no error."""
        return self.done and self.error is None and self.finish is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from the send to the first event with tokens (None without one)."""
        return self.arrivals[0] - self.sent if self.arrivals else None

    def gaps(self) -> list[float]:
        """The inter-token latencies: one per event with tokens after the first."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def body(prompt: str, max_tokens: int) -> dict:
    """A greedy streamed completion of exactly `max_tokens` tokens (ignore_eos), with the token
    ids in every chunk."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}


def client(connections: int) -> httpx.AsyncClient:
    """One async client for `connections` streams at once, no timeouts (a paused stream waits
    for the reaper)."""
    limits = httpx.Limits(max_connections=connections + 8,
                          max_keepalive_connections=connections + 8)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None))


def take_event(s: Stream, data: bytes, mono: float, wall: float) -> None:
    """One SSE `data:` payload of `s`, received at (`mono`, `wall`)."""
    s.events += 1
    if data == b"[DONE]":
        s.done = True
        return
    try:
        msg = json.loads(data)
    except ValueError:
        s.error = f"not JSON: {data[:80]!r}"
        return
    if msg.get("error"):
        s.error = json.dumps(msg["error"])[:300]
        return
    for c in msg.get("choices") or ():
        ids = c.get("token_ids") or []
        if ids:
            s.arrivals.append(mono)
            s.walls.append(wall)
            s.counts.append(len(ids))
            s.token_ids.extend(ids)
        s.text += c.get("text") or ""
        if c.get("finish_reason"):
            s.finish = c["finish_reason"]


async def stream_one(http: httpx.AsyncClient, url: str, headers: dict, s: Stream, b: dict,
                     on_event: Callable[[Stream], None] | None = None) -> Stream:
    """POST `b` to `url` + /v1/completions and read its SSE to the end into `s`."""
    s.sent, s.sent_wall = time.monotonic(), time.time()
    try:
        async with http.stream("POST", url + "/v1/completions", json=b,
                               headers={**headers, "X-Request-Id": s.key}) as r:
            s.status = r.status_code
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return s
            buf = b""
            async for part in r.aiter_bytes():
                mono, wall = time.monotonic(), time.time()
                buf += part
                while b"\n\n" in buf:
                    raw, buf = buf.split(b"\n\n", 1)
                    for line in raw.split(b"\n"):
                        if line.startswith(b"data:"):
                            take_event(s, line[5:].strip(), mono, wall)
                            if on_event is not None:
                                on_event(s)
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    return s


async def run_level(url: str, headers: dict, items: list[tuple[str, dict]], concurrency: int
                    ) -> tuple[list[Stream], float]:
    """Stream every (key, body) of `items`, at most `concurrency` at once (a closed loop: the
    next starts as one ends): (the streams, the wall seconds from the first send to the last
    end)."""
    sem = asyncio.Semaphore(concurrency)
    streams = [Stream(k) for k, _ in items]

    async with client(concurrency) as http:
        async def one(s: Stream, b: dict) -> None:
            async with sem:
                await stream_one(http, url, headers, s, b)

        t0 = time.monotonic()
        await asyncio.gather(*(one(s, b) for s, (_, b) in zip(streams, items)))
        return streams, time.monotonic() - t0


def quantile(xs: list[float], q: float) -> float:
    """The `q` quantile of `xs` (nearest rank); NaN for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))]
