"""Worker tier: interactive and bulk on one worker (the real vLLM CPU engine, each step slowed
by STEP_S, an engine batch of 4, six task threads, two of them kept from bulk work), one worker
start for every check:

- with the engine full of long greedy bulk generations and more bulk queued, an interactive
  request starts at once by preempting the bulk run cheapest to rebuild, and finishes within a
  small multiple of its idle latency; the preempted bulk request resumes from its stream and ends
  token-identical to an uninterrupted twin; no token is thrown away, by the worker's own
  vigil_tokens_discarded_total and by EngineCore's own count of the tokens it generated (the
  drill's slow steps log every request that leaves the engine's batch with its tokens: their
  sum is what the results hold); every stored result is backed by the engine's witness. The
  bulk work mixes every request kind (issue 38): plain, penalized, structured, with bad words,
  and n = 2 sampled;
- the same with the bulk work arriving as one message of many requests (`generate_many`, as a
  batch object's window does): twice the engine's batch in one message, so the intake cap and
  the engine's batch gate, not the message count, keep the extra bulk requests out of vLLM, the
  one that yields holds a batch seat, and the gate's line gives it to the interactive
  request;
- last, the worker is SIGTERMed under load (a drain: a scale-in), with default-tier greedy
  generations streaming and bulk ones waiting at the gate: every request is handed back with
  every token it made in its stream and its attempt refunded, none counted discarded (the
  worker's own counter, logged as it exits), the worker exits within DRAIN_EXIT_BOUND_S, and a
  successor worker resumes each one token-identical to an uninterrupted twin; the drained
  requests are of every greedy kind too."""
from __future__ import annotations

import re
import signal
import time
import uuid

import pytest
import requests

from app.local.embedded import free_port, wait_for
from app.state.store import shared_store
from tasks.inference import generate, generate_many
from tests.conftest import TIERS_MODEL
from tests.worker_procs import RunningWorker, assert_each_ran_to_a_result_once, assert_witnessed
from workers.held import FREEZE_TIMEOUT_S

pytestmark = pytest.mark.worker
LONG = 240  # tokens per bulk generation
SEQS = 4  # the tiers model's engine batch (tests/conftest.py)
# An interactive request under a full engine of bulk work finishes within this multiple of its
# idle latency, plus this many seconds (one preemption: a read, a stream write, an abort).
BUSY_FACTOR, BUSY_SLACK_S = 5, 1.0
# A worker SIGTERMed with its engine full exits within this many seconds: measured 6.3-6.9 s
# here (three runs, 6 requests held), 12.2 s in the drain soak with 45 held beside a second
# worker (docs/failure-modes.md, "SIGTERM drain under load"); about 3x the e2e's worst.
DRAIN_EXIT_BOUND_S = 20.0
DRAIN_TOKENS = 400  # a drained generation's max_tokens: long enough to be cut mid-way
# Every engine step of the module's worker takes this much longer (the drill's slow_step, inside
# EngineCore; logits untouched): on a fast machine 240 tiny-model tokens took under a second, the
# first bulk runs ended before the interactive request came and nothing had to yield (CI, 57f0703).
STEP_S = 0.01


def scrape(port: int) -> str:
    return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def discarded(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^vigil_tokens_discarded_total\{[^}]*\} (\S+)",
                                            text, re.M))


def interactive(job: str) -> float:
    t0 = time.monotonic()
    out = generate.delay(model=TIERS_MODEL, prompt="quick", max_tokens=8, temperature=0.0,
                         ignore_eos=True, job=job, priority="interactive").get(timeout=120)
    assert out["completion_tokens"] == 8
    return time.monotonic() - t0


# The request kinds the bulk work and the drain mix (issue 38), by request number modulo their
# count: each greedy kind resumes token-identical; the n = 2 sampled one continues each sample.
KINDS = [{}, {"presence_penalty": 0.8, "frequency_penalty": 0.5},
         {"structured": {"regex": "[a-z]{4000}"}},  # letters past max_tokens: runs to its length
         {"bad_words": ["silver", "snow"], "repetition_penalty": 1.2},
         {"n": 2, "temperature": 1.0}]


def kind(i: int) -> dict:
    return KINDS[i % len(KINDS)]


def bulk_kwargs(i: int, job: str, tier: str | None = "bulk") -> dict:
    kw = {**dict(model=TIERS_MODEL, prompt=f"bulk number {i}", max_tokens=LONG,
                 temperature=0.0, ignore_eos=True, job=job), **kind(i)}
    return {**kw, "priority": tier} if tier else kw


