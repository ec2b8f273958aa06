"""What the engine may call on a request's token stream writer: the `TokenTap` protocol.

The engine host hands each streamed run its tap (workers/streaming.py `StreamTap` implements
it): the engine's stream watch adds the tokens each step made, the vLLM engine continues a run
from the tap's resume point, and the tier gate reads a preempted run's tokens into it. Nothing
in workers/engine/ calls a tap member not listed here (tests/test_token_streams.py checks that
StreamTap has every one).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from app.state.streams import Checkpoint


@runtime_checkable
class TokenTap(Protocol):
    """One attempt's token stream writer, as the engine sees it."""

    live: bool  # a reader shows its tokens as they come: read after every engine step
    adapter_fingerprint: str  # the LoRA adapter files' fingerprint the tokens are made with
    prompt_ids: list[int] | None  # the prompt's token ids, once the engine told them

    @property
    def resumed_at(self) -> list[int]:
        """Sample 0's takeover offsets: where each run that continued it took over."""

    @property
    def watch_period(self) -> float:
        """How often the stream watch reads this run's new tokens (seconds)."""

    def resumed_at_of(self, index: int) -> list[int]:
        """Sample `index`'s takeover offsets."""

    def resume_point(self) -> Checkpoint | None:
        """Where a run continues: every token made so far (None: from the prompt)."""

    def refuse_resume(self, why: str) -> None:
        """The tokens so far cannot be continued: dropped, the run starts from the prompt."""

    def took_over(self) -> None:
        """This run continues the tokens so far (each sample's offset noted)."""

    def set_prompt(self, prompt_ids: list[int]) -> None:
        """The prompt's token ids, as the engine read them."""

    def add(self, token_ids: list[int], text: str, char_counts: list[int] | None = None, *,
            index: int = 0, logprobs: list[dict] | None = None,
            made_at: float | None = None) -> None:
        """Tokens sample `index` generated and the text released with them."""
