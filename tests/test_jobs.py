"""Redis tier: jobs (app/fleet/jobs.py) as functions of (store, now): the job's queue per pool is
announced once, deleting a job fails its open requests and refuses new ones, a lapsed lease
ends a job, and the reconcile repairs a lost announcement; two beats never double-act."""
from __future__ import annotations

import pytest
import redis

from app.fleet.consumers import ensure_job_consumers
from app.fleet.jobs import end_job, expire_jobs
from app.requests.schemas import GenerateRequest
from app.requests.record_fields import record_fields
from app.state import keys
from app.state.jobs import create_job, list_jobs
from app.state.queues import DEFAULT_JOB
from app.state.queues import job_queue_name as queue_name
from app.state.queues import pool_queues
from app.state.store import CREATED, CREATED_NEW_JOB_QUEUE, EXISTS, JOB_DELETED, RequestStore
from tests.unit_helpers import Told
from workers.heartbeat import Heartbeat

pytestmark = pytest.mark.redis
T0 = 1_800_000_000.0


@pytest.fixture()
def store(redis_db1_url):
    return RequestStore(redis.Redis.from_url(redis_db1_url), 3600)


def submit(store, rid, job, now=T0, model="tiny-llama"):
    req = GenerateRequest(model=model, prompt="p", job=job)
    return store.create(rid, record_fields(req, now, 3600), now)


def test_a_jobs_queue_is_new_once_per_pool_and_the_default_job_has_none(store):
    assert submit(store, "a1", "eval-7") == CREATED_NEW_JOB_QUEUE
    assert submit(store, "a2", "eval-7") == CREATED
    assert submit(store, "a2", "eval-7") == EXISTS
    assert submit(store, "d1", DEFAULT_JOB) == CREATED
    assert pool_queues(store.raw, "tiny-llama") == ["vigil.pool.tiny-llama",
                                                  "vigil.pool.tiny-llama.job.eval-7"]
    [job] = [j for j in list_jobs(store.raw) if j["name"] == "eval-7"]
    assert job["pending"] == 2 and job["last_active"] == T0


def test_deleting_a_job_fails_its_open_requests_and_refuses_new_ones(store):
    """Given a job with open requests and messages in its queue, when it is deleted, then each
    open request fails job_deleted once (waiters told), its queue and its messages are gone,
    its workers are told to stop consuming it, a finished request keeps its result, and a later
    submit to the job is refused; a second delete at the same moment does nothing."""
    for i in range(5):
        submit(store, f"j{i}", "doomed")
    store.finish("j0", 0, T0, result={"text": "done"})
    store.raw.lpush(queue_name("tiny-llama", "doomed"), "m1", "m2")
    Heartbeat(store.workers, 1, "w1@h", 10, lambda: {"pools": "tiny-llama"}).beat()
    told, cancelled = Told(), []
    assert store.try_lock("job:doomed", "other", 60)
    assert end_job(store, "doomed", T0 + 1, "job 'doomed' was deleted", told,
                   lambda q, n: cancelled.append((q, n)), ["tiny-llama"], 3600) == -1
    store.unlock("job:doomed", "other")
    n = end_job(store, "doomed", T0 + 1, "job 'doomed' was deleted",
                told, lambda q, names: cancelled.append((q, names)),
                ["tiny-llama"], 3600)
    assert n == 4 and sorted(r for r, _ in told) == ["j1", "j2", "j3", "j4"]
    assert all(e.startswith("job_deleted: ") for _, e in told)
    assert store.get("j1")["status"] == "FAILED" and store.get("j0")["status"] == "SUCCEEDED"
    assert not store.raw.exists(queue_name("tiny-llama", "doomed"))
    assert cancelled == [("vigil.pool.tiny-llama.job.doomed", ["w1@h"])]
    assert pool_queues(store.raw, "tiny-llama") == ["vigil.pool.tiny-llama"]
    assert submit(store, "late", "doomed") == JOB_DELETED and store.get("late") is None
    assert not store.raw.exists(keys.job_requests("doomed"))


def test_a_job_whose_lease_lapsed_is_abandoned_and_an_active_one_is_kept(store):
    submit(store, "o1", "old", now=T0)
    submit(store, "n1", "fresh", now=T0 + 3000)
    submit(store, "d1", DEFAULT_JOB, now=T0)
    create_job(store.raw, "short", lease_s=10, now=T0 + 3000)
    ended = []

    def end(name, reason):
        ended.append((name, reason))
        return 0

    assert expire_jobs(store, T0 + 3700, 3600, end) == 2
    assert sorted(n for n, _ in ended) == ["old", "short"]
    assert "abandoned" in ended[0][1]


def test_the_reconcile_adds_a_job_queue_a_worker_missed_and_skips_quarantined_ones(store):
    from app.state.health import HealthLedger

    submit(store, "r1", "late-job")
    for inst, name in ((1, "ok@h"), (2, "sick@h")):
        Heartbeat(store.workers, inst, name, 10, lambda: {"pools": "tiny-llama"}).beat()
    ledger = HealthLedger(store.raw, window=3600, threshold=1)
    ledger.failure(2, T0, "stall")
    have = {"ok@h": ["vigil.housekeeping", "vigil.pool.tiny-llama"],
            "sick@h": ["vigil.housekeeping", "vigil.pool.tiny-llama"]}
    added = []
    assert ensure_job_consumers(store, ["tiny-llama", "unserved-model"], have.get,
                                lambda n, q: added.append((n, q))) == 1
    assert added == [("ok@h", "vigil.pool.tiny-llama.job.late-job")]


def test_two_beats_sweeping_leases_at_once_act_once(store):
    submit(store, "o1", "old", now=T0)
    ended = []
    assert store.try_lock("job_leases", "other-beat", 60)
    assert expire_jobs(store, T0 + 7200, 3600, lambda n, r: ended.append(n) or 0) == 0
    store.unlock("job_leases", "other-beat")
    assert expire_jobs(store, T0 + 7200, 3600, lambda n, r: ended.append(n) or 0) == 1
    assert ended == ["old"]
