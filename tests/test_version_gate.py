"""Redis tier: version safety during a rolling upgrade (docs/api.md, "Version safety").

Workers from before schema version 2 fail any message of another version (`unsupported_version`,
terminal) and cannot be changed now; workers since say in their registry entry which versions
they read and hand a newer message back. So the producer stamps a request with the lowest
version that holds it, and publishes a version 2 request only where no live worker of its pool
would fail it (app/requests/version_gate.py). And a version 3 message sent to a queue no pool
owns is forwarded by housekeeping as it is, for a worker that reads it, never failed."""
from __future__ import annotations

import json
import time

import pytest

from app.errors import TransientError
from app.requests.models import get_registry
from app.requests.admit import admit
from app.requests.submit import submit_many, submit_request
from app.requests.version_gate import (ADVERTISED, VERDICT_CACHE_S, check_served, pool_reads,
                                       unadvertised_workers)
from app.state.conn import connect
from app.state.queues import job_queue_name, pool_queue
from app.state.store import RequestStore
from tests.unit_helpers import RecordingPorts
from workers.forwarding import forward

pytestmark = pytest.mark.redis
POOL = "tiny-llama"
V1 = {"model": POOL, "prompt": "plain"}
V2 = {"model": POOL, "prompt": "scored", "logprobs": 2}


class CapturingPorts(RecordingPorts):
    """RecordingPorts that also keep each message's kwargs and options."""

    def __init__(self):
        super().__init__()
        self.messages: list[tuple[str, dict, dict]] = []

    def send(self, args, kwargs, task_id, **options):
        super().send(args, kwargs, task_id, **options)
        self.messages.append((task_id, kwargs, options))


@pytest.fixture()
def store(settings):
    """A fresh store (and so a fresh registry: the gate's cached verdicts are per registry)."""
    return RequestStore(connect(settings), settings.result_ttl)


def register(store, instance: int, name: str, *, pools: str = POOL, versions: str | None = None,
             seen: float | None = None) -> None:
    """A worker's registry entry as its heartbeat writes it; `versions` None: one from before
    workers advertised the versions they read (it writes no such field)."""
    entry = {"name": name, "instance_id": instance, "pools": pools, "has_pinged": 1}
    if versions is not None:
        entry["schema_versions"] = versions
    store.workers.write(instance, entry, time.time() if seen is None else seen)


def submit(store, settings, kwargs, ports=None, task_id=None):
    return submit_request(kwargs, task_id, settings=settings, registry=get_registry(),
                          store=store, ports=ports or RecordingPorts())


def test_a_worker_of_this_code_advertises_the_versions_it_reads(store):
    """What workers/runtime.py writes in every heartbeat is read back as the versions (1, 2,
    3)."""
    assert ADVERTISED == "1,2,3"
    register(store, 7, "new@h", versions=ADVERTISED)
    (entry,) = store.workers.entries()
    assert entry.schema_versions == [1, 2, 3]


def test_a_pool_reads_a_version_only_when_every_live_worker_of_it_advertises_it(store,
                                                                               settings):
    """Given tiny-llama served by a worker reading 1-3 and one reading 1-2, the pool does not
    read version 3 (the online API then leaves `live` out: a version 2 worker would hand such a
    request back), while it reads version 2; with the older worker gone (another pool's
    registry read, after the cache), it reads 3. A pool with no live worker reads nothing."""
    assert not pool_reads(store.workers, "tiny-llama", 3, settings.live_window, now=1000.0)
    register(store, 1, "new@h", versions=ADVERTISED)
    register(store, 2, "v2@h", versions="1,2")
    now = time.time()
    assert not pool_reads(store.workers, "tiny-llama", 3, settings.live_window, now=now)
    assert pool_reads(store.workers, "tiny-llama", 2, settings.live_window, now=now)
    store.workers.drop(2)
    assert not pool_reads(store.workers, "tiny-llama", 3, settings.live_window, now=now)  # cached
    assert pool_reads(store.workers, "tiny-llama", 3, settings.live_window,
                      now=now + VERDICT_CACHE_S + 0.1)


