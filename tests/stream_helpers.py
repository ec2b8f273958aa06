"""Shared by the token stream tests (tests/test_token_streams.py, tests/test_stream_flusher.py):
a RUNNING request's claim and a scripted chunk of its stream, on a real redis-server."""
from __future__ import annotations

import time

from app.requests.record_fields import record_fields
from app.requests.schemas import parse_request
from app.state.streams import Chunk

KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 64}


def running(store, rid: str, instance: int = 11) -> str:
    """A RUNNING request; returns its claim's begin token (what fences its stream)."""
    req = parse_request(KW)
    assert store.create(rid, record_fields(req, time.time(), 3600))
    b = store.begin(rid, 0, "w1", instance, time.time(), 3)
    assert b.action == "run" and b.streamed == 0
    return b.token


def chunk(rid, token, start, ids, text, attempt=1, **kw) -> Chunk:
    return Chunk(rid, token, attempt, start, ids, text, [0] * (len(ids) - 1) + [len(text)],
                 **kw)
