"""Worker tier: a worker's engine processes never outlive it, and a clean stop leaks nothing."""
from __future__ import annotations

import os
import signal

import psutil
import pytest

from app.embedded import wait_for
from tasks.inference import generate
from tests.conftest import RunningWorker

pytestmark = pytest.mark.worker


def engine_processes(pid: int) -> list[psutil.Process]:
    """Live descendants of the worker, less its orphan guard."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "orphan_guard" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_a_sigkilled_worker_leaves_no_engine_process_behind(redis_server, tmp_path):
    """Given a worker with a warm engine (EngineCore + model process), when its main process is
    SIGKILLed, then every engine process is gone within seconds (the orphan guard kills them),
    so a successor never meets memory held by its dead predecessor."""
    w = RunningWorker(redis_server, "victim@testhost", tmp_path)
    try:
        w.wait_engine()
        children = engine_processes(w.proc.pid)
        names = " ".join(p.name() for p in children)
        assert "EngineCore" in names, names
        os.kill(w.proc.pid, signal.SIGKILL)
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                 for p in children), 30, what="engine processes to exit")
    finally:
        w.stop()


def test_a_clean_stop_shuts_the_engine_down_and_unregisters(redis_server, tmp_path):
    """Given a worker that served a request, when it gets SIGTERM, then it exits 0 after shutting
    its engine down: no engine process left, no leaked shared memory or __del__ noise in its log,
    and its registry entry is gone."""
    w = RunningWorker(redis_server, "clean@testhost", tmp_path)
    try:
        w.wait_engine()
        assert generate.delay(model="tiny-llama", prompt="hi", max_tokens=4).get(timeout=120)
        children = engine_processes(w.proc.pid)
        os.kill(w.proc.pid, signal.SIGTERM)
        assert w.proc.wait(timeout=120) == 0
        wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                 for p in children), 30, what="engine processes to exit")
        log = w.log.read_text()
        for bad in ("leaked shared_memory", "__del__", "Traceback", "orphan guard"):
            assert bad not in log, f"{bad!r} in worker log"
        assert w.entry() is None
    finally:
        w.stop()
