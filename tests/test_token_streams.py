"""Redis tier and unit tests: token streams (app/state/streams.py, workers/streaming.py) and
their readers (VigilAsyncResult.stream). The seam of a resume: tests/test_resume_seam.py.

The engine's side is tested end to end in tests/test_token_stream_e2e.py (a real worker and
engine); here the stream's rules are checked on a real redis-server with scripted chunks."""
from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import redis

from app.errors import TerminalError
from app.local.embedded import stop_process
from app.requests.stream_cursor import StreamCursor
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.settings import load_settings
from app.state import keys
from app.state.conn import connect
from app.state.store import RequestStore
from app.state.streams import (APPENDED, FENCED, OFF_SEQUENCE, Checkpoint, Chunk, Entry,
                               TokenStreams, checkpoint_of)
from tests.conftest import CACHE_DIR
from tests.unit_helpers import wait_until
from tests.redis_servers import LocalRedis
from workers.stream_sink import StreamSink
from workers.streaming import StreamTap

KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 64}


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


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


# -- the fenced append ----------------------------------------------------------------------------
@pytest.mark.redis
def test_only_the_running_claim_appends_and_only_where_the_stream_ends(store):
    """Given a RUNNING request, when chunks are appended, then its claim's next chunk is
    written (once, even when sent again), a gap is refused (off sequence), another claim is
    fenced, and after the finish nothing is written at all."""
    token = running(store, "r1")
    ts = TokenStreams(store.raw)
    first = chunk("r1", token, 0, [1, 2], "ab", prompt_ids=[7, 8])
    assert ts.append_many([first]) == [APPENDED]
    assert ts.append_many([first]) == [APPENDED]  # a pipeline sent again: not written twice
    assert len(ts.entries("r1")) == 1
    assert ts.append_many([chunk("r1", token, 5, [3], "c")]) == [OFF_SEQUENCE]  # a gap
    assert ts.append_many([chunk("r1", "another-claim", 2, [3], "c")]) == [FENCED]
    assert ts.append_many([chunk("r1", token, 2, [3], "c")]) == [APPENDED]
    assert store.get("r1")["streamed"] == "3"
    cp = ts.checkpoint("r1")
    assert (cp.prompt_ids, cp.token_ids, cp.text) == ([7, 8], [1, 2, 3], "abc")
    store.finish("r1", 11, time.time(), result={"text": "abcd", "token_ids": [1, 2, 3, 4]})
    assert ts.append_many([chunk("r1", token, 3, [4], "d")]) == [FENCED]
    entries = ts.entries("r1")
    assert entries[-1].end == "SUCCEEDED" and len(entries) == 3
    assert 0 < store.raw.ttl(keys.stream("r1")) <= store.result_ttl


@pytest.mark.redis
def test_a_new_claim_learns_where_the_stream_ends_from_begin(store):
    """The next attempt's begin says how many tokens the stream holds (its resume point), and
    only its own claim writes from there on."""
    token = running(store, "b1")
    ts = TokenStreams(store.raw)
    ts.append_many([chunk("b1", token, 0, [1, 2, 3], "abc", prompt_ids=[5])])
    assert store.requeue("b1", 11, 1)
    b = store.begin("b1", 1, "w2", 22, time.time(), 3)
    assert b.action == "run" and b.streamed == 3 and b.token != token
    assert ts.append_many([chunk("b1", token, 3, [4], "d")]) == [FENCED]  # the old claim
    assert ts.append_many([chunk("b1", b.token, 3, [4], "d", attempt=2)]) == [APPENDED]


@pytest.mark.redis
def test_a_request_that_never_streamed_gets_no_stream_at_its_finish(store):
    running(store, "r2")
    store.finish("r2", 11, time.time(), result={"text": "x"})
    assert not store.raw.exists(keys.stream("r2"))


@pytest.mark.redis
def test_the_deadline_sweep_ends_a_stream_too(store):
    token = running(store, "r3")
    TokenStreams(store.raw).append_many([chunk("r3", token, 0, [1], "a", prompt_ids=[5])])
    store.finish_failed_many(["r3"], "deadline_exceeded: late", "TerminalError", time.time())
    assert TokenStreams(store.raw).entries("r3")[-1].end == "FAILED"
    assert store.raw.ttl(keys.stream("r3")) > 0


