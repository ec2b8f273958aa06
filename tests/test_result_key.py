"""Redis tier: a worker's result written to Celery's result key by the finish that stores it
(app/fleet/outcomes.py `result_key_for`, app/state/lua_records.py FINISH), read back by Celery itself;
and the per-request work a worker leaves out (Celery's result repr, its two INFO lines).

`celery_app` is pytest-celery's app on Vigil's own configuration (tests/conftest.py), so its
backend is Vigil's Redis result backend on the test's database.
"""
from __future__ import annotations

import json
import logging
import time

import pytest
from celery import states
from celery.backends.base import DisabledBackend

from app.errors import TerminalError
from app.fleet.outcomes import end_request, result_key_for, result_keys_for
from app.state.conn import connect
from app.state.store import RequestStore
from tests.test_store_and_service import create

pytestmark = pytest.mark.redis
RESULT = {"request_id": "r1", "text": "four words of text", "token_ids": [5, 6, 7, 8]}


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def test_a_won_finish_writes_celerys_result_key_as_celery_would(store, celery_app):
    """Given a running request, when its worker's finish wins with a result key, then Celery's
    own `AsyncResult.get()` returns the result, and the stored value is the meta Celery's
    backend writes for the same result (but its date and task id), with Celery's expiry."""
    backend = celery_app.backend
    create(store, "r1")
    store.begin("r1", 0, "w1", 11, time.time(), 3)
    rk = result_key_for(backend, "r1")
    won, stored = end_request(store, "r1", result=RESULT, instance=11, result_key=rk)
    assert won and rk.written and stored.result == RESULT
    assert celery_app.AsyncResult("r1").get(timeout=5) == RESULT

    backend.store_result("celery-wrote-this", RESULT, states.SUCCESS)
    ours = json.loads(store.raw.get(rk.key))
    celerys = json.loads(store.raw.get(backend.get_key_for_task("celery-wrote-this")))
    assert ours.pop("task_id") == "r1" and celerys.pop("task_id") == "celery-wrote-this"
    assert ours.pop("date_done") and celerys.pop("date_done")
    assert ours == celerys
    assert 0 < store.raw.ttl(rk.key) <= backend.expires


def test_a_lost_or_failed_finish_leaves_the_result_key_to_celery(store, celery_app):
    """Given a request that already ended, a second finish with a result key loses and writes
    no key (the task then has Celery write the stored outcome); a finish that ends a request
    FAILED writes none either (Celery writes a failure with the error's own class)."""
    backend = celery_app.backend
    create(store, "r1")
    store.begin("r1", 0, "w1", 11, time.time(), 3)
    assert end_request(store, "r1", result=RESULT, instance=11)[0]
    rk = result_key_for(backend, "r1")
    won, stored = end_request(store, "r1", result={"text": "late"}, instance=12, result_key=rk)
    assert not won and not rk.written and stored.result == RESULT
    assert store.raw.get(rk.key) is None

    create(store, "r2")
    rk = result_key_for(backend, "r2")
    won, _ = end_request(store, "r2", error=TerminalError.of("deadline_exceeded", "late"),
                         result_key=rk)
    assert won and not rk.written and store.raw.get(rk.key) is None


def test_keys_for_many_ids_share_one_meta_and_read_back_as_celerys_own(store, celery_app,
                                                                      monkeypatch):
    """Given a message of many requests, when their result keys come from one encoded meta
    (`result_keys_for`: what a generate_many task uses), then each key is what
    `result_key_for` gives that id (its own key and task id, an id needing JSON escapes
    included), Celery's `AsyncResult.get()` reads each result, and the meta is built again
    once it is older than META_REUSE_S (its `date_done`)."""
    from app.fleet import outcomes

    backend = celery_app.backend
    keys = result_keys_for(backend)
    ids = ["r1", 'r"2\\', "r3-\u00e9"]
    for rid in ids:
        one, many = result_key_for(backend, rid), keys(rid)
        assert many.key == one.key and many.expires_s == one.expires_s
        ours, theirs = (json.loads(k.prefix + "1" + k.suffix) for k in (many, one))
        assert ours.pop("date_done") and theirs.pop("date_done")
        assert ours == theirs and ours["task_id"] == rid
        create(store, rid)
        store.begin(rid, 0, "w1", 11, time.time(), 3)
        won, _ = end_request(store, rid, result={**RESULT, "request_id": rid}, instance=11,
                             result_key=many)
        assert won and many.written
        assert celery_app.AsyncResult(rid).get(timeout=5)["request_id"] == rid
    built = []
    real = outcomes.result_key_for
    monkeypatch.setattr(outcomes, "result_key_for", lambda *a: built.append(1) or real(*a))
    clock = [100.0]
    monkeypatch.setattr(outcomes.time, "monotonic", lambda: clock[0])
    keys = result_keys_for(backend)
    keys("a"), keys("b")
    clock[0] += outcomes.META_REUSE_S + 0.1
    keys("c")
    assert len(built) == 2


def test_only_celerys_redis_backend_gets_its_key_written_by_a_finish(celery_app):
    """Any other result backend is written by Celery itself."""
    assert result_key_for(DisabledBackend(celery_app), "r1") is None
    assert result_keys_for(DisabledBackend(celery_app))("r1") is None
    assert result_key_for(celery_app.backend, "r1").key == "celery-task-meta-r1"


def test_a_result_is_not_reprd_for_celery_unless_payloads_are_logged(monkeypatch):
    """Celery builds a repr of every return value (for its success line and its task-succeeded
    event); a generate result holds generated text. None is built unless
    VIGIL_LOG_PAYLOADS=1, when Celery's own bound applies."""
    from app.settings import get_settings
    from tasks.base import CELERY_RESULTREPR_MAXSIZE
    from tasks.inference import generate

    assert generate.resultrepr_maxsize == 0
    monkeypatch.setenv("VIGIL_LOG_PAYLOADS", "1")
    get_settings.cache_clear()
    try:
        assert generate.resultrepr_maxsize == CELERY_RESULTREPR_MAXSIZE > 0
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def test_celerys_two_lines_per_request_are_left_out_and_its_other_lines_kept(caplog):
    """After `quiet_per_request_lines`, Celery's strategy logger skips "received" before
    building it, a trace "succeeded" record is dropped before any handler, and the trace's
    other INFO lines (an expected failure, a retry) still reach the handlers."""
    from celery.app import trace as celery_trace

    from app.logging_setup import quiet_per_request_lines

    strategy = logging.getLogger("celery.worker.strategy")
    trace_log = logging.getLogger("celery.app.trace")
    level, filters = strategy.level, list(trace_log.filters)
    try:
        quiet_per_request_lines()
        quiet_per_request_lines()  # idempotent
        assert not strategy.isEnabledFor(logging.INFO)
        assert len(trace_log.filters) == len(filters) + 1
        with caplog.at_level(logging.INFO, logger="celery.app.trace"):
            celery_trace.info(celery_trace.LOG_SUCCESS, {"name": "vigil.generate", "id": "r1",
                                                         "runtime": 0.1, "return_value": "x"})
            celery_trace.info(celery_trace.LOG_RETRY, {"name": "vigil.generate", "id": "r1",
                                                       "exc": "wedged"})
        assert [r.msg for r in caplog.records] == [celery_trace.LOG_RETRY]
    finally:
        strategy.setLevel(level)
        trace_log.filters[:] = filters
