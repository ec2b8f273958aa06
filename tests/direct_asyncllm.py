"""A witness outside Vigil: run requests on a vLLM AsyncLLM built directly from
workers/engine/vllm_args.py's `engine_args` (the recipe the worker's engine uses), with
SamplingParams written here by hand rather than by Vigil's mapping, and print vLLM's raw
answer as JSON (tests/test_generation_contract_e2e.py compares it with Vigil's result).

    python tests/direct_asyncllm.py MODEL REQUESTS_JSON   # prints one JSON line per request

REQUESTS_JSON: a list of {"prompt_token_ids": [...], "sampling": {SamplingParams kwargs}}.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys


def _positions(lps) -> list | None:
    """vLLM's list of {id: Logprob} as [[[id, logprob, rank, decoded], ...] | None, ...]."""
    if lps is None:
        return None
    return [None if p is None else [[i, v.logprob, v.rank, v.decoded_token] for i, v in p.items()]
            for p in lps]


async def main(model: str, requests: list[dict]) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.requests.model_files import ensure_model_files
    from app.requests.models import get_registry
    from workers.engine.vllm_args import engine_args, engine_env_defaults

    engine_env_defaults()
    spec = get_registry().get(model)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=ensure_model_files(spec),
                                                    **engine_args(spec)))
    try:
        for n, r in enumerate(requests):
            params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **r["sampling"])
            final = None
            async for out in llm.generate({"prompt_token_ids": r["prompt_token_ids"]}, params,
                                          request_id=f"direct-{n}"):
                final = out
            print(json.dumps({
                "prompt_token_ids": list(final.prompt_token_ids),
                "prompt_logprobs": _positions(final.prompt_logprobs),
                "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                             "cumulative_logprob": c.cumulative_logprob,
                             "finish_reason": c.finish_reason,
                             "logprobs": _positions(c.logprobs)} for c in final.outputs],
            }), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