@pytest.mark.redis
def test_a_restarted_stream_begins_again_at_token_0(store):
    """A refused resume's first chunk resets the stream: the checkpoint starts there."""
    token = running(store, "r4")
    ts = TokenStreams(store.raw)
    ts.append_many([chunk("r4", token, 0, [1, 2], "ab", prompt_ids=[5])])
    reset = chunk("r4", token, 0, [9], "z", reset=True, prompt_ids=[5], generation=1)
    assert ts.append_many([reset]) == [APPENDED]
    assert ts.append_many([reset]) == [APPENDED]  # sent again: one restart, not two
    assert sum(e.reset for e in ts.entries("r4")) == 1
    cp = ts.checkpoint("r4")
    assert (cp.token_ids, cp.text) == ([9], "z")
    assert store.get("r4")["streamed"] == "1"


@pytest.mark.redis
def test_the_appends_survive_a_lost_script_cache(store):
    """Redis restarted (SCRIPT FLUSH stands in for its empty script cache): the next flush
    loads the script again instead of failing."""
    token = running(store, "r5")
    ts = TokenStreams(store.raw)
    ts.append_many([chunk("r5", token, 0, [1], "a", prompt_ids=[5])])
    store.raw.script_flush()
    assert ts.append_many([chunk("r5", token, 1, [2], "b")]) == [APPENDED]


# -- the checkpoint ---------------------------------------------------------------------------------
def test_a_checkpoint_names_the_offsets_where_attempts_took_over():
    es = [Entry("1-0", 0, [1, 2], "ab", [0, 2], attempt=1, prompt_ids=[9]),
          Entry("2-0", 2, [3], "c", [1], attempt=1),
          Entry("3-0", 3, [4, 5], "de", [1, 1], attempt=2),
          Entry("4-0", 5, [6], "f", [1], attempt=4)]
    cp = checkpoint_of(es)
    assert cp.token_ids == [1, 2, 3, 4, 5, 6] and cp.text == "abcdef"
    assert cp.resumed_at == [3, 5] and cp.prompt_ids == [9]
    assert checkpoint_of([]) is None
    assert checkpoint_of([Entry("9-0", end="FAILED")]) is None


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


@pytest.mark.redis
def test_a_flush_while_redis_restarts_waits_for_it_and_writes_every_token_once(
        restartable_redis, caplog):
    """Given a worker streaming a request (outage grace 30 s), when Redis stops with tokens
    already written and more arrive while it is down, then the flush does not fail: it waits
    for Redis (the store's outage policy), the tokens stay in the tap meanwhile, and once Redis
    is back every token is in the stream exactly once, in order (the script cache lost with
    the restart is loaded again)."""
    caplog.set_level(logging.WARNING)
    store, sink = worker_sink(restartable_redis, outage_grace=30)
    try:
        tap = open_tap(sink, store, "o1")
        tap.add([1, 2], "ab")
        wait_until(lambda: tap.unwritten() == 0)
        stop_redis(restartable_redis)
        tap.add([3, 4], "cd")
        wait_until(lambda: "cannot reach Redis" in caplog.text)  # the flush is retrying
        tap.add([5], "e")
        assert tap.unwritten() == 3
        restartable_redis.start()
        wait_until(lambda: tap.unwritten() == 0, 30)
        assert each_token_once(store, "o1") == [1, 2, 3, 4, 5]
        assert TokenStreams(store.raw).checkpoint("o1").text == "abcde"
        assert "could not write token streams" not in caplog.text  # waited, never failed
    finally:
        sink.stop()


