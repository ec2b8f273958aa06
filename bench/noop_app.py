"""A bare Celery app with one no-op task: the baseline for Vigil's per-request overhead.

Run by bench/throughput.py as

    python -m celery -A bench.noop_app worker -P threads -c N --prefetch-multiplier 1 -Q bench.noop

with `VIGIL_REDIS_URL` naming the Redis. `BENCH_NOOP_PROFILE` picks the configuration:

- `bare` (default): JSON, a result backend, Celery's defaults otherwise (early ack, no events).
- `vigil-conf`: the Celery settings Vigil uses (read from `app.celery_app.create_app`, so they
  follow Vigil's configuration) on queue `bench.noop.vconf`, but none of Vigil's code: separates
  the cost of Celery configuration from the cost of Vigil's own work per request.
"""
from __future__ import annotations

import os

from celery import Celery

from bench.celery_stock import stock_app

PROFILES = {"bare": "bench.noop", "vigil-conf": "bench.noop.vconf"}


def make_app(profile: str = "bare", redis_url: str | None = None) -> Celery:
    """The no-op app for `profile` (no connection is made here)."""
    if profile not in PROFILES:
        raise ValueError(f"BENCH_NOOP_PROFILE must be one of {sorted(PROFILES)}, got {profile!r}")
    app = stock_app("bench_noop", PROFILES[profile], redis_url,
                    vigil_conf=profile == "vigil-conf")
    app.task(name="bench.noop")(noop)
    return app


def noop(x=None):
    """Return the argument: the cheapest task Celery can run."""
    return x


app = make_app(os.environ.get("BENCH_NOOP_PROFILE", "bare"))
