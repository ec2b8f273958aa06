"""Where the model runs on the CPU: inside EngineCore (Vigil's choice) or in a process of its own.

    python -m bench.engine_layout [--rounds 3] [--requests 32] [--tokens 64]

vLLM 0.32 on the CPU starts a model process below EngineCore (its "mp" executor) even for one
device; on a GPU with one device it runs the model in EngineCore itself (UniProcExecutor).
workers/engine/vllm_args.py `executor_args` asks for the GPU's layout on the CPU too. This bench
measures what that changes, with the worker's own engine args (`engine_args`, LoRA lanes
included), each layout in a fresh process (a cold import, as a worker's engine start):

- engine start: from `AsyncLLM.from_engine_args` to ready;
- memory: the resident set of the engine's processes once ready (PSS where the kernel has it);
- generation: `--requests` greedy requests of `--tokens` tokens at once, best of 3;
- the tokens: both layouts must give the same greedy tokens (a mismatch is printed and fails).

Rounds alternate which layout goes first. Printed: the median of each side per figure and the
ratio in-EngineCore / own-process. The last line is `ratio R`: the engine start's ratio.
Not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.direct_engine import MODEL, make_prompts

LAYOUTS = ("in-core", "own-process")


def measure_layout(layout: str, n: int, tokens: int) -> dict:
    """One engine in this process with `layout`; its figures and the greedy tokens."""
    import asyncio

    import psutil

    from workers.engine.vllm_args import engine_args, engine_env_defaults

    engine_env_defaults()
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.requests.models import get_registry

    spec = get_registry().get(MODEL)
    args = engine_args(spec)
    if layout == "own-process":
        args.pop("distributed_executor_backend", None)  # vLLM's own choice on the CPU: "mp"
    elif "distributed_executor_backend" not in args:
        raise SystemExit("engine_args does not put the model in EngineCore on this host")
    t0 = time.monotonic()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec.path, **args))
    start_s = time.monotonic() - t0
    procs = [p for p in psutil.Process().children(recursive=True)
             if "resource_tracker" not in " ".join(p.cmdline())]

    def memory(p) -> int:
        try:
            full = p.memory_full_info()
            return getattr(full, "pss", 0) or full.rss
        except psutil.Error:
            return 0

    engine_bytes = sum(memory(p) for p in procs)

    async def run() -> tuple[float, list[list[int]]]:
        counter = iter(range(10**9))

        async def one(prompt: str) -> list[int]:
            sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
            final = None
            async for out in llm.generate({"prompt": prompt}, sp, request_id=f"r{next(counter)}"):
                final = out
            return list(final.outputs[0].token_ids)

        best, outs = float("inf"), []
        for _ in range(3):
            t = time.perf_counter()
            outs = await asyncio.gather(*(one(p) for p in make_prompts(n, 0)))
            best = min(best, time.perf_counter() - t)
        return best, outs

    try:
        gen_s, outs = asyncio.run(run())
    finally:
        llm.shutdown(timeout=30)
    return {"layout": layout, "start_s": start_s, "gen_s": gen_s, "processes": len(procs),
            "engine_mib": engine_bytes / 2**20, "tokens": outs}


def _child(layout: str, n: int, tokens: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.engine_layout", "--child", layout,
                          "--requests", str(n), "--tokens", str(tokens)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{layout} run failed (exit {out.returncode})")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_layout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--child", choices=LAYOUTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.environ.setdefault("VIGIL_CACHE_DIR", tempfile.mkdtemp(prefix="vigil-layout-"))
    if a.child:
        # vLLM logs to stdout too: the figures go on a line of their own, last.
        print(json.dumps(measure_layout(a.child, a.requests, a.tokens)), flush=True)
        return 0
    from app.requests.model_files import ensure_model_files
    from app.requests.models import get_registry

    ensure_model_files(get_registry().get(MODEL))  # builds tiny-llama on first use
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    runs: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
    mismatches = 0
    for r in range(a.rounds):
        order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
        got = {k: _child(k, a.requests, a.tokens, env) for k in order}
        same = got["in-core"]["tokens"] == got["own-process"]["tokens"]
        mismatches += not same
        for k in LAYOUTS:
            runs[k].append(got[k])
        print(f"round {r + 1} ({order[0]} first): " + "; ".join(
            f"{k} start {got[k]['start_s']:.1f} s, gen {got[k]['gen_s']:.2f} s, "
            f"{got[k]['processes']} processes, {got[k]['engine_mib']:.0f} MiB" for k in LAYOUTS)
            + f"; tokens {'identical' if same else 'DIFFER'}", flush=True)

    def med(k: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[k])

    print(f"{'':22s}{'in-core':>10s}{'own-process':>13s}{'ratio':>8s}")
    for field, label in (("start_s", "engine start (s)"), ("gen_s", "generation (s)"),
                         ("engine_mib", "engine memory (MiB)")):
        i, o = med("in-core", field), med("own-process", field)
        print(f"{label:22s}{i:>10.2f}{o:>13.2f}{i / o:>8.2f}")
    print(f"{a.rounds} rounds, {a.requests} greedy requests x {a.tokens} tokens; "
          f"greedy tokens differ in {mismatches} of {a.rounds} rounds")
    print(f"ratio {med('in-core', 'start_s') / med('own-process', 'start_s'):.2f}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
