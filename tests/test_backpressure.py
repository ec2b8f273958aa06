"""Redis tier: backpressure (issue 8 part 5). The per-job and per-pool caps on open requests are
checked in the create script itself; past them `.delay` raises `overloaded` at once, with
nothing written and nothing published."""
from __future__ import annotations

import time
import uuid

import pytest

from app import app
from app.errors import TransientError
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.state import keys
from app.state.conn import connect
from app.state.store import (CREATED, EXISTS, OVERLOADED_JOB, OVERLOADED_POOL, RequestStore,
                             shared_store)
from tasks.inference import generate

pytestmark = pytest.mark.redis


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def fields(job="j", model="tiny-llama"):
    req = parse_request({"model": model, "prompt": "hello", "job": job})
    return record_fields(req, time.time(), 3600)


def test_a_job_at_its_cap_is_accepted_one_over_refused_and_a_finished_request_frees_a_slot(
        store):
    """Given a job cap of 3, when 4 requests are created, then the 3rd (exactly at the cap) is
    accepted and the 4th refused with nothing written; once one ends, the next is accepted."""
    for i in range(3):
        assert store.create(f"r{i}", fields(), max_per_job=3) >= CREATED
    assert store.raw.scard(keys.job_requests("j")) == 3
    assert store.create("r3", fields(), max_per_job=3) == OVERLOADED_JOB
    assert store.get("r3") is None and not store.raw.zscore(keys.DEADLINES, "r3")
    assert store.raw.scard(keys.pool_requests("tiny-llama")) == 3
    store.finish("r0", 1, time.time(), result={"text": "x"})
    assert store.create("r3", fields(), max_per_job=3) >= CREATED
    assert store.raw.scard(keys.job_requests("j")) == 3


def test_concurrent_producers_never_overshoot_the_caps(settings):
    """Given 8 producers (threads, each with its own connection) racing 200 submits each into
    one job capped at 150 and a pool capped at 120, then exactly 120 are accepted, the rest
    refused with nothing written: the count and the write are one script."""
    from concurrent.futures import ThreadPoolExecutor

    def produce(p: int) -> list[int]:
        own = RequestStore(connect(settings), settings.result_ttl)
        return [own.create(f"c{p}-{i}", fields(job="race"), max_per_job=150, max_per_pool=120)
                for i in range(200)]

    with ThreadPoolExecutor(8) as pool:
        outcomes = [x for batch in pool.map(produce, range(8)) for x in batch]
    store = RequestStore(connect(settings), settings.result_ttl)
    assert sum(o >= CREATED for o in outcomes) == 120
    assert set(outcomes) <= {CREATED, 2, OVERLOADED_POOL, OVERLOADED_JOB}
    assert store.raw.scard(keys.pool_requests("tiny-llama")) == 120
    assert store.raw.scard(keys.job_requests("race")) == 120
    assert store.raw.zcard(keys.DEADLINES) == 120


def test_the_pool_cap_counts_every_job_of_the_pool_and_only_that_pool(store):
    assert store.create("a", fields(job="j1"), max_per_pool=2) >= CREATED
    assert store.create("b", fields(job="j2"), max_per_pool=2) >= CREATED
    assert store.create("c", fields(job="j3"), max_per_pool=2) == OVERLOADED_POOL
    assert store.get("c") is None and not store.raw.exists(keys.job_requests("j3"))
    assert store.create("d", fields(model="unserved-model"), max_per_pool=2) >= CREATED
    store.finish("a", 1, time.time(), error_kind="RequestError", error="invalid_request: x")
    assert store.create("c", fields(job="j3"), max_per_pool=2) >= CREATED


def test_a_resubmit_at_the_cap_is_the_same_request_not_an_overload(store):
    assert store.create("same", fields(), max_per_job=1) >= CREATED
    assert store.create("same", fields(), max_per_job=1) == EXISTS


