"""`vigil request ID`: one request's record and, while it waits, why.

    vigil request 3f2c...            # status, attempts, deadline, result summary or error
    vigil request 3f2c... --json     # one JSON object, for scripts
    vigil request 3f2c... --show-text   # the generated text and token ids too (user data)

A waiting request (record `PENDING` or `RUNNING`) is explained from the pool's state
(`app.ops.status.collect`), the worker in-flight sets and the pool's queue: e.g. "pool tiny-llama: no
live worker serves it", "position ~12 of 40 in queue vigil.pool.tiny-llama", "running on worker
gpu0@h since 12:00:01 (attempt 2 of 3)". The same explanation is `why_waiting(request_id)` in
Python, and `AsyncResult.info` of a request that is not finished (`VigilAsyncResult`,
app/requests/async_result.py).

Where a message sits in the queue: kombu's Redis transport LPUSHes each message (a JSON object
whose `headers.id` is the task id, here the request id) onto the list named after the queue and
workers BRPOP it, so the next message delivered is the rightmost element. LPOS cannot find it: it
matches whole elements, and a message's bytes (delivery tag, body) are not known to a reader. The
list is read from the right with LRANGE, `SCAN_CHUNK` elements at a time, at most `SCAN_LIMIT`
(bounded: a request deeper than that is reported as "not among the first 10000"). The list moves
while it is read (deliveries on the right, submits on the left), so the position is approximate.
Messages published with a Celery priority live in other lists (`<queue>\\x06\\x16<n>`); Vigil
publishes none. Read-only: nothing here changes Redis.
"""
from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import redis

from app.state import keys
from app.errors import TransientError, error_from_record
from app.state.health import QUARANTINED, RESTARTING
from app.requests.models import ModelRegistry
from app.settings import VigilSettings
from app.state.queues import DEFAULT_JOB, job_queue_name
from app.state.store import RequestStore

# The most queue entries a position lookup reads, and how many per LRANGE.
SCAN_LIMIT = 10_000
SCAN_CHUNK = 1_000


def queue_position(client: redis.Redis, queue: str, request_id: str, *, limit: int = SCAN_LIMIT,
                   chunk: int = SCAN_CHUNK) -> tuple[int | None, int]:
    """(position, length) of `request_id`'s message in a kombu Redis queue: position 1 is the next
    message a worker receives; None when it is not among the first `limit` entries (or not there
    at all). Approximate: the list moves while it is read."""
    length = int(client.llen(queue))
    needle = request_id.encode()
    scanned = 0
    while scanned < min(length, limit):
        n = min(chunk, limit - scanned)
        items = client.lrange(queue, -(scanned + n), -(scanned + 1))  # left to right
        for i, raw in enumerate(reversed(items)):  # head (rightmost) first
            if needle in raw and message_id(raw) == request_id:
                return scanned + i + 1, length
        if len(items) < n:
            break
        scanned += n
    return None, length


def message_id(raw: bytes) -> str | None:
    """The task id (here the request id) of one kombu message as stored in a queue list, or None
    when the entry is not a kombu message."""
    try:
        return json.loads(raw)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None


