"""Redis tier and unit tests: token streams (app/state/streams.py, workers/streaming.py) and
their readers (VigilAsyncResult.stream). The seam of a resume: tests/test_resume_seam.py.

The engine's side is tested end to end in tests/test_token_stream_e2e.py (a real worker and
engine); here the stream's rules are checked on a real redis-server with scripted chunks. The
worker's flusher: tests/test_stream_flusher.py."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from app.errors import TerminalError
from app.requests.stream_cursor import StreamCursor
from app.state import keys
from app.state.conn import connect
from app.state.store import RequestStore
from app.state.streams import APPENDED, FENCED, OFF_SEQUENCE, Entry, TokenStreams, checkpoint_of
from tests.stream_helpers import chunk, running
from workers.streaming import StreamTap


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


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
