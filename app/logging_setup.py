"""One logging setup for Celery and vLLM (and vLLM's child processes).

Celery configures the worker's root logger; vLLM would otherwise install its own stdout handler
with another format, and its EngineCore/Worker children log on their own. We hand vLLM a
dictConfig file (VLLM_LOGGING_CONFIG_PATH, inherited by the children through the environment)
that uses Celery's line format (plus the logger name) on stderr, so every line of a worker
reads the same way.

Celery's two INFO lines per request (received, succeeded) are left out of a worker's log unless
VIGIL_LOG_REQUESTS (`quiet_per_request_lines`).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from celery.app import trace as celery_trace

from app.core_log import use_error_log

LINE_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(name)s: %(message)s"


def vllm_logging_config(level: str) -> dict:
    """The dictConfig vLLM and its children load: Vigil's line format on stderr, and vLLM's
    ERROR records in the worker's engine error file too (app/core_log.py: how the worker tells
    a CUDA fault from a request's)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vigil": {"format": LINE_FORMAT}},
        "handlers": {"vigil": {"class": "logging.StreamHandler", "formatter": "vigil",
                               "stream": "ext://sys.stderr", "level": level},
                     "vigil-engine-errors": {"()": "app.core_log.error_file_handler"}},
        "loggers": {"vllm": {"handlers": ["vigil", "vigil-engine-errors"], "level": level,
                             "propagate": False}},
    }


def configure_vllm_logging(cache_dir: Path, level: str) -> None:
    """Point vLLM at Vigil's logging config unless the operator already chose one (then the
    engine error file stays empty and engine deaths are judged without it)."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    use_error_log(cache_dir)
    path = cache_dir / f"vllm-logging-{level.lower()}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(vllm_logging_config(level)))
    os.replace(tmp, path)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    vllm_logger = sys.modules.get("vllm.logger")
    if vllm_logger is not None:
        # vLLM configures its loggers once, when it is imported: a worker forked from a process
        # that had imported it already (the test suite's, tests/worker_zygote.py) applies the
        # config now, as an import would have.
        vllm_logger._configure_vllm_root_logger()


class _DropLine(logging.Filter):
    """Drops the records of one message format (read when the record is filtered)."""

    def __init__(self, fmt: Callable[[], str]):
        super().__init__()
        self._fmt = fmt

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self._fmt()


def quiet_per_request_lines() -> None:
    """Stop Celery's two INFO lines per request in this worker process: "Task ... received"
    (its strategy logger, which then skips the line before building it) and "Task ...
    succeeded" (dropped by a filter before any handler formats or writes it). Every other line
    of Celery's, the failures and retries included, is kept. Call before the consumer starts
    (worker_init): Celery reads the strategy logger's level once, when it builds its strategies.
    Idempotent."""
    logging.getLogger("celery.worker.strategy").setLevel(logging.WARNING)
    trace_log = logging.getLogger("celery.app.trace")
    if not any(isinstance(f, _DropLine) for f in trace_log.filters):
        trace_log.addFilter(_DropLine(lambda: celery_trace.LOG_SUCCESS))
