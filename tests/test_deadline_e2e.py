"""Worker tier: a request whose pool no worker serves never hangs: beat's deadline sweep ends it."""
from __future__ import annotations

import sys

import pytest

from app.errors import TerminalError
from app.local.embedded import start_process, stop_process, vigil_env
from tasks.inference import generate
from tests.conftest import UNSERVED_MODEL

pytestmark = pytest.mark.worker


def test_a_request_for_a_pool_no_worker_serves_ends_with_deadline_exceeded(
        warm_worker, redis_server, tmp_path):
    """Given a live worker that serves only tiny-llama and a real beat sweeping every second,
    when a request for another pool is submitted with a 2 s deadline, then r.get() raises
    deadline_exceeded shortly after the deadline instead of waiting forever."""
    beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                          "-s", str(tmp_path / "schedule")],
                         vigil_env(redis_server.url, VIGIL_DEADLINE_SWEEP_INTERVAL="1"),
                         tmp_path / "beat.log")
    try:
        r = generate.delay(model=UNSERVED_MODEL, prompt="anyone there?", max_tokens=4,
                           deadline_s=2)
        with pytest.raises(TerminalError, match="^deadline_exceeded: "):
            r.get(timeout=90)
        rec = {k.decode(): v.decode()
               for k, v in redis_server.client().hgetall(f"vigil:req:{r.id}").items()}
        assert rec["status"] == "FAILED" and rec["attempts"] == "0"
    finally:
        stop_process(beat)
