"""Unit tier: the OpenAI side of the generation contract (issue 31). Batch lines' n, logprobs,
response_format, seed, stop, penalties, logit_bias and vLLM's extras become the request's
fields; a finished request's output line has OpenAI's shapes (n choices, chat's
logprobs.content, completions' parallel lists), checked against the official `openai`
package's own types, every field known to them."""
from __future__ import annotations

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from app.errors import RequestError
from app.requests import batch_file as batch
from app.requests.schemas import parse_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion_line(**body) -> dict:
    return {"custom_id": "q1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": "Hi", **body}}


def chat_line(**body) -> dict:
    return {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}],
                     **body}}


def to_request(obj: dict) -> dict:
    return batch.to_request(obj, 1, "job-1", lambda model, msgs: [1, 2, 3],
                            lambda model, n: 32)[1]


def test_a_completion_line_carries_openais_fields_and_vllms_extras_onto_the_request():
    kw = to_request(completion_line(
        n=3, temperature=0.9, logprobs=4, seed=7, stop=["\n"], presence_penalty=0.5,
        frequency_penalty=-0.25, logit_bias={"11": -100}, top_k=40, min_p=0.1,
        repetition_penalty=1.1, min_tokens=2, stop_token_ids=[5], bad_words=["zz"],
        include_stop_str_in_output=True, skip_special_tokens=False, allowed_token_ids=[1, 5],
        prompt_logprobs=1, response_format={"type": "json_schema", "json_schema": {
            "name": "thing", "schema": SCHEMA, "strict": True}}))
    req = parse_request(kw)
    assert (req.n, req.logprobs, req.seed, req.stop) == (3, 4, 7, ["\n"])
    assert (req.presence_penalty, req.frequency_penalty, req.logit_bias) == (0.5, -0.25,
                                                                             {"11": -100.0})
    assert (req.top_k, req.min_p, req.repetition_penalty, req.min_tokens) == (40, 0.1, 1.1, 2)
    assert req.stop_token_ids == [5] and req.bad_words == ["zz"] and req.prompt_logprobs == 1
    assert req.include_stop_str_in_output and not req.skip_special_tokens
    assert req.structured.wire() == {"json": SCHEMA} and req.schema_version == 2


@pytest.mark.parametrize("body, structured", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"grammar": 'root ::= "a"'}),
])
def test_response_format_and_vllms_structured_outputs_become_the_constraint(body, structured):
    req = parse_request(to_request(chat_line(**body)))
    assert (req.structured.wire() if req.structured else None) == structured


@pytest.mark.parametrize("body, logprobs", [
    ({"logprobs": True, "top_logprobs": 3}, 3),
    ({"logprobs": True}, 0),
    ({"logprobs": False}, None),
    ({}, None),
])
def test_chat_logprobs_and_top_logprobs_read_as_openai_reads_them(body, logprobs):
    assert parse_request(to_request(chat_line(**body))).logprobs == logprobs


@pytest.mark.parametrize("obj, words", [
    (chat_line(top_logprobs=2), "body.top_logprobs needs body.logprobs true"),
    (chat_line(logprobs=2), "body.logprobs must be true or false"),
    (chat_line(response_format={"type": "yaml"}), "response_format.type 'yaml'"),
    (chat_line(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "json_schema.schema must be a JSON schema"),
    (chat_line(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "not both"),
    (completion_line(best_of=2), "best_of"),
])
def test_bad_openai_fields_name_the_line_and_the_field(obj, words):
    with pytest.raises(RequestError, match="^invalid_request: line 1: ") as ei:
        to_request(obj)
    assert words in str(ei.value)


def test_values_the_request_refuses_are_refused_when_it_is_parsed():
    with pytest.raises(RequestError, match="structured.whitespace_pattern: unknown field"):
        parse_request(to_request(chat_line(structured_outputs={"regex": "a",
                                                               "whitespace_pattern": " "})))


def _entry(token_id: int, token: str, logprob: float, top: list[tuple]) -> dict:
    return {"token_id": token_id, "token": token, "logprob": logprob, "rank": 1,
            "top": [{"token_id": i, "token": t, "logprob": lp, "rank": r}
                    for i, t, lp, r in top]}


E1 = _entry(5, "He", -0.5, [(5, "He", -0.5, 1), (6, "é", -1.5, 2)])
E2 = _entry(7, "llo", -0.25, [(7, "llo", -0.25, 1), (8, "y", -2.0, 2)])
RESULT = {"request_id": "r1", "model": "tiny-llama", "text": "Hello", "token_ids": [5, 7],
          "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2, "attempts": 1,
          "worker": "w@h", "logprobs": [E1, E2], "cumulative_logprob": -0.75,
          "choices": [{"index": 0, "text": "Hello", "token_ids": [5, 7], "finish_reason": "length",
                       "completion_tokens": 2, "logprobs": [E1, E2], "cumulative_logprob": -0.75},
                      {"index": 1, "text": "Hy", "token_ids": [5, 8, 9], "finish_reason": "stop",
                       "completion_tokens": 3, "logprobs": [E1, E1, E2],
                       "cumulative_logprob": -1.25}]}


def known_everywhere(m: BaseModel, where: str = "body") -> None:
    """Every field of our dict is one the openai type knows (its models allow extras)."""
    assert not m.model_extra, f"{where}: fields openai's type does not know: {m.model_extra}"
    for name in type(m).model_fields:
        value = getattr(m, name)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, BaseModel):
                known_everywhere(v, f"{where}.{name}")


def test_a_completion_output_line_is_openais_completion_with_n_choices_and_logprobs():
    body = batch.success_line("r1", "q1", "completion", RESULT, 1700)["response"]["body"]
    c = Completion.model_validate(body)
    known_everywhere(c)
    assert [ch.index for ch in c.choices] == [0, 1] and c.choices[1].text == "Hy"
    lp = c.choices[0].logprobs
    assert lp.tokens == ["He", "llo"] and lp.token_logprobs == [-0.5, -0.25]
    assert lp.top_logprobs == [{"He": -0.5, "é": -1.5}, {"llo": -0.25, "y": -2.0}]
    assert lp.text_offset == [0, 2]
    assert c.usage.completion_tokens == 5 and c.usage.total_tokens == 8  # every sample's


def test_a_chat_output_line_is_openais_chat_completion_with_logprobs_content():
    body = batch.success_line("r1", "q1", "chat", RESULT, 1700)["response"]["body"]
    c = ChatCompletion.model_validate(body)
    known_everywhere(c)
    first = c.choices[0].logprobs.content
    assert [t.token for t in first] == ["He", "llo"] and first[0].bytes == [72, 101]
    assert first[0].top_logprobs[1].token == "é" and first[0].top_logprobs[1].bytes == [195, 169]
    assert c.choices[1].message.content == "Hy" and c.choices[1].finish_reason == "stop"


def test_without_logprobs_or_n_the_output_line_is_what_it_was():
    plain = {k: v for k, v in RESULT.items()
             if k not in ("logprobs", "cumulative_logprob", "choices")}
    body = batch.success_line("r1", "q1", "chat", plain, 1)["response"]["body"]
    known_everywhere(ChatCompletion.model_validate(body))
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
