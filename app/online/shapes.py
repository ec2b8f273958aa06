"""The online API's answers in the shapes `vllm serve` gives: vLLM's own protocol models
(vllm/entrypoints/openai/*/protocol.py) filled from Vigil's results and stream chunks, dumped as
vLLM dumps them (a whole response with every field; a stream chunk with the fields it set; the
usage chunk without nulls).

Logprobs follow vLLM's formatting (its `_create_completion_logprobs` and `_create_chat_logprobs`):
a position's candidates are the chosen token first, then the top ones by rank; completions list
the first `logprobs` + 1 of them as {token: logprob}, chat the first `top_logprobs`; a prompt
position without logprobs (the first) has the token decoded alone and nulls; -9999.0 stands for
minus infinity. Token strings are vLLM's own decoded tokens, which Vigil's entries carry
(workers/engine/logprobs.py); with `detokenize` false the tokenizer decodes them here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from app.online.fields import CHAT

Decode = Callable[[list[int]], str]


@dataclass
class Format:
    """What formatting a call's answers needs (kept with the call: a reconnect on another
    gateway formats the rest the same way)."""

    kind: str  # fields.COMPLETIONS or fields.CHAT
    call_id: str  # the response id: cmpl-... / chatcmpl-...
    created: int
    model: str  # the id the body named
    n: int = 1
    logprobs: int | None = None  # completions: the top count; chat: top_logprobs (with logprobs)
    named_logprobs: bool = False  # logprob_token_ids: every named id is listed
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)  # per prompt, with echo
    prompt_ids: list[list[int]] = field(default_factory=list)  # per prompt
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    prompt_logprobs: bool = False
    base: str = ""  # the registered model that serves it (the model's own id, or an adapter's base)

    def wire(self) -> dict:
        """JSON-safe form (the call record)."""
        return dict(self.__dict__)

    @classmethod
    def of(cls, raw: dict) -> "Format":
        return cls(**raw)

    def choice(self, prompt: int, sample: int) -> int:
        """The choice index of `sample` of prompt `prompt`: prompt-major, as vLLM orders them."""
        return prompt * self.n + sample


def _candidates(entry: dict) -> list[dict]:
    """A position's candidates in vLLM's dict order: the chosen token, then the top ones."""
    out = [entry]
    seen = {entry["token_id"]}
    for t in entry.get("top") or ():
        if t["token_id"] not in seen:
            seen.add(t["token_id"])
            out.append(t)
    return out


def _text(e: dict, decode: Decode) -> str:
    tok = e.get("token")
    return tok if tok is not None else decode([e["token_id"]])


def completion_logprobs(entries: list, fmt: Format, decode: Decode, offset: int = 0,
                        token_ids: list[int] | None = None):
    """vLLM's CompletionLogProbs for `entries` (None entries: prompt positions without
    logprobs, whose token id comes from `token_ids`), text offsets from `offset`."""
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

    return CompletionLogProbs(**completion_logprobs_json(entries, fmt, decode, offset,
                                                         token_ids))


def chat_logprobs(entries: list, fmt: Format, decode: Decode):
    """vLLM's ChatCompletionLogProbs for `entries`."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionLogProbs

    return ChatCompletionLogProbs.model_validate(chat_logprobs_json(entries, fmt, decode))


def completion_logprobs_json(entries: list, fmt: Format, decode: Decode, offset: int = 0,
                             token_ids: list[int] | None = None) -> dict:
    """`completion_logprobs` as the JSON its model dumps (what the stream's hot path sends)."""
    tokens, lps, tops, offsets = [], [], [], []
    for i, e in enumerate(entries):
        if e is None:  # a prompt position nothing predicts: the token decoded alone
            tok = decode([token_ids[i]]) if token_ids is not None else ""
            tokens.append(tok)
            lps.append(None)
            tops.append(None)
        else:
            tok = _text(e, decode)
            tokens.append(tok)
            lps.append(max(e["logprob"], -9999.0))
            cands = _candidates(e)
            if not fmt.named_logprobs:
                cands = cands[:(fmt.logprobs or 0) + 1]
            tops.append({_text(c, decode): max(c["logprob"], -9999.0) for c in cands})
        offsets.append(offset)
        offset += len(tok)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens,
            "top_logprobs": tops}


def chat_logprobs_json(entries: list, fmt: Format, decode: Decode) -> dict:
    """`chat_logprobs` as the JSON its model dumps (what the stream's hot path sends)."""
    content = []
    for e in entries:
        tok = _text(e, decode)
        cands = _candidates(e)
        if not fmt.named_logprobs:
            cands = cands[:fmt.logprobs or 0]
        content.append({"token": tok, "logprob": max(e["logprob"], -9999.0),
                        "bytes": list(tok.encode("utf-8", errors="replace")),
                        "top_logprobs": [{"token": (t := _text(c, decode)),
                                          "logprob": max(c["logprob"], -9999.0),
                                          "bytes": list(t.encode("utf-8", errors="replace"))}
                                         for c in cands]})
    return {"content": content}


