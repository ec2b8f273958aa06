"""What token streams cost: the throughput bench's Celery side with streams on against the same
with streams off, in one run (docs/performance.md, "Token streams").

    python -m bench.stream_cost                       # 5 rounds per side, 512 req x 128 tokens
    python -m bench.throughput --stream-cost          # the same, from the throughput bench
    python -m bench.stream_cost --flush-ms 50 --chunk-tokens 16   # other stream settings

Self-contained (a private redis-server and two `vigil worker --cpu` processes). The two workers
serve two pools with the same weights and engine args (tiny-llama, and a twin registered for the
run), one with VIGIL_STREAM_FLUSH_MS at its default or `--flush-ms`, the other with 0 (no
streams, no resume: the engine's outputs are FINAL_ONLY, as before streams existed). Rounds send
the same prompts to each, alternating which goes first; both engines stay warm and the idle one
costs nothing. Redis' own counters (INFO commandstats) give the stream writes per request. The
last line printed is `ratio R`: the median over rounds of streamed req/s / unstreamed req/s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import redis

from bench.cpu_meter import _errors_note, _fmt_cpu, collect
from bench.direct_engine import MODEL, make_prompts
from bench.redis_ops import server_stats as command_counts
from bench.throughput import Bench, stop_all
from bench.throughput_report import spread

TWIN = "tiny-llama-nostream"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.stream_cost",
                                description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=512, help="requests per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per side, alternating")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--concurrency", type=int, default=160, help="worker threads")
    p.add_argument("--flush-ms", type=int, default=None,
                   help="the streamed worker's VIGIL_STREAM_FLUSH_MS (default: the default)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="the streamed worker's VIGIL_STREAM_CHUNK_TOKENS (default: the default)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds of quiet before each measured segment")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    a = p.parse_args(argv)
    # what Bench's helpers read
    a.redis_max_connections, a.worker_loglevel, a.submit_threads = 0, None, 1
    return a


class StreamCost(Bench):
    """Bench's private Redis, CPU meter and helpers, with two workers instead of one."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.models_file = self.tmp / "models.json"

    def _twin_models_file(self) -> None:
        from app.requests.models import get_registry

        spec = get_registry().get(MODEL).model_dump(mode="json")
        spec["name"] = TWIN
        self.models_file.write_text(json.dumps({"models": [spec]}))

    def _worker(self, name: str, pool: str, **env: str):
        log = self.tmp / f"{name}.log"
        proc = self.emb.start_worker(self.redis.url, f"{name}@%h", log,
                                     concurrency=self.args.concurrency, pools=pool,
                                     VIGIL_IDLE_CLEANUP="0",
                                     VIGIL_MODELS_FILE=str(self.models_file), **env)
        self.procs.append(proc)
        return proc, log

    def run(self) -> int:
        from tasks.inference import generate

        a = self.args
        try:
            self.redis.start()
            self._twin_models_file()
            os.environ["VIGIL_MODELS_FILE"] = str(self.models_file)
            from app.requests.models import get_registry
            from app.settings import get_settings

            get_settings.cache_clear()
            get_registry.cache_clear()
            s = get_settings()
            stream_env = {}
            if a.flush_ms is not None:
                stream_env["VIGIL_STREAM_FLUSH_MS"] = str(a.flush_ms)
            if a.chunk_tokens is not None:
                stream_env["VIGIL_STREAM_CHUNK_TOKENS"] = str(a.chunk_tokens)
            flush = a.flush_ms if a.flush_ms is not None else s.stream_flush_ms
            chunk = a.chunk_tokens if a.chunk_tokens is not None else s.stream_chunk_tokens
            self.say(f"vigil stream cost {time.strftime('%Y-%m-%d %H:%M')}: {os.cpu_count()} "
                     f"CPUs; streamed worker: flush {flush} ms, chunk {chunk} tokens; logs in "
                     f"{self.tmp}")
            on, on_log = self._worker("bench-stream", MODEL, **stream_env)
            off, off_log = self._worker("bench-nostream", TWIN, VIGIL_STREAM_FLUSH_MS="0")
            r = redis.Redis.from_url(self.redis.url)
            self.wait_engine(r, "bench-stream", on, on_log)
            self.wait_engine(r, "bench-nostream", off, off_log)
            sides = {"streamed": MODEL, "unstreamed": TWIN}
            for pool in sides.values():  # warm-up
                collect([generate.delay(model=pool, prompt=p, max_tokens=8, ignore_eos=True)
                         for p in make_prompts(64, 999)])
            self.cpu.add("redis", self.redis.proc.pid)
            rates: dict[str, list[float]] = {side: [] for side in sides}
            appends: list[float] = []
            for k in range(a.rounds):
                prompts = make_prompts(a.requests, k)
                order = list(sides) if k % 2 == 0 else list(reversed(sides))
                for side in order:
                    pool = sides[side]
                    self.cpu.add("worker", (on if side == "streamed" else off).pid)
                    before = command_counts(r)

                    def one_round():
                        rs = [generate.delay(model=pool, prompt=p, max_tokens=a.max_tokens,
                                             ignore_eos=True) for p in prompts]
                        values, errors = collect(rs)
                        return sum(v["completion_tokens"] for v in values), len(values), errors

                    wall, (tokens, ok, errors), cpu = self.measure(one_round)
                    after = command_counts(r)
                    self.cpu.remove("worker")
                    evalsha = after.get("evalsha", 0) - before.get("evalsha", 0)
                    xadd = after.get("xadd", 0) - before.get("xadd", 0)
                    if side == "streamed":
                        appends.append(xadd / max(ok, 1))
                    rates[side].append(ok / wall)
                    self.say(f"round {k + 1} {side:10s}: {ok} req in {wall:6.2f} s = "
                             f"{ok / wall:6.1f} req/s ({tokens / wall:6.0f} tok/s), stream "
                             f"entries {xadd} ({xadd / max(ok, 1):.2f}/req), scripts "
                             f"{evalsha}{_errors_note(errors)} | cpu% {_fmt_cpu(cpu)}")
            ratios = [x / y for x, y in zip(rates["streamed"], rates["unstreamed"])]
            self.say("-- summary --")
            self.say(f"{a.requests} req x {a.max_tokens} tokens, {a.rounds} rounds each, "
                     f"alternating which side goes first:")
            for side, values in rates.items():
                self.say(f"  {side:10s} {spread(values, 'req/s')}")
            self.say(f"  stream entries per request (chunks + end) "
                     f"{spread(appends, '')}")
            self.say(f"  ratio streamed/unstreamed per round {spread(ratios, '')}")
            self.say(f"ratio {statistics.median(ratios):.2f}")
            return 0
        finally:
            stop_all(self.emb, list(reversed(self.procs)), self.redis, self.tmp, a.keep_logs)


def main(argv=None) -> int:
    return StreamCost(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
