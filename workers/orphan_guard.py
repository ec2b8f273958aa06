"""Orphan guard: the engine's processes never outlive their worker.

A SIGKILLed worker cannot run cleanup code, and vLLM's EngineCore and model processes survive it
(docs/field-notes.md: ~2.3 GB, on a GPU the card's memory, still held 40 s later), so a restarted worker
meets memory pressure made by its own predecessor. The guard is a tiny separate process started
by the worker with a pipe: the worker keeps the write end, the guard blocks on the read end. The
worker sends the (pid, create_time) of its engine processes after each engine start, and the guard
also polls the worker's descendants every `POLL_S`. When the pipe reaches EOF (the worker exited,
by any means, SIGKILL included) the guard SIGKILLs every recorded process whose create_time still
matches (so a recycled PID is never hit) and exits.

Run as `python -m workers.orphan_guard WORKER_PID` with the pipe as stdin; it imports nothing heavy.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 1.0
# After the worker is gone, processes that exit on their own (vLLM's resource tracker) get this
# long before they are killed.
GRACE_S = 3.0


def _alive(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class OrphanGuard:
    """Worker side: starts the guard process and reports engine pids to it."""

    def __init__(self) -> None:
        read_fd, self._write_fd = os.pipe()  # both non-inheritable (PEP 446): engine children
        # started later never hold the write end, so EOF means exactly "the worker is gone"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.orphan_guard", str(os.getpid())],
            stdin=read_fd, close_fds=True, process_group=0,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        os.close(read_fd)

    def report(self, pids: list[tuple[int, float]]) -> None:
        """Tell the guard about processes to kill if the worker dies."""
        data = "".join(f"{pid} {ct!r}\n" for pid, ct in pids if pid != self.proc.pid)
        if data:
            try:
                os.write(self._write_fd, data.encode())
            except OSError:
                pass

    def close(self) -> None:
        """Clean stop: nothing to do. The pipe stays open until this process exits, so the guard
        sweeps only what is still alive *after* the worker is gone (vLLM's resource tracker
        legitimately lives until then), and exits itself."""


def _kill_all(known: dict[int, float]) -> list[str]:
    killed = []
    for pid, ct in known.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - ct) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                name = p.name()
                p.kill()
                killed.append(f"{name}[{pid}]")
        except psutil.Error:
            continue
    return killed


def main(argv: list[str]) -> int:
    worker_pid = int(argv[0])
    me = os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the worker; we follow it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    known: dict[int, float] = {}
    buf = b""
    try:
        worker = psutil.Process(worker_pid)
    except psutil.Error:
        return 0
    while True:
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                pid, ct = line.split()
                known[int(pid)] = float(ct)
        try:
            for p in worker.children(recursive=True):
                if p.pid != me:
                    known.setdefault(p.pid, p.create_time())
        except psutil.Error:
            pass
    # EOF: the worker is gone (or stopped cleanly). Give a clean shutdown a moment, then kill.
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(_alive(p, ct) for p, ct in known.items()):
        time.sleep(0.05)
    killed = _kill_all(known)
    if killed:
        print(f"vigil orphan guard: worker {worker_pid} is gone; killed {', '.join(killed)}",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
