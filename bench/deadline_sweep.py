"""Memory of the deadline sweep over a large backlog (issue: 100k pending records).

    python -m bench.deadline_sweep [--records 100000]

Starts a private Redis, writes N expired PENDING records (pipelined, with the same Lua script the
producer uses), sweeps them with `app.fleet.deadlines.sweep_deadlines` telling Celery's real Redis
result backend (as beat's task does), checks from Redis that every record ended FAILED and every
request has its Celery result key, and reports the sweeper's peak Python memory (tracemalloc),
time and Redis round trips (Redis' own `total_commands_processed` and the sweep's chunks),
against the same sweep over a 1,000-record backlog in the same run (memory and time from
separate sweeps: tracemalloc slows Python down). The last line is `ratio R`
= peak memory (N) / peak memory (1,000): ~1 means the sweep's memory does not grow with the
backlog.
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

from app.celery_app import create_app
from app.fleet.deadlines import sweep_deadlines
from app.local.embedded import EmbeddedRedis
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.settings import load_settings
from app.state.conn import connect
from app.state.store import RequestStore


def fill(store: RequestStore, n: int, prefix: str) -> None:
    """N expired PENDING records, written by the producer's own script (CREATE), 1,000 a round
    trip."""
    req = parse_request({"model": "tiny-llama", "prompt": "a prompt of some length " * 20,
                         "deadline_s": 1})
    fields = record_fields(req, 1000.0, 3600)
    for start in range(0, n, 1000):
        store.create_many([(f"{prefix}{i}", fields) for i in range(start, min(n, start + 1000))],
                          1000.0)


def count_keys(client, pattern: str) -> int:
    return sum(1 for _ in client.scan_iter(match=pattern, count=10_000))


def measure(store: RequestStore, backend, n: int, prefix: str, *, trace: bool
            ) -> tuple[float, float, int]:
    """(peak KiB or 0, seconds, Redis commands) of one sweep over n fresh records; with `trace`
    the peak Python memory is traced (tracemalloc slows Python down: the time of a traced
    sweep is not reported)."""
    fill(store, n, prefix)
    before = store.raw.info("stats")["total_commands_processed"]
    if trace:
        tracemalloc.start()
    t = time.perf_counter()
    failed = sweep_deadlines(store, 2000.0, backend)
    elapsed = time.perf_counter() - t
    peak = 0
    if trace:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    commands = store.raw.info("stats")["total_commands_processed"] - before - 1
    assert failed == n, (failed, n)
    assert store.raw.zcard("vigil:deadlines") == 0
    assert count_keys(store.raw, f"celery-task-meta-{prefix}*") == n
    assert store.get(f"{prefix}{n - 1}")["status"] == "FAILED"
    store.raw.flushdb()
    return peak / 1024, elapsed, commands


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=100_000)
    a = p.parse_args(argv)
    rds = EmbeddedRedis().start()
    try:
        settings = load_settings(redis_url=rds.url)
        store = RequestStore(connect(settings), 3600)
        app = create_app(settings)
        base_kib, _, _ = measure(store, app.backend, 1000, "base-", trace=True)
        kib, _, _ = measure(store, app.backend, a.records, "big-", trace=True)
        _, base_s, base_cmds = measure(store, app.backend, 1000, "base-", trace=False)
        _, secs, cmds = measure(store, app.backend, a.records, "big-", trace=False)
        n = a.records
        print(f"baseline: 1000 records swept in {base_s:.2f} s, peak {base_kib:.0f} KiB, "
              f"{base_cmds} Redis commands")
        print(f"backlog : {n} records swept in {secs:.2f} s ({n / secs:.0f}/s), "
              f"peak {kib:.0f} KiB; {cmds} Redis commands ({cmds / n:.2f} per request)")
        print(f"ratio {kib / base_kib:.2f}")
    finally:
        rds.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
