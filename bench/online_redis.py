"""What the online bench reads from Redis after a run (bench/online.py): the live delay of each
streamed token, the stages of a request's first token, the kill's accounting, and Redis' own
counters of its work.

Everything here is read from the durable streams and records the run left (`vigil:stream:{id}`,
`vigil:req:{id}`), matched with what the client saw (bench/online_client.py `Stream`):

- **Live delay.** A live chunk's `w` is the wall time of the engine step that made its last
  token (EngineCore's own timestamp: workers/engine/stream_watch.py). Each token the client got
  is matched to the chunk that holds it by its position in the stream; its delay is the client's
  receipt time minus that `w`, split at the chunk's stream entry id (Redis' own clock at the
  XADD): engine step -> in Redis (the worker's read and write), in Redis -> client (the
  publish, the gateway's relay, SSE). For a chunk of several tokens the earlier ones were made
  one or more steps before `w`, so their delay is a lower bound; how many tokens came in chunks
  of more than one is printed beside it. A request's last tokens come with its result, not a
  chunk (docs/api.md, "Token streams"): they have no `w` and are counted apart.
- **First token's stages**: client send -> the record's `created_at` (the gateway parsed,
  rendered, recorded the call and submitted it) -> `started_at` (a worker began it) -> the
  first chunk's `w` (the engine admitted it and made its first token) -> the first chunk's
  entry id (written) -> the client's receipt.
"""
from __future__ import annotations

import json
import statistics

from app.state import keys
from app.state.streams import Entry, parse_entry
from bench.online_client import Stream, quantile


def entries(client, request_id: str) -> list[Entry]:
    """The request's stream entries, oldest first (chunks only)."""
    return [e for e in (parse_entry(i, f) for i, f in client.xrange(keys.stream(request_id)))
            if not e.end]


def entry_time(e: Entry) -> float:
    """Redis' own clock when the entry was appended (its id's milliseconds), in seconds."""
    return int(e.entry_id.split("-")[0]) / 1000.0


def by_position(es: list[Entry]) -> dict[int, Entry]:
    """Each token position of the stream -> the (last) chunk holding it."""
    out: dict[int, Entry] = {}
    for e in es:
        for k in range(len(e.token_ids)):
            out[e.start + k] = e
    return out


def live_delays(s: Stream, es: list[Entry]) -> tuple[list[float], list[float], list[float],
                                                      int, int]:
    """For every token of `s` that a chunk with `w` holds: (receipt - w, in Redis - w,
    receipt - in Redis), and (tokens that came with the result: no chunk, tokens in chunks of
    more than one token)."""
    pos = by_position(es)
    total, worker, relay, tail, multi = [], [], [], 0, 0
    at = 0
    for wall, n in zip(s.walls, s.counts):
        for k in range(at, at + n):
            e = pos.get(k)
            if e is None or e.made_at is None:
                tail += 1
                continue
            total.append(wall - e.made_at)
            worker.append(entry_time(e) - e.made_at)
            relay.append(wall - entry_time(e))
            multi += len(e.token_ids) > 1
        at += n
    return total, worker, relay, tail, multi


def step_gaps(es: list[Entry]) -> list[float]:
    """The engine's own time per token between consecutive live chunks of one attempt (the
    later chunk's `w` minus the earlier's, over its tokens): the inter-token latency at the
    engine, before any delivery."""
    out = []
    for a, b in zip(es, es[1:]):
        if a.made_at is not None and b.made_at is not None and a.attempt == b.attempt \
                and b.token_ids:
            out += [(b.made_at - a.made_at) / len(b.token_ids)] * len(b.token_ids)
    return out


def first_token_stages(client, s: Stream, es: list[Entry]) -> dict[str, float] | None:
    """The stages of `s`'s first token (module docstring), in seconds; None when something is
    missing (no chunk before the result)."""
    created, started = client.hmget(keys.request(s.key), "created_at", "started_at")
    first = es[0] if es else None
    if created is None or started is None or first is None or first.made_at is None \
            or not s.walls or first.start != 0:
        return None
    created, started = float(created), float(started)
    return {"gateway (send -> record)": created - s.sent_wall,
            "queue (record -> worker begins)": started - created,
            "engine (begin -> first token's step)": first.made_at - started,
            "write (step -> in Redis)": entry_time(first) - first.made_at,
            "relay (in Redis -> client)": s.walls[0] - entry_time(first)}


def stage_table(rows: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """(stage, p50, p99) in seconds over `rows` (first_token_stages of many requests)."""
    if not rows:
        return []
    return [(k, statistics.median([r[k] for r in rows]), quantile([r[k] for r in rows], 0.99))
            for k in rows[0]]


# -- Redis' own counters ----------------------------------------------------------------------
def counters(client) -> dict:
    """INFO commandstats (calls and usec per command) and Redis' CPU seconds (user + sys)."""
    cpu = client.info("cpu")
    cmds = {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in client.info("commandstats").items()}
    return {"cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), "cmds": cmds}


def counter_delta(a: dict, b: dict) -> tuple[float, dict[str, tuple[int, int]]]:
    """(Redis CPU seconds, {command: (calls, usec)}) between two `counters`."""
    out = {}
    for k, (calls, usec) in b["cmds"].items():
        c0, u0 = a["cmds"].get(k, (0, 0))
        if calls - c0:
            out[k] = (calls - c0, usec - u0)
    return b["cpu"] - a["cpu"], out


# -- the kill -----------------------------------------------------------------------------------
def kill_accounting(client, s: Stream, killed_at: float) -> dict:
    """One stream of the kill run (`accounting`), read from its durable stream and record."""
    raw = client.hget(keys.request(s.key), "result")
    return accounting(entries(client, s.key), json.loads(raw) if raw else {}, killed_at)


def accounting(es: list[Entry], result: dict, killed_at: float) -> dict:
    """A killed stream's chunks `es` and final `result`: the tokens the dead (first) attempt
    made durable (`durable`), where the next attempt resumed (`resumed_at`, from the result),
    and the steps the dead worker's engine had time for between its last durable step and the
    SIGKILL at wall time `killed_at` (`after_last`: (kill - last w) / the attempt's time per
    token, the median over its last chunks' w's), which is how many tokens it made that no
    stream held (recomputed by the resume)."""
    first = es[0].attempt if es else None
    dead = [e for e in es if e.attempt == first]
    durable = sum(len(e.token_ids) for e in dead)
    ws = [(e.made_at, len(e.token_ids)) for e in dead if e.made_at is not None]
    per_token = [(b[0] - a[0]) / b[1] for a, b in zip(ws, ws[1:]) if b[1]]
    step = statistics.median(per_token[-16:]) if per_token else None
    after = (killed_at - ws[-1][0]) / step if ws and step else None
    return {"durable": durable, "resumed_at": result.get("resumed_at") or [],
            "attempts": len({e.attempt for e in es}), "step_s": step,
            "after_last": max(0.0, after) if after is not None else None,
            "last_w": ws[-1][0] if ws else None}