def test_zero_means_unlimited_and_a_rolled_back_submit_gives_its_slot_back(store):
    for i in range(5):
        assert store.create(f"u{i}", fields(), max_per_job=0, max_per_pool=0) >= CREATED
    store.delete("u0")
    assert store.raw.scard(keys.job_requests("j")) == 4
    assert store.raw.scard(keys.pool_requests("tiny-llama")) == 4
    for i in range(1, 5):
        store.finish(f"u{i}", 1, time.time(), result={"text": "x"})
    assert not store.raw.exists(keys.job_requests("j"), keys.pool_requests("tiny-llama"))


def job_keys(client, job: str) -> dict[bytes, bytes]:
    """Every key that names `job`, with its serialized value (DUMP): equal when nothing of the
    job was written. Kombu's keys (its bindings) are left out: a live worker told of the job's queue by the
    accepted submits declares it when the broadcast reaches it, at any moment of the test."""
    return {k: client.dump(k) for k in client.scan_iter(f"*{job}*")
            if not k.startswith(b"_kombu.")}


@pytest.fixture()
def capped(monkeypatch):
    """`generate.delay` with caps just above what its pools and job already hold (database 0 is
    shared with other tests), publishing into a list instead of Redis."""
    from app.settings import get_settings

    sent = []

    def capture(self, name, args=None, kwargs=None, **options):
        sent.append(options["task_id"])
        return self.AsyncResult(options["task_id"])

    monkeypatch.setattr(type(app), "send_task", capture)

    def cap(**caps):
        s = get_settings().model_copy(update=caps)
        monkeypatch.setattr("tasks.base.get_settings", lambda: s)
        return s

    yield cap, sent
    r = shared_store()
    for rid in sent:
        r.finish(rid, 0, time.time(), error_kind="RequestError", error="invalid_request: test")


def test_delay_past_the_job_cap_raises_overloaded_at_once_with_retry_advice(capped):
    """Given a job at its cap, when one more request is submitted, then `.delay` raises
    TransientError(overloaded) naming the job, the cap's variable and when to retry, and writes
    and publishes nothing."""
    cap, sent = capped
    s = cap(max_pending_per_job=2)
    job = f"bp-{uuid.uuid4().hex}"
    a = generate.delay(model="tiny-llama", prompt="one", job=job)
    generate.delay(model="tiny-llama", prompt="two", job=job)
    r = shared_store().raw
    # Database 0 is shared (other tests, the session's warm worker): what must not change is
    # this job's keys and the refused request's own (its id chosen here, as `.delay` would).
    before = job_keys(r, job)
    rid = f"refused-{uuid.uuid4()}"
    with pytest.raises(TransientError) as ei:
        generate.apply_async(kwargs={"model": "tiny-llama", "prompt": "three", "job": job},
                             task_id=rid)
    e = ei.value
    assert e.code == "overloaded" and isinstance(e, TransientError)
    assert str(e) == (f"overloaded: job {job!r} has 2 open requests, its cap "
                      f"(VIGIL_MAX_PENDING_PER_JOB); nothing was sent: retry in "
                      f"~{s.retry_backoff_max:g} s")
    assert len(sent) == 2 and job_keys(r, job) == before
    assert not list(r.scan_iter(f"*{rid}*"))  # no record, stream or result
    assert r.zscore(keys.DEADLINES, rid) is None
    assert not r.sismember(keys.pool_requests("tiny-llama"), rid)
    shared_store().finish(a.id, 0, time.time(), result={"text": "x"})
    generate.delay(model="tiny-llama", prompt="three", job=job)
    assert len(sent) == 3


def test_delay_past_the_pool_cap_raises_overloaded_naming_the_pool(capped):
    cap, sent = capped
    r = shared_store().raw
    cap(max_pending_per_pool=r.scard(keys.pool_requests("unserved-model")) + 1)
    generate.delay(model="unserved-model", prompt="fits")
    with pytest.raises(TransientError, match=r"^overloaded: pool 'unserved-model' has \d+ open "
                       r"requests, its cap \(VIGIL_MAX_PENDING_PER_POOL\); nothing was sent: "
                       r"retry in ~\d+ s$"):
        generate.delay(model="unserved-model", prompt="one too many")
    assert len(sent) == 1
