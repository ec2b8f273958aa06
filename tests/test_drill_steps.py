"""Unit tier: the drill's slow steps (workers/engine/drill_steps.py), the logits processor vLLM
loads in EngineCore for `slow_step`: it follows vLLM's batch updates (removed, added, moved,
swapped) and logs each request that leaves with the tokens it made of its max_tokens; it sleeps
its seconds at every step. The e2e (tests/test_abort_ended_e2e.py) runs it in a real engine."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from app.drills import SLOW_STEP_CONFIG_KEY, parse_drill
from workers.engine.drill import slow_step_args
from workers.engine.drill_steps import SlowSteps


def processor(step_s: float = 0.0) -> SlowSteps:
    config = SimpleNamespace(additional_config={SLOW_STEP_CONFIG_KEY: step_s})
    return SlowSteps(config, torch.device("cpu"), False)


def update(removed=(), added=(), moved=()) -> BatchUpdate:
    return BatchUpdate(batch_size=4, removed=list(removed), added=list(added), moved=list(moved))


def test_each_request_leaving_the_batch_is_logged_with_the_tokens_it_made(caplog):
    """Given requests added at indices 0-2 whose outputs grow, moved and swapped as vLLM
    condenses its batch, when they leave, then each departure names that request's own
    tokens and max_tokens."""
    caplog.set_level(logging.WARNING, logger="vllm.vigil_drill")
    p = processor()
    outs = {n: [] for n in (10, 20, 30)}
    p.update_state(update(added=[(i, SamplingParams(max_tokens=n), [1], outs[n])
                                 for i, n in enumerate((10, 20, 30))]))
    outs[10] += [5] * 3
    outs[20] += [5] * 7
    outs[30] += [5] * 30
    p.update_state(update(removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    p.update_state(update(moved=[(0, 1, MoveDirectionality.SWAP)]))  # 30 at 1, 20 at 0
    p.update_state(update(removed=[1]))
    p.update_state(update(removed=[0]))
    assert [r.getMessage() for r in caplog.records] == [
        "DRILL: a request left the engine's batch after 3 of 10 tokens (3 made while in it)",
        "DRILL: a request left the engine's batch after 30 of 30 tokens (30 made while in it)",
        "DRILL: a request left the engine's batch after 7 of 20 tokens (7 made while in it)"]


def test_a_request_whose_slot_is_reused_in_the_same_step_is_logged_too(caplog):
    """vLLM reuses a leaving request's slot for a request added in the same step, or moves the
    last request into it to condense the batch, and then does not list it as removed (its
    BatchUpdateBuilder pops the index): the departure is still logged, with its tokens (EngineCore's count must miss no run: tests/test_tiers_e2e.py
    adds these up)."""
    caplog.set_level(logging.WARNING, logger="vllm.vigil_drill")
    p = processor()
    first, second = [], []
    p.update_state(update(added=[(0, SamplingParams(max_tokens=40), [1], first)]))
    first += [5] * 12
    p.update_state(update(added=[(0, SamplingParams(max_tokens=8), [1], second)]))
    second += [5] * 8
    p.update_state(update(removed=[0]))
    # Condensed: the last request moved into a leaving one's slot, which is not listed.
    third, fourth = [], []
    p.update_state(update(added=[(0, SamplingParams(max_tokens=9), [1], third),
                                 (1, SamplingParams(max_tokens=9), [1], fourth)]))
    third += [5] * 3
    fourth += [5] * 4
    p.update_state(update(moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    p.update_state(update(removed=[0]))
    assert [r.getMessage() for r in caplog.records] == [
        "DRILL: a request left the engine's batch after 12 of 40 tokens (12 made while in it)",
        "DRILL: a request left the engine's batch after 8 of 8 tokens (8 made while in it)",
        "DRILL: a request left the engine's batch after 3 of 9 tokens (3 made while in it)",
        "DRILL: a request left the engine's batch after 4 of 9 tokens (4 made while in it)"]


def test_a_request_back_in_the_batch_counts_only_the_tokens_of_each_stay(caplog):
    """A request vLLM takes out of the batch and puts back (a pause takes every one out) is
    logged at each departure with its tokens so far, and the tokens of that stay: the stays
    add up to what it made."""
    caplog.set_level(logging.WARNING, logger="vllm.vigil_drill")
    p = processor()
    out: list[int] = []
    p.update_state(update(added=[(0, SamplingParams(max_tokens=50), [1], out)]))
    out += [5] * 20
    p.update_state(update(removed=[0]))
    p.update_state(update(added=[(2, SamplingParams(max_tokens=50), [1], out)]))
    out += [5] * 30
    p.update_state(update(removed=[2]))
    assert [r.getMessage() for r in caplog.records] == [
        "DRILL: a request left the engine's batch after 20 of 50 tokens (20 made while in it)",
        "DRILL: a request left the engine's batch after 50 of 50 tokens (30 made while in it)"]


def test_every_step_takes_its_seconds_longer_and_keeps_the_logits():
    """Given slow_step=0.05, then each apply returns the logits untouched, 0.05 s later; the
    drill names the processor and its seconds in the engine args vLLM reads."""
    assert not processor().is_argmax_invariant()  # applied at greedy steps too
    logits = torch.ones(2, 8)
    started = time.monotonic()
    assert processor(0.05).apply(logits) is logits
    assert time.monotonic() - started >= 0.05
    args = slow_step_args(parse_drill("slow_step=0.25").slow_step_s)
    assert args == {"logits_processors": ["workers.engine.drill_steps:SlowSteps"],
                    "additional_config": {SLOW_STEP_CONFIG_KEY: 0.25}}
