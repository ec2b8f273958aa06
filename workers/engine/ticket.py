"""The in-flight request: one request's passage through the engine host, kept across engine
restarts (its runs, its outcome, the engine the recovery granted it, its verdict)."""
from __future__ import annotations

from dataclasses import dataclass, field

from app.request_ids import request_id_of, run_id
from app.requests.schemas import GenerateRequest
from app.requests.tiers import engine_priority
from workers.engine.token_tap import TokenTap

# A run that asks at most this many tokens per sample ends within a few engine steps of its
# first: the tier gate may queue batches of them inside vLLM behind their like
# (workers/engine/tier_gate.py, "Short runs").
SHORT_RUN_TOKENS = 16


def is_short(max_tokens: int | None) -> bool:
    """Whether a run of `max_tokens` tokens a sample is short: at most SHORT_RUN_TOKENS (none
    or 0: not short)."""
    return 0 < int(max_tokens or 0) <= SHORT_RUN_TOKENS


@dataclass(eq=False)
class Ticket:
    """One request's passage through the engine host, kept across engine restarts."""

    req: GenerateRequest
    attempt_id: str  # the engine request id of the attempt (app/request_ids.py)
    runs: int = 0
    solo_deaths: int = 0
    reruns_here: int = 0  # runs again on this engine because vLLM asked (retry_policy.retry_here)
    last: str = ""  # outcome of the last run: ok / error / died / cancelled
    in_recovery: bool = False  # owned by the recovery plan (not a fresh suspect)
    granted: object = None  # the engine the recovery handed this ticket for its next run
    verdict: BaseException | None = None  # what to raise instead of running again
    gone: bool = False  # the caller gave up (timeout, drain): never run it again
    adapter: object = None  # the request's LoRA adapter (app.requests.adapters.AdapterRef), if any
    adapter_engine: object = None  # the engine whose adapter use count holds this ticket
    timeout: float = float("inf")  # the longest one run may take inside the engine
    tap: TokenTap | None = None  # the request's token stream writer, if streamed
    # A bulk request that may still yield its batch seat to an interactive one (its record's
    # preemptions are under VIGIL_MAX_PREEMPTIONS), and whether it is yielding now.
    preemptible: bool = False
    preempting: bool = False
    # Its place in the line for the engine's batch seats, (tier, arrival), and the time it has
    # spent there: `gated` seconds before, and since `gate_since` (time.monotonic) while it
    # waits now. Written on the host's loop (workers/engine/tier_gate.py), read by the task
    # thread (workers/engine/pending.py): waiting for a slot is not waiting for an engine.
    place: tuple = ()
    gated: float = 0.0
    gate_since: float | None = None
    # Seated past the engine's batch: its run waits inside vLLM for a slot, its wedge clock
    # (`clock`, the run's asyncio timeout while it runs) not started until the gate hands it
    # a slot (workers/engine/tier_gate.py, "One batch ahead").
    ahead: bool = False
    clock: object = None
    extra: dict = field(default_factory=dict)

    @property
    def bulk(self) -> bool:
        """A bulk request: it may yield its batch seat to an interactive one
        (workers/engine/tier_gate.py)."""
        return getattr(self.req, "priority", None) == "bulk"

    @property
    def tier(self) -> int:
        """Its engine priority (0: the most urgent), the first of its `place`."""
        return self.place[0] if self.place else engine_priority(getattr(self.req, "priority",
                                                                        None))

    @property
    def seqs(self) -> int:
        """The engine's batch seats its run takes: one per sample (vLLM runs each of n samples
        as a request of its own)."""
        return int(getattr(self.req, "n", 1) or 1)

    @property
    def short(self) -> bool:
        """A short run: at most SHORT_RUN_TOKENS tokens per sample (`is_short`)."""
        return is_short(getattr(self.req, "max_tokens", 0))

    @property
    def urgent(self) -> bool:
        """An interactive request: it may make a bulk one yield its slot."""
        return getattr(self.req, "priority", None) == "interactive"

    @property
    def request_id(self) -> str:
        """The Vigil request id this attempt belongs to."""
        return request_id_of(self.attempt_id)

    def engine_request_id(self) -> str:
        """A fresh id per run: an aborted id may linger in the engine's bookkeeping."""
        return run_id(self.attempt_id, self.runs)
