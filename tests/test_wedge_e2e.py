"""Worker tier: a wedged worker (SIGSTOPped EngineCore: the worker process and its heartbeat are
fine, it answers every probe, and it never finishes a generation) is caught by traffic alone,
quarantined, and comes back only through a passing canary."""
from __future__ import annotations

import os
import signal
import time

import pytest

from app import app
from app.local.embedded import wait_for
from app.state.health import HEALTHY, QUARANTINED, RESTARTING, HealthLedger
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import RunningWorker, assert_each_ran_to_a_result_once, every_request_taken

pytestmark = pytest.mark.worker
REQUEST_TIMEOUT_S = 40
STALL_TIMEOUT_S = 8
POOL_QUEUE = "vigil.pool.tiny-llama"


def test_a_worker_answering_every_probe_but_finishing_no_generation_is_quarantined(
        warm_worker, redis_server, tmp_path):
    """Given two workers under load, when the EngineCore of one is SIGSTOPped (its heartbeat goes
    on), then within request_timeout it is QUARANTINED from traffic alone (the stall watchdog
    aborts what it held and reports each as a failure); every request it held completes on the
    other worker, exactly once; no request begins on it while quarantined; and after its engine
    restart and a passing canary it is HEALTHY and serves again."""
    client = redis_server.client()
    store = RequestStore(client, 3600)
    ledger = HealthLedger(client, window=3600, threshold=3)
    victim = RunningWorker(redis_server, "wedge@testhost", tmp_path,
                           VIGIL_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT_S),
                           VIGIL_STALL_TIMEOUT=str(STALL_TIMEOUT_S))
    try:
        inst = victim.wait_engine()["instance_id"]
        warm_inst = warm_worker.entry()["instance_id"]
        rs = [generate.delay(model="tiny-llama", prompt=f"a long tale {i}", max_tokens=300,
                             ignore_eos=True) for i in range(48)]
        wait_for(lambda: every_request_taken(store, rs, (inst, warm_inst)), 120,
                 what="every request to be taken")
        wait_for(lambda: int(victim.entry()["in_flight"]) >= 3, 60, what="the victim to be busy")
        held = {i.decode() for i in client.smembers(f"vigil:inflight:{inst}")}
        cores = victim.engine_core_pids()
        assert len(cores) == 1 and held
        wedged_at = time.time()
        os.kill(cores[0], signal.SIGSTOP)

        # Caught by traffic: the heartbeat kept saying all is well until then.
        wait_for(lambda: ledger.read(inst).state in (QUARANTINED, RESTARTING),
                 REQUEST_TIMEOUT_S + 5, interval=0.1, what="the wedged worker's quarantine")
        caught_s = time.time() - wedged_at
        quarantined_at = ledger.read(inst).last_failure_at
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

        back = wait_for(lambda: (e := victim.entry()) and e.get("health_state") == HEALTHY and e,
                        300, what="the canary to pass")
        healthy_at = time.time()
        assert int(back["quarantines"]) == 1 and int(back["engine_restarts"]) >= 1
        # Nothing began on the victim from its quarantine to its canary.
        for r in rs:
            for h in store.history(r.id):
                if h["instance"] == inst:
                    assert not quarantined_at + 0.5 < h["started_at"] < healthy_at, h
        print(f"\nwedge caught {caught_s:.1f} s after SIGSTOP (stall timeout {STALL_TIMEOUT_S} s,"
              f" request timeout {REQUEST_TIMEOUT_S} s); the {len(held)} requests it held were"
              f" done {done_s:.1f} s after the wedge")

        # It serves again: with the other worker stepping aside, the victim takes new work.
        app.control.cancel_consumer(POOL_QUEUE, destination=[warm_worker.name], reply=True,
                                    timeout=10)
        try:
            again = [generate.delay(model="tiny-llama", prompt=f"after {i}", max_tokens=8)
                     for i in range(4)]
            assert all(r.get(timeout=120)["worker"] == victim.name for r in again)
        finally:
            app.control.add_consumer(POOL_QUEUE, destination=[warm_worker.name], reply=True,
                                     timeout=10)
    finally:
        for pid in victim.engine_core_pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        victim.stop()
