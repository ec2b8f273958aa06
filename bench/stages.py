"""Where a short request's time goes, stage by stage (issue 42; docs/performance.md, "Where a
short request's time goes").

    python -m bench.stages [--sides many,single] [--requests 4096] [--logprobs 5] [--rounds 1]

One `vigil worker` (tiny-llama, the real vLLM CPU engine, concurrency 160, its metrics port
open) started through bench/stage_hooks.py, which times each stage's calls inside it, and the
direct AsyncLLM of bench/throughput.py as the same run's baseline. Per round and side the
throughput bench's short workload (`--requests` prompts x `--max-tokens` with `--logprobs`):
`generate_many` (many) or `generate.delay` (single), then the direct engine. Printed per side,
per request of the round (a stage's seconds summed over its calls, divided by the requests):

- the producer: its submit (publishing), and its waiting for the results;
- per message: Celery's consumer to a pool thread (task_received -> task_prerun), the task body;
- per round trip: BEGIN and FINISH (calls, requests per call, ms per call);
- per engine call: the hop onto the engine host's loop, the loop's time per request,
  `AsyncLLM.add_request` calls per engine step, the engine's batch per step and steps/s
  (bench/step_meter.py), vLLM's output handler (calls, outputs per call, ms);
- per thread: CPU of each of the worker's Python threads and of its native threads; the CPU of
  EngineCore, Redis and the producer;
- Redis: commands per request (INFO commandstats) and its CPU per request.

The stage timers are wall time inside a call (a Redis round trip includes waiting for the GIL
on its way back); thread CPU is what the thread ran. GIL shares per thread come from
bench/profile_worker.py (py-spy), run apart: py-spy's sampling and these timers would disturb
each other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis

from app.local.embedded import free_port
from bench.cpu_meter import collect
from bench.direct_engine import MODEL, DirectEngine, make_prompts
from bench.profile_worker import head_commit
from bench.step_meter import Steps, scrape_steps


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default="many,single", help="many (generate_many), single (.delay)")
    p.add_argument("--requests", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=160)
    p.add_argument("--no-direct", action="store_true", help="skip the direct engine baseline")
    p.add_argument("--keep-logs", action="store_true")
    return p.parse_args(argv)


def _probe(path: Path) -> dict:
    for _ in range(100):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise RuntimeError(f"no stage totals in {path}")


def _probe_after(path: Path, since: float) -> dict:
    """The probe's totals written after perf_counter time `since` (same machine clock)."""
    while True:
        snap = _probe(path)
        if snap["at"] >= since:
            return snap
        time.sleep(0.05)


def _redis_stats(r) -> tuple[dict, float]:
    cmds = {k.removeprefix("cmdstat_"): (v["calls"], v["usec"])
            for k, v in r.info("commandstats").items()}
    cpu = r.info("cpu")
    return cmds, cpu["used_cpu_user"] + cpu["used_cpu_sys"]


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for label, pid in pids.items():
        try:
            p = psutil.Process(pid)
            procs = [p] + (p.children(recursive=True) if label == "EngineCore" else [])
            out[label] = sum(sum(q.cpu_times()[:2]) for q in procs)
        except psutil.Error:
            out[label] = 0.0
    return out


def _engine_core_pid(worker_pid: int) -> int | None:
    for c in psutil.Process(worker_pid).children(recursive=True):
        if "EngineCore" in c.name() or "EngineCore" in " ".join(c.cmdline()):
            return c.pid
    kids = psutil.Process(worker_pid).children()
    return kids[0].pid if kids else None


