"""Worker tier: a SIGKILLed worker's requests are requeued by beat's reaper, not left for Redis'
visibility timeout, and every one of them ends exactly once; so do a batch object's lines (the
batch completes, each line once)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from app import app
from app.fleet import batches
from app.local.embedded import start_process, stop_process, vigil_env, wait_for
from app.requests import batch_file as fmt
from app.requests.publish import announce_queue
from app.settings import get_settings
from app.state import keys
from app.state.batches import BatchStore
from app.state.queues import job_queue_name
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import (RunningWorker, assert_each_ran_to_a_result_once, engine_processes,
                            every_request_taken, wait_processes_gone)

pytestmark = pytest.mark.worker
REAP_TIMEOUT_S = 8


def test_a_sigkilled_workers_requests_complete_on_another_worker_exactly_once(
        warm_worker, redis_server, tmp_path):
    """Given two live workers and a real beat reaping after 8 s of silence, when one worker's
    main process is SIGKILLed with requests in flight, then its engine processes exit within
    seconds (the orphan guard), and every request completes exactly once, those it held on
    their second attempt on the survivor, long before Redis' visibility timeout would have
    brought them back; those that had streamed tokens continue from them (resume) and come
    out token-identical to an uninterrupted run. A batch object running beside them (its
    lines on both workers when the kill comes) completes with each line recorded once and
    each line's request finished once by an engine."""
    store = RequestStore(redis_server.client(), 3600)
    beat = None
    victim = RunningWorker(redis_server, "victim2@testhost", tmp_path)
    try:
        entry = victim.wait_engine()
        inst = entry["instance_id"]
        # A batch object first: its six lines are taken by both workers before the 32 come.
        bs, now = BatchStore(store.raw), time.time()
        lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny-llama", "prompt": f"a batch story {i}",
                           "max_tokens": 150, "ignore_eos": True}} for i in range(6)]
        f = batches.upload_file(bs, "".join(json.dumps(x) + "\n" for x in lines).encode(),
                                "reaper.jsonl", "batch", now, get_settings())
        bid = batches.create_batch(bs, f["id"], "/v1/completions", "24h", None, now,
                                   get_settings())["id"]
        job = store.raw.hget(keys.batch(bid), "job").decode()
        batch_ids = [fmt.request_id_for(job, x["custom_id"]) for x in lines]
        # Both workers consume the batch's queue before beat (and its batch tick) starts, so
        # its lines spread over them instead of going to whichever heard of the queue first.
        queue = job_queue_name("tiny-llama", job)
        announce_queue(app.vigil_ports.bus, store.workers, "tiny-llama", job)
        wait_for(lambda: all(queue in (app.vigil_ports.bus.active_queues(w) or [])
                             for w in ("warm@testhost", "victim2@testhost")), 60, 0.5,
                 "both workers to consume the batch's queue")
        beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                              "-s", str(tmp_path / "schedule")],
                             vigil_env(redis_server.url,
                                       VIGIL_WORKER_REAP_TIMEOUT=str(REAP_TIMEOUT_S),
                                       VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1",
                                       VIGIL_BATCH_TICK_INTERVAL="0.5"),
                             tmp_path / "beat.log")
        wait_for(lambda: all((store.get(r) or {}).get("status") == "RUNNING" for r in batch_ids),
                 120, 0.1, "the batch's lines to run")
        # Greedy: a request resumed on the survivor must come out token-identical.
        kws = [dict(model="tiny-llama", prompt=f"a long story number {i}", max_tokens=400,
                    ignore_eos=True, temperature=0.0) for i in range(32)]
        rs = [generate.delay(**kw) for kw in kws]
        warm_inst = warm_worker.entry()["instance_id"]

        wait_for(lambda: every_request_taken(store, rs, (inst, warm_inst)), 120,
                 what="every request to be taken by a worker")
        held = {x.decode() for x in store.raw.smembers(keys.inflight(inst))}
        assert held, "the victim took no request"
        batch_held = held & set(batch_ids)
        assert batch_held, "the victim took none of the batch's lines"
        held -= batch_held
        # Killed once its requests have streamed tokens: the survivor continues from them.
        wait_for(lambda: any(int((store.get(rid) or {}).get("streamed") or 0) > 0
                             for rid in held), 60, 0.05, what="a held request's first chunk")
        children = engine_processes(victim.proc.pid)
        assert "EngineCore" in " ".join(p.name() for p in children)
        killed_at = time.monotonic()
        # The main process only: its engine processes are left to the orphan guard, which must
        # kill them within seconds, so a successor never meets memory held by its predecessor.
        os.kill(victim.proc.pid, signal.SIGKILL)
        wait_processes_gone(children)
        outs = [r.get(timeout=300) for r in rs]
        recovered_s = time.monotonic() - killed_at
        print(f"\n{len(held)} requests were on the killed worker; all 32 done "
              f"{recovered_s:.1f} s after the kill (reap timeout {REAP_TIMEOUT_S} s)")
        assert [o["request_id"] for o in outs] == [r.id for r in rs]
        assert all(o["completion_tokens"] == 400 for o in outs)
        by_id = {o["request_id"]: o for o in outs}
        wrong = [(rid, by_id[rid]["worker"], by_id[rid]["attempts"]) for rid in held
                 if by_id[rid]["worker"] != "warm@testhost" or by_id[rid]["attempts"] < 2]
        assert not wrong
        assert_each_ran_to_a_result_once(store, [r.id for r in rs])
        # Resumed from the tokens the dead worker streamed, and the same tokens as a run that
        # was never interrupted (a fresh copy of three of them, on the survivor: suite time).
        resumed = [i for i, o in enumerate(outs) if o.get("resumed_at")]
        assert resumed and all(outs[i]["request_id"] in held for i in resumed)
        again = [(i, generate.delay(**kws[i])) for i in resumed[:3]]
        for i, r in again:
            assert r.get(timeout=300)["token_ids"] == outs[i]["token_ids"], outs[i]["resumed_at"]
        print(f"{len(resumed)} of them resumed at tokens "
              f"{sorted(outs[i]['resumed_at'][0] for i in resumed)}; {len(again)} compared with "
              f"an uninterrupted run: token-identical")
        # The reaper, not the visibility timeout, brought them back.
        assert recovered_s < get_settings().visibility_timeout / 4
        assert store.raw.zscore(keys.WORKERS, inst) is None
        # The batch: completed, each line once, its killed lines run again on the survivor.
        done = wait_for(lambda: (b := batches.get_batch(bs, bid))["status"] in batches.ENDED
                        and b, 120, 0.2, "the batch to end")
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        recorded = [json.loads(x)["custom_id"] for x in batches.result_lines(bs, bid, False)]
        assert sorted(recorded) == sorted(x["custom_id"] for x in lines)
        assert_each_ran_to_a_result_once(store, batch_ids)
        assert all(int(store.get(r)["attempts"]) >= 2 for r in batch_held)
        assert "reaped worker victim2@testhost" in (tmp_path / "beat.log").read_text() or \
            "reaped worker victim2@testhost" in warm_worker.log.read_text()
    finally:
        victim.stop()
        stop_process(beat)
