"""Worker tier: interactive and bulk on one worker (the real vLLM CPU engine, an engine batch of
4, six task threads, two of them kept from bulk work): with the engine full of long greedy bulk
generations and more bulk queued, an interactive request starts at once by preempting the
youngest bulk run, and finishes within a small multiple of its idle latency; the preempted bulk
request resumes from its stream and ends token-identical to an uninterrupted twin; no token is
thrown away (the worker's own vigil_tokens_discarded_total); the engine's output count (vLLM's,
witness outside Vigil's records) shows every bulk token made once."""
from __future__ import annotations

import re
import time
import uuid

import pytest
import requests

from app.local.embedded import free_port, wait_for
from app.state.store import shared_store
from tasks.inference import generate
from tests.conftest import TIERS_MODEL, RunningWorker, assert_witnessed

pytestmark = pytest.mark.worker
LONG = 240  # tokens per bulk generation


def scrape(port: int) -> str:
    return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def discarded(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^vigil_tokens_discarded_total\{[^}]*\} (\S+)",
                                            text, re.M))


def interactive(job: str) -> float:
    t0 = time.monotonic()
    out = generate.delay(model=TIERS_MODEL, prompt="quick", max_tokens=8, temperature=0.0,
                         ignore_eos=True, job=job, priority="interactive").get(timeout=120)
    assert out["completion_tokens"] == 8
    return time.monotonic() - t0


def test_an_interactive_request_preempts_bulk_work_that_resumes_identical(redis_server, tmp_path):
    port = free_port()
    w = RunningWorker(redis_server, "tiers@testhost", tmp_path, pools=TIERS_MODEL, concurrency=6,
                      VIGIL_INTERACTIVE_SLOTS="2", VIGIL_METRICS_PORT=str(port))
    try:
        w.wait_engine()
        job = f"tiers-{uuid.uuid4().hex[:6]}"
        idle = min(interactive(job) for _ in range(2))
        before = discarded(scrape(port))
        bulk = [generate.delay(model=TIERS_MODEL, prompt=f"bulk number {i}", max_tokens=LONG,
                               temperature=0.0, ignore_eos=True, job=job, priority="bulk")
                for i in range(6)]
        store = shared_store()
        wait_for(lambda: sum(int((store.get(r.id) or {}).get("streamed") or 0) > 0
                             for r in bulk) >= 4, 120, 0.05, "four bulk runs streaming")
        busy = interactive(job)
        outs = [r.get(timeout=300) for r in bulk]
        preempted = [r for r in bulk if int(store.get(r.id).get("preemptions") or 0) > 0]
        print(f"tiers: interactive latency idle {idle * 1000:.0f} ms, under a full engine of "
              f"bulk work {busy * 1000:.0f} ms ({busy / idle:.1f}x); preempted "
              f"{len(preempted)} of {len(bulk)} bulk requests")
        assert preempted, "no bulk run yielded its slot"
        assert busy < 5 * idle + 1.0
        assert all(o["completion_tokens"] == LONG for o in outs)
        assert discarded(scrape(port)) == before
        # Each preempted request resumed (from its stream) and matches its uninterrupted twin.
        for r in preempted:
            out = next(o for o in outs if o["request_id"] == r.id)
            assert out["resumed_at"], out.get("resumed_at")
            twin = generate.delay(model=TIERS_MODEL, prompt=f"bulk number {bulk.index(r)}",
                                  max_tokens=LONG, temperature=0.0, ignore_eos=True,
                                  job=job).get(timeout=300)
            assert twin["token_ids"] == out["token_ids"]
        # One finished generation each, the preempted ones' resumed runs included (an aborted
        # run finishes nothing).
        assert_witnessed(store, [r.id for r in bulk])
    finally:
        w.stop()
