"""Unit tier: request validation and submit-time admission (no Redis)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from app.errors import RequestError
from app.requests.models import get_registry
from app.requests.schemas import parse_request
from app.requests.admit import admit
from app.settings import load_settings

OK = {"model": "tiny-llama", "prompt": "hello"}


def code_of(kwargs, **setting_overrides) -> str:
    with pytest.raises(RequestError) as ei:
        admit(kwargs, load_settings(**setting_overrides), get_registry())
    return str(ei.value)


@pytest.mark.parametrize("bad, field", [
    ({"model": "tiny-llama"}, "exactly one of prompt or prompt_token_ids"),
    ({**OK, "prompt_token_ids": [1, 2]}, "exactly one of prompt or prompt_token_ids"),
    ({**OK, "prompt": ""}, "prompt"),
    ({**OK, "max_tokens": 0}, "max_tokens"),
    ({**OK, "max_tokens": -5}, "max_tokens"),
    ({**OK, "max_tokens": "16"}, "max_tokens"),
    ({**OK, "max_tokens": True}, "max_tokens"),
    ({**OK, "temperature": -1}, "temperature"),
    ({**OK, "temperature": float("inf")}, "temperature"),
    ({**OK, "top_p": 0}, "top_p"),
    ({**OK, "seed": -1}, "seed"),
    ({**OK, "stop": [""]}, "stop"),
    ({**OK, "stop": ["x"] * 17}, "stop"),
    ({**OK, "job": "has space"}, "job"),
    ({**OK, "deadline_s": 0}, "deadline_s"),
    ({**OK, "prompt_token_ids": None, "prompt": None}, "exactly one"),
    ({**OK, "promt": "typo"}, "promt: unknown field"),
    ({**OK, "ignore_eos": "yes"}, "ignore_eos"),
])
def test_malformed_requests_are_refused_with_the_field_named(bad, field):
    msg = code_of(bad)
    assert msg.startswith("invalid_request: ")
    assert field in msg


def test_a_valid_request_is_admitted_and_normalised():
    req, spec, _ = admit({**OK, "stop": "\n"}, load_settings(), get_registry())
    assert req.stop == ["\n"] and spec.name == "tiny-llama" and spec.queue == "vigil.pool.tiny-llama"


def test_unknown_model_is_refused_naming_the_known_ones():
    msg = code_of({**OK, "model": "gpt-17"})
    assert msg.startswith("model_not_found: ") and "tiny-llama" in msg


def test_oversized_prompt_bytes_are_refused_with_the_setting_named():
    msg = code_of({**OK, "prompt": "é" * 600}, max_prompt_bytes=1000)
    assert msg.startswith("invalid_request: ") and "VIGIL_MAX_PROMPT_BYTES" in msg


def test_max_tokens_beyond_the_model_context_is_refused():
    assert "max_tokens=513" in code_of({**OK, "max_tokens": 513})


def test_token_prompt_longer_than_the_context_is_prompt_too_long_at_submit():
    assert code_of({"model": "tiny-llama", "prompt_token_ids": [5] * 513}).startswith(
        "prompt_too_long: ")


def test_out_of_vocabulary_token_is_refused_at_submit():
    msg = code_of({"model": "tiny-llama", "prompt_token_ids": [1, 2048]})
    assert msg.startswith("token_out_of_vocab: ") and "2048" in msg


def test_non_mapping_kwargs_are_invalid_request():
    with pytest.raises(RequestError, match="^invalid_request: "):
        parse_request(["model", "tiny-llama"])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["model", "prompt", "prompt_token_ids", "max_tokens", "temperature",
                          "top_p", "seed", "stop", "ignore_eos", "job", "deadline_s", "x"])


@hsettings(max_examples=300, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=8))
def test_any_json_kwargs_end_in_a_request_or_a_typed_error(kwargs):
    try:
        req, _, _ = admit(kwargs, load_settings(), get_registry())
    except RequestError as e:
        assert e.code in {"invalid_request", "model_not_found", "prompt_too_long",
                          "token_out_of_vocab"}
    else:
        assert req.model == "tiny-llama"
