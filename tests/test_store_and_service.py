"""Redis tier: the request record's Lua transitions and the worker-side service, on a real
redis-server (database 1, flushed per test). The engine is a scripted fake: these tests are about
Vigil's state machine, the real engine is exercised in test_worker_e2e.py."""
from __future__ import annotations

import time

import pytest

from app.errors import RequestError, TerminalError, TransientError
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.state import keys
from app.state.conn import connect
from app.state.store import RequestStore
from workers.engine.host import EngineHost
from workers.engine.output import EngineOutput
from workers.runtime import WorkerRuntime
from workers.delivery_answers import StaleDelivery
from workers.service import serve
from tests.unit_helpers import RecordingPorts

pytestmark = pytest.mark.redis
KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}


@pytest.fixture()
def store(settings):
    return RequestStore(connect(settings), settings.result_ttl)


def create(store, rid="r1", now=None, **kw):
    req = parse_request({**KW, **kw})
    assert store.create(rid, record_fields(req, now or time.time(), 3600))
    return req


def test_create_never_overwrites_an_existing_record(store):
    create(store)
    assert not store.create("r1", {"status": "PENDING", "model": "other"})
    assert store.get("r1")["model"] == "tiny-llama"


def test_begin_claims_once_and_counts_attempts(store):
    create(store)
    b = store.begin("r1", 0, "w1", 11, time.time(), 3)
    assert b.action == "run" and b.attempts == 1
    rec = store.get("r1")
    assert rec["status"] == "RUNNING" and rec["instance"] == "11"
    assert store.raw.sismember(keys.inflight(11), "r1")


def test_a_terminal_record_answers_a_duplicate_delivery_with_the_stored_outcome(store):
    create(store)
    store.begin("r1", 0, "w1", 11, time.time(), 3)
    won, _ = store.finish("r1", 11, time.time(), result={"text": "x"})
    assert won
    b = store.begin("r1", 0, "w2", 22, time.time(), 3)
    assert b.action == "done" and b.outcome.result == {"text": "x"}
    assert store.stats()["duplicate_deliveries"] == 1
    assert not store.raw.sismember(keys.inflight(11), "r1")
    assert 0 < store.raw.ttl(keys.request("r1")) <= store.result_ttl


def test_the_first_result_wins_and_later_writers_are_counted(store):
    create(store)
    assert store.finish("r1", 1, time.time(), result={"text": "first"})[0]
    won, stored = store.finish("r1", 2, time.time(), error_kind="RequestError",
                               error="invalid_request: late")
    assert not won and stored.status == "SUCCEEDED" and stored.result == {"text": "first"}
    assert store.stats()["duplicate_results"] == 1


def test_an_older_dispatch_is_stale(store):
    create(store)
    store.begin("r1", 0, "w1", 11, time.time(), 3)
    assert store.release("r1", 11, 1, "engine_restarting: x")
    assert store.begin("r1", 0, "w2", 22, time.time(), 3).action == "stale"
    assert store.begin("r1", 1, "w2", 22, time.time(), 3).action == "run"


def test_release_is_refused_once_another_instance_owns_the_request(store):
    create(store)
    store.begin("r1", 0, "w1", 11, time.time(), 3)
    store.begin("r1", 0, "w2", 22, time.time(), 3)  # redelivery taken over by w2
    assert not store.release("r1", 11, 1, "late")
    assert store.get("r1")["instance"] == "22"


def test_past_deadline_and_out_of_attempts_are_reported(store):
    create(store, "late", now=time.time() - 7200)
    assert store.begin("late", 0, "w", 1, time.time(), 3).action == "expired"
    create(store, "tired")
    for inst in (1, 2):  # redeliveries after dead (unregistered) workers
        store.begin("tired", 0, "w", inst, time.time(), 2)
    b = store.begin("tired", 0, "w", 3, time.time(), 2)
    assert b.action == "exhausted" and b.attempts == 2


