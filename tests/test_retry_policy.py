"""Unit tier: the one retry decision (app/retry_policy.py), a table over every error code.

Every code app/errors.py defines is listed here with what must happen to a request after it:
a new code that is not in the table fails `test_every_error_code_is_in_the_table`, so a new
kind of failure cannot land without a decision."""
from __future__ import annotations

import random
import re

import pytest

from app import errors
from app.errors import RequestError, TerminalError, TransientError, WorkerFatalError
from app.retry_policy import (MEMORY_RETRY_MAX_S, NEVER_RETRIED, RETRIED, RETRY_HERE,
                              RETRY_HERE_PAUSE_S, Attempted, End, Limits, OutagePolicy, Retry,
                              backoff, decide, may_preempt, retry_here, rule_for)
from app.settings import load_settings

LIMITS = Limits(max_attempts=3, memory_pressure_window=300.0, retry_backoff=2.0,
                retry_backoff_max=1000.0)
NOW = 1_000_000.0

# code -> (class, retried?, at once?, uses an attempt?, delay cap); docs/api.md, "Retries".
TABLE = {
    "invalid_request": (RequestError, False, None, None, None),
    "model_not_found": (RequestError, False, None, None, None),
    "prompt_too_long": (RequestError, False, None, None, None),
    "token_out_of_vocab": (RequestError, False, None, None, None),
    "poison_request": (RequestError, False, None, None, None),
    "invalid_model_config": (RequestError, False, None, None, None),
    "lora_adapter_invalid": (RequestError, False, None, None, None),
    "unsupported_version": (RequestError, False, None, None, None),
    "memory_pressure": (TransientError, True, False, False, MEMORY_RETRY_MAX_S),
    "allocation_failed": (TransientError, True, False, True, None),
    "engine_restarting": (TransientError, True, False, True, None),
    "worker_lost": (TransientError, True, True, True, None),
    "wedged": (TransientError, True, True, True, None),
    "redis_unavailable": (TransientError, True, False, True, None),
    "overloaded": (TransientError, True, False, True, None),
    "workers_too_old": (TransientError, True, False, True, None),
    "lora_adapter_pending": (TransientError, True, False, False, None),
    "schema_too_new": (TransientError, True, False, False, None),
    "preempted": (TransientError, True, True, False, None),
    "drained": (TransientError, True, True, False, None),
    "engine_error": (TransientError, True, False, True, None),
    "generation_failed": (TransientError, True, True, True, None),
    "retry_requested": (TransientError, True, False, True, None),
    "structured_output_invalid": (TransientError, True, True, True, None),
    "cuda_context_lost": (WorkerFatalError, True, True, True, None),
    "repeated_engine_death": (WorkerFatalError, True, True, True, None),
    "canary_failed": (WorkerFatalError, True, True, True, None),
    "engine_start_failed": (WorkerFatalError, True, True, True, None),
    "deadline_exceeded": (TerminalError, False, None, None, None),
    "job_deleted": (TerminalError, False, None, None, None),
    "attempts_exhausted": (TerminalError, False, None, None, None),
    "cancelled": (TerminalError, False, None, None, None),
    "batch_cancelled": (TerminalError, False, None, None, None),
    "batch_expired": (TerminalError, False, None, None, None),
    "request_lost": (TerminalError, False, None, None, None),
}


def test_every_error_code_is_in_the_table():
    codes = {v for k, v in vars(errors).items() if k.isupper() and isinstance(v, str)}
    assert codes == set(TABLE), f"codes without a decision: {codes - set(TABLE)}"


def test_the_error_modules_own_table_lists_each_code_under_its_class():
    """app/errors.py's docstring table (class, whose fault, codes) lists every code once, under
    the class this table raises it as; what happens after each is not in it (one table
    decides: app/retry_policy.py). A code added without its row, or under another class, fails
    here."""
    cls, listed = None, {}
    for line in errors.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3:
            continue
        cls = cells[0] or cls
        for word in re.findall(r"[a-z_]+", cells[2]):
            if word in TABLE:
                assert word not in listed, f"{word} listed twice"
                listed[word] = cls
    assert listed == {code: row[0].__name__ for code, row in TABLE.items()}
    assert "retried?" not in errors.__doc__  # no second copy of the decisions


@pytest.mark.parametrize("code", sorted(TABLE))
def test_each_code_gets_its_decision(code):
    cls, retried, at_once, uses_attempt, cap = TABLE[code]
    e = cls.of(code, "x")
    d = decide(e, Attempted(attempts=1, dispatch=5), LIMITS, NOW, random.Random(3))
    if not retried:
        assert d == End(e)
        return
    assert isinstance(d, Retry) and d.uses_attempt is uses_attempt
    assert d.pressure is (code == "memory_pressure")
    rng = random.Random(7)
    delays = [decide(e, Attempted(1, 5), LIMITS, NOW, rng).countdown for _ in range(200)]
    if at_once:
        assert set(delays) == {0.0}
        return
    # The failed attempt drives the backoff when it used one; the next dispatch when it did not.
    bound = 2.0 if uses_attempt else min(cap or 1000.0, 2.0 * 2 ** 5)
    assert all(0 <= x <= bound for x in delays) and max(delays) > bound / 2


