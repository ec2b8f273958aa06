"""A finished request as OpenAI's response bodies (docs/batch.md, "Output lines"): the
`text_completion` of /v1/completions and the `chat.completion` of /v1/chat/completions, one
choice per sample, with logprobs in each endpoint's own shape when the request asked for them.
Checked against the `openai` package's own types (tests/test_batch_format.py)."""
from __future__ import annotations

COMPLETION = "completion"
CHAT = "chat"


def openai_body(request_id: str, kind: str, result: dict, created: int) -> dict:
    """The response body for `result` (a Vigil result dict, docs/api.md) on endpoint `kind`.
    Usage counts every sample's tokens, as OpenAI's does."""
    samples = result.get("choices") or [{**result, "index": 0}]
    choices = [_choice(kind, c) for c in samples]
    completion = sum(len(c.get("token_ids") or ()) for c in samples)
    usage = {"prompt_tokens": result["prompt_tokens"], "completion_tokens": completion,
             "total_tokens": result["prompt_tokens"] + completion}
    obj, prefix = ("chat.completion", "chatcmpl-") if kind == CHAT else ("text_completion",
                                                                         "cmpl-")
    return {"id": prefix + request_id, "object": obj, "created": created,
            "model": result["model"], "choices": choices, "usage": usage}


def _choice(kind: str, c: dict) -> dict:
    entries = c.get("logprobs")
    out: dict = {"index": c.get("index", 0)}
    if kind == CHAT:
        out["message"] = {"role": "assistant", "content": c["text"]}
        out["logprobs"] = chat_logprobs(entries) if entries is not None else None
    else:
        out["text"] = c["text"]
        out["logprobs"] = completion_logprobs(entries) if entries is not None else None
    out["finish_reason"] = c["finish_reason"]
    return out


def _token(e: dict) -> str:
    # A request without detokenizing has no token strings; vLLM then writes "token_id:N".
    return e["token"] if e.get("token") is not None else f"token_id:{e['token_id']}"


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "surrogatepass"))


def chat_logprobs(entries: list[dict]) -> dict:
    """Chat's `choices[i].logprobs`: {"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": None}."""
    return {"content": [{
        "token": _token(e), "logprob": e["logprob"], "bytes": _bytes(_token(e)),
        "top_logprobs": [{"token": _token(t), "logprob": t["logprob"],
                          "bytes": _bytes(_token(t))} for t in e["top"]],
    } for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict]) -> dict:
    """Completions' `choices[i].logprobs`: parallel lists tokens, token_logprobs, top_logprobs
    (one {token: logprob} per token) and text_offset (each token's offset in the text, the
    tokens' lengths added up, as vLLM computes it)."""
    tokens = [_token(e) for e in entries]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_token(t): t["logprob"] for t in e["top"]} for e in entries],
            "text_offset": offsets}
