"""Worker tier: work nobody will read is stopped. A request that the deadline sweep ends while it
runs is aborted in its worker's engine within one heartbeat interval, instead of running on to
its end (a long generation holds a slot of the engine's batch for minutes)."""
from __future__ import annotations

import time

import pytest

from app import app
from app.errors import TerminalError
from app.fleet.deadlines import sweep_deadlines
from app.local.embedded import wait_for
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import SLOW_START_MODEL, RunningWorker

pytestmark = pytest.mark.worker
# Every generation stays this long in the drill's engine (cancellable, as a real one is).
RUN_S = 40
DEADLINE_S = 3


def test_a_request_swept_while_it_runs_is_aborted_in_the_engine_within_a_heartbeat(
        redis_server, tmp_path):
    """Given a worker (heartbeat every 1 s) running a request that would stay 40 s in its engine,
    when the deadline sweep ends the request at its deadline, then the worker aborts it in the
    engine within one heartbeat interval and a little more (the engine is free again), and the
    caller gets deadline_exceeded."""
    store = RequestStore(redis_server.client(), 3600)
    worker = RunningWorker(redis_server, "aborter@testhost", tmp_path, pools=SLOW_START_MODEL,
                           VIGIL_ENGINE="drill", VIGIL_DRILL=f"slow_run={RUN_S}",
                           VIGIL_STALL_TIMEOUT="0")
    try:
        worker.wait_engine()
        r = generate.delay(model=SLOW_START_MODEL, prompt="a long one", max_tokens=4,
                           deadline_s=DEADLINE_S)
        wait_for(lambda: store.get(r.id)["status"] == "RUNNING", 30, what="the request to run")
        wait_for(lambda: int(worker.entry()["in_flight"]) == 1, 10, what="it in the engine")
        wait_for(lambda: time.time() > float(store.get(r.id)["deadline_at"]), 30,
                 what="its deadline")
        assert sweep_deadlines(store, time.time(), app.backend) == 1
        swept_at = time.time()
        wait_for(lambda: int(worker.entry()["in_flight"]) == 0, RUN_S, interval=0.1,
                 what="the engine to drop the swept request")
        after_end_s = time.time() - swept_at
        with pytest.raises(TerminalError, match="^deadline_exceeded: "):
            r.get(timeout=30)
        # One heartbeat (1 s) to notice, one more for the entry to say so, and some slack; the
        # engine would have held it ~37 s more otherwise.
        assert after_end_s < 5, after_end_s
        assert "aborted 1 request(s) that ended elsewhere" in worker.log.read_text()
    finally:
        worker.stop()
