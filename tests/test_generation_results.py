"""Unit tier: vLLM's outputs as Vigil's result (issue 31): logprob entries from vLLM's own
Logprob dicts (its shapes built with its own classes), the n samples as `choices` with sample 0
at the top, and fields present only when asked for."""
from __future__ import annotations

import json

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

from app.requests.schemas import GenerateResult, parse_request
from workers.engine.logprobs import NO_PROBABILITY, cumulative, entry
from workers.engine.vllm_output import output_of
from workers.result import build_result

BASE = {"model": "tiny-llama", "prompt_token_ids": [1, 5, 6]}


def lp(x, rank, tok=None):
    return Logprob(logprob=x, rank=rank, decoded_token=tok)


def test_the_chosen_token_outside_the_top_k_keeps_its_rank_and_the_top_k_follow_in_order():
    # vLLM's dict: the chosen token first (real rank 4), then the top 2 ranked 1..2.
    pos = {9: lp(-3.0, 4, "z"), 7: lp(-0.1, 1, "a"), 8: lp(-0.5, 2, "b")}
    e = entry(9, pos, k=2)
    assert (e["token_id"], e["token"], e["logprob"], e["rank"]) == (9, "z", -3.0, 4)
    assert [(t["token_id"], t["rank"]) for t in e["top"]] == [(7, 1), (8, 2)]


def test_the_chosen_token_inside_the_top_k_appears_once_in_rank_order():
    # vLLM inserts the chosen token first; the top-k pass overwrites it in place.
    pos = {8: lp(-0.5, 2, "b"), 7: lp(-0.1, 1, "a"), 6: lp(-0.9, 3, "c")}
    e = entry(8, pos, k=3)
    assert e["rank"] == 2 and [t["token_id"] for t in e["top"]] == [7, 8, 6]
    assert entry(8, {8: lp(-0.5, 2)}, k=0)["top"] == []  # logprobs=0: the chosen token only


def test_named_token_ids_come_in_their_order_without_made_up_ranks():
    pos = {3: lp(-1.0, 5), 11: lp(-2.0, 1), 12: lp(float("-inf"), 2)}
    e = entry(3, pos, k=2, named=[12, 11])
    assert [(t["token_id"], t["rank"]) for t in e["top"]] == [(12, None), (11, None)]
    assert e["rank"] == 5 and e["top"][0]["logprob"] == NO_PROBABILITY  # -inf is not JSON
    assert entry(11, {11: lp(-2.0, 1), 3: lp(-1.0, 2)}, k=2, named=[3, 11])["rank"] is None


def _final(n: int, logprobs: bool, prompt_logprobs: bool) -> RequestOutput:
    outs = []
    for i in reversed(range(n)):  # vLLM's order is not promised: sorted by index here
        ids = [10 + i, 20 + i]
        lps = [{t: lp(-0.25 * (j + 1), 1, f"t{t}")} for j, t in enumerate(ids)] if logprobs \
            else None
        outs.append(CompletionOutput(index=i, text=f"text{i}", token_ids=ids,
                                     cumulative_logprob=-0.75 if logprobs else None,
                                     logprobs=lps, finish_reason="length"))
    plp = [None, {5: lp(-1.5, 3, "p5"), 2: lp(-0.2, 1, "p2")}, {6: lp(-0.4, 1, "p6")}] \
        if prompt_logprobs else None
    return RequestOutput("r", None, [1, 5, 6], plp, outs, True)


def test_an_n_1_result_without_logprobs_is_the_result_it_always_was():
    req = parse_request({**BASE, "max_tokens": 2})
    res = build_result("r", req, output_of(_final(1, False, False), req), 1, "w@h")
    assert set(res) == {"request_id", "model", "text", "token_ids", "finish_reason",
                        "prompt_tokens", "completion_tokens", "attempts", "worker"}
    assert (res["text"], res["token_ids"], res["prompt_tokens"]) == ("text0", [10, 20], 3)


def test_n_samples_are_choices_with_sample_0_at_the_top_and_logprobs_when_asked():
    req = parse_request({**BASE, "max_tokens": 2, "n": 3, "temperature": 0.8, "logprobs": 0,
                         "prompt_logprobs": 1})
    res = build_result("r", req, output_of(_final(3, True, True), req), 2, "w@h")
    GenerateResult.model_validate(res)
    assert [c["index"] for c in res["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in res["choices"]] == [[10, 20], [11, 21], [12, 22]]
    top = {k: v for k, v in res["choices"][0].items() if k != "index"}
    assert all(res[k] == v for k, v in top.items())  # the top level is choice 0
    assert [e["logprob"] for e in res["logprobs"]] == [-0.25, -0.5]
    assert res["cumulative_logprob"] == -0.75 == cumulative(res["logprobs"]) + 0.0
    first, second, third = res["prompt_logprobs"]
    assert first is None and (second["token_id"], second["rank"], second["token"]) == (5, 3, "p5")
    assert [t["token_id"] for t in second["top"]] == [2]
    assert third["top"] == [{"token_id": 6, "token": "p6", "logprob": -0.4, "rank": 1}]
    assert json.loads(json.dumps(res)) == res  # plain JSON, no float that JSON lacks
