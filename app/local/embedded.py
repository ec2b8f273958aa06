"""The embedded default: a private redis-server and Vigil's processes on one machine.

Used by `vigil demo`, the benchmarks and the test suite. Every process started here is put in its
own process group and stopped (TERM, then KILL) by `stop`, so nothing is left behind. Groups, not
sessions: a new session is a new scheduler autogroup on Linux, and with the engine spinning on
both cores an autogrouped Redis or producer starved (bench/README.md: "slow mode").
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from app.state.conn import answers_ping


REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `cond()` until it returns a truthy value; TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def redis_server_path(given: str | None = None) -> str:
    """The redis-server binary: `given` (a binary carried to a host without one), else the one
    on PATH; a RuntimeError saying what is wrong (`given` not an executable file) or how to
    install it."""
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise RuntimeError(f"redis-server {given!r} is not an executable file")
        return given
    path = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if not path:
        raise RuntimeError("redis-server is not installed: run `sudo apt-get install -y "
                           "redis-server` (Debian/Ubuntu), or `make setup` as root")
    return path


class EmbeddedRedis:
    """A private redis-server on a free loopback port, with its own data directory. It hands
    out its `url`, not a client: Vigil reaches Redis only through app/state/ (tests and benches
    that look at Redis directly make their own client from the url)."""

    def __init__(self, port: int | None = None, appendonly: bool = False,
                 server: str | None = None):
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="vigil-redis-"))
        self.appendonly = appendonly
        self.server = server  # the binary (redis_server_path's `given`)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10) -> "EmbeddedRedis":
        """Start the server and wait until it answers PING."""
        args = [redis_server_path(self.server), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no", "--loglevel", "warning"]
        if self.appendonly:
            args += ["--appendfsync", "everysec"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, process_group=0)
        wait_for(lambda: answers_ping(self.url), timeout,
                 what=f"redis-server on port {self.port}")
        return self

    def stop(self) -> None:
        """Stop the server (data dir removed)."""
        stop_process(self.proc)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server, keeping its data dir (for restart tests)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def vigil_env(redis_url: str, **extra: str) -> dict[str, str]:
    """Environment for a Vigil process on `redis_url` (PYTHONPATH set to this checkout)."""
    env = dict(os.environ)
    env["VIGIL_REDIS_URL"] = redis_url
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def start_process(argv: list[str], env: dict[str, str], log_path: Path | None = None
                  ) -> subprocess.Popen:
    """Start a child in its own process group, output to `log_path` (or inherited)."""
    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen(argv, env=env, cwd=str(REPO), stdout=out,
                                stderr=subprocess.STDOUT if out else None,
                                process_group=0)
    finally:
        if out:
            out.close()


def worker_command(name: str, concurrency: int | None = None, pools: str | None = None
                   ) -> list[str]:
    """The command line of `vigil worker --cpu` called `name` (pure)."""
    argv = [sys.executable, "-m", "app.ops.cli", "worker", "--cpu", "--name", name]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    if pools:
        argv += ["--pools", pools]
    return argv


def start_worker(redis_url: str, name: str, log_path: Path | None = None,
                 concurrency: int | None = None, pools: str | None = None,
                 **env: str) -> subprocess.Popen:
    """A real `vigil worker --cpu` process (a Celery threads-pool worker)."""
    return start_process(worker_command(name, concurrency, pools), vigil_env(redis_url, **env),
                         log_path)


def start_housekeeper(redis_url: str, log_path: Path | None = None, **env: str
                      ) -> subprocess.Popen:
    """A real `vigil housekeeper` process (beat's tasks, no engine)."""
    argv = [sys.executable, "-m", "app.ops.cli", "housekeeper"]
    return start_process(argv, vigil_env(redis_url, **env), log_path)


def stop_process(proc: subprocess.Popen | None, timeout: float = 30) -> None:
    """TERM the process group, wait, then KILL whatever is left of it."""
    if proc is None or proc.poll() is not None and not _group_alive(proc.pid):
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid):
                return
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
