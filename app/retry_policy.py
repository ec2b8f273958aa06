"""What happens to a request after an error: the one retry decision, and the outage policies.

`decide(error, state, settings, now)` answers `Retry(countdown, uses_attempt, pressure)` (publish
the request again as its next dispatch) or `End(error)` (write the outcome, final). Every place
that asks the question asks it here: the worker's service after a failed attempt
(workers/service.py), the task's one retry path (tasks/base.py: the countdown of an error that
escaped the service undecided, e.g. Redis unreachable mid-delivery), and the hand-back of a
dead or stopping worker's requests (app/fleet/handback.py, which asks `may_drain` for a
stopping one's). Celery's autoretry lists
(tasks/inference.py) are derived from the same table (`RETRIED`, `NEVER_RETRIED`), and the
bound on preemptions is asked here too, before a run (`may_preempt`, workers/service.py).

The table, by class, then by code (docs/api.md, "Retries", shows it to users):

| error | retried? | delay | attempt used? |
| --- | --- | --- | --- |
| RequestError, TerminalError | never | | |
| TransientError (default) | until VIGIL_MAX_ATTEMPTS | jittered backoff on the attempt | yes |
| TransientError wedged, worker_lost, generation_failed | until VIGIL_MAX_ATTEMPTS | at once | yes |
| TransientError retry_requested | re-run here RETRY_HERE times, then until VIGIL_MAX_ATTEMPTS | here: RETRY_HERE_PAUSE_S doubling; then backoff | no here; yes after |
| TransientError lora_adapter_pending | until the deadline | backoff on the dispatch | no |
| TransientError schema_too_new | until the deadline | backoff on the dispatch | no |
| TransientError preempted | VIGIL_MAX_PREEMPTIONS times (`may_preempt`) | at once | no |
| TransientError drained | VIGIL_MAX_DRAINS times (`may_drain`), then as worker_lost | at once | no |
| TransientError memory_pressure | VIGIL_MEMORY_PRESSURE_WINDOW | backoff on the dispatch, <= 15 s | no |
| TransientError structured_output_invalid | until VIGIL_MAX_ATTEMPTS, only if another attempt can differ (not greedy, no seed) | at once | yes |
| WorkerFatalError (any code) | until VIGIL_MAX_ATTEMPTS | at once, elsewhere | yes |

Two bounds are also kept where a delivery is claimed, so that no copy of a request runs past
them, whichever path brought it (a retry, a redelivery, a reaper's or an audit's republish):
the BEGIN script (app/state/lua_records.py), atomically with the claim, does not run a request past
its deadline (`expired`: it ends deadline_exceeded) nor one that has used VIGIL_MAX_ATTEMPTS
attempts (`exhausted`: it ends with `exhausted()`'s error, worded here). `decide` bounds the
retry after a failure; BEGIN is the gate before the next run. The preemption bound works before
a run too: a request is never preempted once it has been VIGIL_MAX_PREEMPTIONS times
(`may_preempt`), so `decide` never sees a preemption past it.

One rule is asked inside the worker, before an error leaves it: `retry_here` says whether the
engine host re-runs a request on its own engine (vLLM asked for a retry: `retry_requested`),
how soon, and how often; only once those re-runs are spent does the error reach `decide`.

The outage policies: how long a reader or writer of Redis rides out an outage before it raises
(`OutagePolicy`, used by app/state/calls.py), the same bound in kombu's terms for a worker's own
publishes (`OutagePolicy.kombu`), and the fail-fast policy of a producer's submit
(`SUBMIT_PUBLISH_RETRY`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from app.errors import (ATTEMPTS_EXHAUSTED, DEADLINE_EXCEEDED, DRAINED, GENERATION_FAILED,
                        LORA_ADAPTER_PENDING, MEMORY_PRESSURE, PREEMPTED, RETRY_REQUESTED,
                        SCHEMA_TOO_NEW, STRUCTURED_OUTPUT_INVALID, WEDGED, WORKER_LOST,
                        RequestError, TerminalError, TransientError, VigilError,
                        WorkerFatalError)
from app.settings_defaults import (DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_DRAINS,
                                   DEFAULT_MAX_PREEMPTIONS,
                                   DEFAULT_MEMORY_PRESSURE_WINDOW_S, DEFAULT_RETRY_BACKOFF_MAX_S,
                                   DEFAULT_RETRY_BACKOFF_S)

# A request waiting for memory (memory_pressure) is tried again at least this often, so it
# starts soon after a co-tenant lets go of the card.
MEMORY_RETRY_MAX_S = 15.0
# A request vLLM asked to be retried (retry_requested) is re-run on the same engine this many
# times, after pauses of RETRY_HERE_PAUSE_S doubling (0.5 + 1 + 2 s: a paused engine resumes, a
# cache refills), before it goes back on its queue like any transient error.
RETRY_HERE = 3
RETRY_HERE_PAUSE_S = 0.5


@dataclass(frozen=True)
class Rule:
    """How one kind of error is handled: `retried` at all; `at_once` (no backoff: another worker
    can take it now); `uses_attempt` (counted against VIGIL_MAX_ATTEMPTS; else the attempt is
    refunded and the request's deadline or window bounds it); `delay_cap` (a tighter cap on
    the backoff); `memory_window` (bounded by VIGIL_MEMORY_PRESSURE_WINDOW from the first
    refusal); `varies` (retried only because another attempt may answer differently: a request
    that makes the same output every time, `Attempted.repeats`, ends at once); `here`
    (re-runs on the worker's own engine before the error leaves it: `retry_here`)."""

    retried: bool
    at_once: bool = False
    uses_attempt: bool = True
    delay_cap: float | None = None
    memory_window: bool = False
    varies: bool = False
    here: int = 0


NEVER = Rule(retried=False)
BACKOFF = Rule(retried=True)
AT_ONCE = Rule(retried=True, at_once=True)

# By class: the default of every code of that class.
CLASS_RULES: dict[type[VigilError], Rule] = {
    RequestError: NEVER,
    TerminalError: NEVER,
    TransientError: BACKOFF,
    WorkerFatalError: AT_ONCE,
}
# By code, where a code differs from its class.
CODE_RULES: dict[str, Rule] = {
    WEDGED: AT_ONCE,
    WORKER_LOST: AT_ONCE,
    # vLLM ended the request with an error of its own, its engine healthy: at once, through
    # the queue, where any worker (another one, if one is free) can take it.
    GENERATION_FAILED: AT_ONCE,
    # vLLM asked for a retry: its engine takes the request again in a moment (`retry_here`);
    # past RETRY_HERE re-runs, as any transient error.
    RETRY_REQUESTED: Rule(retried=True, here=RETRY_HERE),
    LORA_ADAPTER_PENDING: Rule(retried=True, uses_attempt=False),
    # A message of a schema version this worker does not read: handed back, no attempt used,
    # for a worker that reads it; the deadline bounds the wait.
    SCHEMA_TOO_NEW: Rule(retried=True, uses_attempt=False),
    # A bulk request that yielded its slot to an interactive one: back at once, resuming from
    # its stream, no attempt used; VIGIL_MAX_PREEMPTIONS bounds how often (`may_preempt`: a
    # request preempted that often is not preempted again), its deadline still rules.
    PREEMPTED: Rule(retried=True, at_once=True, uses_attempt=False),
    # A request handed back by a worker that stops (SIGTERM), with its tokens: back at once,
    # no attempt used (a scale-in is nobody's fault); VIGIL_MAX_DRAINS bounds how often
    # (`may_drain`: past it the hand-back is worker_lost and uses the attempt), its deadline
    # still rules.
    DRAINED: Rule(retried=True, at_once=True, uses_attempt=False),
    MEMORY_PRESSURE: Rule(retried=True, uses_attempt=False, delay_cap=MEMORY_RETRY_MAX_S,
                          memory_window=True),
    # The engine's output broke the request's structured constraint (an engine backend's bug:
    # xgrammar 0.2.8 lets a control character into a string with maxLength). Another sample may
    # hold to it, so a sampled request is tried again at once, using an attempt; a greedy or
    # seeded one would make the very same output, so it ends at once.
    STRUCTURED_OUTPUT_INVALID: Rule(retried=True, at_once=True, varies=True),
}

# Celery's autoretry lists (tasks/inference.py), derived from the table.
RETRIED: tuple[type[VigilError], ...] = tuple(c for c, r in CLASS_RULES.items() if r.retried)
NEVER_RETRIED: tuple[type[VigilError], ...] = tuple(
    c for c, r in CLASS_RULES.items() if not r.retried)


def rule_for(error: VigilError) -> Rule:
    """The rule of `error`: its code's if the code has one of its own, else its class's (the
    nearest class in the table; a VigilError of no listed class is never retried)."""
    for cls in type(error).__mro__:
        if cls in CLASS_RULES:
            base = CLASS_RULES[cls]
            return CODE_RULES.get(error.code, base) if base.retried else base
    return NEVER


@dataclass(frozen=True)
class Limits:
    """The bounds a decision reads (VigilSettings has all six, and is accepted as they are)."""

    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    memory_pressure_window: float = DEFAULT_MEMORY_PRESSURE_WINDOW_S
    retry_backoff: float = DEFAULT_RETRY_BACKOFF_S
    retry_backoff_max: float = DEFAULT_RETRY_BACKOFF_MAX_S
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS
    max_drains: int = DEFAULT_MAX_DRAINS


@dataclass(frozen=True)
class Attempted:
    """What the request's record says at the failure: the attempts it has counted (None when
    the failure happened before any was known, e.g. Redis unreachable mid-delivery), the
    dispatch that failed, its deadline (0: not checked here), when its memory-pressure wait
    began (None: not waiting), and whether it `repeats`: makes the same output on every attempt
    (greedy, or sampled with a seed)."""

    attempts: int | None
    dispatch: int
    deadline_at: float = 0.0
    pressure_since: float | None = None
    repeats: bool = False


@dataclass(frozen=True)
class Retry:
    """Publish the request again as its next dispatch after `countdown` seconds; the attempt
    stays counted when `uses_attempt`, else it is refunded; `pressure` starts or continues the
    memory-pressure window."""

    countdown: float
    uses_attempt: bool
    pressure: bool = False


@dataclass(frozen=True)
class End:
    """End the request with `error` (final)."""

    error: VigilError


def exhausted(attempts: int, last_error: str) -> TerminalError:
    """The `attempts_exhausted` end of a request that used `attempts` attempts."""
    return TerminalError.of(ATTEMPTS_EXHAUSTED, f"{attempts} attempts used; last error: "
                            f"{last_error}")


def backoff(step: int, base: float, cap: float, rng: random.Random = random) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**(step-1))]."""
    return rng.uniform(0, min(cap, base * (2 ** max(0, step - 1))))


def decide(error: VigilError, state: Attempted, settings: Limits, now: float,
           rng: random.Random = random) -> Retry | End:
    """What happens to a request whose attempt (or delivery) failed with `error`.

    End: an error never retried; a deadline already past (when `state` names one); the attempts
    used up, for an error that uses one; the memory-pressure window over, for a memory wait; a
    request that makes the same output every attempt, for an error only another output mends
    (`attempts_exhausted`, saying so).
    Retry otherwise, at once or after a full-jitter backoff on the failed attempt (on the next
    dispatch number when no attempt counts), capped by the rule's own cap."""
    rule = rule_for(error)
    if not rule.retried:
        return End(error)
    if state.deadline_at and now > state.deadline_at:
        return End(TerminalError.of(DEADLINE_EXCEEDED, f"the deadline passed; last error: "
                                    f"{error}"))
    if rule.varies and state.repeats:
        n = state.attempts or 1
        return End(TerminalError.of(ATTEMPTS_EXHAUSTED, (
            f"{n} attempt{'s' if n != 1 else ''} used, and another would make the same output "
            f"(greedy, or sampled with a seed); last error: {error}")))
    if rule.memory_window:
        since = now if state.pressure_since is None else state.pressure_since
        if now - since >= settings.memory_pressure_window:
            return End(TerminalError.of(ATTEMPTS_EXHAUSTED, (
                f"no engine could start for memory pressure for {now - since:.0f} s "
                f"(VIGIL_MEMORY_PRESSURE_WINDOW {settings.memory_pressure_window:g} s); "
                f"last error: {error}")))
    elif rule.uses_attempt and state.attempts is not None \
            and state.attempts >= settings.max_attempts:
        return End(exhausted(state.attempts, str(error)))
    return Retry(countdown(rule, state, settings, rng), rule.uses_attempt, rule.memory_window)


