"""The benchmark's direct baseline: one vLLM AsyncLLM fed directly, in its own process.

`python -m bench.direct_engine` runs the server side (`direct_server`); `DirectEngine` is the
parent side used by bench/throughput.py. Also holds what every side of the comparison shares (the
prompts and the sampling), so a round sends the same requests through Celery and directly.
"""
from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

from bench.cpu_meter import GET_TIMEOUT_S, _tail

MODEL = "tiny-llama"
# Words the tiny model's tokenizer was trained on (app/requests/model_files.py): ~1 token per word.
WORDS = ("the a one two red blue green small large quick slow cat dog bird fish tree river "
         "mountain city house road car train ship sun moon star cloud rain snow wind fire water "
         "stone gold book page word song voice light dark day night morning evening year time "
         "runs jumps sings reads writes sees finds makes takes gives builds opens carries and or "
         "but with under over near far into from to of in on at by for is was Alice Bob Paris").split()


# -- shared by both sides -----------------------------------------------------------------------
def make_prompts(n: int, round_no: int, words: int = 10) -> list[str]:
    """`n` different ~`words`-word prompts, the same for a given round on both sides."""
    rng = random.Random(7919 * (round_no + 1))
    return [f"Request {round_no}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words - 2))
            for i in range(n)]


async def run_to_end(llm, prompt: str, max_tokens: int, request_id: str,
                     logprobs: int | None = None):
    """Run one prompt through `llm` (an AsyncLLM) to its end and return its CompletionOutput:
    the sampling every engine of the bench uses (the request defaults, `ignore_eos`, the final
    output only, as the worker asks for it), with `logprobs` top logprobs per token if given."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=None,
                        ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY,
                        logprobs=logprobs)
    final = None
    async for out in llm.generate({"prompt": prompt}, sp, request_id=request_id):
        final = out
    return final.outputs[0]


# -- the direct engine (runs in its own process: `--direct-server`) ----------------------------
def direct_server(lora: bool = True) -> int:
    """Build one AsyncLLM with the worker's own engine args (workers/engine/vllm.py,
    `engine_args`: the registry's args, its KV cache request, the LoRA lanes; `lora=False`
    leaves the lanes out), then run rounds on command.

    Protocol on stdin/stdout, one JSON object per line: {"round", "n", "max_tokens",
    optional "logprobs"} ->
    {"elapsed", "tokens", "n", "steps", "step_outputs"} (the engine's steps in the round and the
    request outputs in them, counted like the worker's: workers/engine/vllm.py, StepCounter);
    "quit" or EOF shuts the engine down. vLLM's own output goes to
    stderr (fd 1 is pointed at fd 2 before vLLM is imported; its children inherit that).
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import asyncio

    from workers.engine.step_counter import StepCounter
    from workers.engine.vllm_args import engine_args, engine_env_defaults

    engine_env_defaults()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from app.requests.models import get_registry

    spec = get_registry().get(MODEL)

    async def serve() -> None:
        args = engine_args(spec, lora=lora)
        started = time.monotonic()
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec.path, **args))
        proto.write(json.dumps({
            "ready": round(time.monotonic() - started, 1),
            "max_num_seqs": llm.vllm_config.scheduler_config.max_num_seqs,
            "args": {k: v for k, v in args.items() if k != "engine_args"}},
            default=lambda v: getattr(v, "__name__", str(v))) + "\n")  # the executor class
        steps = StepCounter(llm)  # counted as the worker's engine counts them
        loop = asyncio.get_running_loop()

        async def one(rid: str, prompt: str, max_tokens: int, logprobs: int | None) -> int:
            return len((await run_to_end(llm, prompt, max_tokens, rid, logprobs)).token_ids)

        try:
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line or line.strip() == "quit":
                    break
                cmd = json.loads(line)
                prompts = make_prompts(cmd["n"], cmd["round"])
                s0, o0 = steps.steps, steps.outputs
                t0 = time.perf_counter()
                counts = await asyncio.gather(*(
                    one(f"d{cmd['round']}-{i}-{cmd.get('logprobs')}", p, cmd["max_tokens"],
                        cmd.get("logprobs")) for i, p in enumerate(prompts)))
                elapsed = time.perf_counter() - t0
                proto.write(json.dumps({"elapsed": elapsed, "tokens": sum(counts),
                                        "n": len(counts), "steps": steps.steps - s0,
                                        "step_outputs": steps.outputs - o0}) + "\n")
        finally:
            llm.shutdown(timeout=30)

    asyncio.run(serve())
    return 0


class DirectEngine:
    """Parent side of `direct_server`: a subprocess in its own process group."""

    def __init__(self, env: dict[str, str], log_path: Path, cwd: str, lora: bool = True):
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.direct_engine", *([] if lora else ["--no-lora"])],
            env=env, cwd=cwd,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            process_group=0)
        self.log_path = log_path

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"direct engine gave no answer (exit {self.proc.poll()}); "
                           f"see {self.log_path}:\n{_tail(self.log_path)}")

    def wait_ready(self, timeout: float = 300) -> dict:
        return self._reply(timeout)

    def run_round(self, round_no: int, n: int, max_tokens: int,
                  logprobs: int | None = None) -> dict:
        self.proc.stdin.write(json.dumps({"round": round_no, "n": n, "max_tokens": max_tokens,
                                          "logprobs": logprobs}) + "\n")
        self.proc.stdin.flush()
        return self._reply(GET_TIMEOUT_S)

    def close(self, stop_process) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=40)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        stop_process(self.proc)
        self._log.close()


if __name__ == "__main__":
    sys.exit(direct_server(lora="--no-lora" not in sys.argv[1:]))
