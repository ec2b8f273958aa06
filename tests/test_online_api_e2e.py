"""Worker tier: the online API (`vigil api`'s /v1/completions, /v1/chat/completions, /v1/models,
/tokenize, /detokenize, /tokenizer_info) behind the official `openai` client and the request
shapes of lm-evaluation-harness, on a real gateway process and the suite's warm worker.
Streams through worker and gateway deaths: tests/test_online_streams_e2e.py."""
from __future__ import annotations

import json

import openai
import pytest
import requests
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.contract_witness import direct
from tests.online_gateway import TOKEN, assembled, serving_gateway, stream_events

pytestmark = pytest.mark.worker
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def gateway(warm_worker, redis_server, tmp_path_factory):
    yield from serving_gateway(redis_server.url, tmp_path_factory.mktemp("online-api"))


@pytest.fixture()
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=TOKEN, max_retries=0)


def test_the_openai_client_gets_whole_and_streamed_answers_its_own_types_accept(client,
                                                                                  gateway):
    """Given the official client against `vigil api`, when it asks for completions and chat
    completions, whole and streamed, greedy, with n, logprobs and response_format, then every
    body and chunk validates as the client's own strict types (its pydantic models, no extra
    leniency), a stream's assembled text equals the whole answer's, choices come in
    prompt-major order, usage counts every token, and the stream's last chunk before [DONE]
    is the usage chunk it asked for."""
    msgs = [{"role": "user", "content": "tell me a story"}]
    whole = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    body = json.loads(whole.text)
    ChatCompletion.model_validate(body, strict=False)
    text = body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 24 and body["object"] == "chat.completion"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    # Completions: two prompts, n = 2 each, sampled with a seed, top-2 logprobs.
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=["once upon", "a time"], max_tokens=8, n=2, temperature=0.9,
        seed=7, logprobs=2)
    comp = json.loads(raw.text)
    Completion.model_validate(comp)
    assert [c["index"] for c in comp["choices"]] == [0, 1, 2, 3]
    for c in comp["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 8
        assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])  # chosen + top 2, as vLLM
        assert lp["text_offset"][0] == 0
    assert comp["usage"]["completion_tokens"] == 4 * 8
    streamed = {}
    for ch in client.completions.create(model=MODEL, prompt=["once upon", "a time"],
                                        max_tokens=8, n=2, temperature=0.9, seed=7,
                                        logprobs=2, stream=True):
        # The client's Completion type wants a finish_reason, which a stream's chunks carry
        # as null until the last (OpenAI's own legacy streams too): all else must validate.
        d = ch.model_dump()
        Completion.model_validate({**d, "choices": [
            {**c, "finish_reason": c["finish_reason"] or "length"} for c in d["choices"]]})
        for c in ch.choices:
            streamed.setdefault(c.index, []).append(c)
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in streamed.values():  # seeded: the same samples as the whole answer
        i = c[0].index
        assert "".join(x.text for x in c) == comp["choices"][i]["text"]
        assert sum((x.logprobs.text_offset for x in c if x.logprobs), []) == \
            comp["choices"][i]["logprobs"]["text_offset"]

    # Structured outputs: a json_schema response_format gives JSON the schema holds.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(r.choices[0].message.content) in ({"ok": True}, {"ok": False})
    assert r.model == MODEL and r.id.startswith("chatcmpl-")


def test_errors_have_openais_shape_and_status(client, gateway):
    """An unknown model is a 404 (NotFoundError), a field Vigil does not carry out a 400
    naming it (never dropped in silence), an unknown field too, a bad value a 400, a wrong key
    a 401."""
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, suffix="!")
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()


def test_lm_eval_harness_request_shapes_get_vllms_own_numbers(client, gateway):
    """Given lm-evaluation-harness' `local-completions` shapes, when a loglikelihood request
    (token-id prompt, echo, logprobs 1, max_tokens 1) and a generate_until request (a stop
    string) come, then the echoed prompt's token_logprobs equal what vLLM itself computes for
    those tokens (an AsyncLLM of the test's own), the first null; generation stops at the stop
    string; /tokenizer_info, /tokenize and /detokenize answer as vLLM's do (the model's own
    tokenizer agrees)."""
    ids = requests.post(gateway.url + "/tokenize", headers=gateway.headers(), json={
        "model": MODEL, "prompt": "the quick brown fox"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                  logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    (own,) = direct(MODEL, [{"prompt_token_ids": ids,
                          "sampling": {"max_tokens": 1, "temperature": 0, "logprobs": 1,
                                       "prompt_logprobs": 1}}])
    want = [None] + [next(v for i, v, *_ in pos if i == tid)
                     for tid, pos in zip(ids[1:], own["prompt_logprobs"][1:])]
    got = lp.token_logprobs[:len(ids)]
    assert got[0] is None
    assert all(abs(a - b) <= 1e-5 for a, b in zip(got[1:], want[1:]))
    assert r.choices[0].text.startswith(requests.post(
        gateway.url + "/detokenize", headers=gateway.headers(),
        json={"model": MODEL, "tokens": ids}).json()["prompt"])

    until = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=64,
                                      temperature=0, stop=["e"])
    assert "e" not in until.choices[0].text and until.choices[0].finish_reason in ("stop",
                                                                                   "length")
    info = requests.get(gateway.url + "/tokenizer_info", headers=gateway.headers()).json()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gateway_model_path(gateway))
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == 512
    assert ids == tok("the quick brown fox").input_ids


def gateway_model_path(gateway) -> str:
    models = requests.get(gateway.url + "/v1/models", headers=gateway.headers()).json()
    return next(m["root"] for m in models["data"] if m["id"] == MODEL)


def test_a_raw_stream_carries_event_ids_a_client_can_go_on_from(gateway):
    """Every event of a stream but [DONE] carries `id: <call>/<position>`, the positions
    increasing; a second POST with `Last-Event-ID` set to an event's id gets exactly the events
    after it (the same data), and with the last id nothing but [DONE]."""
    url = gateway.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "a long tale", "max_tokens": 48, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    events = stream_events(url, body, gateway.headers())
    assert events[-1] == (None, "[DONE]")
    ids = [e for e, _ in events[:-1]]
    assert all(ids) and len(set(ids)) == len(ids)
    cut = len(events) // 2
    rest = stream_events(url, body, gateway.headers(**{"Last-Event-ID": ids[cut]}))
    assert rest == events[cut + 1:]
    assert stream_events(url, body, gateway.headers(**{"Last-Event-ID": ids[-1]})) == \
        [(None, "[DONE]")]
    assert assembled(events[:cut + 1]) + assembled(rest) == assembled(events)
