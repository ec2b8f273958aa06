"""Vigil's Celery application: `celery -A app worker|beat|flower`.

Importing this builds the app from `VIGIL_*` settings (a bad setting raises SettingsError naming
the variable) and connects to nothing.
"""
from app.celery_app import create_app

app = create_app()
celery = app

__all__ = ["app", "celery"]
