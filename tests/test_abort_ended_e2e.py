"""Worker tier: work nobody will read is stopped. A request that the deadline sweep ends while it
runs is aborted in its worker's engine within one heartbeat interval, instead of running on to
its end (a long generation holds a slot of the engine's batch for minutes)."""
from __future__ import annotations

import re
import time

import pytest

from app import app
from app.errors import TerminalError
from app.fleet.deadlines import sweep_deadlines
from app.local.embedded import wait_for
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import SLOW_START_MODEL
from tests.worker_procs import RunningWorker

pytestmark = pytest.mark.worker
# Every engine step takes this much longer, inside EngineCore (the drill's slow_step), so a
# request of MAX_TOKENS stays scheduled in vLLM for ~40 s unless vLLM aborts it.
STEP_S = 0.25
MAX_TOKENS = 160
DEADLINE_S = 3


def test_a_request_swept_while_it_runs_is_aborted_in_the_engine_within_a_heartbeat(
        redis_server, tmp_path):
    """Given a worker (heartbeat every 1 s) whose engine steps take 0.25 s each, running a
    request of 160 tokens (~40 s in vLLM), when the deadline sweep ends the request at its
    deadline, then the worker aborts it within one heartbeat interval and a little more, and
    vLLM's abort reaches EngineCore: the request leaves the engine's batch short of its 160
    tokens (EngineCore's own account, the drill's logits processor), the engine takes the next
    request at once, and the caller gets deadline_exceeded."""
    store = RequestStore(redis_server.client(), 3600)
    worker = RunningWorker(redis_server, "aborter@testhost", tmp_path, pools=SLOW_START_MODEL,
                           VIGIL_ENGINE="drill", VIGIL_DRILL=f"slow_step={STEP_S}",
                           VIGIL_STALL_TIMEOUT="0")
    try:
        worker.wait_engine()
        r = generate.delay(model=SLOW_START_MODEL, prompt="a long one", max_tokens=MAX_TOKENS,
                           ignore_eos=True, deadline_s=DEADLINE_S)
        wait_for(lambda: store.get(r.id)["status"] == "RUNNING", 30, what="the request to run")
        wait_for(lambda: int(worker.entry()["in_flight"]) == 1, 10, what="it in the engine")
        wait_for(lambda: time.time() > float(store.get(r.id)["deadline_at"]), 30,
                 what="its deadline")
        assert sweep_deadlines(store, time.time(), app.backend) == 1
        swept_at = time.time()
        wait_for(lambda: int(worker.entry()["in_flight"]) == 0, MAX_TOKENS * STEP_S,
                 interval=0.1, what="the engine to drop the swept request")
        after_end_s = time.time() - swept_at
        with pytest.raises(TerminalError, match="^deadline_exceeded: "):
            r.get(timeout=30)
        # One heartbeat (1 s) to notice, one more for the entry to say so, and some slack; the
        # engine would have held it ~30 s more otherwise.
        assert after_end_s < 5, after_end_s
        log = worker.log.read_text()
        assert "aborted 1 request(s) that ended elsewhere" in log

        # The engine is free: the next request runs at once (its first step also tells the
        # drill's processor, in EngineCore, that the swept request left the batch).
        nxt = generate.delay(model=SLOW_START_MODEL, prompt="next", max_tokens=2,
                             ignore_eos=True).get(timeout=60)
        assert nxt["completion_tokens"] == 2
        left = wait_for(lambda: re.findall(
            rf"left the engine's batch after (\d+) of {MAX_TOKENS} tokens",
            worker.log.read_text()), 10, what="EngineCore to say the swept request left")
        made = int(left[0])
        print(f"\nswept request aborted in the engine {after_end_s:.1f} s after the sweep, "
              f"after {made} of {MAX_TOKENS} tokens")
        # Made at most while it ran (to its deadline, the sweep, the abort) at 0.25 s a step.
        assert len(left) == 1 and 0 < made < MAX_TOKENS / 2, left
    finally:
        worker.stop()
