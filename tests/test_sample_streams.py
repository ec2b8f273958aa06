"""Redis tier and unit tests: token streams of requests with n samples and logprobs (issue 31).

A stream of several samples carries each sample's tokens as parts of one chunk, fenced on the
count of every sample's tokens; its checkpoint gives each sample its own tokens, text,
logprobs and takeover offsets; a reader gets one chunk per sample with its index, and the
result's tails last. The engine's side (vLLM's request states, read per sample) is checked
here with stand-ins shaped as vLLM 0.32's, and end to end in
tests/test_generation_contract_e2e.py."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from app import metrics
from app.requests.stream_cursor import StreamCursor
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.state.conn import connect
from app.state.store import RequestStore
from app.state.streams import APPENDED, Checkpoint, TokenStreams
from workers.engine.resume import Seam, inexact, resumable, unsound
from workers.engine.stream_watch import StreamWatch, WatchedRun
from workers.stream_sink import StreamSink
from workers.streaming import StreamTap

KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 64, "n": 3, "temperature": 1.0}


def lp(token_id: int, x: float) -> dict:
    return {"token_id": token_id, "token": str(token_id), "logprob": x, "rank": 1, "top": []}


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def running(store, rid: str, instance: int = 11, dispatch: int = 0):
    if dispatch == 0:
        assert store.create(rid, record_fields(parse_request(KW), time.time(), 3600))
    b = store.begin(rid, dispatch, "w1", instance, time.time(), 3)
    assert b.action == "run"
    return b


@pytest.mark.redis
def test_a_stream_of_three_samples_checkpoints_each_sample_with_its_logprobs(store):
    """Given a request of 3 samples, when its tap streams tokens of samples 0 and 2, then of
    1 and 2, the stream holds two chunks fenced on the total (3 then 6 tokens), and the
    checkpoint gives each sample its own tokens, text and logprob entries."""
    ts = TokenStreams(store.raw)
    sink = StreamSink(ts, flush_ms=60000, chunk_tokens=64)
    b = running(store, "s1")
    tap = sink.open("s1", b.token, 1, "tiny-llama", None, samples=3)
    tap.set_prompt([1, 2])
    tap.add([10, 11], "ab", index=0, logprobs=[lp(10, -1.0), lp(11, -2.0)])
    tap.add([30], "x", index=2, logprobs=[lp(30, -0.5)])
    assert sink.flush(force=True) == 1
    tap.add([20], "q", index=1, logprobs=[lp(20, -0.1)])
    tap.add([31, 32], "yz", index=2, logprobs=[lp(31, -0.2), lp(32, -0.3)])
    assert sink.flush(force=True) == 1
    assert store.get("s1")["streamed"] == "6"
    cp = ts.checkpoint("s1")
    assert cp.prompt_ids == [1, 2] and cp.total == 6
    assert [(c.token_ids, c.text) for c in cp.samples] == [([10, 11], "ab"), ([20], "q"),
                                                           ([30, 31, 32], "xyz")]
    assert [e["logprob"] for e in cp.sample(2).logprobs] == [-0.5, -0.2, -0.3]
    assert (cp.token_ids, cp.logprobs) == (cp.sample(0).token_ids, cp.sample(0).logprobs)


@pytest.mark.redis
def test_each_sample_takes_over_from_its_own_tokens_on_the_next_attempt(store):
    """Given attempt 1 streamed samples 0 and 1 (not 2) and was requeued, when attempt 2's tap
    opens on that checkpoint and takes over, then each sample with tokens records its own
    offset, the next chunk continues the total, and the checkpoint lists the takeovers."""
    ts = TokenStreams(store.raw)
    sink = StreamSink(ts, flush_ms=60000, chunk_tokens=64)
    b = running(store, "s2")
    tap = sink.open("s2", b.token, 1, "tiny-llama", None, samples=3)
    tap.set_prompt([1])
    tap.add([10, 11, 12], "abc", index=0)
    tap.add([20], "d", index=1)
    sink.flush(force=True)
    assert store.requeue("s2", 11, 1)
    b2 = running(store, "s2", instance=22, dispatch=1)
    assert b2.streamed == 4
    tap2 = sink.open("s2", b2.token, 2, "tiny-llama", ts.checkpoint("s2"), samples=3)
    tap2.took_over()
    assert [tap2.resumed_at_of(i) for i in range(3)] == [[3], [1], []]
    tap2.add([21], "e", index=1)
    tap2.add([40], "f", index=2)
    c = tap2.take_chunk(0, 0.0, 1, force=True)
    assert c.start == 4 and [(p.index, p.start) for p in c.parts] == [(1, 1), (2, 0)]
    tap2.chunk_written(c, ts.append_many([c])[0])
    cp = ts.checkpoint("s2")
    assert [c.token_ids for c in cp.samples] == [[10, 11, 12], [20, 21], [40]]
    assert [c.resumed_at for c in cp.samples] == [[3], [1], []]


def discarded() -> float:
    """The worker's vigil_tokens_discarded_total for tiny-llama (app/metrics.py)."""
    return metrics.REGISTRY.get_sample_value("vigil_tokens_discarded_total",
                                             {"pool": "tiny-llama"}) or 0.0


