"""What a run continuing a checkpoint tells EngineCore about itself (docs/api.md, "Resume"):
how many of its prompt's last tokens were generated (the checkpoint's), and the penalties
Vigil applies for it there. Carried in vLLM's `SamplingParams.extra_args`, the field vLLM
passes to the engine's logits processors for their own parameters; written by
workers/engine/sampling.py, read in EngineCore by workers/engine/resume_steps.py (penalties,
bad words) and workers/engine/resume_grammar.py (the grammar's state).
"""
from __future__ import annotations

from dataclasses import dataclass

KEY = "vigil_resume"


@dataclass(frozen=True)
class Marks:
    """A continuing run's marks: `made` generated tokens end its prompt; `penalties`
    (presence, frequency, repetition) are Vigil's to apply (vLLM is given none), or None."""

    made: int
    penalties: tuple[float, float, float] | None = None


def extra_args(marks: Marks) -> dict:
    """`marks` as SamplingParams.extra_args (JSON-shaped: vLLM sends them to EngineCore)."""
    inner: dict = {"made": marks.made}
    if marks.penalties is not None:
        inner["penalties"] = list(marks.penalties)
    return {KEY: inner}


def read(extra: dict | None) -> Marks | None:
    """The marks in a request's extra_args, None for a run from the prompt."""
    inner = (extra or {}).get(KEY)
    if not isinstance(inner, dict):
        return None
    pen = inner.get("penalties")
    return Marks(int(inner.get("made", 0)),
                 tuple(float(x) for x in pen) if pen is not None else None)
