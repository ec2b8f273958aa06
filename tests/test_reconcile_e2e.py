"""Worker tier: beat's pool reconcile on real workers: requests for a pool that no worker
serves get one within one pass; a model no worker can fit ends at its deadline with the reason."""
from __future__ import annotations

import time

import pytest

from app import app
from app.errors import TerminalError
from app.local.embedded import wait_for
from app.state.queues import job_queue_name as queue_name
from app.state.store import RequestStore
from tasks.housekeeping import deadline_sweep, reconcile
from tasks.inference import generate
from tests.conftest import HUGE_MODEL, ROOMY_MODEL
from tests.worker_procs import RunningWorker, queued

pytestmark = pytest.mark.worker


def test_a_pool_nobody_serves_gets_a_worker_within_one_reconcile_pass(
        warm_worker, redis_server, tmp_path):
    """Given two CPU workers serving tiny-llama only, when requests arrive for another model,
    then one reconcile pass makes one of them consume that pool, and the requests complete on
    it; a model that no worker can fit is never assigned: its requests end at their deadline
    with deadline_exceeded, the reason in the error."""
    store = RequestStore(redis_server.client(), 3600)
    spare = RunningWorker(redis_server, "spare@testhost", tmp_path, VIGIL_PRELOAD="0")
    try:
        spare.wait_registered()
        # Ready for control commands (its consumer is up), as the reconcile requires.
        wait_for(lambda: app.control.ping(destination=[spare.name], timeout=1), 120,
                 what="the spare worker to answer a ping")
        rs = [generate.delay(model=ROOMY_MODEL, prompt=f"room {i}", max_tokens=8)
              for i in range(4)]
        big = generate.delay(model=HUGE_MODEL, prompt="too big", deadline_s=3)
        wait_for(lambda: queued(store.raw, queue_name(ROOMY_MODEL, "default")) == 4, 30,
                 what="the requests to wait in their queue")
        done = reconcile()
        # (other pools may get a worker too: earlier tests leave messages in unserved queues)
        chosen = dict(done["assigned"])[ROOMY_MODEL]
        assert chosen in (spare.name, warm_worker.name) and HUGE_MODEL not in dict(
            done["assigned"])
        assert "needs 100000.2 GiB free" in done["unserved"][HUGE_MODEL]
        assert all(r.get(timeout=300)["worker"] == chosen for r in rs)

        deadline = float(store.get(big.id)["deadline_at"])
        wait_for(lambda: time.time() > deadline, 30, what="the big request's deadline")
        deadline_sweep()
        with pytest.raises(TerminalError, match="^deadline_exceeded: ") as ei:
            big.get(timeout=30)
        assert "no live healthy worker can take it" in str(ei.value)
    finally:
        spare.stop()