# The drill's slow steps log, in EngineCore, each request that leaves the engine's batch with
# the tokens it made (workers/engine/drill_steps.py LEFT_FORMAT): EngineCore's own count.
# A flush request (max_tokens 1) is left out: its own departure may come before or after a mark.
LEFT = re.compile(r"left the engine's batch after \d+ of (\d+) tokens \((\d+) made while in it\)")


class TiersWorker:
    """The module's worker and what its tests read of it."""

    def __init__(self, worker: RunningWorker, port: int, idle: float):
        self.worker, self.port, self.idle = worker, port, idle

    def discarded(self) -> float:
        return discarded(scrape(self.port))

    def flush(self) -> int:
        """Make EngineCore log every request that left its batch so far (a departure is
        logged at the next step: a one-token request makes one), and return where the worker's
        log ends now."""
        generate.delay(model=TIERS_MODEL, prompt="flush", max_tokens=1, temperature=0.0,
                       ignore_eos=True).get(timeout=120)
        return len(self.worker.log.read_text(errors="replace"))

    def generated_since(self, mark: int) -> int:
        """The tokens EngineCore says its requests made, by the departures logged past
        `mark` (flush requests left out)."""
        text = self.worker.log.read_text(errors="replace")[mark:]
        return sum(int(n) for most, n in LEFT.findall(text) if most != "1")

    def assert_engine_kept_all(self, mark: int, kept: int) -> None:
        """Every token EngineCore generated since `mark` is in a result: once a closing
        flush logged the last departures, the departures since `mark` add up to `kept`, no
        more (a token made after its run's last read, or made and never written, would show
        here)."""
        self.flush()
        try:
            wait_for(lambda: self.generated_since(mark) >= kept, 30, 0.05,
                     "EngineCore's departures to cover the results")
        finally:
            made = self.generated_since(mark)
            print(f"tiers: EngineCore generated {made} tokens, the results hold {kept}")
        assert made == kept


@pytest.fixture(scope="module")
def tiers(redis_server, tmp_path_factory):
    port = free_port()
    w = RunningWorker(redis_server, "tiers@testhost", tmp_path_factory.mktemp("tiers"),
                      pools=TIERS_MODEL, concurrency=6, VIGIL_INTERACTIVE_SLOTS="2",
                      VIGIL_METRICS_PORT=str(port), VIGIL_ENGINE="drill",
                      VIGIL_DRILL=f"slow_step={STEP_S}")
    try:
        w.wait_engine()
        job = f"tiers-idle-{uuid.uuid4().hex[:6]}"
        idle = min(interactive(job) for _ in range(2))
        yield TiersWorker(w, port, idle)
    finally:
        w.stop()


def streaming(store, rs, samples: list[int] | None = None) -> int:
    """The batch seats `rs` take now: each running with a token streamed (one that ended keeps
    its count of tokens streamed, and no longer holds a batch seat) takes its `samples`."""
    recs = [store.get(r.id) or {} for r in rs]
    samples = samples or [1] * len(rs)
    return sum(n for rec, n in zip(recs, samples)
               if rec.get("status") == "RUNNING" and int(rec.get("streamed") or 0) > 0)


def kept(outs: list[dict]) -> int:
    """The tokens the results hold, every sample's."""
    return sum(c["completion_tokens"] for o in outs for c in o.get("choices") or [o])


def check_preempted_resumed_identical(store, bulk, outs, job: str) -> list:
    """The preempted requests of `bulk` (one at least): each resumed from its stream and equals
    its uninterrupted twin (default tier, run together as one message of many)."""
    preempted = [i for i, r in enumerate(bulk)
                 if int(store.get(r.id).get("preemptions") or 0) > 0]
    assert preempted, "no bulk run yielded its slot"
    greedy = [i for i in preempted if kind(i).get("n", 1) == 1]
    twins = generate_many([bulk_kwargs(i, job, None) for i in greedy])
    for i in preempted:
        out = outs[i]
        assert any(c.get("resumed_at") for c in out.get("choices") or [out]), (
            f"bulk request {i} yielded its slot before making a token: it held no batch seat")
    for i, twin in zip(greedy, twins):
        assert twin.get(timeout=300)["token_ids"] == outs[i]["token_ids"], kind(i)
    return preempted