@pytest.mark.redis
def test_a_refused_resume_of_several_samples_restarts_every_sample(store):
    """Given a 2-sample request whose stream holds 3 tokens, when its resume is refused, then
    every sample restarts at token 0 and the 3 tokens thrown away are counted in
    vigil_tokens_discarded_total."""
    ts = TokenStreams(store.raw)
    sink = StreamSink(ts, flush_ms=60000, chunk_tokens=64)
    b = running(store, "s3")
    tap = sink.open("s3", b.token, 1, "tiny-llama", None, samples=2)
    tap.set_prompt([1])
    tap.add([10, 11], "a", index=0)
    tap.add([20], "b", index=1)
    sink.flush(force=True)
    before = discarded()
    tap.refuse_resume("test")
    assert discarded() == before + 3
    assert tap.resume_point() is None
    tap.set_prompt([1])
    tap.add([50], "z", index=1)
    c = tap.take_chunk(0, 0.0, 1, force=True)
    assert c.reset and c.start == 0 and [p.index for p in c.parts] == [1]
    assert ts.append_many([c]) == [APPENDED]
    cp = ts.checkpoint("s3")
    assert [s.token_ids for s in cp.samples] == [[], [50]]


def test_a_reader_gets_each_samples_chunk_with_its_index_and_the_tails_last():
    """Given chunks of two samples (with logprobs) and a result with both choices, a reader
    from 0 gets each sample's tokens in stream order, each with its index and offset in its
    sample, then each sample's tail from the result, the last one final; a reader after 3
    tokens (every sample's counted) skips exactly them."""
    from app.state.streams import Entry, Part

    e1 = Entry("1-0", 0, parts=[Part(0, 0, [10, 11], "ab", [1, 1], [lp(10, -1), lp(11, -2)]),
                                Part(1, 0, [20], "c", [1], [lp(20, -3)])])
    e2 = Entry("2-0", 3, parts=[Part(1, 1, [21, 22], "de", [1, 1], [lp(21, -4), lp(22, -5)])])
    result = {"choices": [
        {"index": 0, "text": "abX", "token_ids": [10, 11, 12],
         "logprobs": [lp(10, -1), lp(11, -2), lp(12, -6)]},
        {"index": 1, "text": "cde", "token_ids": [20, 21, 22],
         "logprobs": [lp(20, -3), lp(21, -4), lp(22, -5)]}]}
    cur = StreamCursor(0)
    got = cur.take_all(e1) + cur.take_all(e2) + cur.finals(result)
    assert [(c["index"], c["offset"], c["token_ids"], c["text"]) for c in got] == [
        (0, 0, [10, 11], "ab"), (1, 0, [20], "c"), (1, 1, [21, 22], "de"),
        (0, 2, [12], "X"), (1, 3, [], "")]
    assert [e["logprob"] for e in got[2]["logprobs"]] == [-4, -5] and got[3]["logprobs"][0][
        "logprob"] == -6
    assert got[-1]["final"] and got[-1]["result"] is result and "final" not in got[3]
    later = StreamCursor(3)
    assert [(c["index"], c["offset"], c["token_ids"]) for c in later.take_all(e1)
            + later.take_all(e2)] == [(1, 1, [21, 22])]


def test_a_result_whose_sample_does_not_continue_the_stream_comes_whole():
    from app.state.streams import Entry, Part

    cur = StreamCursor(0)
    cur.take_all(Entry("1-0", 0, parts=[Part(1, 0, [20], "c", [1])]))
    result = {"text": "a", "token_ids": [1], "choices": [
        {"index": 0, "text": "a", "token_ids": [1]}, {"index": 1, "text": "q", "token_ids": [9]}]}
    (final,) = cur.finals(result)
    assert final["restart"] and final["final"] and final["result"] is result


def test_the_seam_keeps_the_stop_string_when_the_request_asks_and_holds_nothing_back():
    table = {1: "a", 2: "b", 3: "c", 4: "d"}

    def decoder(prompt):
        return lambda t: table[t]

    seam = Seam(Checkpoint([0], [1], "a", "", []), ["bc"], decoder, include_stop=True)
    assert seam.feed([2]) == ("b", None)  # nothing held back: the stop string stays anyway
    released, cut = seam.feed([3, 4])
    assert cut.tokens == 2 and cut.text == "abc"