@pytest.mark.parametrize("code", [c for c, row in TABLE.items() if row[1] and row[3]])
def test_an_error_that_uses_an_attempt_ends_the_request_when_none_is_left(code):
    e = TABLE[code][0].of(code, "boom")
    assert isinstance(decide(e, Attempted(2, 1), LIMITS, NOW), Retry)
    d = decide(e, Attempted(3, 2), LIMITS, NOW)
    assert isinstance(d, End) and d.error.code == "attempts_exhausted"
    assert str(d.error) == f"attempts_exhausted: 3 attempts used; last error: {code}: boom"


def test_a_broken_structured_output_is_retried_only_when_another_attempt_can_differ():
    """`structured_output_invalid`: a sampled request without a seed is tried again at once
    (another sample may hold to its constraint), using an attempt; a greedy or seeded one, which
    would make the same output again, ends at once with attempts_exhausted saying why."""
    e = TransientError.of("structured_output_invalid", "not strict JSON")
    assert decide(e, Attempted(1, 0), LIMITS, NOW) == Retry(0.0, True)
    d = decide(e, Attempted(1, 0, repeats=True), LIMITS, NOW)
    assert isinstance(d, End) and str(d.error) == (
        "attempts_exhausted: 1 attempt used, and another would make the same output (greedy, or "
        "sampled with a seed); last error: structured_output_invalid: not strict JSON")
    # Only for an error another output mends: a repeating request's other failures still retry.
    assert isinstance(decide(TransientError.of("engine_error", "x"), Attempted(1, 0, repeats=True),
                             LIMITS, NOW), Retry)


def test_an_attempt_given_back_is_bounded_by_time_not_attempts():
    pending = TransientError.of("lora_adapter_pending", "still written")
    assert isinstance(decide(pending, Attempted(99, 99), LIMITS, NOW), Retry)
    squeeze = TransientError.of("memory_pressure", "not enough free memory")
    assert isinstance(decide(squeeze, Attempted(99, 9, pressure_since=NOW - 299), LIMITS, NOW),
                      Retry)
    d = decide(squeeze, Attempted(0, 9, pressure_since=NOW - 300), LIMITS, NOW)
    assert isinstance(d, End) and d.error.code == "attempts_exhausted"
    assert "VIGIL_MEMORY_PRESSURE_WINDOW 300 s" in str(d.error)


def test_a_request_is_preempted_at_most_max_preemptions_times():
    """The preempted row's bound (asked before a run): a request may yield its slot while it
    was preempted fewer than VIGIL_MAX_PREEMPTIONS times, never at or past it; the settings
    carry the bound as Limits does; each preemption itself is retried at once, no attempt
    used (the table above)."""
    assert [may_preempt(n, Limits(max_preemptions=3)) for n in range(5)] == \
        [True, True, True, False, False]
    assert not may_preempt(0, Limits(max_preemptions=0))
    settings = load_settings(max_preemptions=1)
    assert may_preempt(0, settings) and not may_preempt(1, settings)


def test_a_deadline_already_past_ends_a_retryable_error():
    lost = TransientError.of("worker_lost", "reaped")
    assert isinstance(decide(lost, Attempted(1, 0, deadline_at=NOW + 1), LIMITS, NOW), Retry)
    d = decide(lost, Attempted(1, 0, deadline_at=NOW - 1), LIMITS, NOW)
    assert isinstance(d, End) and d.error.code == "deadline_exceeded"


def test_an_error_decided_without_a_known_attempt_backs_off_on_the_dispatch():
    """Redis unreachable mid-delivery: no attempt was counted, nothing can be exhausted."""
    e = TransientError.of("redis_unavailable", "down")
    rng = random.Random(1)
    delays = [decide(e, Attempted(None, 3), LIMITS, NOW, rng).countdown for _ in range(200)]
    assert max(delays) <= 2.0 * 2 ** 3 and max(delays) > 2.0 * 2 ** 2


def test_celerys_autoretry_lists_come_from_the_table():
    assert set(RETRIED) == {TransientError, WorkerFatalError}
    assert set(NEVER_RETRIED) == {RequestError, TerminalError}
    assert rule_for(errors.VigilError("x: y")).retried is False


def test_backoff_is_jittered_and_capped():
    rng = random.Random(1)
    xs = [backoff(a, 2.0, 10.0, rng) for a in range(1, 10) for _ in range(20)]
    assert all(0 <= x <= 10.0 for x in xs) and len(set(xs)) > 100
    assert all(backoff(1, 2.0, 10.0, rng) <= 2.0 for _ in range(50))


def test_the_outage_policy_rides_out_its_grace_in_doubling_pauses():
    p = OutagePolicy(120.0)
    pauses = [p.first_pause()]
    for _ in range(6):
        pauses.append(p.next_pause(pauses[-1]))
    assert pauses == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    kombu = p.kombu()
    assert kombu["max_retries"] == 62 and kombu["interval_max"] == 2.0
    assert OutagePolicy(0).kombu()["max_retries"] == 2


@pytest.mark.parametrize("code", sorted(TABLE))
def test_only_a_retry_vllm_asked_for_is_run_again_here_first(code):
    """`retry_here`: retry_requested re-runs on the worker's own engine RETRY_HERE times, after
    doubling pauses, before it leaves for `decide`; every other code leaves at once."""
    e = TABLE[code][0].of(code, "x")
    pauses = [retry_here(e, n) for n in range(RETRY_HERE + 2)]
    if code != "retry_requested":
        assert pauses == [None] * (RETRY_HERE + 2)
        return
    assert pauses[:RETRY_HERE] == [RETRY_HERE_PAUSE_S * 2 ** n for n in range(RETRY_HERE)]
    assert pauses[RETRY_HERE:] == [None, None]