@pytest.mark.redis
def test_a_flush_failing_past_the_outage_grace_is_logged_and_sent_again(restartable_redis,
                                                                         caplog):
    """Given a worker streaming a request, when Redis stays away longer than the outage grace
    (0.5 s here, 120 s by default), then the flush fails with redis_unavailable and says so in
    the log, the tokens stay pending in the tap (the worker goes on), and the next flush after
    Redis is back writes them, each once."""
    caplog.set_level(logging.WARNING)
    store, sink = worker_sink(restartable_redis, outage_grace=0.5)
    try:
        tap = open_tap(sink, store, "o2")
        tap.add([1, 2], "ab")
        wait_until(lambda: tap.unwritten() == 0)
        stop_redis(restartable_redis)
        tap.add([3, 4], "cd")
        wait_until(lambda: "could not write token streams: redis_unavailable" in caplog.text)
        tap.add([5], "e")
        assert tap.unwritten() == 3
        restartable_redis.start()
        wait_until(lambda: tap.unwritten() == 0, 30)
        assert each_token_once(store, "o2") == [1, 2, 3, 4, 5]
    finally:
        sink.stop()


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


# -- the reader's cursor ------------------------------------------------------------------------
def test_a_reader_after_n_gets_the_tokens_past_n_and_their_text():
    cur = StreamCursor(after=3)
    e1 = Entry("1-0", 0, [1, 2], "ab", [1, 1])
    e2 = Entry("2-0", 2, [3, 4, 5], "cdef", [1, 0, 3])
    assert cur.take(e1) is None
    assert cur.take(e2) == {"offset": 3, "text": "def", "token_ids": [4, 5]}
    final = cur.final({"text": "abcdefgh", "token_ids": [1, 2, 3, 4, 5, 6, 7]})
    assert final["offset"] == 5 and final["text"] == "gh" and final["token_ids"] == [6, 7]
    assert final["final"] is True and "restart" not in final


def test_a_reader_is_told_when_the_stream_restarts():
    cur = StreamCursor(after=0)
    assert cur.take(Entry("1-0", 0, [1, 2], "ab", [1, 1]))["offset"] == 0
    again = cur.take(Entry("2-0", 0, [7], "z", [1], reset=True))
    assert again == {"offset": 0, "text": "z", "token_ids": [7], "restart": True}


def test_a_result_that_does_not_continue_the_stream_comes_whole_as_a_restart():
    """The restart never reached the stream (a worker with streams off ran the last attempt):
    the reader is given the whole result, marked, instead of a tail cut at the wrong place."""
    cur = StreamCursor(after=0)
    cur.take(Entry("1-0", 0, [1, 2], "ab", [1, 1]))
    final = cur.final({"text": "xyz", "token_ids": [7, 8, 9]})
    assert final["restart"] and final["offset"] == 0 and final["text"] == "xyz"
    assert final["token_ids"] == [7, 8, 9]


def test_a_reader_past_the_end_gets_an_empty_final_chunk():
    cur = StreamCursor(after=10)
    final = cur.final({"text": "abc", "token_ids": [1, 2, 3]})
    assert final["token_ids"] == [] and final["text"] == ""


@pytest.mark.redis
def test_stream_reads_to_the_result_from_any_process_that_knows_the_id(redis_server):
    """A reader with only the request id (app.AsyncResult(id)) gets the streamed chunks, then
    the tail from the result, whose text the chunks add up to exactly."""
    from app import app

    store, s1 = RequestStore(app.vigil_store.raw, 3600), f"s1-{uuid.uuid4()}"
    token = running(store, s1)
    ts = TokenStreams(app.vigil_store.raw)
    ts.append_many([chunk(s1, token, 0, [1, 2], "ab", prompt_ids=[5])])
    got = []

    def read():
        got.extend(app.AsyncResult(s1).stream(timeout=30))

    reader = threading.Thread(target=read)
    reader.start()
    ts.append_many([chunk(s1, token, 2, [3], "c")])
    store.finish(s1, 11, time.time(), result={"text": "abcde", "token_ids": [1, 2, 3, 4, 5]})
    reader.join(30)
    assert [c["offset"] for c in got] == [0, 2, 3]
    assert "".join(c["text"] for c in got) == "abcde"
    assert got[-1]["result"]["token_ids"] == [1, 2, 3, 4, 5]
    app.vigil_store.raw.delete(keys.request(s1), keys.stream(s1))


