"""Unit and Redis tiers: the online API's rules (app/online/, app/ops/api_online.py) without a
worker: which body fields are carried out and how they map onto Vigil's request (checked by
Vigil's own schema), the stream positions, vLLM's logprob order, API keys, and the gateway's
answers through the real ASGI app on a real Redis (its submits recorded, not run): 429 with
Retry-After over a job's cap, a key's job and tier, another key's call unreadable, a body over
its bound refused before it is read. The calls on real workers: tests/test_online_api_e2e.py."""
from __future__ import annotations

import pytest

from app.errors import RequestError
from app.online.calls import DONE, Position, parse_event_id, request_ids
from app.online.fields import CHAT, COMPLETIONS, options_of, refuse_unsupported, vigil_kwargs
from app.online.render import Target
from app.online.shapes import Format, chat_logprobs, completion_logprobs
from app.requests.schemas import parse_request

MODEL = "tiny-llama"


def completion(**body):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest.model_validate({"model": MODEL, "prompt": "x", **body})


def chat(**body):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})


@pytest.mark.parametrize("field,value", [("suffix", "!"), ("use_beam_search", True),
                                         ("prompt_embeds", "AAAA"), ("cache_salt", "s"),
                                         ("frobnicate", 1)])
def test_a_field_the_fleet_does_not_carry_out_is_refused_by_name(field, value):
    """vLLM's model would take (or ignore) it: the online API refuses it, `param` naming it."""
    with pytest.raises(RequestError, match="^invalid_request: ") as e:
        refuse_unsupported(completion(**{field: value}), COMPLETIONS)
    assert e.value.param == field


def test_tools_are_refused_and_supported_fields_and_vigils_own_pass():
    with pytest.raises(RequestError) as e:
        refuse_unsupported(chat(tools=[{"type": "function", "function": {"name": "f"}}]), CHAT)
    assert e.value.param == "tools"
    refuse_unsupported(completion(echo=True, logprobs=2, n=2, temperature=0.5, seed=3,
                                  vigil_tier="bulk", vigil_detach=True), COMPLETIONS)
    refuse_unsupported(chat(logprobs=True, top_logprobs=3, continue_final_message=False,
                            chat_template_kwargs={"x": 1}), CHAT)


def test_samplingparams_map_onto_a_request_vigils_schema_accepts():
    """Every carried field of vLLM's SamplingParams lands on the Vigil field of its meaning,
    the result validating as a GenerateRequest: the prompt as token ids, tier, job, live."""
    req = completion(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=4,
                     n=2, stop=["x"], stop_token_ids=[7], presence_penalty=0.5,
                     frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={"5": -3},
                     logprobs=2, min_tokens=1, bad_words=["zz"], ignore_eos=True,
                     response_format={"type": "json_object"})
    params = req.to_sampling_params(9, {})
    opts = options_of(req, {}, key_job=None, max_tier="interactive")
    kw = vigil_kwargs(params, [1, 2, 3], Target(MODEL), opts, live=True)
    assert kw == {"model": MODEL, "prompt_token_ids": [1, 2, 3], "priority": "interactive",
                  "job": "default", "live": True, "n": 2, "temperature": 0.7, "top_p": 0.9,
                  "top_k": 5, "min_p": 0.1, "seed": 4, "presence_penalty": 0.5,
                  "frequency_penalty": 0.2, "repetition_penalty": 1.1, "ignore_eos": True,
                  "max_tokens": 9, "min_tokens": 1, "logprobs": 2,
                  "include_stop_str_in_output": False, "skip_special_tokens": True,
                  "detokenize": True, "stop": ["x"], "stop_token_ids": [7],
                  "bad_words": ["zz"], "logit_bias": {"5": -3.0},
                  "structured": {"json_object": True}}
    assert parse_request(kw).schema_version == 3
    adapter = vigil_kwargs(params, [1], Target(MODEL, "sql-tune"), opts, live=False)
    assert adapter["model"] == MODEL and adapter["lora"] == "sql-tune" and "live" not in adapter


def test_the_tier_is_interactive_unless_said_and_never_above_the_keys():
    req = completion()
    assert options_of(req, {}, key_job=None, max_tier="interactive").tier == "interactive"
    assert options_of(req, {"x-vigil-tier": "bulk"}, key_job=None,
                      max_tier="interactive").tier == "bulk"
    assert options_of(completion(priority=7), {}, key_job=None,
                      max_tier="interactive").tier == "bulk"
    capped = options_of(req, {"x-vigil-job": "mine"}, key_job="team-a", max_tier="default")
    assert (capped.tier, capped.job) == ("default", "team-a")  # the key's job wins
    with pytest.raises(RequestError) as e:
        options_of(completion(vigil_tier="interactive"), {}, key_job=None, max_tier="default")
    assert e.value.param == "vigil_tier"


def test_a_position_round_trips_through_its_event_id():
    p = Position([DONE, 17, -1], usage_sent=False)
    r = parse_event_id(p.encode("cmpl-abc"))
    assert r.call_id == "cmpl-abc" and r.position == p
    p.usage_sent = True
    assert parse_event_id(p.encode("cmpl-abc")).position.usage_sent
    assert parse_event_id("cmpl-abc").position is None  # a call id alone: from the start
    for bad in ("cmpl-abc/x", "cmpl-abc/-2", ""):
        with pytest.raises(RequestError):
            parse_event_id(bad)
    assert request_ids("b", 1) == ["b"] and request_ids("b", 2) == ["b-0", "b-1"]


