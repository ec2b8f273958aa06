"""What every engine the host can run looks like, and what it answers.

An engine exposes `await run(request, request_id[, adapter]) -> EngineOutput`,
`await add_adapter(ref)`, `await remove_adapter(ref)`, `shutdown(timeout)`, `dead`,
`child_pids()`, and optionally `progress` (a step counter, for the stall watchdog) and `kill()`
(for a wedged engine). The host knows nothing else about it (workers/engine/kinds.py lists them).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """One sample of a request (vLLM's CompletionOutput), its logprobs as JSON entries
    (workers/engine/logprobs.py) when the request asked for them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None
    # Token offsets where a run took over from tokens made before it (resume), oldest first.
    resumed_at: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineOutput:
    """The engine's answer to one request: its first sample's fields, and with `n` > 1 every
    sample in `samples` (sample 0 first)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    # Token offsets where a run took over from tokens made before it (resume), oldest first.
    resumed_at: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict | None] | None = None
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def of(cls, samples: list[Sample], prompt_tokens: int,
           prompt_logprobs: list[dict | None] | None = None) -> "EngineOutput":
        """The output of these samples (index order): the first one's fields at the top, and
        all of them in `samples` when there are several."""
        first = samples[0]
        return cls(first.text, first.token_ids, first.finish_reason, prompt_tokens,
                   first.resumed_at, first.logprobs, first.cumulative_logprob, prompt_logprobs,
                   samples if len(samples) > 1 else [])