def measure_side(side: str, prompts: list[str], a, probe: Path, r, metrics_port: int,
                 pids: dict[str, int]) -> dict:
    """One round of `side`: every figure of the module docstring, as totals over the round."""
    from tasks.inference import generate, generate_many

    items = [dict(model=MODEL, prompt=p, max_tokens=a.max_tokens, ignore_eos=True,
                  **({"logprobs": a.logprobs} if a.logprobs else {})) for p in prompts]
    time.sleep(1.5)  # the engine's model process stops busy-polling after its last step
    p0 = _probe_after(probe, time.perf_counter())
    c0, rc0 = _redis_stats(r)
    s0 = scrape_steps(metrics_port)
    cpu0 = _cpu(pids)
    t0, tc0 = time.perf_counter(), time.thread_time()
    rs = generate_many(items) if side == "many" else [generate.delay(**kw) for kw in items]
    t1, tc1 = time.perf_counter(), time.thread_time()
    values, errors = collect(rs)
    t2 = time.perf_counter()
    cpu1 = _cpu(pids)
    s1 = scrape_steps(metrics_port).over(s0, t2 - t0)
    c1, rc1 = _redis_stats(r)
    p1 = _probe_after(probe, time.perf_counter() + 0.3)
    calls = {k: [v[i] - p0["calls"].get(k, [0, 0, 0.0])[i] for i in range(3)]
             for k, v in p1["calls"].items()}
    counts = {k[1:]: v for k, v in p1["threads"].items() if k.startswith("#")}
    threads = {k: v - p0["threads"].get(k, 0.0) for k, v in p1["threads"].items()
               if not k.startswith("#")}
    threads["(native threads)"] = ((p1["process_cpu"] - p0["process_cpu"])
                                   - sum(threads.values()))
    cmds = {k: (v[0] - c0.get(k, (0, 0))[0], v[1] - c0.get(k, (0, 0))[1])
            for k, v in c1.items()}
    return {"side": side, "n": len(prompts), "ok": len(values), "errors": len(errors),
            "wall": t2 - t0, "submit": t1 - t0, "submit_cpu": tc1 - tc0, "calls": calls,
            "threads": threads, "thread_counts": counts, "steps": s1, "redis_cmds": cmds, "redis_cpu": rc1 - rc0,
            "cpu": {k: cpu1[k] - cpu0[k] for k in cpu0}}


