"""The suite's worker processes, forked from a parent that has already imported vLLM.

A `vigil worker` spends about half of its start importing vLLM, torch and transformers in its
main process (~13 s of CPU on these 2-core machines; the other half is its EngineCore, a spawned
process that imports them again). The suite starts some thirty workers, so that import was the
largest single cost of `make test`. Here it is paid once per test process: a zygote imports the
third-party modules a worker needs (never Vigil's own: they read their settings at import, and
each worker has its own environment), then forks each worker on request. The child is a real
`vigil worker` from there on: it gets its own process group, environment, working directory and
log file, runs app/ops/cli.py's `main()` with the worker's command line, and when the CLI execs
`celery worker`, runs Celery's own `main()` in the same process instead, after dropping every
module of Vigil's so that they import afresh under the worker's environment, as after an exec.
Its EngineCore is spawned by vLLM as in production. docs/testing.md says what this does not
cover (the plain `exec` start, which tests/test_procfile_honcho_e2e.py and the demo still use).

Run as `python -m tests.worker_zygote`: JSON lines on stdin, one answer per line on stdout.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# What a worker's main process imports that costs seconds, and carries no Vigil setting.
HEAVY = ("torch", "transformers", "vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm",
         "vllm.sampling_params", "vllm.lora.request", "celery", "celery.bin.celery",
         "celery.apps.worker", "kombu", "kombu.transport.redis", "redis", "psutil", "pydantic")
# Vigil's own packages: imported afresh in each worker (its settings come from its environment).
OURS = ("app", "tasks", "workers", "bench", "tests")


# -- the zygote ------------------------------------------------------------------------------
class _Children:
    """Exit statuses of the forked workers, reaped as soon as they exit (a worker's orphan
    guard and the reaper judge a dead worker by its pid being gone)."""

    def __init__(self):
        self.status: dict[int, int] = {}

    def reap(self, *_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.status[pid] = os.waitstatus_to_exitcode(status)


def _exec_in_place(path, argv, env=None):
    """Stands in for os.execv/os.execve in a forked worker: runs the program `argv` names (only
    `python -m MODULE ...` is supported) in this process, after dropping Vigil's modules."""
    if len(argv) < 3 or argv[1] != "-m":
        raise RuntimeError(f"the zygote can only exec `python -m MODULE`, not {argv!r}")
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    for name in [m for m in sys.modules if m.split(".")[0] in OURS]:
        del sys.modules[name]
    sys.argv = [argv[2], *argv[3:]]
    _run_module(argv[2])


def _run_module(module: str) -> None:
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a worker's crash is its exit status, as after exec
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child(order: dict) -> None:
    """In the forked process: become the worker `order` describes. Never returns."""
    try:
        os.setpgid(0, 0)
        log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 4096)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(order["env"])
        os.chdir(order["cwd"])
        os.execv = lambda path, argv: _exec_in_place(path, argv)
        os.execve = _exec_in_place
        argv = order["argv"]
        if len(argv) < 3 or argv[1] != "-m":
            raise RuntimeError(f"not a `python -m MODULE` command line: {argv!r}")
        sys.argv = [argv[2], *argv[3:]]
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        os._exit(70)
    _run_module(argv[2])


def serve() -> None:
    """The zygote's loop: import HEAVY, then answer `start` and `status` orders until stdin
    closes."""
    for name in HEAVY:
        importlib.import_module(name)
    children = _Children()
    signal.signal(signal.SIGCHLD, children.reap)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(order)
            try:
                os.setpgid(pid, pid)
            except (PermissionError, ProcessLookupError):
                pass  # the child did it first (or is gone already: its status says so)
            out.write(json.dumps({"pid": pid}) + "\n")
        elif order["op"] == "status":
            children.reap()
            out.write(json.dumps({"returncode": children.status.get(order["pid"])}) + "\n")
        out.flush()


# -- the test process' side ------------------------------------------------------------------
class Zygote:
    """A running zygote (`python -m tests.worker_zygote`), started by `Zygote.start(env)`."""

    def __init__(self, proc: subprocess.Popen):
        self._proc = proc
        self._lock = threading.Lock()

    @classmethod
    def start(cls, env: dict[str, str], cwd: Path, timeout: float = 180) -> "Zygote":
        """Start one and wait until it has imported HEAVY (`env`: the workers' common one; vLLM
        is told not to configure its logging: each worker configures it for itself)."""
        env = {**env, "VLLM_CONFIGURE_LOGGING": "0"}
        env.pop("VLLM_LOGGING_CONFIG_PATH", None)
        proc = subprocess.Popen([sys.executable, "-m", "tests.worker_zygote"], env=env, cwd=cwd,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        z = cls(proc)
        deadline = time.monotonic() + timeout
        first = z._read()
        if not first.get("ready") or time.monotonic() > deadline:
            raise RuntimeError(f"the worker zygote did not start: {first}")
        return z

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker zygote exited ({self._proc.poll()})")
        return json.loads(line)

    def _ask(self, order: dict) -> dict:
        with self._lock:
            self._proc.stdin.write(json.dumps(order) + "\n")
            self._proc.stdin.flush()
            return self._read()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> "ForkedProcess":
        """A worker running `argv` (`python -m MODULE ...`) in `env`, output appended to `log`,
        in a process group of its own (as app/local/embedded.py's start_process)."""
        pid = self._ask({"op": "start", "argv": argv, "env": env, "cwd": str(cwd),
                         "log": str(log)})["pid"]
        return ForkedProcess(self, pid, argv)

    def returncode(self, pid: int) -> int | None:
        """The exit status of the worker `pid` (Popen's convention), or None while it runs."""
        return self._ask({"op": "status", "pid": pid})["returncode"]

    def stop(self) -> None:
        """Stop the zygote (its workers are stopped by their owners)."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


class ForkedProcess:
    """What the suite needs of subprocess.Popen, for a worker forked by the zygote: `pid`,
    `args`, `poll()`, `returncode` and `wait()`."""

    def __init__(self, zygote: Zygote, pid: int, argv: list[str]):
        self._zygote = zygote
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve()
