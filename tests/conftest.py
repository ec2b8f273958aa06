"""Shared fixtures for the three tiers (docs/testing.md).

A private redis-server is started once per run, before any test module imports the Celery app,
on a free port; VIGIL_REDIS_URL points at it. Redis-tier tests use database 1, flushed per test;
worker-tier tests share database 0 with real `celery worker` processes.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import pytest

from tests.redis_servers import LocalRedis

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
    if _zygote is not None:
        _zygote.stop()
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


# -- worker tier -----------------------------------------------------------------------------
def worker_entry(client, name: str) -> dict[str, str] | None:
    """The registry hash of the live worker called `name` (Celery node name), if any."""
    for key in client.scan_iter("vigil:worker:*"):
        raw = client.hgetall(key)
        entry = {k.decode(): v.decode() for k, v in raw.items()}
        if entry.get("name") == name:
            return entry
    return None


_zygote = None  # tests/worker_zygote.py: this process' pre-imported parent of its workers


def forked_worker(redis_url: str, name: str, log: Path, concurrency: int | None,
                  pools: str | None, **env):
    """A real `vigil worker --cpu` (app/local/embedded.py's command line and environment),
    forked from this test process' zygote so that it skips importing vLLM again
    (tests/worker_zygote.py); VIGIL_TEST_FORK_WORKERS=0 starts it with a plain exec instead."""
    global _zygote
    from app.local.embedded import REPO, start_worker, vigil_env, worker_command
    from tests.worker_zygote import Zygote

    if os.environ.get("VIGIL_TEST_FORK_WORKERS", "1") == "0":
        return start_worker(redis_url, name, log, concurrency=concurrency, pools=pools, **env)
    if _zygote is None:
        _zygote = Zygote.start(vigil_env(redis_url), REPO)
    return _zygote.spawn(worker_command(name, concurrency, pools), vigil_env(redis_url, **env),
                         REPO, log)


class RunningWorker:
    """A real `vigil worker --cpu` subprocess (Celery threads pool, vLLM CPU engine)."""

    def __init__(self, redis_server, name: str, tmp: Path, pools: str = "tiny-llama",
                 concurrency: int = 64, **env):
        self.name = name
        self.log = tmp / f"{name.split('@')[0]}.log"
        self.client = redis_server.client()
        env.setdefault("VIGIL_HEARTBEAT_INTERVAL", "1")
        self.proc = forked_worker(redis_server.url, name, self.log, concurrency, pools, **env)

    def entry(self) -> dict[str, str] | None:
        return worker_entry(self.client, self.name)

    def wait_engine(self, timeout: float = 300) -> dict[str, str]:
        from app.local.embedded import wait_for

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}); log:\n"
                                   + self.log.read_text()[-4000:])
            e = self.entry()
            # Loaded and ready (has_pinged): a test that kills it from here on meets a worker
            # the reaper judges by the reap timeout, not the registration grace.
            return (e if e and int(e.get("engine_loads", 0)) >= 1 and e.get("has_pinged") == "1"
                    else None)

        return wait_for(ready, timeout, 0.2, f"{self.name}'s engine")

    def wait_registered(self, timeout: float = 120) -> dict[str, str]:
        """The worker's registry entry once it heartbeats (no engine needed)."""
        from app.local.embedded import wait_for

        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}); log:\n"
                                   + self.log.read_text()[-4000:])
            return self.entry()

        return wait_for(up, timeout, 0.2, f"{self.name} to register")

    def engine_core_pids(self) -> list[int]:
        """PIDs of this worker's vLLM EngineCore process(es)."""
        import psutil

        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "EngineCore" in " ".join(p.cmdline()) + p.name():
                    out.append(p.pid)
            except psutil.Error:
                continue
        return out

    def stop(self) -> None:
        from app.local.embedded import stop_process

        stop_process(self.proc, timeout=60)


def engine_processes(pid: int) -> list:
    """Live descendants (psutil.Process) of the worker `pid`: its engine processes, less its
    orphan guard."""
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "orphan_guard" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def wait_processes_gone(procs, timeout: float = 30) -> None:
    """Wait until none of `procs` (psutil.Process) is alive (zombies count as gone)."""
    import psutil

    from app.local.embedded import wait_for

    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                             for p in procs), timeout, what="engine processes to exit")


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


