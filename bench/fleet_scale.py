"""Housekeeping over a large fleet: one reaper, reconcile and status pass at 1,000 workers.

    python -m bench.fleet_scale [--workers 1000] [--pools 500]

Starts a private Redis and registers N workers through the real heartbeat (`Heartbeat.beat`,
the registry hash and the `vigil:workers` score a worker writes), spread over P pools (a registry
of P models), with work waiting in a tenth of the pools' queues and open requests in flight on the
workers. A tenth of the workers are silent (their last heartbeat older than the reap timeout) and
hold 5 requests each; the rest are live and healthy. Then it times, each on the same state:

- the reaper (`app.fleet.reaper.reap_workers`: every silent worker's requests requeued, the
  worker dropped, the audit of their pools);
- the reconcile (`app.fleet.reconcile.reconcile_pools`: pools with waiting work and no worker);
- `vigil status`'s snapshot (`app.fleet.snapshot.collect`).

The same three passes over a baseline fleet of 10 workers and 5 pools run first in the same run.
Each line prints the pass's seconds, its Redis commands (Redis' own `total_commands_processed`)
and the ratio to the baseline; the goal is every pass under 1 s at 1,000 workers. The last line
is `ratio R` = the slowest large pass / 1 s.
"""
from __future__ import annotations

import argparse
import time

import redis

from app.fleet.reaper import reap_workers
from app.fleet.reconcile import reconcile_pools
from app.fleet.snapshot import collect
from app.local.embedded import EmbeddedRedis
from app.requests.models import ModelRegistry, ModelSpec
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.settings import load_settings
from app.state import keys
from app.state.conn import connect
from app.state.queues import job_queue_name
from app.state.store import RequestStore
from workers.heartbeat import Heartbeat

GiB = 1 << 30
REAP_TIMEOUT = 60.0
HELD_PER_DEAD = 5


def build(store: RequestStore, n_workers: int, n_pools: int, now: float) -> ModelRegistry:
    """Register the fleet (module docstring) and return its registry."""
    pools = [f"model-{p:04d}" for p in range(n_pools)]
    reg = ModelRegistry([ModelSpec(name=p, memory_gib=2, kv_cache_floor_gib=0.5)
                         for p in pools])
    for i in range(n_workers):
        pool = pools[i % n_pools]
        dead = i % 10 == 0
        at = now - (REAP_TIMEOUT * 3 if dead else 1.0)
        hb = Heartbeat(store.workers, 10_000 + i, f"gpu{i % 8}@node-{i // 8:04d}", 10, (
            lambda pool=pool: {"pools": pool, "configured_pools": pool, "model": pool,
                               "engine_state": "ready", "in_flight": 3,
                               "device_free_bytes": 40 * GiB, "device_total_bytes": 80 * GiB}),
            clock=lambda at=at: at)
        hb.has_pinged = True
        hb.beat()
        if dead:
            for j in range(HELD_PER_DEAD):
                rid = f"held-{i}-{j}"
                req = parse_request({"model": pool, "prompt": "x", "max_tokens": 4})
                store.create(rid, record_fields(req, now - 100, 3600), now - 100)
                store.begin(rid, 0, f"gpu{i % 8}", 10_000 + i, now - 100, 3, REAP_TIMEOUT)
    # Work waiting in a tenth of the pools (a message each, in their own queue).
    for p in pools[::10]:
        store.raw.lpush(job_queue_name(p, "default"), b'{"headers": {"id": "w"}}')
    return reg


def timed(store: RequestStore, fn) -> tuple[float, int, object]:
    """(seconds, Redis commands, result) of one call."""
    before = store.raw.info("stats")["total_commands_processed"]
    t = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t
    return secs, store.raw.info("stats")["total_commands_processed"] - before - 1, out


def passes(rds: EmbeddedRedis, n_workers: int, n_pools: int) -> dict[str, tuple[float, int]]:
    """Build a fleet on a flushed database and time the three passes over it."""
    redis.Redis.from_url(rds.url).flushall()
    settings = load_settings(redis_url=rds.url, worker_reap_timeout=REAP_TIMEOUT)
    store = RequestStore(connect(settings), 3600)
    now = time.time()
    reg = build(store, n_workers, n_pools, now)
    republished: list[str] = []
    out = {}
    secs, cmds, _ = timed(store, lambda: collect(store, settings, reg, now=now))
    out["status"] = (secs, cmds)
    secs, cmds, reaped = timed(store, lambda: reap_workers(
        store, now, lambda rid, rec, d: republished.append(rid), None,
        reap_timeout=REAP_TIMEOUT, max_attempts=3, registration_grace=REAP_TIMEOUT,
        max_reaps=n_workers))
    assert len(reaped) == (n_workers + 9) // 10, len(reaped)
    assert len(republished) == len(reaped) * HELD_PER_DEAD, len(republished)
    out["reaper"] = (secs, cmds)
    secs, cmds, _ = timed(store, lambda: reconcile_pools(
        store, reg, now, lambda name, q, add: None, live_window=REAP_TIMEOUT))
    out["reconcile"] = (secs, cmds)
    assert keys.WORKERS and store.raw.zcard(keys.WORKERS) == n_workers - len(reaped)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--pools", type=int, default=500)
    a = p.parse_args(argv)
    rds = EmbeddedRedis().start()
    try:
        base = passes(rds, 10, 5)
        big = passes(rds, a.workers, a.pools)
    finally:
        rds.stop()
    print(f"{'pass':<10} {'10 workers / 5 pools':>22} "
          f"{f'{a.workers} workers / {a.pools} pools':>28} {'ratio':>7}")
    for name in ("reaper", "reconcile", "status"):
        (bs, bc), (s, c) = base[name], big[name]
        print(f"{name:<10} {bs * 1000:>9.1f} ms {bc:>6} cmds {s * 1000:>13.1f} ms "
              f"{c:>7} cmds {s / bs:>7.1f}")
    print(f"ratio {max(s for s, _ in big.values()):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
