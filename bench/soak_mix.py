"""The soak's request mix (`python -m bench.soak --mix`, issue 38): every request kind, in every
tier, under kills, drains and preemption.

Each request is one of KINDS (plain; held to a regex longer than any max_tokens, so it runs to
its length; presence, frequency and repetition penalties; bad words; n = 2 sampled samples)
and one of three tiers: interactive, default or bulk. The workers' model gets a small engine
batch (`batch_models_file`: tiny-llama's own registry entry with `max_num_seqs` set), so the
batch runs full of bulk work and an interactive request makes a bulk run yield its slot
(workers/engine/tier_gate.py): a preemption, which resumes it elsewhere from its stream. With
`--greedy` every kind but n = 2 is greedy and its resumed requests are checked against
uninterrupted twins (bench/soak_findings.py `check_twins`).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

KINDS: dict[str, dict] = {
    "plain": {},
    "structured": {"structured": {"regex": "[a-z]{4000}"}},
    "penalized": {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.1},
    "bad_words": {"bad_words": ["river", "stone"]},
    "n2": {"n": 2, "temperature": 1.0},
}
# (tier, share): None is the default tier.
TIERS: list[tuple[str | None, float]] = [("interactive", 0.15), ("bulk", 0.45), (None, 0.40)]
# The engine batch of the mix's workers: small enough for bulk work to fill it.
MIX_BATCH = 8


def pick(rng: random.Random) -> tuple[str, dict]:
    """A request kind and tier: (kind name, the request fields they add)."""
    name = rng.choice(list(KINDS))
    r, tier = rng.random(), None
    for t, share in TIERS:
        if r < share:
            tier = t
            break
        r -= share
    return name, {**KINDS[name], **({"priority": tier} if tier else {})}


def is_twin_checked(kwargs: dict) -> bool:
    """Whether a resumed request's result must equal an uninterrupted rerun: greedy, one
    sample."""
    return kwargs.get("temperature", 1.0) == 0.0 and kwargs.get("n", 1) == 1


def batch_models_file(path: Path, model: str, batch: int, cache_dir: str) -> Path:
    """A VIGIL_MODELS_FILE whose entry for `model` is its registry entry (its weights under
    `cache_dir`) with an engine batch of `batch` sequences (`max_num_seqs`)."""
    from app.requests.models import get_registry

    entry = get_registry().get(model).model_dump(mode="json")
    entry["path"] = str(Path(cache_dir) / "models" / Path(entry["path"]).name)
    entry["engine_args"] = {**entry.get("engine_args", {}), "max_num_seqs": batch}
    path.write_text(json.dumps({"models": [entry]}))
    return path
