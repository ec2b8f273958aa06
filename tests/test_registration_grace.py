"""Redis tier: has_pinged and the registration grace (issue 4 part 1). The reaper is a function of
(store, now) and the heartbeat takes an injected clock, so no test waits on wall time."""
from __future__ import annotations

import threading

import pytest

from app.fleet.reaper import reap_workers
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.settings import SettingsError, load_settings
from app.state import keys
from app.state.conn import connect
from app.state.store import RequestStore
from workers.heartbeat import Heartbeat

pytestmark = pytest.mark.redis
T0 = 1_000_000.0
TIMEOUT = 120.0
GRACE = 3600.0


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def register(store, instance, name, last_seen, has_pinged):
    store.raw.hset(keys.worker(instance), mapping={"name": name, "last_seen": last_seen,
                                                 "has_pinged": has_pinged})
    store.raw.zadd(keys.WORKERS, {str(instance): last_seen})


def run_on(store, instance, rid, now=T0):
    req = parse_request({"model": "tiny-llama", "prompt": "x", "deadline_s": 2 * GRACE})
    assert store.create(rid, record_fields(req, now, 2 * GRACE))
    assert store.begin(rid, 0, "w", instance, now, 3).action == "run"


def reap(store, now, published=None, **kw):
    published = [] if published is None else published
    return reap_workers(store, now, lambda rid, rec, d: published.append((rid, d)),
                        None, reap_timeout=TIMEOUT, max_attempts=3,
                        registration_grace=GRACE, **kw)


def heartbeat(store, instance, name, clock):
    return Heartbeat(store.workers, instance, name, 10.0, lambda: {"in_flight": 0}, clock=clock)


def test_a_worker_that_never_pinged_is_reaped_on_the_grace_and_a_pinged_one_on_the_timeout(store):
    """Given two workers silent since T0, one ready (has_pinged 1) and one that crashed during
    warm-up (has_pinged 0), each holding a request: when the reaper runs just past the reap
    timeout, then only the ready one is reaped; the warming one is left alone until just past
    the registration grace, and then reaped with its request requeued."""
    register(store, 1, "ready@h", T0, 1)
    register(store, 2, "warming@h", T0, 0)
    run_on(store, 1, "a")
    run_on(store, 2, "b")
    published: list = []
    assert reap(store, T0 + TIMEOUT + 1, published) == {"ready@h": (1, 0)}
    assert published == [("a", 1)]
    assert reap(store, T0 + GRACE - 1, published) == {}
    assert store.raw.exists(keys.worker(2)) and store.get("b")["status"] == "RUNNING"
    assert reap(store, T0 + GRACE + 1, published) == {"warming@h": (1, 0)}
    assert published == [("a", 1), ("b", 1)]
    assert store.raw.zcard(keys.WORKERS) == 0 and not store.raw.exists(keys.worker(2))


def test_workers_in_their_grace_do_not_hide_a_dead_ready_worker_behind_them(store):
    """Given 250 warming workers (has_pinged 0, inside their grace) seen before a dead ready
    worker, so they fill the first chunks of the scan, when the reaper reads 100 at a time,
    then it still reaches and reaps the ready one in the same run, and leaves the 250 alone."""
    for i in range(250):
        register(store, 100 + i, f"warming{i}@h", T0 - 100, 0)
    register(store, 1, "dead@h", T0, 1)
    assert reap(store, T0 + TIMEOUT + 1, chunk=100) == {"dead@h": (0, 0)}
    assert store.raw.zcard(keys.WORKERS) == 250


def test_the_heartbeat_says_has_pinged_only_once_the_worker_is_ready(store):
    """The entry is written with has_pinged 0 at registration; mark_ready writes 1 itself before
    it returns (no heartbeat thread runs here), so a worker killed right after it is judged by
    the reap timeout; later writes keep 1."""
    now = [T0]
    hb = heartbeat(store, 7, "w@h", lambda: now[0])
    hb.beat()
    assert store.raw.hget(keys.worker(7), "has_pinged") == b"0"
    now[0] = T0 + 1
    hb.mark_ready()
    assert store.raw.hget(keys.worker(7), "has_pinged") == b"1"
    assert store.raw.zscore(keys.WORKERS, "7") == T0 + 1
    hb.beat()
    assert store.raw.hget(keys.worker(7), "has_pinged") == b"1"


