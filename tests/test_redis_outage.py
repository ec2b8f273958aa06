"""Redis tier: the pieces that carry requests through a Redis restart (docs/reliability.md).

A real Redis restart is tests/test_redis_restart_e2e.py; the faults here are the ones a restart
produces only by chance (a reply lost after the script ran, a message lost in the fsync window, a
finished request rolled back to RUNNING), injected on a real Redis server.
"""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import redis
from celery.exceptions import TimeoutError as CeleryTimeoutError

from app.errors import REDIS_UNAVAILABLE, REQUEST_LOST, TerminalError, TransientError
from app.fleet.message_audit import audit_after_restart
from app.fleet.reaper import reap_workers
from app.state import keys
from app.state.conn import connect
from app.state.store import RequestStore
from tests.unit_helpers import Told, wait_until
from tests.test_store_and_service import create

pytestmark = pytest.mark.redis


class Clock:
    """A fake monotonic clock that sleeping advances."""

    def __init__(self):
        self.t, self.slept = 0.0, []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


@pytest.fixture()
def clock():
    return Clock()


@pytest.fixture()
def store(settings, clock):
    """A worker's store: calls ride out an outage of up to 30 (fake) seconds."""
    return RequestStore(connect(settings), settings.result_ttl, 30.0, clock=clock,
                        sleep=clock.sleep)


def flaky(fn, failures: int, after: bool = False):
    """`fn`, failing with ConnectionError its first `failures` calls: before running, or after
    (`after`: the script ran, its reply was lost)."""
    left = [failures]

    def call(*a, **kw):
        if left[0] and not after:
            left[0] -= 1
            raise redis.ConnectionError("Connection refused")
        out = fn(*a, **kw)
        if left[0]:
            left[0] -= 1
            raise redis.ConnectionError("Connection closed by server")
        return out
    return call


def test_a_workers_call_is_retried_through_an_outage_with_growing_pauses(store, clock):
    """Given a worker's store, when Redis refuses three calls in a row, then the call is retried
    after 0.1, 0.2 and 0.4 s and succeeds; nothing is raised."""
    create(store, "r1")
    store._begin = flaky(store._begin, 3)
    assert store.begin("r1", 0, "w@h", 5, time.time(), 3).action == "run"
    assert store.get("r1")["status"] == "RUNNING"
    assert clock.slept == [0.1, 0.2, 0.4]


def test_a_workers_call_gives_up_redis_unavailable_after_the_grace(store, clock):
    """Given Redis away for good, when a worker's store call is made, then it raises
    TransientError(redis_unavailable) once the 30 s grace is spent, with pauses capped at 2 s;
    a producer's store (no grace) raises at once."""
    def down(*a, **kw):
        raise redis.ConnectionError("Connection refused")

    with pytest.raises(TransientError) as e:
        store._call(down)
    assert e.value.code == REDIS_UNAVAILABLE
    assert sum(clock.slept) == pytest.approx(30.0) and max(clock.slept) == 2.0
    producer = RequestStore(store.raw, store.result_ttl)
    with pytest.raises(TransientError):
        producer._call(down)


HANDED_OUT = {  # what a store hands out -> (one read through it, the client command it makes)
    "health ledger": (lambda s: s.health_ledger(window=60, threshold=3).read(1), "hgetall"),
    "batch objects": (lambda s: s.batches().file("f1"), "hgetall"),
    "token streams": (lambda s: s.streams().entries("r1"), "xrange"),
    "worker registry": (lambda s: s.workers.entries(), "zrange"),
}


@pytest.mark.parametrize("made", sorted(HANDED_OUT))
def test_what_a_store_hands_out_rides_out_an_outage_under_its_policy(store, clock, monkeypatch,
                                                                      made):
    """Given a worker's store, when Redis refuses two calls of the health ledger, the batch
    objects, the token streams or the worker registry it hands out, then each is retried after
    0.1 and 0.2 s as the store's own calls are (app/state/calls.py): nothing is raised."""
    read, command = HANDED_OUT[made]
    monkeypatch.setattr(store.raw, command, flaky(getattr(store.raw, command), 2))
    read(store)
    assert clock.slept == [0.1, 0.2]


