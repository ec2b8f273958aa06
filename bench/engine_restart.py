"""A dead engine back: what a worker's engine start and its restart after a SIGKILL are made of,
for the code under test against a baseline commit, measured in the same run.

    python -m bench.engine_restart [--baseline eb37a72] [--rounds 2] [--tokens 400]

Each side runs in a fresh process of its own (a cold import, as a worker's first start) from its
own tree: the working tree, and the baseline commit written out with `git archive` (default
eb37a72, where issue 39's GPU run was made). Rounds alternate which side goes first. A side
starts the engine the way the worker does (Vigil's engine host over the real vLLM engine from
its kind's factory, workers/engine/kinds.py, each start sized to free memory by the worker's
planner, tiny-llama with its LoRA lanes) and times:

- the first start's parts: vLLM's import in the worker; the EngineCore process spawned and
  importing vLLM again (to its first line); its config and distributed init; the model load;
  the LoRA layers; the KV cache and vLLM's warm-up ("init engine ... took"); the handshake
  back; Vigil's own warm-up of the lanes (where it runs: CUDA); the first request;
- the first and the next adapter request (another adapter each time): what compiling the LoRA
  kernels adds to a user's first adapter request;
- a restart: EngineCore SIGKILLed 0.3 s into a `--tokens` greedy request; SIGKILL -> that request
  finished on the recovered engine (`restart_s`), and its parts: the death seen, the dead engine
  shut down, the new EngineCore spawned and importing vLLM, its start's parts, the canary, the
  re-run.
  The same request's time on the warm engine is measured before the kill (`warm_run_s`), so
  `restart_s - warm_run_s` is what the restart itself costs.

The parts come from the timestamped lines vLLM and Vigil log (both at INFO, Vigil's format,
written to a file the engine's processes share), not from code of the engine's own. Printed:
the median of each side per figure, and the ratio working tree / baseline. The last line is
`ratio R`: restart_s's. Run it under the heavy-test lock (it starts engines); not part of
`make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = "eb37a72"
KILL_AFTER_S = 0.3
# Log lines that mark a part's end, by part: (process, text). The first line after the part
# began that matches ends it. `core` lines are EngineCore's; `main` lines the worker's.
MARKS = {
    "loading": ("main", "vigil.engine: loading engine for model"),
    "core_up": ("core", "Initializing a V1 LLM engine"),
    "dist_init": ("core", "world_size=1 rank=0"),
    "load_start": ("core", "Starting to load model"),
    "weights": ("core", "Loading weights took"),
    "lora": ("core", "Using PunicaWrapper"),
    "init_engine": ("core", "init engine (profile, create kv cache, warmup model) took"),
    "ready": ("main", "vigil.engine: engine for "),
    "warmed": ("main", "vigil.engine: warmed the engine"),
    "died": ("main", "vigil.engine: engine for tiny-llama died"),
    "rerun": ("main", "vigil.engine: re-running"),
}
# A start's parts, each between two marks (a missing mark: the part is left out).
START_PARTS = (("spawn_and_import", "loading", "core_up"),
               ("config_and_dist_init", "core_up", "load_start"),
               ("model_load", "load_start", "weights"), ("lora_layers", "weights", "lora"),
               ("kv_cache_and_vllm_warm_up", "lora", "init_engine"),
               ("handshake", "init_engine", "ready"), ("vigil_warm_up", "ready", "warmed"))
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/([^\]]+)\] (.*)$")


# -- one side, in a process of its own ----------------------------------------------------------
def child(tree: Path, tokens: int) -> dict:
    """Measure one side from `tree` in this process; its figures."""
    sys.path.insert(0, str(tree))
    tmp = Path(tempfile.mkdtemp(prefix="vigil-restart-"))
    log_path = tmp / "engine.log"
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(log_fd, 2)  # this process's and its engine processes' lines, into one file
    os.dup2(log_fd, 1)
    sys.stdout = sys.stderr = os.fdopen(2, "w", buffering=1)
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s: %(levelname)s/%(processName)s] %(name)s: "
                               "%(message)s")
    from app.logging_setup import configure_vllm_logging

    configure_vllm_logging(tmp / "cache", "INFO")
    from concurrent.futures import ThreadPoolExecutor

    from app.requests.adapters import AdapterRef
    from app.requests.model_files import ensure_model_files
    from app.requests.models import get_registry
    from app.requests.schemas import GenerateRequest
    from bench.gpu_engine_smoke import build_adapter
    from workers.engine.host import EngineHost, HostEvents
    from workers.engine.kinds import engine_factory
    from workers.engine.memory import plan_memory, probe_memory, worker_device
    from workers.engine.processes import engine_core_pids
    from workers.engine.vllm_args import engine_env_defaults

    r: dict = {}
    engine_env_defaults()
    t0 = time.monotonic()
    import vllm  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
    r["vllm_import"] = time.monotonic() - t0
    spec = get_registry().get("tiny-llama")
    model = Path(ensure_model_files(spec))
    adapters = [build_adapter(model, tmp / f"adapter{i}", rank=spec.max_lora_rank, seed=i)
                for i in (1, 2)]
    device = worker_device()

    class Sized(HostEvents):  # every start sized to free memory, as a worker's
        def plan_memory(self, s):
            return plan_memory(s, probe_memory(*device), 1 << 30)

    host = EngineHost(engine_factory("vllm"), idle_cleanup=0, events=Sized()).start()
    try:
        short = GenerateRequest(model=spec.name, prompt="the quick brown fox", max_tokens=16,
                                temperature=0)
        started = time.time()
        t0 = time.monotonic()
        host.generate(short, spec, "first", 600)
        r["first_start_to_result"] = time.monotonic() - t0
        r.update(_parts(_marks(log_path, started), "start_"))
        for i, a in enumerate(adapters):
            ref = AdapterRef(f"bench-adapter-{i}", str(a), spec.name)
            t0 = time.monotonic()
            host.generate(short, spec, f"lora-{i}", 600, adapter=ref)
            r[f"adapter_request_{'first' if i == 0 else 'next'}"] = time.monotonic() - t0
        long = GenerateRequest(model=spec.name, prompt="tell me a long story",
                               max_tokens=tokens, temperature=0, ignore_eos=True)
        t0 = time.monotonic()
        host.generate(long, spec, "warm-long", 600)
        r["warm_run_s"] = time.monotonic() - t0
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(host.generate, long, spec, "killed-long", 600)
            until = time.monotonic() + 60
            while host.snapshot()["in_flight"] < 1 and time.monotonic() < until:
                time.sleep(0.005)
            time.sleep(KILL_AFTER_S)
            killed_at = time.time()
            t0 = time.monotonic()
            for pid in engine_core_pids():
                os.kill(pid, 9)
            done = fut.result(timeout=600)
            r["restart_s"] = time.monotonic() - t0
            finished_at = time.time()
        r["restart_tokens"] = len(done.token_ids)
        r["restarts"] = host.stats.restarts
        m = _marks(log_path, killed_at, finished_at)
        r.update(_parts(m, "restart_"))
        for name, a, b in (("restart_death_seen", "kill", "died"),
                           ("restart_dead_engine_shutdown", "died", "loading"),
                           ("restart_canary", "ready", "rerun"),
                           ("restart_rerun", "rerun", "finished")):
            if a in m and b in m:
                r[name] = m[b] - m[a]
        if "ready" in m:
            r["restart_engine_start"] = m["ready"] - m["loading"]
    finally:
        host.shutdown(60)
    r = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
    out.write("RESULT " + json.dumps(r) + "\n")
    return r


def _marks(log_path: Path, since: float, finished: float | None = None) -> dict:
    """The first time (epoch seconds, relative to `since`) of each MARKS line logged after
    `since`; "kill" is 0 and "finished" is `finished` (now when None)."""
    found: dict = {"kill": 0.0}
    for line in log_path.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - since
        if at < -0.002:  # asctime has milliseconds
            continue
        proc = "core" if m.group(2).startswith("EngineCore") else "main"
        for name, (where, text) in MARKS.items():
            if name not in found and where == proc and text in m.group(3):
                if name == "ready" and "ready in" not in m.group(3):
                    continue
                found[name] = at
    found["finished"] = (finished or time.time()) - since
    return found


def _parts(marks: dict, prefix: str) -> dict:
    """START_PARTS between `marks` (seconds), named with `prefix`."""
    return {f"{prefix}{name}": marks[b] - marks[a] for name, a, b in START_PARTS
            if a in marks and b in marks and marks[b] >= marks[a]}


# -- the comparison -------------------------------------------------------------------------------
def write_tree(rev: str, dest: Path) -> Path:
    """Commit `rev`'s files, written out under `dest` (git archive)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_side(tree: Path, tokens: int, timeout: float = 900) -> dict:
    """One side in a fresh process; its figures (raises with its log's tail if it failed)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "VLLM_LOGGING_CONFIG_PATH",
                        "VLLM_HOST_IP", "VLLM_LOOPBACK_IP", "VIGIL_ENGINE_ERROR_LOG")}
    env["PYTHONPATH"] = str(tree)
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(tree),
                        "--tokens", str(tokens)], capture_output=True, text=True, env=env,
                       cwd=tree, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"the side from {tree} failed (exit {p.returncode}): "
                           + " | ".join((p.stdout + p.stderr).strip().splitlines()[-8:]))
    return json.loads(lines[-1][len("RESULT "):])


def commit_of_worktree() -> str:
    """HEAD's short hash, `+dirty` with local changes."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def table(base: list[dict], cur: list[dict]) -> list[str]:
    """One line per figure: the medians of both sides and their ratio."""
    keys = [k for k in cur[0] if isinstance(cur[0][k], (int, float))]
    keys += [k for k in base[0] if k not in keys and isinstance(base[0][k], (int, float))]
    lines = [f"{'figure':42} {'baseline':>9} {'this tree':>9} {'ratio':>6}"]
    for k in keys:
        b = [x[k] for x in base if k in x]
        c = [x[k] for x in cur if k in x]
        mb = statistics.median(b) if b else None
        mc = statistics.median(c) if c else None
        ratio = f"{mc / mb:6.2f}" if mb and mc is not None else "     -"
        lines.append(f"{k:42} {'-' if mb is None else f'{mb:9.3f}':>9} "
                     f"{'-' if mc is None else f'{mc:9.3f}':>9} {ratio}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(Path(a.child), a.tokens)
        return 0
    base_tree = write_tree(a.baseline, Path(tempfile.mkdtemp(prefix="vigil-baseline-")))
    print(f"engine_restart: this tree {commit_of_worktree()} against {a.baseline}; "
          f"{a.rounds} round(s), a {a.tokens}-token request killed after {KILL_AFTER_S} s; "
          f"{os.cpu_count()} cores", flush=True)
    base, cur = [], []
    for rnd in range(a.rounds):
        order = [("baseline", base_tree, base), ("this tree", REPO, cur)]
        for name, tree, into in (order if rnd % 2 == 0 else order[::-1]):
            t0 = time.monotonic()
            into.append(run_side(tree, a.tokens))
            print(f"round {rnd + 1}, {name}: {time.monotonic() - t0:.0f} s: "
                  f"{json.dumps(into[-1])}", flush=True)
    for line in table(base, cur):
        print(line)
    rb = statistics.median(x["restart_s"] for x in base)
    rc = statistics.median(x["restart_s"] for x in cur)
    print(f"ratio {rc / rb:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
