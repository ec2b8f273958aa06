"""Worker tier: the online API's streams do not break (docs/api.md, "How a stream continues";
docs/failure-modes.md, "The online API"): open SSE streams through a SIGKILLed worker complete,
each greedy one identical to its uninterrupted twin; a client whose gateway is SIGKILLed
reconnects to another with `Last-Event-ID` and gets the rest with no gap and no duplicate; a
client that goes away cancels its request in the engine, unless it made the call detached."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid

import pytest
import requests

from app import app
from app.local.embedded import start_process, stop_process, vigil_env, wait_for
from app.state.queues import HOUSEKEEPING_QUEUE, job_queue_name
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import WITNESS_DIR
from tests.worker_procs import RunningWorker, assert_each_ran_to_a_result_once, stepped_aside
from workers.engine.witness import finished_generations, read_witness
from tests.online_gateway import Gateway, assembled, serving_gateway, stream_events

pytestmark = pytest.mark.worker
MODEL = "tiny-llama"
REAP_TIMEOUT_S = 8
STREAMS = 8
# A stream's pause when its worker dies: the reaper's bound (reap timeout + a quarter + a
# heartbeat: tests/test_reaper_e2e.py), then the survivor's resume (the live channel wakes the
# follower at its first chunk), with the reaper test's margin for a loaded 2-core machine.
PAUSE_BOUND_S = REAP_TIMEOUT_S * 1.25 + 1 + 20


@pytest.fixture(scope="module")
def gateway(warm_worker, redis_server, tmp_path_factory):
    yield from serving_gateway(redis_server.url, tmp_path_factory.mktemp("online-streams"))


def body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **kw}


def token_ids(events) -> list[int]:
    return [t for _, d in events if isinstance(d, dict) for c in d.get("choices") or ()
            for t in c.get("token_ids") or ()]


def request_id_of(events) -> str:
    eid = next(e for e, _ in events if e)
    return eid.split("/")[0].split("-", 1)[1]


def twin(gateway, b: dict) -> dict:
    """The same call, whole and uninterrupted (greedy: what every stream must equal)."""
    r = requests.post(gateway.url + "/v1/completions", headers=gateway.headers(),
                      json={**b, "stream": False}, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]


def test_streams_go_on_through_a_sigkilled_worker_and_equal_their_uninterrupted_twins(
        gateway, warm_worker, redis_server, tmp_path):
    """Given 8 open SSE streams of greedy completions running on a worker (its steps slowed so
    the kill lands mid-generation) and a real beat reaping after 8 s, when that worker's
    process group is SIGKILLed, then no stream breaks: each pauses, goes on from the same token
    on the surviving worker (resumed from its durable stream) and ends with its finish and
    [DONE]; the text and token ids each client assembled equal an uninterrupted run's; each
    request ran to a result exactly once (the engines' witness); no pause exceeded the
    reaper's bound plus the resume."""
    store = RequestStore(redis_server.client(), 3600)
    bus, warm = app.vigil_ports.bus, warm_worker.name
    victim = RunningWorker(redis_server, "onlinevictim@testhost", tmp_path,
                           VIGIL_ENGINE="drill", VIGIL_DRILL="slow_step=0.03")
    beat = None
    job = f"online-{uuid.uuid4().hex[:8]}"
    queue = job_queue_name(MODEL, job)
    try:
        victim.wait_engine()
        bus.cancel_consumer(HOUSEKEEPING_QUEUE, [victim.name])
        generate.delay(model=MODEL, prompt="open the job", max_tokens=1, job=job).get(timeout=120)
        wait_for(lambda: all(queue in (bus.active_queues(w) or []) for w in (warm, victim.name)),
                 60, 0.5, "both workers to consume the job's queue")
        # The warm worker steps aside until the kill, so the streams run on the victim; it
        # takes them over after it.
        with stepped_aside(warm, queue):
            beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                                  "-s", str(tmp_path / "schedule")],
                                 vigil_env(redis_server.url,
                                           VIGIL_WORKER_REAP_TIMEOUT=str(REAP_TIMEOUT_S),
                                           VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1",
                                           VIGIL_RECONCILE_INTERVAL="3600"), tmp_path / "beat.log")
            bodies = [body(f"an online story {i}", 160) for i in range(STREAMS)]
            seen = [0] * STREAMS
            arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
            results: list = [None] * STREAMS

            def run(i):
                def on_event(n, eid, data):
                    arrivals[i].append(time.monotonic())
                    seen[i] = n + 1
                results[i] = stream_events(gateway.url + "/v1/completions", bodies[i],
                                           gateway.headers(**{"X-Vigil-Job": job}), on_event)

            threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(STREAMS)]
            for t in threads:
                t.start()
            wait_for(lambda: all(n >= 6 for n in seen), 240, 0.05, "every stream to flow")
            killed_at = time.monotonic()
            os.killpg(victim.proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        assert all(r is not None for r in results), "a stream did not end"
        pauses = []
        for i, events in enumerate(results):
            assert events[-1] == (None, "[DONE]"), events[-3:]
            assert not any(isinstance(d, dict) and "error" in d for _, d in events), events
            finish = [c["finish_reason"] for _, d in events if isinstance(d, dict)
                      for c in d.get("choices") or () if c.get("finish_reason")]
            assert finish == ["length"]
            want = twin(gateway, bodies[i])
            assert token_ids(events) == want["token_ids"]
            assert assembled(events) == want["text"]
            gaps = [b - a for a, b in zip(arrivals[i], arrivals[i][1:]) if b > killed_at]
            pauses.append(max(gaps or [0.0]))
        print(f"online streams through a SIGKILL: pauses p50 {sorted(pauses)[len(pauses)//2]:.1f} s,"
              f" max {max(pauses):.1f} s")
        assert max(pauses) <= PAUSE_BOUND_S
        assert_each_ran_to_a_result_once(store, [request_id_of(e) for e in results])
    finally:
        stop_process(beat)
        victim.stop()


def test_a_client_goes_on_at_another_gateway_after_its_gateway_is_sigkilled(
        gateway, redis_server, tmp_path):
    """Given a stream read through a second gateway, when that gateway is SIGKILLed mid-stream,
    then the client reconnects to the other gateway with `Last-Event-ID` (the last event id it
    got) and receives exactly the rest: the token ids of both parts joined equal the whole
    answer's, none missing and none twice, and the request was not cancelled by the kill."""
    doomed = Gateway(redis_server.url, tmp_path, name="doomed").wait_ready()
    b = body("a tale told twice", 400)
    try:
        first = stream_events(doomed.url + "/v1/completions", b, doomed.headers(),
                              lambda n, eid, data: n < 4)
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        last_id = [e for e, _ in first if e][-1]
        rest = stream_events(gateway.url + "/v1/completions", b,
                             gateway.headers(**{"Last-Event-ID": last_id}))
    finally:
        doomed.stop()
    assert rest[-1] == (None, "[DONE]")
    want = twin(gateway, b)
    assert token_ids(first) + token_ids(rest) == want["token_ids"]
    assert assembled(first) + assembled(rest) == want["text"]


def walk_away(gateway, store: RequestStore, tries: int = 3) -> str:
    """A long streamed call whose client closes the connection after two events; returns its
    request id once the request ended. On a loaded machine the gateway may have written the
    whole answer into the socket's buffers before the client read its second event: the
    request then ran to its end before its client went away (its attempt ended before the
    close), which is no test of going away, and another call is made (at most `tries`)."""
    for _ in range(tries):
        events = stream_events(gateway.url + "/v1/completions", body("walk away", 480),
                               gateway.headers(), lambda n, eid, data: n < 1)
        closed_at = time.time()
        rid = request_id_of(events)
        wait_for(lambda: (store.get(rid) or {}).get("status") in ("FAILED", "SUCCEEDED"), 30,
                 0.05, "the request to end")
        ended = [a["ended_at"] for a in store.history(rid) if a.get("ended_at")]
        if store.get(rid)["status"] == "FAILED" or not ended or max(ended) > closed_at:
            return rid
    raise AssertionError(f"each of {tries} requests of 480 tokens ran to its end before its "
                         "client read two events")


def test_a_client_that_goes_away_cancels_its_request_in_the_engine(gateway, redis_server,
                                                                    warm_worker):
    """Given a long streamed call, when its client closes the connection after a few events,
    then its request ends `cancelled` within seconds and its engine stops making tokens (its
    durable stream, the worker's own record of what it made, stops short of max_tokens); a
    call made with `vigil_detach` runs on to its end instead, and its whole answer is read
    later by its id."""
    store = RequestStore(redis_server.client(), 3600)
    rid = walk_away(gateway, store)
    assert store.get(rid)["error"].startswith("cancelled")
    # The engine let go of it (the worker's heartbeat counts what its engine runs), and never
    # ran it to its end (the engines' witness: no finished generation).
    wait_for(lambda: warm_worker.entry().get("in_flight") == "0", 30, 0.1,
             "the worker's engine to let the request go")
    assert finished_generations(read_witness(WITNESS_DIR).get(rid, [])) == 0
    made = sum(len(e.token_ids) for e in store.streams().entries(rid) if not e.end)
    assert made < 480

    kept = stream_events(gateway.url + "/v1/completions",
                         body("walk away, detached", 64, vigil_detach=True),
                         gateway.headers(), lambda n, eid, data: n < 2)
    call_id = next(e for e, _ in kept if e).split("/")[0]
    whole = requests.get(gateway.url + f"/v1/calls/{call_id}", headers=gateway.headers(),
                         timeout=120)
    assert whole.status_code == 200
    assert whole.json()["choices"][0]["finish_reason"] == "length"
    assert store.get(request_id_of(kept))["status"] == "SUCCEEDED"
