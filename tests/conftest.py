"""Shared fixtures for the three tiers (docs/testing.md).

A private redis-server is started once per run, before any test module imports the Celery app,
on a free port; VIGIL_REDIS_URL points at it. Redis-tier tests use database 1, flushed per test;
worker-tier tests share database 0 with real `celery worker` processes.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.redis_servers import LocalRedis
from tests.unit_helpers import EVENT_KWARGS, callback_events
from tests.worker_procs import RunningWorker, stop_zygote

_redis: LocalRedis | None = None
UNSERVED_MODEL = "unserved-model"
# One model cache for the run (the tiny model is built once, ~5 s); reuse the developer's cache
# when VIGIL_TEST_CACHE_DIR is set.
CACHE_DIR = Path(os.environ.get("VIGIL_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="vigil-test-"))
# pytest-xdist's processes inherit it from the controller: one model cache for all of them
# (model_files.py builds a model under a file lock, so two processes never build it twice).
os.environ.setdefault("VIGIL_TEST_CACHE_DIR", str(CACHE_DIR))
# Every worker of the run writes down each generation its engine finished here (the witness,
# workers/engine/witness.py); the exactly-once checks compare it with the stored results.
WITNESS_DIR = Path(tempfile.mkdtemp(prefix="vigil-witness-"))


# The run's scheduling across xdist processes: longest modules first, `alone` tests.
pytest_plugins = ["tests.suite_schedule"]


def pytest_configure(config):
    global _redis
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test: each of its processes starts its own Redis
    _redis = LocalRedis().start()
    os.environ["VIGIL_REDIS_URL"] = _redis.url
    os.environ["VIGIL_CACHE_DIR"] = str(CACHE_DIR)
    os.environ["VIGIL_WITNESS_DIR"] = str(WITNESS_DIR)
    # A pool that no test worker serves (never loaded): requests for it can only end by deadline.
    models = CACHE_DIR / "test-models.json"
    models.write_text(json.dumps({"models": [
        {"name": UNSERVED_MODEL, "path": str(CACHE_DIR / "no-such-weights"), "max_model_len": 512},
        *fault_test_models(CACHE_DIR)]}))
    os.environ["VIGIL_MODELS_FILE"] = str(models)
    # LoRA adapters named by path must live here (tests/test_lora_e2e.py builds them).
    os.environ["VIGIL_ADAPTER_ROOTS"] = str(CACHE_DIR / "adapters")
    os.environ.pop("VIGIL_ENGINE", None)


DRILL_MODEL = "tiny-llama-drill"  # tiny-llama's weights, served only by drill workers
ROOMY_MODEL = "roomy-llama"  # tiny-llama's weights; its worker is told it needs most memory
HUGE_MODEL = "huge-llama"  # says it needs 100,000 GiB: no worker can ever take it
CORRUPT_MODEL = "corrupt-llama"  # a model dir whose config.json is garbage
MISSING_MODEL = "missing-llama"  # a registered path with nothing there
SLOW_START_MODEL = "slow-start-llama"  # tiny-llama's weights, for workers started together
TIERS_MODEL = "tiers-llama"  # tiny-llama's weights, an engine batch of 4 (tiers, preemption)


def fault_test_models(cache_dir: Path) -> list[dict]:
    """Registry entries of the fault tests' extra pools (same weights as tiny-llama, or broken)."""
    from app.requests.models import TINY_MAX_POSITIONS as MAX_POSITIONS
    from app.requests.models import TINY_VERSION
    from app.requests.models import TINY_VOCAB_SIZE as VOCAB_SIZE

    tiny = {"path": str(cache_dir / "models" / f"tiny-llama-v{TINY_VERSION}"),
            "builder": "tiny-llama", "max_model_len": MAX_POSITIONS, "vocab_size": VOCAB_SIZE,
            "engine_args": {"max_model_len": MAX_POSITIONS, "enforce_eager": True, "seed": 0,
                            "dtype": "float32"}}
    corrupt = cache_dir / "corrupt-model"
    corrupt.mkdir(parents=True, exist_ok=True)
    (corrupt / "config.json").write_text("{this is not json")
    return [
        {"name": DRILL_MODEL, **tiny, "memory_gib": 2.0},
        {"name": ROOMY_MODEL, **tiny, "memory_gib": 2.0, "kv_cache_gib": 0.5,
         "kv_cache_floor_gib": 0.25},
        {"name": HUGE_MODEL, **tiny, "memory_gib": 100000.0},
        {"name": SLOW_START_MODEL, **tiny, "memory_gib": 2.0},
        {"name": TIERS_MODEL, **tiny, "memory_gib": 2.0,
         "engine_args": {**tiny["engine_args"], "max_num_seqs": 4}},
        {"name": CORRUPT_MODEL, "path": str(corrupt), "max_model_len": MAX_POSITIONS},
        {"name": MISSING_MODEL, "path": str(cache_dir / "missing-weights"),
         "max_model_len": MAX_POSITIONS},
    ]


