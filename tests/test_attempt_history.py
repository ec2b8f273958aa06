"""Redis tier: the request record keeps every attempt (`history`), written by the same Lua scripts
as the status changes (begin, release, requeue, finish), on a real redis-server (database 1,
flushed per test)."""
from __future__ import annotations

import json

import pytest

from app.fleet.deadlines import sweep_deadlines
from app.fleet.reaper import reap_workers
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.state import keys
from app.state.conn import connect
from app.state.lua_records import HISTORY_MAX
from app.state.store import RequestStore
from tests.unit_helpers import NeverTold

pytestmark = pytest.mark.redis
T0 = 1_700_000_000.125  # a current Unix time, exact in binary and within cjson's 14 digits
BIG = 2**62 + 12345  # instance ids are 63 random bits: a float would not keep this one


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def add(store, rid, created=T0, deadline_s=3600.0):
    req = parse_request({"model": "tiny-llama", "prompt": "x", "deadline_s": deadline_s})
    assert store.create(rid, record_fields(req, created, 3600))


def test_a_retried_then_successful_request_keeps_both_attempts(store):
    """Given a request begun by one worker, released for a retry, and begun and finished by
    another, when its history is read, then it holds both attempts in order: who ran each, when,
    and how each ended (the retry with its error's code)."""
    add(store, "r")
    assert store.begin("r", 0, "a@h", BIG, T0, 3).action == "run"
    assert store.release("r", BIG, 1, "engine_restarting: the engine died", now=T0 + 1.5)
    assert store.begin("r", 1, "b@h", 22, T0 + 2.25, 3).action == "run"
    won, _ = store.finish("r", 22, T0 + 3.5, result={"text": "ok"})
    assert won

    h = store.history("r")
    assert h == [
        {"attempt": 1, "dispatch": 0, "worker": "a@h", "instance": str(BIG), "started_at": T0,
         "ended_at": T0 + 1.5, "outcome": "retry", "error": "engine_restarting"},
        {"attempt": 2, "dispatch": 1, "worker": "b@h", "instance": "22", "started_at": T0 + 2.25,
         "ended_at": T0 + 3.5, "outcome": "succeeded", "error": None},
    ]
    times = [t for e in h for t in (e["started_at"], e["ended_at"])]
    assert times == sorted(times) and len(set(times)) == 4
    raw = json.loads(store.raw.hget(keys.request("r"), "history"))
    assert raw[0]["instance"] == str(BIG)  # stored as a string, not a rounded number


def test_an_open_attempt_shows_no_end_while_it_runs(store):
    """Given a request just begun, when its history is read, then its one attempt is open:
    no end, no outcome, no error."""
    add(store, "r")
    store.begin("r", 0, "a@h", 7, T0, 3)
    assert store.history("r") == [
        {"attempt": 1, "dispatch": 0, "worker": "a@h", "instance": "7", "started_at": T0,
         "ended_at": None, "outcome": None, "error": None}]


def test_a_failed_request_closes_its_attempt_with_the_error_code(store):
    """Given a running attempt, when it finishes with a RequestError, then the attempt is closed
    'failed' with the code before the first ':' of the error."""
    add(store, "r")
    store.begin("r", 0, "a@h", 7, T0, 3)
    won, _ = store.finish("r", 7, T0 + 1, error_kind="RequestError",
                          error="prompt_too_long: 900 tokens: over the 512 limit")
    assert won
    (e,) = store.history("r")
    assert (e["outcome"], e["error"], e["ended_at"]) == ("failed", "prompt_too_long", T0 + 1)


def test_the_reaper_closes_a_dead_workers_attempt_as_requeued(store):
    """Given a request running on a worker that stopped heartbeating, when the reaper requeues
    it, then the attempt is closed 'requeued' with worker_lost at the reaper's clock, and the
    next attempt is appended after it."""
    store.raw.hset(keys.worker(5), mapping={"name": "dead@h", "last_seen": T0})
    store.raw.zadd(keys.WORKERS, {"5": T0})
    add(store, "r")
    store.begin("r", 0, "dead@h", 5, T0 + 1, 3)
    published = []
    report = reap_workers(store, T0 + 500, lambda rid, rec, d: published.append((rid, d)),
                          NeverTold(),
                          reap_timeout=60, max_attempts=3)
    assert report == {"dead@h": (1, 0)} and published == [("r", 1)]
    (e,) = store.history("r")
    assert (e["instance"], e["outcome"], e["error"], e["ended_at"]) == (
        "5", "requeued", "worker_lost", T0 + 500)
    store.begin("r", 1, "b@h", 6, T0 + 501, 3)
    assert [(x["attempt"], x["instance"], x["outcome"]) for x in store.history("r")] == [
        (1, "5", "requeued"), (2, "6", None)]