def test_a_version_2_request_is_refused_at_submit_while_an_old_worker_serves_its_pool(
        store, settings):
    """Given a live worker of tiny-llama from before version 2 (its entry advertises no
    versions) beside an upgraded one, when a request using a version 2 field is submitted, then
    it is refused at once, TransientError(workers_too_old) naming the old worker and the field,
    with no record and no message: no old worker can fail it. A version 1 request is published
    as before (both workers read it)."""
    register(store, 1, "old@h")
    register(store, 2, "new@h", versions=ADVERTISED)
    ports = CapturingPorts()
    with pytest.raises(TransientError, match=r"^workers_too_old: pool 'tiny-llama' has 1 live "
                                             r"worker\(s\) from before schema version 2 "
                                             r"\(old@h\).*it uses logprobs") as ei:
        submit(store, settings, V2, ports, task_id="v2-refused")
    assert ei.value.code == "workers_too_old"
    assert store.get("v2-refused") is None and ports.messages == []
    submit(store, settings, V1, ports, task_id="v1-sent")
    (rid, kwargs, options), = ports.messages
    assert (rid, kwargs["schema_version"], store.get(rid)["status"]) == ("v1-sent", 1, "PENDING")


def test_many_requests_at_once_are_refused_whole_while_an_old_worker_serves_their_pool(
        store, settings):
    """generate_many with one version 2 request among version 1 ones, an old worker live: the
    call is refused before anything is written (all or nothing, as any refusal)."""
    register(store, 1, "old@h")
    with pytest.raises(TransientError, match="^workers_too_old: "):
        submit_many([V1, V2, V1], ["m0", "m1", "m2"], settings=settings,
                    registry=get_registry(), store=store, ports=RecordingPorts())
    assert [store.get(rid) for rid in ("m0", "m1", "m2")] == [None, None, None]


@pytest.mark.parametrize("old", ["upgraded", "silent", "other-pool"])
def test_a_version_2_request_is_published_where_no_live_worker_of_its_pool_is_old(
        store, settings, old):
    """The gate refuses for live workers of the request's pool only: an upgraded worker, an
    old worker silent past the live window (dead, or gone), or an old worker of another pool
    lets the version 2 request through, stamped version 2."""
    if old == "upgraded":
        register(store, 1, "w@h", versions="1,2")
    elif old == "silent":
        register(store, 1, "w@h", seen=time.time() - settings.live_window - 5)
    else:
        register(store, 1, "w@h", pools="unserved-model")
    ports = CapturingPorts()
    submit(store, settings, V2, ports, task_id=f"v2-{old}")
    (rid, kwargs, options), = ports.messages
    assert kwargs["schema_version"] == 2 and options["queue"].name == pool_queue(POOL)


def test_the_gate_reads_the_registry_at_most_every_few_seconds_per_pool(store, settings):
    """A producer reads a pool's workers once per VERDICT_CACHE_S: an old worker that registers
    within it is seen at the next read (a submit of version 2 requests costs no registry read in
    between); an old worker that upgrades is let through as late."""
    now = time.time()
    window = settings.live_window
    assert unadvertised_workers(store.workers, POOL, window, now) == []
    register(store, 1, "old@h", seen=now)
    assert unadvertised_workers(store.workers, POOL, window, now + 1) == []  # cached
    assert unadvertised_workers(store.workers, POOL, window,
                                now + VERDICT_CACHE_S) == ["old@h"]
    req_v1, _, _ = admit(V1, settings, get_registry())
    check_served(req_v1, POOL, store.workers, settings)  # version 1: never gated


def test_housekeeping_forwards_a_message_of_a_newer_version_as_it_is(store, settings):
    """Given a vigil.generate message of schema_version 4 (a newer producer without queue=)
    that reached vigil.housekeeping, when housekeeping forwards it, then it is not failed: it
    is recorded from the fields every version keeps (PENDING, its job and deadline), and
    published to its pool's queue for its job under the same id and dispatch, its kwargs
    exactly as sent, for a worker that reads version 4."""
    newer = {"model": POOL, "prompt": "from the future", "schema_version": 4, "job": "rollout",
             "deadline_s": 60, "speculative_mode": {"depth": 4}}
    ports = CapturingPorts()
    forward(store, get_registry(), settings, ports, "fwd-v4", 0, newer)
    rec = store.get("fwd-v4")
    assert (rec["status"], rec["job"], rec["pool"]) == ("PENDING", "rollout", POOL)
    assert json.loads(rec["request"]) == newer
    assert float(rec["deadline_at"]) - float(rec["created_at"]) == pytest.approx(60)
    (rid, kwargs, options), = ports.messages
    assert (rid, kwargs) == ("fwd-v4", newer) and "retries" not in options
    assert options["queue"].name == job_queue_name(POOL, "rollout")
    # Again (a duplicate delivery of the same message): published again, never failed.
    forward(store, get_registry(), settings, ports, "fwd-v4", 0, newer)
    assert store.get("fwd-v4")["status"] == "PENDING" and len(ports.messages) == 2
