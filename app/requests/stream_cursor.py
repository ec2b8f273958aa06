"""A stream reader's position in a request's token stream (app/state/streams.py): which chunks
a reader that has had `after` tokens gets next, and the tail the result carries after the
stream. What `VigilAsyncResult.stream()` (app/requests/async_result.py) and the online API's
streams (app/online/relay.py) hand out."""
from __future__ import annotations

from app.state.streams import Entry


class _Seq:
    """A reader's view of one sample's tokens in the stream (since its last restart)."""

    def __init__(self):
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.chars = 0


class StreamCursor:
    """A stream reader's position: the chunks it hands out start after token `after` (for a
    request of several samples, `after` counts every sample's tokens, in stream order)."""

    def __init__(self, after: int):
        self.sent = max(0, after)  # the next token offset to hand out (all samples together)
        self.seqs: dict[int, _Seq] = {}
        self.total = 0  # tokens in the stream (since its last restart), all samples
        self.multi = False

    @property
    def tokens(self) -> int:
        return len(self._seq(0).ids)

    def _seq(self, index: int) -> _Seq:
        return self.seqs.setdefault(index, _Seq())

    def take(self, e: Entry) -> dict | None:
        """The part of entry `e` the reader has not had (None: nothing new), for a stream of
        one sample (`take_all` for any stream)."""
        chunks = self.take_all(e)
        return chunks[0] if chunks else None

    def take_all(self, e: Entry) -> list[dict]:
        """The chunks of entry `e` the reader has not had: one per sample with new tokens, each
        with its sample's `index` when the request has several."""
        if e.end:
            return []
        restart = None
        if e.reset:
            self.seqs, self.total = {}, 0
            if self.sent > 0:
                restart = {"offset": 0, "text": "", "token_ids": [], "restart": True}
                self.sent = 0
        self.multi = self.multi or e.parts is not None
        out = []
        at = e.start  # the stream offset (all samples) of the part's first token
        for p in e.sample_parts():
            q = self._seq(p.index)
            q.ids += p.token_ids
            q.texts.append(p.text)
            q.chars += len(p.text)
            end = at + len(p.token_ids)
            if end > self.sent:
                k = max(0, self.sent - at)
                chunk = {"offset": p.start + k, "text": p.text[sum(p.char_counts[:k]):],
                         "token_ids": p.token_ids[k:]}
                if p.logprobs is not None:
                    chunk["logprobs"] = p.logprobs[k:]
                if self.multi:
                    chunk = {"index": p.index, **chunk}
                out.append(chunk)
                self.sent = end
            at = end
        self.total = at
        if restart is not None:  # a restart and its first chunk: one chunk saying both
            if out:
                out[0]["restart"] = True
            else:
                out = [restart]
        return out

    def final(self, result: dict) -> dict:
        """The last chunk of a one-sample stream (`finals` for any stream)."""
        return self.finals(result)[-1]

    def finals(self, result: dict) -> list[dict]:
        """The chunks after the stream: each sample's tokens past it (the last few of a
        request are never streamed: its result carries them), the last one marked `final`
        with the result. A reader that asked for an offset inside that tail gets the tail
        whole (its offset says where it starts): text is not cut by token there. A result that
        does not continue the stream (its run restarted from the prompt and the restart never
        reached the stream) comes whole, as a restart."""
        choices = result.get("choices") if self.multi or result.get("choices") else None
        samples = choices if choices else [result]
        tails = []
        for i, c in enumerate(samples):
            q = self.seqs.get(c.get("index", i), _Seq())
            ids = list(c.get("token_ids") or ())
            text = c.get("text") or ""
            lps = c.get("logprobs")
            if ids[:len(q.ids)] != q.ids or not text.startswith("".join(q.texts)):
                return [self._whole(result, samples)]
            tail = {"offset": len(q.ids), "text": text[q.chars:], "token_ids": ids[len(q.ids):]}
            if lps is not None:
                tail["logprobs"] = lps[len(q.ids):]
            if choices:
                tail = {"index": c.get("index", i), **tail}
            tails.append(tail)
        if not choices and (self.sent >= len(samples[0].get("token_ids") or ()) > self.tokens
                            or self.sent > len(samples[0].get("token_ids") or ())):
            empty = {"offset": len(samples[0].get("token_ids") or ()), "text": "",
                     "token_ids": []}
            if samples[0].get("logprobs") is not None:
                empty["logprobs"] = []
            tails = [empty]
        tails[-1] = {**tails[-1], "final": True, "result": result}
        return tails

    def _whole(self, result: dict, samples: list[dict]) -> dict:
        """The whole result as one final chunk marked `restart` (sample 0's tokens at the top,
        every sample's in the result's `choices`)."""
        first = samples[0]
        chunk = {"offset": 0, "text": first.get("text") or "",
                 "token_ids": list(first.get("token_ids") or ()), "final": True,
                 "restart": True, "result": result}
        if first.get("logprobs") is not None:
            chunk["logprobs"] = first["logprobs"]
        return chunk