def retry_here(error: VigilError, reruns: int) -> float | None:
    """Seconds to wait before the engine host re-runs `error`'s request on its own engine,
    which has re-run it `reruns` times already for this; None when it does not (the error
    leaves the worker, to `decide`). Re-runs here use no attempt and publish nothing."""
    rule = rule_for(error)
    if not rule.retried or reruns >= rule.here:
        return None
    return RETRY_HERE_PAUSE_S * (2 ** reruns)


def may_preempt(preemptions: int, settings: Limits) -> bool:
    """Whether a request preempted `preemptions` times may yield its batch seat once more (the
    `preempted` row's bound): only while that is fewer than VIGIL_MAX_PREEMPTIONS. Asked before
    a run (workers/service.py), not after: a request at the bound runs to its end where it is."""
    return preemptions < settings.max_preemptions


def may_drain(drains: int, settings: Limits) -> bool:
    """Whether a request handed back `drains` times by stopping workers may be handed back once
    more without using an attempt (the `drained` row's bound): only while that is fewer than
    VIGIL_MAX_DRAINS. Past it, a stopping worker's hand-back is `worker_lost`, as a dead
    worker's is, and uses the attempt (app/fleet/handback.py)."""
    return drains < settings.max_drains


def countdown(rule: Rule, state: Attempted, settings: Limits,
              rng: random.Random = random) -> float:
    """Seconds before the retry that `rule` makes of a failure in `state` (decide's delay)."""
    if rule.at_once:
        return 0.0
    step = state.attempts if rule.uses_attempt and state.attempts else state.dispatch + 1
    delay = backoff(step, settings.retry_backoff, settings.retry_backoff_max, rng)
    return delay if rule.delay_cap is None else min(rule.delay_cap, delay)


