"""Worker tier: a wedged worker (SIGSTOPped EngineCore: the worker process and its heartbeat are
fine, it answers every probe, and it never finishes a generation) is caught by traffic alone,
quarantined, and comes back only through a passing canary."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from app.local.embedded import wait_for
from app.state.health import HEALTHY, QUARANTINED, RESTARTING
from app.state.store import RequestStore
from tasks.inference import generate
from tests.worker_procs import (RunningWorker, assert_each_ran_to_a_result_once,
                                every_request_taken, stepped_aside)

pytestmark = pytest.mark.worker
STALL_TIMEOUT_S = 8
# Far above the stall timeout, so only the stall watchdog can catch the wedge within the test:
# the requests' own timeouts would take 600 s.
REQUEST_TIMEOUT_S = 600
# The watchdog looks every min(1 s, stall / 4); then the aborted requests' task threads report
# to the ledger and the third report quarantines. Measured 8.9 s in all; the margin is for a
# loaded 2-core machine (the other worker busy on both cores).
CAUGHT_BOUND_S = STALL_TIMEOUT_S + 1 + 6
POOL_QUEUE = "vigil.pool.tiny-llama"


def test_a_worker_answering_every_probe_but_finishing_no_generation_is_quarantined(
        warm_worker, redis_server, tmp_path):
    """Given two workers under load, the victim's request timeout far above its stall timeout
    (600 s, 8 s), when the EngineCore of the victim is SIGSTOPped (its heartbeat goes on), then
    its stall watchdog declares one stall and the worker is QUARANTINED from traffic alone
    within the stall timeout plus the watchdog's period and a margin (15 s), every report that
    condemned it a stall; every request it held completes on the other worker, exactly once,
    having run at most twice; no request begins on it while quarantined; and after its engine
    restart and a passing canary it is HEALTHY and serves again."""
    client = redis_server.client()
    store = RequestStore(client, 3600)
    victim = RunningWorker(redis_server, "wedge@testhost", tmp_path,
                           VIGIL_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT_S),
                           VIGIL_STALL_TIMEOUT=str(STALL_TIMEOUT_S))
    try:
        inst = victim.wait_engine()["instance_id"]
        # The victim alone takes the requests; the other worker consumes again before the wedge.
        with stepped_aside(warm_worker.name, POOL_QUEUE):
            rs = [generate.delay(model="tiny-llama", prompt=f"a long tale {i}", max_tokens=300,
                                 ignore_eos=True) for i in range(48)]
            wait_for(lambda: every_request_taken(store, rs, (inst,)), 120,
                     what="the victim to take every request")
        wait_for(lambda: int(victim.entry()["in_flight"]) >= 3, 60, what="the victim to be busy")
        held = {i.decode() for i in client.smembers(f"vigil:inflight:{inst}")}
        cores = victim.engine_core_pids()
        assert len(cores) == 1 and held
        wedged_at = time.time()
        os.kill(cores[0], signal.SIGSTOP)

        # Caught by traffic: the heartbeat kept saying all is well until then. The ledger's
        # failure times (read before a canary clears them) say when the third report came.
        def condemned():
            raw = client.hgetall(f"vigil:health:{inst}")
            state = raw.get(b"state", b"").decode()
            return raw if state in (QUARANTINED, RESTARTING) else None

        raw = wait_for(condemned, CAUGHT_BOUND_S + 1, interval=0.1,
                       what="the wedged worker's quarantine by its stall watchdog")
        failures = sorted(json.loads(raw[b"failures"]))
        caught_s = failures[2] - wedged_at  # the report that crossed the threshold of 3
        quarantined_at = failures[2]
        assert raw[b"last_failure_reason"].decode().startswith("stall: the engine made no "
                                                               "progress for ")
        assert caught_s <= CAUGHT_BOUND_S, caught_s
        assert victim.entry() is not None  # alive and heartbeating all along

        outs = [r.get(timeout=600) for r in rs]
        done_s = max(float(store.get(rid)["finished_at"]) for rid in held) - wedged_at
        assert all(o["completion_tokens"] == 300 for o in outs)
        by_id = {o["request_id"]: o for o in outs}
        assert all(by_id[rid]["worker"] == warm_worker.name for rid in held)
        # A held request whose engine finished just before the watchdog's abort reached it ran
        # to completion there and again on the other worker: at most twice; every other once.
        assert_each_ran_to_a_result_once(store, [r.id for r in rs],
                                         at_most={rid: 2 for rid in held})
        # Each held request began at most once on the victim (received, not begun: handed back).
        for rid in held:
            h = store.history(rid)
            assert len(h) <= 2 and len([x for x in h if x["instance"] == inst]) <= 1, h
        # One stall declared, and no request's own timeout ever reported (600 s).
        assert int(victim.entry()["stalls"]) == 1
        reports = [ln for ln in victim.log.read_text().splitlines() if "health: " in ln]
        assert reports and all("stall: " in ln for ln in reports), reports

        back = wait_for(lambda: (e := victim.entry()) and e.get("health_state") == HEALTHY and e,
                        300, what="the canary to pass")
        healthy_at = time.time()
        assert int(back["quarantines"]) == 1 and int(back["engine_restarts"]) >= 1
        # Nothing began on the victim from its quarantine to its canary.
        for r in rs:
            for h in store.history(r.id):
                if h["instance"] == inst:
                    assert not quarantined_at + 0.5 < h["started_at"] < healthy_at, h
        print(f"\nwedge caught {caught_s:.1f} s after SIGSTOP by the stall watchdog (stall timeout"
              f" {STALL_TIMEOUT_S} s, bound {CAUGHT_BOUND_S} s, request timeout "
              f"{REQUEST_TIMEOUT_S} s); the {len(held)} requests it held were done "
              f"{done_s:.1f} s after the wedge")

        # It serves again: with the other worker stepping aside, the victim takes new work.
        with stepped_aside(warm_worker.name, POOL_QUEUE):
            again = [generate.delay(model="tiny-llama", prompt=f"after {i}", max_tokens=8)
                     for i in range(4)]
            assert all(r.get(timeout=120)["worker"] == victim.name for r in again)
    finally:
        for pid in victim.engine_core_pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        victim.stop()
