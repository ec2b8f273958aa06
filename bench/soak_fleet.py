"""The processes a soak runs (bench/soak.py), and how they are watched and killed.

A private redis-server (append-only), two `vigil worker --cpu` processes serving one pool (the
*steady* worker, whose main process is never killed, and the *victim*, whose whole process group
is SIGKILLed, or whose main process is SIGTERMed: a drain), and any number of `celery beat`s,
each with its own schedule file.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from app.local.embedded import (REPO, EmbeddedRedis, start_housekeeper, start_process,
                                start_worker, stop_process, vigil_env, wait_for)

MODEL = "tiny-llama"
QUEUE = f"vigil.pool.{MODEL}"
STEADY = "steady@soakhost"
VICTIM = "victim@soakhost"
WORKER_CONCURRENCY = 64
SHM_DIR = "/dev/shm"


def fleet_env(cache_dir: str, reap_timeout: float, request_timeout: float) -> dict[str, str]:
    """The VIGIL_* settings every worker and beat of the soak runs with: heartbeats every
    second, the given reap timeout (below the production floor) and request timeout."""
    return dict(
        VIGIL_CACHE_DIR=cache_dir, VIGIL_HEARTBEAT_INTERVAL="1",
        VIGIL_WORKER_REAP_TIMEOUT=f"{reap_timeout:g}",
        # A dead worker that never became ready is judged by the same window (a warming worker
        # heartbeats, so it is never reaped while alive).
        VIGIL_WORKER_REGISTRATION_GRACE=f"{reap_timeout:g}",
        VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1", VIGIL_REQUEST_TIMEOUT=f"{request_timeout:g}",
        # The engine stays loaded through the drain: RSS start and end are comparable.
        VIGIL_IDLE_CLEANUP="0")


class Fleet:
    """Redis, the two workers and the beats of one soak; `close` stops them all."""

    def __init__(self, logdir: Path, env: dict[str, str]):
        self.logdir, self.env = logdir, env
        self.redis: EmbeddedRedis | None = None
        self.client = None  # a redis.Redis on self.redis
        self.procs: dict[str, subprocess.Popen] = {}  # worker node name or "beatN" -> process
        self.lock = threading.Lock()  # guards self.procs against the supervisor's restarts

    # -- starting ----------------------------------------------------------------------------
    def start_redis(self) -> str:
        """Start the private append-only Redis; returns its URL."""
        self.redis = EmbeddedRedis(appendonly=True).start()
        self.client = redis.Redis.from_url(self.redis.url)
        return self.redis.url

    def make_this_process_a_client(self) -> None:
        """Point this process's Vigil settings and Celery app (the producer's) at the fleet's
        Redis and cache. They are built once per process: raises if this process already built
        them for another Redis (a test session: run `python -m bench.soak` in a subprocess)."""
        import app as app_pkg
        from app.settings import get_settings

        os.environ["VIGIL_REDIS_URL"] = self.redis.url
        os.environ["VIGIL_CACHE_DIR"] = self.env["VIGIL_CACHE_DIR"]
        built = getattr(app_pkg, "_app", None)
        if built is None:
            get_settings.cache_clear()
        elif built.conf.broker_url != self.redis.url:
            raise RuntimeError("bench.soak needs a process whose Celery app is not built yet "
                               "(run `python -m bench.soak` in a subprocess)")

    def build_model(self) -> None:
        """Build the tiny model's weights if they are not there yet (once, here: two workers
        building it at once would race)."""
        from app.requests.model_files import is_built
        from app.requests.models import get_registry

        path = get_registry().get(MODEL).path
        if not is_built(path):
            subprocess.run([sys.executable, "-m", "app.ops.cli", "model", "build-tiny", path],
                           check=True, env=vigil_env(self.redis.url, **self.env), cwd=str(REPO),
                           stdout=subprocess.DEVNULL)

    def start_worker(self, name: str) -> subprocess.Popen:
        """Start a worker named `name` serving MODEL, logging to <logdir>/<name before @>.log
        (appended to by every incarnation)."""
        log = self.logdir / f"{name.split('@')[0]}.log"
        proc = start_worker(self.redis.url, name, log, concurrency=WORKER_CONCURRENCY,
                            pools=MODEL, **self.env)
        with self.lock:
            self.procs[name] = proc
        return proc

    def start_beats(self, n: int) -> None:
        """Start `n` celery beats, each with its own schedule file, so every housekeeping task
        is sent n times."""
        for i in range(n):
            self.procs[f"beat{i}"] = start_process(
                [sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                 "-s", str(self.logdir / f"beat{i}-schedule")],
                vigil_env(self.redis.url, **self.env), self.logdir / f"beat{i}.log")

    def start_housekeeper(self) -> None:
        """Start the housekeeper (beat's tasks on threads of its own), as the Procfile does."""
        self.procs["housekeeper"] = start_housekeeper(self.redis.url,
                                                      self.logdir / "housekeeper.log", **self.env)

    def wait_ready(self, names: tuple[str, ...], timeout: float = 600) -> None:
        """Wait until every named worker's engine is loaded; raises if one exits first."""
        for name in names:
            wait_for(lambda: self._alive_or_raise(name) and self.ready(name), timeout, 0.5,
                     f"{name}'s engine")

    def _alive_or_raise(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}); see {self.logdir}")
        return True

    # -- looking -----------------------------------------------------------------------------
    def entry(self, name: str) -> dict[str, str] | None:
        """The registry entry of the live process now running as `name` (matched by pid: a
        killed incarnation's entry stays until it is reaped), or None."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return None
        for key in self.client.scan_iter("vigil:worker:*", count=100):
            e = {k.decode(): v.decode() for k, v in self.client.hgetall(key).items()}
            if e.get("pid") == str(proc.pid) and e.get("name") == name:
                return e
        return None

    def ready(self, name: str) -> dict[str, str] | None:
        """The live worker's registry entry if its engine has loaded and is ready, else None."""
        e = self.entry(name)
        if e and int(e.get("engine_loads") or 0) >= 1 and e.get("engine_state") == "ready":
            return e
        return None

    def held(self, name: str) -> list[str]:
        """The request ids in the live worker's in-flight set (none if it is not registered)."""
        from app.state import keys

        e = self.entry(name)
        if not e:
            return []
        return sorted(x.decode() for x in self.client.smembers(keys.inflight(e["instance_id"])))

    def engine_cores(self, name: str) -> list[int]:
        """The pids of the worker's EngineCore processes (none while its engine is down)."""
        import psutil

        proc = self.procs.get(name)
        out = []
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if "EngineCore" in " ".join(p.cmdline()) + p.name():
                        out.append(p.pid)
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return out

    def memory(self, name: str) -> dict | None:
        """The worker's RSS now (MiB): "main" (its main process), "total" (main and every
        descendant: engine processes, orphan guard), and "engine_up"; None if it is gone."""
        import psutil

        try:
            p = psutil.Process(self.procs[name].pid)
            main = p.memory_info().rss
            total = main
            for c in p.children(recursive=True):
                try:
                    total += c.memory_info().rss
                except psutil.Error:
                    continue
        except psutil.Error:
            return None
        return {"main": main / 2**20, "total": total / 2**20,
                "engine_up": bool(self.ready(name) and self.engine_cores(name))}

    # -- killing -----------------------------------------------------------------------------
    def kill_worker(self, name: str) -> tuple[float, list[str], int]:
        """SIGKILL the worker's whole process group (main process, engine, orphan guard) at
        whatever moment this is, wait for it to exit, and start a fresh worker under the same
        name. Returns when it was killed (Unix time), the requests it held then, and the
        group id."""
        proc = self.procs[name]
        held = self.held(name)
        at = time.time()
        os.killpg(proc.pid, signal.SIGKILL)
        stop_process(proc, timeout=10)  # waits for it; anything left of the group is killed
        self.start_worker(name)
        return at, held, proc.pid

    def drain_worker(self, name: str, timeout: float = 120) -> tuple[float, list[str], int,
                                                                     float | None]:
        """SIGTERM the worker's main process (a scale-in: `docker stop`, a pod deleted) at
        whatever moment this is, wait for it to exit (its drain hands every request it holds
        back), then start a fresh worker under the same name. Past `timeout` s its whole group
        is SIGKILLed. Returns when it was signalled (Unix time), the requests it held then, its
        pid, and how long it took to exit (None: it had to be killed)."""
        proc = self.procs[name]
        held = self.held(name)
        at, t0 = time.time(), time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
            exit_s = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            exit_s = None
        stop_process(proc, timeout=10)  # anything left of the group is killed
        self.start_worker(name)
        return at, held, proc.pid, exit_s

    def kill_engine(self, name: str) -> tuple[float, list[str], list[int]]:
        """SIGKILL the worker's EngineCore processes (the worker restarts its engine). Returns
        when (Unix time), the requests the worker held then, and the pids killed."""
        pids = self.engine_cores(name)
        held = self.held(name)
        at = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return at, held, pids

    # -- /dev/shm and stopping ---------------------------------------------------------------
    @staticmethod
    def shm_segments() -> set[str]:
        """The POSIX shared-memory segments (vLLM's message queues, psm_*) in /dev/shm now."""
        try:
            return {f for f in os.listdir(SHM_DIR) if f.startswith("psm_")}
        except OSError:
            return set()

    @classmethod
    def shm_left(cls, before: set[str]) -> dict[str, int]:
        """The segments in /dev/shm now that were not in `before`, and the KiB they use: once
        every process stopped, leaked (another user's processes could add to this count)."""
        left = cls.shm_segments() - before
        used = 0
        for f in left:
            try:
                used += os.stat(os.path.join(SHM_DIR, f)).st_blocks * 512
            except OSError:
                continue
        return {"segments": len(left), "used_kib": used // 1024}

    def close(self) -> None:
        """Stop every process (workers, beats: all at once), then Redis; nothing is left."""
        with self.lock:
            procs = list(self.procs.values())
        stoppers = [threading.Thread(target=stop_process, args=(p, 30)) for p in procs]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if self.redis is not None:
            self.redis.stop()
