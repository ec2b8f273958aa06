"""Redis tier and unit tests: the worker's stream flusher (workers/stream_sink.py,
workers/streaming.py `StreamTap`): one round trip per flush, chunks due by size or time, one in
flight per tap, fencing, and Redis away while a worker streams (docs/failure-modes.md, "Token
streams"). The stream's own rules: tests/test_token_streams.py."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from app.local.embedded import stop_process
from app.requests.stream_cursor import StreamCursor
from app.settings import load_settings
from app.state.conn import connect
from app.state.store import RequestStore
from app.state.streams import Checkpoint, TokenStreams
from tests.conftest import CACHE_DIR
from tests.redis_servers import LocalRedis
from tests.stream_helpers import chunk, running
from tests.unit_helpers import wait_until
from workers.stream_sink import StreamSink
from workers.streaming import StreamTap


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


# -- the worker's flusher -------------------------------------------------------------------------
class RoundTrips:
    """Counts the separate sends to Redis (round trips) on redis-py's connections."""

    def __init__(self, monkeypatch):
        self.sends = 0
        orig = redis.connection.Connection.send_packed_command

        def counted(conn, command, check_health=True):
            self.sends += 1
            return orig(conn, command, check_health)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)


def open_tap(sink, store, rid, prompt=(1,)):
    tap = sink.open(rid, running(store, rid), 1, "tiny-llama", None)
    tap.set_prompt(list(prompt))
    return tap


@pytest.mark.redis
def test_one_flush_writes_every_request_in_one_round_trip(store, monkeypatch):
    """Given 20 running requests with unwritten tokens, a flush writes a chunk for each, and
    sends to Redis once (one pipeline: one round trip for all of them)."""
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=64)
    taps = [open_tap(sink, store, f"f{i}", (1, 2, 3)) for i in range(20)]
    for t in taps:
        t.add([10, 11], "xy")
    sink.flush(force=True)  # loads the script once
    for t in taps:
        t.add([12], "z")
    trips = RoundTrips(monkeypatch)
    assert sink.flush(force=True) == 20
    assert trips.sends == 1
    for i in range(20):
        cp = TokenStreams(store.raw).checkpoint(f"f{i}")
        assert cp.token_ids == [10, 11, 12] and cp.text == "xyz" and cp.prompt_ids == [1, 2, 3]


@pytest.mark.redis
def test_a_chunk_is_due_by_size_or_by_time_whichever_first(store):
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=4)
    tap = open_tap(sink, store, "d1")
    tap.add([5, 6], "ab")
    assert tap.take_chunk(time.monotonic(), 0.2, 4) is None  # 2 tokens, just now
    c = tap.take_chunk(time.monotonic() + 0.3, 0.2, 4)  # 2 tokens, 300 ms
    assert c is not None
    tap.chunk_written(c, None)  # not written: still pending
    tap.add([7, 8], "cd")
    assert tap.take_chunk(time.monotonic(), 0.2, 4) is not None  # 4 tokens


@pytest.mark.redis
def test_one_chunk_of_a_tap_is_in_flight_at_a_time(store):
    """A hand-back's flush and the flusher thread never send the same tokens twice."""
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=64)
    tap = open_tap(sink, store, "i1")
    tap.add([5, 6], "ab")
    c = tap.take_chunk(0, 0.2, 64, force=True)
    assert tap.take_chunk(0, 0.2, 64, force=True) is None
    assert sink.flush(force=True) == 0
    tap.chunk_written(c, sink.streams.append_many([c])[0])
    tap.add([7], "c")
    assert sink.flush(force=True) == 1
    assert sink.streams.checkpoint("i1").token_ids == [5, 6, 7]


@pytest.mark.redis
def test_tokens_that_arrive_while_a_chunk_is_written_stay_pending(store):
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=64)
    tap = open_tap(sink, store, "p1")
    tap.add([5, 6], "ab", [1, 1])
    c = tap.take_chunk(0, 0.2, 64, force=True)
    tap.add([7], "c")  # during the write
    tap.chunk_written(c, sink.streams.append_many([c])[0])
    assert tap.unwritten() == 1
    sink.flush(force=True)
    cp = sink.streams.checkpoint("p1")
    assert cp.token_ids == [5, 6, 7] and cp.text == "abc"


@pytest.mark.redis
def test_the_last_write_of_a_yielding_request_waits_for_the_chunk_in_flight(store):
    """Given a tap whose chunk the flusher thread is writing (Redis holds writes for a second:
    CLIENT PAUSE WRITE, a slow round trip), when its request yields its slot and its last
    tokens come in, then `write_now` waits for that chunk's answer and writes the rest: every
    token is in the stream, none left to count as discarded (eb37a72 gave up at once)."""
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=64)
    tap = open_tap(sink, store, "y1")
    tap.add([5, 6], "ab")
    store.raw.client_pause(1000, all=False)
    flusher = threading.Thread(target=sink.flush, kwargs={"force": True})
    flusher.start()
    wait_until(lambda: tap._in_flight)
    tap.add([7], "c")  # read out of the engine right before the yield
    assert sink.write_now(tap) and tap.unwritten() == 0
    flusher.join(10)
    cp = sink.streams.checkpoint("y1")
    assert cp.token_ids == [5, 6, 7] and cp.text == "abc"