def _when(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    stamp = dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")
    ago = now - t
    return f"{stamp} ({ago:.0f} s ago)" if ago >= 0 else f"{stamp} (in {-ago:.0f} s)"


def _num(rec: dict, name: str) -> float | None:
    v = rec.get(name)
    return float(v) if v not in (None, "") else None


def _code(message: str) -> str:
    return error_from_record("", message).code if message else ""


def why_waiting(request_id: str, *, client: redis.Redis | None = None,
                settings: VigilSettings | None = None, registry: ModelRegistry | None = None,
                now: float | None = None) -> dict[str, Any] | None:
    """Why a request has no outcome yet, as plain JSON-ready data; None when it has ended or has
    no record (never submitted, or expired after VIGIL_RESULT_TTL).

    {"request_id", "status" (PENDING | RUNNING, Vigil's record), "summary" (the reasons joined
    with "; "), "reasons" (list of str), "pool", "queue", "queue_length", "position" (1 = next
    delivered; None when not found within SCAN_LIMIT or running), "held_by" (worker names whose
    in-flight set holds it), "worker" and "running_since" (RUNNING only), "attempts",
    "max_attempts", "last_error", "deadline_at", "pool_workers" (healthy live workers serving
    the pool), "why_unserved"}. Defaults: this process's settings, registry and Redis client.
    Costs a few Redis round trips per worker and pool plus a bounded queue scan: fine for a
    person or a poll every few seconds, not for a tight loop over thousands of requests.
    """
    from app.requests.models import get_registry
    from app.settings import get_settings
    from app.state.conn import connect
    from app.state.store import shared_store

    if client is None:
        client = shared_store().r if settings is None else connect(settings)
    settings = settings or get_settings()
    registry = registry or get_registry()
    store = RequestStore(client, settings.result_ttl)
    rec = store.get(request_id)
    if rec is None or rec.get("status") in keys.TERMINAL:
        return None
    return _waiting(request_id, rec, client, settings, registry,
                    time.time() if now is None else now)


def _waiting(request_id: str, rec: dict, client: redis.Redis, settings: VigilSettings,
             registry: ModelRegistry, now: float) -> dict[str, Any]:
    from app.ops.status import collect

    snap = collect(client, settings, registry, now)
    pool = rec.get("pool") or rec.get("model", "")
    queue = job_queue_name(pool, rec.get("job") or DEFAULT_JOB)
    status = rec.get("status", keys.PENDING)
    attempts = int(rec.get("attempts") or 0)
    max_attempts = settings.max_attempts
    last_error = rec.get("last_error", "")
    pool_state = next((p for p in snap["pools"] if p["pool"] == pool), None)
    by_instance = {w["instance_id"]: w for w in snap["workers"]}
    reasons: list[str] = []
    out: dict[str, Any] = {
        "request_id": request_id, "status": status, "pool": pool, "queue": queue,
        "queue_length": None, "position": None, "held_by": [], "worker": None,
        "running_since": None, "attempts": attempts, "max_attempts": max_attempts,
        "last_error": last_error, "deadline_at": _num(rec, "deadline_at"),
        "pool_workers": pool_state["workers"] if pool_state else [],
        "why_unserved": pool_state["why_unserved"] if pool_state else "not registered here",
    }
    if status == keys.RUNNING:
        w = by_instance.get(rec.get("instance", ""))
        since = _num(rec, "started_at")
        name = rec.get("worker") or (w["name"] if w else "?")
        line = (f"running on worker {name} since {_when(since, now)} "
                f"(attempt {attempts} of {max_attempts})")
        if w is None:
            line += "; that worker is no longer registered (stopped or reaped)"
        elif not w["live"]:
            line += (f"; that worker is silent for {w['last_seen_s']:.0f} s: the reaper "
                     "requeues its requests")
        elif w["state"] in (QUARANTINED, RESTARTING):
            line += f"; that worker is {w['state']}: it hands its requests back"
        elif w["engine_state"] not in ("", "ready"):
            line += f"; its engine is {w['engine_state']}"
        reasons.append(line)
        out.update(worker=name, running_since=since)
    else:
        if pool_state is None:
            reasons.append(f"pool {pool}: not in this process's model registry "
                           "(VIGIL_MODELS_FILE differs?)")
        elif pool_state["why_unserved"]:
            reasons.append(f"pool {pool}: {pool_state['why_unserved']}")
        holders = _holders(client, request_id, snap["workers"])
        out["held_by"] = [w["name"] for w in holders]
        if last_error:
            reasons.append(f"waiting for attempt {attempts + 1} of {max_attempts}; the last one "
                           f"ended {_code(last_error)}")
        for w in holders:
            if not w["live"]:
                reasons.append(f"its message is with worker {w['name']}, silent for "
                               f"{w['last_seen_s']:.0f} s: the reaper requeues it")
            elif w["state"] in (QUARANTINED, RESTARTING):
                reasons.append(f"its message is with worker {w['name']}, which is "
                               f"{w['state']}: it hands it back")
            else:
                reasons.append(f"its message is with worker {w['name']} (received, not begun: "
                               "a retry's countdown, or waiting for a free task thread)")
        position, length = queue_position(client, queue, request_id)
        out.update(queue_length=length, position=position)
        if position is not None:
            reasons.append(f"position ~{position} of {length} in queue {queue}")
        elif not holders:
            if length > SCAN_LIMIT:
                reasons.append(f"not among the first {SCAN_LIMIT} of {length} messages in "
                               f"queue {queue}")
            else:
                reasons.append(f"not in queue {queue} and held by no worker: in transit, or "
                               "with a consumer that stopped before recording it (back after "
                               "the visibility timeout, or ended at its deadline)")
    deadline = out["deadline_at"]
    if deadline is not None and now > deadline:
        reasons.append(f"past its deadline by {now - deadline:.0f} s: the deadline sweep fails "
                       "it (deadline_exceeded)")
    out["reasons"] = reasons
    out["summary"] = "; ".join(reasons)
    return out


def _holders(client: redis.Redis, request_id: str, workers: list[dict]) -> list[dict]:
    """The registered workers whose in-flight set holds the request (one pipelined round trip)."""
    if not workers:
        return []
    pipe = client.pipeline(transaction=False)
    for w in workers:
        pipe.sismember(keys.inflight(w["instance_id"]), request_id)
    return [w for w, held in zip(workers, pipe.execute()) if held]


def describe(request_id: str, *, client: redis.Redis, settings: VigilSettings,
             registry: ModelRegistry, now: float | None = None,
             show_text: bool = False) -> dict[str, Any] | None:
    """One request as plain JSON-ready data, or None without a record: its fields (never the
    prompt), `history` (RequestStore.history), a result summary (`text` and `token_ids` only with
    `show_text`), the error ({kind, code, message}) and, while it has no outcome, `waiting`
    (why_waiting's dict)."""
    now = time.time() if now is None else now
    store = RequestStore(client, settings.result_ttl)
    rec = store.get(request_id)
    if rec is None:
        return None
    status = rec.get("status", "")
    out: dict[str, Any] = {
        "request_id": request_id, "status": status, "model": rec.get("model", ""),
        "pool": rec.get("pool", ""), "job": rec.get("job", ""), "lora": rec.get("lora") or None,
        "created_at": _num(rec, "created_at"), "deadline_at": _num(rec, "deadline_at"),
        "finished_at": _num(rec, "finished_at"), "attempts": int(rec.get("attempts") or 0),
        "max_attempts": settings.max_attempts, "dispatch": int(rec.get("dispatch") or 0),
        "worker": rec.get("worker") or None, "instance": rec.get("instance") or None,
        "started_at": _num(rec, "started_at"), "last_error": rec.get("last_error", ""),
        "history": store.history(request_id), "result": None, "error": None, "waiting": None,
    }
    if status == keys.SUCCEEDED and rec.get("result"):
        res = json.loads(rec["result"])
        summary = {k: res.get(k) for k in ("finish_reason", "prompt_tokens", "completion_tokens",
                                           "attempts", "worker")}
        summary["text_chars"] = len(res.get("text") or "")
        if res.get("lora") is not None:
            summary["lora"] = res["lora"]
        if show_text:
            summary["text"] = res.get("text", "")
            summary["token_ids"] = res.get("token_ids", [])
        out["result"] = summary
    elif status == keys.FAILED:
        message = rec.get("error", "")
        out["error"] = {"kind": rec.get("error_kind", ""), "code": _code(message),
                        "message": message}
    else:
        out["waiting"] = _waiting(request_id, rec, client, settings, registry, now)
    return out


def render(view: dict[str, Any], now: float | None = None):
    """Rich renderables for `describe`'s dict."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    colors = {"SUCCEEDED": "green", "FAILED": "red", "RUNNING": "cyan", "PENDING": "yellow"}
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("request", view["request_id"])
    head.add_row("status", f"[{colors.get(view['status'], 'white')}]{view['status']}[/]")
    head.add_row("model / pool", f"{view['model']} / {view['pool']}")
    head.add_row("job", view["job"] or "-")
    if view["lora"]:
        head.add_row("lora", view["lora"])
    head.add_row("attempts", f"{view['attempts']} of {view['max_attempts']} "
                 f"(dispatch {view['dispatch']})")
    head.add_row("created", _when(view["created_at"], now))
    head.add_row("deadline", _when(view["deadline_at"], now))
    if view["finished_at"] is not None:
        head.add_row("finished", _when(view["finished_at"], now))
    if view["last_error"] and view["status"] != "FAILED":
        head.add_row("last error", Text(view["last_error"]))
    if view["result"] is not None:
        r = view["result"]
        head.add_row("result", f"{r['completion_tokens']} tokens ({r['finish_reason']}), prompt "
                     f"{r['prompt_tokens']} tokens, {r['text_chars']} chars, on {r['worker']}")
        if "text" in r:
            head.add_row("text", Text(r["text"]))
    if view["error"] is not None:
        e = view["error"]
        head.add_row("error", Text(f"{e['kind']}: {e['message']}", style="red"))
    if view["waiting"] is not None:
        head.add_row("waiting", Text("\n".join(view["waiting"]["reasons"]) or "-",
                                     style="yellow"))
    attempts = Table(title="attempts", title_justify="left")
    for col in ("#", "worker", "instance", "started", "ended", "took", "outcome", "error"):
        attempts.add_column(col)
    for h in view["history"]:
        took = (f"{h['ended_at'] - h['started_at']:.1f} s" if h.get("ended_at") is not None
                and h.get("started_at") is not None else "")
        attempts.add_row(str(h.get("attempt", "")), h.get("worker") or "", h.get("instance") or "",
                         _when(h.get("started_at"), now), _when(h.get("ended_at"), now), took,
                         h.get("outcome") or "open", h.get("error") or "")
    return Group(head, attempts) if view["history"] else head


def run_request(request_id: str, as_json: bool = False, show_text: bool = False) -> int:
    """Print one request; 0 when it exists, 1 when it has no record or Redis is unreachable."""
    from rich.console import Console

    from app.requests.models import get_registry
    from app.settings import get_settings
    from app.redis_url import redacted_url
    from app.state.conn import connect

    s = get_settings()
    console = Console()
    try:
        view = describe(request_id, client=connect(s), settings=s, registry=get_registry(),
                        show_text=show_text)
    except (redis.RedisError, OSError, TransientError) as e:  # the store raises TransientError
        console.print(f"[red]cannot reach Redis at {redacted_url(s.redis_url)}: "
                      f"{type(e).__name__}[/]")
        return 1
    if view is None:
        if as_json:
            print(json.dumps({"request_id": request_id, "found": False}))
        else:
            console.print(f"no request {request_id}: never submitted, or its record expired "
                          f"(VIGIL_RESULT_TTL, {s.result_ttl} s after it ended)")
        return 1
    if as_json:
        print(json.dumps({**view, "found": True}))
    else:
        console.print(render(view))
    return 0
