"""Redis' own ceiling for Vigil's request scripts: how many requests/s one Redis core can record.

    python -m bench.redis_ceiling [--procs 1,2,4] [--seconds 10]

Starts a private Redis (AOF everysec, as the deployment runs it) and, for each process count,
that many client processes, each recording requests as fast as it can through Vigil's own
calls (app/state/store.py), in the order a request makes them: the producer's `create`, the
worker's `hold`, `begin` and `finish` with a result (the record of a request from submit to end;
the broker's and Celery's result backend's own traffic is measured by bench/redis_ops.py).

For each step it prints the requests/s recorded and Redis' CPU over the step (its own
`used_cpu_user + used_cpu_sys`, as % of one core): one Redis runs on one core, so requests/s
divided by Redis' CPU fraction is what one saturated Redis core records. On this 2-core machine the
clients and Redis share the cores; the extrapolation is printed beside the measured rate. Then
`--open` requests are submitted through the producer's own path with no worker, for Redis'
memory per open request. The last line is `ratio R` = the extrapolated ceiling / the rate
measured with the most clients.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import redis

from app.local.embedded import EmbeddedRedis
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.settings import load_settings
from app.state.conn import connect
from app.state.store import RequestStore


def client(url: str, tag: str, seconds: float, done) -> None:
    """Record requests for `seconds` through RequestStore's own calls; put how many in `done`."""
    store = RequestStore(connect(load_settings(redis_url=url)), 3600)
    req = parse_request({"model": "tiny-llama", "prompt": "a prompt of ten words or so, as the "
                         "benchmarks send", "max_tokens": 32})
    fields = record_fields(req, time.time(), 3600)
    result = {"model": "tiny-llama", "text": "x " * 32, "token_ids": list(range(32)),
              "finish_reason": "length", "prompt_tokens": 12, "completion_tokens": 32,
              "attempts": 1, "worker": "w@h"}
    instance = int(tag.rsplit("-", 1)[1]) + 1
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        rid = f"{tag}-{n}"
        now = time.time()
        store.create(rid, fields, now)
        store.hold(rid, instance)
        assert store.begin(rid, 0, "w@h", instance, now, 3).action == "run"
        store.finish(rid, instance, now, result={**result, "request_id": rid})
        n += 1
    done.put(n)


def redis_cpu(client) -> float:
    c = client.info("cpu")
    return float(c["used_cpu_user"]) + float(c["used_cpu_sys"])


def step(rds: EmbeddedRedis, procs: int, seconds: float) -> tuple[float, float]:
    """(requests/s, Redis CPU as a fraction of one core) with `procs` clients."""
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    c = redis.Redis.from_url(rds.url)
    cpu0, t0 = redis_cpu(c), time.monotonic()
    ps = [ctx.Process(target=client, args=(rds.url, f"p{procs}-{k}", seconds, done))
          for k in range(procs)]
    for p in ps:
        p.start()
    total = sum(done.get(timeout=seconds + 60) for _ in ps)
    for p in ps:
        p.join()
    wall, cpu = time.monotonic() - t0, redis_cpu(c) - cpu0
    c.flushall()
    return total / wall, cpu / wall


def open_memory(rds: EmbeddedRedis, n: int) -> float:
    """Bytes of Redis memory per open request: `n` requests submitted through the producer's
    own path (record, indexes and the Celery message in its queue), no worker taking them."""
    from app.celery_app import create_app
    from app.requests.models import get_registry
    from app.requests.submit import submit_request

    settings = load_settings(redis_url=rds.url)
    app = create_app(settings)
    store = RequestStore(connect(settings), settings.result_ttl)
    c = redis.Redis.from_url(rds.url)
    c.flushall()
    m0 = c.info("memory")["used_memory"]
    prompt = "a prompt of about two hundred bytes, " * 5
    for i in range(n):
        submit_request({"model": "tiny-llama", "prompt": prompt, "max_tokens": 128,
                        "job": "bench"}, settings=settings, registry=get_registry(),
                       store=store, ports=app.vigil_ports)
    per = (c.info("memory")["used_memory"] - m0) / n
    c.flushall()
    return per


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_ceiling")
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--open", type=int, default=20_000,
                   help="open requests submitted to measure Redis memory per request (0: skip)")
    a = p.parse_args(argv)
    rds = EmbeddedRedis(appendonly=True).start()
    try:
        rows = [(n, *step(rds, n, a.seconds)) for n in map(int, a.procs.split(","))]
        per_open = open_memory(rds, a.open) if a.open else None
    finally:
        rds.stop()
    print(f"{'clients':>8} {'requests/s':>11} {'Redis CPU':>10} {'per Redis core':>15}")
    for n, rate, cpu in rows:
        print(f"{n:>8} {rate:>11.0f} {100 * cpu:>9.0f}% {rate / max(cpu, 1e-9):>15.0f}")
    if per_open is not None:
        print(f"Redis memory per open request (200-byte prompt, its message queued): "
              f"{per_open:.0f} bytes = {per_open * 1e6 / 2**30:.2f} GiB per million")
    n, rate, cpu = rows[-1]
    print(f"ratio {rate / max(cpu, 1e-9) / rate:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
