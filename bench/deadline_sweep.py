"""Memory of the deadline sweep over a large backlog (issue: 100k pending records).

    python -m bench.deadline_sweep [--records 100000]

Starts a private Redis, writes N expired PENDING records (pipelined, with the same Lua script the
producer uses), sweeps them with `app.fleet.deadlines.sweep_deadlines`, and reports the sweeper's
peak Python memory (tracemalloc) and time, against the same sweep over a 1,000-record backlog in
the same run. The last line is `ratio R` = peak memory (N) / peak memory (1,000): ~1 means the
sweep's memory does not grow with the backlog.
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

from app.fleet.deadlines import sweep_deadlines
from app.local.embedded import EmbeddedRedis
from app.requests.schemas import parse_request
from app.requests.submit import record_fields
from app.settings import load_settings
from app.state.conn import connect
from app.state.store import RequestStore


def fill(store: RequestStore, n: int, prefix: str) -> None:
    req = parse_request({"model": "tiny-llama", "prompt": "a prompt of some length " * 20,
                         "deadline_s": 1})
    fields = record_fields(req, 1000.0, 3600)
    for start in range(0, n, 1000):
        with store.r.pipeline(transaction=False) as pipe:
            s = RequestStore(pipe, 3600)  # same scripts, queued on the pipeline
            for i in range(start, min(n, start + 1000)):
                s._create(keys=[f"vigil:req:{prefix}{i}", "vigil:deadlines"],
                          args=[f"{prefix}{i}", 1001.0, *sum(([k, v] for k, v in fields.items()), [])],
                          client=pipe)
            pipe.execute()


class CountingBackend:
    """Stands in for Celery's result backend: counts the failures the sweep tells it."""

    def __init__(self):
        self.failed = 0

    def mark_as_failure(self, task_id, exc):
        self.failed += 1

    def mark_as_done(self, task_id, result):
        pass


def measure(store: RequestStore, n: int, prefix: str) -> tuple[float, float, int]:
    fill(store, n, prefix)
    told = CountingBackend()
    tracemalloc.start()
    t = time.perf_counter()
    failed = sweep_deadlines(store, 2000.0, told)
    elapsed = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert failed == told.failed == n, (failed, told.failed, n)
    return peak / 1024, elapsed, failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=100_000)
    a = p.parse_args(argv)
    rds = EmbeddedRedis().start()
    try:
        store = RequestStore(connect(load_settings(redis_url=rds.url)), 3600)
        base_kib, base_s, _ = measure(store, 1000, "base-")
        kib, secs, n = measure(store, a.records, "big-")
        print(f"baseline: 1000 records swept in {base_s:.2f} s, peak {base_kib:.0f} KiB")
        print(f"backlog : {n} records swept in {secs:.2f} s ({n / secs:.0f}/s), "
              f"peak {kib:.0f} KiB; Redis used {rds.client().info('memory')['used_memory_human']}")
        print(f"ratio {kib / base_kib:.2f}")
    finally:
        rds.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
