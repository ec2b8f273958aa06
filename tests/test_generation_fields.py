"""Unit tier: the version 2 request fields (issue 31): their validation at submit, the version a
request is stamped with, the bounds that need the model or the settings, the structured-output
checks before publish, and the one mapping onto vLLM's SamplingParams."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from app.errors import RequestError
from app.requests.limits import logprob_entries
from app.requests.models import get_registry
from app.requests.schemas import needed_version, parse_request
from app.requests.structured import backend_of, nesting
from app.requests.submit import admit, wire_kwargs
from app.settings import load_settings

OK = {"model": "tiny-llama", "prompt": "hello"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
          "required": ["name"]}


def refusal(kwargs, **overrides) -> str:
    with pytest.raises(RequestError) as ei:
        admit(kwargs, load_settings(**overrides), get_registry())
    return str(ei.value)


@pytest.mark.parametrize("bad, says", [
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0}, "n > 1 needs temperature > 0"),
    ({"n": 2.0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"logprob_token_ids": []}, "logprob_token_ids"),
    ({"logprob_token_ids": list(range(129))}, "logprob_token_ids"),
    ({"logprob_token_ids": [1, 2], "logprobs": 5}, "logprobs must be left out or equal"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_tokens": 17}, "min_tokens (17) must not exceed max_tokens (16)"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {"abc": 1}}, "logit_bias: Value error, keys must be token ids"),
    ({"logit_bias": {"007": 1}}, "keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "biases must be finite numbers from -100 to 100"),
    ({"logit_bias": {"5": math.nan}}, "logit_bias"),
    ({"bad_words": [" "]}, "bad words must be non-blank"),
    ({"bad_words": ["x"] * 129}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"detokenize": False, "stop": ["."]}, "stop strings need detokenize"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"structured": {}}, "give exactly one of json, json_object, regex, choice, grammar"),
    ({"structured": {"regex": "a", "choice": ["a"]}}, "give exactly one of"),
    ({"structured": {"json_object": False}}, "structured.json_object"),
    ({"structured": {"choice": []}}, "structured.choice"),
    ({"structured": {"choice": ["a", ""]}}, "choices must be non-empty strings"),
    ({"structured": {"grammar": "  "}}, "must not be blank"),
    ({"structured": {"regex": "a\x00b"}}, "must not hold a NUL character"),
    ({"structured": {"json": {"type": "strnig"}}}, "not a valid JSON schema at type"),
    ({"structured": {"json": "{}"}}, "structured.json"),
    ({"structured": {"yaml": "x"}}, "structured.yaml: unknown field"),
    ({"schema_version": 1, "logprobs": 1}, "version 2 fields (logprobs) need schema_version 2"),
])
def test_malformed_version_2_fields_are_refused_with_the_field_named(bad, says):
    msg = refusal({**OK, **bad})
    assert msg.startswith("invalid_request: ") and says in msg, msg


@pytest.mark.parametrize("bad, code, says", [
    ({"n": 17, "temperature": 1.0}, "invalid_request", "n=17 is above 16"),
    ({"n": 10**9}, "invalid_request", "VIGIL_MAX_N"),
    ({"logprob_token_ids": [2048]}, "token_out_of_vocab", "logprob_token_ids: token id 2048"),
    ({"stop_token_ids": [5, 4096]}, "token_out_of_vocab", "stop_token_ids: token id 4096"),
    ({"allowed_token_ids": [1, 99999]}, "token_out_of_vocab", "allowed_token_ids"),
    ({"logit_bias": {"2048": 1.0}}, "token_out_of_vocab", "logit_bias: token id 2048"),
    ({"prompt": "x" * 100_000, "prompt_logprobs": 20}, "invalid_request",
     "VIGIL_MAX_LOGPROB_ENTRIES"),
])
def test_bounds_that_need_the_model_or_the_settings_are_checked_at_submit(bad, code, says):
    msg = refusal({**OK, **bad})
    assert msg.startswith(code + ": ") and says in msg, msg


def test_the_result_size_counts_samples_tokens_alternatives_and_the_prompt():
    req = parse_request({**OK, "n": 4, "max_tokens": 10, "logprobs": 5,
                         "prompt_logprobs": 2, "prompt": "abc"})
    assert logprob_entries(req) == 4 * 10 * 6 + (3 + 1) * 3
    named = parse_request({**OK, "max_tokens": 10, "logprob_token_ids": [1, 2, 3]})
    assert logprob_entries(named) == 10 * 4
    assert logprob_entries(parse_request(OK)) == 0
    assert refusal({**OK, "max_tokens": 10, "logprobs": 4}, max_logprob_entries=49).endswith(
        "the limit is 49 (VIGIL_MAX_LOGPROB_ENTRIES)")


def test_a_request_is_stamped_with_the_lowest_version_that_holds_it():
    """A request without version 2 fields is a version 1 message (a worker from before version
    2 serves it); one with any of them is version 2; fields at their defaults do not count."""
    plain = parse_request({**OK, "n": 1, "top_k": 0, "detokenize": True})
    assert plain.schema_version == 1 and wire_kwargs(plain)["schema_version"] == 1
    assert "n" not in wire_kwargs(plain)
    rich = parse_request({**OK, "top_k": 5})
    assert rich.schema_version == 2 == needed_version(rich)
    assert parse_request({**OK, "schema_version": 2}).schema_version == 2  # asked for: kept


def test_the_wire_form_is_the_request_again_so_a_resubmit_compares_equal():
    """logit_bias int keys become the decimal strings JSON makes of them, and `structured`
    travels under its own names, so the request after the wire is the request before it."""
    kw = {**OK, "n": 3, "logprobs": 2, "logit_bias": {5: 1.5, "7": -2},
          "structured": {"json": SCHEMA}, "stop_token_ids": [3], "bad_words": ["zz"]}
    req = parse_request(kw)
    wire = wire_kwargs(req)
    assert wire["logit_bias"] == {"5": 1.5, "7": -2.0} and wire["structured"] == {"json": SCHEMA}
    assert parse_request(wire) == req and wire_kwargs(parse_request(wire)) == wire


def test_an_uncompilable_schema_is_refused_before_publish_naming_the_reason():
    """Given tiny-llama's backend (xgrammar), a schema valid by its metaschema but not
    compilable (a $ref to nothing) is invalid_request at submit, naming the backend's reason;
    a compilable schema, a regex and a grammar are admitted."""
    assert backend_of(get_registry().get("tiny-llama").engine_args) == "xgrammar"
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}
    msg = refusal({**OK, "structured": {"json": bad}})
    assert msg.startswith("invalid_request: structured (json) cannot be compiled by tiny-llama"
                          "'s structured-output backend (xgrammar): "), msg
    assert "regex" in refusal({**OK, "structured": {"regex": "a(b"}})
    assert "grammar" in refusal({**OK, "structured": {"grammar": "root ::= nothing_defined"}})
    for ok in ({"json": SCHEMA}, {"regex": "[a-c]{3}"}, {"choice": ["yes", "no"]},
               {"json_object": True}, {"grammar": 'root ::= "a" | "b"'}):
        req, _ = admit({**OK, "structured": ok}, load_settings(), get_registry())
        assert req.structured.wire() == ok


def test_a_schema_nested_deeper_than_vllm_allows_is_refused_without_recursion():
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    assert nesting(deep) == 65  # counted level by level, stopping past the bound
    assert "nests objects and arrays deeper than 64" in refusal({**OK, "structured":
                                                                  {"json": deep}})


def test_the_mapping_onto_sampling_params_carries_every_field():
    """workers/engine/sampling.py: a run from the prompt asks vLLM for what the request says;
    a continued sample asks for one sample, the rest of max_tokens and min_tokens, its own seed
    (seed + index, as vLLM seeds sample i), token ids only."""
    from workers.engine.sampling import Continuation, sampling_params

    req = parse_request({**OK, "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                         "min_p": 0.05, "seed": 11, "presence_penalty": 0.5,
                         "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_tokens": 3,
                         "max_tokens": 12, "stop": ["\n"], "stop_token_ids": [7],
                         "logit_bias": {"9": -5}, "include_stop_str_in_output": True,
                         "skip_special_tokens": False, "bad_words": ["zz"],
                         "allowed_token_ids": [1, 2, 3, 7, 9], "logprobs": 3,
                         "prompt_logprobs": 1, "structured": {"choice": ["a", "b"]}})
    p = sampling_params(req)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (4, 0.7, 0.9, 20, 0.05, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.min_tokens, p.max_tokens, p.stop, p.stop_token_ids) == (3, 12, ["\n"], [7])
    assert p.logit_bias == {9: -5.0} and p.allowed_token_ids == [1, 2, 3, 7, 9]
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    assert p.bad_words == ["zz"] and (p.logprobs, p.prompt_logprobs) == (3, 1)
    assert p.structured_outputs.choice == ["a", "b"] and p.detokenize
    c = sampling_params(req, Continuation(index=2, made=5))
    assert (c.n, c.max_tokens, c.min_tokens, c.seed, c.detokenize) == (1, 7, 0, 13, False)
    assert c.stop == [] and c.structured_outputs is None and c.logit_bias == {9: -5.0}
    named = sampling_params(parse_request({**OK, "logprob_token_ids": [4, 5]}))
    assert named.logprob_token_ids == [4, 5] and named.logprobs is None


HOSTILE_FIELDS = {
    "n": st.one_of(st.integers(), st.just(10**9), st.floats()),
    "logprobs": st.one_of(st.integers(), st.none(), st.booleans()),
    "prompt_logprobs": st.one_of(st.integers(), st.text(max_size=3)),
    "presence_penalty": st.floats(allow_nan=True, allow_infinity=True),
    "frequency_penalty": st.floats(allow_nan=True, allow_infinity=True),
    "repetition_penalty": st.floats(allow_nan=True, allow_infinity=True),
    "min_p": st.floats(allow_nan=True),
    "top_k": st.integers(),
    "min_tokens": st.integers(),
    "logit_bias": st.one_of(
        st.dictionaries(st.one_of(st.integers(), st.text(max_size=6)), st.floats(), max_size=6),
        st.just({str(i): 1.0 for i in range(10**6)})),
    "stop_token_ids": st.lists(st.integers(), max_size=6),
    "allowed_token_ids": st.one_of(st.lists(st.integers(), max_size=6),
                                   st.just(list(range(300_000)))),
    "bad_words": st.lists(st.text(max_size=300), max_size=4),
    "logprob_token_ids": st.lists(st.integers(), max_size=200),
    "structured": st.one_of(
        st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object",
                                         "yaml"]),
                        st.one_of(st.text(max_size=20), st.booleans(), st.none(),
                                  st.lists(st.text(max_size=5), max_size=3),
                                  st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                                  max_size=3)), max_size=2),
        st.just({"json": {"type": "object", "properties": {
            f"p{i}": {"type": "string"} for i in range(5000)}}}),
        st.just({"regex": "a" * 70_000})),
    "detokenize": st.one_of(st.booleans(), st.integers()),
}


@hsettings(max_examples=100, deadline=None, database=None,
           suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({}, optional=HOSTILE_FIELDS))
def test_hostile_version_2_fields_end_in_a_request_or_a_typed_error(fields):
    """Huge schemas, NaN penalties, a million logit_bias entries, n = 10^9, wrong types: admit
    returns a request within every bound or raises a typed RequestError, nothing else."""
    try:
        req, _ = admit({**OK, **fields}, load_settings(), get_registry())
    except RequestError as e:
        assert e.code in {"invalid_request", "token_out_of_vocab"}, e
    else:
        assert 1 <= req.n <= 16 and logprob_entries(req) <= load_settings().max_logprob_entries
        for f in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            assert math.isfinite(getattr(req, f))
