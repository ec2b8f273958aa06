"""A `vigil worker` with timers on the stages a request passes through, for bench/stages.py.

    python -m bench.stage_hooks OUT.json worker --cpu ...   # the arguments of app.ops.cli

Runs the real worker (app.ops.cli, unchanged; its exec of `celery worker` is sent back through
this module) after wrapping, in the Celery process only, the calls
each stage makes, and writes the running totals to OUT.json every 0.25 s (bench/stages.py reads
it before and after a round and takes the difference). Bench-only instrumentation: nothing in
app/, workers/ or tasks/ knows of it. What it counts (calls, requests, seconds spent inside):

- Celery: `task_received` (the consumer's thread has built the message's Request) to
  `task_prerun` (a pool thread starts it), and `task_prerun` to `task_postrun`, per task name.
- Redis round trips of the store: BEGIN (`begin`, `begin_many`) and FINISH (`finish`,
  `finish_many`, which also write Celery's result key), per call and per request.
- The engine host: the hop onto its loop (`submit`, `submit_many`), the task thread's wait for a
  run's end (`result`), the loop's time per request from `TicketRuns.generate` (admission,
  batch slots) and inside `VllmEngine.run` (vLLM's add, the step, the output).
- vLLM's front end: `AsyncLLM.add_request` calls, and its output handler's
  `OutputProcessor.process_outputs` (detokenizing, logprobs, the per-request queues): calls,
  outputs and seconds.
- CPU seconds of every Python thread (by name, pool threads merged), of the process, and the
  process' CPU outside Python threads (vLLM's and ZMQ's native threads).

Each timer adds about a microsecond per call; the figures are for the account, not throughput.
"""
from __future__ import annotations

import functools
import json
import os
import re
import runpy
import sys
import threading
import time
from collections import defaultdict

_lock = threading.Lock()
_calls: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])  # calls, requests, seconds
_received: dict[str, float] = {}
_started: dict[str, float] = {}


def add(key: str, seconds: float, requests: int = 1) -> None:
    """Count one call of stage `key` carrying `requests` requests and lasting `seconds`."""
    with _lock:
        c = _calls[key]
        c[0] += 1
        c[1] += requests
        c[2] += seconds


def _wrap(owner, name: str, key: str, count=None) -> None:
    orig = getattr(owner, name, None)
    if orig is None:  # moved by a refactor: that stage goes uncounted, the rest still counts
        print(f"stage_hooks: {owner.__name__}.{name} not found", file=sys.stderr)
        return
    if _is_async(orig):
        @functools.wraps(orig)
        async def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return await orig(*a, **k)
            finally:
                add(key, time.perf_counter() - t0, count(a) if count else 1)
    else:
        @functools.wraps(orig)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                add(key, time.perf_counter() - t0, count(a) if count else 1)
    setattr(owner, name, timed)


def _is_async(fn) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _celery_signals() -> None:
    from celery import signals

    @signals.task_received.connect(weak=False)
    def _rx(request=None, **_):
        _received[request.id] = time.perf_counter()

    @signals.task_prerun.connect(weak=False)
    def _pre(task_id=None, task=None, **_):
        now = time.perf_counter()
        _started[task_id] = now
        t = _received.pop(task_id, None)
        if t is not None:
            add(f"celery received->prerun {task.name}", now - t)

    @signals.task_postrun.connect(weak=False)
    def _post(task_id=None, task=None, **_):
        t = _started.pop(task_id, None)
        if t is not None:
            add(f"celery prerun->postrun {task.name}", time.perf_counter() - t)


def install() -> None:
    """Wrap the stages' calls (module docstring)."""
    _celery_signals()
    from app.state.store import RequestStore
    from workers.engine.host import EngineHost
    from workers.engine.ticket_run import TicketRuns
    from workers.engine.vllm import VllmEngine

    n1 = lambda a: len(a[1])  # noqa: E731  the list argument's length
    _wrap(RequestStore, "begin", "redis BEGIN (one)")
    _wrap(RequestStore, "begin_many", "redis BEGIN (many)", n1)
    _wrap(RequestStore, "finish", "redis FINISH (one)")
    _wrap(RequestStore, "finish_many", "redis FINISH (many)", n1)
    _wrap(EngineHost, "submit", "host hop onto the loop (one)")
    _wrap(EngineHost, "submit_many", "host hop onto the loop (many)", n1)
    _wrap(EngineHost, "result", "task thread waits for the run")
    _wrap(TicketRuns, "generate", "loop: request in the host (admission, slots, run)")
    _wrap(VllmEngine, "run", "loop: request in VllmEngine.run (add, step, output)")
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    _wrap(AsyncLLM, "add_request", "vllm AsyncLLM.add_request")
    _wrap(OutputProcessor, "process_outputs", "vllm output handler process_outputs", n1)


def _thread_cpu() -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for t in threading.enumerate():
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError, ValueError):
            continue
        out[re.sub(r"\d+$", "*", t.name)] += cpu
        out["#" + re.sub(r"\d+$", "*", t.name)] += 1  # the group's live threads
    return out


def snapshot() -> dict:
    """The running totals: stages, CPU per Python thread, the process' CPU."""
    with _lock:
        calls = {k: list(v) for k, v in _calls.items()}
    return {"at": time.perf_counter(), "calls": calls, "threads": _thread_cpu(),
            "process_cpu": time.process_time()}


def _writer(path: str) -> None:
    tmp = path + ".tmp"
    while True:
        try:
            with open(tmp, "w") as f:
                json.dump(snapshot(), f)
            os.replace(tmp, path)
        except Exception as e:  # keep the worker serving whatever the probe meets
            print(f"stage_hooks: {e}", file=sys.stderr)
        time.sleep(0.25)


def main() -> None:
    """`OUT celery ...`: install the timers, start the writer, run Celery with the rest of the
    arguments. `OUT worker ...` (app.ops.cli's arguments): run `vigil worker`, whose exec of
    `python -m celery ...` comes back here as `OUT celery ...`."""
    out, cmd = sys.argv[1], sys.argv[2]
    if cmd == "celery":
        install()
        threading.Thread(target=_writer, args=(out,), name="stage-hooks-writer",
                         daemon=True).start()
        sys.argv = ["celery"] + sys.argv[3:]
        runpy.run_module("celery", run_name="__main__", alter_sys=True)
        return
    execv = os.execv

    def through_hooks(path, argv):
        if list(argv[1:3]) == ["-m", "celery"]:
            argv = [argv[0], "-m", "bench.stage_hooks", out, "celery", *argv[3:]]
        return execv(path, argv)

    os.execv = through_hooks
    sys.argv = ["app.ops.cli"] + sys.argv[2:]
    runpy.run_module("app.ops.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
