"""Redis tier: the pool reconcile (app/fleet/reconcile.py) as a function of (store, registry, now):
an unserved pool with waiting work gets the idlest healthy worker that fits its model, never one
that cannot; with none, the reason is recorded; replicas grow a pool; lent workers go back."""
from __future__ import annotations

import pytest
import redis

from app.fleet.reconcile import reconcile_pools
from app.requests.models import ModelRegistry, ModelSpec
from app.state.health import HealthLedger
from app.state.jobs import unserved_reason
from app.state.queues import job_queue_name as queue_name
from app.state.store import RequestStore
from workers.heartbeat import Heartbeat

pytestmark = pytest.mark.redis
GiB = 1 << 30
T0 = 1_800_000_000.0
REG = ModelRegistry([ModelSpec(name="x", memory_gib=2, kv_cache_floor_gib=0.5),
                     ModelSpec(name="y", memory_gib=4, kv_cache_floor_gib=1),
                     ModelSpec(name="huge", memory_gib=500, kv_cache_floor_gib=1)])


@pytest.fixture()
def store(redis_db1_url):
    return RequestStore(redis.Redis.from_url(redis_db1_url), 3600)


def worker(store, inst, name, pools, free_gib, model="", in_flight=0, configured=None, at=T0,
           ready=True):
    hb = Heartbeat(store.workers, inst, name, 10, lambda: {
        "pools": ",".join(pools), "configured_pools": ",".join(configured or pools),
        "device_free_bytes": int(free_gib * GiB), "model": model, "in_flight": in_flight},
        clock=lambda: at)
    hb.has_pinged = ready  # as mark_ready() would, without its write
    hb.beat()


def control_log():
    calls = []
    return calls, lambda name, q, add: calls.append((name, q, add))


def test_an_unserved_pool_gets_the_idlest_worker_that_fits_within_one_pass(store):
    """Given two workers serving x (one busy, one idle; both report room for y), when y has
    waiting work, then one pass assigns y to the idle one: it consumes y's queues."""
    worker(store, 1, "busy@h", ["x"], 8, model="x", in_flight=30)
    worker(store, 2, "idle@h", ["x"], 8, model="x")
    store.raw.lpush(queue_name("y", "default"), "m")
    store.raw.sadd("vigil:pooljobs:y", "eval")
    calls, control = control_log()
    done = reconcile_pools(store, REG, T0 + 1, control, live_window=120)
    assert done["assigned"] == [("y", "idle@h")]
    assert calls == [("idle@h", "vigil.pool.y", True), ("idle@h", "vigil.pool.y.job.eval", True)]
    assert unserved_reason(store.raw, "y") == ""


def test_a_worker_that_cannot_fit_the_model_is_never_chosen_and_the_reason_is_recorded(store):
    worker(store, 1, "small@h", ["x"], 3, model="x")
    worker(store, 2, "gone@h", ["x"], 900, at=T0 - 1000)  # silent: not live
    worker(store, 3, "sick@h", ["x"], 900)
    worker(store, 4, "warming@h", ["x"], 900, ready=False)  # not started: cannot take orders
    HealthLedger(store.raw, window=3600, threshold=1).failure(3, T0, "stall")  # quarantined
    store.raw.lpush(queue_name("huge", "default"), "m")
    calls, control = control_log()
    done = reconcile_pools(store, REG, T0 + 1, control, live_window=120)
    assert calls == [] and done["assigned"] == []
    reason = unserved_reason(store.raw, "huge")
    assert "needs 501.0 GiB free" in reason and done["unserved"]["huge"] == reason
    # x's worker holds x (2.5 GiB) and has 3 GiB free: y (5 GiB) fits once x is evicted
    store.raw.lpush(queue_name("y", "default"), "m")
    assert reconcile_pools(store, REG, T0 + 2, control, live_window=120)["assigned"] == [
        ("y", "small@h")]


def test_a_pool_grows_to_the_replicas_its_jobs_ask_for_and_lent_workers_go_back(store):
    worker(store, 1, "a@h", ["x"], 8, model="x")
    worker(store, 2, "b@h", ["y"], 8, model="y")
    worker(store, 3, "c@h", ["y"], 8, model="y")
    store.raw.sadd("vigil:pooljobs:x", "big")
    store.raw.hset("vigil:job:big", mapping={"replicas": 2})
    store.raw.lpush(queue_name("x", "big"), "m")
    calls, control = control_log()
    done = reconcile_pools(store, REG, T0 + 1, control, live_window=120)
    assert len(done["assigned"]) == 1 and done["assigned"][0][0] == "x"
    lent = done["assigned"][0][1]
    # the work is done and the lent worker's engine went back to y: it is released
    store.raw.delete(queue_name("x", "big"))
    worker(store, 2 if lent == "b@h" else 3, lent, ["x", "y"], 8, model="y", configured=["y"])
    calls.clear()
    done = reconcile_pools(store, REG, T0 + 2, control, live_window=120)
    assert done["released"] == [("x", lent)]
    assert (lent, "vigil.pool.x", False) in calls


def test_at_most_reconcile_concurrency_pools_get_a_worker_per_pass(store):
    reg = ModelRegistry([ModelSpec(name=f"p{i}", memory_gib=1, kv_cache_floor_gib=0.25)
                         for i in range(6)])
    for i in range(6):
        worker(store, 10 + i, f"w{i}@h", [], 8)
        store.raw.lpush(queue_name(f"p{i}", "default"), "m")
    calls, control = control_log()
    done = reconcile_pools(store, reg, T0 + 1, control, live_window=120, concurrency=4)
    assert len(done["assigned"]) == 4 and len({w for _, w in done["assigned"]}) == 4


def test_two_beats_reconciling_at_once_act_once(store, monkeypatch):
    """Given another beat's reconcile holding the lock, then this one does nothing."""
    import tasks.housekeeping as th

    monkeypatch.setattr(th, "shared_store", lambda: store)
    assert store.try_lock("pool_reconcile", "other-beat", 60)
    assert th.reconcile() == {}
    store.unlock("pool_reconcile", "other-beat")