def test_the_store_without_grace_fails_at_once_on_the_same_client(store, clock, monkeypatch):
    """Given a worker's store, when Redis refuses a registry read made through
    `without_grace()` (the heartbeat's, the engine loop's), then it raises
    TransientError(redis_unavailable) at once, with no pause, on the store's own client."""
    monkeypatch.setattr(store.raw, "zrange", flaky(store.raw.zrange, 1))
    with pytest.raises(TransientError) as e:
        store.without_grace().workers.entries()
    assert e.value.code == REDIS_UNAVAILABLE and clock.slept == []
    assert store.without_grace().raw is store.raw
    producer = RequestStore(store.raw, store.result_ttl)
    assert producer.without_grace() is producer


def test_a_pipeline_cut_mid_execute_is_sent_again_with_its_commands(store):
    """Given a worker's store and a pipeline of two begins (and a read), when the connection is
    lost inside the pipeline's execute (redis-py then empties the pipeline), then the outage
    policy sends it again with its commands: the begins claim their requests and the replies
    are theirs, not the [] an emptied pipeline answers."""
    create(store, "p1")
    create(store, "p2")
    real = redis.client.Pipeline._execute_pipeline
    cut = [1]

    def flaky_execute(self, connection, commands, raise_on_error):
        if cut[0]:
            cut[0] -= 1
            raise redis.ConnectionError("Connection closed by server")
        return real(self, connection, commands, raise_on_error)

    redis.client.Pipeline._execute_pipeline = flaky_execute
    try:
        begins = store.begin_many([("p1", 0), ("p2", 0)], "w@h", 9, time.time(), 3)
    finally:
        redis.client.Pipeline._execute_pipeline = real
    assert cut == [0] and [b.action for b in begins] == ["run", "run"]
    assert {store.get(r)["status"] for r in ("p1", "p2")} == {"RUNNING"}


def test_a_claim_whose_reply_was_lost_is_the_same_claim_when_retried(store):
    """Given BEGIN ran but its reply was lost, when the worker retries it, then it gets its own
    run back: one attempt counted, one open attempt in history, not a second run."""
    create(store, "r1")
    store._begin = flaky(store._begin, 1, after=True)
    b = store.begin("r1", 0, "w1", 11, time.time(), 3)
    assert b.action == "run" and b.attempts == 1
    assert store.get("r1")["attempts"] == "1"
    assert len(store.history("r1")) == 1


def test_a_release_whose_reply_was_lost_still_says_released(store):
    """Given RELEASE (a retry handed back) ran but its reply was lost, when the worker retries
    it, then it is told it released the request (so it publishes the retry) instead of 'not
    yours any more', which would leave the request with no message."""
    create(store, "r1")
    store.begin("r1", 0, "w1", 11, time.time(), 3)
    store._release = flaky(store._release, 1, after=True)
    assert store.release("r1", 11, 1, "wedged: test")
    rec = store.get("r1")
    assert rec["status"] == "PENDING" and rec["dispatch"] == "1"


def test_a_copy_of_a_live_run_is_busy_not_run_twice(store):
    """Given a request running on a live worker, when the same dispatch is delivered again (to
    that worker after kombu restored its unacked messages, or to another one), then it is
    'busy' and dropped, and the other worker does not keep it in its in-flight set; once its
    owner is dead (silent past the window), the copy runs."""
    now = time.time()
    create(store, "r1")
    store.raw.zadd(keys.WORKERS, {"11": now})
    assert store.begin("r1", 0, "w1", 11, now, 3, live_window=30).action == "run"
    assert store.begin("r1", 0, "w1", 11, now, 3, live_window=30).action == "busy"
    store.raw.sadd(keys.inflight(22), "r1")  # task_received on the other worker
    assert store.begin("r1", 0, "w2", 22, now, 3, live_window=30).action == "busy"
    assert not store.raw.sismember(keys.inflight(22), "r1")
    assert store.get("r1")["attempts"] == "1"
    b = store.begin("r1", 0, "w2", 22, now + 60, 3, live_window=30)
    assert b.action == "run" and b.attempts == 2


class Published(list):
    def __call__(self, rid, rec, dispatch):
        self.append((rid, dispatch))


def _message(rid: str) -> str:
    return json.dumps({"body": "", "headers": {"id": rid, "task": "vigil.generate"}})


