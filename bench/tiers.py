"""Interactive latency under a saturating bulk backlog, with tiers and without, in one run
(docs/performance.md, "Tiers").

    python -m bench.tiers                               # 480-token bulk, 6 rounds of 5
    python -m bench.tiers --rounds 2                    # a quick look

Self-contained: a private redis-server and one `vigil worker --cpu` serving a pool of tiny-llama's
weights whose engine runs a batch of `--seqs` (4) requests, at the worker's default task threads
and `VIGIL_INTERACTIVE_SLOTS`. A backlog of `--bulk` long greedy bulk requests is submitted as
`generate_many` calls (messages of many, as a batch object's window is), topped up with
another `--bulk` whenever fewer than twice the engine's batch are open, so bulk work always
waits while the trickle runs. Once the engine's batch is full of them, the bulk work runs
alone for `--alone` seconds (its throughput alone), then a trickle of short greedy requests
(`--trickle-tokens`, one at a time, `--gap` s apart) runs in blocks of `--per-block`, the blocks
alternating between the two sides, `--rounds` times (the first side alternates too):

- **with tiers**: `priority="interactive"`: taken first, and preempting the bulk run cheapest to
  rebuild when the engine's batch is full;
- **without**: the same requests at the default tier: taken before bulk work from the queue,
  but waiting (outside vLLM since issue 38's batch gate) for a batch seat that a finished bulk
  request frees.

Reported per side: the trickle's latency (submit to result) p50 / p99 / max, and the bulk
tokens made per second during its blocks (vLLM's own output count, the worker's
`vigil_engine_step_outputs`, less the trickle's tokens), against the bulk work alone: the bulk
throughput cost. Then: preemptions, the bulk tokens thrown away (`vigil_tokens_discarded_total`
before and after: goal 0), and every preempted bulk request run again uninterrupted (its twin,
default tier, after the backlog ended): each must be token-identical. `saturated` says whether
bulk work still waited when the last block ended.

Not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import requests

from app.local.embedded import free_port

POOL = "tiers-bench"
SIDES = {"with tiers": "interactive", "without": None}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__.split("\n")[0])
    p.add_argument("--bulk", type=int, default=24,
                   help="bulk requests per generate_many call (the backlog and each top-up)")
    p.add_argument("--bulk-tokens", type=int, default=480, help="tokens per bulk request")
    p.add_argument("--seqs", type=int, default=4, help="the engine's batch (max_num_seqs)")
    p.add_argument("--rounds", type=int, default=6, help="blocks per side")
    p.add_argument("--per-block", type=int, default=5, help="trickle requests per block")
    p.add_argument("--trickle-tokens", type=int, default=16, help="tokens per trickle request")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between trickle requests")
    p.add_argument("--alone", type=float, default=10.0, help="seconds of bulk work alone")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    return p.parse_args(argv)


def quantile(xs: list[float], q: float) -> float:
    """The `q` quantile of `xs` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))]


