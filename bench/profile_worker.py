"""Where a worker's CPU goes per request: py-spy samples of a real `vigil worker` (the instant
engine: Vigil's whole path, no model; or `--engine vllm`, the real engine on tiny-llama, whose
EngineCore runs in a process of its own) while a producer keeps it busy, summarised per thread
and per function. The measure-first step of docs/performance.md, "Where the worker's time goes"
and "Short requests".

    python -m bench.profile_worker [--side many|single] [--engine instant|vllm] [--logprobs K]
                                   [--seconds 20] [--rate 100]

Samples are taken only while a thread holds the GIL (py-spy --gil): on this worker the GIL is
the limit, so a thread's share of GIL samples is its share of the worker's Python time. Printed:
requests finished during the sampling, GIL samples per request (at `--rate` samples/s: 10 ms
per sample at 100), the share per thread (pool threads merged by name), the functions with the
most samples of their own (self), and the share per area of the code (celery, kombu, redis-py,
Vigil's app/, workers/, tasks/, json, ...). The raw py-spy file is kept with `--keep`.
Needs py-spy (`pip install py-spy`) and the right to ptrace the worker (root, or
kernel.yama.ptrace_scope=0).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import redis

MODEL = "tiny-llama"
SLICE = 512  # requests per submit call (generate_many) or per loop of .delay


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.profile_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("many", "single"), default="many",
                   help="submit through generate_many (32 a message) or .delay, one a message")
    p.add_argument("--engine", choices=("instant", "vllm"), default="instant",
                   help="the worker's engine: no model, or the real one on tiny-llama")
    p.add_argument("--logprobs", type=int, default=0, help="top logprobs asked per token")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens per request (1: the short workload; 128: the main one)")
    p.add_argument("--seconds", type=float, default=20.0, help="sampling time")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--top", type=int, default=25, help="functions listed")
    p.add_argument("--keep", action="store_true", help="keep the raw py-spy file and logs")
    return p.parse_args(argv)


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return found


def _thread_group(name: str) -> str:
    """Pool threads merged: 'ThreadPoolExecutor-0_17' -> 'ThreadPoolExecutor-0_*'."""
    return re.sub(r"\d+$", "*", name)


AREAS = [("celery", "/celery/"), ("kombu", "/kombu/"), ("redis-py", "/redis/"),
         ("billiard", "/billiard/"), ("vine/amqp", "/vine/"), ("json", "/json/"),
         ("vigil workers/", "/workers/"), ("vigil tasks/", "/tasks/"), ("vigil app/", "/app/"),
         ("vllm", "/vllm/"), ("asyncio", "/asyncio/"), ("threading/queue", "/threading.py"),
         ("threading/queue", "/queue.py"), ("concurrent", "/concurrent/"),
         ("logging", "/logging/"), ("socket/selectors", "/selectors.py"),
         ("socket/selectors", "/socket.py"), ("pydantic", "/pydantic")]


def _area(frame: str) -> str:
    m = re.search(r"\(([^()]*):\d+\)$", frame)
    path = m.group(1) if m else frame
    for label, part in AREAS:
        if part in path or (part.startswith("/") and path.startswith(part[1:])):
            return label
    return "other"


def summarise(raw: Path, finished: int, rate: int, top: int) -> list[str]:
    """The report's lines from py-spy's raw (collapsed) file."""
    threads: Counter = Counter()
    self_fn: Counter = Counter()
    areas: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        head = frames[0]
        name = head.split(": ", 1)[1] if head.startswith("thread (") and ": " in head else head
        frames = frames[1:] if head.startswith("thread (") else frames
        if frames and not frames[0].endswith(")"):  # the thread name py-spy adds
            frames = frames[1:]
        total += n
        threads[_thread_group(name)] += n
        if frames:
            self_fn[frames[-1]] += n
            # The area is that of the innermost frame from a known library or Vigil's code.
            for f in reversed(frames):
                a = _area(f)
                if a != "other":
                    areas[a] += n
                    break
            else:
                areas["other"] += n
    ms_per_sample = 1000.0 / rate
    out = [f"GIL samples: {total} at {rate}/s ({total * ms_per_sample / 1000:.1f} s of GIL "
           f"time); requests finished while sampling: {finished}"]
    if finished:
        out.append(f"GIL time per request: {total * ms_per_sample / finished:.3f} ms")
    out.append("\nper thread (share of GIL samples):")
    out += [f"  {100 * n / total:5.1f}%  {t}" for t, n in threads.most_common(12)]
    out.append("\nper area (innermost known frame):")
    out += [f"  {100 * n / total:5.1f}%  {a}" for a, n in areas.most_common()]
    out.append(f"\ntop {top} functions by own samples:")
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in self_fn.most_common(top)]
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    spy = _py_spy()
    tmp = Path(tempfile.mkdtemp(prefix="vigil-profile-"))
    from bench.throughput import _free_port

    port = _free_port()
    os.environ["VIGIL_CACHE_DIR"] = os.environ.get("VIGIL_CACHE_DIR") or str(tmp / "cache")
    os.environ["VIGIL_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    from app.local import embedded

    redis_server = embedded.EmbeddedRedis(port=port)
    worker = None
    stop = threading.Event()
    try:
        redis_server.start()
        worker = embedded.start_worker(redis_server.url, "profile@%h", tmp / "worker.log",
                                       concurrency=a.concurrency, pools=MODEL,
                                       VIGIL_ENGINE=a.engine, VIGIL_IDLE_CLEANUP="0")
        from tasks.inference import generate, generate_many

        def submit(base: int) -> list:
            items = [{"model": MODEL, "prompt": f"hello there {base + i}",
                      "max_tokens": a.max_tokens,
                      **({"ignore_eos": True} if a.max_tokens > 1 else {}),
                      **({"logprobs": a.logprobs} if a.logprobs else {})}
                     for i in range(SLICE)]
            if a.side == "many":
                return generate_many(items)
            return [generate.delay(**kw) for kw in items]

        for r in submit(0):  # the engine warm, the worker's connections open
            r.get(timeout=300)
        done = [0]

        def producer() -> None:
            base, pending = SLICE, []
            while not stop.is_set():
                pending.append(submit(base))
                base += SLICE
                if len(pending) > 3:  # keep ~2,000 requests ahead of the worker
                    for r in pending.pop(0):
                        r.get(timeout=300)
                        done[0] += 1
            for batch in pending:
                for r in batch:
                    r.get(timeout=300)
                    done[0] += 1

        feeder = threading.Thread(target=producer, name="producer", daemon=True)
        feeder.start()
        time.sleep(3)  # the queue filled
        raw = tmp / "profile.txt"
        r = redis.Redis.from_url(redis_server.url)
        before = _finished(r)
        subprocess.run([spy, "record", "--pid", str(worker.pid), "--duration",
                        str(int(a.seconds)), "--rate", str(a.rate), "--format", "raw",
                        "--threads", "--gil", "--output", str(raw)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finished = _finished(r) - before
        stop.set()
        feeder.join(timeout=300)
        per = "VIGIL_REQUESTS_PER_MESSAGE a message" if a.side == "many" else "one a message"
        print(f"side: {a.side} ({SLICE} requests a submit, {per}), engine {a.engine}, "
              f"logprobs {a.logprobs}, max_tokens {a.max_tokens}, {a.seconds:.0f} s sampled; "
              f"commit {head_commit()}")
        for line in summarise(raw, finished, a.rate, a.top):
            print(line)
        if a.keep:
            print(f"raw samples and logs kept in {tmp}")
        return 0
    finally:
        stop.set()
        embedded.stop_process(worker)
        redis_server.stop()
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _finished(r) -> int:
    """Requests finished so far: Celery result keys in Redis (one per finished request)."""
    return sum(1 for _ in r.scan_iter(match="celery-task-meta-*", count=10_000))


def head_commit() -> str:
    """The checkout's short commit, "?" when git cannot tell (a figure names its commit)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent.parent
                              ).stdout.strip() or "?"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
