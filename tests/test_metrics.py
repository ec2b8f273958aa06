"""Redis tier: the Prometheus metrics (app/metrics.py) as the worker's code paths move them: the
service with a scripted engine, the housekeeping functions of `(store, now)`, and the scrape-time
collector over a real engine host and real Redis (database 1, flushed per test). Counters are
process-wide, so each test compares before and after. The HTTP endpoint of a real worker is
tested in test_metrics_e2e.py."""
from __future__ import annotations

import socket
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app import metrics
from app.errors import RequestError, TransientError
from app.fleet.deadlines import sweep_deadlines
from app.fleet.reaper import reap_workers
from app.state.conn import connect
from app.state.store import RequestStore
from tests.test_store_and_service import KW, Scripted, create
from workers import metrics_server
from workers.engine.host import EngineHost
from workers.runtime import WorkerRuntime
from workers.delivery_answers import StaleDelivery
from workers.service import serve
from tests.unit_helpers import RecordingPorts

pytestmark = pytest.mark.redis
POOL = "tiny-llama"


def value(name: str, **labels) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


class Delta:
    """Sample values of the process-wide registry, relative to when it was made."""

    def __init__(self, *series):
        self.before = {s: value(s[0], **dict(s[1:])) for s in series}

    def __call__(self, name, **labels) -> float:
        key = (name, *sorted(labels.items()))
        return value(name, **labels) - self.before[key]


def series(name, **labels):
    return (name, *sorted(labels.items()))


@pytest.fixture()
def runtime(settings):
    rts = []

    def _make(script=(), **overrides):
        rt = WorkerRuntime(settings.model_copy(update=overrides), "w-test", engine="instant",
                           guard=False, ports=RecordingPorts())
        rt.host = EngineHost(Scripted(script), idle_cleanup=0).start()
        rts.append(rt)
        return rt

    yield _make
    for rt in rts:
        rt.host.shutdown(1)


def test_serve_counts_outcomes_by_code_attempts_retries_and_dropped_deliveries(runtime):
    """Given an engine that fails once with MemoryError, when a request is served (retry), its
    superseded copy arrives (stale), its retry succeeds, a duplicate arrives, and a bad request
    arrives, then each path moved its counter by one."""
    d = Delta(series("vigil_requests_total", pool=POOL, outcome="succeeded", code=""),
              series("vigil_requests_total", pool=POOL, outcome="failed", code="invalid_request"),
              series("vigil_attempts_total", pool=POOL),
              series("vigil_retries_total", pool=POOL, code="allocation_failed"),
              series("vigil_deliveries_dropped_total", pool=POOL, reason="stale"),
              series("vigil_deliveries_dropped_total", pool=POOL, reason="duplicate_delivery"))
    rt = runtime([MemoryError("KV blocks")])
    create(rt.store, "m1")
    with pytest.raises(TransientError):
        serve(rt, "m1", 0, KW)
    with pytest.raises(StaleDelivery):
        serve(rt, "m1", 0, KW)
    serve(rt, "m1", 1, KW)
    serve(rt, "m1", 1, KW)  # duplicate delivery: the stored result, nothing run
    with pytest.raises(RequestError):
        serve(rt, "bad", 0, {"model": POOL, "prompt": 42})
    assert d("vigil_retries_total", pool=POOL, code="allocation_failed") == 1
    assert d("vigil_deliveries_dropped_total", pool=POOL, reason="stale") == 1
    assert d("vigil_attempts_total", pool=POOL) == 2
    assert d("vigil_requests_total", pool=POOL, outcome="succeeded", code="") == 1
    assert d("vigil_deliveries_dropped_total", pool=POOL, reason="duplicate_delivery") == 1
    assert d("vigil_requests_total", pool=POOL, outcome="failed", code="invalid_request") == 1


def test_housekeeping_counts_runs_skips_and_the_requests_it_ends(settings):
    store = RequestStore(connect(settings), settings.result_ttl)
    d = Delta(series("vigil_requests_total", pool=POOL, outcome="failed",
                     code="deadline_exceeded"),
              series("vigil_housekeeping_duration_seconds_count", task="deadline_sweep"),
              series("vigil_housekeeping_skipped_total", task="deadline_sweep"),
              series("vigil_housekeeping_duration_seconds_count", task="reaper"),
              series("vigil_reaped_workers_total"),
              series("vigil_reaped_requests_total", outcome="requeued"))
    create(store, "late", now=time.time() - 4000)
    assert sweep_deadlines(store, time.time(), None) == 1
    assert store.try_lock("deadline_sweep", "someone-else", 60)
    assert sweep_deadlines(store, time.time(), None) == 0
    create(store, "held")
    store.begin("held", 0, "dead@h", 9, time.time() - 300, 3)
    store.raw.zadd("vigil:workers", {"9": time.time() - 300})
    republished = []
    reap_workers(store, time.time(), lambda rid, rec, disp: republished.append(rid),
                 None, reap_timeout=60, max_attempts=3)
    assert republished == ["held"]
    assert d("vigil_requests_total", pool=POOL, outcome="failed", code="deadline_exceeded") == 1
    assert d("vigil_housekeeping_duration_seconds_count", task="deadline_sweep") == 1
    assert d("vigil_housekeeping_skipped_total", task="deadline_sweep") == 1
    assert d("vigil_housekeeping_duration_seconds_count", task="reaper") == 1
    assert d("vigil_reaped_workers_total") == 1
    assert d("vigil_reaped_requests_total", outcome="requeued") == 1


def scrape(collector) -> dict[tuple, float]:
    reg = CollectorRegistry()
    reg.register(collector)
    text = generate_latest(reg).decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_collector_reads_engine_health_and_queues_when_scraped(runtime):
    """Given a worker runtime, two messages in tiny-llama's queue and one request held, then a
    scrape shows the idle engine, HEALTHY, the queue depth and the held request; after one
    served request the engine's load and generation counters moved."""
    rt = runtime()
    rt.store.raw.lpush("vigil.pool.tiny-llama", "m1", "m2")
    rt.store.hold("x", rt.instance_id)
    c = metrics_server.WorkerCollector(rt)
    s = scrape(c)
    assert s[("vigil_worker_info", ("engine_kind", "instant"), ("instance_id",
              str(rt.instance_id)), ("worker", "w-test"))] == 1
    assert s[("vigil_engine_state", ("model", ""), ("state", "empty"))] == 1
    assert s[("vigil_health_state", ("state", "HEALTHY"))] == 1
    assert s[("vigil_health_state", ("state", "QUARANTINED"))] == 0
    assert s[("vigil_queue_depth", ("pool", POOL), ("queue", "vigil.pool.tiny-llama"))] == 2
    assert s[("vigil_requests_held",)] == 1
    assert s[("vigil_engine_loads_total",)] == 0
    create(rt.store, "one")
    serve(rt, "one", 0, KW)
    s = scrape(c)
    assert s[("vigil_engine_loads_total",)] == 1
    assert s[("vigil_engine_generations_total",)] == 1
    assert s[("vigil_engine_state", ("model", POOL), ("state", "ready"))] == 1


def test_a_metrics_port_in_use_is_logged_not_fatal(runtime, caplog):
    rt = runtime()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert metrics_server.serve(rt, port, "127.0.0.1") is None
    assert "cannot listen on 127.0.0.1:%d" % port in caplog.text
