"""Unit tier: the version 2 request fields (issue 31): their validation at submit, the version a
request is stamped with, the bounds that need the model or the settings, the structured-output
checks before publish, and the one mapping onto vLLM's SamplingParams."""
from __future__ import annotations

import math

import pytest

from app.errors import RequestError
from app.requests.limits import logprob_entries
from app.requests.models import get_registry
from app.requests.schemas import needed_version, parse_request
from app.requests.structured import backend_of, nesting
from app.requests.admit import admit
from app.requests.record_fields import wire_kwargs
from app.settings import load_settings
from tests.request_shapes import OK, SCHEMA, json_deep, refusal


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
    ({"n": 2, "temperature": 1.0, "prompt_logprobs": 1}, "invalid_request",
     "prompt_logprobs with n > 1 cannot run on tiny-llama, which serves LoRA adapters"),
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
        req, _, _ = admit({**OK, "structured": ok}, load_settings(), get_registry())
        assert req.structured.wire() == ok


SHORT = {"type": "object", "additionalProperties": False, "required": ["s"],
         "properties": {"s": {"type": "string", "maxLength": 4}}}


@pytest.mark.parametrize("constraint, text, says", [
    ({"json": SHORT}, '{"s": "ab"}', ""),
    # xgrammar 0.2.8 lets a raw control character into a string with maxLength (the issue's
    # repro on tiny-llama): a strict JSON parser refuses it.
    ({"json": SHORT}, '{"s": "a\x1ab"}', "not strict JSON: Invalid control character at"),
    ({"json": SHORT}, '{"s": "abcdef"}', "JSON its schema refuses at s: maxLength 4"),
    ({"json": SHORT}, '{"s": NaN}', "not strict JSON: NaN is not JSON"),
    ({"json": SHORT}, '{"s": "ab"', "not strict JSON: Expecting"),
    ({"json_object": True}, '{"a": [1, 2]}', ""),
    ({"json_object": True}, '[1]', "JSON, but not an object (a list)"),
    ({"regex": "[a-c]{3}-[0-9]{2}"}, "abc-12", ""),
    ({"regex": "[a-c]{3}-[0-9]{2}"}, "abc-123", "7 characters that its regex does not match"),
    ({"regex": "a.b"}, "a\nb", ""),  # `.` matches any character, as the backends' does
    ({"regex": "(?<!x"}, "anything", ""),  # Python cannot compile it: not checked
    ({"choice": ["red fox", "blue whale"]}, "blue whale", ""),
    ({"choice": ["red fox", "blue whale"]}, "red fo", "6 characters, none of its 2 choices"),
    ({"grammar": 'root ::= "a"'}, "b", ""),  # no parser but the backend's: not checked
])
def test_an_output_is_checked_against_its_constraint_apart_from_the_backend(constraint, text,
                                                                             says):
    """app/requests/structured.py `violation`: a strict JSON parse and the schema by
    jsonschema, a regex fullmatch, choice membership; the reason never quotes the output."""
    from app.requests.structured import Structured, violation

    why = violation(Structured.model_validate(constraint), text)
    assert why.startswith(says) if says else why == ""
    assert text not in why or not says


def test_only_a_sample_the_engine_ended_is_checked_and_a_break_is_a_typed_retryable_error():
    """workers/result.py `check_structured`: a sample cut by max_tokens, or by the request's
    own stop strings, is left alone; one the engine ended that breaks the constraint raises
    TransientError(structured_output_invalid) naming the sample and the reason. A greedy or
    seeded request repeats its output (`repeats_output`), a sampled one without a seed not."""
    from app.errors import TransientError
    from workers.engine.output import EngineOutput, Sample
    from workers.result import check_structured, repeats_output

    kw = {"model": "tiny-llama", "prompt": "x", "structured": {"json": SHORT}}
    req = parse_request(kw)
    broken = '{"s": "\x1a"}'
    check_structured(req, EngineOutput(broken, [1], "length", 1))
    check_structured(parse_request({**kw, "stop": ["}"]}), EngineOutput(broken, [1], "stop", 1))
    with pytest.raises(TransientError, match=r"^structured_output_invalid: the output broke its "
                                             r"json constraint: not strict JSON: Invalid control"):
        check_structured(req, EngineOutput(broken, [1], "stop", 1))
    two = parse_request({**kw, "n": 2})
    samples = [Sample(0, '{"s": "ok"}', [1], "stop"), Sample(1, broken, [1], "stop")]
    with pytest.raises(TransientError, match=r"sample 1's output broke its json constraint"):
        check_structured(two, EngineOutput.of(samples, 1))
    assert repeats_output(parse_request({**kw, "temperature": 0.0}))
    assert repeats_output(parse_request({**kw, "seed": 7}))
    assert not repeats_output(req)


def test_a_schema_nested_deeper_than_vllm_allows_is_refused_without_recursion():
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    assert nesting(deep) == 65  # counted level by level, stopping past the bound
    assert "nests objects and arrays deeper than 64" in refusal({**OK, "structured":
                                                                  {"json": deep}})


