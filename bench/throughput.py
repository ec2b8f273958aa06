"""Throughput of Vigil (Celery + Redis + one warm AsyncLLM) against vLLM's AsyncLLM fed directly.

    python -m bench.throughput                 # full run: overhead, main 5 rounds, short 3, LoRA
    python -m bench.throughput --requests 128 --rounds 1 --skip-overhead --workloads main
    python -m bench.throughput --many --bare-celery --skip-overhead --lora-rounds 0
    python -m bench.throughput --workloads short --bare-celery --skip-overhead   # eval scoring
    python -m bench.throughput --logprobs 5    # also both sides with 5 top logprobs per token

Self-contained: a private redis-server, its own workers and engine, all stopped on exit.

Part 2 (printed first, it runs first): per-request cost of `vigil.generate` on a worker with the
instant engine (VIGIL_ENGINE=instant: no model), through `.delay` and through `generate_many`,
against a bare Celery no-op task (bench/noop_app.py) and a no-op with Vigil's Celery settings;
submit-all + get-all, the sides going first in turn, medians and spreads (bench/overhead.py).

Part 1 (the main figure): `--requests` prompts of ~10 words, `--max-tokens` tokens each
(ignore_eos, so every request is the same length), through `generate.delay` and one
`vigil worker --cpu`, against the same prompts given all at once (asyncio.gather) to an AsyncLLM
in a long-lived subprocess built from the same engine args (one function builds both:
workers/engine/vllm_args.py, `engine_args`, LoRA lanes and KV cache size included). The sides take
turns going first; the engines stay warm and an idle one costs nothing. Each round is
timed from the first submit to the last result. The summary gives each side's median and
spread, then the LoRA lanes' own cost (the direct engine with vs without them, alternating).
The last line printed is `ratio R`: the median over rounds of celery req/s / direct req/s (the
main workload's; the short one's when it runs alone).

`--many` adds a side to the main workload: the same requests through `generate_many`
(VIGIL_REQUESTS_PER_MESSAGE requests per Celery message, one call per round: all of them reach
the worker's engine at once, as on the direct side), with `many/direct` (and `many/bare`).

The short workload (`--workloads`, by default after the main one, on the same warm engines):
`--short-requests` (4,096) prompts x `--short-max-tokens` (1) with `--short-logprobs` (5) top
logprobs per token, asked by every side alike: `.delay`, direct, `generate_many` and, with
`--bare-celery`, bare Celery. Eval scoring: one engine step per request, so what feeds the engine
sets the pace.

`--logprobs K` adds two sides to each round of the main workload, the same requests with K top
logprobs per token through Celery and directly: `with/without` is what logprobs cost each side
(vLLM computing and the front end converting them; Vigil also turning them into JSON entries,
storing and returning them), `celery/direct with logprobs` the ratio under that load.

`--bare-celery` adds a side to each round: a bare Celery worker with a warm AsyncLLM in a
process global, the same engine args, Celery's defaults and nothing of Vigil
(bench/bare_engine_app.py). It is what a team runs before Vigil, so `bare/direct` is what Celery
feeding an engine reaches on these cores at all, and `celery/bare` is what Vigil's promises cost
on top of it.

Each measured segment also reports the CPU used by each process (psutil), as % of one core over
the segment's wall time: on a 2-core machine that is where the ratio is won or lost.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from app.local.embedded import free_port as _free_port
from bench.cpu_meter import CpuMeter, _tail, collect, renice_engine
from bench.direct_engine import MODEL, DirectEngine, direct_server, make_prompts
from bench.overhead import overhead
from bench.throughput_args import Workload, parse_args
from bench.throughput_report import overhead_summary, summary_lines, worker_kv
from bench.throughput_rounds import WorkloadRounds


# -- the orchestrator -------------------------------------------------------------------------
class Bench(WorkloadRounds):
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="vigil-bench-"))
        self.cache = os.environ.get("VIGIL_CACHE_DIR") or str(self.tmp / "cache")
        port = _free_port()
        # Before anything imports `app`: the Celery app and settings are built at import.
        os.environ["VIGIL_CACHE_DIR"] = self.cache
        os.environ["VIGIL_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        from app.local import embedded

        self.emb = embedded
        self.redis = embedded.EmbeddedRedis(port=port)
        self.procs: list = []
        self.cpu = CpuMeter()
        self.cpu.add("bench", os.getpid(), children=False)

    def say(self, line: str) -> None:
        print(line, flush=True)

    # -- helpers ----------------------------------------------------------------------------
    def start_worker(self, name: str, **env: str):
        log = self.tmp / f"{name}.log"
        if self.args.redis_max_connections:
            # redis-py 8 caps a connection pool at 100 connections by default, below the
            # worker's task threads; raise the cap for Vigil's store and Celery's result backend
            # (URL query), keep the plain URL for the broker (kombu refuses the parameter).
            capped = f"{self.redis.url}?max_connections={self.args.redis_max_connections}"
            env = {"VIGIL_REDIS_URL": capped, "CELERY_RESULT_BACKEND": capped,
                   "CELERY_BROKER_URL": self.redis.url, **env}
        url = env.pop("VIGIL_REDIS_URL", self.redis.url)
        env = {"VIGIL_IDLE_CLEANUP": "0", **env}  # the engine stays warm between rounds
        if not self.args.worker_loglevel:
            proc = self.emb.start_worker(url, f"{name}@%h", log, concurrency=self.args.concurrency,
                                         pools=MODEL, **env)
        else:  # app.local.embedded.start_worker has no log level: the same command, spelled out
            argv = [sys.executable, "-m", "app.ops.cli", "worker", "--cpu", "--name", f"{name}@%h",
                    "--concurrency", str(self.args.concurrency), "--pools", MODEL,
                    "--loglevel", self.args.worker_loglevel]
            proc = self.emb.start_process(argv, self.emb.vigil_env(url, **env), log)
        self.procs.append(proc)
        return proc, log

    def submit_all(self, task, kwargs_list: list[dict]) -> list:
        """`task.delay(**kw)` for each; from `--submit-threads` threads when above 1 (the
        results are rebound to this thread's backend, which is thread-local in Celery)."""
        n = self.args.submit_threads
        if n <= 1:
            return [task.delay(**kw) for kw in kwargs_list]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n) as ex:
            ids = list(ex.map(lambda kw: task.delay(**kw).id, kwargs_list))
        return [task.AsyncResult(i) for i in ids]

    def wait_engine(self, r, name: str, proc, log: Path, timeout: float = 300) -> bytes:
        """The worker's registry key once its engine is loaded (`engine_loads` >= 1)."""
        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited ({proc.returncode}):\n{_tail(log)}")
            for key in r.scan_iter("vigil:worker:*"):
                h = r.hgetall(key)
                if (h.get(b"name", b"").decode().startswith(name + "@")
                        and int(h.get(b"engine_loads", 0) or 0) >= 1
                        and h.get(b"engine_state") == b"ready"):
                    return key
            return None
        return self.emb.wait_for(ready, timeout, interval=0.2, what=f"{name}'s engine")

    def measure(self, fn):
        # vLLM's model process busy-polls its input for 1 s after its last step
        # (shm_broadcast.SpinCondition); let the engine that just ran go idle first, since both
        # engines' model processes share a core.
        time.sleep(self.args.settle)
        import psutil

        sys0, before = psutil.cpu_times(), self.cpu.snapshot()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        sys1, after = psutil.cpu_times(), self.cpu.snapshot()
        cpu = CpuMeter.diff(before, after, wall)
        # Everything else on the machine (other users' processes, the kernel): a noisy
        # neighbour shows here, and in `steal` on a VM.
        busy = sum(getattr(sys1, f) - getattr(sys0, f) for f in
                   ("user", "nice", "system", "irq", "softirq") if hasattr(sys1, f))
        cpu["OTHER"] = max(0.0, 100.0 * busy / wall - sum(cpu.values()))
        if hasattr(sys1, "steal"):
            cpu["steal"] = 100.0 * (sys1.steal - sys0.steal) / wall
        return wall, out, cpu

    # -- part 1 and the short workload (their rounds: bench/throughput_rounds.py) ----------
    def workloads(self) -> list[Workload]:
        """What this run measures, in order (`--workloads`): the main workload (`--requests` x
        `--max-tokens`) and the short one (`--short-requests` x `--short-max-tokens` with
        `--short-logprobs` top logprobs on every side)."""
        a = self.args
        out = []
        for name in a.workloads.split(","):
            if name == "main":
                sides = ["celery", "direct"] + (["many"] if a.many else []) + (
                    ["bare"] if a.bare_celery else []) + (
                    ["celery+lp", "direct+lp"] if a.logprobs is not None else [])
                out.append(Workload("main", a.requests, a.max_tokens, None, a.rounds, 0, sides))
            elif name == "short":
                sides = ["celery", "direct", "many"] + (["bare"] if a.bare_celery else [])
                out.append(Workload("short", a.short_requests, a.short_max_tokens,
                                    a.short_logprobs, a.short_rounds, 100, sides))
            else:
                raise SystemExit(f"--workloads: unknown workload {name!r} (main, short)")
        return out

    def throughput(self) -> dict[str, dict]:
        """Every workload of `workloads()` on one set of warm engines (the Vigil worker, the
        direct engine and, with `--bare-celery`, the bare worker): {workload name: figures}."""
        a = self.args
        metrics_port = _free_port()
        worker, wlog = self.start_worker("bench-cpu", VIGIL_METRICS_PORT=str(metrics_port),
                                         VIGIL_METRICS_ADDRESS="127.0.0.1")
        direct = DirectEngine(self.emb.vigil_env(self.redis.url), self.tmp / "direct.log",
                              str(self.emb.REPO))
        self.procs.append(direct.proc)
        bare = None
        if a.bare_celery:  # imported here: its app module reads the environment set above
            from bench.bare_celery import BareCelery

            bare = BareCelery(self.emb, self.redis.url, self.tmp / "bare.log", a.concurrency)
            self.procs.append(bare.proc)
        r = redis.Redis.from_url(self.redis.url)
        out: dict[str, dict] = {}
        try:
            t0 = time.monotonic()
            info = direct.wait_ready()
            wkey = self.wait_engine(r, "bench-cpu", worker, wlog)
            if a.renice_engine:
                n_w = renice_engine(worker.pid, a.renice_engine)
                n_d = renice_engine(direct.proc.pid, a.renice_engine)
                self.say(f"EXPERIMENT: engine processes reniced to {a.renice_engine} "
                         f"({n_w} worker-side threads, {n_d} direct-side threads)")
            self.say(f"engines ready after {time.monotonic() - t0:.0f} s (direct AsyncLLM built "
                     f"in {info['ready']} s, max_num_seqs {info['max_num_seqs']}); worker "
                     f"concurrency {a.concurrency}")
            self.say(f"engine args, both sides (workers/engine/vllm_args.py engine_args): "
                     f"{info['args']}; the worker's KV cache: {worker_kv(wlog)}")
            # warm-up: one small round each (first steps, connections, thread start-up)
            from tasks.inference import generate

            warm = make_prompts(128, 999)
            collect([generate.delay(model=MODEL, prompt=p, max_tokens=8, ignore_eos=True)
                     for p in warm])
            direct.run_round(999, len(warm), 8)
            if any("many" in w.sides for w in self.workloads()):
                from tasks.inference import generate_many

                collect(generate_many([dict(model=MODEL, prompt=p, max_tokens=8,
                                            ignore_eos=True) for p in warm]))
            if bare:
                bare.warm(warm, 8)
                self.cpu.add("bare", bare.proc.pid)
            self.cpu.add("redis", self.redis.proc.pid)
            self.cpu.add("worker", worker.pid)
            self.cpu.add("direct", direct.proc.pid)
            for w in self.workloads():
                self.say(f"-- workload {w.describe()}: sides {', '.join(w.sides)} --")
                out[w.name] = self._workload(w, metrics_port, direct, bare)
            for label in ("worker", "direct", "bare"):
                self.cpu.remove(label)
            h = {k.decode(): v.decode() for k, v in r.hgetall(wkey).items()}
            self.say(f"worker engine: peak_in_flight {h.get('peak_in_flight')}, served "
                     f"{h.get('served')}, engine_loads {h.get('engine_loads')}")
        finally:
            direct.close(self.emb.stop_process)
            self.emb.stop_process(worker)
            if bare:
                self.emb.stop_process(bare.proc)
        if a.lora_rounds and "main" in out:
            out["main"]["lora"] = self.lora_cost()
        return out

    # -- the whole run ----------------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        summary: list[str] = []
        try:
            self.redis.start()
            from app.requests.model_files import is_built
            from app.requests.models import get_registry

            path = get_registry().get(MODEL).path
            if not is_built(path):  # once, here: two engines building it at once would race
                subprocess.run([sys.executable, "-m", "app.ops.cli", "model", "build-tiny", path],
                               check=True, env=self.emb.vigil_env(self.redis.url),
                               cwd=str(self.emb.REPO), stdout=subprocess.DEVNULL)
            self.say(f"vigil bench {time.strftime('%Y-%m-%d %H:%M')}: {os.cpu_count()} CPUs, "
                     f"logs in {self.tmp}")
            if not a.skip_overhead:
                summary += overhead_summary(overhead(self))
            ratio = None
            if not a.skip_throughput:
                t = self.throughput()
                for w in self.workloads():
                    summary += summary_lines(w, t[w.name], a)
                first = t.get("main") or next(iter(t.values()))
                ratio = statistics.median(first["ratios"])
            self.say("-- summary --")
            for line in summary:
                self.say(line)
            if ratio is not None:
                self.say(f"ratio {ratio:.2f}")
            return 0
        finally:
            stop_all(self.emb, list(reversed(self.procs)), self.redis, self.tmp, a.keep_logs)


def stop_all(emb, procs: list, redis, tmp: Path, keep_logs: bool) -> None:
    """A bench's end: every process it started (in order), its Redis, and its temp dir unless
    the logs are kept (the model cache lives there too unless VIGIL_CACHE_DIR was given)."""
    for proc in procs:
        emb.stop_process(proc)
    redis.stop()
    if not keep_logs:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _one_session() -> None:
    """EXPERIMENT (--one-session): start every child in a new process group of *this* session
    instead of a new session, so that all of them share one scheduler autogroup
    (/proc/sys/kernel/sched_autogroup_enabled). Process groups are kept: stop_process still works."""
    popen = subprocess.Popen

    class Popen(popen):
        def __init__(self, *a, **kw):
            if kw.pop("start_new_session", False):
                kw["process_group"] = 0
            super().__init__(*a, **kw)

    subprocess.Popen = Popen


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.direct_server:
        return direct_server()
    if args.one_session:
        _one_session()
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
