"""Redis tier: `vigil api`'s online side as an ASGI app on a real Redis, its submits recorded
instead of published (no worker): what the gateway decides before a request runs. API keys
(app/state/api_keys.py) name the job and cap the tier; another key's call reads nothing; a job
over its cap is a 429 with Retry-After, nothing submitted; a body over its bound is refused
from its Content-Length; a revoked key stops working within the key cache."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis
from starlette.testclient import TestClient

from app.ops.api import create_api
from app.ops.gateway import Gateway
from app.requests.models import get_registry
from app.requests.submit import submit_request
from app.settings import load_settings
from app.state.api_keys import KEY_CACHE_S, KeyReader
from app.state.conn import connect
from app.state.store import RequestStore
from tests.conftest import CACHE_DIR
from tests.unit_helpers import RecordingPorts

pytestmark = pytest.mark.redis
MODEL = "tiny-llama"
ADMIN = "admin-token"


class Ports(RecordingPorts):
    """Recording ports that keep each message's kwargs, with a result channel name."""

    def __init__(self):
        super().__init__()
        self.kwargs: dict[str, dict] = {}

        class _Backend:
            @staticmethod
            def get_key_for_task(rid):
                return f"celery-task-meta-{rid}".encode()

        self.backend = _Backend()

    def send(self, args, kwargs, task_id, **options):
        super().send(args, kwargs, task_id, **options)
        self.kwargs[task_id] = kwargs


@pytest.fixture()
def api(redis_db1_url):
    settings = load_settings(redis_url=redis_db1_url, cache_dir=CACHE_DIR,
                             api_token=ADMIN, max_pending_per_job=2,
                             api_max_body_bytes=64 * 1024)
    store = RequestStore(connect(settings), settings.result_ttl)
    ports = Ports()
    gw = Gateway(settings, store, get_registry(), ports, warm=False)
    gw.renderers.lane_now(MODEL)
    with TestClient(create_api(store.batches(), settings, gateway=gw)) as client:
        client.ports, client.store, client.settings, client.gateway = ports, store, settings, gw
        yield client


def post(client, token, **body):
    return client.post("/v1/completions", headers={"Authorization": f"Bearer {token}"},
                       json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True,
                             **body})


def test_a_key_names_the_job_caps_the_tier_and_reads_only_its_own_calls(api):
    """A key of job team-a capped at the default tier: asking for interactive is a 400 naming
    vigil_tier; its call runs under team-a whatever job header it sends, at its cap; another
    key cannot read that call (404), and a key cannot use Files and Batches (401)."""
    keys = api.store.api_keys()
    team = keys.create("team-a", "team-a", "default")
    other = keys.create("team-b", None, "bulk")
    r = post(api, team, vigil_tier="interactive")
    assert r.status_code == 400 and r.json()["error"]["param"] == "vigil_tier"
    calls = api.gateway.calls
    caller = api.portal.call(api.gateway.keys.grant, team)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}

    async def start():
        from app.online.serving import Caller

        who = Caller(caller["name"], caller["job"], caller["max_tier"])
        prepared = await calls.prepare("completions", body, {"x-vigil-job": "not-mine"}, who)
        await calls.start(prepared, who)
        return prepared

    prepared = api.portal.call(start)
    kwargs = api.ports.kwargs[prepared.request_ids[0]]
    assert (kwargs["job"], kwargs.get("priority", "default")) == ("team-a", "default")
    theirs = api.get(f"/v1/calls/{prepared.call_id}/stream",
                     headers={"Authorization": f"Bearer {other}"})
    assert theirs.status_code == 404
    assert api.get("/v1/files", headers={"Authorization": f"Bearer {team}"}).status_code == 401
    assert [k["name"] for k in keys.list()] == ["team-a", "team-b"]


def test_a_job_over_its_cap_is_a_429_with_retry_after_and_nothing_is_submitted(api):
    for i in range(2):  # the job's cap: 2 open requests
        submit_request({"model": MODEL, "prompt": f"p{i}", "job": "capped"}, settings=api.settings,
                       registry=get_registry(), store=api.store, ports=Ports())
    r = api.post("/v1/completions", headers={"Authorization": f"Bearer {ADMIN}",
                                             "X-Vigil-Job": "capped"},
                 json={"model": MODEL, "prompt": "x", "max_tokens": 4})
    assert r.status_code == 429 and r.headers["Retry-After"] == str(
        int(api.settings.retry_backoff_max))
    assert r.json()["error"]["code"] == "overloaded" and api.ports.kwargs == {}


def test_a_body_over_its_bound_is_refused_before_it_is_read(api):
    big = json.dumps({"model": MODEL, "prompt": "x" * (70 * 1024)})
    r = api.post("/v1/completions", headers={"Authorization": f"Bearer {ADMIN}",
                                             "Content-Type": "application/json"}, content=big)
    assert r.status_code == 400 and "VIGIL_API_MAX_BODY_BYTES" in r.json()["error"]["message"]
    assert api.ports.kwargs == {}


def test_a_revoked_key_is_refused_once_the_cache_lapses(redis_db1_url):
    asyncio.run(_revoked(redis_db1_url))


async def _revoked(redis_db1_url):
    settings = load_settings(redis_url=redis_db1_url, cache_dir=CACHE_DIR)
    keys = RequestStore(connect(settings), 60).api_keys()
    token = keys.create("gone-soon", None, "interactive")
    now = [100.0]
    reader = KeyReader(aioredis.Redis.from_url(redis_db1_url), clock=lambda: now[0])
    assert (await reader.grant(token))["name"] == "gone-soon"
    assert keys.revoke("gone-soon") == 1
    assert await reader.grant(token) is not None  # cached
    now[0] += KEY_CACHE_S + 0.1
    assert await reader.grant(token) is None
    assert await reader.grant("vk-not-a-key") is None


@pytest.mark.parametrize("warm", [False, True])
def test_a_vigil_api_gateway_freezes_its_heap_once_started(redis_db1_url, warm, heap_restored):
    """A `vigil api` process' gateway (`freeze_heap`, as `Gateway.from_settings` builds it)
    freezes the heap once its render modules are imported, before it serves, and, when it
    warms, again once its lanes are built (app/heap.py): Python's full collections then skip
    the ~645,000 objects of vLLM, transformers and torch it holds for good, each walk of which
    took ~0.3 s of CPU and stopped the event loop relaying every open stream. A gateway built
    without it (inside another program, these tests) leaves the heap alone."""
    import gc

    settings = load_settings(redis_url=redis_db1_url, cache_dir=CACHE_DIR, api_token=ADMIN)
    store = RequestStore(connect(settings), settings.result_ttl)
    plain = Gateway(settings, store, get_registry(), Ports(), warm=False)
    with TestClient(create_api(store.batches(), settings, gateway=plain)):
        assert gc.get_freeze_count() == 0
    gw = Gateway(settings, store, get_registry(), Ports(), warm=warm, freeze_heap=True)
    with TestClient(create_api(store.batches(), settings, gateway=gw)):
        started = gc.get_freeze_count()
        assert started > 0 and gc.get_threshold()[0] >= 20_000
        if warm:
            gw._warming.join(120)
            assert not gw._warming.is_alive(), "the lanes were not built within 120 s"
            assert gc.get_freeze_count() > started  # the lanes' objects frozen too