def start_batch_beat(redis_server, tmp: Path, **env):
    """A real `celery beat` on the suite's Redis whose batch tick runs every half second (the
    batch objects' driver; the warm worker, which consumes vigil.housekeeping, runs it)."""
    import sys

    from app.local.embedded import start_process, vigil_env

    return start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                          "-s", str(tmp / "batch-beat-schedule")],
                         vigil_env(redis_server.url, VIGIL_BATCH_TICK_INTERVAL="0.5", **env),
                         tmp / "batch-beat.log")


def queued(client, queue: str) -> int:
    """Messages waiting in `queue`, every priority list of it (a request's tier picks the list:
    app/requests/tiers.py)."""
    from app.state import broker

    return broker.depths(client, [queue])[0]


@contextlib.contextmanager
def stepped_aside(name: str, queue: str = "vigil.pool.tiny-llama", timeout: float = 30):
    """Worker `name` stops consuming `queue` for the block and consumes it again after (each
    change waited for, as the worker itself reports its queues). A test whose victim must hold
    the requests sends them inside: which consumer takes a message is otherwise a race, and an
    idle warm worker with free slots (prefetch = concurrency) may take a whole batch before a
    just-started one pops any."""
    from app import app
    from app.local.embedded import wait_for

    bus = app.vigil_ports.bus
    bus.cancel_consumer(queue, [name])
    wait_for(lambda: queue not in (bus.active_queues(name) or [queue]), timeout, 0.2,
             f"{name} to stop consuming {queue}")
    try:
        yield
    finally:
        bus.add_consumer(queue, [name])
        wait_for(lambda: queue in (bus.active_queues(name) or []), timeout, 0.2,
                 f"{name} to consume {queue} again")


def every_request_taken(store, results, instances, queue: str = "vigil.pool.tiny-llama") -> bool:
    """True once every request of `results` has left the queue and is held by one of the worker
    `instances` (or has ended). Fault tests kill only then: a message a consumer popped in the
    last instant before a SIGKILL, before its hold was written with kombu's note of it
    (app/state/transport.py), is not in the worker's in-flight set: it comes back through the
    reaper's audit (app/fleet/message_audit.py), not with the worker's other requests, which
    would blur what the test measures."""
    from app.state import keys

    if queued(store.raw, queue):
        return False
    held = set().union(*(store.raw.smembers(keys.inflight(i)) for i in instances))
    return all(r.id.encode() in held or store.get(r.id)["status"] in ("SUCCEEDED", "FAILED")
               for r in results)


def assert_each_ran_to_a_result_once(store, request_ids, *,
                                     at_most: dict[str, int] | None = None) -> None:
    """Exactly once, per request, from its own history: one attempt succeeded, and no attempt
    is left open (a second run that lost its finish leaves its attempt open). Unlike the global
    `duplicate_results` counter, this cannot be moved by other tests' stragglers. And from a
    witness outside Vigil's records (`assert_witnessed`): one finished generation each, but
    for the requests `at_most` names, which may have up to that many."""
    assert_witnessed(store, request_ids, at_most=at_most)
    bad = {}
    for rid in request_ids:
        h = store.history(rid)
        succeeded = sum(e["outcome"] == "succeeded" for e in h)
        still_open = sum(e["outcome"] is None for e in h)
        if succeeded != 1 or still_open:
            bad[rid] = [(e["worker"], e["outcome"], e["error"]) for e in h]
    assert not bad, f"requests not run to a result exactly once: {bad}"


