"""The online bench's kill under load (bench/online.py): open greedy streams on one worker,
that worker's process group SIGKILLed mid-way, a second worker alive and beat reaping after a
short timeout; every stream must complete, each identical to its uninterrupted twin.

Setup, as tests/test_online_streams_e2e.py does it: the streams run under a job of their own
(`X-Vigil-Job`) whose queue only the victim consumes (the steady worker is told to stop
consuming it once the job's queue exists, and to consume it again right after the kill, which
is what a fleet of two consuming workers looks like once the victim holds every stream); the
victim does not run housekeeping (the steady worker reaps it). The kill lands once every stream
has received at least `kill_at` tokens. Then the same bodies run again, uninterrupted, on the
steady worker: the twins.

Reported: streams completed (ended with a finish_reason and [DONE], no error event, all their
tokens), identical to their twins (token ids, which the body asks back), the pause each client
saw (its largest gap between two events across the kill), and the tokens recomputed: the
tokens the dead worker's engine made that no durable stream held, so that the resumed attempt
made them again. A SIGKILL leaves no count of what the engine made, so they are counted by the
engine's own clock, per stream (bench/online_redis.py `kill_accounting`): the whole engine
steps that fit between the step of its last durable chunk (`w`) and the SIGKILL, at that
attempt's own time per token (one token per step per stream). That the resumed attempt
continued from exactly the durable tokens is checked against the result's `resumed_at`.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time

import httpx

from app.local.embedded import wait_for
from app.state import keys
from bench.online_client import MODEL, Stream, body, client, quantile, run_level, stream_one
from bench.online_redis import kill_accounting

JOB = "killbench"


def steer(vigil, bus, queue: str, steady: str, victim: str) -> None:
    """Make the victim the only consumer of the job's queue and keep housekeeping off it."""
    from app.state.queues import HOUSEKEEPING_QUEUE

    bus.cancel_consumer(HOUSEKEEPING_QUEUE, [vigil.node(victim)])
    r = httpx.post(vigil.url + "/v1/completions", timeout=120,
                   headers={**vigil.headers, "X-Vigil-Job": JOB},
                   json={"model": MODEL, "prompt": "open the job", "max_tokens": 1})
    r.raise_for_status()
    nodes = [vigil.node(steady), vigil.node(victim)]
    wait_for(lambda: all(queue in (bus.active_queues(n) or []) for n in nodes), 60, 0.5,
             "both workers to consume the job's queue")
    bus.cancel_consumer(queue, [vigil.node(steady)])
    wait_for(lambda: queue not in (bus.active_queues(vigil.node(steady)) or [queue]), 30, 0.2,
             "the steady worker to leave the job's queue")


async def streams_through_kill(vigil, items, kill_at: int, kill) -> tuple[list[Stream], float]:
    """Open every (key, body) stream at once; call `kill()` once each has `kill_at` tokens.
    Returns the streams and the kill's monotonic time."""
    streams = [Stream(k) for k, _ in items]
    killed = asyncio.get_running_loop().create_future()

    def check(_s: Stream) -> None:
        if not killed.done() and all(len(s.token_ids) >= kill_at for s in streams):
            killed.set_result(kill())

    headers = {**vigil.headers, "X-Vigil-Job": JOB}
    async with client(len(items)) as http:
        tasks = [asyncio.create_task(stream_one(http, vigil.url, headers, s, b, check))
                 for s, (_, b) in zip(streams, items)]
        await asyncio.gather(*tasks)
    if not killed.done():
        raise RuntimeError("the streams ended before the kill: raise --kill-tokens")
    return streams, killed.result()


def run_kill(vigil, redis_client, bus, *, streams: int, tokens: int, reap_timeout: int,
             say) -> dict:
    """The kill run (module docstring); its figures."""
    from app.state.queues import job_queue_name

    steady, victim = "steady", "victim"
    queue = job_queue_name(MODEL, JOB)
    vigil.start_worker(victim)
    vigil.wait_worker(victim, redis_client)
    steer(vigil, bus, queue, steady, victim)
    vigil.start_beat(reap_timeout)
    say(f"kill run: {streams} greedy streams x {tokens} tokens on worker {victim}, SIGKILL at "
        f"{tokens // 2} tokens each; beat reaps after {reap_timeout} s; {steady} takes over")
    stamp = time.strftime("%H%M%S")
    items = [(f"kill-{stamp}-{i}", body(f"A story to survive {i}: the river and the stone",
                                        tokens)) for i in range(streams)]
    held: dict = {}

    def kill() -> float:
        held["wall"] = time.time()
        t = time.monotonic()
        os.killpg(vigil.workers[victim].pid, signal.SIGKILL)
        bus.add_consumer(queue, [vigil.node(steady)])
        return t

    t0 = time.monotonic()
    got, killed = asyncio.run(streams_through_kill(vigil, items, tokens // 2, kill))
    took = time.monotonic() - t0
    twin_items = [(f"twin-{stamp}-{i}", b) for i, (_, b) in enumerate(items)]
    twins, _ = asyncio.run(run_level(vigil.url, vigil.headers, twin_items, streams))
    complete = [s for s in got if s.ok and s.finish == "length" and len(s.token_ids) == tokens]
    same = sum(1 for s, t in zip(got, twins) if t.ok and s.token_ids == t.token_ids
               and len(s.token_ids) == tokens)
    pauses, resumed = [], []
    for s in got:
        stamps = [s.sent] + s.arrivals
        gaps = [(b - a, b) for a, b in zip(stamps, stamps[1:]) if b > killed]
        if gaps:
            gap, end = max(gaps)
            pauses.append(gap)
            resumed.append(end - killed)
    acc = [kill_accounting(redis_client, s, held["wall"]) for s in got]
    durable = sum(a["durable"] for a in acc)
    recomputed = sum(math.floor(a["after_last"]) for a in acc if a["after_last"] is not None)
    resumed_ok = sum(1 for a in acc if a["resumed_at"] == [a["durable"]])
    hist = [json.loads(redis_client.hget(keys.request(s.key), "history") or "[]") for s in got]
    on_victim = sum(1 for h in hist if h and h[0].get("worker") == vigil.node(victim)
                    and h[-1].get("worker") == vigil.node(steady))
    steps = [a["step_s"] for a in acc if a["step_s"]]
    return {"streams": streams, "tokens": tokens, "completed": len(complete),
            "identical": same, "twins_ok": sum(t.ok for t in twins),
            "pauses": pauses, "took_s": took, "durable": durable, "recomputed": recomputed,
            "resumed_first_s": min(resumed, default=math.nan),
            "resumed_last_s": max(resumed, default=math.nan),
            "resumed_at_durable": resumed_ok, "first_attempt_on_victim": on_victim,
            "step_ms": 1000 * sorted(steps)[len(steps) // 2] if steps else math.nan,
            "errors": [s.error for s in got if s.error][:3],
            "p50": quantile(pauses, 0.5), "p99": quantile(pauses, 0.99),
            "max": max(pauses) if pauses else math.nan}
