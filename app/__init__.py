"""Vigil's Celery application: `celery -A app worker|beat|flower`.

`app.app` (alias `app.celery`) is built on first access from `VIGIL_*` settings (a bad setting
raises SettingsError naming the variable). It connects to nothing; importing a submodule such as
`app.errors` does not build it.
"""
from __future__ import annotations


def __getattr__(name: str):
    if name in ("app", "celery"):
        from app.celery_app import shared_app  # built on first access, never at import

        return shared_app()
    raise AttributeError(f"module 'app' has no attribute {name!r}")
