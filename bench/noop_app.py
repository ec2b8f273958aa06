"""A bare Celery app with one no-op task: the baseline for Vigil's per-request overhead.

Run by bench/throughput.py as

    python -m celery -A bench.noop_app worker -P threads -c N --prefetch-multiplier 1 -Q bench.noop

with `VIGIL_REDIS_URL` naming the Redis. `BENCH_NOOP_PROFILE` picks the configuration:

- `bare` (default): JSON, a result backend, Celery's defaults otherwise (early ack, no events).
- `vigil-conf`: the Celery settings Vigil uses (acks_late, task events incl. task-sent,
  track_started) on queue `bench.noop.vconf`, but none of Vigil's code: separates the cost of
  Celery configuration from the cost of Vigil's own work per request.
"""
from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

PROFILES = {"bare": "bench.noop", "vigil-conf": "bench.noop.vconf"}


def make_app(profile: str = "bare", redis_url: str | None = None) -> Celery:
    """The no-op app for `profile` (no connection is made here)."""
    if profile not in PROFILES:
        raise ValueError(f"BENCH_NOOP_PROFILE must be one of {sorted(PROFILES)}, got {profile!r}")
    url = redis_url or os.environ.get("VIGIL_REDIS_URL", "redis://localhost:6379/0")
    queue = PROFILES[profile]
    app = Celery("bench_noop", broker=url, backend=url)
    app.conf.update(
        task_serializer="json", result_serializer="json",
        accept_content=["json"], result_accept_content=["json"],
        task_queues=[Queue(queue)], task_default_queue=queue,
        worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True,
    )
    if profile == "vigil-conf":
        app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True,
                        worker_send_task_events=True, task_send_sent_event=True,
                        task_track_started=True)

    app.task(name="bench.noop")(noop)
    return app


def noop(x=None):
    """Return the argument: the cheapest task Celery can run."""
    return x


app = make_app(os.environ.get("BENCH_NOOP_PROFILE", "bare"))