def vllm_prompt_logprobs(entries: list | None, prompt_ids: list[int]) -> list | None:
    """Vigil's prompt logprob entries as vLLM's `prompt_logprobs` ({token id: Logprob} per
    position, the first None)."""
    if entries is None:
        return None
    from vllm.logprobs import Logprob

    out = []
    for tid, e in zip(prompt_ids, entries):
        if e is None:
            out.append(None)
            continue
        d = {}
        for c in _candidates(e):
            d[c["token_id"]] = Logprob(logprob=c["logprob"], rank=c.get("rank"),
                                       decoded_token=c.get("token"))
        out.append(d)
    return out


def usage(prompt_tokens: int, completion_tokens: int):
    """vLLM's UsageInfo."""
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _samples(result: dict) -> list[dict]:
    return result.get("choices") or [{**result, "index": 0}]


def response(fmt: Format, results: list[dict], decode: Decode) -> dict:
    """The whole (not streamed) response body for the results of the call's prompts, in
    order: vLLM's CompletionResponse or ChatCompletionResponse, every field."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for p, result in enumerate(results):
        ids = fmt.prompt_ids[p] if p < len(fmt.prompt_ids) else []
        prompt_tokens += result["prompt_tokens"]
        for s in _samples(result):
            completion_tokens += len(s.get("token_ids") or ())
            choices.append(_choice(fmt, p, s, result, ids, decode))
    cls = _models(fmt.kind)[0]
    extra = {}
    if fmt.kind == CHAT and fmt.prompt_logprobs and results:
        extra["prompt_logprobs"] = vllm_prompt_logprobs(results[0].get("prompt_logprobs"),
                                                        fmt.prompt_ids[0])
    if fmt.kind == CHAT and fmt.return_token_ids and fmt.prompt_ids:
        extra["prompt_token_ids"] = fmt.prompt_ids[0]
    body = cls(id=fmt.call_id, created=fmt.created, model=fmt.model, choices=choices,
               usage=usage(prompt_tokens, completion_tokens), **extra)
    return body.model_dump(mode="json")


def _choice(fmt: Format, p: int, s: dict, result: dict, prompt_ids: list[int], decode: Decode):
    index = fmt.choice(p, s.get("index", 0))
    entries = s.get("logprobs")
    if fmt.kind == CHAT:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseChoice, ChatMessage)

        return ChatCompletionResponseChoice(
            index=index, message=ChatMessage(role="assistant", content=s["text"]),
            logprobs=chat_logprobs(entries, fmt, decode) if fmt.logprobs is not None and
            entries is not None else None,
            finish_reason=s.get("finish_reason"),
            token_ids=list(s.get("token_ids") or ()) if fmt.return_token_ids else None)
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice

    text, ids, lps = s["text"], list(s.get("token_ids") or ()), entries
    if fmt.echo:
        text = fmt.prompt_texts[p] + text
        if lps is not None:
            plp = result.get("prompt_logprobs") or [None] * len(prompt_ids)
            lps = list(plp) + list(lps)
            ids = list(prompt_ids) + ids
    logprobs = None
    if fmt.logprobs is not None and lps is not None:
        logprobs = completion_logprobs(lps, fmt, decode, 0, ids)
    return CompletionResponseChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=s.get("finish_reason"),
        prompt_logprobs=vllm_prompt_logprobs(result.get("prompt_logprobs"), prompt_ids)
        if fmt.prompt_logprobs else None,
        prompt_token_ids=list(prompt_ids) if fmt.return_token_ids else None,
        token_ids=list(s.get("token_ids") or ()) if fmt.return_token_ids else None)


def _models(kind: str):
    if kind == CHAT:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse, ChatCompletionStreamResponse)

        return ChatCompletionResponse, ChatCompletionStreamResponse
    from vllm.entrypoints.openai.completion.protocol import (CompletionResponse,
                                                             CompletionStreamResponse)

    return CompletionResponse, CompletionStreamResponse


class Chunks:
    """A call's stream chunks (data of SSE events), as vLLM's streaming serving shapes them,
    JSON text. Keeps each choice's text offset (completions logprobs count offsets across
    chunks) and tokens so far (continuous usage)."""

    def __init__(self, fmt: Format, decode: Decode):
        self.fmt = fmt
        self.decode = decode
        self.offsets: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self._object = "chat.completion.chunk" if fmt.kind == CHAT else "text_completion"

    def _dump(self, choices: list, usage_info=None) -> str:
        cls = _models(self.fmt.kind)[1]
        chunk = cls(id=self.fmt.call_id, object=self._object, created=self.fmt.created,
                    model=self.fmt.model, choices=choices)
        if usage_info is not None:
            chunk.usage = usage_info
        return chunk.model_dump_json(exclude_unset=True)

    def _usage_so_far(self, p: int, prompt_tokens: int, index: int):
        if not self.fmt.continuous_usage:
            return None
        return usage(prompt_tokens, self.tokens.get(index, 0))

    def opening(self, p: int) -> str | None:
        """The first event of prompt `p`: chat's role delta for each of its choices, or a
        completion's echoed prompt text; None when there is none."""
        if self.fmt.kind == CHAT:
            from vllm.entrypoints.openai.chat_completion.protocol import (
                ChatCompletionResponseStreamChoice, DeltaMessage)

            return self._dump([ChatCompletionResponseStreamChoice(
                index=self.fmt.choice(p, s), delta=DeltaMessage(role="assistant", content=""),
                logprobs=None, finish_reason=None) for s in range(self.fmt.n)])
        if not (self.fmt.echo or self.fmt.return_token_ids):
            return None
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice

        choices = []
        for s in range(self.fmt.n):
            i = self.fmt.choice(p, s)
            text = self.fmt.prompt_texts[p] if self.fmt.echo else ""
            self.offsets[i] = len(text)
            extra = {"prompt_token_ids": self.fmt.prompt_ids[p]} \
                if self.fmt.return_token_ids else {}
            choices.append(CompletionResponseStreamChoice(index=i, text=text, **extra))
        return self._dump(choices)

    def tokens_event(self, p: int, chunk: dict, prompt_tokens: int) -> str:
        """One stream chunk of prompt `p` (a dict of VigilAsyncResult.stream's shape: text,
        token_ids, logprobs, index) as one event: the JSON vLLM's stream choice would dump
        (exclude_unset), built without its models (the hot path: one per token of every
        live stream; tests/test_online_api.py holds it to the models' own dump)."""
        s = chunk.get("index", 0)
        i = self.fmt.choice(p, s)
        self.tokens[i] = self.tokens.get(i, 0) + len(chunk["token_ids"])
        entries = chunk.get("logprobs")
        wants = self.fmt.logprobs is not None and entries is not None
        if self.fmt.kind == CHAT:
            c = {"index": i, "delta": {"content": chunk["text"]},
                 "logprobs": chat_logprobs_json(entries, self.fmt, self.decode) if wants
                 else None, "finish_reason": None}
        else:
            lp = None
            if wants:
                lp = completion_logprobs_json(entries, self.fmt, self.decode,
                                               self.offsets.get(i, 0))
                if lp["tokens"]:
                    self.offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            c = {"index": i, "text": chunk["text"], "logprobs": lp, "finish_reason": None}
        if self.fmt.return_token_ids:
            c["token_ids"] = list(chunk["token_ids"])
        out = {"id": self.fmt.call_id, "object": self._object, "created": self.fmt.created,
               "model": self.fmt.model, "choices": [c]}
        if self.fmt.continuous_usage:
            done = self.tokens.get(i, 0)
            out["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + done,
                            "completion_tokens": done}
        return json.dumps(out, ensure_ascii=False, separators=(",", ":"))

    def finish_event(self, p: int, result: dict, texts: dict[int, str] | None = None) -> str:
        """Prompt `p`'s end: every one of its choices' finish_reason, in one event, with the
        text that came after each choice's last token (`texts` by sample: released at the
        end, held back before for a stop string)."""
        choices = []
        for s in _samples(result):
            index = s.get("index", 0)
            i = self.fmt.choice(p, index)
            text = (texts or {}).get(index, "")
            if self.fmt.kind == CHAT:
                from vllm.entrypoints.openai.chat_completion.protocol import (
                    ChatCompletionResponseStreamChoice, DeltaMessage)

                choices.append(ChatCompletionResponseStreamChoice(
                    index=i, delta=DeltaMessage(content=text) if text else DeltaMessage(),
                    logprobs=None, finish_reason=s.get("finish_reason"), stop_reason=None))
            else:
                from vllm.entrypoints.openai.completion.protocol import (
                    CompletionResponseStreamChoice)

                choices.append(CompletionResponseStreamChoice(
                    index=i, text=text, logprobs=None, finish_reason=s.get("finish_reason"),
                    stop_reason=None))
        return self._dump(choices)

    def usage_event(self, results: list[dict]) -> str:
        """The last chunk with `stream_options.include_usage`: no choices, the call's usage."""
        cls = _models(self.fmt.kind)[1]
        pt = sum(r["prompt_tokens"] for r in results)
        ct = sum(len(s.get("token_ids") or ()) for r in results for s in _samples(r))
        chunk = cls(id=self.fmt.call_id, created=self.fmt.created, model=self.fmt.model,
                    choices=[], usage=usage(pt, ct))
        return chunk.model_dump_json(exclude_unset=False, exclude_none=True)
