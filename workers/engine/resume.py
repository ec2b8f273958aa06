"""Resuming a request from the tokens it already generated (docs/api.md, "Resume").

A run that continues a checkpoint (app/state/streams.py) gives the engine the prompt's token ids
followed by the generated ones, with `max_tokens` reduced by their number. Two things about the
text need care at the seam, and this module does both:

- **held-back text.** vLLM releases text only past the longest stop string (it might still be
  cut): the stream's text can lag its tokens by a few characters, and a partial UTF-8 character
  is never released. The resumed run decodes those characters again, the same way vLLM does
  (a `tokenizers` DecodeStream primed with the prompt), and releases them first.
- **stop strings across the seam.** The engine checks the continuation's own text only; a stop
  string that begins in the held-back characters and ends in the new ones is found here, token by
  token, as an uninterrupted run finds it: the run ends at the token that completes it, with the
  text cut where the stop string begins.

`refusal` says when a checkpoint must not be continued (the run restarts from the prompt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from app.state.streams import Checkpoint

# A decoder for one request: primed with the prompt's token ids, it returns the text each next
# token adds (None or "" while a character is incomplete), as vLLM's incremental detokenizer.
Decoder = Callable[[int], "str | None"]
DecoderFactory = Callable[[list[int]], Decoder]


def refusal(cp: Checkpoint, *, max_tokens: int, max_model_len: int,
            adapter_fingerprint: str) -> str:
    """Why `cp` must not be continued by a run with these limits ('' when it may)."""
    if cp.prompt_ids is None:
        return "the stream does not hold the prompt's token ids"
    if cp.tokens > max_tokens:
        return f"the stream holds {cp.tokens} tokens, more than max_tokens ({max_tokens})"
    if len(cp.prompt_ids) + max_tokens > max_model_len:
        return (f"the prompt ({len(cp.prompt_ids)} tokens) and max_tokens ({max_tokens}) do "
                f"not fit this engine's context ({max_model_len})")
    if cp.adapter_fingerprint != adapter_fingerprint:
        return "the LoRA adapter's files changed since its tokens were generated"
    return ""


@dataclass
class Cut:
    """A stop string found across the seam: keep `tokens` new tokens; the new text is `text`."""

    tokens: int
    text: str
    stop: str


class Seam:
    """The text of a resumed run: the held-back characters, then the engine's new text, with
    the stop strings that straddle the seam checked here (module docstring)."""

    def __init__(self, cp: Checkpoint, stops: list[str] | None, decoder: DecoderFactory):
        step = decoder(list(cp.prompt_ids or ()))
        full = "".join(step(t) or "" for t in cp.token_ids)
        if not full.startswith(cp.text):
            raise ValueError("the stream's text is not the decoding of its tokens")
        self.held = full[len(cp.text):]
        self._step = step
        self._stops = [s for s in stops or () if s]
        # A stop string that straddles the seam begins in the held-back text, so it ends within
        # longest - 1 characters of new text: past that, the engine's check is the whole check.
        longest = max((len(s) for s in self._stops), default=0)
        self._open = bool(self.held) and longest > 0
        self._window = longest - 1
        self._new = ""  # new text as decoded here (while the seam is open)
        self._new_tokens = 0
        self._released = False
        self._buffered: list[str] = []

    def feed(self, token_ids: list[int], text: str) -> tuple[str | None, Cut | None]:
        """The engine's next output (new tokens and the text it released with them): returns
        the text to release now (None: nothing yet, the seam is still open) and, when a stop
        string across the seam ends within these tokens, where the run ends."""
        if self._open:
            for i, t in enumerate(token_ids):
                piece = self._step(t) or ""
                before = len(self._new)
                self._new += piece
                self._new_tokens += 1
                window = self.held + self._new
                cut = self._straddling(window, len(self.held) + before)
                if cut is not None:
                    return None, Cut(self._new_tokens, window[:cut[0]], cut[1])
                if len(self._new) >= self._window:
                    self._open = False
                    break
            self._buffered.append(text)
            if self._open:
                return None, None
        else:
            self._buffered.append(text)
        out = "".join(self._buffered)
        self._buffered = []
        if not self._released:
            self._released = True
            out = self.held + out
        return out, None

    def finish(self) -> str:
        """The text still unreleased when the engine finished the run (no stop across the
        seam): the held-back characters (if not yet released) and anything buffered."""
        out = "".join(self._buffered)
        self._buffered = []
        if not self._released:
            self._released = True
            out = self.held + out
        return out

    def _straddling(self, window: str, old_len: int) -> tuple[int, str] | None:
        """The stop string (and where it begins) that the last token completed, begun in the
        held-back text; the one that ends first wins, as vLLM picks."""
        best = None
        for s in self._stops:
            i = window.find(s, max(0, old_len - len(s) + 1))
            if 0 <= i < len(self.held) and (best is None or i + len(s) < best[0] + len(best[1])):
                best = (i, s)
        return best


def fast_decoder(tokenizer) -> DecoderFactory:
    """A DecoderFactory over a Hugging Face fast tokenizer, decoding as vLLM's
    FastIncrementalDetokenizer does (a `tokenizers` DecodeStream primed with the prompt,
    special tokens skipped)."""
    from tokenizers.decoders import DecodeStream

    inner = getattr(tokenizer, "_tokenizer", tokenizer)

    def make(prompt_ids: list[int]) -> Decoder:
        stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
        return lambda t: stream.step(inner, t)

    return make