def report(m: dict) -> list[str]:
    """The lines of one side's account, per request of the round."""
    n, wall = m["ok"] or 1, m["wall"]
    ms = lambda s: 1000.0 * s / n  # noqa: E731  seconds over the round -> ms per request
    out = [f"== {m['side']}: {m['ok']}/{m['n']} ok ({m['errors']} failed) in {wall:.2f} s = "
           f"{m['ok'] / wall:.0f} req/s; {ms(wall):.3f} ms of wall per request",
           f"  producer submit {m['submit']:.2f} s ({ms(m['submit']):.3f} ms/req, "
           f"{100 * m['submit'] / wall:.0f}% of the wall; its CPU {ms(m['submit_cpu']):.3f} "
           f"ms/req); waiting for results {wall - m['submit']:.2f} s"]
    out.append("  stage: calls, requests per call, ms per call, ms per request (sum over calls)")
    for k in sorted(m["calls"]):
        c, q, s = m["calls"][k]
        if c:
            out.append(f"    {k:55s} {c:6d} {q / c:7.1f} {1000 * s / c:9.3f} {ms(s):8.3f}")
    st: Steps = m["steps"]
    adds = m["calls"].get("vllm AsyncLLM.add_request", [0, 0, 0])[0]
    out.append(f"  engine: {st.describe()}; add_request calls per step "
               f"{adds / st.steps if st.steps else 0:.1f}")
    proc = sum(m["threads"].values())
    out.append(f"  worker CPU {ms(proc):.3f} ms/req ({100 * proc / wall:.0f}% of a core); "
               f"per thread, ms/req (share of the worker's CPU):")
    for k, v in sorted(m["threads"].items(), key=lambda kv: -kv[1]):
        if v > 0.005 * proc:
            live = m["thread_counts"].get(k)
            out.append(f"    {k:30s} {'' if live is None else f'({live} live)':>10s} "
                       f"{ms(v):7.3f}  {100 * v / proc:5.1f}%")
    out.append("  CPU per request, ms (% of a core): " + ", ".join(
        f"{k} {ms(v):.3f} ({100 * v / wall:.0f}%)" for k, v in m["cpu"].items()))
    cmds = sorted(((k, v) for k, v in m["redis_cmds"].items() if v[0]), key=lambda kv: -kv[1][0])
    out.append(f"  Redis: CPU {ms(m['redis_cpu']):.3f} ms/req; commands per request: " + ", ".join(
        f"{k} {c / n:.2f}" for k, (c, _) in cmds[:10]))
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vigil-stages-"))
    port = free_port()
    os.environ.setdefault("VIGIL_CACHE_DIR", str(tmp / "cache"))
    os.environ["VIGIL_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    from app.local import embedded

    rs = embedded.EmbeddedRedis(port=port)
    procs = []
    try:
        rs.start()
        from app.requests.model_files import is_built
        from app.requests.models import get_registry

        path = get_registry().get(MODEL).path
        if not is_built(path):
            subprocess.run([sys.executable, "-m", "app.ops.cli", "model", "build-tiny", path],
                           check=True, env=embedded.vigil_env(rs.url), cwd=str(embedded.REPO),
                           stdout=subprocess.DEVNULL)
        metrics_port, probe = free_port(), tmp / "stages.json"
        argv = [sys.executable, "-m", "bench.stage_hooks", str(probe), "worker", "--cpu",
                "--name", "stages@%h", "--concurrency", str(a.concurrency), "--pools", MODEL]
        worker = embedded.start_process(argv, embedded.vigil_env(
            rs.url, VIGIL_IDLE_CLEANUP="0", VIGIL_METRICS_PORT=str(metrics_port),
            VIGIL_METRICS_ADDRESS="127.0.0.1"), tmp / "worker.log")
        procs.append(worker)
        direct = None
        if not a.no_direct:
            direct = DirectEngine(embedded.vigil_env(rs.url), tmp / "direct.log",
                                  str(embedded.REPO))
            procs.append(direct.proc)
            direct.wait_ready()
        from tasks.inference import generate

        warm = make_prompts(64, 998)
        values, errors = collect([generate.delay(model=MODEL, prompt=p, max_tokens=a.max_tokens,
                                                 ignore_eos=True, logprobs=a.logprobs)
                                  for p in warm])
        if errors:
            raise SystemExit(f"warm-up failed: {errors[:3]}")
        if direct is not None:
            direct.run_round(998, len(warm), a.max_tokens, a.logprobs)
        pids = {"worker": worker.pid, "EngineCore": _engine_core_pid(worker.pid),
                "producer": os.getpid(), "redis": rs.proc.pid}
        r = redis.Redis.from_url(rs.url)
        print(f"vigil stages {time.strftime('%Y-%m-%d %H:%M')}, commit {head_commit()}: "
              f"{os.cpu_count()} CPUs, {a.requests} x max_tokens={a.max_tokens}, logprobs "
              f"{a.logprobs}, concurrency {a.concurrency}; logs in {tmp}", flush=True)
        for k in range(a.rounds):
            prompts = make_prompts(a.requests, 500 + k)
            for side in a.sides.split(","):
                for line in report(measure_side(side, prompts, a, probe, r, metrics_port, pids)):
                    print(line, flush=True)
            if direct is not None:
                time.sleep(1.5)
                dpids = {"front end": direct.proc.pid,
                         "EngineCore": _engine_core_pid(direct.proc.pid)}
                cpu0 = _cpu(dpids)
                reply = direct.run_round(500 + k, a.requests, a.max_tokens, a.logprobs)
                cpu = {k: v - cpu0[k] for k, v in _cpu(dpids).items()}
                st = Steps(reply["steps"], reply["step_outputs"], reply["elapsed"])
                n, wall = a.requests, reply["elapsed"]
                print(f"== direct: {n / wall:.0f} req/s ({wall:.2f} s); {st.describe()}; CPU "
                      f"per request, ms (% of a core; the round's reply included): " + ", ".join(
                          f"{k} {1000 * v / n:.3f} ({100 * v / wall:.0f}%)"
                          for k, v in cpu.items()), flush=True)
        return 0
    finally:
        for p in reversed(procs):
            embedded.stop_process(p)
        rs.stop()
        if not a.keep_logs:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