def test_after_a_restart_only_requests_whose_message_is_gone_are_published_again(store):
    """Given, after a Redis restart, open requests from before it: one with no message anywhere,
    one fetched by a consumer that is gone (only in kombu's unacked hash, held by no worker), one
    queued, one held by a worker, one running, and one submitted after the restart, when the
    audit runs, then the first two are moved to their next dispatch and published again, and a
    second audit (same Redis run) does nothing."""
    # Redis reports its uptime in whole seconds: let it be up long enough for "after" to be
    # unmistakably after its start.
    wait_until(lambda: time.time() - store.redis_run()[1] >= 2, 5)
    _, started = store.redis_run()
    before = started - 30
    for rid in ("lost", "queued", "fetched", "held", "running"):
        create(store, rid, now=before)
    create(store, "after", now=time.time())
    store.raw.lpush("vigil.pool.tiny-llama", _message("queued"))
    store.raw.hset("unacked", "tag-1", json.dumps([json.loads(_message("fetched")), "", "x"]))
    store.raw.sadd(keys.inflight(7), "held")
    store.begin("running", 0, "w", 8, time.time(), 3)
    published = Published()
    try:
        assert audit_after_restart(store, time.time(), published) == 2
        assert sorted(published) == [("fetched", 1), ("lost", 1)]
        rec = store.get("lost")
        assert rec["status"] == "PENDING" and rec["dispatch"] == "1"
        assert rec["last_error"].startswith("redis_unavailable")
        assert store.raw.get(keys.REDIS_RUN_ID) is not None
        assert audit_after_restart(store, time.time(), published) is None
        assert len(published) == 2
    finally:
        store.raw.delete("vigil.pool.tiny-llama", "unacked")


def test_the_reaper_counts_silence_only_from_when_redis_started(store):
    """Given a worker whose last heartbeat is long past the reap timeout, when Redis started only
    5 s ago (no heartbeat could land before), then the reaper leaves it; counted from an old
    start, it is reaped."""
    now = time.time()
    store.raw.hset(keys.worker(1), mapping={"name": "w@h", "last_seen": now - 600})
    store.raw.zadd(keys.WORKERS, {"1": now - 600})
    published, failed = Published(), Told()
    args = dict(reap_timeout=120, max_attempts=3)
    assert reap_workers(store, now, published, failed,
                        redis_started_at=now - 5, **args) == {}
    assert reap_workers(store, now, published, failed,
                        redis_started_at=now - 3600, **args) == {"w@h": (0, 0)}


def test_get_answers_from_the_record_or_says_request_lost(monkeypatch):
    """Given a request whose record ended but whose result never reached the result backend, and
    one Redis has no record of, when a producer waits with get(), then the first returns the
    record's result and the second raises TerminalError request_lost, both within seconds
    instead of waiting out the timeout."""
    from app import app
    from app.requests import async_result

    monkeypatch.setattr(async_result, "RECORD_CHECK_S", 0.2)
    store = RequestStore(app.vigil_store.raw, 60)
    rid = f"outage-{uuid.uuid4()}"
    create(store, rid)
    store.begin(rid, 0, "w", 99, time.time(), 3)
    store.finish(rid, 99, time.time(), result={"request_id": rid, "text": "from the record"})
    started = time.monotonic()
    assert app.AsyncResult(rid).get(timeout=30)["text"] == "from the record"
    with pytest.raises(TerminalError) as e:
        app.AsyncResult(f"never-{uuid.uuid4()}").get(timeout=30)
    assert e.value.code == REQUEST_LOST
    assert time.monotonic() - started < 25


class FlakyClient:
    """Just enough of a Redis client for Heartbeat: pipelines that fail while `down`, and a
    run_id that changes when Redis 'restarts'."""

    def __init__(self):
        self.down, self.run_id = False, "a"

    def pipeline(self, transaction=True):
        client = self

        class Pipe:
            def __getattr__(self, name):
                return lambda *a, **kw: None

            def execute(self):
                if client.down:
                    raise redis.ConnectionError("Connection refused")

        return Pipe()

    def info(self, section):
        return {"run_id": self.run_id}


