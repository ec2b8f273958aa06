"""One logging setup for Celery and vLLM (and vLLM's child processes).

Celery configures the worker's root logger; vLLM would otherwise install its own stdout handler
with another format, and its EngineCore/Worker children log on their own. We hand vLLM a
dictConfig file (VLLM_LOGGING_CONFIG_PATH, inherited by the children through the environment)
that uses Celery's line format (plus the logger name) on stderr, so every line of a worker
reads the same way.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

LINE_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(name)s: %(message)s"


def vllm_logging_config(level: str) -> dict:
    """The dictConfig vLLM and its children load."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vigil": {"format": LINE_FORMAT}},
        "handlers": {"vigil": {"class": "logging.StreamHandler", "formatter": "vigil",
                               "stream": "ext://sys.stderr", "level": level}},
        "loggers": {"vllm": {"handlers": ["vigil"], "level": level, "propagate": False}},
    }


def configure_vllm_logging(cache_dir: Path, level: str) -> None:
    """Point vLLM at Vigil's logging config unless the operator already chose one."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"vllm-logging-{level.lower()}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(vllm_logging_config(level)))
    os.replace(tmp, path)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
