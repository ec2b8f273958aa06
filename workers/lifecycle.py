"""Celery start-up and shutdown hooks of a Vigil worker process.

worker_init  -> logging for vLLM, the WorkerRuntime (heartbeat, engine loop, orphan guard)
worker_ready -> preload the engines of VIGIL_POOLS in the background
worker_shutdown -> the engine is shut down cleanly (no leaked processes or shared memory)
"""
from __future__ import annotations

import logging
import threading

from celery.app import trace as celery_trace
from celery.signals import worker_init, worker_ready, worker_shutdown

from app.logging_setup import configure_vllm_logging
from app.settings import get_settings
from workers import runtime

log = logging.getLogger("vigil.worker")


@worker_init.connect
def _on_worker_init(sender=None, **_):
    s = get_settings()
    configure_vllm_logging(s.cache_dir, s.log_level)
    if not s.log_payloads:
        # Celery logs a task's return value on success; ours holds the generated text (user
        # data). Keep the line, drop the payload, unless VIGIL_LOG_PAYLOADS=1.
        celery_trace.LOG_SUCCESS = "Task %(name)s[%(id)s] succeeded in %(runtime)ss"
    runtime.install(runtime.WorkerRuntime(s, getattr(sender, "hostname", "") or "worker").start())


@worker_ready.connect
def _on_worker_ready(sender=None, **_):
    rt = runtime.get_runtime()
    pools = [p for p in rt.settings.pools if p]
    if not pools:
        return

    def _preload():
        try:
            rt.preload(pools)
        except Exception as e:  # requests will retry the load and report the error themselves
            log.error("preloading %s failed: %s", pools, e)

    threading.Thread(target=_preload, name="vigil-preload", daemon=True).start()


@worker_shutdown.connect
def _on_worker_shutdown(sender=None, **_):
    runtime.uninstall()