@pytest.mark.redis
def test_the_last_write_gives_up_on_a_chunk_in_flight_at_its_bound(store):
    """A chunk in flight whose answer never comes (a flusher stuck) holds the last write only
    for its bound: it returns False, the tokens left unwritten (the close counts them)."""
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=64)
    tap = open_tap(sink, store, "y2")
    tap.add([5], "a")
    assert tap.take_chunk(0, 0.2, 64, force=True) is not None  # in flight, never answered
    tap.add([6], "b")
    assert sink.write_now(tap, timeout=0.2) is False and tap.unwritten() == 2


@pytest.mark.redis
def test_a_reply_from_before_a_restart_is_ignored(store):
    """A chunk of the old run in flight while the tap restarts its stream: its reply must not
    make the new run's tokens follow the old ones."""
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=64)
    tap = open_tap(sink, store, "g1")
    tap.add([5, 6], "ab")
    old = tap.take_chunk(0, 0.2, 64, force=True)
    tap.refuse_resume("test")
    tap.chunk_written(old, sink.streams.append_many([old])[0])
    tap.set_prompt([1])
    tap.add([9], "z")
    assert sink.flush(force=True) == 1
    cp = sink.streams.checkpoint("g1")
    assert cp.token_ids == [9] and cp.text == "z"


@pytest.mark.redis
def test_a_fenced_tap_writes_nothing_more(store):
    sink = StreamSink(TokenStreams(store.raw), flush_ms=200, chunk_tokens=64)
    running(store, "x1")
    tap = sink.open("x1", "not-the-running-claim", 1, "tiny-llama", None)
    tap.set_prompt([1])
    tap.add([5], "a")
    assert sink.flush(force=True) == 0 and tap.dead
    tap.add([6], "b")
    assert tap.take_chunk(0, 0.0, 1, force=True) is None


@pytest.mark.redis
def test_every_flush_interval_writes_all_that_is_pending(store):
    """Tokens that came just after a write go at the next interval, not the one after; an early
    wake (a full chunk) writes only what is due."""
    sink = StreamSink(TokenStreams(store.raw), flush_ms=300, chunk_tokens=4)
    small, full = open_tap(sink, store, "t1"), open_tap(sink, store, "t2")
    small.add([5], "a")
    full.add([5, 6, 7, 8], "abcd")
    assert sink.tick(early=True) == 1  # the full chunk only
    assert small.unwritten() == 1
    assert sink.tick(early=False) == 1  # the interval: the rest, however young
    assert small.unwritten() == 0


@pytest.mark.redis
def test_the_flusher_thread_writes_on_its_own(store):
    sink = StreamSink(TokenStreams(store.raw), flush_ms=20, chunk_tokens=64).start()
    try:
        tap = open_tap(sink, store, "t3")
        tap.add([5, 6, 7], "abc")
        deadline = time.monotonic() + 10
        while tap.unwritten() and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert tap.unwritten() == 0
    finally:
        sink.stop()


# -- Redis away while a worker streams (docs/failure-modes.md, "Token streams") -----------------
@pytest.fixture()
def restartable_redis():
    """A private redis-server (AOF) that a test stops and starts again on the same port."""
    server = LocalRedis(appendonly=True).start()
    yield server
    server.stop()


def stop_redis(server: LocalRedis) -> None:
    """Stop the server cleanly (SIGTERM: its AOF written), keeping its data for `start`."""
    stop_process(server.proc, timeout=10)
    server.proc = None


def worker_sink(server: LocalRedis, outage_grace: float):
    """A worker's store on `server` (its calls ride out `outage_grace` seconds of outage) and
    its running flusher (every 50 ms), as workers/runtime.py builds them."""
    settings = load_settings(redis_url=server.url, cache_dir=CACHE_DIR)
    store = RequestStore(connect(settings), settings.result_ttl, outage_grace)
    return store, StreamSink(store.streams(), flush_ms=50, chunk_tokens=64).start()


def each_token_once(store, rid: str) -> list[int]:
    """The stream's token ids, checking that its chunks follow each other without gap or
    overlap (nothing written twice)."""
    at, ids = 0, []
    for e in TokenStreams(store.raw).entries(rid):
        if e.end:
            continue
        assert e.start == at, f"chunk at {e.start}, the stream ended at {at}"
        at += len(e.token_ids)
        ids += e.token_ids
    return ids