def test_the_heartbeat_calls_back_when_redis_returns_or_restarted():
    """Given a heartbeat, when its writes fail and then succeed again, and later Redis' run_id
    changes without a failed write, then it calls on_redis_back once for each."""
    from app.state.registry import WorkerRegistry
    from workers.heartbeat import Heartbeat

    calls = []
    client = FlakyClient()
    hb = Heartbeat(WorkerRegistry(client), 1, "w", 0.01, dict,
                   on_redis_back=lambda: calls.append(1))
    hb.start()
    try:
        wait_until(lambda: hb._run_id == "a")
        client.down = True
        wait_until(lambda: hb._failed)
        client.down = False
        wait_until(lambda: len(calls) == 1)
        client.run_id = "b"
        wait_until(lambda: len(calls) == 2)
    finally:
        hb.stop(unregister=False)
    assert threading.active_count() >= 1


def test_a_worker_hands_back_what_its_set_lists_but_it_does_not_hold(settings, monkeypatch):
    """Given a worker whose in-flight set names a request RUNNING under it that it does not run
    (a Redis crash rolled its finish back) and a PENDING one whose delayed retry its consumer
    dropped with the connection, when Redis comes back, then both are moved to their next
    dispatch and published again."""
    from tests.unit_helpers import RecordingPorts
    from workers.runtime import WorkerRuntime

    published = RecordingPorts()
    rt = WorkerRuntime(settings, "w-test", engine="instant", guard=False, ports=published)
    create(rt.store, "rolled-back")
    rt.store.begin("rolled-back", 0, rt.name, rt.instance_id, time.time(), 3)
    create(rt.store, "dropped-retry")
    rt.store.begin("dropped-retry", 0, rt.name, rt.instance_id, time.time(), 3)
    rt.store.release("dropped-retry", rt.instance_id, 1, "wedged: test")
    assert rt.held.reclaim_orphans() == 2
    assert sorted(published.sent) == [("dropped-retry", 2), ("rolled-back", 1)]
    assert {rt.store.get(r)["status"] for r in ("rolled-back", "dropped-retry")} == {"PENDING"}


def test_after_a_reap_a_message_the_dead_consumer_took_is_published_again(store):
    """Given a worker (pools tiny-llama) killed while its consumer waited in BRPOP, so that Redis
    handed it a message no one will read (the request PENDING, in no queue, no unacked entry, no
    in-flight set), when the reaper reaps it, then that request is published again under its
    next dispatch; a request submitted a moment ago (between record and publish) is left."""
    now = time.time()
    store.raw.hset(keys.worker(5), mapping={"name": "dead@h", "last_seen": now - 600,
                                          "pools": "tiny-llama"})
    store.raw.zadd(keys.WORKERS, {"5": now - 600})
    create(store, "taken", now=now - 30)
    create(store, "just-submitted", now=now - 1)
    published = Published()
    report = reap_workers(store, now, published, None, reap_timeout=120,
                          max_attempts=3)
    assert report == {"dead@h": (0, 0)}
    assert published == [("taken", 1)]
    assert store.get("taken")["last_error"].startswith("worker_lost")
    assert store.get("just-submitted")["dispatch"] == "0"


def test_waiting_in_get_renews_the_job_lease(monkeypatch):
    """Given a job whose last activity is an hour old and one of its requests running, when a
    producer waits on that request with get(), then the job's lease is renewed while it waits
    (so beat does not take the job for abandoned)."""
    from app import app
    from app.requests import async_result
    from app.state.jobs import create_job

    monkeypatch.setattr(async_result, "RECORD_CHECK_S", 0.2)
    monkeypatch.setattr(async_result, "_touched", {})
    client = app.vigil_store.raw
    store = RequestStore(client, 60)
    job = f"lease-{uuid.uuid4().hex[:8]}"
    create_job(client, job, now=time.time() - 3600)
    rid = f"lease-{uuid.uuid4()}"
    create(store, rid, job=job)
    client.zadd(keys.JOBS, {job: time.time() - 3600})
    store.begin(rid, 0, "w", 98, time.time(), 3)
    r = app.AsyncResult(rid)
    try:
        with pytest.raises(CeleryTimeoutError):
            r.get(timeout=1.5)  # still running: times out
        assert client.zscore(keys.JOBS, job) > time.time() - 60
    finally:
        r.backend.remove_pending_result(r)  # stop listening now, not at interpreter exit
        store.finish(rid, 98, time.time(), error_kind="TerminalError", error="job_deleted: test")
        client.delete(keys.job(job), keys.inflight(98))
        client.zrem(keys.JOBS, job)
