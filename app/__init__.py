"""Vigil's Celery application: `celery -A app worker|beat|flower`.

`app.app` (alias `app.celery`) is built on first access from `VIGIL_*` settings (a bad setting
raises SettingsError naming the variable). It connects to nothing; importing a submodule such as
`app.errors` does not build it.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_app = None


def __getattr__(name: str):
    global _app
    if name in ("app", "celery"):
        with _lock:
            if _app is None:
                from app.celery_app import create_app

                _app = create_app()
        return _app
    raise AttributeError(f"module 'app' has no attribute {name!r}")
