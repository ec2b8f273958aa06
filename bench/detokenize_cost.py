"""What `detokenize=False` saves: the same requests on one vLLM AsyncLLM, detokenized or not.

    python -m bench.detokenize_cost                      # 256 x 128 tokens, 4 rounds per side
    python -m bench.detokenize_cost --logprobs 5         # with 5 top logprobs per token

One AsyncLLM built in this process from the worker's own recipe (workers/engine/vllm_args.py
`engine_args`, as the worker and bench/direct_engine.py build theirs), so this process is what a
worker's main process is to its engine: vLLM's front end (the output handler, the incremental
detokenizer, the logprobs processor) runs here, and the model in the EngineCore process. Each
round runs `--requests` prompts (bench/direct_engine.py `make_prompts`, ~10 words) of
`--max-tokens` tokens (`ignore_eos`, temperature 1, FINAL_ONLY outputs as the worker asks for
them) all at once, once with `detokenize=True` and once with `detokenize=False` (the only
difference), the two sides taking turns going first, after a settle pause (EngineCore busy-polls
for 1 s after its last step). It prints, per side, requests per second and this process' CPU
per request (the front end's cost, which `detokenize=False` cuts), the EngineCore's CPU per
request, and other processes' CPU over the round (`other`: anything else on the machine).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import psutil

from bench.cpu_meter import CpuMeter
from bench.direct_engine import MODEL, make_prompts


def _busy_s() -> float:
    """CPU seconds the whole machine spent busy so far."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


async def _round(llm, prompts: list[str], max_tokens: int, detokenize: bool,
                 logprobs: int | None, tag: str) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    meter = CpuMeter()
    meter.add("front", os.getpid())  # this process, and EngineCore below it
    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY, detokenize=detokenize,
                        logprobs=logprobs)

    async def one(i: int, prompt: str):
        final = None
        async for out in llm.generate({"prompt": prompt}, sp, request_id=f"{tag}-{i}"):
            final = out
        return final.outputs[0]

    busy0, before, t0 = _busy_s(), meter.snapshot(), time.perf_counter()
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    pct = CpuMeter.diff(before, meter.snapshot(), wall)  # % of one core, per process kind
    mine = pct.pop("front", 0.0) * wall / 100
    cores = sum(pct.values()) * wall / 100
    other = max(0.0, _busy_s() - busy0 - mine - cores)
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == len(prompts) * max_tokens
    if not detokenize:
        assert all(o.text == "" for o in outs)
    n = len(prompts)
    return {"rps": n / wall, "tps": tokens / wall, "front_ms": 1000 * mine / n,
            "core_ms": 1000 * cores / n, "other_pct": 100 * other / wall}


def _summary(rows: list[dict], key: str) -> str:
    vals = [r[key] for r in rows]
    return f"{statistics.median(vals):8.1f} ({min(vals):.1f}-{max(vals):.1f})"


async def main(requests: int, max_tokens: int, rounds: int, logprobs: int | None,
               settle: float) -> None:
    """Build the engine, warm it up, run `rounds` rounds per side and print the figures."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.requests.model_files import ensure_model_files
    from app.requests.models import get_registry
    from workers.engine.vllm_args import engine_args, engine_env_defaults

    engine_env_defaults()
    spec = get_registry().get(MODEL)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=ensure_model_files(spec),
                                                    **engine_args(spec)))
    sides: dict[bool, list[dict]] = {True: [], False: []}
    try:
        await _round(llm, make_prompts(32, -1), 16, True, logprobs, "warm")
        for rnd in range(rounds):
            prompts = make_prompts(requests, rnd)
            for detok in ((True, False) if rnd % 2 == 0 else (False, True)):
                await asyncio.sleep(settle)
                row = await _round(llm, prompts, max_tokens, detok, logprobs, f"r{rnd}-{detok}")
                sides[detok].append(row)
                print(f"round {rnd + 1} detokenize={str(detok):5}  {row['rps']:6.1f} req/s  "
                      f"{row['tps']:8.0f} tok/s  front end {row['front_ms']:6.2f} ms/req  "
                      f"EngineCore {row['core_ms']:6.2f} ms/req  other {row['other_pct']:4.0f}%",
                      flush=True)
    finally:
        llm.shutdown()
    print(f"\n{requests} requests x {max_tokens} tokens, logprobs={logprobs}, {rounds} rounds "
          "per side; median (min-max)")
    print(f"{'':18} {'req/s':>22} {'front end ms/req':>24} {'EngineCore ms/req':>24}")
    for detok in (True, False):
        rows = sides[detok]
        print(f"detokenize={str(detok):6} {_summary(rows, 'rps'):>22} "
              f"{_summary(rows, 'front_ms'):>24} {_summary(rows, 'core_ms'):>24}")
    on, off = sides[True], sides[False]
    ratio = [b["rps"] / a["rps"] for a, b in zip(on, off)]
    saved = [1 - b["front_ms"] / a["front_ms"] for a, b in zip(on, off)]
    print(f"off/on req/s per round: {', '.join(f'{r:.2f}' for r in ratio)} "
          f"(median {statistics.median(ratio):.2f}); front-end CPU saved per request: "
          f"{', '.join(f'{100 * s:.0f}%' for s in saved)} "
          f"(median {100 * statistics.median(saved):.0f}%)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--settle", type=float, default=2.0)
    a = ap.parse_args()
    asyncio.run(main(a.requests, a.max_tokens, a.rounds, a.logprobs, a.settle))
