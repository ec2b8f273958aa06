"""Redis tier: submitting many requests at once (app/requests/submit.py) through the real
app on a real Redis (database 1): each request its own record and result handle, the messages
carrying up to K requests each, grouped by queue and tier; all or nothing when one is wrong or
refused."""
from __future__ import annotations

import json

import pytest
from celery.exceptions import TimeoutError as CeleryTimeoutError

from app.celery_app import create_app
from app.errors import RequestError, TransientError
from app.requests.async_result import SIBLINGS_READ
from app.requests.models import get_registry
from app.requests.submit import GC_DEFERRED_FROM, submit_many
from app.state import broker
from app.task_names import GENERATE_MANY

pytestmark = pytest.mark.redis
POOL = "vigil.pool.tiny-llama"


def many(app, settings, items, **kw):
    return submit_many(items, settings=settings, registry=get_registry(),
                       store=app.vigil_store, ports=app.vigil_ports, **kw)


def commands_called(raw) -> dict:
    """Redis' own count of calls per command since its counters were reset: {name: calls}."""
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in raw.info("commandstats").items()}


def stored_while_waiting(settings, result) -> dict:
    """`result.get()`'s answer when its result is stored 0.3 s after the get began, from
    another app's connections (as a worker's FINISH stores it); Redis' command counters are
    reset as the get begins."""
    import threading

    other = create_app(settings)  # the worker's side: its own connections
    result.app.vigil_store.raw.config_resetstat()
    timer = threading.Timer(0.3, other.backend.store_result,
                            (result.id, {"request_id": result.id, "text": "late"}, "SUCCESS"))
    timer.start()
    try:
        return result.get(timeout=4)
    finally:
        timer.cancel()


def messages(r, queue):
    out = []
    for key in broker.queue_lists(queue):
        out += [json.loads(m) for m in reversed(r.lrange(key, 0, -1))]
    return out


def test_many_requests_are_recorded_each_and_published_k_to_a_message(quiet_settings):
    s = quiet_settings.model_copy(update={"requests_per_message": 4})
    app = create_app(s)
    items = [{"model": "tiny-llama", "prompt": f"p{i}", "max_tokens": 2} for i in range(10)]
    items += [{"model": "tiny-llama", "prompt": "now", "priority": "interactive"}]
    app.vigil_store.raw.config_resetstat()
    results = many(app, s, items)
    calls = app.vigil_store.raw.info("commandstats")
    assert "cmdstat_subscribe" not in calls  # no one waits for a message's own result
    assert len(results) == 11 and len({r.id for r in results}) == 11
    recs = [app.vigil_store.get(r.id) for r in results]
    assert all(rec["status"] == "PENDING" and rec["dispatch"] == "0" for rec in recs)
    assert json.loads(recs[3]["request"])["prompt"] == "p3"
    msgs = messages(app.vigil_store.raw, POOL)
    assert [m["headers"]["task"] for m in msgs] == [GENERATE_MANY] * 4
    carried = [m["headers"]["vigil_ids"] for m in msgs]
    assert sorted(len(c) for c in carried) == [1, 2, 4, 4]  # 10 default in 4s; 1 interactive
    assert sorted(i for c in carried for i in c) == sorted(r.id for r in results)
    first = msgs[0]  # popped first: the interactive one, at priority 0
    assert first["headers"]["vigil_ids"] == [results[-1].id]
    body = json.loads(__import__("base64").b64decode(first["body"]))
    assert body[1]["requests"][0]["kwargs"]["prompt"] == "now"
    assert "prompt" not in first["headers"]["kwargsrepr"]


def test_one_bad_request_fails_them_all_naming_it_and_nothing_is_written(settings):
    app = create_app(settings)
    items = [{"model": "tiny-llama", "prompt": "ok"}, {"model": "tiny-llama", "prompt": ""}]
    with pytest.raises(RequestError, match="^invalid_request: request 1: "):
        many(app, settings, items)
    assert not list(app.vigil_store.raw.scan_iter("vigil:req:*"))
    assert messages(app.vigil_store.raw, POOL) == []


def test_a_refusal_mid_way_deletes_what_this_call_created(settings):
    s = settings.model_copy(update={"max_pending_per_job": 3})
    app = create_app(s)
    items = [{"model": "tiny-llama", "prompt": f"p{i}", "job": "capped"} for i in range(5)]
    with pytest.raises(TransientError, match="^overloaded: "):
        many(app, s, items)
    assert not list(app.vigil_store.raw.scan_iter("vigil:req:*"))
    assert messages(app.vigil_store.raw, POOL + ".job.capped") == []


