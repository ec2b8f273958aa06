"""Redis tier: a many submit written and published in parts (app/requests/submit.py, "Many
requests are recorded and published in parts") through the real app on a real Redis
(database 1): the first messages leave before the later records are written, a call the caps
cannot take whole is refused before anything is written, and what only a later part meets is
raised with the handles of what went out before it."""
from __future__ import annotations

from collections import Counter

import pytest

import app.requests.submit as submit_module
from app.celery_app import create_app
from app.errors import RequestError, TransientError
from app.requests.submit import FIRST_PART
from app.state.store import CREATED_NEW_JOB_QUEUE, OVERLOADED_JOB, OVERLOADED_POOL
from tests.test_submit_many import POOL, many, messages

pytestmark = pytest.mark.redis
CAPPED = POOL + ".job.capped"


def items(n: int, tag: str = "p", **kw) -> list[dict]:
    return [{"model": "tiny-llama", "prompt": f"{tag}{i}", "max_tokens": 1, **kw}
            for i in range(n)]


def carried(r, queue: str) -> list[str]:
    """The request ids the queue's messages carry, in the order they were published."""
    return [i for m in messages(r, queue) for i in m["headers"]["vigil_ids"]]


def recorded(r, ids: list[str]) -> int:
    """How many of `ids` have a record."""
    return r.exists(*[f"vigil:req:{i}" for i in ids]) if ids else 0


def on_each_message(monkeypatch, hook) -> None:
    """Call `hook()` as each generate_many message is published, before it is."""
    real = submit_module.publish_many

    def publish_many(*a, **kw):
        hook()
        return real(*a, **kw)

    monkeypatch.setattr(submit_module, "publish_many", publish_many)


def test_the_first_messages_leave_before_the_later_records_are_written(settings, monkeypatch):
    """Given a call of 1,300 requests (parts of 256, 1,024 and 20), when its first message is
    published, then the first part is recorded and nothing after it; every request ends up
    recorded once and carried by one message, in order."""
    app = create_app(settings)
    r = app.vigil_store.raw
    ids = [f"part-{i}" for i in range(1300)]
    seen: list[tuple[int, int]] = []
    on_each_message(monkeypatch, lambda: seen.append(
        (recorded(r, ids[:FIRST_PART]), recorded(r, ids[FIRST_PART:]))))
    many(app, settings, items(1300), task_ids=ids)
    assert seen[0] == (FIRST_PART, 0)
    assert seen[-1] == (FIRST_PART, 1300 - FIRST_PART)
    assert recorded(r, ids) == 1300
    assert carried(r, POOL) == ids


def test_a_call_the_caps_cannot_take_whole_is_refused_in_its_first_part(settings):
    """Given a job capped at 400 open requests, a call of 401 (two parts) is refused
    `overloaded` with nothing recorded or sent and no `.submitted`, while a call of exactly
    400 is taken whole; then one more is refused."""
    s = settings.model_copy(update={"max_pending_per_job": 400})
    app = create_app(s)
    r = app.vigil_store.raw
    with pytest.raises(TransientError, match="^overloaded: .*nothing was sent") as refused:
        many(app, s, items(401, job="capped"))
    assert not hasattr(refused.value, "submitted")
    assert not list(r.scan_iter("vigil:req:*"))
    assert messages(r, CAPPED) == []
    taken = many(app, s, items(400, "q", job="capped"))
    assert len(carried(r, CAPPED)) == 400 and recorded(r, [h.id for h in taken]) == 400
    with pytest.raises(TransientError, match="^overloaded: "):
        many(app, s, items(1, "x", job="capped"))


def test_a_cap_another_producer_fills_between_parts_raises_with_what_went_out(
        settings, monkeypatch):
    """Given a job capped at 600 and a call of 500 (256 + 244), when another producer submits
    200 of the job while the call's first part is published, then the call raises
    `overloaded` with `.submitted` the handles of the first part, in order; the second part's
    records are deleted; what went out stays recorded and queued; the same call again (more
    room) sends only the rest, each request once."""
    s = settings.model_copy(update={"max_pending_per_job": 600})
    app = create_app(s)
    r = app.vigil_store.raw
    ids = [f"mine-{i}" for i in range(500)]
    other = create_app(s)
    cut_in: list[int] = []

    def other_producer():
        if not cut_in:
            cut_in.append(1)
            many(other, s, items(200, "o", job="capped"))

    on_each_message(monkeypatch, other_producer)
    with pytest.raises(TransientError, match=f"^overloaded: .*first {FIRST_PART} requests "
                       "were sent") as refused:
        many(app, s, items(500, job="capped"), task_ids=ids)
    assert [h.id for h in refused.value.submitted] == ids[:FIRST_PART]
    assert recorded(r, ids) == FIRST_PART
    mine = [i for i in carried(r, CAPPED) if i.startswith("mine-")]
    assert mine == ids[:FIRST_PART]
    assert len(carried(r, CAPPED)) == FIRST_PART + 200
    roomier = s.model_copy(update={"max_pending_per_job": 1000})  # the same call again sends
    many(create_app(roomier), roomier, items(500, job="capped"), task_ids=ids)  # only the rest
    assert sorted(i for i in carried(r, CAPPED) if i.startswith("mine-")) == sorted(ids)