def test_a_worker_restarted_with_the_same_name_gets_a_fresh_entry_and_the_dead_one_is_reaped(
        store):
    """Given a ready worker gpu0@h (real Heartbeat) holding a request that dies at T0, and the
    same hostname started again at T0 + 200 (a new process: new instance id, still warming up),
    when the reaper runs, then the dead instance is reaped on its own (its request requeued)
    and the new one keeps its own fresh entry: its start time, has_pinged 0, nothing of the
    dead one's."""
    now = [T0]
    old = heartbeat(store, 1, "gpu0@h", lambda: now[0])
    old.mark_ready()
    old.beat()
    run_on(store, 1, "a")
    now[0] = T0 + 200
    new = heartbeat(store, 2, "gpu0@h", lambda: now[0])
    new.beat()
    assert reap(store, T0 + 201) == {"gpu0@h": (1, 0)}
    assert not store.raw.exists(keys.worker(1), keys.inflight(1))
    entry = {k.decode(): v.decode() for k, v in store.raw.hgetall(keys.worker(2)).items()}
    assert entry["name"] == "gpu0@h" and entry["instance_id"] == "2"
    assert float(entry["started_at"]) == T0 + 200 and entry["has_pinged"] == "0"
    assert store.raw.zrange(keys.WORKERS, 0, -1) == [b"2"]


def test_the_registration_grace_is_validated_against_the_reap_timeout():
    with pytest.raises(SettingsError, match="VIGIL_WORKER_REGISTRATION_GRACE"):
        load_settings(worker_registration_grace=60)
    with pytest.raises(SettingsError, match="VIGIL_WORKER_REGISTRATION_GRACE"):
        load_settings(worker_reap_timeout=7200)  # the default grace (1 h) is now too short
    assert load_settings(worker_reap_timeout=0, worker_registration_grace=5)
    assert load_settings().worker_registration_grace == GRACE


def test_a_cross_field_settings_error_shows_that_fields_value_only(monkeypatch):
    """A rule across fields gets every setting as its input: the message must not carry the
    others (the Flower password among them)."""
    monkeypatch.setenv("VIGIL_FLOWER_PASSWORD", "hunter2")
    monkeypatch.setenv("VIGIL_WORKER_REGISTRATION_GRACE", "30")
    with pytest.raises(SettingsError) as err:
        load_settings()
    assert "hunter2" not in str(err.value) and "(got '30')" in str(err.value)


def test_the_result_ttl_floor_is_lifted_only_by_the_test_setting():
    with pytest.raises(SettingsError, match="VIGIL_RESULT_TTL"):
        load_settings(result_ttl=5)
    assert load_settings(result_ttl=5, allow_short_result_ttl=True).result_ttl == 5


def test_worker_ready_marks_the_worker_ready_only_after_its_preload_ends(monkeypatch):
    """Given a worker whose preload is still running when Celery's worker_ready fires, it is
    marked ready (has_pinged) only once the preload ends, and also when the preload fails."""
    from workers import lifecycle, runtime

    for fails in (False, True):
        started, release, marked = threading.Event(), threading.Event(), threading.Event()

        class FakeRuntime:
            settings = load_settings(pools=["tiny-llama"], preload=True)
            pools = ["tiny-llama"]

            def preload(self, pools):
                started.set()
                release.wait(10)
                if fails:
                    raise RuntimeError("weights missing")

            def ready(self):
                marked.set()

        monkeypatch.setattr(runtime, "get_runtime", lambda name="": FakeRuntime())
        lifecycle._on_worker_ready(sender=None)
        assert started.wait(10) and not marked.is_set()  # preload blocked: not ready yet
        release.set()
        assert marked.wait(10)

    class NoPreload:
        settings = load_settings(preload=False)
        pools = ["tiny-llama"]

        def ready(self):
            marked.set()

    marked = threading.Event()
    monkeypatch.setattr(runtime, "get_runtime", lambda name="": NoPreload())
    lifecycle._on_worker_ready(sender=None)
    assert marked.is_set()


def test_instance_ids_are_63_random_bits_never_the_pid():
    """A worker instance id is uuid4's 63 low bits: positive, fits a signed 64-bit integer (and
    survives Redis and Lua as the string it is stored as), differs at every start, and is never
    the PID, which recurs across restarts."""
    import os

    from workers.runtime import new_instance_id

    ids = {new_instance_id() for _ in range(2000)}
    assert len(ids) == 2000 and all(0 < i < 2**63 for i in ids)
    assert os.getpid() not in ids and max(ids).bit_length() > 60
