"""A batch object against the same lines through `generate.delay`, with a worker killed midway.

    python -m bench.batch_objects [--lines 10000] [--max-tokens 8] [--window 512]

A private fleet (bench/soak_fleet.py): an append-only Redis, two `vigil worker --cpu` processes
on tiny-llama (the *steady* one and the *victim*), the housekeeper and one beat (the batch tick
every VIGIL_BATCH_TICK_INTERVAL, 2 s; the reaper with a 10 s timeout). In the same run:

1. **direct**: the lines submitted with `generate.delay` under a job of their own, at most
   `--window` open at once (what a careful producer does), waited for by reading the records;
   the victim worker is SIGKILLed (its whole process group) once half have ended, and started
   again.
2. **batch**: the same lines as a file, `vigil batch submit` in a process of its own that is
   SIGKILLed as soon as it printed the batch id; the victim is SIGKILLed once half the lines are
   recorded; the batch is followed until it ends.

It prints the time of each (to the last result), the batch's accounting (every line in the
output or the error file, none twice, none missing: read from the files, not the counts), the
engines' witness (workers/engine/witness.py: how many generations each request's engines
finished), and last `ratio R`: the batch's time over the direct time.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from app.local.embedded import REPO, vigil_env
from bench.soak_fleet import MODEL, STEADY, VICTIM, Fleet, fleet_env

WORDS = ("the cat finds a small red book under the old tree near river stone light").split()
POLL_S = 0.5


def make_lines(n: int, max_tokens: int) -> list[dict]:
    """`n` completion lines, each prompt different, each asking exactly `max_tokens` tokens."""
    out = []
    for i in range(n):
        words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 9))
        out.append({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": MODEL, "prompt": f"line {i}: {words}",
                             "max_tokens": max_tokens, "ignore_eos": True}})
    return out


def run_direct(fleet: Fleet, lines: list[dict], window: int, say) -> dict:
    """Submit every line with generate.delay (at most `window` open), kill the victim once half
    have ended; returns {"seconds", "ids", "failed"}."""
    from app.state.store import shared_store
    from tasks.inference import generate

    store = shared_store()
    job = f"direct-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    open_ids: set[str] = set()
    ids, ended, failed, killed = [], 0, 0, False

    def poll() -> None:
        nonlocal ended, failed, killed
        done = store.ended(list(open_ids))
        for rid, outcome in done.items():
            open_ids.discard(rid)
            ended += 1
            failed += outcome is None or outcome.result is None
        if not killed and ended >= len(lines) // 2:
            fleet.kill_worker(VICTIM)
            killed = True
            say(f"direct: victim killed at {ended} ended, {time.monotonic() - t0:.1f} s")

    for line in lines:
        while len(open_ids) >= window:
            poll()
            time.sleep(0.05)
        b = line["body"]
        r = generate.delay(model=b["model"], prompt=b["prompt"], max_tokens=b["max_tokens"],
                           ignore_eos=True, job=job)
        ids.append(r.id)
        open_ids.add(r.id)
    while open_ids:
        poll()
        time.sleep(0.05)
    return {"seconds": time.monotonic() - t0, "ids": ids, "failed": failed}


def run_batch(fleet: Fleet, lines: list[dict], env: dict, logdir: Path, say) -> dict:
    """Submit the lines as a batch object from a process killed as soon as it printed the id,
    kill the victim at half; returns the accounting."""
    from app.fleet import batches
    from app.requests import batch_file as fmt
    from app.state.batches import BatchStore

    bs = BatchStore(fleet.client)
    path = logdir / "lines.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "app.ops.cli", "batch", "submit", str(path)],
                            env=vigil_env(fleet.redis.url, **env), cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    bid = proc.stdout.readline().strip()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    submitted = time.monotonic() - t0
    say(f"batch: {bid} stored in {submitted:.2f} s; its submitter SIGKILLed")
    killed = False
    while True:
        b = batches.get_batch(bs, bid)
        c = b["request_counts"]
        if not killed and c["completed"] + c["failed"] >= len(lines) // 2:
            fleet.kill_worker(VICTIM)
            killed = True
            say(f"batch: victim killed at {c['completed'] + c['failed']} recorded, "
                f"{time.monotonic() - t0:.1f} s")
        if b["status"] in batches.ENDED:
            break
        time.sleep(POLL_S)
    seconds = time.monotonic() - t0
    out = [json.loads(x) for x in batches.result_lines(bs, bid, errors=False)]
    err = [json.loads(x) for x in batches.result_lines(bs, bid, errors=True)]
    seen = Counter(x["custom_id"] for x in out + err)
    want = {x["custom_id"] for x in lines}
    job = fleet.client.hget(f"vigil:batch:{bid}", "job").decode()
    return {"seconds": seconds, "status": b["status"], "counts": c, "output": len(out),
            "errors": len(err), "twice": sum(1 for v in seen.values() if v > 1),
            "missing": len(want - set(seen)), "error_codes": Counter(
                x["error"]["code"] for x in err),
            "short": sum(1 for x in out if x["response"]["body"]["usage"]["completion_tokens"]
                         != lines[0]["body"]["max_tokens"]),
            "ids": [fmt.request_id_for(job, x["custom_id"]) for x in lines],
            "submitted_s": submitted}


def witnessed(witness_dir: Path, ids: list[str]) -> Counter:
    """How many requests of `ids` the engines ran to completion 0, 1, 2, ... times (canaries
    belong to no request)."""
    from workers.engine.witness import finished_generations, read_witness

    seen = read_witness(witness_dir)
    return Counter(finished_generations(seen.get(rid, [])) for rid in ids)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--window", type=int, default=512, help="the direct producer's most open "
                   "requests (the batch's is VIGIL_BATCH_WINDOW, 512)")
    p.add_argument("--reap-timeout", type=float, default=10.0)
    p.add_argument("--cache-dir", default=os.environ.get("VIGIL_CACHE_DIR",
                                                          str(Path.home() / ".cache" / "vigil")))
    p.add_argument("--logdir", help="keep the fleet's logs here (default: a temporary directory)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="vigil-batch-bench-"))
    logdir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(msg, flush=True)

    env = fleet_env(args.cache_dir, args.reap_timeout, request_timeout=120)
    env["VIGIL_WITNESS_DIR"] = str(logdir / "witness")
    fleet = Fleet(logdir, env)
    try:
        fleet.start_redis()
        fleet.make_this_process_a_client()
        os.environ["VIGIL_WITNESS_DIR"] = env["VIGIL_WITNESS_DIR"]
        fleet.build_model()
        for name in (STEADY, VICTIM):
            fleet.start_worker(name)
        fleet.start_housekeeper()
        fleet.start_beats(1)
        fleet.wait_ready((STEADY, VICTIM))
        lines = make_lines(args.lines, args.max_tokens)
        say(f"{args.lines} lines of {args.max_tokens} tokens; two workers on tiny-llama; "
            f"logs in {logdir}")
        direct = run_direct(fleet, lines, args.window, say)
        say(f"direct: {args.lines} ended in {direct['seconds']:.1f} s "
            f"({args.lines / direct['seconds']:.1f}/s), {direct['failed']} failed")
        fleet.wait_ready((STEADY, VICTIM))
        batch = run_batch(fleet, lines, env, logdir, say)
        say(f"batch: {batch['status']} in {batch['seconds']:.1f} s "
            f"({args.lines / batch['seconds']:.1f}/s): {batch['output']} output lines, "
            f"{batch['errors']} error lines {dict(batch['error_codes'])}, {batch['twice']} "
            f"twice, {batch['missing']} missing, {batch['short']} short of their tokens; "
            f"counts {batch['counts']}")
        for name, ids in (("direct", direct["ids"]), ("batch", batch["ids"])):
            w = witnessed(logdir / "witness", ids)
            say(f"witness ({name}): requests by generations their engines finished: "
                f"{dict(sorted(w.items()))}")
        say(f"ratio {batch['seconds'] / direct['seconds']:.2f}")
    finally:
        fleet.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
