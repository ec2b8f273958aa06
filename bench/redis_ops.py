"""Redis work per request: `vigil.generate` (one request a message, `.delay`) and
`generate_many` (VIGIL_REQUESTS_PER_MESSAGE a message) against a bare Celery no-op, counted on
both ends.

    python -m bench.redis_ops [--requests 1000]

Self-contained: a private Redis, a `vigil worker --cpu` on the instant engine (VIGIL_ENGINE=
instant: Vigil's whole path, no model) and a bare Celery no-op worker (bench/noop_app.py,
profile `bare`), both threads pools of 64, each run under bench/redis_counter.py, which counts the
round trips and commands each process sends (redis-py's connection, which kombu and Celery's
result backend use). The producer is this process, counted the same way. For each side, after a
warm-up, N requests are submitted and their results read (`delay`, or `generate_many` in slices
of 512, then `get`), and the table gives, per request:

- producer and worker round trips and commands sent (client side);
- commands Redis executed (its own `INFO commandstats`: commands inside Lua scripts included,
  so a script call counts as EVALSHA plus what it ran), and bytes in and out (`INFO stats`);
- the commands Redis ran most for Vigil.

The idle traffic of both workers (heartbeats, BRPOP polls) over the same span is included: it is
part of what a request costs at this rate. The last line is `ratio R` = Redis commands per Vigil
request / per no-op request.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench import redis_counter


def server_stats(client) -> dict[str, int]:
    """Redis' own counters: commands by name, and bytes in and out."""
    stats = client.info("stats")
    out = {"net_in": stats["total_net_input_bytes"], "net_out": stats["total_net_output_bytes"]}
    for name, v in client.info("commandstats").items():
        out[name.removeprefix("cmdstat_")] = int(v["calls"])
    return out


def delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_ops")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vigil-redis-ops-"))
    from app.local.embedded import EmbeddedRedis, free_port

    port = free_port()
    os.environ["VIGIL_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"  # before `app` is imported
    os.environ.setdefault("VIGIL_CACHE_DIR", str(tmp / "cache"))
    from app.local import embedded
    from bench.cpu_meter import collect
    from bench.noop_app import make_app
    from tasks.inference import generate, generate_many

    rds = EmbeddedRedis(port=port).start()
    procs = []
    try:
        counts = {"vigil": tmp / "vigil-counts", "noop": tmp / "noop-counts"}
        site = str(redis_counter.sitecustomize_dir(tmp))

        def env(side: str, **extra: str) -> dict[str, str]:
            e = embedded.vigil_env(rds.url, BENCH_REDIS_COUNTS=str(counts[side]), **extra)
            e["PYTHONPATH"] = site + os.pathsep + e["PYTHONPATH"]
            return e

        vigil = embedded.start_process(
            [sys.executable, "-m", "app.ops.cli", "worker", "--cpu", "--name", "ops-vigil@%h",
             "--concurrency", str(a.concurrency), "--pools", "tiny-llama"],
            env("vigil", VIGIL_ENGINE="instant"), tmp / "vigil.log")
        noop = embedded.start_process(
            [sys.executable, "-m", "celery", "-A", "bench.noop_app", "worker", "-P", "threads",
             "-c", str(a.concurrency), "--prefetch-multiplier", "1", "-Q", "bench.noop", "-n",
             "ops-noop@%h"], env("noop", BENCH_NOOP_PROFILE="bare"), tmp / "noop.log")
        procs += [vigil, noop]
        noop_task = make_app("bare", rds.url).tasks["bench.noop"]
        def many(count: int) -> list:
            out = []
            for start in range(0, count, 512):
                out += generate_many([{"model": "tiny-llama", "prompt": f"hello {i}",
                                       "max_tokens": 1}
                                      for i in range(start, min(count, start + 512))])
            return out

        one = {"vigil": lambda i: generate.delay(model="tiny-llama", prompt=f"hello {i}",
                                                 max_tokens=1),
               "noop": lambda i: noop_task.delay(i)}
        sides = {"vigil": lambda n: [one["vigil"](i) for i in range(n)], "vigil-many": many,
                 "noop": lambda n: [one["noop"](i) for i in range(n)]}
        worker_of = {"vigil": "vigil", "vigil-many": "vigil", "noop": "noop"}
        redis_counter.install()
        for submit in sides.values():  # warm-up: the workers are up, connections open
            values, errors = collect(submit(100))
            assert not errors, errors[:3]
        client = redis.Redis.from_url(rds.url)
        rows: dict[str, dict] = {}
        for side, submit in sides.items():
            w0 = redis_counter.ask(counts[worker_of[side]])
            p0 = redis_counter.counts()
            s0 = server_stats(client)
            t0 = time.perf_counter()
            values, errors = collect(submit(a.requests))
            wall = time.perf_counter() - t0
            s1 = server_stats(client)
            p1 = redis_counter.counts()
            w1 = redis_counter.ask(counts[worker_of[side]])
            assert not errors and len(values) == a.requests, errors[:3]
            n = a.requests
            srv = delta(s0, s1)
            srv["info"] = srv.get("info", 0) - 4  # this bench's own INFO calls
            rows[side] = {
                "producer_rtt": (p1["round_trips"] - p0["round_trips"]) / n,
                "producer_cmds": (p1["commands"] - p0["commands"]) / n,
                "worker_rtt": (w1["round_trips"] - w0["round_trips"]) / n,
                "worker_cmds": (w1["commands"] - w0["commands"]) / n,
                "server_cmds": sum(v for k, v in srv.items() if k not in ("net_in", "net_out"))
                / n,
                "net_in": srv["net_in"] / n, "net_out": srv["net_out"] / n,
                "top": sorted(((v / n, k) for k, v in srv.items()
                               if k not in ("net_in", "net_out") and v > 0), reverse=True)[:12],
                "wall": wall,
            }
    finally:
        for proc in procs:
            embedded.stop_process(proc)
        rds.stop()
    print(f"per request, {a.requests} requests per side (delay + get), workers of "
          f"{a.concurrency} threads:")
    print(f"{'':34s}{'vigil.generate':>16s}{'generate_many':>15s}{'bare no-op':>14s}")
    labels = [("producer round trips", "producer_rtt"), ("producer commands sent", "producer_cmds"),
              ("worker round trips", "worker_rtt"), ("worker commands sent", "worker_cmds"),
              ("Redis commands run (Lua inside)", "server_cmds"), ("bytes into Redis", "net_in"),
              ("bytes out of Redis", "net_out")]
    for label, key in labels:
        print(f"{label:34s}{rows['vigil'][key]:>16.1f}{rows['vigil-many'][key]:>15.1f}"
              f"{rows['noop'][key]:>14.1f}")
    print("Redis commands run per vigil.generate request, most first:")
    print("  " + ", ".join(f"{k} {v:.2f}" for v, k in rows["vigil"]["top"]))
    print("per generate_many request:")
    print("  " + ", ".join(f"{k} {v:.2f}" for v, k in rows["vigil-many"]["top"]))
    print("per bare no-op request:")
    print("  " + ", ".join(f"{k} {v:.2f}" for v, k in rows["noop"]["top"]))
    print(f"generate_many/no-op {rows['vigil-many']['server_cmds'] / rows['noop']['server_cmds']:.2f}"
          " (Redis commands run per request)")
    print(f"ratio {rows['vigil']['server_cmds'] / rows['noop']['server_cmds']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
