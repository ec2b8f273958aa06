"""Worker tier: the soak's short version (bench/soak.py; issue 8 parts 1 and 3; its request
mix, issue 38).

Runs `python -m bench.soak` in a subprocess: the soak needs a Redis of its own and this test
process's Celery app is already built for the suite's Redis (the app is built once per process).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from app.local.embedded import start_process, stop_process, vigil_env, wait_for

pytestmark = pytest.mark.worker
N = 300
# By progress, not time, each once its target holds requests: the steady worker's EngineCore is
# SIGKILLed once 40 requests have ended, the victim worker's whole process group once 100 have.
# The producer does not pause for a kill: a message the victim's consumer takes to its grave (a
# BRPOP answered after the SIGKILL, a fetch Celery never reported) must come back through the
# reaper and its audit (app/fleet/message_audit.py), or the test fails on a lost request.
KILL_ENGINE_AT = 40
KILL_WORKER_AT = 100
# Failure codes a kill-only run may produce by design: none.
ALLOWED_FAILURES: set[str] = set()


def test_a_short_soak_with_two_beats_loses_nothing_and_runs_nothing_twice(tmp_path):
    """Given two workers and two beats on a Redis of their own, and 300 requests submitted as
    fast as a window of 96 open requests allows, when one worker's EngineCore is SIGKILLed once
    40 requests have ended and the other worker's whole process group (then restarted) once 100
    have, each while it holds requests and while the producer keeps submitting, then every
    request ends, none runs to a result twice (by its records, and by the engines' witness: one
    finished generation each, at most two for a request the killed worker held), none is
    requeued twice for one dispatch or failed twice, no dead instance is reaped twice although
    both beats send every reap, nothing fails, and the results read back through Celery's
    result backend agree with the records. The requests are of every kind and tier (`--mix`,
    bench/soak_mix.py: plain, structured, penalized, bad words, n = 2), on an engine batch bulk
    work fills, so bulk runs yield their slots to interactive requests too."""
    report_path = tmp_path / "report.json"
    out = tmp_path / "soak.out"
    argv = [sys.executable, "-m", "bench.soak", "--requests", str(N), "--max-tokens", "24",
            "--window", "96", "--rate", "0", "--beats", "2", "--mix",
            "--kill-worker-at", str(KILL_WORKER_AT), "--kill-engine-at", str(KILL_ENGINE_AT),
            "--drain-timeout", "240", "--logdir", str(tmp_path / "logs"),
            "--report", str(report_path)]
    proc = start_process(argv, vigil_env(os.environ["VIGIL_REDIS_URL"]), out)
    try:
        # SIGTERM on a timeout: the soak stops every process it started.
        wait_for(lambda: proc.poll() is not None, 540, 0.5, "the soak to finish")
    finally:
        stop_process(proc, timeout=60)
    text = out.read_text(errors="replace")
    assert report_path.exists(), f"no report; output:\n{text[-6000:]}"
    rep = json.loads(report_path.read_text())
    print("\n" + text[text.find("-- soak report --"):])

    kills = {kind: [k for k in rep["kills"] if k["kind"] == kind] for kind in ("worker", "engine")}
    assert len(kills["worker"]) >= 1 and len(kills["engine"]) >= 1, rep["kills"]
    assert all(k["held"] for k in rep["kills"]), "a kill hit a worker holding no request"
    assert rep["accepted"] == N
    assert rep["lost"] == 0, rep["lost_detail"]
    assert rep["duplicates"] == 0, rep["duplicate_ids"]
    assert rep["requeued_twice"] == 0 and rep["failed_twice"] == 0
    assert rep["stats"].get("duplicate_results", 0) == 0
    assert rep["wrong_results"] == 0
    # The engines' own witness backs every stored result, and each request ran to completion
    # exactly once; only a request the killed worker held may have twice (its engine finished
    # it just before the kill lost its finish): bench/soak_findings.py tally_witness.
    assert rep["witness_mismatches"] == 0, rep["witness_mismatch_ids"]
    assert rep["ran_too_often"] == 0, rep["ran_too_often_ids"]
    assert set(rep["generations_per_request"]) <= {"1", "2"}, rep["generations_per_request"]
    assert set(rep["failed_by_code"]) <= ALLOWED_FAILURES, rep["failed_by_code"]
    assert rep["succeeded"] == N - sum(rep["failed_by_code"].values())
    # The killed instance was reaped exactly once although two beats sent every reap.
    assert rep["reaps"] and all(n == 1 for n in rep["reaps"].values()), rep["reaps"]
    assert rep["unrecovered_kills"] == 0
    # Every kind was asked, and interactive requests preempted bulk runs (each resumed).
    assert set(rep["kinds"]) == {"plain", "structured", "penalized", "bad_words", "n2"}
    assert rep["preemptions"] >= 1, rep["preemptions"]
    assert rep["backend_checked"] > 0 and not rep["backend_disagreements"]
    assert proc.returncode == 0, text[-3000:]