def test_the_nesting_bound_is_vllms_to_the_level():
    """64 levels of objects (the outermost counted) are admitted and vLLM takes them; 65 are
    refused at submit, as vLLM's own check refuses them (counted once the other way, 64 levels
    passed the producer and failed on the first attempt)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import check_json_nesting

    at, past = json_deep(63), json_deep(64)
    assert (nesting(at), nesting(past), nesting({}), nesting({"a": []})) == (64, 65, 1, 2)
    req, _, _ = admit({**OK, "structured": {"json": at}}, load_settings(), get_registry())
    check_json_nesting(req.structured.wire()["json"])
    assert "deeper than 64" in refusal({**OK, "structured": {"json": past}})
    with pytest.raises(VLLMValidationError):
        check_json_nesting(past)


def test_the_mapping_onto_sampling_params_carries_every_field():
    """workers/engine/sampling.py: a run from the prompt asks vLLM for what the request says;
    a continued sample asks for one sample, the rest of max_tokens and min_tokens, its own seed
    (seed + index, as vLLM seeds sample i), token ids only, the same constraint, and marks
    for EngineCore (the generated prefix, the penalties it applies)."""
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
    assert c.stop == [] and c.structured_outputs.choice == ["a", "b"]
    assert c.logit_bias == {9: -5.0} and c.bad_words == ["zz"]
    # The penalties are applied in EngineCore over the whole generation (resume_steps.py),
    # which is told how many of the prompt's tokens were generated (resume_marks.py).
    assert (c.presence_penalty, c.frequency_penalty, c.repetition_penalty) == (0.0, 0.0, 1.0)
    assert c.extra_args == {"vigil_resume": {"made": 5, "penalties": [0.5, -0.5, 1.2]}}
    named = sampling_params(parse_request({**OK, "logprob_token_ids": [4, 5]}))
    assert named.logprob_token_ids == [4, 5] and named.logprobs is None


def test_detokenize_false_reaches_vllm_on_a_run_from_the_prompt():
    """`detokenize=False` is passed to vLLM (its front end then skips the incremental
    detokenizer: the result's text is "" and logprob entries carry no token, which
    tests/test_generation_contract_e2e.py checks on the real engine); left out, vLLM
    detokenizes. A continued sample is never detokenized by vLLM, whatever the request says
    (its text is the seam's)."""
    from workers.engine.sampling import Continuation, sampling_params

    off = parse_request({**OK, "detokenize": False, "logprobs": 2, "n": 2})
    assert off.schema_version == 2 and wire_kwargs(off)["detokenize"] is False
    p = sampling_params(off)
    assert p.detokenize is False and p.n == 2 and p.logprobs == 2
    assert sampling_params(parse_request(OK)).detokenize is True
    assert sampling_params(off, Continuation(index=1, made=3)).detokenize is False


def test_an_xgrammar_still_importing_is_no_verdict_on_a_constraint(monkeypatch):
    """Given xgrammar half imported (in a worker, the engine's thread imports it while a task
    thread admits a request: a module with no `Grammar` yet; the soak met it), then the admit's
    compile check gives no verdict and the request goes on (the engine checks it); before, the
    AttributeError was taken for xgrammar's refusal and a good request ended invalid_request.
    A constraint xgrammar itself refuses is still refused."""
    import sys
    import types

    from app.requests.structured import check_compiles

    good = parse_request({**OK, "structured": {"regex": "[a-z]{4}"}}).structured
    bad = parse_request({**OK, "structured": {"regex": "[a-z"}}).structured
    with pytest.raises(RequestError, match="^invalid_request: structured"):
        check_compiles(bad, "xgrammar", "tiny-llama")
    monkeypatch.setitem(sys.modules, "xgrammar", types.ModuleType("xgrammar"))
    check_compiles(good, "xgrammar", "tiny-llama")
    check_compiles(bad, "xgrammar", "tiny-llama")  # no verdict here: the engine's own check


def test_each_runs_sampling_params_are_its_own_so_vllm_copies_them_shallowly():
    """vLLM deep-copies the SamplingParams it is given unless they are marked `skip_clone`
    (~20 us of the engine's loop per request); Vigil builds them afresh for every run, nothing
    inside them shared with another run, and marks them so (workers/engine/sampling.py)."""
    from workers.engine.sampling import Continuation, sampling_params

    req = parse_request({"model": "tiny-llama", "prompt": "x", "max_tokens": 4,
                         "stop_token_ids": [5], "stop": ["."], "logprobs": 2})
    a, b = sampling_params(req), sampling_params(req)
    c = sampling_params(req, Continuation(0, 1))
    assert a.skip_clone and b.skip_clone and c.skip_clone
    assert a is not b and a.stop_token_ids is not b.stop_token_ids and a.stop is not b.stop
    assert a.clone().max_tokens == 4 and c.max_tokens == 3
