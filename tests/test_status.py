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
from app.state.registry import WorkerRegistry
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
        Heartbeat(WorkerRegistry(client), inst, name, 10,
                  lambda: {"pools": "tiny-llama", "in_flight": 0, "model": "tiny-llama"}).beat()
    ledger = HealthLedger(client, window=3600, threshold=3)
    for i in range(3):
        ledger.failure(2, 1000.0 + i, "stall: no progress")
    from app.requests.schemas import GenerateRequest
    from app.requests.record_fields import record_fields
    from app.state.store import RequestStore

    store = RequestStore(client, 3600)
    store.create("old-one", record_fields(GenerateRequest(model="tiny-llama", prompt="p",
                                                          job="eval-3"), 1000.0, 3600), 1000.0)
    client.lpush("vigil.pool.tiny-llama.job.eval-3", json.dumps({"headers": {"id": "old-one"}}))
    client.lpush("vigil.pool.tiny-llama", "m1")
    client.rpush("vigil.pool.unserved-model", "m3")
    snap = collect(store, s, reg, now=1100.0)
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


def _snapshot() -> dict:
    """A snapshot as collect() returns it: long host names, a long failure, three pools."""
    failure = ("stall: the engine made no progress for 120 s while 37 requests waited on it; "
               "aborted them and restarted the engine core process")
    workers = [{"name": f"gpu{i}@inference-node-{i:02d}.cluster.example.internal",
                "instance_id": f"24856{i}931", "state": state, "streak": streak,
                "last_failure": failure if streak else "", "quarantines": 0, "live": True,
                "last_seen_s": 3.2, "pools": ["tiny-llama", "roomy-llama"],
                "model": "tiny-llama", "engine_state": "ready", "in_flight": 12,
                "engine_restarts": 0, "device": "cuda:0", "free_bytes": 30 << 30,
                "total_bytes": 80 << 30}
               for i, (state, streak) in enumerate((("HEALTHY", 0), ("SUSPECT", 1),
                                                    ("QUARANTINED", 3), ("RESTARTING", 0)))]
    pools = [{"pool": "tiny-llama", "pending": 40, "running": 36, "oldest_waiting_s": 12.0,
              "workers": [w["name"] for w in workers[:2]], "why_unserved": ""},
             {"pool": "unserved-model", "pending": 3, "running": 0, "oldest_waiting_s": 300.0,
              "workers": [], "why_unserved": "no live worker serves it"}]
    return {"redis": "127.0.0.1:6379/0", "at": 2000.0, "workers": workers, "pools": pools,
            "jobs": [{"name": "eval-7", "pending": 40, "replicas": 1, "last_active": 1990.0}]}


def _rendered(wide: bool, width: int) -> list[str]:
    import io

    from rich.console import Console

    from app.ops.status import render

    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(render(_snapshot(), wide))
    return console.file.getvalue().splitlines()


def test_status_fits_80_columns_with_every_state_whole_and_one_line_per_worker():
    """Given four workers with 50-character names, two pools and a long last failure, when
    status renders in an 80-column terminal, then no line is wider than 80, every state is
    written whole, each worker takes one line (no column wraps down the screen), and the last
    failure is left to --wide / --json."""
    lines = _rendered(False, 80)
    assert max(len(x) for x in lines) <= 80
    text = "\n".join(lines)
    for state in ("HEALTHY", "SUSPECT", "QUARANTINED", "RESTARTING"):
        assert sum(state in x for x in lines) == 1, text
    worker_lines = [x for x in lines if "@inference-node" in x or "gpu" in x]
    assert len(worker_lines) == 4, text
    for header in ("name", "state", "streak", "in flight", "last seen", "pools"):
        assert header in text
    assert "stall" not in text and "instance" not in text
    assert "no live worker serves it" in text


def test_status_wide_adds_instance_engine_memory_and_a_shortened_last_failure():
    lines = _rendered(True, 260)
    text = "\n".join(lines)
    for header in ("instance", "engine", "memory free/total", "last failure", "served by"):
        assert header in text
    assert "stall: the engine made no progress for 120 s" in text and "…" in text
    assert "restarted the engine core process" not in text  # the full text is in --json
    assert "248562931" in text and "30.0/80.0 GiB cuda:0" in text
