"""Worker tier: `vigil demo --keep` end to end, as a newcomer runs it.

The demo starts its own private Redis, a CPU worker (the real vLLM engine on tiny-llama), the
housekeeper, beat, Flower and `vigil api`, sends its prompts from a producer process and prints a summary;
with --keep everything stays up after the summary, to be looked at, until Ctrl-C. Here its
worker runs the instant engine (the demo passes its environment on).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import requests

from app.local.embedded import start_process, stop_process, vigil_env, wait_for
from tests.conftest import CACHE_DIR

pytestmark = pytest.mark.worker


def test_demo_keep_leaves_the_fleet_and_flower_up_until_ctrl_c(tmp_path):
    """Given `vigil demo --keep --n 3`, when its summary is printed, then its last lines say the
    fleet keeps running and how to stop it, the demo process is still there, Flower answers at
    the URL and password printed and lists the demo's worker, `vigil status` on the printed
    Redis shows that worker, the demo streamed a chat completion through `vigil api` and the
    curl command it printed answers (its URL and token); when Ctrl-C (SIGINT) reaches the demo process, then it exits 0
    saying it stopped cleanly, and none of the processes it started is left."""
    log = tmp_path / "demo.log"
    # The instant engine (workers/engine/instant.py): what is tested is the demo's fleet, Flower
    # and its stop; the real engine end to end is the rest of the worker tier's.
    env = vigil_env("redis://unused:1/0", VIGIL_CACHE_DIR=str(CACHE_DIR), VIGIL_ENGINE="instant")
    env.pop("VIGIL_REDIS_URL", None)
    demo = start_process([sys.executable, "-m", "app.ops.cli", "demo", "--keep", "--n", "3",
                          "--max-tokens", "4"], env, log)
    children: list[psutil.Process] = []
    try:
        def kept() -> bool:
            if demo.poll() is not None:
                raise AssertionError(f"the demo exited ({demo.returncode}):\n"
                                     + log.read_text()[-3000:])
            return "press Ctrl-C to stop it" in log.read_text()

        wait_for(kept, 300, 0.5, "the demo's summary")
        out = log.read_text()
        m = re.search(r"Flower: (http://127\.0\.0\.1:\d+)\s+\(user vigil, password (\S+)\) — "
                      r"it keeps running until Ctrl-C", out)
        assert m, out[-2000:]
        url, password = m.group(1), m.group(2)
        redis_url = re.search(r"VIGIL_REDIS_URL=(redis://\S+) vigil status", out).group(1)
        children = psutil.Process(demo.pid).children(recursive=True)
        assert demo.poll() is None and len(children) >= 5  # redis, worker, beat, housekeeper..

        workers = requests.get(f"{url}/api/workers?refresh=1", auth=("vigil", password),
                               timeout=10).json()
        assert any(name.startswith("demo-cpu@") for name in workers), workers
        status = subprocess.run([sys.executable, "-m", "app.ops.cli", "status", "--json"],
                                env={**env, "VIGIL_REDIS_URL": redis_url}, capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "demo-cpu@" in status.stdout
        assert "the online API streams a chat completion" in out
        c = re.search(r"try it: curl -N (http://127\.0\.0\.1:\d+/v1/chat/completions) -H "
                      r"'Authorization: Bearer (\S+)'", out)
        assert c, out[-2000:]
        chat = requests.post(c.group(1), headers={"Authorization": f"Bearer {c.group(2)}"},
                             json={"model": "tiny-llama", "max_tokens": 4,
                                   "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"

        os.kill(demo.pid, signal.SIGINT)  # what Ctrl-C sends (the children have own groups)
        assert demo.wait(timeout=120) == 0
        assert "stopped cleanly: no process left" in log.read_text()
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                 for p in children), 30, 0.2, "the demo's processes to exit")
    finally:
        if demo.poll() is None:
            stop_process(demo, timeout=90)
        for p in children:  # each in a process group of its own: a failed test kills them here
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
