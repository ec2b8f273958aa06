"""Unit tier: the batch file format (app/requests/batch_file.py), the command's default paths
(app/ops/batch_run.py; the command itself: tests/test_batch_run.py) and chat rendering with real
tokenizers saved in a temporary directory (app/requests/chat.py). No Redis, no Celery."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from app.errors import RequestError
from app.ops.batch_run import default_paths
from app.requests import batch_file as batch
from app.requests.chat import ChatTemplates
from app.requests.models import ModelRegistry, ModelSpec
from app.requests.schemas import parse_request


def line(cid="q1", url="/v1/completions", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": "tiny-llama", **body}}


def fake_render(model, messages):
    return [len(messages), len(model)]


def fake_budget(model, prompt_tokens):
    return 64 - prompt_tokens  # a 64-token context


def to_req(obj, render=fake_render):
    return batch.to_request(obj, 7, "job-1", render, fake_budget)


def refused(obj, *words, render=fake_render):
    with pytest.raises(RequestError) as ei:
        to_req(obj, render)
    assert ei.value.code == "invalid_request"
    assert ei.value.detail.startswith("line 7: ")
    for w in words:
        assert w in ei.value.detail
    return ei.value


# -- ids and names -----------------------------------------------------------------------------
def test_request_ids_are_deterministic_per_job_and_custom_id():
    a = batch.request_id_for("eval-7", "q1")
    assert a == batch.request_id_for("eval-7", "q1") and uuid.UUID(a).version == 5
    assert a != batch.request_id_for("eval-8", "q1") != batch.request_id_for("eval-7", "q2")
    # "job\ncustom_id": no (job, custom_id) pair can be spelled as another
    assert batch.request_id_for("a", "b:c") != batch.request_id_for("a:b", "c")


def test_the_id_namespace_never_changes():
    """A changed namespace would orphan every interrupted batch: pin one id."""
    assert batch.request_id_for("eval-7", "q1") == str(
        uuid.uuid5(uuid.UUID("4f0b7c8e-3c1d-5a8e-9d62-1b7e0a6c2f51"), "eval-7\nq1"))


@pytest.mark.parametrize("path, job", [
    ("/data/eval-7.jsonl", "eval-7"), ("run.v2.jsonl", "run.v2"),
    ("my prompts.jsonl", "my-prompts"),
    (".hidden.jsonl", "batch-.hidden"), ("é.jsonl", "batch--"), ("x" * 200 + ".jsonl", "x" * 128),
])
def test_the_default_job_comes_from_the_file_name_and_is_a_valid_job(path, job):
    assert batch.default_job(path) == job
    assert batch.valid_job(job)


def test_default_output_paths_sit_next_to_the_input():
    assert default_paths("/d/eval.jsonl") == (Path("/d/eval.output.jsonl"),
                                              Path("/d/eval.errors.jsonl"))
    assert default_paths("in.txt") == (Path("in.txt.output.jsonl"), Path("in.txt.errors.jsonl"))


# -- reading lines ----------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
    ('{"method": "POST"}', "custom_id"), ('{"custom_id": ""}', "custom_id"),
    ('{"custom_id": 5}', "custom_id"), (json.dumps({"custom_id": "x" * 513}), "custom_id"),
])
def test_a_line_without_a_usable_custom_id_is_an_invalid_request(text, words):
    with pytest.raises(RequestError) as ei:
        batch.read_custom_id(text, 3)
    assert ei.value.code == "invalid_request"
    assert "line 3" in str(ei.value) and words in str(ei.value)


def test_a_completion_line_becomes_generate_kwargs_that_pass_the_schema():
    cid, obj = batch.read_custom_id(json.dumps(line(
        prompt="Hello", max_tokens=8, temperature=0, top_p=0.5, seed=3, stop=["."],
        ignore_eos=True, n=1, stream=False, user="me")), 1)
    kind, kw = to_req(obj)
    assert cid == "q1" and kind == "completion"
    assert kw == {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
                  "top_p": 0.5, "seed": 3, "stop": ["."], "ignore_eos": True, "n": 1,
                  "job": "job-1", "priority": "bulk"}
    parse_request(kw)


def test_nulls_mean_the_default_and_token_prompts_are_token_ids():
    assert to_req(line(prompt=[5, 6], seed=None, stop=None, temperature=None))[1] == {
        "model": "tiny-llama", "prompt_token_ids": [5, 6], "job": "job-1", "priority": "bulk"}
    assert to_req(line(prompt=["one prompt"]))[1]["prompt"] == "one prompt"


def test_a_chat_line_is_rendered_by_the_models_template():
    seen = []

    def render(model, messages):
        seen.append((model, messages))
        return [4, 9, 5]

    kind, kw = to_req(line(url="/v1/chat/completions", max_completion_tokens=5, messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]), render)
    assert kind == "chat"
    assert kw == {"model": "tiny-llama", "prompt_token_ids": [4, 9, 5], "max_tokens": 5,
                  "job": "job-1", "priority": "bulk"}
    assert seen == [("tiny-llama", [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "a\nb"}])]


def test_a_chat_line_without_max_tokens_gets_the_rest_of_the_context_a_completion_16():
    """Given a chat line that names no max_tokens (or null), then it asks the rest of the model's
    context after its prompt (chat_budget), as OpenAI's and vLLM's chat endpoints do; a
    completions line names none and so keeps the request's default (16), as OpenAI's legacy
    endpoint does; a model whose context is unknown keeps 16 too."""
    chat = line(url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
    assert to_req(chat)[1]["max_tokens"] == 64 - 2
    assert to_req({**chat, "body": {**chat["body"], "max_tokens": None}})[1]["max_tokens"] == 62
    assert "max_tokens" not in to_req(line(prompt="x"))[1]
    assert "max_tokens" not in batch.to_request(chat, 7, "j", fake_render, lambda m, n: None)[1]


def test_rest_of_context_reads_the_registry_and_the_cap(monkeypatch):
    from app.requests.chat import rest_of_context
    from app.requests.models import TINY_MAX_POSITIONS, get_registry
    from app.settings import get_settings

    assert get_registry().get("tiny-llama").max_model_len == TINY_MAX_POSITIONS
    assert rest_of_context("tiny-llama", 10) == TINY_MAX_POSITIONS - 10
    assert rest_of_context("tiny-llama", TINY_MAX_POSITIONS) == 1  # ends prompt_too_long
    monkeypatch.setenv("VIGIL_MAX_TOKENS_CAP", "7")
    get_settings.cache_clear()
    try:
        assert rest_of_context("tiny-llama", 10) == 7
    finally:
        monkeypatch.delenv("VIGIL_MAX_TOKENS_CAP")
        get_settings.cache_clear()


@pytest.mark.parametrize("obj, words", [
    ({**line(prompt="x"), "extra": 1}, ["unknown field(s) extra"]),
    ({**line(prompt="x"), "method": "GET"}, ["method"]),
    ({**line(prompt="x"), "url": "/v1/embeddings"}, ["/v1/embeddings", "not supported"]),
    ({**line(), "body": "text"}, ["body must be a JSON object"]),
    ({**line(), "body": {"prompt": "x"}}, ["body.model"]),
    (line(prompt="x", logprobs=2, best_of=3), ["best_of", "not supported"]),
    (line(prompt="x", top_logprobs=2), ["top_logprobs", "not supported"]),
    (line(prompt="x", stream=True), ["body.stream must be False"]),
    (line(prompt="x", max_completion_tokens=4), ["max_completion_tokens", "not supported"]),
    (line(prompt="x", messages=[]), ["messages", "not supported"]),
    (line(prompt=["a", "b"]), ["one prompt per line"]),
    (line(prompt=[1, True]), ["body.prompt"]),
    (line(prompt=None), ["body.prompt"]),
    (line(url="/v1/chat/completions", prompt="x"), ["prompt", "not supported"]),
    (line(url="/v1/chat/completions"), ["body.messages must be a non-empty list"]),
    (line(url="/v1/chat/completions", messages=[{"content": "x"}]), ["messages[0]", "role"]),
    (line(url="/v1/chat/completions", messages=[{"role": "user", "content": None}]),
     ["messages[0].content"]),
    (line(url="/v1/chat/completions", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), ["only text parts"]),
    (line(url="/v1/chat/completions", messages=[{"role": "user", "content": "x"}],
          max_tokens=3, max_completion_tokens=4), ["differ"]),
])
def test_a_bad_envelope_or_body_is_an_invalid_request_naming_the_line(obj, words):
    refused(obj, *words)


def test_field_values_are_left_to_the_request_schema():
    """Types and bounds are GenerateRequest's to check, at submit time, with its messages."""
    kw = to_req(line(prompt="x", max_tokens="5"))[1]
    with pytest.raises(RequestError, match="max_tokens"):
        parse_request(kw)