def test_a_refusal_deletes_the_records_its_round_trip_created_after_it_too(settings):
    """Given a call whose first id is already used by another request, and one whose fourth
    request passes its job's cap with a request of another job after it, each is refused and
    no request of it keeps a record: the records its one round trip created after the
    refused answer are deleted too (before, they stayed with no message until the deadline
    sweep, counted against the caps)."""
    s = settings.model_copy(update={"max_pending_per_job": 3})
    app = create_app(s)
    r = app.vigil_store.raw
    many(app, s, [{"model": "tiny-llama", "prompt": "other"}], task_ids=["taken"])
    with pytest.raises(RequestError, match="already used by a different request"):
        many(app, s, [{"model": "tiny-llama", "prompt": f"p{i}"} for i in range(5)],
             task_ids=["taken", "t1", "t2", "t3", "t4"])
    call = [{"model": "tiny-llama", "prompt": f"a{i}", "job": "ja"} for i in range(4)]
    call.append({"model": "tiny-llama", "prompt": "b", "job": "jb"})
    with pytest.raises(TransientError, match="^overloaded: "):
        many(app, s, call, task_ids=["a0", "a1", "a2", "a3", "b0"])
    assert sorted(k.decode() for k in r.scan_iter("vigil:req:*")) == ["vigil:req:taken"]


def test_the_same_ids_again_are_the_same_requests_and_publish_nothing_more(settings):
    app = create_app(settings)
    items = [{"model": "tiny-llama", "prompt": f"p{i}"} for i in range(3)]
    ids = ["again-0", "again-1", "again-2"]
    many(app, settings, items, task_ids=ids)
    before = len(messages(app.vigil_store.raw, POOL))
    assert [r.id for r in many(app, settings, items, task_ids=ids)] == ids
    assert len(messages(app.vigil_store.raw, POOL)) == before
    with pytest.raises(RequestError, match="already used by a different request"):
        many(app, settings, [{"model": "tiny-llama", "prompt": "other"}], task_ids=["again-0"])


