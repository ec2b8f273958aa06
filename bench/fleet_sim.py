"""A simulated fleet on one Redis: many instant-engine workers, producers at full speed.

    python -m bench.fleet_sim [--workers 8] [--producers 2] [--seconds 300]

Starts a private append-only Redis, `--workers` `vigil worker --cpu` processes on the instant
engine (VIGIL_ENGINE=instant: Vigil's whole path, no model; each its own name), the housekeeper
and a beat (every housekeeping task running at its default interval), and `--producers` producer
processes that each keep `--window` requests open through `generate.delay` and read every result,
for `--seconds`. Every 10 s it samples Redis' own counters (commands, CPU, memory, net bytes);
at the end it prints requests completed per second, Redis CPU per request (µs of its one core),
commands per request, and the ceiling those imply: one Redis core / CPU per request. The same
figures measured with one worker and one producer, before the fleet, give the baseline of the
same run. The last line is `ratio R` = Redis CPU per request with the fleet / with one worker
(~1: Redis' cost per request does not grow with the fleet, so the ceiling holds).

This 2-core machine runs out of CPU for the workers and producers long before Redis saturates:
what it measures is Redis' cost per request at a fleet's fan-in, not the fleet's ceiling.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import redis


def produce(url: str, tag: str, window: int, seconds: float, done) -> None:
    """Keep `window` requests open for `seconds`; put (completed, errors) into `done`."""
    os.environ["VIGIL_REDIS_URL"] = url
    from tasks.inference import generate

    open_: list = []
    completed = errors = i = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end or open_:
        while len(open_) < window and time.monotonic() < end:
            open_.append(generate.delay(model="tiny-llama", prompt=f"{tag} {i}", max_tokens=4))
            i += 1
        r = open_.pop(0)
        try:
            r.get(timeout=120)
            completed += 1
        except Exception:
            errors += 1
    done.put((completed, errors))


def sample(client) -> dict[str, float]:
    info = client.info()
    return {"cmds": info["total_commands_processed"],
            "cpu": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
            "mem": info["used_memory"], "net": info["total_net_input_bytes"]
            + info["total_net_output_bytes"]}


def run(workers: int, producers: int, window: int, seconds: float, tmp: Path) -> dict:
    from app.local import embedded

    rds = embedded.EmbeddedRedis(appendonly=True).start()
    procs = []
    try:
        env = {"VIGIL_ENGINE": "instant", "VIGIL_CACHE_DIR": str(tmp / "cache")}
        for k in range(workers):
            procs.append(embedded.start_worker(rds.url, f"sim{k}@fleet{k // 4}",
                                               tmp / f"w{workers}-{k}.log", concurrency=16,
                                               pools="tiny-llama", **env))
        procs.append(embedded.start_housekeeper(rds.url, tmp / f"hk{workers}.log", **env))
        procs.append(embedded.start_process(
            [sys.executable, "-m", "celery", "-A", "app", "beat", "-s",
             str(tmp / f"beat{workers}")], embedded.vigil_env(rds.url, **env),
            tmp / f"beat{workers}.log"))
        client = redis.Redis.from_url(rds.url)
        embedded.wait_for(lambda: client.zcard("vigil:workers") == workers, 120, 0.5,
                          "the workers to register")
        ctx = mp.get_context("spawn")  # fresh interpreters: their settings read their own env
        done = ctx.Queue()
        s0, t0 = sample(client), time.monotonic()
        ps = [ctx.Process(target=produce, args=(rds.url, f"p{k}", window, seconds, done))
              for k in range(producers)]
        for p in ps:
            p.start()
        peak_mem = s0["mem"]
        while any(p.is_alive() for p in ps):
            time.sleep(10 if seconds >= 60 else 1)
            peak_mem = max(peak_mem, sample(client)["mem"])
        results = [done.get(timeout=60) for _ in ps]
        for p in ps:
            p.join()
        s1, wall = sample(client), time.monotonic() - t0
    finally:
        for p in procs:
            embedded.stop_process(p)
        rds.stop()
    n = sum(c for c, _ in results)
    return {"workers": workers, "requests": n, "errors": sum(e for _, e in results),
            "rate": n / wall, "cpu_us": 1e6 * (s1["cpu"] - s0["cpu"]) / max(n, 1),
            "cmds": (s1["cmds"] - s0["cmds"]) / max(n, 1),
            "net": (s1["net"] - s0["net"]) / max(n, 1),
            "redis_cpu": (s1["cpu"] - s0["cpu"]) / wall, "peak_mem_mb": peak_mem / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet_sim")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--baseline-seconds", type=float, default=60)
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vigil-fleet-sim-"))
    base = run(1, 1, a.window, a.baseline_seconds, tmp)
    fleet = run(a.workers, a.producers, a.window, a.seconds, tmp)
    print(f"{'':10s}{'req/s':>9s}{'errors':>8s}{'Redis CPU':>11s}{'µs/req':>9s}"
          f"{'cmds/req':>10s}{'bytes/req':>11s}{'peak MB':>9s}{'ceiling req/s':>15s}")
    for row in (base, fleet):
        print(f"{row['workers']:>3d} worker{'s' if row['workers'] > 1 else ' '}"
              f"{row['rate']:>9.0f}{row['errors']:>8d}{100 * row['redis_cpu']:>10.0f}%"
              f"{row['cpu_us']:>9.0f}{row['cmds']:>10.1f}{row['net']:>11.0f}"
              f"{row['peak_mem_mb']:>9.1f}{1e6 / row['cpu_us']:>15.0f}")
    print(f"logs in {tmp}")
    print(f"ratio {fleet['cpu_us'] / base['cpu_us']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