# -- output lines -----------------------------------------------------------------------------
RESULT = {"request_id": "r1", "model": "tiny-llama", "text": "hi there", "token_ids": [1, 2],
          "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2, "attempts": 1,
          "worker": "w@h"}


def test_a_completion_success_has_the_openai_batch_shape():
    out = batch.success_line("r1", "q1", "completion", RESULT, 1700000000)
    assert out == {"id": "batch_req_r1", "custom_id": "q1", "error": None, "response": {
        "status_code": 200, "request_id": "r1", "body": {
            "id": "cmpl-r1", "object": "text_completion", "created": 1700000000,
            "model": "tiny-llama",
            "choices": [{"index": 0, "text": "hi there", "logprobs": None,
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}}}


def test_a_chat_success_carries_the_message():
    body = batch.success_line("r1", "q1", "chat", RESULT, 1)["response"]["body"]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-r1"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi there"},
                                "logprobs": None, "finish_reason": "length"}]


def test_an_error_line_has_a_null_response_and_the_vigil_code():
    assert batch.error_line("batch_req_r1", "q1", "model_not_found", "no model") == {
        "id": "batch_req_r1", "custom_id": "q1", "response": None,
        "error": {"code": "model_not_found", "message": "no model"}}
    assert batch.dumps({"t": "é"}) == '{"t":"é"}\n'


