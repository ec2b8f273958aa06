"""`vigil status`: the fleet as Redis sees it: workers (health state, streak, in flight, memory),
pools (waiting, oldest wait, running, who serves them, why not) and jobs.

    vigil status            # tables
    vigil status --json     # one JSON object, for scripts
    vigil status --watch 2  # refresh every 2 s until Ctrl-C

Read-only: it reads the registry entries, health ledgers and queue lengths; it never acts.
Credentials never appear: Redis is shown as host:port/db only.
"""
from __future__ import annotations

import json
import time

import redis

from app.redis_url import redacted_url
from app.state import keys
from app.state.health import HEALTHY, SUSPECT, HealthLedger
from app.fleet.jobs import list_jobs
from app.state.queues import pool_queues
from app.state.registry import WorkerRegistry
from app.requests.models import ModelRegistry
from app.fleet.reconcile import unserved_reason
from app.settings import VigilSettings

GiB = 1 << 30


def collect(client: redis.Redis, settings: VigilSettings, registry: ModelRegistry,
            now: float | None = None) -> dict:
    """A snapshot of workers and pools (plain data, JSON-ready)."""
    now = time.time() if now is None else now
    ledger = HealthLedger(client, window=settings.failure_window,
                          threshold=settings.failure_threshold)
    workers = []
    for e in WorkerRegistry(client).entries():
        h = ledger.read(e.instance)
        workers.append({
            "name": e.name or "?", "instance_id": e.instance, "state": h.state,
            "streak": h.streak, "last_failure": h.last_failure_reason,
            "quarantines": h.quarantines, "live": e.live(now, settings.live_window),
            "last_seen_s": round(now - e.last_seen, 1), "pools": e.pools,
            "model": e.model, "engine_state": e.engine_state, "in_flight": e.in_flight,
            "engine_restarts": e.engine_restarts, "device": e.device,
            "free_bytes": e.free_bytes, "total_bytes": e.total_bytes,
        })
    pools = []
    for name in registry.names():
        serving = [w for w in workers if w["live"] and name in w["pools"]]
        healthy = [w for w in serving if w["state"] in (HEALTHY, SUSPECT)]
        queues = pool_queues(client, name)
        pending = sum(client.llen(q) for q in queues)
        oldest = oldest_waiting_age(client, queues, now)
        running = sum(w["in_flight"] for w in serving if w["model"] == name)
        why = unserved_reason(client, name)
        if not serving:
            why = why or "no live worker serves it"
        elif not healthy:
            why = why or "every worker serving it is quarantined or restarting"
        pools.append({"pool": name, "pending": pending, "running": running,
                      "oldest_waiting_s": oldest,
                      "workers": [w["name"] for w in healthy], "why_unserved": why})
    return {"redis": redacted_url(settings.redis_url), "at": now, "workers": workers,
            "pools": pools, "jobs": list_jobs(client)}


def oldest_waiting_age(client: redis.Redis, queues: list[str], now: float) -> float | None:
    """Seconds the oldest message waiting in `queues` has waited since its request was
    submitted (kombu pushes on the left and pops on the right: the oldest is at index -1);
    None when nothing waits."""
    ages = []
    for q in queues:
        raw = client.lindex(q, -1)
        if raw is None:
            continue
        try:
            rid = json.loads(raw)["headers"]["id"]
            created = client.hget(keys.request(rid), "created_at")
        except (ValueError, KeyError, TypeError):
            continue
        if created:
            ages.append(now - float(created))
    return round(max(ages), 1) if ages else None


def render(snap: dict):
    """Rich tables for a snapshot."""
    from rich.console import Group
    from rich.table import Table

    wt = Table(title=f"workers  ({snap['redis']})", title_justify="left")
    for col in ("name", "instance", "state", "streak", "pools", "engine", "in flight",
                "last seen", "memory free/total", "last failure"):
        wt.add_column(col)
    colors = {"HEALTHY": "green", "SUSPECT": "yellow", "QUARANTINED": "red",
              "RESTARTING": "magenta"}
    for w in snap["workers"]:
        mem = ""
        if w["free_bytes"] is not None and w["total_bytes"]:
            mem = f"{w['free_bytes'] / GiB:.1f}/{w['total_bytes'] / GiB:.1f} GiB {w['device']}"
        seen = f"{w['last_seen_s']:.0f} s ago" + ("" if w["live"] else " (silent)")
        wt.add_row(w["name"], w["instance_id"],
                   f"[{colors.get(w['state'], 'white')}]{w['state']}[/]", str(w["streak"]),
                   ",".join(w["pools"]), f"{w['model'] or '-'} {w['engine_state']}",
                   str(w["in_flight"]), seen, mem, w["last_failure"][:60])
    pt = Table(title="pools", title_justify="left")
    for col in ("pool", "waiting", "oldest", "running", "served by", "why unserved"):
        pt.add_column(col)
    for p in snap["pools"]:
        oldest = "" if p["oldest_waiting_s"] is None else f"{p['oldest_waiting_s']:.0f} s"
        pt.add_row(p["pool"], str(p["pending"]), oldest, str(p["running"]),
                   ", ".join(p["workers"]),
                   f"[red]{p['why_unserved']}[/]" if p["why_unserved"] and p["pending"] else
                   p["why_unserved"])
    jt = Table(title="jobs", title_justify="left")
    for col in ("job", "open requests", "replicas", "last active"):
        jt.add_column(col)
    for j in snap.get("jobs", []):
        jt.add_row(j["name"], str(j["pending"]), str(j["replicas"]),
                   f"{snap['at'] - j['last_active']:.0f} s ago")
    return Group(wt, pt, jt)


def run_status(as_json: bool = False, watch: float | None = None) -> int:
    """Print the fleet once (or every `watch` seconds); 0 on success, 1 if Redis is unreachable."""
    from rich.console import Console
    from rich.live import Live

    from app.requests.models import get_registry
    from app.settings import get_settings
    from app.state.conn import connect

    s = get_settings()
    client = connect(s)
    reg = get_registry()
    console = Console()
    try:
        if as_json:
            print(json.dumps(collect(client, s, reg)))
            return 0
        if not watch:
            console.print(render(collect(client, s, reg)))
            return 0
        with Live(render(collect(client, s, reg)), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(watch)
                live.update(render(collect(client, s, reg)), refresh=True)
    except redis.RedisError as e:
        console.print(f"[red]cannot reach Redis at {redacted_url(s.redis_url)}: "
                      f"{type(e).__name__}[/]")
        return 1
    except KeyboardInterrupt:
        return 0
