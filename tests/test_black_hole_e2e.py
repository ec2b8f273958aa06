"""Worker tier: a worker that fails without dying is taken out. A black hole (its live engine
answers every request at once with an engine error) and a worker that cannot start a model that
another worker serves (a broken local copy of the weights) must neither fail requests for good
nor keep taking them: their failures count against the worker, not the request."""
from __future__ import annotations

import json

import pytest

from app.local.embedded import wait_for
from app.state.health import HealthLedger
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import CACHE_DIR, fault_test_models
from tests.worker_procs import RunningWorker

pytestmark = pytest.mark.worker
EXIT_WORKER_BROKEN = 70


def touched_by(store: RequestStore, request_ids, name: str) -> list[dict]:
    """The attempts begun on worker `name` (from each request's history)."""
    return [h for rid in request_ids for h in store.history(rid) if h["worker"] == name]


def test_a_black_hole_beside_a_healthy_worker_fails_no_request_and_leaves(
        warm_worker, redis_server, tmp_path):
    """Given a healthy worker and a black hole on the same pool, when 200 requests arrive, then
    every one succeeds and none ends attempts_exhausted; the black hole's fast failures reach
    its ledger, it quarantines at the threshold and begins no attempt after that, its canaries
    fail and it leaves (exit 70); the requests it touched are counted."""
    client = redis_server.client()
    store = RequestStore(client, 3600)
    ledger = HealthLedger(client, window=3600, threshold=3)
    hole = RunningWorker(redis_server, "hole@testhost", tmp_path, VIGIL_ENGINE="drill",
                         VIGIL_DRILL="black_hole", VIGIL_MAX_CANARY_FAILURES="1",
                         VIGIL_RETRY_BACKOFF="0.5", VIGIL_RETRY_BACKOFF_MAX="2")
    try:
        inst = hole.wait_engine()["instance_id"]
        # ignore_eos: tiny-llama's random weights sample its EOS now and then (a CI run saw a
        # 2-token result among the 200); this test counts requests, not lengths.
        rs = [generate.delay(model="tiny-llama", prompt=f"into the void {i}", max_tokens=8,
                             ignore_eos=True) for i in range(200)]
        h = wait_for(lambda: (lambda x: x if x.quarantines else None)(ledger.read(inst)), 60,
                     what="the black hole's quarantine")
        assert h.state in ("QUARANTINED", "RESTARTING") and h.quarantines == 1, h
        outs = [r.get(timeout=300) for r in rs]
        assert [o["completion_tokens"] for o in outs] == [8] * 200
        assert all(o["worker"] == warm_worker.name for o in outs)
        touched = touched_by(store, [r.id for r in rs], hole.name)
        # Failed fast there (engine_error), or handed back as it quarantined (worker_lost).
        assert touched and {t["error"] for t in touched} <= {"engine_error", "worker_lost"}, \
            {(t["outcome"], t["error"]) for t in touched}
        assert any(t["error"] == "engine_error" for t in touched)
        # It stopped taking requests at the threshold: nothing begun on it after its
        # quarantine (the third failure), give or take the burst that was already in it.
        assert max(t["started_at"] for t in touched) <= h.last_failure_at + 1.0
        assert hole.proc.wait(timeout=180) == EXIT_WORKER_BROKEN
        log = hole.log.read_text()
        assert "QUARANTINED" in log and "canary_failed" in log
        print(f"the black hole touched {len(touched)} of 200 requests, "
              f"{len({t['attempt'] for t in touched})} attempt number(s)")
    finally:
        hole.stop()


def test_a_worker_that_cannot_start_a_model_another_serves_leaves_and_fails_no_request(
        warm_worker, redis_server, tmp_path):
    """Given a healthy worker serving tiny-llama and a second one whose own registry points
    tiny-llama at weights that are not there (a broken local copy), when requests arrive, then
    the second worker's failed start is its own fault (engine_start_failed), not the model's: it
    hands its requests back and leaves (exit 70), and every request succeeds; none ends
    model_not_found."""
    models = tmp_path / "broken-copy.json"
    entries = fault_test_models(CACHE_DIR) + [{"name": "tiny-llama",
                                               "path": str(tmp_path / "no-weights-here")}]
    models.write_text(json.dumps({"models": entries}))
    broken = RunningWorker(redis_server, "broken@testhost", tmp_path, VIGIL_PRELOAD="0",
                           VIGIL_MODELS_FILE=str(models))
    try:
        wait_for(lambda: (broken.entry() or {}).get("has_pinged") == "1", 120,
                 what="the broken worker to be ready")
        rs = [generate.delay(model="tiny-llama", prompt=f"anyone home {i}", max_tokens=8)
              for i in range(60)]
        outs = [r.get(timeout=300) for r in rs]
        assert [o["worker"] for o in outs] == [warm_worker.name] * 60
        assert broken.proc.wait(timeout=120) == EXIT_WORKER_BROKEN
        log = broken.log.read_text()
        assert "engine_start_failed" in log and "model_not_found: model tiny-llama" in log
    finally:
        broken.stop()
