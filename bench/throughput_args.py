"""bench/throughput.py's command line and its workloads (`python -m bench.throughput --help`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

# The first line of bench/throughput.py's docstring: what `--help` says the bench does.
DESCRIPTION = ("Throughput of Vigil (Celery + Redis + one warm AsyncLLM) against vLLM's AsyncLLM "
               "fed directly.")


@dataclass(frozen=True)
class Workload:
    """One workload of part 1: `requests` prompts x `max_tokens` tokens (ignore_eos), every
    side asking `logprobs` top logprobs per token (None: none), `rounds` rounds with the sides
    going first in turn, prompts seeded from `round_base` + the round."""

    name: str
    requests: int
    max_tokens: int
    logprobs: int | None
    rounds: int
    round_base: int
    sides: list[str]

    def describe(self) -> str:
        lp = "" if self.logprobs is None else f", logprobs={self.logprobs}"
        return f"{self.name}: {self.requests} req x {self.max_tokens} tokens{lp}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.throughput", description=DESCRIPTION)
    p.add_argument("--requests", type=int, default=512, help="requests per round (part 1)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds per side, alternating which goes first (part 1)")
    p.add_argument("--lora-rounds", type=int, default=3,
                   help="rounds of the direct engine with vs without LoRA lanes (0: skip)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (part 1)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="two more sides each round (part 1): celery and direct with K top "
                        "logprobs per token, so the cost of logprobs is measured in the same run")
    p.add_argument("--concurrency", type=int, default=160,
                   help="worker threads (the engine's max_num_seqs is 128 on the CPU)")
    p.add_argument("--overhead-requests", type=int, default=2000, help="requests per side (part 2)")
    p.add_argument("--overhead-rounds", type=int, default=2, help="rounds per side (part 2)")
    p.add_argument("--redis-max-connections", type=int, default=0, metavar="N",
                   help="raise the worker's Redis connection-pool cap to N (redis-py 8 "
                        "defaults to 100, below --concurrency); 0 = stock configuration")
    p.add_argument("--submit-threads", type=int, default=1, metavar="N",
                   help="producer threads calling generate.delay in part 1 (default 1)")
    p.add_argument("--worker-loglevel", default=None,
                   help="the Vigil worker's --loglevel (default: vigil worker's, "
                        "VIGIL_LOG_LEVEL or INFO)")
    p.add_argument("--renice-engine", type=int, default=0, metavar="N",
                   help="EXPERIMENT: nice the vLLM EngineCore/worker processes of both sides "
                        "to N (validates a suggested fix; not what Vigil does today)")
    p.add_argument("--one-session", action="store_true",
                   help="EXPERIMENT: keep every child in this session (one scheduler autogroup) "
                        "instead of app.local.embedded's one session per process")
    p.add_argument("--many", action="store_true",
                   help="one more side in the main workload: the same requests through "
                        "generate_many (VIGIL_REQUESTS_PER_MESSAGE requests per Celery message: "
                        "app/requests/submit.py); the short workload always has it")
    p.add_argument("--workloads", default="main,short",
                   help="comma-separated, in order: main (--requests x --max-tokens) and short "
                        "(--short-requests x --short-max-tokens, --short-logprobs on every side)")
    p.add_argument("--short-requests", type=int, default=4096, help="requests per round (short)")
    p.add_argument("--short-max-tokens", type=int, default=1, help="tokens per request (short)")
    p.add_argument("--short-logprobs", type=int, default=5, metavar="K",
                   help="top logprobs per token on every side of the short workload "
                        "(-1: none)")
    p.add_argument("--short-rounds", type=int, default=3, help="rounds per side (short)")
    p.add_argument("--bare-celery", action="store_true",
                   help="a third side: a bare Celery worker with a warm vLLM engine in a process "
                        "global (bench/bare_engine_app.py), what Celery alone reaches here")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds of quiet before each measured segment")
    p.add_argument("--skip-overhead", action="store_true", help="skip part 2")
    p.add_argument("--skip-throughput", action="store_true", help="skip part 1 (every workload)")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    p.add_argument("--direct-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.short_logprobs is not None and args.short_logprobs < 0:
        args.short_logprobs = None
    return args
