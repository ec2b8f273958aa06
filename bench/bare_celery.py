"""Parent side of the bare Celery + vLLM worker (bench/bare_engine_app.py): start it, warm it,
run a round through it, read its engine's steps."""
from __future__ import annotations

from pathlib import Path

from bench.bare_engine_app import QUEUE, make_app, vigil_conf
from bench.celery_stock import stock_worker_argv
from bench.cpu_meter import GET_TIMEOUT_S, collect
from bench.step_meter import Steps


class BareCelery:
    """One `celery worker` of the bare app, `concurrency` threads, in its own process group."""

    def __init__(self, emb, redis_url: str, log: Path, concurrency: int):
        argv = stock_worker_argv("bench.bare_engine_app", QUEUE, "bench-bare@%h", concurrency,
                                 vigil_conf=vigil_conf())
        self.proc = emb.start_process(argv, emb.vigil_env(redis_url), log)
        self.log = log
        app = make_app(redis_url)
        self._generate = app.tasks["bench.bare_generate"]
        self._steps = app.tasks["bench.bare_steps"]

    def warm(self, prompts: list[str], max_tokens: int) -> None:
        """One small round: the engine is built by the first task (waits for it)."""
        _, errors = collect([self._generate.delay(p, max_tokens) for p in prompts])
        if errors:
            raise RuntimeError(f"the bare worker failed its warm-up ({errors[0]}); "
                               f"see {self.log}")

    def run_round(self, prompts: list[str], max_tokens: int,
                  logprobs: int | None = None) -> tuple[int, int, list[str]]:
        """Submit every prompt (with `logprobs` top logprobs per token if given), then wait for
        every result: (tokens, successes, errors)."""
        extra = () if logprobs is None else (logprobs,)
        values, errors = collect([self._generate.delay(p, max_tokens, *extra) for p in prompts])
        return sum(v["completion_tokens"] for v in values), len(values), errors

    def steps(self) -> Steps:
        """The engine's step counters now (subtract a reading taken before a round)."""
        got = self._steps.delay().get(timeout=GET_TIMEOUT_S)
        return Steps(got["steps"], got["outputs"])
