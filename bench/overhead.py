"""Part 2 of bench/throughput.py: the per-request cost of `vigil.generate` on a worker with the
instant engine (VIGIL_ENGINE=instant: Vigil's whole path, no model), through `.delay` (one request a
message) and `generate_many` (VIGIL_REQUESTS_PER_MESSAGE a message), against a bare Celery no-op
task (bench/noop_app.py) and a no-op with Vigil's Celery settings; submit-all + get-all. The
sides take turns going first (round k starts at side k); medians and spreads (min-max) over the
rounds, and each round's ratio of a side to the bare no-op measured in the same round."""
from __future__ import annotations

import redis

from bench.celery_stock import stock_worker_argv
from bench.cpu_meter import _errors_note, _fmt_cpu, collect
from bench.direct_engine import MODEL


def overhead(bench) -> dict:
    """Part 2 for `bench` (bench/throughput.py's Bench: its args, Redis, CPU meter, process
    list): each side's microseconds per request and worker CPU milliseconds per request, one
    figure per round, {"us": {side: [us, ...]}, "worker_cpu_ms": {side: [ms, ...]},
    "redis_cpu_us": {side: [us, ...]}} (round k's figures at index k; Redis' CPU includes the
    idle polling of every worker over the segment); the workers it started are stopped before
    it returns."""
    from bench.noop_app import PROFILES, make_app
    from tasks.inference import generate, generate_many

    a = bench.args
    n = a.overhead_requests
    inst, inst_log = bench.start_worker("bench-instant", VIGIL_ENGINE="instant")
    noops = {}
    for profile, queue in PROFILES.items():
        log = bench.tmp / f"noop-{profile}.log"
        argv = stock_worker_argv("bench.noop_app", queue, f"bench-noop-{profile}@%h",
                                 a.concurrency, vigil_conf=profile == "vigil-conf")
        proc = bench.emb.start_process(
            argv, bench.emb.vigil_env(bench.redis.url, BENCH_NOOP_PROFILE=profile), log)
        bench.procs.append(proc)
        noops[profile] = (proc, make_app(profile, bench.redis.url).tasks["bench.noop"])
    try:
        bench.wait_engine(redis.Redis.from_url(bench.redis.url), "bench-instant", inst, inst_log)
        sides = {"vigil": lambda i: generate.delay(model=MODEL, prompt=f"hello there {i}",
                                                   max_tokens=1),
                 # generate_many: the same requests, 32 per Celery message (submitted in
                 # slices of 512, so the producer and the worker overlap as for .delay).
                 "vigil-many": "many"}
        for profile, (proc, task) in noops.items():
            sides[f"noop-{profile}"] = (lambda t: lambda i: t.delay(i))(task)
        def many(count: int) -> list:
            out = []
            for start in range(0, count, 512):
                out += generate_many([{"model": MODEL, "prompt": f"hello there {i}",
                                       "max_tokens": 1} for i in range(start,
                                                                       min(count, start + 512))])
            return out

        def submit_all(side, submit, count):
            return many(count) if submit == "many" else [submit(i) for i in range(count)]

        for side, submit in sides.items():  # warm: connections, threads, imports
            collect(submit_all(side, submit, 200))
        pids = {"vigil": inst.pid, "vigil-many": inst.pid,
                **{f"noop-{p}": v[0].pid for p, v in noops.items()}}
        times: dict[str, list[float]] = {s: [] for s in sides}
        cpu_ms: dict[str, list[float]] = {s: [] for s in sides}
        redis_us: dict[str, list[float]] = {s: [] for s in sides}
        bench.cpu.add("redis", bench.redis.proc.pid)
        names = list(sides)
        for k in range(a.overhead_rounds):  # each side goes first in turn
            for side in names[k % len(names):] + names[:k % len(names)]:
                submit = sides[side]
                bench.cpu.add("worker", pids[side])

                def go(side=side, submit=submit):
                    return collect(submit_all(side, submit, n))[1]

                wall, errors, cpu = bench.measure(go)
                bench.cpu.remove("worker")
                per_us = 1e6 * wall / n
                wcpu = sum(v for key, v in cpu.items() if key.startswith("worker")) * wall / 100
                times[side].append(per_us)
                cpu_ms[side].append(1e3 * wcpu / n)
                redis_us[side].append(1e6 * cpu.get("redis", 0.0) * wall / 100 / n)
                bench.say(f"overhead round {k + 1} {side:16s}: {n} req in {wall:6.2f} s = "
                         f"{n / wall:7.1f} req/s, {per_us:7.0f} us/req, worker CPU "
                         f"{1e3 * wcpu / n:.2f} ms/req, Redis CPU {redis_us[side][-1]:.0f} us/req"
                         f"{_errors_note(errors)} | cpu% "
                         f"{_fmt_cpu(cpu)}")
        return {"us": times, "worker_cpu_ms": cpu_ms, "redis_cpu_us": redis_us}
    finally:
        bench.emb.stop_process(inst)
        for proc, _ in noops.values():
            bench.emb.stop_process(proc)
