"""vLLM 0.32's logprobs as Vigil's JSON entries (docs/api.md, "Results").

vLLM gives, per position, a dict token id -> Logprob(logprob, rank, decoded_token): the chosen
token first (its real rank), then the top-k alternatives ranked 1..k (the chosen one merged in
when it is among them), or, with `logprob_token_ids`, the named ids in their order, numbered
1..k by position (not ranked). One entry here is

    {"token_id": 17, "token": " the", "logprob": -0.51, "rank": 1,
     "top": [{"token_id": 17, "token": " the", "logprob": -0.51, "rank": 1}, ...]}

`top` the alternatives in rank order (or the named ids in their order, rank None), the chosen
token included when it is among them. `token` is None when the request does not detokenize. A
logprob that is not finite (a token the model gives no probability) is -9999.0, as OpenAI's
API writes it, so every entry is plain JSON.
"""
from __future__ import annotations

import math
from typing import Callable

NO_PROBABILITY = -9999.0

# Decodes the alternatives of one position: (their token ids, the chosen tokens before it) ->
# their strings. Used where vLLM did not decode them (a resumed run: workers/engine/resume.py).
Decode = Callable[[list[int], list[int]], list[str]]


def _lp(x: float) -> float:
    return float(x) if math.isfinite(x) else NO_PROBABILITY


def entry(chosen: int, position: dict, k: int, named: list[int] | None = None,
          tokens: list[str] | None = None) -> dict:
    """One position's entry from vLLM's dict (module docstring). `k` is the request's top count
    (logprobs or prompt_logprobs); `named` its logprob_token_ids; `tokens`, when given, the
    decoded strings of `position`'s keys in order (overriding vLLM's decoded_token)."""
    items = list(position.items())
    decoded = tokens if tokens is not None else [lp.decoded_token for _, lp in items]
    by_id = {tid: (lp, tok) for (tid, lp), tok in zip(items, decoded)}
    lp, tok = by_id[chosen]
    if named is not None:
        top = [{"token_id": t, "token": by_id[t][1], "logprob": _lp(by_id[t][0].logprob),
                "rank": None} for t in named if t in by_id]
        # vLLM numbers the named ids by position: the chosen one's real rank is lost when it is
        # one of them.
        rank = None if chosen in named else lp.rank
    else:
        alts = items[1:] if len(items) > k else items
        top = sorted(({"token_id": t, "token": by_id[t][1], "logprob": _lp(v.logprob),
                       "rank": v.rank} for t, v in alts), key=lambda e: e["rank"])
        rank = lp.rank
    return {"token_id": chosen, "token": tok, "logprob": _lp(lp.logprob), "rank": rank,
            "top": top}


def sample_entries(token_ids, logprobs, k: int, named: list[int] | None = None,
                   decode: Decode | None = None, context: list[int] | None = None) -> list[dict]:
    """The entries of a sample's generated tokens (vLLM's CompletionOutput.logprobs). With
    `decode`, the tokens are decoded here (vLLM had not: a run without detokenizing), each
    position with the chosen tokens before it (`context`: those of earlier runs, then these)."""
    out, before = [], list(context or ())
    for t, position in zip(token_ids, logprobs):
        strings = decode(list(position), before) if decode is not None else None
        out.append(entry(t, position, k, named, strings))
        before.append(t)
    return out


def prompt_entries(prompt_ids, prompt_logprobs, k: int,
                   decode: Decode | None = None) -> list[dict | None]:
    """The prompt's entries (vLLM's RequestOutput.prompt_logprobs): None for the first token,
    which nothing predicts. With `decode`, decoded here, each position with the prompt tokens
    vLLM gives it as context (those of the positions before it that have an entry)."""
    out: list[dict | None] = []
    for p, (t, position) in enumerate(zip(prompt_ids, prompt_logprobs)):
        if position is None:
            out.append(None)
            continue
        before = [prompt_ids[q] for q in range(p) if prompt_logprobs[q] is not None]
        strings = decode(list(position), before) if decode is not None else None
        out.append(entry(t, position, k, tokens=strings))
    return out


def cumulative(entries: list[dict]) -> float:
    """The sum of the chosen tokens' logprobs, added in order as vLLM adds them."""
    total = 0.0
    for e in entries:
        total += e["logprob"]
    return total
