"""Redis tier and unit tests: live streams (a `live` request's chunks written after every engine
step and published on its live channel: app/state/lua_outputs.py STREAM_APPEND,
workers/streaming.py, workers/engine/stream_watch.py). The online API's reader of them is
tests/test_live_reader.py; a real worker's live stream is tests/test_online_api_e2e.py's."""
from __future__ import annotations

import json
import time

import pytest

from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields, wire_kwargs
from app.state import keys
from app.state.conn import connect
from app.state.store import RequestStore
from app.state.streams import APPENDED, FENCED, Chunk, TokenStreams, parse_published
from tests.unit_helpers import wait_until
from workers.engine.stream_watch import StreamWatch, WatchedRun
from workers.stream_sink import StreamSink

KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 64}


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def running(store, rid: str) -> str:
    req = parse_request(KW)
    assert store.create(rid, record_fields(req, time.time(), 3600))
    b = store.begin(rid, 0, "w1", 11, time.time(), 3)
    assert b.action == "run"
    return b.token


def test_live_is_a_version_3_field_that_a_plain_request_never_carries():
    """A request with `live` is stamped schema version 3 (a worker from before it hands the
    message back, never fails it); one without it stays at the lowest version and its message
    does not carry the field."""
    live = parse_request({**KW, "live": True})
    plain = parse_request(KW)
    assert live.schema_version == 3 and wire_kwargs(live)["live"] is True
    assert plain.schema_version == 1 and "live" not in wire_kwargs(plain)
    with pytest.raises(Exception, match="version 3 fields \\(live\\) need schema_version 3"):
        parse_request({**KW, "live": True, "schema_version": 2})


@pytest.mark.redis
def test_a_live_chunk_is_published_exactly_as_it_was_appended_and_only_then(store):
    """Given a subscriber on a running request's live channel, when chunks are appended, then a
    live chunk's entry comes on the channel with the id and fields the stream holds (its step
    stamp `w` included), a chunk that is not live publishes nothing, and a fenced one (another
    claim's) neither."""
    token = running(store, "r1")
    ts = TokenStreams(store.raw)
    sub = store.raw.pubsub()
    sub.subscribe(keys.live("r1"))
    assert sub.get_message(timeout=1)["type"] == "subscribe"
    first = Chunk("r1", token, 1, 0, [5, 6], "ab", [1, 1], prompt_ids=[1, 2], live=True,
                  made_at=1700000000.25)
    assert ts.append_many([first]) == [APPENDED]
    msg = sub.get_message(timeout=1)
    published = parse_published(msg["data"])
    (stored,) = ts.entries("r1")
    assert published == stored
    assert (published.token_ids, published.text, published.made_at) == ([5, 6], "ab",
                                                                         1700000000.25)
    assert ts.append_many([Chunk("r1", token, 2, 2, [7], "c", [1])]) == [APPENDED]
    assert ts.append_many([Chunk("r1", "other", 1, 3, [8], "d", [1], live=True)]) == [FENCED]
    assert sub.get_message(timeout=0.3) is None
    assert len(ts.entries("r1")) == 2
    sub.close()


@pytest.mark.redis
def test_a_live_tap_writes_every_token_at_once_and_a_plain_one_waits_for_its_flush(store):
    """Given a flusher with a 60 s flush interval and 64-token chunks, when one token comes to
    a live tap and one to a plain tap, then the live one is in Redis (and published) at once,
    stamped with its step's time, while the plain one waits for the interval."""
    live_token, plain_token = running(store, "live"), running(store, "plain")
    sink = StreamSink(TokenStreams(store.raw), 60_000, 64).start()
    try:
        live = sink.open("live", live_token, 1, "tiny-llama", None, live=True)
        plain = sink.open("plain", plain_token, 1, "tiny-llama", None)
        live.set_prompt([1])
        plain.set_prompt([1])
        plain.add([9], "x")
        live.add([5], "a", made_at=123.5)
        wait_until(lambda: live.written == 1, 5)
        (e,) = sink.streams.entries("live")
        assert (e.token_ids, e.made_at) == ([5], 123.5)
        live.add([6], "b", made_at=124.0)
        wait_until(lambda: live.written == 2, 5)
        assert plain.written == 0 and sink.streams.entries("plain") == []
    finally:
        sink.stop()


class _Det:
    def __init__(self):
        self.output_token_ids, self.output_text, self.stop_buffer_length = [], "", 0


class _State:
    def __init__(self, request_index=0):
        self.detokenizer = _Det()
        self.request_index = request_index
        self.prompt_token_ids = [1, 2]
        self.logprobs_processor = None


class _OutputProcessor:
    """vLLM's OutputProcessor as the watch reads it: request states by id, and the
    `process_outputs` the AsyncLLM output loop calls once per engine step."""

    def __init__(self):
        self.external_req_ids = {}
        self.request_states = {}
        self.steps = 0

    def add(self, rid: str) -> _State:
        self.external_req_ids[rid] = [rid + "-int"]
        self.request_states[rid + "-int"] = _State()
        return self.request_states[rid + "-int"]

    def process_outputs(self, outputs, engine_core_timestamp=None, iteration_stats=None):
        self.steps += 1
        for rid, token in outputs:  # the step's new token per request
            det = self.request_states[rid + "-int"].detokenizer
            det.output_token_ids.append(token)
            det.output_text += f"<{token}>"
        return "processed"


class _Llm:
    def __init__(self):
        self.output_processor = _OutputProcessor()


class _Tap:
    def __init__(self, live):
        self.live, self.prompt_ids, self.added = live, None, []

    def set_prompt(self, ids):
        self.prompt_ids = ids

    def add(self, token_ids, text, *, index=0, logprobs=None, made_at=None):
        self.added.append((token_ids, text, made_at))


def test_a_live_run_is_read_after_every_engine_step_and_a_plain_one_only_on_the_tick():
    """Given a watch ticking every hour over a live run and a plain run, when the engine's
    output loop processes two steps, then the live run's tap has each step's token right after
    that step (the processor's own return value passed through), stamped with the step's time
    from EngineCore's monotonic clock; the plain run's tap has nothing until the tick."""
    llm = _Llm()
    op = llm.output_processor
    op.add("live"), op.add("plain")
    watch = StreamWatch(llm, period=3600)
    live, plain = _Tap(True), _Tap(False)
    watch._runs["plain"] = WatchedRun(plain)  # watch() needs a running loop for its tick
    watch._live["live"] = watch._runs["live"] = WatchedRun(live)
    watch._hook_steps()
    step_at = time.monotonic() - 0.5  # EngineCore stamped the step half a second ago
    assert op.process_outputs([("live", 7), ("plain", 8)], step_at) == "processed"
    assert [a[:2] for a in live.added] == [([7], "<7>")]
    assert abs(live.added[0][2] - (time.time() - 0.5)) < 0.2
    op.process_outputs([("live", 9), ("plain", 10)], time.monotonic())
    assert [a[:2] for a in live.added] == [([7], "<7>"), ([9], "<9>")]
    assert plain.added == [] and op.steps == 2
    watch.tick()
    assert plain.added == [([8, 10], "<8><10>", None)]
    watch.unwatch("live")
    op.process_outputs([("live", 11)], time.monotonic())
    assert len(live.added) == 2  # no longer watched: not read
    json.dumps([a[:2] for a in live.added])  # plain data only
