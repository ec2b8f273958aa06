"""Redis tier: the deadline sweep as a function of (store, now) on a real redis-server."""
from __future__ import annotations

import threading
import time

import pytest

from app.fleet.deadlines import sweep_deadlines
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.state import keys
from app.state.conn import connect
from app.state.store import RequestStore
from tests.conftest import UNSERVED_MODEL
from tests.unit_helpers import NeverTold, Told, wait_until

pytestmark = pytest.mark.redis
T0 = 1_000_000.0


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def add(store, rid, created=T0, deadline_s=60.0):
    req = parse_request({"model": "tiny-llama", "prompt": "x", "deadline_s": deadline_s})
    assert store.create(rid, record_fields(req, created, 3600))


def test_only_requests_past_their_deadline_are_failed_and_waiters_are_told(store):
    add(store, "late", deadline_s=10)
    add(store, "on-time", deadline_s=1000)
    told = Told()
    n = sweep_deadlines(store, T0 + 11, told)
    assert n == 1 and [t[0] for t in told] == ["late"]
    assert told[0][1].startswith("deadline_exceeded: ")
    assert store.get("late")["status"] == "FAILED" and store.get("late")["error_kind"] == "TerminalError"
    assert store.get("on-time")["status"] == "PENDING"
    assert store.past_deadline(T0 + 11) == []


def test_the_deadline_watch_sleeps_until_the_earliest_deadline_and_ends_it_then(store):
    """The housekeeper's watch (app/fleet/deadlines.py) on an injected clock: with no request
    open it rereads after its period; it sleeps exactly until the earliest deadline when that
    is sooner, a later one submitted meanwhile changes nothing, an earlier one shortens the
    next sleep; at the deadline it ends that request (and only it) and looks again at once."""
    from app.fleet.deadlines import WATCH_AFTER_SWEEP_S, DeadlineWatch

    now = [T0]
    told = Told()
    watch = DeadlineWatch(store, told, clock=lambda: now[0], reread_s=0.5)
    assert watch.step() == 0.5  # nothing open
    add(store, "ten", deadline_s=10)
    assert watch.step() == 0.5  # 10 s away: it rereads first
    now[0] = T0 + 9.8
    assert watch.step() == pytest.approx(0.2)
    add(store, "later", created=T0 + 9.8, deadline_s=100)
    assert watch.step() == pytest.approx(0.2)
    now[0] = T0 + 10.0
    assert watch.step() == WATCH_AFTER_SWEEP_S
    assert told.ids == ["ten"] and store.get("ten")["status"] == "FAILED"
    assert float(store.get("ten")["finished_at"]) == T0 + 10.0
    assert store.get("later")["status"] == "PENDING" and watch.step() == 0.5


def test_the_sweep_reads_in_chunks_and_finishes_a_large_backlog(store):
    for i in range(250):
        add(store, f"r{i}", deadline_s=1)
    told = Told()
    assert sweep_deadlines(store, T0 + 2, told, chunk=100) == 250
    assert len(set(told.ids)) == 250


