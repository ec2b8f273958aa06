"""The drill's slow engine steps (`slow_step=<seconds>`, app/drills.py), inside EngineCore.

A vLLM logits processor that the drill engine names in its engine args (`logits_processors`,
with the seconds in vLLM's `additional_config`), so EngineCore's model runner loads it and runs
it at every step that samples, greedy ones too: each such step takes that much longer, as a
large model's would. A request then stays in vLLM, scheduled and holding its KV cache, for as
many slow steps as it makes tokens, and an abort reaches it there (not a sleep in front of the
engine, which vLLM never sees).

It also writes down, in the worker's log (vLLM's logging config), each request that left the
engine's batch and how many of its `max_tokens` it had made: a request vLLM aborted leaves
short of them, one whose abort never reached EngineCore runs to the end. vLLM tells the
processors of a departure at the next step, so the line comes with the next request's first
step; a departure whose slot vLLM fills in the same step (a request added there, or the last
one moved there to condense the batch) is not listed as removed, and is logged as its slot is
reused. A request can leave the batch and come back (vLLM takes every request out while
paused): each line also says the tokens made in that stay, and those add up to EngineCore's own
count of the tokens it generated (tests/test_tiers_e2e.py adds them up).

Imported only by vLLM (in EngineCore, and in the front end to check the name), by the name the
drill engine gives (workers/engine/drill.py `slow_step_args`): no Vigil module imports it, so
vLLM is imported here at the top.
"""
from __future__ import annotations

import logging
import time

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from app.drills import SLOW_STEP_CONFIG_KEY

# Under "vllm": vLLM's logging config (app/logging_setup.py) sends it to the worker's log.
log = logging.getLogger("vllm.vigil_drill")
LEFT_FORMAT = ("DRILL: a request left the engine's batch after %d of %d tokens (%d made while "
               "in it)")


class SlowSteps(LogitsProcessor):
    """Sleeps `step_s` at every sampling step; logs each request that leaves the batch."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        config = vllm_config.additional_config
        self.step_s = float(config.get(SLOW_STEP_CONFIG_KEY, 0.0)) if isinstance(config, dict) else 0.0
        # index -> (max_tokens, vLLM's live output list, its length when the request joined)
        self._batch: dict[int, tuple[int | None, list[int], int]] = {}

    def is_argmax_invariant(self) -> bool:
        """False: vLLM then applies it at every step, greedy ones included."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch (removed, added, moved, in that order, as vLLM asks) and log each
        request that left it with the tokens it had made."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            left = self._batch.pop(index, None)
            if left is not None:
                _left(left)
        for index, params, _prompt, output in batch_update.added:
            replaced = self._batch.get(index)
            if replaced is not None:  # vLLM gave a leaving request's slot to a new one at once:
                _left(replaced)  # not in `removed`
            self._batch[index] = (params.max_tokens if params is not None else None, output,
                                  len(output))
        for a, b, how in batch_update.moved:
            held_a, held_b = self._batch.pop(a, None), self._batch.pop(b, None)
            if held_a is not None:
                self._batch[b] = held_a
            if how == MoveDirectionality.SWAP and held_b is not None:
                self._batch[a] = held_b
            elif held_b is not None:  # condensed into a leaving request's slot (not `removed`)
                _left(held_b)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The slow step: the logits unchanged, `step_s` later."""
        if self.step_s > 0:
            time.sleep(self.step_s)
        return logits


def _left(entry: tuple[int | None, list[int], int]) -> None:
    """Log a departure: the request's tokens, its max_tokens, and the tokens it made in this
    stay (a request vLLM takes out of the batch and back, as a pause does, stays twice: the
    stays' counts add up to what EngineCore made)."""
    most, output, joined = entry
    log.warning(LEFT_FORMAT, len(output), most or 0, len(output) - joined)
