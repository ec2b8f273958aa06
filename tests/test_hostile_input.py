"""Redis tier: hostile kwargs sent around the producer (issue 8 part 4). Whatever a message says,
the worker-side service ends the request in a success or a typed error, and keeps serving the
others. The engine is the instant one (no model): these tests are about validation and the
request's state machine; tests/test_worker_e2e.py sends hostile messages to a real worker."""
from __future__ import annotations

import itertools
import json
import time

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from app.errors import RequestError, TerminalError, TransientError
from app.requests.schemas import newer_version, parse_request
from app.requests.record_fields import provisional_fields
from app.state import keys
from workers.consumer import malformed
from workers.runtime import WorkerRuntime
from workers.service import serve
from tests.unit_helpers import RecordingPorts

pytestmark = pytest.mark.redis
GOOD = {"model": "tiny-llama", "prompt": "still serving", "max_tokens": 2}

# Every code point, lone surrogates included (they survive kombu's JSON: ensure_ascii escapes
# them and json.loads gives them back).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63),
                 st.floats(), ANY_TEXT)
NESTED = st.recursive(LEAF, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(ANY_TEXT, kids, max_size=4), max_leaves=12)


def _deep(n: int) -> list:
    v: list = []
    for _ in range(n):
        v = [v]
    return v


