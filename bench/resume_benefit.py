"""What resuming saves: a long greedy generation whose worker is SIGKILLed at ~75%, continued from
its token stream, against the same kill with token streams off (a restart from the prompt), in
one run (docs/performance.md, "Resume").

    python -m bench.resume_benefit                    # 1,500 tokens, 3 rounds per side
    python -m bench.resume_benefit --tokens 400 --rounds 1   # quick look (tiny-llama's context)

Self-contained: a private redis-server, `celery beat` (the reaper, reap timeout
`--reap-timeout`), and four `vigil worker --cpu` processes: two serve a pool with token streams
on, two serve a twin pool (same weights and engine args) with VIGIL_STREAM_FLUSH_MS=0. The pools
are tiny-llama's weights with a 2,048-token context (hf_overrides), registered for the run. Each
round first runs the request whole on each pool (the reference, and its duration T), then, per
side: submits it, SIGKILLs the whole process group of the worker running it 0.75 T after its
attempt began, and waits for the survivor's result; the killed worker is started again for the
next round. Reported per side: from the kill to the result, from the requeue (the reaper's end of
the first attempt) to the result, the second attempt's own duration (its history entry), and
whether the tokens are identical to the reference. The reaper's detection time is the same for
both sides; what resuming changes is what comes after it. The last line is
`ratio R`: median over rounds of (requeue -> result) resumed / restarted.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

from app.local.embedded import free_port
from bench.throughput import stop_all

POOLS = {"resumed": "tiny-llama-long", "restarted": "tiny-llama-long-nostream"}
CONTEXT = 2048


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.resume_benefit",
                                description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1500, help="tokens generated (max_tokens)")
    p.add_argument("--rounds", type=int, default=3, help="kills per side, alternating")
    p.add_argument("--at", type=float, default=0.75, help="kill at this fraction of T")
    p.add_argument("--reap-timeout", type=float, default=4.0, help="the reaper's timeout (s)")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    return p.parse_args(argv)


class Benefit:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="vigil-resume-"))
        port = free_port()
        os.environ.setdefault("VIGIL_CACHE_DIR", str(self.tmp / "cache"))
        os.environ["VIGIL_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        self.models_file = self.tmp / "models.json"
        os.environ["VIGIL_MODELS_FILE"] = str(self.models_file)
        self.env = {"VIGIL_HEARTBEAT_INTERVAL": "1", "VIGIL_ALLOW_SHORT_REAP_TIMEOUT": "1",
                    "VIGIL_WORKER_REAP_TIMEOUT": str(args.reap_timeout),
                    "VIGIL_IDLE_CLEANUP": "0", "VIGIL_MODELS_FILE": str(self.models_file)}
        from app.local import embedded

        self.emb = embedded
        self.redis = embedded.EmbeddedRedis(port=port)
        self.workers: dict[str, object] = {}  # name -> process
        self.procs: list = []

    def say(self, line: str) -> None:
        print(line, flush=True)

    def write_models(self) -> None:
        from app.requests.models import TINY_LLAMA, TINY_VERSION

        cache = Path(os.environ["VIGIL_CACHE_DIR"])
        spec = {"path": str(cache / "models" / f"tiny-llama-v{TINY_VERSION}"),
                "builder": TINY_LLAMA, "max_model_len": CONTEXT, "memory_gib": 2.0,
                "kv_cache_gib": 1.0,
                "engine_args": {"max_model_len": CONTEXT, "enforce_eager": True, "seed": 0,
                                "dtype": "float32",
                                "hf_overrides": {"max_position_embeddings": CONTEXT}}}
        self.models_file.write_text(json.dumps({"models": [{"name": p, **spec}
                                                           for p in POOLS.values()]}))

    def start_worker(self, name: str) -> None:
        side = name.rsplit("-", 1)[0]
        env = dict(self.env)
        if side == "restarted":
            env["VIGIL_STREAM_FLUSH_MS"] = "0"
        self.workers[name] = self.emb.start_worker(
            self.redis.url, f"{name}@bench", self.tmp / f"{name}.log", concurrency=4,
            pools=POOLS[side], **env)

    def wait_ready(self, names: list[str], timeout: float = 600) -> None:
        r = redis.Redis.from_url(self.redis.url)

        def ready():
            up = set()
            for key in r.scan_iter("vigil:worker:*"):
                h = r.hgetall(key)
                if int(h.get(b"engine_loads", 0) or 0) >= 1 and h.get(b"has_pinged") == b"1":
                    up.add(h.get(b"name", b"").decode().split("@")[0])
            return set(names) <= up
        self.emb.wait_for(ready, timeout, 0.5, f"workers {names}")

    def run_side(self, side: str, kw: dict, whole_s: float, reference: list[int]) -> dict:
        from app.state.store import RequestStore
        from tasks.inference import generate

        store = RequestStore(redis.Redis.from_url(self.redis.url), 3600)
        r = generate.delay(**{**kw, "model": POOLS[side]})
        began = None
        while began is None:
            rec = store.get(r.id) or {}
            if rec.get("status") == "RUNNING":
                began = float(rec["started_at"])
                victim = rec["worker"].split("@")[0]
            time.sleep(0.01)
        time.sleep(max(0.0, began + self.args.at * whole_s - time.time()))
        streamed = int((store.get(r.id) or {}).get("streamed") or 0)
        os.killpg(self.workers[victim].pid, signal.SIGKILL)
        killed = time.time()
        out = r.get(timeout=600)
        done = time.time()
        hist = store.history(r.id)
        requeued = next(h["ended_at"] for h in hist if h["outcome"] == "requeued")
        last = hist[-1]
        self.emb.stop_process(self.workers[victim])
        self.start_worker(victim)
        row = {"kill_to_result": done - killed, "requeue_to_result": done - requeued,
               "second_attempt": last["ended_at"] - last["started_at"],
               "identical": out["token_ids"] == reference, "streamed_at_kill": streamed,
               "resumed_at": out.get("resumed_at") or [], "attempts": out["attempts"],
               "victim": victim}
        self.say(f"  {side:9s}: killed {victim} at {self.args.at:.0%} of T ({streamed} tokens "
                 f"in its stream); result {row['kill_to_result']:.2f} s after the kill, "
                 f"{row['requeue_to_result']:.2f} s after the requeue; attempt 2 took "
                 f"{row['second_attempt']:.2f} s; resumed_at {row['resumed_at']}; "
                 f"token-identical {row['identical']}")
        return row

    def run(self) -> int:
        a = self.args
        try:
            self.redis.start()
            self.write_models()
            beat = self.emb.start_process(
                [sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO", "-s",
                 str(self.tmp / "schedule")], self.emb.vigil_env(self.redis.url, **self.env),
                self.tmp / "beat.log")
            self.procs.append(beat)
            names = [f"{side}-{i}" for side in POOLS for i in (1, 2)]
            for n in names:
                self.start_worker(n)
            self.wait_ready(names)
            from tasks.inference import generate

            self.say(f"vigil resume benefit {time.strftime('%Y-%m-%d %H:%M')}: {os.cpu_count()} "
                     f"CPUs; {a.tokens} greedy tokens, SIGKILL at {a.at:.0%}, reap timeout "
                     f"{a.reap_timeout:g} s; logs in {self.tmp}")
            rows: dict[str, list[dict]] = {side: [] for side in POOLS}
            for k in range(a.rounds):
                kw = dict(prompt=f"Round {k}: once upon a time", max_tokens=a.tokens,
                          temperature=0.0, ignore_eos=True)
                whole = {}
                for side, pool in POOLS.items():
                    t0 = time.time()
                    res = generate.delay(**{**kw, "model": pool}).get(timeout=600)
                    whole[side] = (time.time() - t0, res["token_ids"])
                self.say(f"round {k + 1}: whole run {whole['resumed'][0]:.2f} s (streams on), "
                         f"{whole['restarted'][0]:.2f} s (off)")
                order = list(POOLS) if k % 2 == 0 else list(reversed(POOLS))
                for side in order:
                    rows[side].append(self.run_side(side, kw, whole[side][0], whole[side][1]))
                    self.wait_ready(names)
            self.say("-- summary --")
            for side, rs in rows.items():
                for key in ("kill_to_result", "requeue_to_result", "second_attempt"):
                    v = [x[key] for x in rs]
                    self.say(f"  {side:9s} {key:17s} median {statistics.median(v):6.2f} s "
                             f"(min {min(v):.2f} - max {max(v):.2f})")
                self.say(f"  {side:9s} token-identical {sum(x['identical'] for x in rs)} of "
                         f"{len(rs)}")
            ratios = [x["requeue_to_result"] / y["requeue_to_result"]
                      for x, y in zip(rows["resumed"], rows["restarted"])]
            attempt = [x["second_attempt"] / y["second_attempt"]
                       for x, y in zip(rows["resumed"], rows["restarted"])]
            kill = [x["kill_to_result"] / y["kill_to_result"]
                    for x, y in zip(rows["resumed"], rows["restarted"])]
            self.say(f"  resumed/restarted: kill -> result {statistics.median(kill):.2f}, "
                     f"attempt 2 {statistics.median(attempt):.2f}, requeue -> result "
                     f"{statistics.median(ratios):.2f}")
            self.say(f"ratio {statistics.median(ratios):.2f}")
            return 0
        finally:
            stop_all(self.emb, list(self.workers.values()) + self.procs, self.redis, self.tmp,
                     a.keep_logs)


def main(argv=None) -> int:
    return Benefit(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
