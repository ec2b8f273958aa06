"""EngineCore's own account of its failure, kept where the worker can read it.

When EngineCore dies, vLLM's front end tells every request only `EngineDeadError` ("EngineCore
encountered an issue. See stack trace (above) for the root cause."); when it fails to start,
`RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s):
{...}")`. The root cause (a CUDA illegal address, a CUDA out of memory, a Python error in the
model runner) is only in what EngineCore (or, with tensor parallelism, a WorkerProc) logged on
the way down: `logger.exception("EngineCore encountered a fatal error.")`, `"EngineCore failed to
start."`, `"WorkerProc failed to start."`, `"WorkerProc failed."`, `"WorkerProc hit an
exception."` (vllm/v1/engine/core.py, vllm/v1/executor/multiproc_executor.py, 0.32). With tensor
parallelism a rank's own failure (a CUDA out of memory, vLLM's free-memory check, both of which
run in each WorkerProc) is logged by its WorkerProc before EngineCore logs its own line, whose
traceback only says "WorkerProc initialization failed due to an exception in a background
process": the cause is read from the first failure line of the start on. So Vigil's vLLM logging config (app/logging_setup.py) adds a second
handler, `error_file_handler`, that every vLLM process of a worker builds: ERROR records, pid and
process name in each line, appended to the file VIGIL_ENGINE_ERROR_LOG names (one per worker
process, under $VIGIL_CACHE_DIR/engine-errors/). The worker marks the file's end before each
engine start and reads what came after it once that engine fails (`CoreLog.failure_since`).

Imported by every vLLM process of a worker (through the logging config), so it imports nothing
but the standard library.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

ENV = "VIGIL_ENGINE_ERROR_LOG"
RECORD_FORMAT = ("[%(asctime)s: %(levelname)s/%(processName)s pid=%(process)d] %(name)s: "
                 "%(message)s")
# The lines vLLM logs when an engine process goes down (vLLM 0.32 and 0.33 alike; tests read
# them from vLLM's source, every `logger.exception` of EngineCore and WorkerProc): what follows
# one is the failure's traceback. "WorkerProc failed." (its dot included) is a rank's death at
# run time, "WorkerProc failed to start." a rank's at start.
FAILURE_MARKERS = ("EngineCore encountered a fatal error", "EngineCore failed to start",
                   "WorkerProc failed to start", "WorkerProc failed.",
                   "WorkerProc hit an exception", "died unexpectedly")
MAX_READ = 256 << 10  # a traceback is a few KiB; a runaway log must not be read whole
KEEP_DEAD_S = 86400.0  # another worker's file, gone with its process, is removed after a day


def error_file_handler() -> logging.Handler:
    """The logging handler of VIGIL_ENGINE_ERROR_LOG (a dictConfig factory, built in each vLLM
    process): ERROR and above, appended; a NullHandler where the variable is unset (vLLM
    outside a worker: benchmarks, scripts)."""
    path = os.environ.get(ENV)
    if not path:
        return logging.NullHandler()
    handler = logging.FileHandler(path, mode="a", delay=True)
    handler.setLevel(logging.ERROR)
    handler.setFormatter(logging.Formatter(RECORD_FORMAT))
    return handler


def use_error_log(cache_dir: Path, pid: int | None = None) -> Path:
    """Name this worker process's error file in VIGIL_ENGINE_ERROR_LOG (its engine processes
    inherit it), unless already named; files of processes long gone are removed."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    folder = Path(cache_dir) / "engine-errors"
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale(folder)
    path = folder / f"{pid or os.getpid()}.log"
    os.environ[ENV] = str(path)
    return path


def _remove_stale(folder: Path) -> None:
    now = time.time()
    for f in folder.glob("*.log"):
        try:
            pid = int(f.stem)
            alive = _alive(pid)
            if not alive and now - f.stat().st_mtime > KEEP_DEAD_S:
                f.unlink()
        except (ValueError, OSError):
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CoreLog:
    """The error file of this worker's engine processes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def from_env(cls) -> "CoreLog | None":
        """The file VIGIL_ENGINE_ERROR_LOG names, or None (an operator's own vLLM logging)."""
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def mark(self) -> int:
        """Where the file ends now: what an engine started after this logs comes after it."""
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def failure_since(self, offset: int, end: int | None = None) -> str:
        """What the engine processes logged after `offset` (up to `end`), from the first line
        announcing a failure (`FAILURE_MARKERS`) on; "" when none was logged (a SIGKILL logs
        nothing)."""
        size = MAX_READ if end is None else max(0, min(MAX_READ, end - offset))
        try:
            with self.path.open("rb") as f:
                f.seek(offset)
                text = f.read(size).decode("utf-8", "replace")
        except OSError:
            return ""
        starts = [i for i in (text.find(m) for m in FAILURE_MARKERS) if i >= 0]
        if not starts:
            return ""
        line_start = text.rfind("\n", 0, min(starts)) + 1
        return text[line_start:]
