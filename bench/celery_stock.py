"""The stock Celery app the benches' bare workers share (bench/noop_app.py,
bench/bare_engine_app.py), optionally with the Celery settings Vigil uses."""
from __future__ import annotations

import os
import sys

from celery import Celery
from kombu import Queue

# Vigil's Celery settings that change the per-task cost.
VIGIL_KEYS = ("task_acks_late", "task_reject_on_worker_lost", "worker_send_task_events",
              "task_send_sent_event", "task_track_started", "broker_transport_options",
              "result_backend_transport_options", "redis_max_connections", "result_expires",
              "worker_redirect_stdouts")


def stock_app(name: str, queue: str, redis_url: str | None = None,
              vigil_conf: bool = False) -> Celery:
    """A Celery app on `queue` with Celery's defaults (early ack, no events, no retries), JSON
    and results in Redis (`redis_url`, else `VIGIL_REDIS_URL`); with `vigil_conf`, Vigil's own
    values of VIGIL_KEYS (read from `app.celery_app.create_app`, so they follow Vigil's
    configuration) but none of Vigil's code. No connection is made here."""
    url = redis_url or os.environ.get("VIGIL_REDIS_URL", "redis://localhost:6379/0")
    app = Celery(name, broker=url, backend=url)
    app.conf.update(
        task_serializer="json", result_serializer="json",
        accept_content=["json"], result_accept_content=["json"],
        task_queues=[Queue(queue)], task_default_queue=queue,
        worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True,
    )
    if vigil_conf:
        from app.celery_app import create_app
        from app.settings import load_settings

        vigil = create_app(load_settings(redis_url=url)).conf
        app.conf.update({k: vigil[k] for k in VIGIL_KEYS})
    return app


def stock_worker_argv(app_module: str, queue: str, name: str, concurrency: int,
                      vigil_conf: bool = False) -> list[str]:
    """The `celery worker` command line of a bare bench worker for `app_module`: the threads pool,
    `concurrency` threads, one message prefetched per thread, on `queue` only; with
    `vigil_conf`, also the log level `vigil worker` passes (INFO)."""
    argv = [sys.executable, "-m", "celery", "-A", app_module, "worker", "-P", "threads",
            "-c", str(concurrency), "--prefetch-multiplier", "1", "-Q", queue, "-n", name]
    return argv + (["-l", "INFO"] if vigil_conf else [])
