"""A finished soak's evidence, read into its SoakReport (bench/soak_report.py).

Each function fills part of the report from one source: the request records (outcomes,
duplicates, latency, recovery per kill), where the messages of unfinished requests are, the steady
worker's memory samples, the result backend, and the processes' logs.
"""
from __future__ import annotations

import json
import random
import re
import statistics
import time
from collections import Counter
from pathlib import Path

from bench.soak_fleet import QUEUE
from bench.soak_mix import is_twin_checked
from bench.soak_report import Kill, SoakReport

# Records are read back this many at a time (one pipeline each).
READ_CHUNK = 500
RECORD_FIELDS = ("status", "created_at", "finished_at", "error", "result", "attempts",
                 "dispatch", "history", "last_error", "preemptions")
REAPED = re.compile(r"reaped worker \S+ \(instance (\d+)\)")
# workers/lifecycle.py, logged by a worker as it exits (SIGTERM): its own token counters.
EXIT_TOTALS = re.compile(r"in this process (\d+) generated token\(s\) were resumed from and "
                         r"(\d+) discarded")
# app/fleet/message_audit.py audit_after_reap, logged by the reaper.
AUDIT_REPUBLISHED = re.compile(r"(\d+) request\(s\) of pool\(s\) .* had lost their message to a "
                               r"dead worker's consumer")


def read_records(client, ids: list[str]) -> dict[str, dict | None]:
    """Each request's record (the fields the report needs, decoded; `history` as a list), or
    None for an id Redis has no record of."""
    from app.state import keys

    out: dict[str, dict | None] = {}
    for i in range(0, len(ids), READ_CHUNK):
        chunk = ids[i:i + READ_CHUNK]
        pipe = client.pipeline(transaction=False)
        for rid in chunk:
            pipe.hmget(keys.request(rid), *RECORD_FIELDS)
        for rid, vals in zip(chunk, pipe.execute()):
            if vals[0] is None:
                out[rid] = None
                continue
            rec = {f: (v.decode() if v is not None else None) for f, v in zip(RECORD_FIELDS, vals)}
            h = json.loads(rec["history"]) if rec["history"] else []
            rec["history"] = h if isinstance(h, list) else []
            out[rid] = rec
    return out


def tally_records(rep: SoakReport, recs: dict[str, dict | None],
                  asked_tokens: dict[str, int]) -> None:
    """Fill the outcome figures from the records: succeeded, failed by code, lost (no terminal
    record), duplicates (not exactly one attempt succeeded, or an attempt left open), requeued
    twice (one dispatch begun twice), failed twice, wrong token counts, attempts, latency
    (created_at to finished_at) and the three slowest requests with their histories."""
    failed, attempts, latencies = Counter(), Counter(), []
    for rid, rec in recs.items():
        if rec is None or rec["status"] not in ("SUCCEEDED", "FAILED"):
            rep.lost += 1
            rep.lost_ids.append(rid)
            continue
        h = rec["history"]
        outcomes = Counter(e.get("outcome") for e in h)
        dispatches = Counter(e.get("dispatch") for e in h)
        attempts[int(rec["attempts"] or 0)] += 1
        latencies.append((float(rec["finished_at"]) - float(rec["created_at"]), rid))
        if rec["status"] == "SUCCEEDED":
            rep.succeeded += 1
            res = json.loads(rec["result"])
            if res.get("completion_tokens") != asked_tokens[rid]:
                rep.wrong_results += 1
            bad = outcomes["succeeded"] != 1 or outcomes[None] or outcomes["failed"]
        else:
            failed[(rec["error"] or "unknown").split(":", 1)[0]] += 1
            if len(rep.failed_samples) < 5:
                rep.failed_samples.append(f"{rid}: {(rec['error'] or '')[:300]}")
            bad = outcomes["succeeded"] or outcomes[None]
        if bad:
            rep.duplicates += 1
            rep.duplicate_ids.append(rid)
        if any(n > 1 for n in dispatches.values()):
            rep.requeued_twice += 1
        if outcomes["failed"] > 1:
            rep.failed_twice += 1
    rep.failed_by_code = dict(failed)
    rep.attempts = dict(sorted(attempts.items()))
    if latencies:
        xs = [x for x, _ in latencies]
        rep.latency_p50_s, rep.latency_p99_s = _quantile(xs, 0.5), _quantile(xs, 0.99)
        rep.latency_max_s = max(xs)
        for lat, rid in sorted(latencies, reverse=True)[:3]:
            rep.slowest.append({"id": rid, "latency_s": round(lat, 1),
                                "history": _history(recs[rid])})


