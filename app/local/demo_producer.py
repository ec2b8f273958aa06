"""The demo's producer: a separate process that submits prompts as `generate.delay` does
(app/requests/submit.py).

Shows a progress bar while results arrive, then a summary table. Exit code 0 when every
request succeeded.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.celery_app import shared_app
from app.errors import VigilError
from app.requests.models import TINY_LLAMA, get_registry
from app.requests.submit import submit_request
from app.settings import get_settings
from app.state.store import shared_store

SUBJECTS = ["the cat", "a small robot", "the river", "Alice", "the old train", "a blue bird"]
VERBS = ["finds", "builds", "sings about", "carries", "opens", "reads"]
OBJECTS = ["a golden book", "the moon", "forty-two stones", "the city", "a quiet song"]


def prompts(n: int, seed: int = 7) -> list[str]:
    """`n` short, varied prompts (deterministic)."""
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}" for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--job", default="demo")
    a = p.parse_args(argv)
    settings, registry, store = get_settings(), get_registry(), shared_store()
    console = Console()
    started = time.monotonic()
    pending = {}
    for text in prompts(a.n):
        r = submit_request(dict(model=TINY_LLAMA, prompt=text, max_tokens=a.max_tokens,
                                job=a.job), settings=settings, registry=registry, store=store,
                           ports=shared_app().vigil_ports)
        pending[r.id] = (r, time.monotonic())
    results, failures, latencies = [], Counter(), []
    with Progress(TextColumn("[bold]generate.delay"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("requests", total=a.n)
        while pending:
            for rid, (r, t0) in list(pending.items()):
                if not r.ready():
                    continue
                del pending[rid]
                try:
                    results.append(r.get(timeout=5))
                    latencies.append(time.monotonic() - t0)
                except VigilError as e:
                    failures[e.code] += 1
                bar.advance(task)
            time.sleep(0.05)
    wall = time.monotonic() - started
    tokens = sum(x["completion_tokens"] for x in results)
    t = Table(title="Vigil demo summary")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("requests", str(a.n))
    t.add_row("succeeded", str(len(results)))
    t.add_row("failed", ", ".join(f"{k}: {v}" for k, v in failures.items()) or "0")
    t.add_row("wall time", f"{wall:.1f} s")
    t.add_row("requests/s", f"{len(results) / wall:.1f}")
    t.add_row("generated tokens/s", f"{tokens / wall:.0f}")
    if latencies:
        q = statistics.quantiles(latencies, n=20) if len(latencies) > 1 else latencies * 19
        t.add_row("latency p50 / p95", f"{statistics.median(latencies):.2f} s / {q[18]:.2f} s")
    t.add_row("attempts", ", ".join(f"{k}: {v}" for k, v in
                                    sorted(Counter(x["attempts"] for x in results).items())))
    t.add_row("workers", ", ".join(sorted({x["worker"] for x in results})))
    console.print(t)
    if results:
        console.print(f"example: [italic]{results[0]['text'][:80]!r}[/] (random weights: "
                      "gibberish is expected)")
    return 0 if len(results) == a.n else 1


if __name__ == "__main__":
    sys.exit(main())
