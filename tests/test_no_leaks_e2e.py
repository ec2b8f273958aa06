"""Worker tier: no leaks (issue 4 part 8). After a run of 1,000 requests and the result TTL, Redis
holds nothing of them: only configuration and the registries of what is still alive.

Runs against a redis-server of its own, so the suite's shared database (other tests' keys) cannot
hide or fake a leak, with a real `vigil worker` (VIGIL_ENGINE=instant: the keys a request leaves
do not depend on the engine) and a real `celery beat` running every housekeeping task.
"""
from __future__ import annotations

import sys

import pytest

from app.local.embedded import start_process, start_worker, stop_process, vigil_env, wait_for
from app.state import keys
from app.state.queues import HOUSEKEEPING_QUEUE
from tests.redis_servers import LocalRedis

pytestmark = pytest.mark.worker
N = 1000
RESULT_TTL_S = 5  # below the production floor of 60 s: VIGIL_ALLOW_SHORT_RESULT_TTL (tests only)
ENV = dict(VIGIL_ENGINE="instant", VIGIL_RESULT_TTL=str(RESULT_TTL_S),
           VIGIL_ALLOW_SHORT_RESULT_TTL="1", VIGIL_HEARTBEAT_INTERVAL="1",
           VIGIL_WORKER_REAP_TIMEOUT="4", VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1",
           VIGIL_DEADLINE_SWEEP_INTERVAL="1", VIGIL_HEALTH_TICK_INTERVAL="1")
JOB = "leak-job"
# Every tenth request in a named job of its own, the rest in the default job: both kinds of
# per-job structure are exercised.
PRODUCER = f"""
from tasks.inference import generate
rs = [generate.delay(model="tiny-llama", prompt=f"p {{i}}", max_tokens=4,
                     job="{JOB}" if i % 10 == 0 else "default") for i in range({N})]
outs = [r.get(timeout=120) for r in rs]
assert len({{o["request_id"] for o in outs}}) == {N}
print("all", len(outs), "done")
"""

# What may stay for good. Configuration: kombu's exchange bindings (`_kombu.binding*`, Celery's
# declarations of its queues). Registries of live things, each entry removed when its thing
# ends: vigil:workers with each live worker's vigil:worker:{i} and vigil:health:{i}; vigil:jobs
# with each live job's vigil:job:{name} (the `default` job is always live) and the pools' job
# sets vigil:pooljobs:{pool} naming live jobs only; vigil:stats, a fixed set of counters;
# vigil:redis_run_id, the one key saying which Redis run the restart audit last covered; and
# vigil:housekeeping, one field per beat task (its last run).
CONFIG_PREFIXES = ("_kombu.binding",)


def registry_keys(r) -> set[str]:
    """The keys the registries of live workers and jobs account for right now."""
    out = {keys.STATS, keys.REDIS_RUN_ID, keys.HOUSEKEEPING_RUNS}
    workers = {i.decode() for i in r.zrange(keys.WORKERS, 0, -1)}
    if workers:
        out.add(keys.WORKERS)
    out |= {keys.worker(i) for i in workers} | {keys.health(i) for i in workers}
    jobs = {j.decode() for j in r.zrange(getattr(keys, "JOBS", "vigil:jobs"), 0, -1)}
    if jobs:
        out.add(getattr(keys, "JOBS", "vigil:jobs"))
        out |= {f"{keys.PREFIX}job:{j}" for j in jobs}
    for k in r.scan_iter(f"{keys.PREFIX}pooljobs:*"):
        if {j.decode() for j in r.smembers(k)} <= jobs:
            out.add(k.decode())
    return out


def leftovers(r) -> dict[str, int]:
    """Every key that is neither configuration nor a live registry entry -> its remaining TTL in
    ms (-1: none; -2: it expired between the scan and the read)."""
    allowed = registry_keys(r)
    return {k.decode(): r.pttl(k) for k in r.scan_iter(count=1000)
            if k.decode() not in allowed and not k.decode().startswith(CONFIG_PREFIXES)}


def test_after_a_thousand_requests_and_the_result_ttl_redis_holds_only_config_and_registries(
        tmp_path):
    """Given a worker and a beat on a Redis of their own, when 1,000 requests (a tenth of them
    in a named job) have all been served, then every key they left (records, Celery results)
    expires within the result TTL and nothing else is left: no queue, in-flight set, deadline
    entry, per-job request set or lock. After the TTL only configuration and the registries of
    the live worker and jobs remain; after the worker stops, its registry entries are gone too."""
    redis_server = LocalRedis().start()
    r = redis_server.client()
    worker = beat = None
    try:
        worker = start_worker(redis_server.url, "leaks@testhost", tmp_path / "worker.log",
                              concurrency=64, pools="tiny-llama", **ENV)
        beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                              "-s", str(tmp_path / "schedule")],
                             vigil_env(redis_server.url, **ENV), tmp_path / "beat.log")

        def ready():
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-4000:]
            return any(r.hget(k, "has_pinged") == b"1" for k in r.scan_iter("vigil:worker:*"))

        wait_for(ready, 120, 0.1, "the worker to be ready (has_pinged 1)")
        producer = start_process([sys.executable, "-c", PRODUCER],
                                 vigil_env(redis_server.url, **ENV), tmp_path / "producer.log")
        assert producer.wait(timeout=180) == 0, (tmp_path / "producer.log").read_text()[-4000:]

        # Right after the run: whatever is not config or registry must already be on its way out.
        # Records and Celery results only (those of the first requests may already be gone),
        # each with a TTL of at most the result TTL, and a beat task's lock (its lease as TTL)
        # if one is running right now.
        # Beat's queue too, while beat runs: a tick it sent a moment ago may not be taken yet
        # (it must be gone once beat has stopped, below).
        left = leftovers(r)
        kinds = ("vigil:req:", "celery-task-meta-", keys.lock(""), HOUSEKEEPING_QUEUE)
        assert all(k.startswith(kinds) for k in left), sorted(k for k in left
                                                              if not k.startswith(kinds))
        immortal = {k: t for k, t in left.items() if not k.startswith(HOUSEKEEPING_QUEUE)
                    and (t == -1 or t > RESULT_TTL_S * 1000 and not k.startswith(keys.lock("")))}
        assert not immortal, f"keys without a TTL (or a longer one) after the run: {immortal}"

        stop_process(beat)  # no new housekeeping messages or locks from here on
        wait_for(lambda: not leftovers(r), RESULT_TTL_S + 60, 0.2, "every key to expire")

        stop_process(worker)
        left_vigil = sorted(k.decode() for k in r.scan_iter(f"{keys.PREFIX}*"))
        assert not [k for k in left_vigil if k.startswith((keys.WORKERS, keys.PREFIX + "worker:",
                                                           keys.PREFIX + "health:"))], left_vigil
        assert set(left_vigil) <= registry_keys(r), left_vigil
        assert not leftovers(r)
    finally:
        stop_process(beat)
        stop_process(worker)
        redis_server.stop()
