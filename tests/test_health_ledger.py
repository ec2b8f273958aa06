"""Redis tier: the health ledger (app/state/health.py) with an injected clock, and beat's health tick.
Only traffic moves the ledger: failures count within the window, a completed generation ends
the streak, heartbeats and probes change nothing."""
from __future__ import annotations

import pytest
import redis

from app.fleet.consumers import enforce_quarantines
from app.state.health import HEALTHY, QUARANTINED, RESTARTING, SUSPECT, HealthLedger
from app.state.store import RequestStore
from app.state.registry import WorkerRegistry
from workers.heartbeat import Heartbeat

pytestmark = pytest.mark.redis
REQUEST_TIMEOUT = 600.0
WINDOW = 3600.0
DAY = 86400.0
T0 = 1_800_000_000.0


@pytest.fixture()
def client(redis_db1_url):
    return redis.Redis.from_url(redis_db1_url)


@pytest.fixture()
def ledger(client):
    return HealthLedger(client, window=WINDOW, threshold=3)


def probe_passes(client, instance, now):
    """What a probe or heartbeat does: rewrite the worker's entry. It must not touch the ledger."""
    Heartbeat(WorkerRegistry(client), instance, "w@host", 10, lambda: {"engine_state": "ready"},
              clock=lambda: now).beat()


def test_trickle_failures_still_condemn(ledger, client):
    """Given one timed-out request per request-timeout window and every probe passing between
    them, then the third failure quarantines the worker, and only that report says so."""
    became = []
    for i in range(3):
        now = T0 + i * REQUEST_TIMEOUT
        probe_passes(client, 7, now + 1)
        state, streak, b = ledger.failure(7, now, f"timeout {i}")
        became.append(b)
        probe_passes(client, 7, now + 2)
    assert (state, streak) == (QUARANTINED, 3) and became == [False, False, True]
    h = ledger.read(7)
    assert h.state == QUARANTINED and h.quarantines == 1 and h.last_failure_reason == "timeout 2"
    assert ledger.failure(7, T0 + 2000, "another")[2] is False  # already quarantined: once


def test_rare_blips_days_apart_never_condemn(ledger):
    """Given a blip a day for ten days (a healthy worker's occasional slow request), then the
    streak never passes 1 and the worker is never quarantined."""
    for day in range(10):
        state, streak, became = ledger.failure(8, T0 + day * DAY, "blip")
        assert (state, streak, became) == (SUSPECT, 1, False)


def test_success_resets_the_streak(ledger, client):
    """Given two failures, when a generation completes, then the streak is over: two more
    failures leave the worker SUSPECT, not quarantined. A heartbeat between is no success."""
    ledger.failure(9, T0, "a")
    probe_passes(client, 9, T0 + 1)
    assert ledger.failure(9, T0 + 2, "b")[:2] == (SUSPECT, 2)
    assert ledger.success(9, T0 + 3) == HEALTHY
    assert ledger.read(9).streak == 0
    ledger.failure(9, T0 + 4, "c")
    assert ledger.failure(9, T0 + 5, "d")[:2] == (SUSPECT, 2)


def test_only_a_canary_brings_a_quarantined_worker_back(ledger):
    for i in range(3):
        ledger.failure(10, T0 + i, "x")
    assert ledger.success(10, T0 + 10) == QUARANTINED  # a stray success is not a canary
    ledger.restarting(10, T0 + 11)
    assert ledger.read(10).state == RESTARTING
    assert ledger.canary(10, T0 + 12, ok=False, reason="no answer") == (QUARANTINED, 1)
    assert ledger.canary(10, T0 + 13, ok=False, reason="no answer") == (QUARANTINED, 2)
    assert ledger.canary(10, T0 + 14, ok=True) == (HEALTHY, 0)
    h = ledger.read(10)
    assert (h.state, h.streak, h.canary_failures) == (HEALTHY, 0, 0)


class Fleet:
    """Beat's view of Celery control: which queues each worker consumes; cancels recorded."""

    def __init__(self, queues):
        self.queues = queues
        self.cancelled = []

    def active(self, name):
        return self.queues.get(name)

    def cancel(self, name, queue):
        self.cancelled.append((name, queue))
        self.queues[name] = [q for q in self.queues[name] if q != queue]


def register(client, instance, name, now):
    Heartbeat(WorkerRegistry(client), instance, name, 10, lambda: {}, clock=lambda: now).beat()


def test_the_health_tick_stops_a_quarantined_worker_that_still_consumes(ledger, client):
    """Given a quarantined worker still consuming its pool queue (its own cancel was lost) and a
    healthy one, then the tick cancels the quarantined worker's pool consumers only, once; a
    second beat's tick at the same moment does nothing."""
    store = RequestStore(client, 3600)
    register(client, 11, "sick@h", T0)
    register(client, 12, "fine@h", T0)
    for i in range(3):
        ledger.failure(11, T0 + i, "timeout")
    fleet = Fleet({"sick@h": ["vigil.housekeeping", "vigil.pool.tiny-llama"],
                   "fine@h": ["vigil.housekeeping", "vigil.pool.tiny-llama"]})
    assert store.try_lock("health_tick", "other-beat", 60)
    assert enforce_quarantines(ledger, store, T0 + 5, fleet.active, fleet.cancel) == 0
    store.unlock("health_tick", "other-beat")
    assert enforce_quarantines(ledger, store, T0 + 5, fleet.active, fleet.cancel) == 1
    assert fleet.cancelled == [("sick@h", "vigil.pool.tiny-llama")]
    assert enforce_quarantines(ledger, store, T0 + 6, fleet.active, fleet.cancel) == 0


def test_the_health_tick_leaves_a_worker_that_passed_its_canary_alone(ledger, client):
    store = RequestStore(client, 3600)
    register(client, 13, "back@h", T0)
    for i in range(3):
        ledger.failure(13, T0 + i, "timeout")
    fleet = Fleet({"back@h": ["vigil.pool.tiny-llama"]})

    def active_then_recovered(name):
        ledger.canary(13, T0 + 10, ok=True)  # the canary passes while the tick asks around
        return fleet.active(name)

    assert enforce_quarantines(ledger, store, T0 + 10, active_then_recovered, fleet.cancel) == 0
    assert fleet.cancelled == []
