"""Worker tier: a real `vigil worker` and a real producer process meet through a Redis that is
not the suite's open loopback one: with a password, over TLS with client certificates, and
through Redis Sentinel (docs/operations.md, "Redis beyond one box").

These tests are about connectivity, not generation: each worker runs VIGIL_ENGINE=instant
(workers/engine/kinds.py, InstantEngine: answers without a model), so a worker starts in seconds and
the round trip exercises the broker, the result backend and Vigil's state over the connection
under test. Every worker and server is private to its test.
"""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from app.local.embedded import REPO, free_port, start_worker, stop_process, vigil_env, wait_for
from tests.redis_servers import (SENTINEL_MASTER, PrivateRedis, PrivateSentinel, make_tls_files,
                                 run_password)

pytestmark = pytest.mark.worker

PW = run_password()


def _run(code_or_argv, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """A separate Vigil process (python -c CODE, or argv) with `env`; its output captured."""
    argv = ([sys.executable, "-c", code_or_argv] if isinstance(code_or_argv, str)
            else code_or_argv)
    return subprocess.run(argv, env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=timeout)


PRODUCE = ("import json; from tasks.inference import generate\n"
           "r = generate.delay(model='tiny-llama', prompt='over the wire', max_tokens=4)\n"
           "print(json.dumps(r.get(timeout=100)))\n")


def serve_one_request(url: str, name: str, tmp_path: Path, check_client, **env: str) -> str:
    """Start an instant-engine worker on `url`, wait until it registered (read through
    `check_client`, a direct client of the server), send one request from a producer process
    and return the worker's log after checking the result came from that worker."""
    log = tmp_path / f"{name.split('@')[0]}.log"
    worker = start_worker(url, name, log, concurrency=4, pools="tiny-llama",
                          VIGIL_ENGINE="instant", VIGIL_HEARTBEAT_INTERVAL="1", **env)
    try:
        def registered():
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited ({worker.returncode}):\n"
                                   + log.read_text()[-3000:])
            for key in check_client.scan_iter("vigil:worker:*"):
                if check_client.hget(key, "name") == name.encode():
                    return True
            return False

        wait_for(registered, 120, 0.2, f"{name} to register")
        out = _run(PRODUCE, vigil_env(url, **env))
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["worker"] == name and result["completion_tokens"] == 4
        status = _run([sys.executable, "-m", "app.ops.cli", "status", "--json"], vigil_env(url, **env))
        assert status.returncode == 0, status.stderr[-3000:]
        snap = json.loads(status.stdout)
        assert any(w["name"] == name for w in snap["workers"])
        assert PW not in status.stdout and "@" not in snap["redis"]
    finally:
        stop_process(worker, timeout=60)
    text = log.read_text()
    assert PW not in text
    return text


def test_password_redis_round_trip_and_a_wrong_password_fails_fast_without_showing_it(
        tmp_path):
    """Given a redis-server with requirepass: when worker and producer have the password in
    VIGIL_REDIS_URL, a request is served (and neither the worker's log nor `vigil status`
    shows the password). When they have a wrong one, the producer's submit raises
    TransientError(redis_unavailable) saying the credentials were refused, and `vigil worker`
    exits 2 naming VIGIL_REDIS_URL before Celery starts; neither output shows a password."""
    server = PrivateRedis(password=PW).start()
    try:
        log = serve_one_request(server.url(), "pw@testhost", tmp_path, server.client())
        assert "redis://:**@127.0.0.1" in log  # Celery's banner, password masked

        wrong = "wrong-" + secrets.token_hex(6)
        env = vigil_env(server.url(password=wrong))
        out = _run("from tasks.inference import generate\n"
                   "from app.errors import TransientError\n"
                   "try:\n"
                   "    generate.delay(model='tiny-llama', prompt='x', max_tokens=2)\n"
                   "except TransientError as e:\n"
                   "    print(type(e).__name__, e.code, e); raise SystemExit(3)\n", env)
        assert out.returncode == 3, out.stdout + out.stderr[-3000:]
        assert out.stdout.startswith("TransientError redis_unavailable")
        assert "refused the credentials" in out.stdout

        worker = _run([sys.executable, "-m", "app.ops.cli", "worker", "--cpu", "--name",
                       "wrong@testhost"], env)
        assert worker.returncode == 2
        assert "VIGIL_REDIS_URL" in worker.stderr and "refused the credentials" in worker.stderr
        for text in (out.stdout + out.stderr, worker.stdout + worker.stderr):
            assert wrong not in text and PW not in text
    finally:
        server.stop()


def test_tls_redis_round_trip_with_a_ca_and_client_certificate_made_here(tmp_path):
    """Given a TLS-only redis-server (password too) that requires client certificates, signed
    by a CA made in this test: when worker and producer have a rediss:// URL and
    VIGIL_REDIS_TLS_CA_FILE, _CERT_FILE and _KEY_FILE, a request is served over TLS."""
    tls = make_tls_files(tmp_path / "pki")
    server = PrivateRedis(password=PW, tls=tls).start()
    try:
        log = serve_one_request(server.url(), "tls@testhost", tmp_path, server.client(),
                                VIGIL_REDIS_TLS_CA_FILE=str(tls.ca),
                                VIGIL_REDIS_TLS_CERT_FILE=str(tls.client_cert),
                                VIGIL_REDIS_TLS_KEY_FILE=str(tls.client_key))
        assert "rediss://:**@127.0.0.1" in log
    finally:
        server.stop()


def test_sentinel_url_round_trip_with_a_dead_sentinel_listed_first(tmp_path):
    """Given a password-protected master watched by a sentinel with its own password, and a
    sentinel URL whose first entry is a sentinel that is down: when worker and producer use
    that URL with VIGIL_REDIS_SENTINEL_MASTER and VIGIL_REDIS_SENTINEL_PASSWORD, a request is
    served through the live sentinel's master."""
    sentinel_pw = "sentinel-" + secrets.token_hex(6)
    master = PrivateRedis(password=PW).start()
    sentinel = PrivateSentinel(master, password=sentinel_pw).start()
    try:
        url = (f"sentinel://:{PW}@127.0.0.1:{free_port()}/0;"
               f"sentinel://:{PW}@127.0.0.1:{sentinel.port}/0")
        log = serve_one_request(url, "sentinel@testhost", tmp_path, master.client(),
                                VIGIL_REDIS_SENTINEL_MASTER=SENTINEL_MASTER,
                                VIGIL_REDIS_SENTINEL_PASSWORD=sentinel_pw)
        assert sentinel_pw not in log
    finally:
        sentinel.stop()
        master.stop()
