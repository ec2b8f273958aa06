"""`vigil request ID`: one request's record and, while it waits, why.

    vigil request 3f2c...            # status, attempts, deadline, result summary or error
    vigil request 3f2c... --json     # one JSON object, for scripts
    vigil request 3f2c... --show-text   # the generated text and token ids too (user data)
    vigil request 3f2c... --follow      # the text as it is generated (the token stream)

The explanation of a wait is app/fleet/waiting.py's (the same one `AsyncResult.info` gives).
Read-only: nothing here changes Redis.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeoutError
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from app.errors import VigilError
from app.fleet.waiting import error_code, num, waiting_for, when
from app.redis_url import redacted_url
from app.requests.models import ModelRegistry, get_registry
from app.settings import VigilSettings, get_settings
from app.state import keys
from app.state.calls import REDIS_ERRORS
from app.state.store import RequestStore, open_store


def describe(request_id: str, *, store: RequestStore, settings: VigilSettings,
             registry: ModelRegistry, now: float | None = None,
             show_text: bool = False) -> dict[str, Any] | None:
    """One request as plain JSON-ready data, or None without a record: its fields (never the
    prompt), `history` (RequestStore.history), a result summary (`text` and `token_ids` only with
    `show_text`), the error ({kind, code, message}) and, while it has no outcome, `waiting`
    (why_waiting's dict)."""
    now = time.time() if now is None else now
    rec = store.get(request_id)
    if rec is None:
        return None
    status = rec.get("status", "")
    out: dict[str, Any] = {
        "request_id": request_id, "status": status, "model": rec.get("model", ""),
        "pool": rec.get("pool", ""), "job": rec.get("job", ""), "lora": rec.get("lora") or None,
        "created_at": num(rec, "created_at"), "deadline_at": num(rec, "deadline_at"),
        "finished_at": num(rec, "finished_at"), "attempts": int(rec.get("attempts") or 0),
        "max_attempts": settings.max_attempts, "dispatch": int(rec.get("dispatch") or 0),
        "worker": rec.get("worker") or None, "instance": rec.get("instance") or None,
        "started_at": num(rec, "started_at"), "last_error": rec.get("last_error", ""),
        "history": store.history(request_id), "result": None, "error": None, "waiting": None,
        # Tokens in the request's token stream so far (app/state/streams.py), and the token
        # offsets where an attempt took over from tokens made before it (resume).
        "tokens_so_far": int(rec.get("streamed") or 0), "resumed_at": [],
    }
    if status == keys.SUCCEEDED and rec.get("result"):
        res = json.loads(rec["result"])
        summary = {k: res.get(k) for k in ("finish_reason", "prompt_tokens", "completion_tokens",
                                           "attempts", "worker")}
        summary["text_chars"] = len(res.get("text") or "")
        out["tokens_so_far"] = int(res.get("completion_tokens") or 0)
        out["resumed_at"] = list(res.get("resumed_at") or ())
        if res.get("lora") is not None:
            summary["lora"] = res["lora"]
        if show_text:
            summary["text"] = res.get("text", "")
            summary["token_ids"] = res.get("token_ids", [])
        out["result"] = summary
    elif status == keys.FAILED:
        message = rec.get("error", "")
        out["error"] = {"kind": rec.get("error_kind", ""), "code": error_code(message),
                        "message": message}
    else:
        out["waiting"] = waiting_for(request_id, rec, store, settings, registry, now)
        cp = store.streams().checkpoint(request_id) if out["tokens_so_far"] else None
        if cp is not None:
            out["resumed_at"] = cp.resumed_at
    return out


def render(view: dict[str, Any], now: float | None = None):
    """Rich renderables for `describe`'s dict."""
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
    head.add_row("created", when(view["created_at"], now))
    head.add_row("deadline", when(view["deadline_at"], now))
    if view["finished_at"] is not None:
        head.add_row("finished", when(view["finished_at"], now))
    if view["tokens_so_far"] or view["resumed_at"]:
        took_over = ", ".join(str(o) for o in view["resumed_at"])
        head.add_row("tokens", f"{view['tokens_so_far']} so far" if view["result"] is None
                     else f"{view['tokens_so_far']} generated")
        if took_over:
            head.add_row("resumed at", f"token {took_over} (an attempt continued the tokens "
                         "made before it)")
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
                         when(h.get("started_at"), now), when(h.get("ended_at"), now), took,
                         h.get("outcome") or "open", h.get("error") or "")
    return Group(head, attempts) if view["history"] else head


def run_request(request_id: str, as_json: bool = False, show_text: bool = False) -> int:
    """Print one request; 0 when it exists, 1 when it has no record or Redis is unreachable."""
    s = get_settings()
    console = Console()
    try:
        view = describe(request_id, store=open_store(s), settings=s, registry=get_registry(),
                        show_text=show_text)
    except (*REDIS_ERRORS, OSError) as e:
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


def follow_request(app, request_id: str, after: int = 0, timeout: float | None = None) -> int:
    """`vigil request ID --follow`: print the request's text as it is generated (its token
    stream, through `app`'s results), then a summary line on stderr. 0 when it succeeded, 1 when
    it failed, has no record, or did not end within `timeout`."""
    err = Console(stderr=True)
    try:
        for chunk in app.AsyncResult(request_id).stream(after=after, timeout=timeout):
            if chunk.get("restart"):
                err.print("[yellow]-- the tokens so far were thrown away; the request started "
                          "again from its prompt --[/]")
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            if chunk.get("final"):
                r = chunk["result"]
                resumed = r.get("resumed_at") or []
                err.print(f"\n[green]done[/]: {r.get('completion_tokens')} tokens "
                          f"({r.get('finish_reason')}), {r.get('attempts')} attempt(s)"
                          + (f", resumed at token {', '.join(map(str, resumed))}"
                             if resumed else ""))
        return 0
    except VigilError as e:
        err.print(f"\n[red]{type(e).__name__}: {e}[/]")
        return 1
    except CeleryTimeoutError as e:
        err.print(f"\n[red]{e}[/]")
        return 1
