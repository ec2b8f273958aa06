"""Worker tier: a real `vigil worker` process serves Prometheus metrics on VIGIL_METRICS_PORT,
and a scrape after a run shows its requests by outcome and code, its attempts and its engine.

The worker serves tiny-llama-drill (tiny-llama's weights under another pool name, with the real
vLLM engine: no drill faults are set) so that no other test worker takes its requests."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.errors import RequestError
from app.local.embedded import free_port, wait_for
from app.state.queues import pool_queue
from tasks.inference import generate
from tests.conftest import DRILL_MODEL
from tests.worker_procs import RunningWorker, queued

pytestmark = pytest.mark.worker


def scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def get(samples: dict, name: str, **labels) -> float:
    return samples.get((name, *sorted(labels.items())), 0.0)


def test_a_scrape_after_a_run_shows_requests_by_outcome_and_code_and_the_engine(
        redis_server, tmp_path):
    """Given a worker with metrics on a free port and its engine loaded, when three requests
    succeed and one fails prompt_too_long, then its /metrics counts 3 succeeded and 1 failed
    prompt_too_long on its pool, 4 attempts, one engine load, 12 request outputs from the
    engine's steps (3 x 4 tokens), the worker's name, a HEALTHY state and the pool's queue
    depth."""
    port = free_port()
    w = RunningWorker(redis_server, "metrics@testhost", tmp_path, pools=DRILL_MODEL,
                      VIGIL_METRICS_PORT=str(port), VIGIL_METRICS_ADDRESS="127.0.0.1")
    try:
        w.wait_engine()
        client = redis_server.client()
        # Whatever an earlier test left in this pool's queue is served before the baseline.
        wait_for(lambda: queued(client, pool_queue(DRILL_MODEL)) == 0
                 and int(w.entry()["in_flight"]) == 0, 120, 0.2, "an idle worker")
        before = scrape(port)
        ok = [generate.delay(model=DRILL_MODEL, prompt=f"count {i}", max_tokens=4,
                             ignore_eos=True) for i in range(3)]  # no early EOS: 4 each
        too_long = generate.delay(model=DRILL_MODEL, prompt="word " * 700, max_tokens=4)
        assert all(r.get(timeout=120)["completion_tokens"] == 4 for r in ok)
        with pytest.raises(RequestError, match="^prompt_too_long: "):
            too_long.get(timeout=120)

        def since(now, name, **labels):
            return get(now, name, **labels) - get(before, name, **labels)

        def counted():  # a result is readable once stored, a moment before the worker counts it
            now = scrape(port)
            done = (since(now, "vigil_requests_total", pool=DRILL_MODEL, outcome="succeeded",
                          code="") >= 3
                    and since(now, "vigil_requests_total", pool=DRILL_MODEL, outcome="failed",
                              code="prompt_too_long") >= 1)
            return now if done else None

        after = wait_for(counted, 30, 0.1, "the worker's counts of the four requests")

        def delta(name, **labels):
            return since(after, name, **labels)

        assert delta("vigil_requests_total", pool=DRILL_MODEL, outcome="succeeded", code="") == 3
        assert delta("vigil_requests_total", pool=DRILL_MODEL, outcome="failed",
                     code="prompt_too_long") == 1
        assert delta("vigil_attempts_total", pool=DRILL_MODEL) == 4
        assert get(after, "vigil_engine_loads_total") == 1
        assert delta("vigil_engine_generations_total") == 3
        # The engine's own count (what EngineCore sent): one output per request per token made,
        # in at least as many steps as one request's tokens; the refused prompt never ran.
        assert delta("vigil_engine_step_outputs_total") == 12
        assert 4 <= delta("vigil_engine_steps_total") <= 12
        assert get(after, "vigil_engine_state", state="ready", model=DRILL_MODEL) == 1
        assert get(after, "vigil_health_state", state="HEALTHY") == 1
        info = [k for k in after if k[0] == "vigil_worker_info"]
        assert len(info) == 1 and ("worker", "metrics@testhost") in info[0]
        assert get(after, "vigil_queue_depth", pool=DRILL_MODEL,
                   queue=pool_queue(DRILL_MODEL)) == 0
        assert get(after, "process_resident_memory_bytes") > 0
    finally:
        w.stop()