def assert_witnessed(store, request_ids, *, at_most: dict[str, int] | None = None,
                     witness_dir: Path | None = None) -> dict[str, int]:
    """The engines' witness (workers/engine/witness.py, written by the engine side, read by no
    Vigil code) agrees with the stored results: each request has exactly one stored result,
    a generation its engine finished in that attempt produced as many tokens (counting those
    it continued from, for a resumed run), and its engines ran it to completion exactly once
    (`finished_generations`; canaries belong to no request). A request that may legitimately
    have finished more than once (its engine finished, then its finish was lost: a worker
    killed or a wedge aborted in between, a Redis crash undoing the write) must be named in
    `at_most` with the most it may have; no other request gets that leeway. Returns the
    number of finished generations per request. `witness_dir`: the suite's unless given."""
    import json

    from workers.engine.witness import finished_generations, read_witness

    at_most = at_most or {}
    seen = read_witness(WITNESS_DIR if witness_dir is None else witness_dir)
    bad, generations = {}, {}
    for rid in request_ids:
        rec = store.get(rid) or {}
        runs = seen.get(rid, [])
        generations[rid] = finished_generations(runs)
        if rec.get("status") != "SUCCEEDED" or not rec.get("result"):
            bad[rid] = f"no stored result ({rec.get('status')})"
            continue
        res = json.loads(rec["result"])
        if not any(g["attempt"] == res["attempts"] and g["total"] == res["completion_tokens"]
                   and g["sample"] == 0 for g in runs):
            bad[rid] = (f"stored attempt {res['attempts']}, {res['completion_tokens']} tokens; "
                        f"the witness saw {runs}")
        elif not 1 <= generations[rid] <= at_most.get(rid, 1):
            bad[rid] = (f"ran to completion {generations[rid]} times (allowed "
                        f"{at_most.get(rid, 1)}); the witness saw {runs}")
    assert not bad, f"stored results the engines' witness does not back: {bad}"
    return generations


def wait_until(cond, timeout: float = 10.0) -> None:
    """Poll `cond` every 10 ms until it is true; fail after `timeout` seconds (unit tier)."""
    from app.local.embedded import wait_for

    wait_for(cond, timeout, 0.01, "the condition")


def callback_events(*, on_change=None, on_fatal=None, on_failure=None, on_success=None,
                    served_elsewhere=None, planner=None):
    """The engine host's events (workers/engine/host_state.py HostEvents) from plain callables,
    for unit tests: each one given replaces that event's harmless default."""
    from workers.engine.host import HostEvents

    class Events(HostEvents):
        def changed(self):
            if on_change is not None:
                on_change()

        def fatal(self, err):
            if on_fatal is not None:
                on_fatal(err)

        def failure(self, reason):
            if on_failure is not None:
                on_failure(reason)

        def success(self):
            if on_success is not None:
                on_success()

        def served_elsewhere(self, model):
            return served_elsewhere(model) if served_elsewhere is not None else False

        def plan_memory(self, spec):
            return planner(spec) if planner is not None else None

    return Events()


EVENT_KWARGS = ("on_change", "on_fatal", "on_failure", "on_success", "served_elsewhere",
                "planner")


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


class Told(list):
    """A stand-in for Celery's result backend (`end_request`'s `backend`): records each failure
    it is told as (request id, error message), each result in `done`. Thread-safe appends."""

    def __init__(self):
        super().__init__()
        self.done: list[tuple[str, dict]] = []

    def mark_as_failure(self, task_id, exc):
        self.append((task_id, str(exc)))

    def mark_as_done(self, task_id, result):
        self.done.append((task_id, result))

    @property
    def ids(self) -> list[str]:
        return [rid for rid, _ in self]


class NeverTold:
    """A result backend that fails the test if it is told anything."""

    def mark_as_failure(self, task_id, exc):
        pytest.fail(f"told the backend that {task_id} failed: {exc}")

    def mark_as_done(self, task_id, result):
        pytest.fail(f"told the backend that {task_id} succeeded")


class RecordingPorts:
    """A Celery app's ports (app/celery_ports.py) that publish nothing: `sent` records each
    vigil.generate message as (request id, dispatch); no result backend; control broadcasts
    recorded in `broadcasts`. For Redis-tier tests of worker-side rules."""

    def __init__(self):
        from app.control import ControlBus

        self.sent: list[tuple[str, int]] = []
        self.broadcasts: list[tuple] = []
        self.backend = None
        ports = self

        class _Control:
            def add_consumer(self, queue, **kw):
                ports.broadcasts.append(("add_consumer", queue, kw.get("destination")))

            def cancel_consumer(self, queue, **kw):
                ports.broadcasts.append(("cancel_consumer", queue, kw.get("destination")))

            def broadcast(self, command, **kw):
                ports.broadcasts.append((command, kw.get("arguments")))

        self.bus = ControlBus(_Control())

    def send(self, args, kwargs, task_id, **options):
        self.sent.append((task_id, options.get("retries", 0)))

    def result(self, request_id):
        return request_id