@pytest.mark.parametrize("fields", [
    {"structured": {"choice": ["a", "b"]}}, {"presence_penalty": 0.5}, {"frequency_penalty": -1},
    {"bad_words": ["x"]},
    {"repetition_penalty": 1.3, "logprobs": 5, "prompt_logprobs": 2, "min_tokens": 3,
     "logit_bias": {"5": 2}, "n": 2},
])
def test_every_request_kind_may_be_continued(fields):
    """Structured outputs (their grammar advanced over the prefix in EngineCore), penalties
    and bad words (counted over the whole generation there), and every other field continue
    (issue 38); a structured request is refused only by an engine whose EngineCore does not
    advance grammars (its model runs in processes of its own)."""
    req = parse_request({**KW, **fields})
    assert unsound(req) == ""
    assert ("structured outputs" in unsound(req, grammar_resumes=False)) == \
        ("structured" in fields)


def test_only_seeded_sampling_is_not_resumable():
    """The predicate victim selection asks (issue 38): a cut and a resume leave greedy
    requests of every kind as they would have been; a seeded sampled one would depend on
    where it was cut (its continuation is seeded again); an unseeded one has no reproducible
    twin."""
    assert resumable(parse_request({**KW, "n": 1, "temperature": 0.0, "seed": 3,
                                     "presence_penalty": 1.0, "structured": {"regex": "a+"}}))
    assert resumable(parse_request({**KW, "temperature": 1.0}))
    assert resumable(parse_request({**KW, "temperature": 1.0, "seed": 3, "top_k": 1}))
    seeded = parse_request({**KW, "temperature": 0.8, "seed": 3})
    assert not resumable(seeded) and "seeded sampling" in inexact(seeded)


def _state(index: int, ids: list[int], text: str, lps: list[dict] | None):
    return SimpleNamespace(
        request_index=index, prompt_token_ids=[1, 2],
        detokenizer=SimpleNamespace(output_token_ids=ids, output_text=text,
                                    stop_buffer_length=0),
        logprobs_processor=SimpleNamespace(logprobs=lps, prompt_logprobs=None))


def test_the_watch_reads_every_sample_of_a_request_from_its_own_state():
    """vLLM 0.32 runs the samples of a request as child requests, each with its own state
    under the request's id (output_processor.external_req_ids): the watch reads each into its
    own sequence of the tap, with the logprobs the run converts."""
    states = {"0_x": _state(0, [10, 11], "ab", [{10: "raw"}, {11: "raw"}]),
              "1_x": _state(1, [20], "c", [{20: "raw"}])}
    op = SimpleNamespace(external_req_ids={"r": ["0_x", "1_x"]}, request_states=states)
    watch = StreamWatch(SimpleNamespace(output_processor=op), 0.1)
    tap = StreamTap(None, "r", "claim", 1, "tiny-llama", samples=2)
    seen = []

    def convert(index, ids, raw, before):
        seen.append((index, ids, before))
        return [lp(t, -1.0) for t in ids]

    watch._runs["r"] = WatchedRun(tap, samples=2, convert=convert)
    watch.tick()
    states["0_x"].detokenizer.output_token_ids = [10, 11, 12]
    states["0_x"].detokenizer.output_text = "abd"
    states["0_x"].logprobs_processor.logprobs.append({12: "raw"})
    watch.tick()
    cp = tap.resume_point()
    assert [(s.token_ids, s.text) for s in cp.samples] == [([10, 11, 12], "abd"), ([20], "c")]
    assert seen == [(0, [10, 11], []), (1, [20], []), (0, [12], [10, 11])]
    assert [e["token_id"] for e in cp.sample(0).logprobs] == [10, 11, 12]


def test_a_resumed_run_without_detokenize_streams_token_ids_only():
    """A resumed run's text is the seam's (vLLM is asked for token ids only): for a request
    with detokenize=False none of it is streamed (its chunks carry "" as its result does),
    while a detokenized request's seam text is; both stream every token id."""
    def decoder(prompt):
        return lambda t: chr(ord("a") + t)

    for detokenize, text in ((True, "cde"), (False, "")):
        cp = Checkpoint([0], [1], "" if not detokenize else "b", "", [])
        tap = StreamTap(None, "r", "claim", 2, "tiny-llama", prior=cp)
        run = WatchedRun(tap, Seam(cp, None, decoder), index=0, detokenize=detokenize)
        run.feed([2, 3, 4], "ignored")
        assert tap.token_ids == [1, 2, 3, 4] and tap.text == ("b" if detokenize else "") + text