def test_reading_one_result_reads_the_ended_siblings_after_it_in_the_same_round_trip(
        quiet_settings):
    """Collecting a generate_many's results in order costs a round trip per SIBLINGS_READ ended
    results (app/requests/async_result.py `Siblings`), counted by Redis itself: no
    subscription to any result's channel, one MGET per 64. Celery's own `get` subscribed, read
    and unsubscribed for every result, a third of the producer's CPU in the short workload
    (docs/performance.md, "Where a short request's time goes"). A result not stored yet is
    left to the wait, and an error is an error."""
    app = create_app(quiet_settings)
    items = [{"model": "tiny-llama", "prompt": f"p{i}", "max_tokens": 1} for i in range(70)]
    results = many(app, quiet_settings, items)
    ended, last = results[:-1], results[-1]
    for i, r in enumerate(ended[:-1]):
        app.backend.store_result(r.id, {"request_id": r.id, "text": f"t{i}"}, "SUCCESS")
    app.backend.mark_as_failure(ended[-1].id, TransientError.of("overloaded", "too much"))
    raw = app.vigil_store.raw
    raw.config_resetstat()
    got = [r.get(timeout=5, propagate=False) for r in ended]
    calls = commands_called(raw)
    assert [g["text"] for g in got[:-1]] == [f"t{i}" for i in range(len(ended) - 1)]
    assert "too much" in str(got[-1])
    assert calls.get("mget") == -(-len(ended) // SIBLINGS_READ) == 2
    assert "subscribe" not in calls and "get" not in calls
    with pytest.raises(CeleryTimeoutError):  # not stored: waited for, not taken from a read
        last.get(timeout=0.3)


def test_a_result_not_stored_yet_is_polled_alone_not_with_its_siblings(quiet_settings):
    """Given 70 results of one generate_many call and the first stored 0.3 s after its
    `get()` began, then the first read took it and the 63 siblings after it in one MGET and
    every later poll read it alone, counted by Redis itself (a key read and not found is one
    keyspace miss). Every poll reading all 64 read 9 of 10 keys in vain in the short-request
    bench (app/requests/async_result.py `Siblings`)."""
    app = create_app(quiet_settings)
    results = many(app, quiet_settings, [{"model": "tiny-llama", "prompt": f"s{i}",
                                          "max_tokens": 1} for i in range(70)])
    raw = app.vigil_store.raw
    got = stored_while_waiting(quiet_settings, results[0])
    polls = raw.info("commandstats")["cmdstat_mget"]["calls"]
    stats = raw.info("stats")
    assert got["text"] == "late"
    assert polls >= 5  # it waited, reading as it went
    assert stats["keyspace_hits"] == 1
    assert stats["keyspace_misses"] == SIBLINGS_READ + polls - 2


def test_a_large_submit_runs_no_garbage_collection_and_leaves_the_collector_as_it_was(
        settings, monkeypatch):
    """Given Python's cyclic garbage collector set to collect every 10 allocations, a submit of
    GC_DEFERRED_FROM requests runs no collection from its first request's admission to its
    last message's publish (counted by gc's own callbacks), and the collector is on again
    after it; in a process that turned the collector off it stays off. A full collection
    inside the submit held its first message back (app/requests/submit.py
    `_hold_collector`)."""
    import gc

    import app.requests.submit as submit_module

    app = create_app(settings)
    started: list[int] = []
    marks: dict[str, int] = {}

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    def admit(*a, **kw):
        marks.setdefault("first admitted", len(started))
        return real_admit(*a, **kw)

    def publish_many(*a, **kw):
        marks["last published"] = len(started)
        return real_publish_many(*a, **kw)

    real_admit, real_publish_many = submit_module.admit, submit_module.publish_many
    monkeypatch.setattr(submit_module, "admit", admit)
    monkeypatch.setattr(submit_module, "publish_many", publish_many)
    first, second = [[{"model": "tiny-llama", "prompt": f"{tag}{i}", "max_tokens": 1}
                      for i in range(GC_DEFERRED_FROM)] for tag in "ab"]
    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(10, 1, 1)
    try:
        many(app, settings, first)
        inside = marks["last published"] - marks["first admitted"]
        on_after = gc.isenabled()
        _ = [[] for _ in range(100)]  # allocations after the call: the collector runs
        collected_after = len(started) > marks["last published"]
        gc.disable()
        many(app, settings, second)
        off_after = not gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    assert inside == 0
    assert on_after and collected_after and off_after


def test_a_result_stored_while_its_get_waits_is_read_without_a_subscription(quiet_settings):
    """Given a generate_many's results and one stored 0.3 s after its `get()` began (from
    another connection, as a worker's FINISH stores it), then `get()` returns it, having read
    the result keys while it waited and subscribed to no channel, counted by Redis itself.
    Subscribed, a collector of thousands built a backlog of their messages on its one reply
    connection and found a result stored long before only at the record check, 5 s later
    (app/requests/async_result.py, module docstring)."""
    app = create_app(quiet_settings)
    results = many(app, quiet_settings, [{"model": "tiny-llama", "prompt": f"w{i}",
                                          "max_tokens": 1} for i in range(3)])
    raw = app.vigil_store.raw
    got = stored_while_waiting(quiet_settings, results[1])
    calls = commands_called(raw)
    assert got["text"] == "late"
    assert calls.get("mget", 0) >= 2  # read before it was stored, and after
    assert "subscribe" not in calls and "psubscribe" not in calls


def test_a_collector_reads_stored_results_as_celery_decodes_them_without_its_hook(
        settings, monkeypatch):
    """Given stored results of every shape a key holds (a result with nested dicts and text
    that looks like an envelope, a failure, a value kombu wrapped in an envelope), then
    `decode_stored` gives what Celery's `decode_result` gives; and a generate_many's collector
    reads plain results without Celery's decoding (its hook per dict was 37% of a collector's
    CPU: docs/performance.md, "The twelfth pass"), the wrapped one through it."""
    import datetime

    from app.requests.async_result import decode_stored

    app = create_app(settings)
    results = many(app, settings, [{"model": "tiny-llama", "prompt": f"d{i}", "max_tokens": 1}
                                   for i in range(4)])
    plain = {"request_id": results[0].id, "text": 'he said "__type__" é',
             "logprobs": [{"tok": [{"id": 5, "logprob": -0.5}]}], "usage": {"n": 1}}
    backend, raw = app.backend, app.vigil_store.raw
    backend.store_result(results[0].id, plain, "SUCCESS")
    backend.store_result(results[1].id, {"text": "b"}, "SUCCESS")
    backend.mark_as_failure(results[2].id, TransientError.of("overloaded", "too much"))
    backend.store_result(results[3].id, {"at": datetime.datetime(2026, 12, 6)}, "SUCCESS")
    values = [raw.get(backend.get_key_for_task(r.id)) for r in results]
    for value in values[:2] + values[3:]:
        assert decode_stored(backend, value) == backend.decode_result(value)
    failed, celerys = decode_stored(backend, values[2]), backend.decode_result(values[2])
    assert type(failed["result"]) is type(celerys["result"])
    assert failed["result"].args == celerys["result"].args
    assert {k: v for k, v in failed.items() if k != "result"} == {
        k: v for k, v in celerys.items() if k != "result"}

    decoded: list[bytes] = []
    real = backend.decode

    def decode(payload):
        decoded.append(payload)
        return real(payload)

    monkeypatch.setattr(backend, "decode", decode)
    got = [r.get(timeout=5, propagate=False) for r in results]
    assert got[0] == plain and got[1] == {"text": "b"} and "too much" in str(got[2])
    assert got[3] == {"at": datetime.datetime(2026, 12, 6)}
    assert decoded == [values[3]]