# Sizes no strategy should draw example by example: built once, picked whole.
HUGE = st.sampled_from([
    "x" * 300_000, "\ud800" * 50_000, "é" * 200_000, list(range(200_000)), [0] * 100_000,
    ["stop"] * 10_000, _deep(5_000), {str(i): i for i in range(20_000)}, 10**4000,
])
HOSTILE = st.one_of(NESTED, HUGE)
FIELDS = {
    "model": st.one_of(st.just("tiny-llama"), st.just("ghost"), HOSTILE),
    "prompt": st.one_of(ANY_TEXT.filter(bool), HOSTILE),
    "prompt_token_ids": st.one_of(st.lists(st.integers(), min_size=1, max_size=8), HOSTILE),
    "max_tokens": st.one_of(st.integers(), HOSTILE),
    "temperature": st.one_of(st.floats(), HOSTILE),
    "top_p": st.one_of(st.floats(), HOSTILE),
    "seed": st.one_of(st.integers(), HOSTILE),
    "stop": st.one_of(st.lists(ANY_TEXT, max_size=20), ANY_TEXT, HOSTILE),
    "ignore_eos": st.one_of(st.booleans(), HOSTILE),
    "lora": st.one_of(ANY_TEXT, HOSTILE),
    "job": st.one_of(st.just("fuzz"), ANY_TEXT, HOSTILE),
    "deadline_s": st.one_of(st.floats(), HOSTILE),
    "schema_version": st.one_of(st.just(1), st.just(2), st.integers(), HOSTILE),
    # Version 2 (issue 31): n = 10^9, NaN penalties, a million logit_bias entries, huge and
    # deep schemas, among the rest.
    "n": st.one_of(st.integers(min_value=-2, max_value=40), st.just(10**9), HOSTILE),
    "logprobs": st.one_of(st.integers(min_value=-2, max_value=30), HOSTILE),
    "prompt_logprobs": st.one_of(st.integers(min_value=-2, max_value=30), HOSTILE),
    "presence_penalty": st.one_of(st.floats(), HOSTILE),
    "frequency_penalty": st.one_of(st.floats(), HOSTILE),
    "repetition_penalty": st.one_of(st.floats(), HOSTILE),
    "top_k": st.one_of(st.integers(), HOSTILE),
    "min_p": st.one_of(st.floats(), HOSTILE),
    "min_tokens": st.one_of(st.integers(), HOSTILE),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(ANY_TEXT, st.integers()), st.floats(),
                                            max_size=4),
                            st.just({str(i): 1.0 for i in range(10**6)}), HOSTILE),
    "stop_token_ids": st.one_of(st.lists(st.integers(), max_size=4), HOSTILE),
    "allowed_token_ids": st.one_of(st.lists(st.integers(), max_size=4), HOSTILE),
    "logprob_token_ids": st.one_of(st.lists(st.integers(), max_size=4), HOSTILE),
    "bad_words": st.one_of(st.lists(ANY_TEXT, max_size=4), HOSTILE),
    "structured": st.one_of(
        st.fixed_dictionaries({}, optional={k: st.one_of(ANY_TEXT, NESTED, HOSTILE) for k in (
            "json", "json_object", "regex", "choice", "grammar")}),
        st.just({"json": {"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(5_000)}}}),
        st.just({"json": _deep(5_000)}), HOSTILE),
    "detokenize": st.one_of(st.booleans(), HOSTILE),
}
KWARGS = st.one_of(
    st.fixed_dictionaries({"model": st.just("tiny-llama"), "prompt": ANY_TEXT.filter(bool)},
                          optional={k: v for k, v in FIELDS.items()
                                    if k not in ("model", "prompt")}),
    st.fixed_dictionaries({}, optional=FIELDS).flatmap(
        lambda d: st.dictionaries(ANY_TEXT, HOSTILE, max_size=3).map(lambda x: {**x, **d})),
    # A good request with one field replaced: reaches past the schema (adapters, engine).
    st.sampled_from(sorted(FIELDS)).flatmap(lambda k: FIELDS[k].map(lambda v: {**GOOD, k: v})),
    HOSTILE,  # not even a mapping
)


@pytest.fixture()
def instant_runtime(settings):
    """A worker runtime on database 1 whose engine answers at once (no model)."""
    rt = WorkerRuntime(settings, "w-fuzz", engine="instant", guard=False,
                       ports=RecordingPorts())
    rt.host.start()
    yield rt
    rt.host.shutdown(1)


def test_hostile_kwargs_always_end_in_a_result_or_a_typed_error(instant_runtime):
    """Given a worker serving the tiny-llama pool, when hypothesis-made kwargs (wrong types,
    huge sizes, any unicode including lone surrogates, deep nesting, unknown fields and schema
    versions) arrive around the producer, then each request ends once, in a result or a typed
    VigilError whose record is terminal, and a normal request after it is still served."""
    rt = instant_runtime
    ids = itertools.count()

    @hsettings(max_examples=300, deadline=None, database=None,
               suppress_health_check=list(HealthCheck))
    @given(KWARGS)
    def check(kwargs):
        rid = f"fuzz-{next(ids)}"
        try:
            out = serve(rt, rid, 0, kwargs)
        except (RequestError, TerminalError) as e:
            assert e.code != "unknown" and str(e).startswith(e.code + ": ")
        except TransientError as e:  # a newer schema version: handed back, never failed here
            assert e.code == "schema_too_new" and newer_version(kwargs) is not None
            assert rt.store.get(rid)["status"] == "PENDING"
        else:
            assert out["request_id"] == rid and isinstance(out["text"], str)
        if newer_version(kwargs) is None or not isinstance(kwargs, dict) or \
                kwargs.get("model") != "tiny-llama":
            assert rt.store.get(rid)["status"] in keys.TERMINAL
        good = serve(rt, rid + "-good", 0, GOOD)  # the worker still serves the others
        assert good["completion_tokens"] == 2

    check()
    assert rt.host.accepting


@pytest.mark.parametrize("version", [0, -1, "1", "3", True, None, 1.0, [1]])
def test_a_schema_version_that_is_no_version_fails_the_request_loudly_never_guessed(
        instant_runtime, version):
    """Given a message whose schema_version is no version at all (not an int, or older than the
    first), when it is served, then that request fails unsupported_version (a RequestError
    naming the version) without running, and the record says so."""
    rt = instant_runtime
    with pytest.raises(RequestError, match="^unsupported_version: schema_version ") as ei:
        serve(rt, "v1", 0, {**GOOD, "schema_version": version})
    assert ei.value.code == "unsupported_version"
    rec = rt.store.get("v1")
    assert rec["status"] == "FAILED" and rec["error"].startswith("unsupported_version: ")


def test_version_1_and_no_version_are_both_served(instant_runtime):
    assert serve(instant_runtime, "a", 0, {**GOOD, "schema_version": 1})["completion_tokens"] == 2
    assert serve(instant_runtime, "b", 0, GOOD)["completion_tokens"] == 2
    assert serve(instant_runtime, "c", 0, {**GOOD, "schema_version": 2,
                                           "n": 2})["completion_tokens"] == 2


NEWER = {**GOOD, "schema_version": 4, "field_of_version_4": {"x": 1}, "job": "rollout"}


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "sent-around"])
def test_a_message_of_a_newer_version_is_handed_back_never_failed(instant_runtime, recorded):
    """Given a message of schema_version 4 (a newer producer, during a rolling upgrade) with a
    field this worker has never heard of, recorded by its producer or sent around it, when this
    worker serves it, then the request is not failed (no invalid_request, no
    unsupported_version): the claim is given back without using an attempt, the record is
    PENDING for the next dispatch with the reason, and the task is retried (schema_too_new) for
    a worker that reads version 4; its deadline still bounds it."""
    rt = instant_runtime
    rid = f"newer-{recorded}"
    if recorded:  # as a version-4 producer would: the record, then the message
        assert rt.store.create(rid, provisional_fields(NEWER, time.time(), 600))
    for dispatch in (0, 1):  # the same again on its retry: never failed, never counted
        with pytest.raises(TransientError, match="^schema_too_new: schema_version 4 ") as ei:
            serve(rt, rid, dispatch, NEWER)
        assert not ei.value.decision.uses_attempt  # app/retry_policy.py: no attempt used
        rec = rt.store.get(rid)
        assert (rec["status"], rec["attempts"], rec["dispatch"]) == ("PENDING", "0",
                                                                     str(dispatch + 1))
        assert rec["last_error"].startswith("schema_too_new: ") and rec["job"] == "rollout"
        assert json.loads(rec["request"]) == NEWER  # kept as sent, for a newer worker
    assert serve(rt, rid + "-good", 0, GOOD)["completion_tokens"] == 2


