"""Resuming a request from the tokens it already generated (docs/api.md, "Resume").

A run that continues a checkpoint (app/state/streams.py) gives the engine the prompt's token ids
followed by the generated ones, with `max_tokens` reduced by their number. The text of such a
run is Vigil's to make, not the engine's: vLLM would decode the new tokens with the whole
checkpoint as its prompt, and a checkpoint that ends inside a character (a token that is half of
a UTF-8 sequence) makes its decoder start over from the prompt's first byte; and it would check
stop strings against the new text only. So the resumed run asks the engine for token ids only
(no stop strings, no detokenizing), and `Seam` here does both, as an uninterrupted vLLM run does
them: a `tokenizers` DecodeStream primed with the prompt and stepped through every generated
token (the checkpoint's, then the new ones), the stop strings checked after each new token over
the whole generated text (a stop string may begin in text the first engine still held back and
end in the new tokens), the text released to readers held back by the longest stop string less
one character, as vLLM holds it back.

`refusal` says when a checkpoint must not be continued (the run restarts from the prompt);
`resumable` which requests a cut and a resume leave as they would have been unbroken.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from app.requests.schemas import GenerateRequest
from app.state.streams import Checkpoint

# A decoder for one request: primed with the prompt's token ids, it returns the text each next
# token adds (None or "" while a character is incomplete), as vLLM's incremental detokenizer.
Decoder = Callable[[int], "str | None"]
DecoderFactory = Callable[[list[int]], Decoder]
# A temperature below this samples greedily (vLLM's sampler: _SAMPLING_EPS).
GREEDY_BELOW = 1e-5


def unsound(req: GenerateRequest, grammar_resumes: bool = True) -> str:
    """Why no checkpoint of `req` may be continued on an engine, whatever it holds ('' when
    one may). Every request kind continues (docs/api.md, "Resume", has the table of every
    field): structured outputs with their grammar advanced over the prefix in EngineCore
    (workers/engine/resume_grammar.py), which needs an engine whose EngineCore builds Vigil's
    logits processors (`grammar_resumes`); penalties and bad words over the whole generation
    (workers/engine/resume_steps.py)."""
    if req.structured is not None and not grammar_resumes:
        return ("structured outputs: this engine's model runs in processes of its own, and "
                "its EngineCore, where the grammar is, does not advance it over the prefix")
    return ""


def grammar_resumes(vllm_config) -> bool:
    """Whether an engine of `vllm_config` advances a continuing run's grammar over its prefix:
    its model runs in EngineCore (vLLM's in-process executor: the layout Vigil asks for on the
    CPU, vLLM's own with one GPU), so EngineCore builds the logits processor that installs
    the hook (workers/engine/resume_steps.py, resume_grammar.py)."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    backend = vllm_config.parallel_config.distributed_executor_backend
    return backend == "uni" or (isinstance(backend, type) and issubclass(backend, UniProcExecutor))


def inexact(req: GenerateRequest) -> str:
    """Why a resumed `req` may not equal the run it would have been unbroken ('' when it
    does): a seeded sampled request is reproducible unbroken, but its continuation is seeded
    again (vLLM's per-request random generator cannot be restored to where the cut left it),
    so its output would depend on where it was cut. Greedy requests (and top_k=1) resume
    exactly; unseeded sampled ones have no reproducible twin to equal, and continue validly."""
    if req.temperature >= GREEDY_BELOW and req.seed is not None and req.top_k != 1:
        return ("seeded sampling: the continuation is seeded again, so the output would depend "
                "on where the run was cut")
    return ""


def resumable(req: GenerateRequest) -> bool:
    """True when `req` may be cut and resumed without changing its result (`inexact` is ''):
    what preemption and drain victim selection asks before choosing a run to stop."""
    return not inexact(req)


def refusal(cp: Checkpoint, *, max_tokens: int, max_model_len: int,
            adapter_fingerprint: str) -> str:
    """Why `cp` must not be continued by a run with these limits ('' when it may)."""
    if cp.prompt_ids is None:
        return "the stream does not hold the prompt's token ids"
    if cp.tokens > max_tokens:
        return f"the stream holds {cp.tokens} tokens, more than max_tokens ({max_tokens})"
    if len(cp.prompt_ids) + cp.tokens >= max_model_len:
        return (f"the prompt ({len(cp.prompt_ids)} tokens) and the {cp.tokens} generated do "
                f"not leave room in this engine's context ({max_model_len})")
    if cp.adapter_fingerprint != adapter_fingerprint:
        return "the LoRA adapter's files changed since its tokens were generated"
    return ""


@dataclass
class Cut:
    """Where a stop string ends the run: keep `tokens` new tokens; the whole generated text is
    `text` (cut where the stop string begins)."""

    tokens: int
    text: str
    stop: str


class Seam:
    """The text of a resumed run, decoded here token by token (module docstring)."""

    def __init__(self, cp: Checkpoint, stops: list[str] | None, decoder: DecoderFactory,
                 include_stop: bool = False, min_tokens: int = 0):
        self._step = decoder(list(cp.prompt_ids or ()))
        # vLLM checks stop strings only in the text of the tokens past `min_tokens`, counted
        # over the whole generation: the checkpoint's tokens count.
        self._made = cp.tokens
        self._min_tokens = min_tokens
        self.text = "".join(self._step(t) or "" for t in cp.token_ids)  # all generated text
        if not self.text.startswith(cp.text):
            raise ValueError("the stream's text is not the decoding of its tokens")
        self.released = len(cp.text)  # characters readers were given
        self._stops = [s for s in stops or () if s]
        # vLLM keeps the stop string (include_stop_str_in_output), and then holds nothing back.
        self._include = include_stop
        self._hold = 0 if include_stop else max((len(s) for s in self._stops), default=1) - 1
        self.new_tokens = 0

    def feed(self, token_ids: list[int], stop_terminated: bool = False) -> tuple[str, Cut | None]:
        """The next generated tokens: returns the text to release with them ('' while it is
        held back) and, when a stop string ends within them, where the run ends.
        `stop_terminated`: the last of them is the stop token (EOS or one of `stop_token_ids`)
        that ended the run; as vLLM's detokenizer, its text is left out unless the request
        includes the stop in its output."""
        last = len(token_ids) - 1
        for i, t in enumerate(token_ids):
            skip = stop_terminated and i == last and not self._include
            piece = "" if skip else (self._step(t) or "")
            old = len(self.text)
            self.text += piece
            self.new_tokens += 1
            if piece and self._stops and self._made + self.new_tokens > self._min_tokens:
                stop = self._stop_in(old)
                if stop is not None:
                    end = stop[0] + (len(stop[1]) if self._include else 0)
                    return "", Cut(self.new_tokens, self.text[:end], stop[1])
        upto = len(self.text) - self._hold
        if upto <= self.released:
            return "", None
        out = self.text[self.released:upto]
        self.released = upto
        return out, None

    def finish(self) -> str:
        """The text not yet released when the run ended without a stop string."""
        out = self.text[self.released:]
        self.released = len(self.text)
        return out

    def _stop_in(self, old_len: int) -> tuple[int, str] | None:
        """The stop string that the last token completed (it ends past `old_len`), and where it
        begins; the one that ends first wins, as vLLM picks."""
        best = None
        for s in self._stops:
            i = self.text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
                best = (i, s)
        return best


def fast_decoder(tokenizer, skip_special_tokens: bool = True) -> DecoderFactory:
    """A DecoderFactory over a Hugging Face fast tokenizer, decoding as vLLM's
    FastIncrementalDetokenizer does (a `tokenizers` DecodeStream primed with the prompt,
    special tokens skipped unless the request keeps them)."""
    from tokenizers.decoders import DecodeStream

    inner = getattr(tokenizer, "_tokenizer", tokenizer)

    def make(prompt_ids: list[int]) -> Decoder:
        stream = DecodeStream(ids=prompt_ids, skip_special_tokens=skip_special_tokens)
        return lambda t: stream.step(inner, t)

    return make


def logprob_decoder(tokenizer):
    """The strings of logprob alternatives, decoded as vLLM 0.32 decodes them when it
    detokenizes (each id alone, then its UTF-8 repair with the chosen tokens before it as
    context: vLLM's own LogprobsProcessor code): (ids, chosen tokens before) -> strings. For a
    resumed run, which vLLM does not detokenize, so its entries read as an unbroken run's."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    proc = LogprobsProcessor(tokenizer=tokenizer, logprobs=None, prompt_logprobs=None,
                             cumulative_logprob=None, num_logprobs=None,
                             num_prompt_logprobs=None)

    def decode(ids: list[int], before: list[int]) -> list[str]:
        return proc._verify_tokens(decoded_tokens_list=convert_ids_list_to_tokens(tokenizer, ids),
                                   tokens=ids, context_token_ids=before[-4:])

    return decode