def tally_recovery(rep: SoakReport, recs: dict[str, dict | None]) -> None:
    """Each kill's recovery (from the kill until the last request it held ended; None if one
    never did), the worst and the median, and how many kills never recovered."""
    for k in rep.kills:
        ends = [recs.get(rid) for rid in k.held]
        if all(r and r["finished_at"] for r in ends):
            k.recovery_s = max([float(r["finished_at"]) - k.at for r in ends], default=0.0)
    recov = [k.recovery_s for k in rep.kills if k.recovery_s is not None]
    rep.unrecovered_kills = sum(k.recovery_s is None for k in rep.kills)
    if recov:
        rep.recovery_worst_s, rep.recovery_median_s = max(recov), statistics.median(recov)
    for k in rep.kills:
        if k.kind in ("worker", "drain") and k.held:
            backs = [_back_after(recs.get(rid), k.at) for rid in k.held]
            if k.kind == "drain":  # a draining worker may finish some of them itself
                backs = [b for b in backs if b is not None] or [None]
            if all(b is not None for b in backs):
                k.handback_s = max(backs)
    backs = [k.handback_s for k in rep.kills if k.handback_s is not None]
    if backs:
        rep.handback_worst_s, rep.handback_median_s = max(backs), statistics.median(backs)


def _back_after(rec: dict | None, at: float) -> float | None:
    """Seconds from a worker kill at `at` until the request it held was back in the fleet's
    hands: its open attempt closed `requeued` by the reaper, or (a message the dead consumer
    took, published again by the audit) its next attempt begun; None if neither happened."""
    if rec is None:
        return None
    entries = rec.get("history") or []
    for e in entries:
        if (e.get("outcome") == "requeued" and e.get("ended_at") is not None
                and float(e.get("started_at") or 0) <= at <= float(e["ended_at"])):
            return float(e["ended_at"]) - at
    later = [float(e["started_at"]) for e in entries if float(e.get("started_at") or 0) > at]
    return min(later) - at if later else None


def locate(client, ids) -> dict[str, dict]:
    """Where each request's message is: the pool queue, kombu's unacked hash (fetched by a
    consumer; its age in s, or "absent"), the in-flight sets that name it. Nowhere at all
    (`nowhere`) means no message will run it until the reaper's audit publishes it again."""
    queued = {json.loads(m).get("headers", {}).get("id") for m in client.lrange(QUEUE, 0, -1)}
    unacked = {}
    for tag, raw in client.hgetall("unacked").items():
        try:
            mid = json.loads(raw)[0].get("headers", {}).get("id")
        except (ValueError, IndexError, AttributeError):
            continue
        score = client.zscore("unacked_index", tag)
        unacked[mid] = round(time.time() - score, 1) if score else None
    held: dict[str, list[str]] = {}
    for key in client.scan_iter("vigil:inflight:*"):
        for rid in client.smembers(key):
            held.setdefault(rid.decode(), []).append(key.decode().rsplit(":", 1)[-1])
    return {rid: {"queued": rid in queued, "unacked_age_s": unacked.get(rid, "absent"),
                  "held_by": held.get(rid, [])} for rid in ids}


def nowhere(where: dict) -> bool:
    """True when `locate` found the message in no queue, no unacked hash, no in-flight set."""
    return not where["queued"] and where["unacked_age_s"] == "absent" and not where["held_by"]


def describe_lost(client, ids: list[str], recs: dict[str, dict | None], kills: list[Kill],
                  t_wall0: float) -> list[dict]:
    """For requests that never ended: their record, when they were submitted (s after the first
    submit, and s from the nearest worker kill), and where their message is."""
    out = []
    for rid, where in locate(client, ids).items():
        rec = recs.get(rid) or {}
        created = rec.get("created_at")
        near = min((float(created) - k.at for k in kills if k.kind == "worker"),
                   key=abs, default=None) if created else None
        out.append({"id": rid, "status": rec.get("status"), "dispatch": rec.get("dispatch"),
                    "submitted_t_s": round(float(created) - t_wall0, 1) if created else None,
                    "submitted_after_worker_kill_s": None if near is None else round(near, 3),
                    **where, "history": _history(rec)})
    return out