# -- the service, with a scripted engine --------------------------------------------------------
class Scripted:
    """An engine whose answers are scripted per call: an EngineOutput or an exception."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = 0
        self.dead = False

    def __call__(self, spec, plan=None):
        return self

    async def run(self, req, rid):
        self.calls += 1
        step = self.script.pop(0) if self.script else EngineOutput("ok", [1, 2], "length", 1)
        if isinstance(step, BaseException):
            raise step
        return step

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        pass


@pytest.fixture()
def runtime(settings):
    rts = []

    def _make(script=(), **overrides):
        s = settings.model_copy(update=overrides)
        rt = WorkerRuntime(s, "w-test", engine="instant", guard=False, ports=RecordingPorts())
        engine = Scripted(script)
        rt.host = EngineHost(engine, idle_cleanup=0).start()
        rt.engine = engine
        rts.append(rt)
        return rt

    yield _make
    for rt in rts:
        rt.host.shutdown(1)


def test_a_workers_state_comes_from_its_store_under_the_store_policy_or_none(runtime):
    """Given a worker runtime with an outage grace, then its health ledger rides out an outage
    under its store's policy (app/state/calls.py), and its heartbeat's registry under none
    (`RequestStore.without_grace`: the next beat tries again)."""
    rt = runtime(redis_outage_grace=30.0)
    assert rt.store.outage_grace == 30.0
    assert rt.health.ledger._call is rt.store._call
    assert rt.heartbeat.registry._call is rt.store.without_grace()._call
    assert rt.store.without_grace().outage_grace == 0


def test_serve_runs_once_and_a_duplicate_returns_the_stored_result(runtime):
    rt = runtime()
    create(rt.store, "s1")
    out = serve(rt, "s1", 0, KW)
    assert out["text"] == "ok" and out["attempts"] == 1 and out["worker"] == "w-test"
    assert serve(rt, "s1", 0, KW) == out
    assert rt.engine.calls == 1


def test_a_message_sent_around_the_producer_is_recorded_and_served(runtime):
    rt = runtime()
    out = serve(rt, "bypass", 0, KW)
    assert out["request_id"] == "bypass" and rt.store.get("bypass")["status"] == "SUCCEEDED"


def test_bad_kwargs_in_the_worker_fail_the_request_with_a_typed_error(runtime):
    rt = runtime()
    with pytest.raises(RequestError, match="^invalid_request: "):
        serve(rt, "bad", 0, {"model": "tiny-llama", "prompt": 42})
    assert rt.store.get("bad")["status"] == "FAILED" and rt.engine.calls == 0


@pytest.mark.parametrize("kwargs,code", [
    ({"max_tokens": 10**6}, "invalid_request"),  # past the model's context
    ({"prompt": None, "prompt_token_ids": [1] * 5000}, "prompt_too_long"),
])
def test_the_model_bounds_are_checked_in_the_worker_as_at_submit(runtime, kwargs, code):
    """Given a message sent around the producer (no submit ran its admit) whose request breaks
    a bound of its model, then the worker's admit (the same one: app/requests/admit.py) ends it
    with the producer's typed error and the engine never sees it."""
    rt = runtime()
    kw = {k: v for k, v in {**KW, **kwargs}.items() if v is not None}
    with pytest.raises(RequestError, match=f"^{code}: "):
        serve(rt, "far", 0, kw)
    assert rt.store.get("far")["status"] == "FAILED" and rt.engine.calls == 0


def test_a_transient_failure_retries_then_exhausts_attempts(runtime):
    rt = runtime([MemoryError("KV blocks"), MemoryError("KV blocks")], max_attempts=2)
    create(rt.store, "t1")
    with pytest.raises(TransientError) as ei:
        serve(rt, "t1", 0, KW)
    d = ei.value.decision  # backoff on attempt 1 (VIGIL_RETRY_BACKOFF 2 s), the attempt used
    assert ei.value.code == "allocation_failed" and d.uses_attempt and 0 <= d.countdown <= 2.0
    assert rt.store.get("t1")["status"] == "PENDING"
    with pytest.raises(StaleDelivery):
        serve(rt, "t1", 0, KW)  # the superseded copy of dispatch 0
    with pytest.raises(TerminalError, match="^attempts_exhausted: 2 attempts"):
        serve(rt, "t1", 1, KW)
    assert rt.store.get("t1")["status"] == "FAILED"