@pytest.mark.redis
def test_stream_of_a_failed_request_raises_its_error_after_its_chunks(redis_server):
    from app import app

    store, s2 = RequestStore(app.vigil_store.raw, 3600), f"s2-{uuid.uuid4()}"
    token = running(store, s2)
    TokenStreams(app.vigil_store.raw).append_many([chunk(s2, token, 0, [1], "a",
                                                     prompt_ids=[5])])
    store.finish(s2, 11, time.time(), error_kind="TerminalError",
                 error="deadline_exceeded: too late")
    chunks = []
    with pytest.raises(TerminalError, match="deadline_exceeded"):
        for c in app.AsyncResult(s2).stream(timeout=30):
            chunks.append(c)
    assert chunks == [{"offset": 0, "text": "a", "token_ids": [1]}]
    app.vigil_store.raw.delete(keys.request(s2), keys.stream(s2))


@pytest.mark.redis
def test_stream_gives_up_at_its_timeout_even_while_chunks_arrive(redis_server):
    from celery.exceptions import TimeoutError as CeleryTimeoutError

    from app import app
    from app.requests.async_result import STREAM_BLOCK_S

    store, s3 = RequestStore(app.vigil_store.raw, 3600), f"s3-{uuid.uuid4()}"
    token = running(store, s3)
    ts = TokenStreams(app.vigil_store.raw)
    stop = threading.Event()

    def write():
        n = 0
        while not stop.is_set():
            ts.append_many([chunk(s3, token, n, [1], "a", prompt_ids=[5] if n == 0 else None)])
            n += 1
            stop.wait(0.05)

    writer = threading.Thread(target=write)
    writer.start()
    started = time.monotonic()
    try:
        with pytest.raises(CeleryTimeoutError):
            for _ in app.AsyncResult(s3).stream(timeout=1.0):
                pass
    finally:
        stop.set()
        writer.join(5)
    # At its timeout: a read blocks at most one STREAM_BLOCK_S (0.5 s) past it; a second of
    # margin for a slow machine.
    assert time.monotonic() - started <= 1.0 + STREAM_BLOCK_S + 1.0
    app.vigil_store.raw.delete(keys.request(s3), keys.stream(s3))


@pytest.mark.redis
def test_stream_of_an_unknown_id_is_a_typed_error_not_a_hang(redis_server):
    """An id Redis has no record of raises request_lost after one stream block (the reader
    looks at the record whenever a block of STREAM_BLOCK_S, 0.5 s, brings nothing), as
    docs/failure-modes.md promises: within the block and a second's margin for a slow
    machine, not at the reader's timeout."""
    from app import app
    from app.requests.async_result import STREAM_BLOCK_S

    started = time.monotonic()
    with pytest.raises(TerminalError, match="request_lost"):
        list(app.AsyncResult(f"no-such-request-{uuid.uuid4()}").stream(timeout=60))
    took = time.monotonic() - started
    print(f"\nrequest_lost {took:.2f} s after the read began")
    assert took <= STREAM_BLOCK_S + 1.0


def test_the_engine_calls_only_the_token_tap_protocol_and_the_stream_tap_has_it_all():
    """The engine's view of the stream writer is workers/engine/token_tap.py's TokenTap: every
    member workers/engine/ reads or calls on a tap (`tap.x`, `run.tap.x`, `t.tap.x`, by
    attribute or `getattr(tap, "x")`) is one of the protocol's, and the StreamTap the worker
    hands the engine has each of them (a member renamed on either side turns this red)."""
    import ast
    from pathlib import Path

    from workers.engine.token_tap import TokenTap

    members = {n for n in vars(TokenTap) if not n.startswith("_")} | set(
        TokenTap.__annotations__)
    def is_tap(e: ast.expr) -> bool:  # `tap`, or `x.tap`
        return getattr(e, "id", None) == "tap" or getattr(e, "attr", None) == "tap"

    used: set[str] = set()
    for path in Path("workers/engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and is_tap(node.value):
                used.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" \
                    and is_tap(node.args[0]):
                used.add(node.args[1].value)
    assert used and used <= members, f"not in TokenTap: {sorted(used - members)}"
    tap = StreamTap(None, "r", "claim", 1, "tiny-llama")
    assert isinstance(tap, TokenTap)
    assert all(hasattr(tap, m) for m in members)
