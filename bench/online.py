"""Vigil's online API (`vigil api`, streamed /v1/completions) against `vllm serve` of the same
CPU build, same model, same engine args and prompts, in one run (docs/performance.md, "The
online API").

    python -m bench.online             # the full run (bench/README.md says how long)
    python -m bench.online --quick     # a few minutes

Self-contained: a private redis-server, `vigil api` (one process), one `vigil worker --cpu`
("steady"), and `vllm serve` on the same tiny-llama directory with the worker's engine args
(bench/online_fleet.py says how they are passed, and where the two differ: the worker runs the
model inside EngineCore, which stock `vllm serve` cannot; side "serve-uni" is `vllm serve`
handed that executor, bench/serve_uni.py). Every engine stays warm; the sides run one after
the other, never at once, the first side alternating per round, with a pause before each
segment (vLLM's engine busy-polls for a second after its last step).

Each round, each side: greedy streamed completions (temperature 0, `ignore_eos`, exactly
`--tokens` tokens, token ids asked back) through one asyncio httpx client at concurrency 1, 16
and 64 (a closed loop: a new stream starts as one ends), the same prompts on both sides and a
new prompt for every request (no prefix-cache hit on either side). Measured as `vllm bench
serve` measures (bench/online_client.py): TTFT, inter-token latency (ITL) p50/p99, output
tokens/s of the level. Then, for Vigil's streams only, read from Redis after the run
(bench/online_redis.py): the live delay of every token (client receipt minus the `w` of the
engine step that made it), the stages of the first token, and Redis' own work per streamed
token (INFO commandstats, used_cpu) over Vigil's segments. Last, the kill under load
(bench/online_kill.py). Process CPU per segment as % of one core; OTHER is everything else on
the machine.

The summary ends with Vigil's ratios to `vllm serve` against the goals of issue 41: TTFT p50
at c=1 at most 60 ms above, ITL p50 at most 1.2x, tokens/s at c=64 at least 0.8x; live delay
p99 at most 50 ms; the kill: every stream complete and identical to its twin.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis

from app.local.embedded import EmbeddedRedis, free_port
from bench.cpu_meter import CpuMeter, _fmt_cpu
from bench.direct_engine import WORDS
from bench.online_client import body, run_level
from bench.online_fleet import Serve, Vigil, differences, engine_recipe
from bench.online_report import Report

LEVELS = (1, 16, 64)
SETTLE_S = 2.0


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with the full run's or `--quick`'s defaults filled in."""
    p = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few minutes: fewer rounds, "
                   "requests and tokens, stock vllm serve only")
    p.add_argument("--rounds", type=int, help="rounds (default 4; quick 2)")
    p.add_argument("--tokens", type=int, help="tokens per request (default 128; quick 64)")
    p.add_argument("--single", type=int, help="requests at c=1 per round (default 8; quick 4)")
    p.add_argument("--waves", type=int, help="requests per round at c=16 and 64, in multiples "
                   "of the concurrency (default 2; quick 1)")
    p.add_argument("--baselines", help="comma-separated: serve (stock vllm serve), serve-uni "
                   "(vllm serve with the worker's executor); default both, quick: serve")
    p.add_argument("--kill-streams", type=int, default=64)
    p.add_argument("--kill-tokens", type=int, help="tokens per kill stream (default 384; "
                   "quick 256); the kill lands at half")
    p.add_argument("--reap-timeout", type=int, default=8)
    p.add_argument("--skip-kill", action="store_true")
    p.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                   help="EXPERIMENT: an environment variable for Vigil's workers (e.g. "
                        "OMP_NUM_THREADS=1); not what Vigil does by itself")
    p.add_argument("--profile", action="store_true",
                   help="py-spy the gateway and the worker's main process during the last "
                        "round's vigil segment at c=64 (top functions; perturbs that segment)")
    p.add_argument("--keep-logs", action="store_true")
    a = p.parse_args(argv)
    q = a.quick
    a.rounds = a.rounds or (2 if q else 4)
    a.tokens = a.tokens or (64 if q else 128)
    a.single = a.single or (4 if q else 8)
    a.waves = a.waves or (1 if q else 2)
    a.kill_tokens = a.kill_tokens or (256 if q else 384)
    a.baselines = [b for b in (a.baselines or ("serve" if q else "serve,serve-uni")).split(",")
                   if b]
    return a


def prompts(round_no: int, level: int, n: int) -> list[str]:
    """`n` different ~12-word prompts, the same for a round and level on every side."""
    rng = random.Random(7919 * (round_no + 1) + level)
    return [f"Request {round_no}-{level}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(10))
            for i in range(n)]