def entry(tid, tok, lp, rank, top):
    return {"token_id": tid, "token": tok, "logprob": lp, "rank": rank,
            "top": [{"token_id": t, "token": s, "logprob": v, "rank": i + 1}
                    for i, (t, s, v) in enumerate(top)]}


def test_logprobs_list_the_chosen_token_first_then_the_top_ones_as_vllm_does():
    """vLLM's dict of a position: the chosen token, then the top ones by rank; completions
    show the first logprobs + 1, chat the first top_logprobs (so a sampled token off the top
    pushes the last top one out, as in vLLM)."""
    e = entry(9, " c", -3.0, 4, [(1, " a", -0.5), (2, " b", -1.0)])
    fmt = Format(COMPLETIONS, "cmpl-x", 0, MODEL, logprobs=2)
    lp = completion_logprobs([e, entry(1, " a", -0.5, 1, [(1, " a", -0.5)])], fmt, str, 5)
    assert lp.tokens == [" c", " a"] and lp.text_offset == [5, 7]
    assert list(lp.top_logprobs[0]) == [" c", " a", " b"]
    c = chat_logprobs([e], Format(CHAT, "chatcmpl-x", 0, MODEL, logprobs=2), str)
    assert [t.token for t in c.content[0].top_logprobs] == [" c", " a"]
    assert c.content[0].bytes == [32, 99]


def test_a_follower_waits_out_redis_errors_and_misses_nothing():
    """Given a hub whose reads fail twice (Redis away, or its pool busy), when a follower
    follows a request that streamed two chunks and ended, then it retries after its poll and
    yields every chunk and the end: a Redis error delays a stream, never ends it."""
    import asyncio

    from app.errors import REDIS_UNAVAILABLE, TransientError
    from app.online.relay import Ended, follow
    from app.state.store_reads import Outcome
    from app.state.streams import Entry

    class Hub:
        fails = 2

        async def follow(self, rid):
            class Sub:
                queue = asyncio.Queue()
            return Sub()

        async def unfollow(self, sub):
            pass

        async def entries(self, rid, after="0-0"):
            if self.fails:
                self.fails -= 1
                raise TransientError.of(REDIS_UNAVAILABLE, "no connection available")
            es = [Entry("1-0", 0, [5, 6], "ab", [1, 1], 1), Entry("2-0", 2, [7], "c", [1], 1)]
            return [e for e in es if after == "0-0" or e.entry_id > after]

        async def outcome(self, rid):
            return "SUCCEEDED", Outcome("SUCCEEDED", {"text": "abcd", "token_ids": [5, 6, 7, 8],
                                                      "prompt_tokens": 1}, "", "")

    async def run():
        return [x async for x in follow(Hub(), "r", poll_s=0.01)]

    out = asyncio.run(run())
    assert [c["token_ids"] for c in out[:-1]] == [[5, 6], [7], [8]]
    assert "".join(c["text"] for c in out[:-1]) == "abcd"
    assert isinstance(out[-1], Ended) and out[-1].result["text"] == "abcd"


@pytest.mark.parametrize("kind", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("logprobs", [None, 0, 2])
@pytest.mark.parametrize("extras", [{}, {"return_token_ids": True, "continuous_usage": True}])
def test_a_streamed_token_event_is_what_vllms_own_models_dump(kind, logprobs, extras):
    """The stream's hot path builds each token event's JSON itself: it must equal, as JSON,
    what vLLM's own stream response models dump for the same chunk (exclude_unset), logprobs,
    token ids and running usage included, over two chunks (the text offsets go on)."""
    import json as json_

    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, DeltaMessage)
    from vllm.entrypoints.openai.completion.protocol import (CompletionResponseStreamChoice,
                                                             CompletionStreamResponse)

    from app.online.shapes import Chunks, usage

    fmt = Format(kind, "x-1", 7, MODEL, n=2, logprobs=logprobs, **extras)
    chunks = Chunks(fmt, lambda ids: f"<{ids[0]}>")
    lp = [entry(9, " c", -3.0, 4, [(1, " a", -0.5), (2, " b", -1.0)]),
          entry(1, None, float("-inf"), 1, [(1, None, -0.5)])]
    offset, made = 0, 0
    for n, chunk in enumerate([{"index": 1, "text": " cé", "token_ids": [9, 1]},
                               {"index": 1, "text": "!", "token_ids": [1]}]):
        if logprobs is not None:
            chunk["logprobs"] = lp[:len(chunk["token_ids"])]
        got = json_.loads(chunks.tokens_event(0, chunk, 5))
        made += len(chunk["token_ids"])
        wants = logprobs is not None
        if kind == CHAT:
            c = ChatCompletionResponseStreamChoice(
                index=1, delta=DeltaMessage(content=chunk["text"]),
                logprobs=chat_logprobs(chunk["logprobs"], fmt, chunks.decode) if wants
                else None, finish_reason=None)
            model = ChatCompletionStreamResponse(id="x-1", object="chat.completion.chunk",
                                                 created=7, model=MODEL, choices=[c])
        else:
            lps = completion_logprobs(chunk["logprobs"], fmt, chunks.decode, offset) \
                if wants else None
            if lps is not None:
                offset = lps.text_offset[-1] + len(lps.tokens[-1])
            c = CompletionResponseStreamChoice(index=1, text=chunk["text"], logprobs=lps,
                                               finish_reason=None)
            model = CompletionStreamResponse(id="x-1", object="text_completion", created=7,
                                             model=MODEL, choices=[c])
        if extras:
            c.token_ids = list(chunk["token_ids"])
            model.usage = usage(5, made)
        assert got == json_.loads(model.model_dump_json(exclude_unset=True)), n