def interactive_beside(tiers, bulk, job: str, before: float, mark: int, what: str) -> None:
    """Once four of `bulk` generate, an interactive request finishes within BUSY_FACTOR x its
    idle latency + BUSY_SLACK_S; then every bulk request completes with all its tokens, the
    preempted ones (one at least) resumed and identical to their twins (the greedy ones), the
    worker's discarded tokens still `before`, EngineCore's own count of the tokens it made
    since `mark` equal to what the results hold, the engine's witness backing each result."""
    store = shared_store()
    samples = [kind(i).get("n", 1) for i in range(len(bulk))]
    wait_for(lambda: streaming(store, bulk, samples) >= SEQS, 120, 0.05,
             "four bulk samples streaming")
    busy = interactive(job)
    print(f"tiers: interactive latency idle {tiers.idle * 1000:.0f} ms, beside {what} "
          f"{busy * 1000:.0f} ms ({busy / tiers.idle:.1f}x)")
    assert busy < BUSY_FACTOR * tiers.idle + BUSY_SLACK_S
    outs = [r.get(timeout=300) for r in bulk]
    assert all(c["completion_tokens"] == LONG for o in outs for c in o.get("choices") or [o])
    # Before the twins run: the interactive request's 8 tokens and the bulk results' are all
    # EngineCore made since the mark.
    tiers.assert_engine_kept_all(mark, kept(outs) + 8)
    preempted = check_preempted_resumed_identical(store, bulk, outs, job)
    print(f"tiers: preempted {len(preempted)} of {len(bulk)} bulk requests "
          f"({[list(kind(i)) for i in preempted]})")
    assert tiers.discarded() == before
    # One finished generation each, the preempted ones' resumed runs included (an aborted
    # run finishes nothing).
    assert_witnessed(store, [r.id for r in bulk])


@pytest.mark.alone  # a latency bound: a neighbour starting an engine stretches it
def test_an_interactive_request_preempts_bulk_work_that_resumes_identical(tiers):
    """Given six long greedy bulk requests (sent one by one) filling the engine's batch of 4,
    when an interactive request arrives, then it preempts a bulk run (the cheapest to rebuild)
    and finishes within 5x its idle latency + 1 s; every bulk request completes, the preempted
    ones resumed and identical to their twins, no token discarded, the witness backs each
    result."""
    job = f"tiers-{uuid.uuid4().hex[:6]}"
    before, mark = tiers.discarded(), tiers.flush()
    bulk = [generate.delay(**bulk_kwargs(i, job)) for i in range(6)]
    interactive_beside(tiers, bulk, job, before, mark, "six bulk requests")


@pytest.mark.alone  # a latency bound: a neighbour starting an engine stretches it
def test_bulk_in_one_message_of_many_still_yields_to_an_interactive_request(tiers):
    """Given eight long greedy bulk requests in one `generate_many` message (twice the engine's
    batch, over the worker's bulk cap of 4 requests: a batch object's window arrives so), when
    the engine's batch is full of them and an interactive request arrives, then it still
    starts at once and finishes within 5x its idle latency + 1 s (before: the four bulk
    requests beyond the batch waited in vLLM ahead of it, first come first served, and the one
    picked to yield was one of them, holding no slot); every bulk request completes, the
    preempted ones identical to their twins, no token discarded, the witness backs each."""
    job = f"tiers-many-{uuid.uuid4().hex[:6]}"
    before, mark = tiers.discarded(), tiers.flush()
    bulk = generate_many([bulk_kwargs(i, job) for i in range(2 * SEQS)])
    interactive_beside(tiers, bulk, job, before, mark,
                       f"one message of {2 * SEQS} bulk requests")


def stopped_line(log: str) -> tuple[int, int]:
    """(tokens resumed, tokens discarded) from the worker's last line as it exits."""
    m = re.findall(r"in this process (\d+) generated token\(s\) were resumed from and (\d+) "
                   r"discarded", log)
    assert m, "no token totals in the worker's log as it stopped"
    return int(m[-1][0]), int(m[-1][1])