def test_a_transient_failure_then_success_lands_once(runtime):
    rt = runtime([MemoryError("KV blocks")])
    create(rt.store, "t2")
    with pytest.raises(TransientError):
        serve(rt, "t2", 0, KW)
    assert serve(rt, "t2", 1, KW)["attempts"] == 2


def test_a_request_past_its_deadline_fails_deadline_exceeded_without_running(runtime):
    rt = runtime()
    create(rt.store, "old", now=time.time() - 4000)
    with pytest.raises(TerminalError, match="^deadline_exceeded: "):
        serve(rt, "old", 0, KW)
    assert rt.engine.calls == 0


def test_a_retry_avoids_the_worker_it_failed_on_while_another_healthy_one_serves(runtime):
    """Given a request whose attempt failed transiently on worker A, when its retry reaches A
    again while another live HEALTHY worker B serves the pool, then A gives it back untouched
    (no attempt used, not held by A) and B runs it; with A alone, A runs it again."""
    from workers.delivery_answers import GiveBack

    a = runtime([MemoryError("KV blocks")])
    b = runtime()
    a.heartbeat.beat()
    b.heartbeat.beat()  # B registers: live, HEALTHY, serving tiny-llama
    create(a.store, "avoid-a")
    with pytest.raises(TransientError):
        serve(a, "avoid-a", 0, KW)  # attempt 1 fails on A
    with pytest.raises(GiveBack):
        serve(a, "avoid-a", 1, KW)
    rec = a.store.get("avoid-a")
    assert (rec["status"], rec["attempts"]) == ("PENDING", "1")
    assert not a.store.raw.sismember(keys.inflight(a.instance_id), "avoid-a")
    assert serve(b, "avoid-a", 1, KW)["attempts"] == 2
    assert [h["instance"] for h in a.store.history("avoid-a")] == [str(a.instance_id),
                                                                    str(b.instance_id)]


def test_a_retry_runs_again_on_the_worker_it_failed_on_when_no_other_serves(runtime):
    a = runtime([MemoryError("KV blocks")])
    a.heartbeat.beat()
    create(a.store, "alone")
    with pytest.raises(TransientError):
        serve(a, "alone", 0, KW)
    out = serve(a, "alone", 1, KW)
    assert out["attempts"] == 2 and a.engine.calls == 2


def test_memory_pressure_waits_by_time_not_attempts_then_ends(runtime):
    """Given starts refused for memory pressure, then the request waits without using up
    attempts (even with max_attempts 1), retried at least every 15 s, the squeeze's start kept
    in its record; once VIGIL_MEMORY_PRESSURE_WINDOW has passed since that start, the next
    refusal ends it attempts_exhausted saying so."""
    from tests.unit_helpers import wait_until

    squeeze = [TransientError.of("memory_pressure", "not enough free memory")] * 5
    rt = runtime(squeeze, max_attempts=1, memory_pressure_window=1.0, retry_backoff=60.0,
                 retry_backoff_max=600.0)
    create(rt.store, "squeezed")
    for dispatch in range(3):
        with pytest.raises(TransientError) as ei:
            serve(rt, "squeezed", dispatch, KW)
        d = ei.value.decision  # the service's decision, carried to the task's retry path
        assert not d.uses_attempt and d.pressure and 0 <= d.countdown <= 15.0
        rec = rt.store.get("squeezed")
        assert (rec["status"], rec["attempts"]) == ("PENDING", "0")
    since = float(rt.store.get("squeezed")["pressure_since"])
    wait_until(lambda: time.time() - since > 1.0, 5)
    with pytest.raises(TerminalError, match="^attempts_exhausted: no engine could start for "
                                           "memory pressure"):
        serve(rt, "squeezed", 3, KW)
