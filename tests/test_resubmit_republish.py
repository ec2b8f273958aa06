"""Redis tier: a record whose producer stopped before publishing its message (a SIGKILLed
`vigil batch` between the two writes) is published by the next submit of the same request,
and only then: a resubmit of a request whose message is queued, fetched or held by a worker
publishes nothing. Real kombu messages, published by pytest-celery's `celery_app` (Vigil's
configuration, database 1)."""
from __future__ import annotations

import time

import pytest

from app.celery_ports import ports_of
from app.requests.models import get_registry
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.requests.submit import submit_request
from app.state.broker import queue_lists
from app.state.conn import connect
from app.state.queues import job_queue
from app.state.store import RequestStore
from tests.worker_procs import queued

pytestmark = pytest.mark.redis
KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4, "job": "resub"}
QUEUE = "vigil.pool.tiny-llama.job.resub"


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def submit(store, settings, celery_app, rid):
    return submit_request(dict(KW), rid, settings=settings, registry=get_registry(),
                          store=store, ports=ports_of(celery_app))


def orphan(store, rid):
    """The record a producer writes before its publish, and nothing else (it died there)."""
    assert store.create(rid, record_fields(parse_request(KW), time.time(), 3600))


def test_a_record_left_without_a_message_is_published_by_its_resubmit(
        store, settings, celery_app):
    orphan(store, "lost-1")
    assert queued(store.raw, QUEUE) == 0
    submit(store, settings, celery_app, "lost-1")
    assert queued(store.raw, QUEUE) == 1
    submit(store, settings, celery_app, "lost-1")  # its message is queued now: nothing more
    assert queued(store.raw, QUEUE) == 1
    assert store.get("lost-1")["dispatch"] == "0"


def test_a_resubmit_publishes_nothing_while_a_worker_holds_or_has_fetched_the_message(
        store, settings, celery_app):
    orphan(store, "held")
    store.hold("held", 42)  # a worker's consumer received it
    submit(store, settings, celery_app, "held")
    assert queued(store.raw, QUEUE) == 0
    submit(store, settings, celery_app, "fetched")  # a first submit: record and message
    # A consumer fetched it (from its tier's list): kombu keeps it in its unacked hash.
    raw = store.raw.rpop(next(k for k in queue_lists(QUEUE) if store.raw.llen(k)))
    store.raw.hset("unacked", "tag-1", b"[" + raw + b', "", "' + QUEUE.encode() + b'"]')
    submit(store, settings, celery_app, "fetched")
    assert queued(store.raw, QUEUE) == 0


def test_a_request_that_began_is_never_republished_by_a_resubmit(store, settings, celery_app):
    orphan(store, "begun")
    assert store.begin("begun", 0, "w@h", 7, time.time(), 3).action == "run"
    store.raw.srem("vigil:inflight:7", "begun")  # even with no holder recorded
    submit(store, settings, celery_app, "begun")
    assert queued(store.raw, QUEUE) == 0


def test_the_periodic_audit_publishes_an_orphan_nobody_resubmits_and_nothing_else(
        store, settings, celery_app):
    """Given an orphan record 10 s old, a fresh one (its producer may be between its record
    and its publish) and a request whose message is queued, when beat's message audit runs,
    then only the old orphan is published again (next dispatch)."""
    from app.fleet.message_audit import audit_orphans

    now = time.time()
    req = parse_request(KW)
    assert store.create("old-orphan", record_fields(req, now - 10, 3600), now - 10)
    assert store.create("young-orphan", record_fields(req, now, 3600), now)
    assert store.create("queued-old", record_fields(req, now - 10, 3600), now - 10)
    celery_app.send_task("vigil.generate", kwargs=KW, task_id="queued-old",
                         queue=job_queue("tiny-llama", "resub"))
    published = []
    assert audit_orphans(store, now, lambda rid, rec, d: published.append((rid, d))) == 1
    assert published == [("old-orphan", 1)]
    assert store.get("old-orphan")["dispatch"] == "1"
