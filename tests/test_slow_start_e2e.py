"""Worker tier: waiting is not wedging. Engines that take longer to start than the request
timeout (two workers starting together on 2 cores; on a GPU, any large model) must not make their
workers look wedged: only time inside a running engine counts against a request."""
from __future__ import annotations

import pytest

from app.state.health import HEALTHY, HealthLedger
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import SLOW_START_MODEL
from tests.worker_procs import RunningWorker

pytestmark = pytest.mark.worker
# Below an engine start on these 2 cores (9-17 s, longer with two starting together); the drill
# adds SLOW_START_S to every start, so the test holds on a faster machine too.
REQUEST_TIMEOUT_S = 10
SLOW_START_S = 6


def test_two_workers_whose_engines_load_slower_than_the_request_timeout_serve_everything(
        redis_server, tmp_path):
    """Given two workers started together with VIGIL_REQUEST_TIMEOUT below their engine start
    time, when requests arrive while both engines are still loading, then every request is
    served, on its first attempt, no failure reaches either worker's health ledger and neither
    is quarantined."""
    client = redis_server.client()
    store = RequestStore(client, 3600)
    ledger = HealthLedger(client, window=3600, threshold=3)
    env = dict(VIGIL_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT_S), VIGIL_STALL_TIMEOUT="5",
               VIGIL_ENGINE="drill", VIGIL_DRILL=f"slow_start={SLOW_START_S}")
    workers = [RunningWorker(redis_server, f"slow{i}@testhost", tmp_path, pools=SLOW_START_MODEL,
                             **env) for i in range(2)]
    try:
        instances = [w.wait_registered()["instance_id"] for w in workers]
        assert all(int(w.entry().get("engine_loads", 0)) == 0 for w in workers)
        rs = [generate.delay(model=SLOW_START_MODEL, prompt=f"patience {i}", max_tokens=8,
                             ignore_eos=True) for i in range(24)]  # no early EOS: 8 each
        outs = [r.get(timeout=300) for r in rs]
        assert [o["completion_tokens"] for o in outs] == [8] * 24
        assert {o["attempts"] for o in outs} == {1}
        loads = {w.name: w.wait_engine()["engine_loads"] for w in workers}
        for inst in instances:
            h = ledger.read(inst)
            assert (h.state, h.streak, h.quarantines) == (HEALTHY, 0, 0), h
        for w in workers:
            log = w.log.read_text()
            assert "QUARANTINED" not in log and "health:" not in log, w.name
        # Both engines took longer to load than one request may run (the point of the test).
        assert min(_load_seconds(w.log.read_text()) for w in workers) > REQUEST_TIMEOUT_S, loads
        assert all(store.get(r.id)["status"] == "SUCCEEDED" for r in rs)
    finally:
        for w in workers:
            w.stop()


def _load_seconds(log: str) -> float:
    """The engine start time the worker logged ('engine for X ready in N s')."""
    import re

    found = re.findall(r"engine for \S+ ready in ([0-9.]+) s", log)
    return max(map(float, found)) if found else 0.0
