"""Redis tier: many requests' state changes in one round trip each (app/state/store_many.py),
each as set-once and as capped as alone, on a real Redis (database 1)."""
from __future__ import annotations

import json
import time

import pytest

from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.state.conn import connect
from app.state.store import (CREATED, CREATED_NEW_JOB_QUEUE, EXISTS, JOB_DELETED, OVERLOADED_JOB,
                             RequestStore)

pytestmark = pytest.mark.redis


def fields(job="many", **kw):
    return record_fields(parse_request({"model": "tiny-llama", "prompt": "p", "job": job,
                                        **kw}), time.time(), 3600)


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


@pytest.fixture()
def quiet_store(quiet_settings):
    """A store on a Redis of the module's own (tests/conftest.py `quiet_redis`), for a test that
    counts with Redis' own command counters."""
    return RequestStore(connect(quiet_settings), quiet_settings.result_ttl)


def test_many_creates_begins_and_finishes_each_as_alone_in_one_round_trip_each(store):
    now = time.time()
    made = store.create_many([(f"m{i}", fields()) for i in range(4)] + [("m0", fields())], now,
                             max_per_job=3)
    # The job's first request announces its queue; the cap of 3 refuses the fourth; m0 again
    # is the same request.
    assert made == [CREATED_NEW_JOB_QUEUE, CREATED, CREATED, OVERLOADED_JOB, EXISTS]
    assert store.get("m3") is None
    begins = store.begin_many([("m0", 0), ("m1", 0), ("m2", 1), ("nope", 0)], "w@h", 5, now, 3)
    assert [b.action for b in begins] == ["run", "run", "run", "missing"]
    assert begins[0].attempts == 1 and begins[0].token and begins[0].token != begins[1].token
    ends = store.finish_many([("m0", {"text": "a"}, None), ("m1", {"text": "b"}, None)], 5, now)
    assert [won for won, _ in ends] == [True, True]
    again = store.finish_many([("m0", {"text": "late"}, None)], 5, now)
    assert again[0][0] is False and again[0][1].result == {"text": "a"}  # set-once
    assert json.loads(store.get("m1")["result"]) == {"text": "b"}
    assert store.get("m2")["status"] == "RUNNING"


def test_a_pipeline_is_its_script_calls_alone_and_survives_an_emptied_script_cache(
        quiet_store):
    """Given Redis' script cache emptied (as by a restart), when many requests are begun and
    finished, then each request is begun and finished once (the scripts loaded, the refused
    calls sent again: attempt 1, not 2); and a pipeline asks Redis nothing before its script
    calls (no SCRIPT EXISTS round trip, which redis-py's own pipelined scripts send each
    time)."""
    store = quiet_store
    now = time.time()
    ids = [f"c{i}" for i in range(6)]
    store.create_many([(rid, fields()) for rid in ids], now)
    store.raw.script_flush()
    for part in (ids[:3], ids[3:]):  # the first with the cache empty, then as usual
        store.raw.config_resetstat()
        begins = store.begin_many([(rid, 0) for rid in part], "w@h", 5, now, 3)
        assert [(b.action, b.attempts) for b in begins] == [("run", 1)] * 3
        ends = store.finish_many([(rid, {"text": rid}, None) for rid in part], 5, now)
        assert [won for won, _ in ends] == [True] * 3
    stats = store.raw.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 6
    assert not any(k.startswith("cmdstat_script") for k in stats), stats
    assert [store.get(rid)["attempts"] for rid in ids] == ["1"] * 6
    assert {store.get(rid)["status"] for rid in ids} == {"SUCCEEDED"}


def test_a_record_created_among_many_is_the_record_redis_py_writes_alone(store):
    """Given the same requests created alone and among many (CREATE: a run per job and pool, one
    JSON argument of fields per request), then each record is, field for field and to the
    byte, what redis-py's own HSET writes for those fields (floats, a non-ASCII and a quoted
    prompt, a LoRA; a value that is not a string or a number as JSON), and every index
    (deadlines, job and pool sets, the job's queue) holds it alike."""
    now = time.time()
    reqs = [fields(prompt='héllo "w" \\ 🎉'), fields(job="other", lora="tiny-lora"),
            fields(job="other", temperature=0.7, max_tokens=3),
            {**fields(), "tags": {"k": [1, "é"]}}]
    alone = [store.create(f"a{i}", f, now) for i, f in enumerate(reqs)]
    many = store.create_many([(f"b{i}", f) for i, f in enumerate(reqs)], now)
    assert alone == [CREATED_NEW_JOB_QUEUE, CREATED_NEW_JOB_QUEUE, CREATED, CREATED]
    assert many == [CREATED] * 4  # the jobs' queues were new to the first only
    assert json.loads(store.get("b3")["tags"]) == {"k": [1, "é"]}
    raw = store.raw
    for i, f in enumerate(reqs):
        raw.hset(f"reference:{i}", mapping={
            k: v if isinstance(v, (str, bytes, int, float)) else json.dumps(v)
            for k, v in f.items()})
        assert raw.hgetall(f"vigil:req:b{i}") == raw.hgetall(f"reference:{i}")
        assert raw.hgetall(f"vigil:req:a{i}") == raw.hgetall(f"reference:{i}")
        assert raw.zscore("vigil:deadlines", f"b{i}") == raw.zscore("vigil:deadlines", f"a{i}")
    assert json.loads(store.get("b0")["request"])["prompt"] == 'héllo "w" \\ 🎉'
    for job, ids in (("many", {"0", "3"}), ("other", {"1", "2"})):
        members = raw.smembers(f"vigil:jobreqs:{job}")
        assert {m.decode() for m in members} >= {p + i for p in "ab" for i in ids}


def test_many_creates_across_jobs_keep_each_cap_and_order(store):
    """Given requests of two jobs interleaved and a cap of 2 per job, then each job's third is
    refused (nothing written), in the callers' order, and a job deleted refuses all of its."""
    now = time.time()
    items = [(f"x{i}", fields(job="ja" if i % 2 == 0 else "jb")) for i in range(6)]
    made = store.create_many(items, now, max_per_job=2)
    assert made == [CREATED_NEW_JOB_QUEUE, CREATED_NEW_JOB_QUEUE, CREATED, CREATED,
                    OVERLOADED_JOB, OVERLOADED_JOB]
    assert store.get("x4") is None and store.get("x5") is None
    store.raw.hset("vigil:job:gone", "state", "deleted")
    assert store.create_many([("g0", fields(job="gone")), ("g1", fields(job="gone"))],
                             now) == [JOB_DELETED, JOB_DELETED]
    assert store.get("g0") is None
