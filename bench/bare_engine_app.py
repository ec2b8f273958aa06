"""A bare Celery worker with a warm vLLM engine in a process global: what a team runs before
Vigil, and so the most that Celery feeding an engine reaches on the same cores.

Run by bench/throughput.py (`--bare-celery`, through bench/bare_celery.py) as

    python -m celery -A bench.bare_engine_app worker -P threads -c N --prefetch-multiplier 1 -Q bench.bare

with `VIGIL_REDIS_URL` naming the Redis. Celery's defaults otherwise (early ack, no events, no
retries), JSON, results in Redis; kombu's stock Redis transport. With `BENCH_BARE_PROFILE`
`vigil-conf`, the Celery settings Vigil uses instead (as bench/noop_app.py's profile of that
name: acks_late and the rest, and `-l INFO`), still none of Vigil's code. The engine is vLLM's AsyncLLM
built by the same function as the Vigil worker's and the direct engine's
(workers/engine/vllm_args.py `engine_args`), on an asyncio loop of its own thread, at the first task;
each task thread hands its prompt to that loop and blocks on the answer. Nothing else: no
records, no leases, no recovery, no token streams. Whatever fails, fails.
"""
from __future__ import annotations

import asyncio
import os
import threading
import uuid

from celery import Celery
from celery.signals import worker_shutdown

from bench.celery_stock import stock_app
from bench.direct_engine import MODEL, run_to_end

QUEUE = "bench.bare"


class WarmEngine:
    """One AsyncLLM on a loop thread, built once, by whichever task comes first."""

    def __init__(self):
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.llm = None
        self.counter = None  # workers.engine.step_counter.StepCounter

    def ready(self) -> "WarmEngine":
        """This engine, built on first use (later callers wait for the first build)."""
        with self._lock:
            if self.llm is None:
                self._build()
        return self

    def _build(self) -> None:
        from workers.engine.vllm_args import engine_env_defaults

        engine_env_defaults()  # before vLLM is imported, as the Vigil worker does
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from app.requests.models import get_registry
        from workers.engine.step_counter import StepCounter
        from workers.engine.vllm_args import engine_args

        spec = get_registry().get(MODEL)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="bare-engine-loop", daemon=True).start()

        async def build():
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec.path,
                                                            **engine_args(spec)))
            return llm, StepCounter(llm)

        self.llm, self.counter = asyncio.run_coroutine_threadsafe(build(), loop).result()
        self.loop = loop

    def generate(self, prompt: str, max_tokens: int, logprobs: int | None = None) -> dict:
        """Run one prompt to its end (the direct engine's sampling: bench/direct_engine.py),
        with `logprobs` top logprobs per token if given, returned as a team would return
        them: per token, [token id, logprob, decoded token] of each candidate."""
        out = asyncio.run_coroutine_threadsafe(
            run_to_end(self.llm, prompt, max_tokens, uuid.uuid4().hex, logprobs),
            self.loop).result()
        got = {"text": out.text, "completion_tokens": len(out.token_ids)}
        if logprobs is not None:
            got["logprobs"] = [[[tid, lp.logprob, lp.decoded_token] for tid, lp in step.items()]
                               for step in out.logprobs or []]
        return got

    def shutdown(self) -> None:
        """Stop the engine (its EngineCore process) if it was built."""
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


ENGINE = WarmEngine()


def vigil_conf() -> bool:
    """True when `BENCH_BARE_PROFILE` asks for Vigil's Celery settings (`vigil-conf`)."""
    return os.environ.get("BENCH_BARE_PROFILE", "bare") == "vigil-conf"


def make_app(redis_url: str | None = None) -> Celery:
    """The bare app (no connection is made here); `BENCH_BARE_PROFILE=vigil-conf` gives it
    Vigil's Celery settings (bench/celery_stock.py)."""
    app = stock_app("bench_bare", QUEUE, redis_url, vigil_conf=vigil_conf())
    app.task(name="bench.bare_generate")(bare_generate)
    app.task(name="bench.bare_steps")(bare_steps)
    return app


def bare_generate(prompt: str, max_tokens: int, logprobs: int | None = None) -> dict:
    """The prompt's completion from the warm engine: {"text", "completion_tokens"}, and
    "logprobs" (per token, [token id, logprob, decoded token] of each candidate) when asked."""
    return ENGINE.ready().generate(prompt, max_tokens, logprobs)


def bare_steps() -> dict:
    """The engine's steps and request outputs so far, counted as the Vigil worker counts them
    (workers/engine/vllm.py, StepCounter): {"steps", "outputs"}."""
    c = ENGINE.ready().counter
    return {"steps": c.steps, "outputs": c.outputs}


@worker_shutdown.connect
def _stop_engine(**_):
    ENGINE.shutdown()


app = make_app()