def test_redis_lost_in_a_later_part_raises_with_what_went_out(settings, monkeypatch):
    """Given a call of 600 requests whose second part's write fails (Redis away), then it
    raises redis_unavailable with `.submitted` the first part's handles, and nothing of the
    second part is recorded or sent."""
    app = create_app(settings)
    r = app.vigil_store.raw
    store = app.vigil_store
    real, writes = store.create_many, []

    def create_many(*a, **kw):
        writes.append(1)
        if len(writes) == 2:
            raise TransientError.of("redis_unavailable", "cannot reach Redis: test")
        return real(*a, **kw)

    monkeypatch.setattr(store, "create_many", create_many)
    ids = [f"lost-{i}" for i in range(600)]
    with pytest.raises(TransientError, match="^redis_unavailable: ") as lost:
        many(app, settings, items(600), task_ids=ids)
    assert [h.id for h in lost.value.submitted] == ids[:FIRST_PART]
    assert recorded(r, ids) == FIRST_PART and carried(r, POOL) == ids[:FIRST_PART]


def test_ids_seen_before_are_answered_whole_before_anything_is_published(settings):
    """Given an id already used by another request, a call of 1,300 naming it last is refused
    `invalid_request` with nothing of the call recorded or sent: its records are all answered
    before its first message (in parts, its first two, 1,280 requests, would have gone out)."""
    app = create_app(settings)
    r = app.vigil_store.raw
    ids = [f"seen-{i}" for i in range(1300)]
    many(app, settings, items(1, "other"), task_ids=[ids[-1]])
    before = carried(r, POOL)
    with pytest.raises(RequestError, match="already used by a different request"):
        many(app, settings, items(1300), task_ids=ids)
    assert recorded(r, ids[:-1]) == 0
    assert carried(r, POOL) == before
    again = many(app, settings, items(1299), task_ids=ids[:-1])  # the rest, fresh: in parts
    assert [h.id for h in again] == ids[:-1] and carried(r, POOL) == before + ids[:-1]


def test_create_counts_the_requests_ahead_against_the_caps(settings):
    """Given `ahead` naming requests still to come in a job and a pool, then the caps count
    them as open: with 2 of the job ahead and a job cap of 3, the second request here is
    refused; with 1 of the pool ahead and a pool cap of 2, the second is refused."""
    import time

    from app.requests.record_fields import record_fields
    from app.requests.schemas import parse_request

    app = create_app(settings)
    store = app.vigil_store

    def fields(job):
        return record_fields(parse_request({"model": "tiny-llama", "prompt": "p", "job": job}),
                             time.time(), 3600)

    made = store.create_many([("a1", fields("ja")), ("a2", fields("ja"))], time.time(),
                             max_per_job=3, ahead=Counter({("job", "ja"): 2}))
    assert made == [CREATED_NEW_JOB_QUEUE, OVERLOADED_JOB]
    made = store.create_many([("b1", fields("jb")), ("b2", fields("jb"))], time.time(),
                             max_per_pool=3, ahead=Counter({("pool", "tiny-llama"): 1}))
    assert made == [CREATED_NEW_JOB_QUEUE, OVERLOADED_POOL]  # a1 + 1 ahead + b1 = 3
    assert store.get("a2") is None and store.get("b2") is None
    assert store.create_many([("c1", fields("jc"))], time.time(), max_per_job=1) == [
        CREATED_NEW_JOB_QUEUE]  # nothing ahead: as alone


def test_a_call_of_several_jobs_is_written_whole_before_any_is_published(settings):
    """Given 256 requests of one job, then 500 of a job capped at 400, the call is refused
    `overloaded` with nothing of it recorded or sent: in parts its first part (the other
    job's, which sees no cap) would have gone out before the capped job's part was refused."""
    s = settings.model_copy(update={"max_pending_per_job": 400})
    app = create_app(s)
    r = app.vigil_store.raw
    call = items(FIRST_PART, job="free") + items(500, "c", job="capped")
    with pytest.raises(TransientError, match="^overloaded: .*nothing was sent") as refused:
        many(app, s, call)
    assert not hasattr(refused.value, "submitted")
    assert not list(r.scan_iter("vigil:req:*"))
    assert messages(r, POOL + ".job.free") == [] and messages(r, CAPPED) == []


def test_a_gateway_call_is_recorded_whole_before_any_of_it_is_published(settings, monkeypatch):
    """Given the online gateway's submit of 300 requests, when its first message is
    published, then all 300 are recorded: an online call is answered as one, so a refusal
    met while writing it leaves none of it running."""
    from app.ops.gateway import Gateway
    from app.requests.models import get_registry

    app = create_app(settings)
    r = app.vigil_store.raw
    gateway = Gateway(settings, app.vigil_store, get_registry(), app.vigil_ports, warm=False)
    ids = [f"online-{i}" for i in range(300)]
    seen: list[int] = []
    on_each_message(monkeypatch, lambda: seen.append(recorded(r, ids)))
    gateway.submit(items(300), ids)
    assert seen and set(seen) == {300}
    assert carried(r, POOL) == ids
