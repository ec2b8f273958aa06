"""Redis tier: a worker's quarantine (workers/quarantine.py) on the real health ledger, with an
injected clock, a scripted engine host and recorded actions: the canary's backoff (2, 4, 8...
seconds, at most 60) and the limit of `VIGIL_MAX_CANARY_FAILURES` (5) failed canaries in a row,
after which the worker leaves (`canary_failed`). The black-hole e2e (tests/test_black_hole_e2e.py)
runs a real worker through the same path with a limit of 1; the schedule and the default limit
are pinned here."""
from __future__ import annotations

import threading

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.errors import CANARY_FAILED, WorkerFatalError
from app.local.embedded import free_port
from app.requests.models import ModelSpec
from app.settings import load_settings
from app.state.health import HEALTHY, QUARANTINED, HealthLedger
from tests.unit_helpers import wait_until
from workers.quarantine import QuarantineActions, WorkerHealth

pytestmark = pytest.mark.redis
T0 = 1_800_000_000.0
SPEC = ModelSpec(name="model-a")
POOLS = ["vigil.pool.model-a"]


class Clock:
    """Wall-clock seconds that only the quarantine's pauses move; each pause is recorded."""

    def __init__(self):
        self.t = T0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.t

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.t += seconds


class ScriptedHost:
    """The engine host's side of a quarantine: each `restart_with_canary` answers the next of
    `canaries` (True: passed); past the script it fails. Records pause/resume."""

    def __init__(self, canaries: list[bool]):
        self.canaries = list(canaries)
        self.restarts = 0
        self.paused = self.resumed = 0

    def pause(self):
        self.paused += 1

    def resume(self):
        self.resumed += 1

    def restart_with_canary(self, spec, timeout):
        self.restarts += 1
        ok = self.canaries.pop(0) if self.canaries else False
        return ok, "" if ok else "the canary generation failed on a fresh engine"


class Actions:
    """Recorded QuarantineActions: what the quarantine did to its worker."""

    def __init__(self):
        self.consumed: list[tuple[list[str], bool]] = []
        self.handed_back = 0
        self.left: list[WorkerFatalError] = []
        self.done = threading.Event()

    def leave(self, err):
        self.left.append(err)
        self.done.set()

    def consume(self, pools, on):
        self.consumed.append((list(pools), on))
        if on:
            self.done.set()

    def hand_back(self):
        self.handed_back += 1
        return 3, 0

    def as_actions(self) -> QuarantineActions:
        return QuarantineActions(pools=lambda: list(POOLS), consume=self.consume,
                                 hand_back=self.hand_back, canary_spec=lambda: SPEC,
                                 leave=self.leave)


@pytest.fixture()
def ledger(redis_db1_url):
    return HealthLedger(redis.Redis.from_url(redis_db1_url), window=3600, threshold=3)


def worker_health(ledger, host, actions, clock, max_canary_failures: int) -> WorkerHealth:
    return WorkerHealth(ledger, 7, "w@host", host, actions.as_actions(), on_change=lambda: None,
                        canary_timeout=30, max_canary_failures=max_canary_failures,
                        clock=clock, pause=clock.pause)


def quarantined_until_done(health: WorkerHealth, actions: Actions, host: ScriptedHost,
                           give_up_after: int = 12) -> None:
    """Three failures proven by traffic (the ledger's threshold) quarantine the worker; wait
    until it left or consumes again. A quarantine that neither leaves nor comes back within
    `give_up_after` restarts is stopped (`close`), so a broken limit fails the test, not hangs."""
    for i in range(3):
        health.failure(f"stall: test {i}")
    wait_until(lambda: actions.done.is_set() or host.restarts >= give_up_after, 10)
    if not actions.done.is_set():
        health.close()


def test_canaries_failing_back_off_and_the_fifth_makes_the_worker_leave(ledger):
    """Given a quarantined worker whose every canary fails, at the default
    VIGIL_MAX_CANARY_FAILURES, then it restarts its engine exactly 5 times, waits 2, 4, 8 and
    16 s between them, and after the fifth failure leaves with canary_failed (its requests were
    handed back at the start; it never consumes again); the ledger counts 5 failed canaries."""
    limit = load_settings().max_canary_failures
    assert limit == 5  # the documented default (docs/failure-modes.md)
    clock, host, actions = Clock(), ScriptedHost([]), Actions()
    health = worker_health(ledger, host, actions, clock, limit)
    quarantined_until_done(health, actions, host)
    assert host.restarts == 5
    assert clock.pauses == [2.0, 4.0, 8.0, 16.0]
    assert len(actions.left) == 1 and actions.left[0].code == CANARY_FAILED
    assert "5 canary generations failed in a row" in str(actions.left[0])
    assert actions.handed_back == 1 and actions.consumed == [(POOLS, False)]
    assert host.paused == 1 and host.resumed == 0
    h = ledger.read(7)
    assert h.state == QUARANTINED and h.canary_failures == 5 and h.quarantines == 1
    assert h.last_failure_at == T0 + 2 + 4 + 8 + 16  # stamped by the injected clock


def test_the_backoff_doubles_up_to_60_s(ledger):
    """Given a limit of 9 failed canaries, then the pauses double from 2 s and stop at 60 s:
    2, 4, 8, 16, 32, 60, 60, 60 (eight pauses between nine restarts)."""
    clock, host, actions = Clock(), ScriptedHost([]), Actions()
    health = worker_health(ledger, host, actions, clock, 9)
    quarantined_until_done(health, actions, host)
    assert host.restarts == 9 and len(actions.left) == 1
    assert clock.pauses == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_a_passing_canary_brings_the_worker_back_and_the_count_starts_over(ledger):
    """Given canaries that fail twice and then pass, then the worker comes back HEALTHY after
    pauses of 2 and 4 s and consumes its pools again; the failures were in a row only: a later
    quarantine whose first canary fails waits 2 s again, and it leaves only after 5 more."""
    clock, host, actions = Clock(), ScriptedHost([False, False, True]), Actions()
    health = worker_health(ledger, host, actions, clock, 5)
    quarantined_until_done(health, actions, host)
    assert clock.pauses == [2.0, 4.0] and host.restarts == 3 and not actions.left
    assert actions.consumed == [(POOLS, False), (POOLS, True)] and host.resumed == 1
    assert health.state == HEALTHY and ledger.read(7).state == HEALTHY
    assert ledger.read(7).canary_failures == 0

    clock.pauses.clear()
    actions.done.clear()
    quarantined_until_done(health, actions, host)
    assert host.restarts == 3 + 5 and clock.pauses == [2.0, 4.0, 8.0, 16.0]
    assert len(actions.left) == 1 and ledger.read(7).quarantines == 2


def test_with_the_ledger_unreachable_the_worker_counts_its_failed_canaries_itself():
    """Given a health ledger whose Redis cannot be reached (every report fails), when the worker
    quarantines itself, then it still backs off 2, 4, 8, 16 s and leaves after its fifth failed
    canary: the limit does not depend on the ledger answering."""
    nowhere = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1,
                          retry=Retry(NoBackoff(), 0))
    dead = HealthLedger(nowhere, window=3600, threshold=3)
    clock, host, actions = Clock(), ScriptedHost([]), Actions()
    health = worker_health(dead, host, actions, clock, 5)
    health.quarantine("stall: the ledger is away")
    wait_until(lambda: actions.done.is_set() or host.restarts >= 12, 30)
    if not actions.done.is_set():
        health.close()
    assert host.restarts == 5 and clock.pauses == [2.0, 4.0, 8.0, 16.0]
    assert len(actions.left) == 1 and actions.left[0].code == CANARY_FAILED
