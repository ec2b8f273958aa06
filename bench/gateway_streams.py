"""Thousands of open streams on one `vigil api` process (docs/performance.md, "The online API").

    python -m bench.gateway_streams [--streams 2000] [--max-tokens 16]

A private Redis and one `vigil api` process (no worker yet): `--streams` streamed completions
are opened at once from one asyncio client (httpx, no thread per stream) and wait, their
requests queued. Measured while they wait: the gateway's resident memory per open stream, its
CPU over 10 s of waiting, and the Redis connections it holds (Redis' own INFO clients). Then one
worker starts: every stream must complete ([DONE], no error event), and the gateway's CPU per SSE
event is measured over the run. No baseline to compare with: the figures are absolute, the
machine's load printed beside them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import redis

from app.local.embedded import (EmbeddedRedis, free_port, start_process, start_worker,
                                stop_process, vigil_env, wait_for)

TOKEN = "bench-token"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=10.0)
    return p.parse_args(argv)


async def open_streams(url: str, n: int, max_tokens: int, opened: list, done: list,
                       events: list) -> None:
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        async def one(i: int) -> None:
            body = {"model": "tiny-llama", "prompt": f"stream number {i}", "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True}
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                opened.append(r.status_code)
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(1)
                        if line == "data: [DONE]":
                            done.append(i)
                        elif '"error"' in line and json.loads(line[6:]).get("error"):
                            done.append(-1)

        await asyncio.gather(*(one(i) for i in range(n)))


def main(argv=None) -> int:
    a = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vigil-gw-bench-"))
    rds = EmbeddedRedis().start()
    client = redis.Redis.from_url(rds.url)
    port = free_port()
    api = start_process([sys.executable, "-m", "app.ops.cli", "api", "--port", str(port),
                         "--address", "127.0.0.1"],
                        vigil_env(rds.url, VIGIL_API_TOKEN=TOKEN), tmp / "api.log")
    worker = None
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ok(url), 180, 0.5, "vigil api")
        gw = psutil.Process(api.pid)
        rss0 = gw.memory_info().rss
        opened, done, events = [], [], []
        loop = asyncio.new_event_loop()
        task = loop.create_task(open_streams(url, a.streams, a.max_tokens, opened, done,
                                             events))
        t0 = time.monotonic()
        while len(opened) < a.streams and time.monotonic() - t0 < 300:
            loop.run_until_complete(asyncio.sleep(0.2))
        took = time.monotonic() - t0
        assert len(opened) == a.streams and set(opened) == {200}, set(opened)
        rss1 = gw.memory_info().rss
        cpu0 = gw.cpu_times()
        loop.run_until_complete(asyncio.sleep(a.idle_s))
        cpu1 = gw.cpu_times()
        idle_cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / a.idle_s
        conns = int(client.info("clients")["connected_clients"])
        print(f"{a.streams} open streams on one gateway process, opened in {took:.1f} s: "
              f"{(rss1 - rss0) / a.streams / 1024:.1f} KiB of RSS each "
              f"({rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB), {idle_cpu * 100:.1f}% of a core "
              f"while they wait, {conns} Redis connections in all (Redis' INFO clients)",
              flush=True)
        worker = start_worker(rds.url, "gwbench@%h", tmp / "worker.log", pools="tiny-llama",
                              concurrency=160)
        c0, e0, t1 = gw.cpu_times(), len(events), time.monotonic()
        loop.run_until_complete(asyncio.wait_for(task, 1800))
        c1, secs = gw.cpu_times(), time.monotonic() - t1
        ok = sum(1 for d in done if d >= 0)
        print(f"completed {ok}/{a.streams} streams ([DONE], no error), {len(events) - e0} SSE "
              f"events in {secs:.1f} s; gateway CPU "
              f"{(c1.user + c1.system - c0.user - c0.system) / max(1, len(events) - e0) * 1e6:.0f}"
              f" us per event; host load {psutil.getloadavg()[0]:.2f}")
        return 0 if ok == a.streams else 1
    finally:
        stop_process(worker)
        stop_process(api)
        rds.stop()


def _ok(url: str) -> bool:
    try:
        return httpx.post(url + "/tokenize", json={"model": "tiny-llama", "prompt": "x"},
                          headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