# -- chat templates ---------------------------------------------------------------------------
def save_tokenizer(path: Path, template: str | None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<|user|>", "<|assistant|>", "<|system|>",
                                         "hello", "world", "\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    if template:
        fast.chat_template = template
    fast.save_pretrained(path)
    return str(path)


def registry(tmp_path) -> ModelRegistry:
    from app.requests.model_files import CHAT_TEMPLATE

    return ModelRegistry([
        ModelSpec(name="templated", path=save_tokenizer(tmp_path / "t", CHAT_TEMPLATE)),
        ModelSpec(name="plain", path=save_tokenizer(tmp_path / "p", None)),
        ModelSpec(name="strict", path=save_tokenizer(
            tmp_path / "s", "{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('first message must be the user') }}{% endif %}"
                            "{{ messages[0]['content'] }}")),
        ModelSpec(name="nowhere", path=str(tmp_path / "missing")),
        ModelSpec(name="pathless"),
    ])


def test_chat_messages_are_rendered_with_the_template_and_a_generation_prompt(tmp_path):
    render = ChatTemplates(registry(tmp_path))
    ids = render("templated", [{"role": "user", "content": "hello"}])
    # <|user|>hello\n<|assistant|>, special tokens matched, nothing added around them
    assert ids == [1, 4, 6, 2]


@pytest.mark.parametrize("model, words", [
    ("plain", "no chat template"), ("nowhere", "no tokenizer could be loaded"),
    ("pathless", "no local path"), ("strict", "refused the messages"),
])
def test_a_model_without_a_usable_template_fails_chat_lines_with_invalid_request(
        tmp_path, model, words):
    render = ChatTemplates(registry(tmp_path))
    for _ in range(2):  # found once, the same answer for every line
        with pytest.raises(RequestError) as ei:
            render(model, [{"role": "system", "content": "hello"}])
        assert ei.value.code == "invalid_request" and words in ei.value.detail


def test_an_unknown_model_is_model_not_found(tmp_path):
    with pytest.raises(RequestError) as ei:
        ChatTemplates(registry(tmp_path))("gpt-9", [{"role": "user", "content": "x"}])
    assert ei.value.code == "model_not_found"
