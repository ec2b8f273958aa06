"""Unit tier: the version 2 request fields against vLLM itself: hostile values end in a request
or a typed error, never a crash (hypothesis), and what submit admits near every bound vLLM's own
SamplingParams.verify accepts. The fields' own rules: tests/test_generation_fields.py."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from app.errors import RequestError
from app.requests.limits import logprob_entries
from app.requests.models import get_registry
from app.requests.admit import admit
from app.settings import load_settings
from tests.request_shapes import OK, deep_schema, json_deep, wide_schema


# What vLLM's own validation reads of the model (SamplingParams.verify): tiny-llama's numbers
# (its registry entry) and vLLM's default max_logprobs, the engine's. verify() is vLLM's code;
# only these numbers stand in for a loaded model.
def tiny_llama_checks():
    """(model config stand-in, structured-outputs config) for SamplingParams.verify."""
    from types import SimpleNamespace

    from vllm.config import StructuredOutputsConfig

    spec = get_registry().get("tiny-llama")
    model = SimpleNamespace(max_logprobs=20, get_vocab_size=lambda: spec.vocab_size,
                            max_model_len=spec.max_model_len, is_diffusion=False)
    return model, StructuredOutputsConfig(**spec.engine_args["structured_outputs_config"])


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
        # Deep: around vLLM's bound of 64 levels (32 of these), and far past it.
        st.one_of(st.integers(28, 36), st.integers(1, 5000)).map(
            lambda d: {"json": deep_schema(d)}),
        st.integers(1, 5000).map(lambda d: {"json": json_deep(d)}),
        # Huge: around the 64 KiB bound.
        st.integers(1500, 2300).map(lambda w: {"json": wide_schema(w)}),
        st.just({"regex": "a" * 70_000})),
    "detokenize": st.one_of(st.booleans(), st.integers()),
}


@hsettings(max_examples=100, deadline=None, database=None,
           suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({}, optional=HOSTILE_FIELDS))
def test_hostile_version_2_fields_end_in_a_request_or_a_typed_error(fields):
    """Huge schemas, deeply nested ones, NaN penalties, a million logit_bias entries, n = 10^9,
    wrong types: admit returns a request within every bound or raises a typed RequestError,
    nothing else. What it accepts, vLLM accepts: its SamplingParams, built by the one mapping
    (workers/engine/sampling.py), pass vLLM's own checks (its constructor and
    SamplingParams.verify with tiny-llama's vocabulary, max_logprobs and structured-output
    backend), so nothing admitted here fails on its first attempt."""
    from workers.engine.sampling import sampling_params

    try:
        req, _, _ = admit({**OK, **fields}, load_settings(), get_registry())
    except RequestError as e:
        assert e.code in {"invalid_request", "token_out_of_vocab"}, e
    else:
        assert 1 <= req.n <= 16 and logprob_entries(req) <= load_settings().max_logprob_entries
        for f in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            assert math.isfinite(getattr(req, f))
        model, structured = tiny_llama_checks()
        sampling_params(req).verify(model, None, structured, object())


# Fields near and past their bounds, so that most requests are admitted and the rest are
# refused by one bound: what submit admits is then checked against vLLM's own validation.
NEAR_BOUNDS = {
    "n": st.integers(1, 17),
    "temperature": st.floats(0.0, 2.5),
    "max_tokens": st.integers(1, 40),
    "logprobs": st.one_of(st.none(), st.integers(0, 21)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 21)),
    "logprob_token_ids": st.lists(st.integers(0, 2100), min_size=1, max_size=130),
    "top_k": st.integers(-2, 3000),
    "min_p": st.floats(0.0, 1.1),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0.0, 3.0),
    "min_tokens": st.integers(0, 45),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 2100), max_size=5),
    "logit_bias": st.dictionaries(st.integers(0, 2100), st.floats(-120.0, 120.0), max_size=5),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "allowed_token_ids": st.lists(st.integers(0, 2100), min_size=1, max_size=10),
    "detokenize": st.booleans(),
    "structured": st.one_of(
        st.integers(1, 36).map(lambda d: {"json": deep_schema(d)}),
        st.integers(1, 70).map(lambda d: {"json": json_deep(d)}),
        st.integers(1, 2300).map(lambda w: {"json": wide_schema(w)}),
        st.sampled_from([{"json_object": True}, {"regex": "[a-c]{3}-[0-9]{2}"},
                         {"regex": "(a|b"}, {"choice": ["yes", "no"]},
                         {"grammar": 'root ::= "a" | "b"'}, {"grammar": "root ::= nope"}])),
}


@hsettings(max_examples=100, deadline=None, database=None,
           suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({}, optional=NEAR_BOUNDS))
def test_what_submit_admits_vllm_accepts(fields):
    """Given requests whose fields sit near and past their bounds (deep and huge schemas
    among them), when submit admits one, then the SamplingParams the one mapping builds for it
    (workers/engine/sampling.py) pass vLLM's own checks: its constructor and
    SamplingParams.verify with tiny-llama's vocabulary, max_logprobs and structured-output
    backend (which compiles the constraint). "Accepted at submit" so means "vLLM takes it",
    not a refusal on the first attempt. (bad_words are checked against the tokenizer only in
    the engine, and are left out here.)"""
    from workers.engine.sampling import sampling_params

    try:
        req, _, _ = admit({**OK, **fields}, load_settings(), get_registry())
    except RequestError as e:
        assert e.code in {"invalid_request", "token_out_of_vocab"}, e
        return
    model, structured = tiny_llama_checks()
    sampling_params(req).verify(model, None, structured, object())