def test_a_newer_message_without_a_readable_job_is_refused_not_lost(instant_runtime):
    """A newer message sent around the producer whose job cannot be read cannot be recorded for
    anyone: it fails unsupported_version, loudly (it is in no record, so nothing is lost)."""
    with pytest.raises(RequestError, match="^unsupported_version: schema_version 4 "):
        serve(instant_runtime, "newer-nojob", 0, {**NEWER, "job": {"bad": 1}})
    assert instant_runtime.store.get("newer-nojob")["status"] == "FAILED"


def test_an_oversized_prompt_sent_around_the_producer_is_refused_in_the_worker(
        instant_runtime):
    rt = instant_runtime
    big = "x" * (rt.settings.max_prompt_bytes + 1)
    with pytest.raises(RequestError,
                       match=r"^invalid_request: prompt is \d+ bytes.*VIGIL_MAX_PROMPT_BYTES"):
        serve(rt, "big", 0, {**GOOD, "prompt": big})


def test_the_schema_refuses_an_unknown_version_before_anything_else():
    with pytest.raises(RequestError, match="^unsupported_version: schema_version 4 "):
        parse_request({"model": "tiny-llama", "prompt": "x", "schema_version": 4, "bogus": 1})


class _Msg:
    """The parts of a kombu message `malformed` reads."""

    def __init__(self, headers, payload, content_type="application/json"):
        self.headers, self.payload, self.content_type = headers, payload, content_type


H = {"id": "m1", "task": "vigil.generate", "retries": 0, "timelimit": [None, None]}


@pytest.mark.parametrize("headers, payload, why", [
    ([1, 2], None, "headers are not a mapping"),
    ({"task": "vigil.generate"}, None, "header 'id'"),
    ({**H, "id": {"a": 1}}, None, "header 'id'"),
    ({**H, "task": ""}, None, "header 'task'"),
    ({**H, "retries": "abc"}, None, "header 'retries'"),
    ({**H, "retries": True}, None, "header 'retries'"),
    ({**H, "timelimit": 5}, None, "header 'timelimit'"),
    (H, "hello", "the body is not"),
    (H, [[], [1, 2], {}], "the body is not"),
    (H, [[], {}, {}, 4], "the body is not"),
    (H, [[], {}, {"callbacks": [{"task": "vigil.reconcile"}]}], "callbacks"),
    (H, [["tiny-llama", "hi"], {}, {}], "keyword arguments only"),
])
def test_the_consumer_guard_names_what_is_wrong_with_a_malformed_message(headers, payload, why):
    assert why in malformed(_Msg(headers, payload))


@pytest.mark.parametrize("headers, payload, content_type", [
    (H, [[], {"model": "tiny-llama"}, None], "application/json"),
    ({**H, "task": "vigil.reconcile"}, [[1], {}, {"callbacks": None}], "application/json"),
    (H, b"\x80\x04pickle", "application/x-python-serialize"),  # Celery refuses it itself
])
def test_the_consumer_guard_lets_through_what_celery_handles_itself(headers, payload,
                                                                    content_type):
    assert malformed(_Msg(headers, payload, content_type)) is None
