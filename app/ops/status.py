"""`vigil status`: the fleet as Redis sees it (app/fleet/snapshot.py), as tables or JSON.

    vigil status            # tables that fit an 80-column terminal
    vigil status --wide     # every column (instance, engine, memory, last failure)
    vigil status --json     # one JSON object, for scripts (last failures in full)
    vigil status --watch 2  # refresh every 2 s until Ctrl-C

Read-only; credentials never appear: Redis is shown as host:port/db only.
"""
from __future__ import annotations

import json
import time

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from app.fleet.snapshot import collect
from app.redis_url import redacted_url
from app.requests.models import get_registry
from app.settings import get_settings
from app.state.calls import REDIS_ERRORS
from app.state.store import open_store

GiB = 1 << 30


# A last failure as `vigil status --wide` shows it; the full text is in `--json` and in
# `vigil request ID`.
FAILURE_CHARS = 48
STATE_COLORS = {"HEALTHY": "green", "SUSPECT": "yellow", "QUARANTINED": "red",
                "RESTARTING": "magenta"}


def shorten(text: str, n: int) -> str:
    """`text` on one line, at most `n` characters (an ellipsis marks a cut)."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


def _table(title: str) -> Table:
    # A rule under the header and two spaces between columns: no borders to spend width on.
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                 padding=(0, 1, 0, 0))


def render(snap: dict, wide: bool = False):
    """Rich tables for a snapshot. By default the columns an operator looks for, fitting 80
    columns: the state is never cut (long names and pool lists are, with an ellipsis); `wide`
    adds instance, engine, memory and the last failure (shortened: full text in --json)."""
    wt = _table(f"workers  ({snap['redis']})")
    wt.add_column("name", overflow="ellipsis", no_wrap=True, max_width=None if wide else 24)
    if wide:
        wt.add_column("instance", no_wrap=True)
    wt.add_column("state", no_wrap=True, min_width=11)  # QUARANTINED, whole
    wt.add_column("streak", no_wrap=True, justify="right", min_width=6)
    wt.add_column("in flight", no_wrap=True, justify="right", min_width=9)
    wt.add_column("last seen", no_wrap=True, min_width=9)
    wt.add_column("pools", overflow="ellipsis", no_wrap=True)
    if wide:
        for col in ("engine", "memory free/total", "last failure"):
            wt.add_column(col, no_wrap=True)
    for w in snap["workers"]:
        seen = f"{w['last_seen_s']:.0f} s" + ("" if w["live"] else " silent")
        state = f"[{STATE_COLORS.get(w['state'], 'white')}]{w['state']}[/]"
        row = [w["name"], *([w["instance_id"]] if wide else []), state, str(w["streak"]),
               str(w["in_flight"]), seen, ",".join(w["pools"])]
        if wide:
            mem = ""
            if w["free_bytes"] is not None and w["total_bytes"]:
                mem = (f"{w['free_bytes'] / GiB:.1f}/{w['total_bytes'] / GiB:.1f} GiB "
                       f"{w['device']}")
            row += [f"{w['model'] or '-'} {w['engine_state']}", mem,
                    shorten(w["last_failure"], FAILURE_CHARS)]
        wt.add_row(*row)
    pt = _table("pools")
    pt.add_column("pool", overflow="ellipsis", no_wrap=True)
    for col in ("waiting", "oldest", "running"):
        pt.add_column(col, no_wrap=True, justify="right")
    if wide:
        pt.add_column("served by")
    pt.add_column("why unserved")
    for p in snap["pools"]:
        oldest = "" if p["oldest_waiting_s"] is None else f"{p['oldest_waiting_s']:.0f} s"
        why = (f"[red]{p['why_unserved']}[/]" if p["why_unserved"] and p["pending"] else
               p["why_unserved"])
        pt.add_row(p["pool"], str(p["pending"]), oldest, str(p["running"]),
                   *([", ".join(p["workers"])] if wide else []), why)
    jt = _table("jobs")
    jt.add_column("job", overflow="ellipsis", no_wrap=True)
    for col in ("open requests", "replicas", "last active"):
        jt.add_column(col, no_wrap=True)
    for j in snap.get("jobs", []):
        jt.add_row(j["name"], str(j["pending"]), str(j["replicas"]),
                   f"{snap['at'] - j['last_active']:.0f} s ago")
    ht = _table("housekeeping")
    ht.add_column("task", no_wrap=True)
    for col in ("every", "last run", "state"):
        ht.add_column(col, no_wrap=True, justify="right")
    warnings = []
    for h in snap.get("housekeeping", []):
        last = "never" if h["age_s"] is None else f"{h['age_s']:.0f} s ago"
        state = h["state"] if h["state"] == "ok" else f"[red]{h['state']}[/]"
        if h["error"]:
            state += " [yellow](failed)[/]"
        ht.add_row(h["task"].removeprefix("vigil."), f"{h['every_s']:g} s", last, state)
        if h["warning"]:
            warnings.append(f"[red]! {h['warning']}[/]")
    return Group(wt, pt, jt, ht, *warnings)


def run_status(as_json: bool = False, watch: float | None = None, wide: bool = False) -> int:
    """Print the fleet once (or every `watch` seconds; `wide`: every column); 0 on success, 1 if
    Redis is unreachable."""
    s = get_settings()
    store = open_store(s)
    reg = get_registry()
    console = Console()
    try:
        if as_json:
            print(json.dumps(collect(store, s, reg)))
            return 0
        if not watch:
            console.print(render(collect(store, s, reg), wide))
            return 0
        with Live(render(collect(store, s, reg), wide), console=console,
                  auto_refresh=False) as live:
            while True:
                time.sleep(watch)
                live.update(render(collect(store, s, reg), wide), refresh=True)
    except REDIS_ERRORS as e:
        console.print(f"[red]cannot reach Redis at {redacted_url(s.redis_url)}: "
                      f"{type(e).__name__}[/]")
        return 1
    except KeyboardInterrupt:
        return 0
