"""Counting a process' Redis traffic from the client side: round trips and commands sent.

`install()` wraps redis-py's connection (which kombu's Redis transport and Celery's result backend
use too): every send of a packed request is one round trip (a pipeline is one), every command in
it one command. `counts()` reads the totals of this process.

A process started with `sitecustomize_dir(tmp)` first on its PYTHONPATH and BENCH_REDIS_COUNTS
set to a directory (a worker: `vigil worker` execs `celery`, so the counter must come with every
interpreter start) installs the counter at start. `ask(directory)` drops a numbered question
there; every such process alive answers with its own counts (a file per process id) within
~0.1 s, and `ask` returns their sum: a worker and its helper processes (its orphan guard) are
one side.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from redis import connection

_counts = {"round_trips": 0, "commands": 0}
_lock = threading.Lock()


def install() -> None:
    """Count every send from now on (idempotent)."""
    cls = connection.AbstractConnection
    if getattr(cls, "_bench_counted", False):
        return
    send_packed, send_command, pack_commands = (cls.send_packed_command, cls.send_command,
                                                cls.pack_commands)

    def counted_send_packed(self, command, *a, **kw):
        with _lock:
            _counts["round_trips"] += 1
        return send_packed(self, command, *a, **kw)

    def counted_send_command(self, *args, **kw):
        with _lock:
            _counts["commands"] += 1
        return send_command(self, *args, **kw)

    def counted_pack_commands(self, commands):
        commands = list(commands)
        with _lock:
            _counts["commands"] += len(commands)
        return pack_commands(self, commands)

    cls.send_packed_command = counted_send_packed
    cls.send_command = counted_send_command
    cls.pack_commands = counted_pack_commands
    cls._bench_counted = True


def counts() -> dict[str, int]:
    """This process' totals so far."""
    with _lock:
        return dict(_counts)


def start_answering() -> None:
    """Install the counter and answer `ask` in BENCH_REDIS_COUNTS (a thread of its own)."""
    install()
    threading.Thread(target=_answer, args=(Path(os.environ["BENCH_REDIS_COUNTS"]),),
                     daemon=True, name="bench-redis-counter").start()


def sitecustomize_dir(tmp: Path) -> Path:
    """A directory holding a sitecustomize.py that calls `start_answering` in every Python
    process started with it on PYTHONPATH and BENCH_REDIS_COUNTS set."""
    d = tmp / "counted-site"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('BENCH_REDIS_COUNTS'):\n"
        "    from bench.redis_counter import start_answering\n"
        "    start_answering()\n")
    return d


def _answer(directory: Path) -> None:
    answered: set[str] = set()
    while True:
        try:
            for q in directory.glob("ask-*"):
                if q.suffix != ".json" and q.name not in answered:
                    tmp = directory / f".{q.name}.{os.getpid()}"
                    tmp.write_text(json.dumps(counts()))
                    tmp.replace(directory / f"{q.name}.{os.getpid()}.json")
                    answered.add(q.name)
        except OSError:
            pass
        time.sleep(0.05)


_asked = 0


def ask(directory: Path, wait: float = 1.0, timeout: float = 10.0) -> dict[str, int]:
    """The summed counts of every process answering in `directory` (module docstring): those
    that answered within `wait` s, or the first to answer within `timeout`."""
    global _asked
    _asked += 1
    name = f"ask-{os.getpid()}-{_asked}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).touch()
    start = time.monotonic()
    while True:
        answers = list(directory.glob(f"{name}.*.json"))
        elapsed = time.monotonic() - start
        if (answers and elapsed >= wait) or elapsed >= timeout:
            break
        time.sleep(0.05)
    if not answers:
        raise TimeoutError(f"no process answered in {directory}")
    total = {"round_trips": 0, "commands": 0}
    for a in answers:
        for k, v in json.loads(a.read_text()).items():
            total[k] += v
    return total