def describe_republished(recs: dict[str, dict | None], kills: list[Kill],
                         t_wall0: float) -> list[dict]:
    """Up to 10 requests the reaper's audit published again (their last error is the audit's
    reason; a later requeue would overwrite it): when they were submitted (s after the first
    submit, and from the nearest worker kill) and their history. Submitted within milliseconds
    of a kill: a message the dead consumer took; otherwise more likely a copy a live consumer had
    fetched but not yet reported, which its stale delivery then shows."""
    from app.fleet.message_audit import REAP_REASON

    out = []
    for rid, rec in recs.items():
        if rec and rec.get("last_error") == REAP_REASON and len(out) < 10:
            created = float(rec["created_at"])
            near = min((created - k.at for k in kills if k.kind == "worker"), key=abs,
                       default=None)
            out.append({"id": rid, "status": rec["status"], "dispatch": rec["dispatch"],
                        "submitted_t_s": round(created - t_wall0, 1),
                        "submitted_after_worker_kill_s": None if near is None else round(near, 3),
                        "history": _history(rec)})
    return out


def rss_figures(rep: SoakReport, samples: list[dict], ready: dict | None, warm: int) -> None:
    """The steady worker's RSS (main process, and with its engine processes): at ready, at
    "start" (the first sample, engine up, once `warm` requests had ended: after warm-up; a sample
    between an engine kill and its restart has no engine), at the end, and the maximum."""
    if not samples:
        return
    up = [x for x in samples if x["engine_up"]] or samples
    start = next((x for x in up if x["ended"] >= warm), up[0])
    end = samples[-1]
    for key, out in (("main", rep.rss_main_mib), ("total", rep.rss_total_mib)):
        out.update(start=round(start[key], 1), end=round(end[key], 1),
                   max=round(max(x[key] for x in samples), 1))
        if ready:
            out["ready"] = round(ready[key], 1)


def check_backend(rep: SoakReport, recs: dict[str, dict | None], seed: int) -> None:
    """Read up to 100 succeeded and 100 failed results back through Celery's result backend
    (what `r.get()` sees) and list every one that disagrees with its record."""
    from app import app
    from app.errors import VigilError

    rng = random.Random(seed + 1)
    done = [rid for rid, r in recs.items() if r and r["status"] == "SUCCEEDED"]
    failed = [rid for rid, r in recs.items() if r and r["status"] == "FAILED"]
    sample = rng.sample(done, min(100, len(done))) + failed[:100]
    for rid in sample:
        rec = recs[rid]
        try:
            got = app.AsyncResult(rid).get(timeout=10)
            if rec["status"] != "SUCCEEDED":
                rep.backend_disagreements.append(f"{rid}: backend has a result, record says "
                                                 f"{rec['error']}")
            elif got != json.loads(rec["result"]):
                rep.backend_disagreements.append(f"{rid}: backend result differs")
        except VigilError as e:
            if rec["status"] != "FAILED" or e.code != rec["error"].split(":", 1)[0]:
                rep.backend_disagreements.append(f"{rid}: backend raised {e}, record "
                                                 f"{rec['status']}")
        except Exception as e:  # a timeout or a foreign error: a disagreement too
            rep.backend_disagreements.append(f"{rid}: {type(e).__name__}: {e}")
        rep.backend_checked += 1


def tally_witness(rep: SoakReport, recs: dict[str, dict | None], witness_dir: Path) -> None:
    """Fill the witness figures: the generations the engines wrote down (no Vigil code reads
    them; canaries counted apart), how many times each request ran to completion, each request
    that ran to completion more often than it may (once; twice for a request a killed worker
    held, whose engine may have finished it just before the kill lost its finish), each
    succeeded record that no finished generation of its attempt, with its token count, backs;
    and the token figures (SoakReport), every sample's."""
    from workers.engine.witness import finished_generations, read_canaries, read_witness

    seen = read_witness(witness_dir) if witness_dir.is_dir() else {}
    rep.witness_canaries = len(read_canaries(witness_dir)) if witness_dir.is_dir() else 0
    rep.witness_generations = sum(len(g) for g in seen.values()) + rep.witness_canaries
    runs = {rid: finished_generations(seen.get(rid, [])) for rid in recs}
    rep.generations_per_request = dict(sorted(Counter(runs.values()).items()))
    held_at_a_kill = {rid for k in rep.kills if k.kind == "worker" for rid in k.held}
    for rid, n in runs.items():
        if n > (2 if rid in held_at_a_kill else 1):
            rep.ran_too_often += 1
            rep.ran_too_often_ids.append(rid)
    # Every sample's tokens: a run from the prompt writes all its samples on one line, a run
    # that continued one sample of n > 1 a line of its own (workers/engine/witness.py).
    rep.tokens_generated = sum(sum(g["samples"]) if g["samples"] else g["tokens"]
                               for gs in seen.values() for g in gs)
    made_by_winners = 0
    for rid, rec in recs.items():
        if rec is None or rec["status"] != "SUCCEEDED" or not rec["result"]:
            continue
        res = json.loads(rec["result"])
        any_resumed = False
        for c in res.get("choices") or [res]:
            resumed = c.get("resumed_at") or []
            rep.tokens_in_results += c["completion_tokens"]
            rep.tokens_reused += sum(resumed)
            any_resumed = any_resumed or bool(resumed)
            made_by_winners += c["completion_tokens"] - (resumed[-1] if resumed else 0)
        rep.requests_resumed += any_resumed
        if not any(g["attempt"] == res["attempts"] and g["total"] == res["completion_tokens"]
                   and g["sample"] == 0 for g in seen.get(rid, [])):
            rep.witness_mismatches += 1
            rep.witness_mismatch_ids.append(rid)
    rep.tokens_thrown_away = max(0, rep.tokens_generated - made_by_winners)


