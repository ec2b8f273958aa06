"""Worker tier: the repository's Procfile under a real `honcho start`, on this GPU-less machine.

The Procfile variant is made from the real one by text: its first GPU worker line becomes the CPU
worker `cpu1: vigil worker --cpu --name cpu1@%h` (--gpu N -> --cpu, a node name instead of gpuN),
the other GPU lines are dropped (one engine fits this machine), and beat and flower run verbatim.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import redis
import requests
from honcho.environ import parse_procfile

from app.local.embedded import REPO, free_port, start_process, vigil_env, wait_for

pytestmark = pytest.mark.worker

BIN = Path(sys.executable).parent
# Database 2 of the suite's private Redis: the warm worker of other modules consumes database 0's
# queues and would otherwise serve this test's request.
DB = 2


def cpu_procfile(real: str) -> str:
    """The Procfile for this machine: the real one with --gpu -> --cpu on one worker line."""
    out, workers = [], 0
    for line in real.splitlines():
        # gpu0, gpu1, and tensor-parallel lines such as gpu2-3 (--gpu 2-3)
        m = re.match(r"^(gpu[\d_-]+):\s*(vigil worker .*)--gpu [\d,-]+(.*)$", line)
        if m:
            workers += 1
            if workers == 1:
                out.append(f"cpu1: {m.group(2)}--cpu --name cpu1@%h{m.group(3)}")
            continue
        out.append(line)
    assert workers >= 1, "the Procfile has no GPU worker line"
    return "\n".join(out) + "\n"


def _producer(redis_url: str, prompt: str) -> subprocess.Popen:
    """A separate producer process: submits one request, prints its result as JSON."""
    code = ("import json; from tasks.inference import generate\n"
            f"r = generate.delay(model='tiny-llama', prompt={prompt!r}, max_tokens=8, "
            f"ignore_eos=True, job='honcho')\n"
            "print(json.dumps(r.get(timeout=400)))\n")
    return subprocess.Popen([sys.executable, "-c", code], env=vigil_env(redis_url),
                            cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _descendants(pid: int) -> dict[tuple[int, float], str]:
    """(pid, create_time) -> process title, for every live descendant of `pid`."""
    out = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in children:
        try:
            out[(p.pid, p.create_time())] = " ".join(p.cmdline()) + " " + p.name()
        except psutil.Error:
            continue
    return out


def _alive(procs: set[tuple[int, float]]) -> list[psutil.Process]:
    out = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_the_procfile_runs_under_honcho_serves_a_request_and_stops_leaving_no_process(
        redis_server, tmp_path):
    """Given the Procfile with its GPU worker as a CPU worker, when `honcho start` runs it against
    the suite's Redis, then the worker serves a request from a separate producer, Flower (started
    by the Procfile's `vigil flower` line) lists the worker and the housekeeper behind basic auth,
    `vigil api` answers behind its token, `vigil metrics` serves the fleet's gauges (the
    request counted by tier) and beat is up; and
    when honcho gets SIGTERM it stops every process and none of theirs survives (the worker's
    engine processes and orphan guard included)."""
    procfile = tmp_path / "Procfile"
    procfile.write_text(cpu_procfile((REPO / "Procfile").read_text()))
    procs = parse_procfile(procfile.read_text()).processes
    assert procs["cpu1"] == "vigil worker --cpu --name cpu1@%h"
    assert set(procs) == {"cpu1", "housekeeper", "beat", "flower", "web", "metrics"}
    (tmp_path / "empty.env").write_text("")
    url = f"redis://127.0.0.1:{redis_server.port}/{DB}"
    redis.Redis.from_url(url).flushdb()
    port, password = free_port(), secrets.token_urlsafe(12)
    api_port, token = free_port(), secrets.token_urlsafe(12)
    metrics_port = free_port()
    env = vigil_env(url, VIGIL_FLOWER_USER="ops", VIGIL_FLOWER_PASSWORD=password,
                    VIGIL_FLOWER_PORT=str(port), VIGIL_API_TOKEN=token,
                    VIGIL_API_PORT=str(api_port), VIGIL_METRICS_EXPORTER_PORT=str(metrics_port),
                    VIGIL_BEAT_SCHEDULE=str(tmp_path / "beat-schedule"),
                    PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    log = tmp_path / "honcho.log"
    honcho = start_process([str(BIN / "honcho"), "start", "-f", str(procfile), "-d", str(REPO),
                            "-e", str(tmp_path / "empty.env"), "--no-colour"], env, log)
    seen: dict[tuple[int, float], str] = {}  # every process honcho's children ever started

    def running(cond):
        def check():
            seen.update(_descendants(honcho.pid))
            if honcho.poll() is not None or "stopped (rc=" in log.read_text():
                raise RuntimeError("a Procfile process stopped:\n" + log.read_text()[-4000:])
            return cond()
        return check

    def flower_workers():
        try:
            r = requests.get(f"http://127.0.0.1:{port}/api/workers?refresh=1",
                             auth=("ops", password), timeout=10)
            return r.json() if r.status_code == 200 else None
        except (requests.RequestException, ValueError):
            return None

    producer = None
    try:
        producer = _producer(url, "the Procfile says hello")
        # Polling meanwhile records every process honcho's children start (the engine's included).
        wait_for(running(lambda: producer.poll() is not None), 450, 0.5, "the request's result")
        stdout, stderr = producer.communicate()
        assert producer.returncode == 0, stderr[-3000:]
        out = json.loads(stdout.strip().splitlines()[-1])
        assert out["worker"].startswith("cpu1@") and out["completion_tokens"] == 8
        workers = wait_for(running(lambda: (w := flower_workers()) and
                                   {n.split("@")[0] for n in w} == {"cpu1", "housekeeper"}
                                   and w), 120, 0.5, "Flower to list cpu1 and the housekeeper")
        assert len(workers) == 2
        assert requests.get(f"http://127.0.0.1:{port}/api/workers",
                            timeout=10).status_code == 401
        wait_for(running(lambda: "beat: Starting" in log.read_text()), 60, 0.5, "beat")
        batches = f"http://127.0.0.1:{api_port}/v1/batches"

        def api_list():
            try:
                return requests.get(batches, headers={"Authorization": f"Bearer {token}"},
                                    timeout=10)
            except requests.RequestException:
                return None

        listed = wait_for(running(api_list), 60, 0.5, "vigil api to answer")
        assert listed.status_code == 200 and listed.json()["object"] == "list"
        assert requests.get(batches, timeout=10).status_code == 401

        def gauges():
            try:
                r = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
                return r.text if r.status_code == 200 else None
            except requests.RequestException:
                return None

        text = wait_for(running(gauges), 60, 0.5, "vigil metrics to answer")
        assert "vigil_fleet_up 1.0" in text
        assert 'vigil_pool_workers{pool="tiny-llama"} 1.0' in text
        running(lambda: True)()  # a last look at the process tree
        titles = list(seen.values())
        assert any("EngineCore" in t for t in titles), titles
        assert any("workers.orphan_guard" in t for t in titles), titles
        assert password not in log.read_text() and token not in log.read_text()

        honcho.send_signal(signal.SIGTERM)
        honcho.wait(timeout=120)
        # The worker's orphan guard runs in its own process group; it kills what is left of the
        # engine a few seconds after the worker is gone, then exits.
        wait_for(lambda: not _alive(seen), 60, 0.5, "every process honcho started to exit")
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
        if honcho.poll() is None:
            os.killpg(honcho.pid, signal.SIGKILL)
        for p in _alive(seen):  # never leak into the rest of the suite, even on failure
            p.kill()