# -- outages of Redis ------------------------------------------------------------------------------
# Pauses between retries of a call while Redis is unreachable: doubling, capped.
OUTAGE_RETRY_FIRST_S = 0.1
OUTAGE_RETRY_MAX_S = 2.0

# A producer's submit fails within seconds when Redis is down instead of hanging (Celery's
# `task_publish_retry_policy`): the caller gets TransientError(redis_unavailable) and retries.
SUBMIT_PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5,
                        "interval_max": 1.0}


@dataclass(frozen=True)
class OutagePolicy:
    """How long a caller rides out an unreachable Redis before it raises: `grace` seconds (0:
    not at all), with doubling pauses from OUTAGE_RETRY_FIRST_S up to OUTAGE_RETRY_MAX_S. Workers
    ride out VIGIL_REDIS_OUTAGE_GRACE (a restart, a failover) so a finished generation is not
    thrown away; producers and operator tools fail at once."""

    grace: float = 0.0

    @classmethod
    def of(cls, settings) -> "OutagePolicy":
        """A worker's policy: VIGIL_REDIS_OUTAGE_GRACE."""
        return cls(settings.redis_outage_grace)

    @staticmethod
    def first_pause() -> float:
        """The pause before the first retry."""
        return OUTAGE_RETRY_FIRST_S

    @staticmethod
    def next_pause(pause: float) -> float:
        """The pause after `pause`: doubled, capped."""
        return min(pause * 2, OUTAGE_RETRY_MAX_S)

    def kombu(self) -> dict:
        """The same bound as kombu's publish retry policy, for a worker's own publishes (a retry,
        a requeue): the record already moved to the next dispatch, so the publish keeps trying
        through a Redis restart instead of leaving the request without a message. Pauses of
        0.2 s growing to 2 s, about `grace` seconds in all."""
        return {"max_retries": max(2, int(self.grace / 2) + 2), "interval_start": 0.2,
                "interval_step": 0.5, "interval_max": 2.0}
