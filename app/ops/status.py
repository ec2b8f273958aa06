"""`vigil status`: the fleet as Redis sees it (app/fleet/snapshot.py), as tables or JSON.

    vigil status            # tables
    vigil status --json     # one JSON object, for scripts
    vigil status --watch 2  # refresh every 2 s until Ctrl-C

Read-only; credentials never appear: Redis is shown as host:port/db only.
"""
from __future__ import annotations

import json
import time

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from app.fleet.snapshot import collect
from app.redis_url import redacted_url
from app.requests.models import get_registry
from app.settings import get_settings
from app.state.conn import connect

GiB = 1 << 30


def render(snap: dict):
    """Rich tables for a snapshot."""
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
