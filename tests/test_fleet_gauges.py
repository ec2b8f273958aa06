"""Redis tier: the fleet's gauges per pool and tier (app/fleet/fleet_gauges.py) and `vigil
metrics`, their one Prometheus endpoint (app/ops/metrics_exporter.py), on a real Redis
(database 1): requests published by the real submit at their tiers, one running on a worker
whose registry entry the real heartbeat wrote, and a message of many bulk requests counted per
request."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from app.celery_app import create_app
from app.fleet.fleet_gauges import pool_gauges
from app.local.embedded import free_port, wait_for
from app.ops import metrics_exporter
from app.state import broker
from app.requests.models import get_registry
from app.requests.submit import submit_many, submit_request
from workers.heartbeat import Heartbeat

pytestmark = pytest.mark.redis


def fleet(settings):
    app = create_app(settings)
    store = app.vigil_store

    def submit(tier, rid):
        submit_request({"model": "tiny-llama", "prompt": "p", "priority": tier}, rid,
                       settings=settings, registry=get_registry(), store=store,
                       ports=app.vigil_ports)

    submit("bulk", "b1")
    submit("bulk", "b2")
    submit("interactive", "i1")
    submit("default", "d-running")
    # A batch's window: one message of many bulk requests, each counted.
    submit_many([{"model": "tiny-llama", "prompt": f"line {i}", "priority": "bulk"}
                 for i in range(5)], settings=settings, registry=get_registry(), store=store,
                ports=app.vigil_ports)
    Heartbeat(store.workers, 5, "w@h", 10, lambda: {"pools": "tiny-llama", "in_flight": 1,
                                                     "model": "tiny-llama"}).beat()
    assert store.begin("d-running", 0, "w@h", 5, time.time(), 3).action == "run"
    return store


def test_waiting_running_and_the_oldest_wait_per_pool_and_tier(settings):
    store = fleet(settings)
    rows = {(r["pool"], r["tier"]): r for r in pool_gauges(store, get_registry(), settings,
                                                           time.time() + 30)}
    tiny = {t: rows[("tiny-llama", t)] for t in ("interactive", "default", "bulk")}
    # d-running's message is still queued (nothing popped it): it counts as waiting too; the
    # message of 5 bulk requests counts 5.
    assert [tiny[t]["waiting"] for t in tiny] == [1, 1, 7]
    assert [tiny[t]["running"] for t in tiny] == [0, 1, 0]
    assert 29 <= tiny["bulk"]["oldest_wait_s"] <= 35 and tiny["bulk"]["workers"] == 1
    # Past the messages it reads (here 1 of 3 in the bulk list: b1, next to pop), the count is
    # estimated from those: 3 messages of 1 request each.
    assert broker.requests_by_list(store.raw, "vigil.pool.tiny-llama", sample=1)[2:] == [0, 3]
    other = rows[("unserved-model", "bulk")]
    assert (other["waiting"], other["running"], other["oldest_wait_s"], other["workers"]) == (
        0, 0, None, 0)


def test_vigil_metrics_serves_them_for_prometheus(settings):
    store = fleet(settings)
    port, stop = free_port(), threading.Event()
    t = threading.Thread(target=metrics_exporter.serve, daemon=True,
                         args=(store, get_registry(), settings, port, "127.0.0.1", stop))
    t.start()
    try:
        text = wait_for(lambda: _get(port), 10, 0.1, "vigil metrics to answer")
    finally:
        stop.set()
        t.join(10)
    assert "vigil_fleet_up 1.0" in text
    assert 'vigil_pool_waiting{pool="tiny-llama",tier="bulk"} 7.0' in text
    assert 'vigil_pool_running{pool="tiny-llama",tier="default"} 1.0' in text
    assert 'vigil_pool_workers{pool="tiny-llama"} 1.0' in text
    assert 'vigil_pool_oldest_wait_seconds{pool="tiny-llama",tier="interactive"}' in text


def _get(port):
    try:
        r = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
        return r.text if r.status_code == 200 else None
    except requests.RequestException:
        return None