@pytest.mark.alone  # its bulk requests must begin while four generations run: timing
def test_sigterm_under_load_hands_back_every_token_and_each_resumes_identical(
        tiers, redis_server, tmp_path):
    """Given the module's worker (last test: it is stopped here) with four long greedy
    default-tier generations streaming in its engine and two bulk ones of a message of many
    waiting at its bulk gate, when it gets SIGTERM (a scale-in), then it freezes its engine and
    writes every token made before handing back: each request is PENDING for its next
    dispatch with its stream holding at least what was streamed before the signal, its
    attempt refunded (`drained`), and the worker's own vigil_tokens_discarded_total, logged
    as it exits, is what it was before; the worker exits 0 within DRAIN_EXIT_BOUND_S; a
    successor worker resumes each from its stream (`resumed_at` its stream's length), ends it
    once (the witness agrees) on attempt 1 and token-identical to an uninterrupted twin."""
    store = shared_store()
    job = f"drain-{uuid.uuid4().hex[:6]}"
    before, mark = tiers.discarded(), tiers.flush()
    greedy = len(KINDS) - 1  # every kind but the sampled one: each has its twin
    kw = [dict(model=TIERS_MODEL, prompt=f"a long tale {i % greedy}", max_tokens=DRAIN_TOKENS,
               temperature=0.0, ignore_eos=True, job=job, **kind(i % greedy))
          for i in range(6)]
    running = [generate.delay(**k) for k in kw[:SEQS]]
    wait_for(lambda: all(int((store.get(r.id) or {}).get("streamed") or 0) >= 24
                         for r in running), 120, 0.05, "four generations streaming")
    waiting = generate_many([{**k, "priority": "bulk"} for k in kw[SEQS:]])
    rs = running + waiting
    wait_for(lambda: all((store.get(r.id) or {}).get("status") == "RUNNING" for r in rs), 60,
             0.05, "the bulk requests begun (waiting at the gate)")
    streamed = {r.id: int(store.get(r.id).get("streamed") or 0) for r in rs}
    victim = tiers.worker
    t0 = time.monotonic()
    victim.proc.send_signal(signal.SIGTERM)
    assert victim.proc.wait(timeout=120) == 0
    exit_s = time.monotonic() - t0
    log = victim.log.read_text()
    _, discarded_at_exit = stopped_line(log)
    handed = re.findall(r"handed back (\d+) request\(s\) \((\d+) aborted in the engine, (\d+) "
                        r"read from it frozen, (\d+) token\(s\) left unwritten\)", log)
    print(f"drain: exit {exit_s:.1f} s after SIGTERM with {len(rs)} requests held "
          f"({SEQS} generating); hand-back {handed}; discarded {discarded_at_exit}")
    assert handed and int(handed[-1][0]) == len(rs) and handed[-1][3] == "0"
    assert discarded_at_exit == before
    assert exit_s < DRAIN_EXIT_BOUND_S
    streams = store.streams()
    held = {}
    for r in rs:
        rec = store.get(r.id)
        assert (rec["status"], rec["dispatch"], rec["attempts"], rec["drains"]) == (
            "PENDING", "1", "0", "1"), rec
        cp = streams.checkpoint(r.id)
        held[r.id] = len(cp.token_ids) if cp is not None else 0
        assert held[r.id] >= streamed[r.id]
    assert all(held[r.id] > 0 for r in running) and all(held[r.id] == 0 for r in waiting)
    # EngineCore's own count: its departures since the mark (the drained runs leave its batch
    # as they are aborted, frozen) are the tokens the streams hold.
    made = tiers.generated_since(mark)
    print(f"drain: EngineCore made {made} tokens; the streams hold {sum(held.values())}")
    assert made == sum(held.values())
    port = free_port()
    successor = RunningWorker(redis_server, "tiers2@testhost", tmp_path, pools=TIERS_MODEL,
                              concurrency=6, VIGIL_METRICS_PORT=str(port))
    try:
        successor.wait_engine()
        outs = {r.id: r.get(timeout=300) for r in rs}
        twins = [generate.delay(**k).get(timeout=300) for k in kw[:greedy]]
        for i, r in enumerate(rs):
            out = outs[r.id]
            assert out["worker"] == "tiers2@testhost" and out["attempts"] == 1
            assert out["token_ids"] == twins[i % greedy]["token_ids"], (r.id, kind(i))
            assert out.get("resumed_at", []) == ([held[r.id]] if held[r.id] else [])
        assert_each_ran_to_a_result_once(store, [r.id for r in rs])
        assert discarded(scrape(port)) == 0
        # Stopped as the harness stops every worker, SIGTERM to its whole process group: its
        # EngineCore gets it too and answers no pause, and the freeze must not wait out its
        # bound for it (it stops at the engine's death).
        successor.stop()
        took = [float(s) for s in re.findall(r"left unwritten\), failed \d+ out of attempts or "
                                             r"time, in ([\d.]+) s", successor.log.read_text())]
        print(f"drain: the successor's group stop handed back in {took} s")
        assert took and took[-1] < FREEZE_TIMEOUT_S
    finally:
        successor.stop()
