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
from kombu import Queue

PROFILES = {"bare": "bench.noop", "vigil-conf": "bench.noop.vconf"}
# Vigil's Celery settings that change the per-task cost.
VIGIL_KEYS = ("task_acks_late", "task_reject_on_worker_lost", "worker_send_task_events",
              "task_send_sent_event", "task_track_started", "broker_transport_options",
              "result_backend_transport_options", "redis_max_connections", "result_expires",
              "worker_redirect_stdouts")


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
        from app.celery_app import create_app
        from app.settings import load_settings

        vigil = create_app(load_settings(redis_url=url)).conf
        app.conf.update({k: vigil[k] for k in VIGIL_KEYS})

    app.task(name="bench.noop")(noop)
    return app


def noop(x=None):
    """Return the argument: the cheapest task Celery can run."""
    return x


app = make_app(os.environ.get("BENCH_NOOP_PROFILE", "bare"))
