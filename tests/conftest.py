"""Shared fixtures for the three tiers (docs/testing.md).

A private redis-server is started once per run, before any test module imports the Celery app,
on a free port; VIGIL_REDIS_URL points at it. Redis-tier tests use database 1, flushed per test;
worker-tier tests share database 0 with real `celery worker` processes.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from app.embedded import EmbeddedRedis

_redis: EmbeddedRedis | None = None
# One model cache for the run (the tiny model is built once, ~5 s); reuse the developer's cache
# when VIGIL_TEST_CACHE_DIR is set.
CACHE_DIR = Path(os.environ.get("VIGIL_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="vigil-test-"))


def pytest_configure(config):
    global _redis
    _redis = EmbeddedRedis().start()
    os.environ["VIGIL_REDIS_URL"] = _redis.url
    os.environ["VIGIL_CACHE_DIR"] = str(CACHE_DIR)
    os.environ.pop("VIGIL_ENGINE", None)


def pytest_unconfigure(config):
    if _redis is not None:
        _redis.stop()


@pytest.fixture(scope="session")
def redis_server() -> EmbeddedRedis:
    assert _redis is not None
    return _redis


@pytest.fixture()
def redis_db1_url(redis_server) -> str:
    """A flushed database for one Redis-tier test."""
    url = f"redis://127.0.0.1:{redis_server.port}/1"
    import redis

    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture()
def settings(redis_db1_url):
    from app.settings import load_settings

    return load_settings(redis_url=redis_db1_url, cache_dir=CACHE_DIR)