def pytest_unconfigure(config):
    stop_zygote()
    if _redis is not None:
        _redis.stop()


@pytest.fixture(scope="session")
def redis_server() -> LocalRedis:
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


@pytest.fixture(scope="module")
def quiet_redis():
    """A redis-server of one module's own, for the tests that count with Redis' own counters
    (calls per command, keyspace hits and misses): those are the server's, and the suite
    process' warm worker, once started, heartbeats on the shared one (a CI run counted 3 hits
    for 1 in tests/test_submit_many.py)."""
    rds = LocalRedis().start()
    yield rds
    rds.stop()


@pytest.fixture()
def quiet_settings(quiet_redis):
    """Settings on a flushed database 1 of `quiet_redis`, its counters reset."""
    from app.settings import load_settings

    client = quiet_redis.client()
    client.flushall()
    client.config_resetstat()
    return load_settings(redis_url=f"redis://127.0.0.1:{quiet_redis.port}/1",
                         cache_dir=CACHE_DIR)


@pytest.fixture()
def heap_restored():
    """For a test of app/heap.py's freeze: the test process' heap unfrozen before it, and
    after it unfrozen again with the collector's thresholds as they were (a frozen heap left
    behind would keep later tests' garbage from ever being collected)."""
    import gc

    gc.unfreeze()
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


# -- pytest-celery (celery.contrib.pytest's fixtures, re-exported by its plugin) ---------------
@pytest.fixture()
def celery_config(settings) -> dict:
    """The configuration of pytest-celery's `celery_app`: Vigil's own (app/celery_app.py), on
    the Redis tier's flushed database 1, with the test process' logging left alone."""
    from app.celery_app import celery_config as vigil_celery_config
    from app.requests.models import get_registry

    return {**vigil_celery_config(settings, get_registry()), "worker_hijack_root_logger": False}


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    """The pool of pytest-celery's in-process `celery_worker`: threads, as Vigil's workers."""
    return "threads"


@pytest.fixture(scope="session")
def celery_includes() -> list[str]:
    """Imported before the in-process worker starts: the ping task its start-up check sends."""
    return ["celery.contrib.testing.tasks"]


@pytest.fixture()
def inprocess_worker(celery_app, celery_includes, celery_worker_pool, celery_worker_parameters):
    """celery.contrib.pytest's `celery_worker`, by another name: an in-process worker of
    `celery_app` (threads pool), started once it answers a ping and stopped after the test.
    pytest-celery 1.3 gives the name `celery_worker` to its Docker-container worker, which
    this machine cannot run (docs/testing.md)."""
    from celery.contrib.testing import worker

    for module in celery_includes:
        celery_app.loader.import_task_module(module)
    with worker.start_worker(celery_app, pool=celery_worker_pool,
                             **celery_worker_parameters) as w:
        yield w


@pytest.fixture(scope="session")
def warm_worker(redis_server, tmp_path_factory):
    """One warm worker shared by the worker-tier tests that only send it requests."""
    # Kept warm for the whole run (no idle cleanup): other modules' workers run for minutes
    # between its tests, and its load count is part of what test_worker_e2e checks.
    w = RunningWorker(redis_server, "warm@testhost", tmp_path_factory.mktemp("warm"),
                      VIGIL_IDLE_CLEANUP="0")
    try:
        w.wait_engine()
        yield w
    finally:
        w.stop()


@pytest.fixture()
def make_host():
    """Build engine hosts from a fake engine factory (unit tier); shut them all down after.
    Callables named as EVENT_KWARGS become the host's events (`callback_events`)."""
    from workers.engine.host import EngineHost

    hosts = []

    def _make(factory, **kw):
        events = callback_events(**{k: kw.pop(k) for k in EVENT_KWARGS if k in kw})
        h = EngineHost(factory, idle_cleanup=kw.pop("idle_cleanup", 0), events=events,
                       **kw).start()
        hosts.append(h)
        return h

    yield _make
    for h in hosts:
        h.shutdown(timeout=1)