class TiersBench:
    """One run (module docstring); `run` returns the exit status."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="vigil-tiers-"))
        port = free_port()
        os.environ.setdefault("VIGIL_CACHE_DIR", str(self.tmp / "cache"))
        os.environ["VIGIL_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        self.models_file = self.tmp / "models.json"
        os.environ["VIGIL_MODELS_FILE"] = str(self.models_file)
        self.metrics_port = free_port()
        self.env = {"VIGIL_HEARTBEAT_INTERVAL": "1", "VIGIL_IDLE_CLEANUP": "0",
                    "VIGIL_MODELS_FILE": str(self.models_file),
                    "VIGIL_METRICS_PORT": str(self.metrics_port)}
        from app.local import embedded

        self.emb = embedded
        self.redis = embedded.EmbeddedRedis(port=port)
        self.worker = None

    def say(self, line: str) -> None:
        print(line, flush=True)

    def write_models(self) -> None:
        from app.requests.models import TINY_LLAMA, TINY_MAX_POSITIONS, TINY_VERSION

        cache = Path(os.environ["VIGIL_CACHE_DIR"])
        spec = {"name": POOL, "path": str(cache / "models" / f"tiny-llama-v{TINY_VERSION}"),
                "builder": TINY_LLAMA, "max_model_len": TINY_MAX_POSITIONS, "memory_gib": 2.0,
                "engine_args": {"max_model_len": TINY_MAX_POSITIONS, "enforce_eager": True,
                                "seed": 0, "dtype": "float32",
                                "max_num_seqs": self.args.seqs}}
        self.models_file.write_text(json.dumps({"models": [spec]}))

    def metrics(self) -> dict[str, float]:
        """The worker's /metrics: every sample summed over its labels, by name."""
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for m in re.finditer(r"^(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def outputs(self) -> float:
        return self.metrics().get("vigil_engine_step_outputs_total", 0.0)

    def wait_ready(self, timeout: float = 600) -> None:
        r = redis.Redis.from_url(self.redis.url)

        def ready():
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker exited; see {self.tmp}")
            for key in r.scan_iter("vigil:worker:*"):
                h = r.hgetall(key)
                if int(h.get(b"engine_loads", 0) or 0) >= 1 and h.get(b"has_pinged") == b"1":
                    return True
            return False
        self.emb.wait_for(ready, timeout, 0.5, "the worker's engine")

    def trickle_one(self, tier: str | None, i: int) -> tuple[float, int]:
        """One trickle request on `tier`: (latency in s, tokens made)."""
        from tasks.inference import generate

        kw = dict(model=POOL, prompt=f"a quick question {i}", max_tokens=self.args.trickle_tokens,
                  temperature=0.0, ignore_eos=True, job="trickle")
        t0 = time.monotonic()
        out = generate.delay(**kw, **({"priority": tier} if tier else {})).get(timeout=600)
        return time.monotonic() - t0, out["completion_tokens"]

    def run(self) -> int:
        a = self.args
        try:
            self.redis.start()
            self.write_models()
            self.worker = self.emb.start_worker(self.redis.url, "tiers@bench",
                                                self.tmp / "worker.log", pools=POOL, **self.env)
            self.wait_ready()
            return self.measure()
        finally:
            if self.worker is not None:
                self.emb.stop_process(self.worker)
            self.redis.stop()
            if not a.keep_logs:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def measure(self) -> int:
        from app.state import keys
        from app.state.store import RequestStore
        from tasks.inference import generate_many

        a = self.args
        store = RequestStore(redis.Redis.from_url(self.redis.url), 3600)
        self.say(f"vigil tiers bench {time.strftime('%Y-%m-%d %H:%M')}: {os.cpu_count()} CPUs; "
                 f"engine batch {a.seqs}; {a.bulk} bulk x {a.bulk_tokens} greedy tokens "
                 f"(generate_many); trickle {a.rounds} blocks x {a.per_block} per side of "
                 f"{a.trickle_tokens} tokens, {a.gap:g} s apart; logs in {self.tmp}")
        discarded0 = self.metrics().get("vigil_tokens_discarded_total", 0.0)
        bulk_kw: list[dict] = []
        bulk: list = []

        def top_up() -> None:
            """Another --bulk bulk requests when fewer than twice the batch are open."""
            if bulk and store.raw.scard(keys.pool_requests(POOL)) >= 2 * a.seqs:
                return
            kws = [dict(model=POOL, prompt=f"bulk {len(bulk_kw) + i}: a long story about the sea",
                        max_tokens=a.bulk_tokens, temperature=0.0, ignore_eos=True, job="bulk")
                   for i in range(a.bulk)]
            bulk_kw.extend(kws)
            bulk.extend(generate_many([{**kw, "priority": "bulk"} for kw in kws]))

        top_up()

        def streaming() -> int:
            return sum(int((store.get(r.id) or {}).get("streamed") or 0) > 0 for r in bulk)
        self.emb.wait_for(lambda: streaming() >= a.seqs, 300, 0.2, "the engine full of bulk")
        o0, t0 = self.outputs(), time.monotonic()
        time.sleep(a.alone)
        alone = (self.outputs() - o0) / (time.monotonic() - t0)
        self.say(f"bulk alone: {alone:.0f} tokens/s")
        lat: dict[str, list[float]] = {s: [] for s in SIDES}
        tps: dict[str, list[float]] = {s: [] for s in SIDES}
        i = 0
        for k in range(a.rounds):
            order = list(SIDES) if k % 2 == 0 else list(reversed(SIDES))
            for side in order:
                o0, t0, made = self.outputs(), time.monotonic(), 0
                for _ in range(a.per_block):
                    top_up()
                    s, n = self.trickle_one(SIDES[side], i)
                    i += 1
                    lat[side].append(s)
                    made += n
                    time.sleep(a.gap)
                dt = time.monotonic() - t0
                tps[side].append((self.outputs() - o0 - made) / dt)
                self.say(f"  round {k + 1} {side:10s}: latency "
                         + " ".join(f"{x * 1000:.0f}" for x in lat[side][-a.per_block:])
                         + f" ms; bulk {tps[side][-1]:.0f} tokens/s")
        open_bulk = sum((store.get(r.id) or {}).get("status") not in ("SUCCEEDED", "FAILED")
                        for r in bulk)
        outs = [r.get(timeout=1800) for r in bulk]
        discarded = self.metrics().get("vigil_tokens_discarded_total", 0.0) - discarded0
        preempted = [j for j, r in enumerate(bulk)
                     if int((store.get(r.id) or {}).get("preemptions") or 0) > 0]
        twins = generate_many([bulk_kw[j] for j in preempted]) if preempted else []
        same = sum(t.get(timeout=1800)["token_ids"] == outs[j]["token_ids"]
                   for j, t in zip(preempted, twins))
        resumed = sum(bool(outs[j].get("resumed_at")) for j in preempted)
        self.say("-- summary --")
        for side in SIDES:
            xs = lat[side]
            self.say(f"  {side:10s} latency p50 {quantile(xs, 0.5) * 1000:6.0f} ms, p99 "
                     f"{quantile(xs, 0.99) * 1000:6.0f} ms, max {max(xs) * 1000:6.0f} ms "
                     f"({len(xs)} requests); bulk {statistics.median(tps[side]):.0f} tokens/s "
                     f"(median of {len(tps[side])} blocks)")
        without = statistics.median(tps["without"])
        cost = 1 - statistics.median(tps["with tiers"]) / without if without else float("nan")
        self.say(f"  bulk alone {alone:.0f} tokens/s; bulk throughput cost of tiers "
                 f"(1 - with / without) {cost:+.1%}")
        self.say(f"  preempted {len(preempted)} bulk requests ({resumed} resumed from their "
                 f"streams); identical to their uninterrupted twins: {same} of {len(preempted)}")
        self.say(f"  bulk tokens discarded (vigil_tokens_discarded_total delta) {discarded:.0f}")
        self.say(f"  saturated: {open_bulk > a.seqs} ({open_bulk} of {len(bulk)} bulk requests "
                 f"open when the last block ended)")
        p50 = {s: quantile(lat[s], 0.5) for s in SIDES}
        self.say(f"ratio p50 {p50['with tiers'] / p50['without']:.2f}")
        return 0 if same == len(preempted) and discarded == 0 else 1


def main(argv=None) -> int:
    return TiersBench(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
