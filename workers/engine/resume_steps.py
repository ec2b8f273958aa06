"""A run continuing a checkpoint samples as the unbroken run would have, inside EngineCore
(docs/api.md, "Resume"): a vLLM logits processor that the engine recipe names for every engine
(workers/engine/vllm_args.py), so EngineCore's model runner loads it.

A continuing run's prompt is the request's prompt followed by the tokens generated so far
(resume_marks.Marks.made of them). vLLM counts only the run's own new tokens as generated, so
for such a run this processor does what vLLM would have done with the generated prefix:

- **Presence, frequency and repetition penalties.** The run asks vLLM for none; this
  processor applies the request's with vLLM's own function (`apply_all_penalties`), the
  original prompt as the prompt and the prefix followed by the new tokens as the output, the
  same float32 operations on the same counts as an unbroken run's sampler. It runs after
  vLLM's built-in processors (min_tokens, logit_bias) and before the sampler's own penalties,
  which for this row are the identity (x * 1.0 - 0.0 * n - 0.0 * m): where the unbroken run's
  penalties happen. (Repetition penalty alone would be exact without it, since vLLM penalizes
  prompt tokens too; applied here it takes the same path as the others.)
- **Bad words across the seam.** vLLM bans a bad word's last token when the tokens before it
  end the output; a word whose first tokens end the prefix is caught here, with vLLM's own
  check over the prefix followed by the new tokens (vLLM still bans the words that lie in the
  new tokens: a subset, and a ban twice is one ban).

The grammar of a structured run is vLLM's, before the sampler; its state is advanced over the
prefix by workers/engine/resume_grammar.py, which this processor installs in the process that
builds it.

Imported only by vLLM, by the name the recipe gives (workers/engine/vllm_args.py): vLLM is
imported here at the top, as in workers/engine/drill_steps.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch
from vllm.v1.sample.ops.penalties import apply_all_penalties

from workers.engine import resume_grammar
from workers.engine.resume_marks import read


@dataclass
class _Row:
    """One continuing run in the batch: its prefix, vLLM's live list of its new tokens, and
    what to apply."""

    prefix: list[int]
    output: list[int]  # vLLM's own list: it grows as the run makes tokens
    prompt: list[int]  # the request's prompt, without the prefix
    penalties: tuple[float, float, float] | None
    bad_words: list[list[int]]  # words of two tokens or more (one-token words: vLLM's)

    def apply(self, logits: torch.Tensor, index: int) -> None:
        past = self.prefix + list(self.output)
        if self.bad_words:
            _apply_bad_words_single_batch(logits[index], self.bad_words, past)
        if self.penalties is not None:
            p, f, r = self.penalties
            dev = logits.device
            row = logits[index:index + 1]
            apply_all_penalties(
                row, torch.tensor([self.prompt], dtype=torch.int64, device=dev),
                torch.tensor([p], dtype=torch.float32, device=dev),
                torch.tensor([f], dtype=torch.float32, device=dev),
                torch.tensor([r], dtype=torch.float32, device=dev), [past])


def _row_of(params, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
    """The row state of a request joining the batch; None when there is nothing to do for it
    (a run from the prompt, or a continuing run with no penalties and no long bad word)."""
    marks = read(params.extra_args if params is not None else None)
    if marks is None or prompt_ids is None:
        return None
    words = [w for w in (params.bad_words_token_ids or ()) if len(w) > 1]
    if marks.penalties is None and not words:
        return None
    cut = len(prompt_ids) - marks.made
    return _Row(list(prompt_ids[cut:]), output_ids, list(prompt_ids[:cut]), marks.penalties,
                words)


class ResumedRuns(LogitsProcessor):
    """Penalties and bad words of continuing runs over their whole generation (module
    docstring); nothing for other requests."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self._rows: dict[int, _Row] = {}
        resume_grammar.install()

    def is_argmax_invariant(self) -> bool:
        """False: penalties and bans change the greedy choice, so vLLM applies it at every
        step."""
        return False

    def update_state(self, batch_update) -> None:
        """Follow the batch (vLLM's own bookkeeping for sparse processors)."""
        process_dict_updates(self._rows, batch_update, _row_of)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The continuing runs' rows, in place."""
        for index, row in self._rows.items():
            row.apply(logits, index)
        return logits
