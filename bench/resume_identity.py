"""Does a greedy generation resumed from its own prefix come out token-identical? (tiny-llama)

    python -m bench.resume_identity [--prompts 64] [--tokens 256] [--cuts 0.25,0.5,0.75]

A fact for resuming a request from the tokens a dead attempt generated (continuing with the
prompt's token ids + the generated prefix as the new prompt, `max_tokens` reduced by the prefix):
the continuation is computed by a prefill over the prefix, where the uninterrupted run computed
the same positions one decode step at a time, in other batches; floating-point sums in another
order can turn a near-tie of the greedy choice the other way.

One vLLM engine on the worker's own args (workers/engine/vllm_args.py `engine_args`, no LoRA lanes),
in this process, with the prefix cache off (a resume runs on another worker: a cold cache). `--prompts` different prompts run greedy (temperature 0, `ignore_eos`) for
`--tokens` tokens, all at once (a busy engine's batch); then, as the baseline of the same run, the
same requests again, all at once: how often a plain rerun is token-identical. Then for each cut
c, every request again from prompt + its first c x tokens, all at once: how often the
continuation equals the original's remaining tokens, and where the first difference falls. The
last line is `ratio R` = identical resumes / identical reruns (1: resuming costs no identity the
engine keeps across runs).

Not part of `make test`. tiny-llama's weights are random (app/requests/model_files.py), so its next
token is often a near-tie: expect more flips than a trained model shows.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

from bench.direct_engine import MODEL, make_prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def measure(n: int, tokens: int, cuts: list[float], say) -> float:
    """Run the three phases on one engine and print the table; returns the ratio."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.requests.models import get_registry
    from workers.engine.vllm_args import engine_args

    spec = get_registry().get(MODEL)
    # No prefix cache: a resume lands on another worker, whose cache does not hold the prefix, so
    # every resumed prefix is computed by a prefill here too (with the cache on, the blocks the
    # first run computed by decoding would be reused as they are).
    args = {**engine_args(spec, lora=False), "enable_prefix_caching": False}
    t0 = time.monotonic()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec.path, **args))
    say(f"engine ready in {time.monotonic() - t0:.1f} s; args {args}")
    counter = iter(range(10**9))

    async def one(prompt, max_tokens: int) -> tuple[list[int], list[int]]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in llm.generate(prompt, sp, request_id=f"r{next(counter)}"):
            final = out
        return list(final.prompt_token_ids), list(final.outputs[0].token_ids)

    try:
        prompts = make_prompts(n, 0)
        first = await asyncio.gather(*(one({"prompt": p}, tokens) for p in prompts))
        again = await asyncio.gather(*(one({"prompt_token_ids": ids}, tokens) for ids, _ in first))
        rerun_same = sum(g == g2 for (_, g), (_, g2) in zip(first, again))
        say(f"{'':14s}{'identical':>12s}{'first difference (tokens after the cut)':>42s}")
        say(f"{'rerun':14s}{rerun_same:>6d}/{n:<5d}"
            f"{_where([first_difference(g, g2) for (_, g), (_, g2) in zip(first, again)]):>42s}")
        resumed_same = resumed_all = 0
        for c in cuts:
            k = int(c * tokens)
            outs = await asyncio.gather(*(one({"prompt_token_ids": ids + g[:k]}, tokens - k)
                                          for ids, g in first))
            diffs = [first_difference(g[k:], cont) for (_, g), (_, cont) in zip(first, outs)]
            same = sum(d is None for d in diffs)
            resumed_same += same
            resumed_all += n
            say(f"{f'resume at {k}':14s}{same:>6d}/{n:<5d}{_where(diffs):>42s}")
    finally:
        llm.shutdown(timeout=30)
    base = rerun_same / n
    ratio = (resumed_same / resumed_all) / base if base else 0.0
    say(f"greedy, {n} prompts x {tokens} tokens, all at once each phase; batch-invariant mode: "
        f"{os.environ.get('VLLM_BATCH_INVARIANT', '0')}")
    return ratio


def _where(diffs: list[int | None]) -> str:
    hits = [d for d in diffs if d is not None]
    if not hits:
        return "-"
    return f"median {statistics.median(hits):.0f}, min {min(hits)}, max {max(hits)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.resume_identity")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--cuts", default="0.25,0.5,0.75", help="fractions of --tokens to resume at")
    a = p.parse_args(argv)
    os.environ.setdefault("VIGIL_CACHE_DIR", tempfile.mkdtemp(prefix="vigil-resume-"))
    from app.requests.model_files import ensure_model_files
    from app.requests.models import get_registry
    from workers.engine.vllm_args import engine_env_defaults

    ensure_model_files(get_registry().get(MODEL))  # builds tiny-llama on first use
    engine_env_defaults()
    ratio = asyncio.run(measure(a.prompts, a.tokens, [float(x) for x in a.cuts.split(",")],
                                lambda line: print(line, flush=True)))
    print(f"ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
