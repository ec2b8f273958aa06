"""Redis tier: the deadline sweep as a function of (store, now) on a real redis-server."""
from __future__ import annotations

import threading
import time

import pytest

from app import keys
from app.housekeeping import sweep_deadlines
from app.schemas import parse_request
from app.store import RequestStore, connect
from app.submit import record_fields

pytestmark = pytest.mark.redis
T0 = 1_000_000.0


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def add(store, rid, created=T0, deadline_s=60.0):
    req = parse_request({"model": "tiny-llama", "prompt": "x", "deadline_s": deadline_s})
    assert store.create(rid, record_fields(req, created, 3600))


def test_only_requests_past_their_deadline_are_failed_and_waiters_are_told(store):
    add(store, "late", deadline_s=10)
    add(store, "on-time", deadline_s=1000)
    told = []
    n = sweep_deadlines(store, T0 + 11, lambda rid, err: told.append((rid, str(err))))
    assert n == 1 and [t[0] for t in told] == ["late"]
    assert told[0][1].startswith("deadline_exceeded: ")
    assert store.get("late")["status"] == "FAILED" and store.get("late")["error_kind"] == "TerminalError"
    assert store.get("on-time")["status"] == "PENDING"
    assert store.past_deadline(T0 + 11) == []


def test_the_sweep_reads_in_chunks_and_finishes_a_large_backlog(store):
    for i in range(250):
        add(store, f"r{i}", deadline_s=1)
    told = []
    assert sweep_deadlines(store, T0 + 2, lambda rid, e: told.append(rid), chunk=100) == 250
    assert len(set(told)) == 250


def test_a_result_written_first_wins_over_the_sweep(store):
    add(store, "done", deadline_s=1)
    store.begin("done", 0, "w", 7, T0, 3)
    store.finish("done", 7, T0 + 0.5, result={"text": "ok"})
    assert sweep_deadlines(store, T0 + 5, lambda *a: pytest.fail("notified")) == 0
    assert store.get("done")["status"] == "SUCCEEDED"


def test_a_running_request_past_its_deadline_leaves_its_workers_inflight_set(store):
    add(store, "stuck", deadline_s=1)
    assert store.begin("stuck", 0, "w", 7, T0, 3).action == "run"
    assert sweep_deadlines(store, T0 + 5, lambda *a: None) == 1
    assert not store.r.sismember(keys.inflight(7), "stuck")
    won, stored = store.finish("stuck", 7, T0 + 6, result={"text": "too late"})
    assert not won and stored.status == "FAILED"


def test_two_sweeps_at_once_never_fail_a_request_twice(store):
    """Given two beats sweeping the same backlog concurrently, every request is failed (and its
    waiter told) exactly once."""
    for i in range(300):
        add(store, f"d{i}", deadline_s=1)
    told: list[str] = []
    lock = threading.Lock()

    def note(rid, err):
        with lock:
            told.append(rid)

    def run():
        while store.past_deadline(T0 + 2, 1):
            sweep_deadlines(store, T0 + 2, note, chunk=10)
            time.sleep(0.001)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(told) == 300 and len(set(told)) == 300


def test_a_held_lock_makes_a_second_sweep_do_nothing(store):
    add(store, "x", deadline_s=1)
    assert store.try_lock("deadline_sweep", "other-beat", 30)
    assert sweep_deadlines(store, T0 + 5, lambda *a: None) == 0
    store.unlock("deadline_sweep", "other-beat")
    assert sweep_deadlines(store, T0 + 5, lambda *a: None) == 1