def read_logs(rep: SoakReport, logdir: Path) -> None:
    """From every process's log: reaps per dead instance, requests the reaper's audit published
    again, and ERROR/CRITICAL/Traceback lines per log with one sample of each kind (at most 15)."""
    samples: Counter = Counter()
    for log in sorted(logdir.glob("*.log")):
        n = 0
        for line in log.read_text(errors="replace").splitlines():
            m = REAPED.search(line)
            if m:
                rep.reaps[m.group(1)] = rep.reaps.get(m.group(1), 0) + 1
            m = AUDIT_REPUBLISHED.search(line)
            if m:
                rep.republished_by_audit += int(m.group(1))
            if " ERROR" in line or "CRITICAL" in line or line.startswith("Traceback"):
                n += 1
                # one sample per kind of line: drop timestamps, ids and numbers
                key = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}|\d+", "N", line.split("] ", 1)[-1])
                if key not in samples:
                    rep.log_error_samples.append(f"{log.name}: {line[:300]}")
                samples[key] += 1
        if n:
            rep.log_errors[log.name] = n
    rep.log_error_samples = rep.log_error_samples[:15]


def read_exit_totals(rep: SoakReport, logdir: Path) -> None:
    """The tokens every worker incarnation discarded, from the line each logs as it exits
    (SIGTERM: a drain, or the soak's own stop). Read once every process has stopped."""
    total = n = 0
    for log in sorted(logdir.glob("*.log")):
        for m in EXIT_TOTALS.finditer(log.read_text(errors="replace")):
            total += int(m.group(2))
            n += 1
    rep.tokens_discarded, rep.worker_exits_logged = total, n


def check_twins(rep: SoakReport, recs: dict[str, dict | None], runs: dict[str, dict],
                sample: int, run_twin) -> None:
    """Greedy requests that were resumed (their result's `resumed_at`), `sample` of them at
    most, run again uninterrupted through `run_twin(kwargs)` (-> the twin's result): each must
    end with the same tokens."""
    resumed = [rid for rid, rec in recs.items() if rec and rec["status"] == "SUCCEEDED"
               and rec["result"] and json.loads(rec["result"]).get("resumed_at")
               and is_twin_checked(runs[rid])]
    for rid in resumed[:sample]:
        twin = run_twin(runs[rid])
        rep.twins_checked += 1
        if twin["token_ids"] != json.loads(recs[rid]["result"])["token_ids"]:
            rep.twin_mismatches += 1
            rep.twin_mismatch_ids.append(rid)


def tally_kinds(rep: SoakReport, recs: dict[str, dict | None], kinds: dict[str, str]) -> None:
    """The mix (bench/soak_mix.py): requests by kind, the resumed ones by kind (a takeover in
    any sample's result), and the preemptions every record counts."""
    rep.kinds = dict(sorted(Counter(kinds.values()).items()))
    resumed: Counter = Counter()
    for rid, rec in recs.items():
        if rec is None:
            continue
        rep.preemptions += int(rec.get("preemptions") or 0)
        if rec["status"] == "SUCCEEDED" and rec["result"]:
            res = json.loads(rec["result"])
            if any(c.get("resumed_at") for c in res.get("choices") or [res]):
                resumed[kinds.get(rid, "plain")] += 1
    rep.resumed_by_kind = dict(sorted(resumed.items()))


def _history(rec: dict) -> list[tuple]:
    return [(e.get("worker"), e.get("dispatch"), e.get("outcome"), e.get("error"))
            for e in rec.get("history") or []]


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