def test_the_sweep_writes_celerys_own_results_in_one_pipeline_and_wakes_a_waiting_get(
        store, settings):
    """Given a producer already waiting in `r.get()` and a second request nobody waits on, when
    the sweep ends both through Celery's real Redis result backend (its pipelined write), then
    the waiter wakes with deadline_exceeded, a later `get()` reads the same from the backend,
    the state is FAILURE, and the result keys expire as Celery's own do."""
    from app.celery_app import create_app
    from app.errors import TerminalError

    app = create_app(settings)
    add(store, "waited", deadline_s=1)
    add(store, "unwatched", deadline_s=1)
    seen = {}

    def wait():
        try:
            app.AsyncResult("waited").get(timeout=20)
        except TerminalError as e:
            seen["error"] = str(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    key = app.backend.get_key_for_task("waited")
    # It waits subscribed to its result's channel: the PUBLISH is what must wake it.
    wait_until(lambda: store.raw.pubsub_numsub(key)[0][1] == 1, 10)
    assert sweep_deadlines(store, T0 + 2, app.backend) == 2
    waiter.join(timeout=20)
    assert seen["error"].startswith("deadline_exceeded: ")
    r = app.AsyncResult("unwatched")
    assert r.state == "FAILURE"
    with pytest.raises(TerminalError, match="^deadline_exceeded: "):
        r.get(timeout=5)
    ttl = store.raw.ttl(app.backend.get_key_for_task("unwatched"))
    assert 0 < ttl <= settings.result_ttl
    app.close()


def test_the_sweep_says_why_a_pool_was_unserved_only_for_that_pools_requests(store):
    """Given two expired requests in a chunk, one in a pool the reconcile found unserved (its
    reason recorded), then only that one's deadline_exceeded carries the reason."""
    from app.state.jobs import set_unserved

    req = parse_request({"model": UNSERVED_MODEL, "prompt": "x", "deadline_s": 1})
    assert store.create("unserved", record_fields(req, T0, 3600))
    add(store, "served", deadline_s=1)
    set_unserved(store.raw, UNSERVED_MODEL, "no worker has 9.0 GiB free", T0)
    told = Told()
    assert sweep_deadlines(store, T0 + 2, told) == 2
    errors = dict(told)
    assert errors["unserved"].endswith("; no worker has 9.0 GiB free")
    assert errors["served"] == ("deadline_exceeded: the request did not end before its deadline "
                                "(no worker finished it in time)")
    assert store.get("unserved")["error"] == errors["unserved"]


def test_a_result_written_first_wins_over_the_sweep(store):
    add(store, "done", deadline_s=1)
    store.begin("done", 0, "w", 7, T0, 3)
    store.finish("done", 7, T0 + 0.5, result={"text": "ok"})
    assert sweep_deadlines(store, T0 + 5, NeverTold()) == 0
    assert store.get("done")["status"] == "SUCCEEDED"


def test_a_running_request_past_its_deadline_leaves_its_workers_inflight_set(store):
    add(store, "stuck", deadline_s=1)
    assert store.begin("stuck", 0, "w", 7, T0, 3).action == "run"
    assert sweep_deadlines(store, T0 + 5, None) == 1
    assert not store.raw.sismember(keys.inflight(7), "stuck")
    won, stored = store.finish("stuck", 7, T0 + 6, result={"text": "too late"})
    assert not won and stored.status == "FAILED"


def test_two_sweeps_at_once_never_fail_a_request_twice(store):
    """Given two beats sweeping the same backlog concurrently, every request is failed (and its
    waiter told) exactly once."""
    for i in range(300):
        add(store, f"d{i}", deadline_s=1)
    told = Told()

    def run():
        while store.past_deadline(T0 + 2, 1):
            sweep_deadlines(store, T0 + 2, told, chunk=10)
            time.sleep(0.001)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(told) == 300 and len(set(told.ids)) == 300


def test_a_held_lock_makes_a_second_sweep_do_nothing(store):
    add(store, "x", deadline_s=1)
    assert store.try_lock("deadline_sweep", "other-beat", 30)
    assert sweep_deadlines(store, T0 + 5, None) == 0
    store.unlock("deadline_sweep", "other-beat")
    assert sweep_deadlines(store, T0 + 5, None) == 1


# -- the reaper ----------------------------------------------------------------------------------
from app.fleet.reaper import reap_workers  # noqa: E402


def register(store, instance, name, last_seen):
    store.raw.hset(keys.worker(instance), mapping={"name": name, "last_seen": last_seen})
    store.raw.zadd(keys.WORKERS, {str(instance): last_seen})


def run_on(store, instance, rid, now=T0, deadline_s=3600.0):
    add(store, rid, created=now, deadline_s=deadline_s)
    assert store.begin(rid, 0, "w", instance, now, 3).action == "run"


class Published(list):
    def __call__(self, rid, rec, dispatch):
        self.append((rid, dispatch, rec["pool"]))


def reap(store, now, published, failed=None, max_attempts=3):
    failed = Told() if failed is None else failed
    return reap_workers(store, now, published, failed,
                        reap_timeout=120, max_attempts=max_attempts)


def test_a_silent_workers_requests_are_republished_under_a_new_dispatch(store):
    """Given a worker silent past the reap timeout holding two requests and a live worker holding
    one, when the reaper runs, then the dead worker's requests are published again (dispatch 1)
    and back to PENDING, its entry is gone, and the live worker is untouched."""
    register(store, 1, "dead@h", T0)
    register(store, 2, "alive@h", T0 + 200)
    run_on(store, 1, "a")
    run_on(store, 1, "b")
    run_on(store, 2, "c")
    published = Published()
    report = reap(store, T0 + 201, published)
    assert report == {"dead@h": (2, 0)}
    assert sorted(published) == [("a", 1, "tiny-llama"), ("b", 1, "tiny-llama")]
    for rid in "ab":
        rec = store.get(rid)
        assert rec["status"] == "PENDING" and rec["dispatch"] == "1"
    assert store.get("c")["status"] == "RUNNING"
    assert store.raw.exists(keys.worker(1), keys.inflight(1)) == 0
    assert store.raw.zscore(keys.WORKERS, "1") is None and store.raw.zscore(keys.WORKERS, "2")


def test_celerys_own_copy_coming_back_later_is_dropped_and_the_requeue_runs(store):
    register(store, 1, "dead@h", T0)
    run_on(store, 1, "a")
    reap(store, T0 + 500, Published())
    assert store.begin("a", 0, "w2", 9, T0 + 600, 3).action == "stale"  # visibility-timeout copy
    b = store.begin("a", 1, "w2", 9, T0 + 600, 3)
    assert b.action == "run" and b.attempts == 2


def test_a_dead_workers_request_out_of_attempts_or_time_is_failed_not_requeued(store):
    register(store, 1, "dead@h", T0)
    run_on(store, 1, "tired")
    run_on(store, 1, "late", deadline_s=100)
    published, failed = Published(), Told()
    report = reap(store, T0 + 200, published, failed, max_attempts=1)
    assert published == [] and report == {"dead@h": (0, 2)}
    codes = dict((rid, msg.split(":")[0]) for rid, msg in failed)
    assert codes == {"tired": "attempts_exhausted", "late": "deadline_exceeded"}
    assert store.get("tired")["status"] == store.get("late")["status"] == "FAILED"


def test_a_restarted_worker_with_the_same_name_gets_a_fresh_entry_and_the_old_one_is_reaped(store):
    register(store, 1, "gpu0@h", T0)
    run_on(store, 1, "a")
    register(store, 3, "gpu0@h", T0 + 200)  # same hostname, new instance id
    report = reap(store, T0 + 201, Published())
    assert report == {"gpu0@h": (1, 0)}
    assert store.raw.exists(keys.worker(3)) and not store.raw.exists(keys.worker(1))


def test_two_reapers_at_once_requeue_each_request_once(store):
    register(store, 1, "dead@h", T0)
    for i in range(50):
        run_on(store, 1, f"r{i}")
    published = Published()
    threads = [threading.Thread(target=reap, args=(store, T0 + 500, published)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r for r, _, _ in published) == sorted(f"r{i}" for i in range(50))


def test_a_reap_timeout_below_the_floor_is_refused_unless_a_test_allows_it():
    from app.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="VIGIL_WORKER_REAP_TIMEOUT"):
        load_settings(worker_reap_timeout=10)
    assert load_settings(worker_reap_timeout=0).worker_reap_timeout == 0
    assert load_settings(worker_reap_timeout=5, allow_short_reap_timeout=True).worker_reap_timeout == 5


def test_a_request_waiting_on_a_retry_held_by_a_dead_worker_is_requeued(store):
    """Given a worker that released a request for a retry (its ETA message sits unacked in that
    worker's consumer) and then died, the reaper still finds and republishes the request."""
    register(store, 1, "dead@h", T0)
    run_on(store, 1, "retrying")
    assert store.release("retrying", 1, 1, "engine_restarting: x")
    published = Published()
    assert reap(store, T0 + 500, published) == {"dead@h": (1, 0)}
    assert published == [("retrying", 2, "tiny-llama")]
    assert store.get("retrying")["dispatch"] == "2"


def test_beginning_a_request_takes_it_out_of_its_previous_holders_set(store):
    run_on(store, 1, "moved")
    store.release("moved", 1, 1, "engine_restarting: x")
    assert store.raw.sismember(keys.inflight(1), "moved")
    assert store.begin("moved", 1, "w2", 2, T0, 3).action == "run"
    assert not store.raw.sismember(keys.inflight(1), "moved")
    assert store.raw.sismember(keys.inflight(2), "moved")


def test_a_message_received_but_not_begun_by_a_dead_worker_is_requeued(store):
    """Given a worker that received a request's message (held, not begun) and died, the reaper
    republishes it; a stale or duplicate delivery leaves no trace in a worker's set."""
    register(store, 1, "dead@h", T0 - 200)
    add(store, "held")
    store.hold("held", 1)
    published = Published()
    assert reap(store, T0 + 10, published) == {"dead@h": (1, 0)}
    assert published == [("held", 1, "tiny-llama")]
    store.hold("held", 5)
    assert store.begin("held", 0, "w", 5, T0, 3).action == "stale"
    assert not store.raw.sismember(keys.inflight(5), "held")


def test_a_heartbeat_landing_mid_reap_keeps_the_workers_entry_set_and_ledger(store):
    """Given a silent worker holding two requests, when its heartbeat lands while the reaper is
    handing back the first one (a starved heartbeat thread catching up), then the reaper hands
    back nothing more and drops nothing: the worker keeps its entry, the request it still holds
    in its in-flight set, and its health ledger (compare and delete on last_seen)."""
    from app.state.health import HealthLedger

    register(store, 1, "slow@h", T0)
    run_on(store, 1, "a")
    run_on(store, 1, "b")
    HealthLedger(store.raw, window=3600, threshold=3).failure(1, T0, "timeout")

    class HeartbeatDuringRepublish(Published):
        def __call__(self, rid, rec, dispatch):
            super().__call__(rid, rec, dispatch)
            store.workers.write(1, {"name": "slow@h"}, T0 + 499)  # the heartbeat lands now

    published = HeartbeatDuringRepublish()
    assert reap(store, T0 + 500, published) == {}
    assert len(published) == 1
    kept = ({"a", "b"} - {published[0][0]}).pop()
    assert store.raw.exists(keys.worker(1)) and store.raw.exists(keys.health(1))
    assert store.inflight_ids(1) == [kept] and store.get(kept)["status"] == "RUNNING"
    assert store.workers.last_seen(1) == T0 + 499


def test_a_workers_finish_refreshes_its_last_seen_but_never_registers_it_again(store):
    register(store, 7, "busy@h", T0)
    run_on(store, 7, "done-here", now=T0)
    store.finish("done-here", 7, T0 + 90, result={"text": "ok"})
    assert store.workers.last_seen(7) == T0 + 90  # a starved heartbeat is not silence
    run_on(store, 8, "unregistered", now=T0)
    store.finish("unregistered", 8, T0 + 90, result={"text": "ok"})
    assert store.workers.last_seen(8) is None  # a reaped worker is not brought back
    add(store, "swept", deadline_s=1)
    store.finish("swept", 0, T0 + 95, error_kind="TerminalError", error="deadline_exceeded: x")
    assert store.workers.last_seen(0) is None and store.workers.last_seen(7) == T0 + 90


def test_the_result_backend_writes_a_final_result_without_reading_first_but_never_replaces_it(
        quiet_settings):
    """Given Vigil's result backend (app/result_backend.py), a SUCCESS is written without the
    GET Celery's backend sends first (Redis' own command counts say so), and a RETRY written
    after it (a late write) still does not replace it."""
    from app.celery_app import create_app
    from app.errors import TransientError

    settings = quiet_settings  # Redis' counters are the server's: one of the module's own
    app = create_app(settings)
    r = connect(settings)

    def gets():
        return r.info("commandstats").get("cmdstat_get", {}).get("calls", 0)

    app.backend.mark_as_done("fin", {"text": "ok"})  # connections warm
    before = gets()
    app.backend.mark_as_done("fin2", {"text": "ok"})
    assert gets() == before
    app.backend.mark_as_retry("fin2", TransientError("wedged: late"))
    assert app.AsyncResult("fin2").state == "SUCCESS"
    assert app.AsyncResult("fin2").get(timeout=5) == {"text": "ok"}
    app.close()
