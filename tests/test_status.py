"""Redis tier: `vigil status` reads workers, health ledgers and queues, and shows why a pool with
waiting work is unserved; no credentials in its output."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from app.fleet.snapshot import collect
from app.local.embedded import vigil_env
from app.redis_url import redacted_url
from app.requests.models import get_registry
from app.settings import load_settings
from app.state.health import HealthLedger
from workers.heartbeat import Heartbeat

pytestmark = pytest.mark.redis


def test_status_shows_health_states_and_why_a_pool_is_unserved(redis_db1_url):
    """Given a healthy worker on tiny-llama and a quarantined one on it too, and waiting work for
    tiny-llama and for a pool nobody serves, then status shows each worker's state and streak,
    and the unserved pool says why."""
    client = redis.Redis.from_url(redis_db1_url)
    s = load_settings(redis_url=redis_db1_url)
    reg = get_registry()
    for inst, name in ((1, "ok@h"), (2, "sick@h")):
        Heartbeat(client, inst, name, 10, lambda: {"pools": "tiny-llama", "in_flight": 0,
                                                   "model": "tiny-llama"}).beat()
    ledger = HealthLedger(client, window=3600, threshold=3)
    for i in range(3):
        ledger.failure(2, 1000.0 + i, "stall: no progress")
    from app.requests.schemas import GenerateRequest
    from app.requests.submit import record_fields
    from app.state.store import RequestStore

    store = RequestStore(client, 3600)
    store.create("old-one", record_fields(GenerateRequest(model="tiny-llama", prompt="p",
                                                          job="eval-3"), 1000.0, 3600), 1000.0)
    client.lpush("vigil.pool.tiny-llama.job.eval-3", json.dumps({"headers": {"id": "old-one"}}))
    client.lpush("vigil.pool.tiny-llama", "m1")
    client.rpush("vigil.pool.unserved-model", "m3")
    snap = collect(client, s, reg, now=1100.0)
    by_name = {w["name"]: w for w in snap["workers"]}
    assert by_name["ok@h"]["state"] == "HEALTHY"
    assert by_name["sick@h"]["state"] == "QUARANTINED" and by_name["sick@h"]["streak"] == 3
    assert by_name["sick@h"]["last_failure"] == "stall: no progress"
    pools = {p["pool"]: p for p in snap["pools"]}
    assert pools["tiny-llama"]["pending"] == 2 and pools["tiny-llama"]["workers"] == ["ok@h"]
    assert pools["tiny-llama"]["oldest_waiting_s"] == 100.0
    assert [(j["name"], j["pending"]) for j in snap["jobs"]] == [("eval-3", 1)]
    assert pools["unserved-model"]["why_unserved"] == "no live worker serves it"


def test_status_json_from_the_command_line_hides_credentials(redis_db1_url):
    url = redis_db1_url.replace("redis://", "redis://vigil:s3cret@")
    assert redacted_url(url) == redis_db1_url
    out = subprocess.run([sys.executable, "-m", "app.ops.cli", "status", "--json"],
                         env=vigil_env(redis_db1_url), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["redis"] == redis_db1_url
    assert "s3cret" not in out.stdout + out.stderr