def commit() -> str:
    """This checkout's short commit, `+dirty` with uncommitted changes to tracked files."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class OnlineBench:
    """One run (module docstring); `run` returns the exit status."""

    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.tmp = Path(tempfile.mkdtemp(prefix="vigil-online-bench-"))
        self.port = free_port()
        os.environ["VIGIL_REDIS_URL"] = f"redis://127.0.0.1:{self.port}/0"  # before `app`
        self.rds = EmbeddedRedis(port=self.port)
        self.vigil: Vigil | None = None
        self.serves: dict[str, Serve] = {}
        self.meter = CpuMeter()
        self.report = Report(args, self.say)

    def say(self, line: str) -> None:
        """Print a line of the report now."""
        print(line, flush=True)

    def run(self) -> int:
        """Start everything, run the rounds, read Redis, run the kill, print the summary; stop
        everything whatever happens. The exit status (bench/online_report.py `summary`)."""
        started = time.monotonic()
        try:
            self.start()
            self.rounds()
            self.report.live_and_stages(self.client)
            if not self.a.skip_kill:
                for kind in list(self.serves):
                    self.serves.pop(kind).stop()  # memory and cores for the kill run
                self.kill()
            self.say(f"wall time {time.monotonic() - started:.0f} s; logs in {self.tmp}")
            return self.report.summary()
        finally:
            for s in self.serves.values():
                s.stop()
            if self.vigil is not None:
                self.vigil.stop()
            self.rds.stop()
            if not self.a.keep_logs:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self) -> None:
        """Start Redis, Vigil's side and the baselines, wait for them, meter them, warm them up."""
        a = self.a
        spec, args = engine_recipe()
        self.say(f"vigil online bench {time.strftime('%Y-%m-%d %H:%M')}, commit {commit()}: "
                 f"{os.cpu_count()} CPUs, load {psutil.getloadavg()[0]:.2f}; {a.rounds} rounds;"
                 f" {a.tokens} greedy tokens per request; c=1: {a.single} requests, c=16/64: "
                 f"{a.waves} x c; baselines {', '.join(a.baselines)}"
                 + (f"; EXPERIMENT worker env {' '.join(a.worker_env)}" if a.worker_env else ""))
        self.say("engine args (worker and vllm serve): " + ", ".join(
            f"{k}={getattr(v, '__name__', v)}" for k, v in args.items()))
        for line in differences(args):
            self.say("  differs: " + line)
        self.rds.start()
        self.client = redis.Redis.from_url(self.rds.url)
        self.vigil = Vigil(self.rds.url, self.tmp,
                           dict(kv.split("=", 1) for kv in self.a.worker_env))
        self.vigil.start_worker("steady")
        for kind in a.baselines:
            self.serves[kind] = Serve(kind, spec, args, self.tmp)
        t0 = time.monotonic()
        self.vigil.wait_api()
        self.vigil.wait_worker("steady", self.client)
        for s in self.serves.values():
            s.wait_ready()
        self.say(f"all sides up in {time.monotonic() - t0:.0f} s")
        self.meter.add("redis", self.rds.proc.pid, children=False)
        self.meter.add("api", self.vigil.api.pid)
        self.meter.add("worker", self.vigil.workers["steady"].pid)
        for kind, s in self.serves.items():
            self.meter.add(kind, s.proc.pid)
        self.meter.add("client", os.getpid(), children=False)
        for side in self.sides():  # warm-up: first-request costs out of the figures
            time.sleep(SETTLE_S)
            self.level(side, -1, 4, 8, min(16, self.a.tokens))

    def sides(self) -> list[str]:
        """The sides of a round: vigil, then the baselines."""
        return ["vigil"] + list(self.serves)

    def endpoint(self, side: str):
        """What a side's client talks to (its url and headers)."""
        return (self.vigil if side == "vigil" else self.serves[side])

    def level(self, side: str, round_no: int, level: int, n: int, tokens: int):
        """One segment: `n` streams at concurrency `level` on `side`."""
        ep = self.endpoint(side)
        tag = f"r{round_no}-{side}-c{level}-{time.strftime('%H%M%S')}"
        items = [(f"{tag}-{i}", body(p, tokens))
                 for i, p in enumerate(prompts(round_no, level, n))]
        return asyncio.run(run_level(ep.url, ep.headers, items, level))

    def rounds(self) -> None:
        """Every round: each side at each concurrency, the first side rotating."""
        a = self.a
        for r in range(a.rounds):
            order = self.sides()
            k = r % len(order)
            order = order[k:] + order[:k]
            for side in order:
                for level in LEVELS:
                    n = a.single if level == 1 else a.waves * level
                    self.quiet(side)
                    c0, e0 = (self.counters(), self.engine()) if side == "vigil" else (None, None)
                    spies = (self.spy() if a.profile and side == "vigil" and level == LEVELS[-1]
                             and r == a.rounds - 1 else [])
                    cpu0, sys0, t0 = self.meter.snapshot(), psutil.cpu_times(), time.monotonic()
                    streams, wall = self.level(side, r, level, n, a.tokens)
                    cpu = self.meter.diff(cpu0, self.meter.snapshot(), time.monotonic() - t0)
                    cpu["OTHER"] = other(sys0, psutil.cpu_times(), cpu)
                    c1, e1 = (self.counters(), self.engine()) if side == "vigil" else (None, None)
                    line = self.report.add(side, level, r, streams, wall, c0, c1, cpu)
                    if e0 is not None:
                        steps, outs = e1[0] - e0[0], e1[1] - e0[1]
                        line += (f"; engine {steps / wall:.0f} steps/s, batch "
                                 f"{outs / max(1, steps):.1f}")
                    self.say(f"  round {r + 1} {line}; cpu {_fmt_cpu(cpu)}")
                    self.spied(spies, sum(len(x.token_ids) for x in streams))

    def engine(self) -> tuple[float, float]:
        """The steady worker's engine steps and request outputs so far (its /metrics)."""
        m = self.vigil.metrics("steady")
        return m.get("vigil_engine_steps_total", 0.0), m.get("vigil_engine_step_outputs_total",
                                                              0.0)

    def quiet(self, side: str, timeout: float = 20.0) -> None:
        """Before a segment of `side`: wait until the other sides' processes are idle (vLLM's
        engine busy-polls for a while after its last step), at least SETTLE_S."""
        time.sleep(SETTLE_S)
        others = [k for k in self.meter.roots if k not in ("client", "redis")
                  and not (side == "vigil" and k in ("api", "worker")) and k != side]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before, t0 = self.meter.snapshot(), time.monotonic()
            time.sleep(0.5)
            busy = self.meter.diff(before, self.meter.snapshot(), time.monotonic() - t0)
            if sum(v for k, v in busy.items() if k.split("/")[0] in others) < 5.0:
                return
        self.say(f"  (the other sides were still busy after {timeout:.0f} s)")

    def spy(self, seconds: int = 5, rate: int = 100) -> list:
        """py-spy recording the gateway and the worker's main process for `seconds` (started
        now, in the background; raw collapsed stacks, idle frames left out)."""
        from bench.profile_worker import _py_spy

        out = []
        for label, proc in (("vigil api", self.vigil.api),
                            ("worker main process", self.vigil.workers["steady"])):
            raw = self.tmp / f"spy-{label.split()[-1]}.txt"
            out.append((label, raw, rate, subprocess.Popen(
                [_py_spy(), "record", "--pid", str(proc.pid), "--duration", str(seconds),
                 "--rate", str(rate), "--format", "raw", "--threads", "--nonblocking",
                 "--output", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        return out

    def spied(self, spies: list, tokens: int) -> None:
        """Print each recording's top functions (bench/profile_worker.py's summary)."""
        from bench.profile_worker import summarise

        for label, raw, rate, proc in spies:
            proc.wait(timeout=60)
            if not raw.exists():
                self.say(f"  (py-spy recorded nothing for {label})")
                continue
            self.say(f"  profile of the {label} (py-spy, {rate}/s, active samples; "
                     f"{tokens} tokens in the segment):")
            for line in summarise(raw, 0, rate, 15)[1:]:
                self.say("    " + line if line else "")

    def counters(self):
        """Redis' own counters now (bench/online_redis.py `counters`)."""
        from bench.online_redis import counters

        return counters(self.client)

    def kill(self) -> None:
        """The kill under load (bench/online_kill.py) on this run's fleet."""
        from app import app  # the Celery app on this run's Redis: the control bus
        from bench.online_kill import run_kill

        self.report.kill = run_kill(self.vigil, self.client, app.vigil_ports.bus,
                                    streams=self.a.kill_streams, tokens=self.a.kill_tokens,
                                    reap_timeout=self.a.reap_timeout, say=self.say)


def other(before, after, cpu: dict[str, float]) -> float:
    """% of one core the machine was busy beyond the metered processes."""
    def busy(t):  # guest time is inside user time already
        return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq",
                                                 "steal"))

    def whole(t):
        return busy(t) + t.idle + getattr(t, "iowait", 0.0)

    used, span = busy(after) - busy(before), whole(after) - whole(before)
    cores = psutil.cpu_count() or 1
    return max(0.0, 100.0 * used / (span / cores) - sum(cpu.values())) if span else 0.0


def main(argv=None) -> int:
    """`python -m bench.online`: one run; its exit status."""
    return OnlineBench(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