def test_a_losing_duplicate_finish_leaves_the_history_alone(store):
    """Given a request finished once, when a second writer finishes it (another outcome, later),
    then that write loses and the history is exactly as the winner left it."""
    add(store, "r")
    store.begin("r", 0, "a@h", 7, T0, 3)
    assert store.finish("r", 7, T0 + 1, result={"text": "first"})[0]
    before = store.history("r")
    won, stored = store.finish("r", 7, T0 + 9, error_kind="RequestError",
                               error="invalid_request: late")
    assert not won and stored.status == "SUCCEEDED"
    assert store.history("r") == before
    assert before[0]["outcome"] == "succeeded" and before[0]["ended_at"] == T0 + 1


def test_the_winning_finish_closes_its_own_attempt_when_a_copy_was_taken_over(store):
    """Given a copy of the request begun on worker 7 and the same dispatch begun again on worker
    8 (a redelivery), when worker 7 finishes first and worker 8 later, then worker 7's attempt is
    closed 'succeeded', and worker 8's losing result leaves its attempt open (its end unseen)."""
    add(store, "r")
    store.begin("r", 0, "a@h", 7, T0, 3)
    store.begin("r", 0, "b@h", 8, T0 + 1, 3)
    assert store.finish("r", 7, T0 + 2, result={"text": "from 7"})[0]
    assert not store.finish("r", 8, T0 + 3, result={"text": "from 8"})[0]
    assert [(e["instance"], e["outcome"], e["ended_at"]) for e in store.history("r")] == [
        ("7", "succeeded", T0 + 2), ("8", None, None)]


def test_the_sweeper_failing_a_request_that_never_ran_invents_no_attempt(store):
    """Given a PENDING request never begun and one whose only attempt was released for a retry,
    when the deadline sweep fails both, then neither history changes: no attempt was open."""
    add(store, "never", deadline_s=10)
    add(store, "released", deadline_s=10)
    store.begin("released", 0, "a@h", 7, T0 + 1, 3)
    store.release("released", 7, 1, "allocation_failed: out of memory", now=T0 + 2)
    before = store.history("released")
    assert sweep_deadlines(store, T0 + 60, None) == 2
    assert store.get("never")["status"] == "FAILED" and store.history("never") == []
    assert store.get("released")["status"] == "FAILED"
    assert store.history("released") == before
    assert before[0]["outcome"] == "retry" and before[0]["error"] == "allocation_failed"


def test_the_sweeper_failing_a_running_request_closes_its_attempt(store):
    """Given a request running past its deadline, when the deadline sweep fails it, then its
    attempt is closed 'failed' with deadline_exceeded at the sweep's clock."""
    add(store, "r", deadline_s=10)
    store.begin("r", 0, "a@h", 7, T0 + 1, 3)
    assert sweep_deadlines(store, T0 + 60, None) == 1
    (e,) = store.history("r")
    assert (e["instance"], e["outcome"], e["error"], e["ended_at"]) == (
        "7", "failed", "deadline_exceeded", T0 + 60)


def test_the_history_keeps_only_the_newest_attempts(store):
    """Given a request retried more times than the bound (max_attempts set far above it), when
    its history is read, then only the newest HISTORY_MAX attempts remain, in order."""
    assert HISTORY_MAX == 32
    add(store, "r")
    n = HISTORY_MAX + 8
    for i in range(n):
        assert store.begin("r", i, "a@h", 7, T0 + 2 * i, 1000).action == "run"
        assert store.release("r", 7, i + 1, "wedged: no answer", now=T0 + 2 * i + 1)
    h = store.history("r")
    assert len(h) == HISTORY_MAX
    assert [e["attempt"] for e in h] == list(range(n - HISTORY_MAX + 1, n + 1))
    assert [e["dispatch"] for e in h] == list(range(n - HISTORY_MAX, n))
    assert all(e["outcome"] == "retry" and e["error"] == "wedged" for e in h)


def test_release_without_a_clock_stamps_now_and_a_codeless_error_is_unknown(store):
    """Given a running attempt, when it is released without `now` and with an error that has no
    code, then its end is the current time and its error code is 'unknown' (as VigilError.code)."""
    import time

    t = time.time()
    add(store, "r", created=t)
    assert store.begin("r", 0, "a@h", 7, t, 3).action == "run"
    assert store.release("r", 7, 1, "something odd")
    (e,) = store.history("r")
    assert e["error"] == "unknown" and e["outcome"] == "retry"
    assert t - 0.001 <= e["ended_at"] <= time.time() + 0.001


def test_no_record_means_no_history(store):
    """Given no record, when its history is read, then it is empty."""
    assert store.history("nothing") == []
