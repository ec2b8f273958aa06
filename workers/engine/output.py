"""What every engine the host can run looks like, and what it answers.

An engine exposes `await run(request, request_id[, adapter]) -> EngineOutput`,
`await add_adapter(ref)`, `await remove_adapter(ref)`, `shutdown(timeout)`, `dead`,
`child_pids()`, and optionally `progress` (a step counter, for the stall watchdog) and `kill()`
(for a wedged engine). The host knows nothing else about it (workers/engine/kinds.py lists them).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineOutput:
    """The engine's answer to one request."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    # Token offsets where a run took over from tokens made before it (resume), oldest first.
    resumed_at: list[int] = field(default_factory=list)