def streamed_through_an_outage(server: LocalRedis, caplog, rid: str, outage_grace: float,
                               logged: str) -> RequestStore:
    """A worker (its store riding out `outage_grace` s) streams "ab" of `rid` into `server`,
    which then stops; "cd" arrives, and "e" once `logged` is in the log; the three tokens are
    still in the tap (asserted). Redis starts again and every token is written; returns the
    worker's store, its flusher stopped."""
    caplog.set_level(logging.WARNING)
    store, sink = worker_sink(server, outage_grace)
    try:
        tap = open_tap(sink, store, rid)
        tap.add([1, 2], "ab")
        wait_until(lambda: tap.unwritten() == 0)
        stop_redis(server)
        tap.add([3, 4], "cd")
        wait_until(lambda: logged in caplog.text)
        tap.add([5], "e")
        assert tap.unwritten() == 3
        server.start()
        wait_until(lambda: tap.unwritten() == 0, 30)
        return store
    finally:
        sink.stop()


@pytest.mark.redis
def test_a_flush_while_redis_restarts_waits_for_it_and_writes_every_token_once(
        restartable_redis, caplog):
    """Given a worker streaming a request (outage grace 30 s), when Redis stops with tokens
    already written and more arrive while it is down, then the flush does not fail: it waits
    for Redis (the store's outage policy), the tokens stay in the tap meanwhile, and once Redis
    is back every token is in the stream exactly once, in order (the script cache lost with
    the restart is loaded again)."""
    store = streamed_through_an_outage(restartable_redis, caplog, "o1", outage_grace=30,
                                       logged="cannot reach Redis")  # the flush is retrying
    assert each_token_once(store, "o1") == [1, 2, 3, 4, 5]
    assert TokenStreams(store.raw).checkpoint("o1").text == "abcde"
    assert "could not write token streams" not in caplog.text  # waited, never failed


@pytest.mark.redis
def test_a_flush_failing_past_the_outage_grace_is_logged_and_sent_again(restartable_redis,
                                                                         caplog):
    """Given a worker streaming a request, when Redis stays away longer than the outage grace
    (0.5 s here, 120 s by default), then the flush fails with redis_unavailable and says so in
    the log, the tokens stay pending in the tap (the worker goes on), and the next flush after
    Redis is back writes them, each once."""
    store = streamed_through_an_outage(
        restartable_redis, caplog, "o2", outage_grace=0.5,
        logged="could not write token streams: redis_unavailable")
    assert each_token_once(store, "o2") == [1, 2, 3, 4, 5]


def test_a_tap_resumes_from_everything_it_holds_and_a_refusal_starts_over():
    prior = Checkpoint([1, 2], [10, 11], "ab", "fp-old", [])
    tap = StreamTap(None, "r", "claim", 2, "tiny-llama", prior, adapter_fingerprint="fp-new")
    tap.add([12], "c")
    cp = tap.resume_point()
    assert cp.token_ids == [10, 11, 12] and cp.text == "abc" and cp.prompt_ids == [1, 2]
    assert cp.adapter_fingerprint == "fp-old"  # what the tokens were made with
    tap.refuse_resume("test")
    assert tap.resume_point() is None
    tap.set_prompt([1, 2])
    tap.add([20], "z")
    c = tap.take_chunk(0, 0.0, 1, force=True)
    assert c.reset and c.start == 0 and c.prompt_ids == [1, 2]
    assert c.adapter_fingerprint == "fp-new"


@pytest.mark.redis
def test_a_refused_resume_restarts_the_stream_before_the_result_is_stored(store):
    """A refusal is written by the time its attempt closes, even if the run streamed nothing:
    a reader must not take the old tokens for the start of the new result."""
    token = running(store, "z1")
    ts = TokenStreams(store.raw)
    ts.append_many([chunk("z1", token, 0, [1, 2], "ab", prompt_ids=[5])])
    store.requeue("z1", 11, 1)
    b = store.begin("z1", 1, "w2", 22, time.time(), 3)
    sink = StreamSink(ts, flush_ms=60000, chunk_tokens=64)
    tap = sink.open("z1", b.token, 2, "tiny-llama", ts.checkpoint("z1"))
    tap.refuse_resume("test")
    sink.close(tap, ok=True)
    entries = ts.entries("z1")
    assert entries[-1].reset and entries[-1].token_ids == []
    assert ts.checkpoint("z1") is None
    assert store.get("z1")["streamed"] == "0"
    cur = StreamCursor(0)
    got = [c for e in entries if (c := cur.take(e)) is not None]
    assert got[-1] == {"offset": 0, "text": "", "token_ids": [], "restart": True}
    assert cur.final({"text": "xyz", "token_ids": [7, 8, 9]})["text"] == "xyz"
