"""Unit tier: the stall watchdog, pause/resume and the quarantine restart of the engine host, with
fake engines that hang like a SIGSTOPped EngineCore (no error, no progress); and the real
VllmEngine's resume of a request of n samples (and its refusal for a structured one) under a
stand-in vLLM that never steps."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from app.errors import TransientError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from app.retry_policy import rule_for
from app.state.streams import Checkpoint
from tests.unit_helpers import wait_until
from workers.engine.host import HandedBack
from workers.engine.output import EngineOutput
from workers.engine.render import PromptRenderer
from workers.engine.vllm import VllmEngine
from workers.engine.waves import Waves
from workers.streaming import StreamTap

A = ModelSpec(name="model-a")


class Hanging:
    """Holds requests until released; `progress` moves only while `stepping` is set."""

    def __init__(self, world):
        self.world = world
        self.dead = False
        self.progress = 0
        self.killed = False
        self.in_flight = 0

    async def run(self, r, rid):
        self.in_flight += 1
        try:
            while not self.world.release.is_set():
                if self.world.stepping.is_set():
                    self.progress += 1
                await asyncio.sleep(0.01)
            return EngineOutput("done", [1], "length", 1)
        finally:
            self.in_flight -= 1

    def kill(self):
        self.killed = True

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self.dead = True


class World:
    def __init__(self):
        self.release = threading.Event()
        self.stepping = threading.Event()
        self.engines: list[Hanging] = []

    def __call__(self, spec, plan=None):
        e = Hanging(self)
        self.engines.append(e)
        return e


def req():
    return GenerateRequest(model="model-a", prompt="hi", max_tokens=4)


def test_a_stalled_engine_is_caught_before_the_request_timeout_and_each_request_reported(
        make_host):
    """Given requests in an engine that makes no progress, then after stall_timeout the watchdog
    aborts them all: each caller gets TransientError(wedged) long before its own timeout, and each
    is reported as one failure."""
    failures = []
    w = World()
    host = make_host(w, stall_timeout=0.3, on_failure=failures.append)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 30) for i in range(4)]
        for f in futs:
            with pytest.raises(TransientError, match="^wedged: the engine made no progress"):
                f.result(timeout=10)
    assert len(failures) == 4 and all(f.startswith("stall: ") for f in failures)
    assert host.stalls == 1
    wait_until(lambda: w.engines[0].in_flight == 0)  # aborted in the engine too


def test_an_engine_that_keeps_stepping_is_not_stalled(make_host):
    """Given a long generation whose engine keeps producing steps, then no stall is declared
    however long it takes, and the completion is reported as a success."""
    failures, successes = [], []
    w = World()
    w.stepping.set()
    host = make_host(w, stall_timeout=0.2, on_failure=failures.append,
                     on_success=lambda: successes.append(1))
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(host.generate, req(), A, "long", 30)
        wait_until(lambda: w.engines and w.engines[0].progress > 100)  # > 1 s of steps
        w.release.set()
        assert fut.result().text == "done"
    assert failures == [] and successes == [1] and host.stalls == 0


def test_a_request_timeout_is_reported_as_a_failure(make_host):
    failures = []
    w = World()
    w.stepping.set()  # progressing, just slow: the request's own timeout catches it
    host = make_host(w, stall_timeout=5, on_failure=failures.append)
    with pytest.raises(TransientError, match="^wedged: "):
        host.generate(req(), A, "slow", 0.3)
    assert len(failures) == 1 and failures[0].startswith("timeout: request slow")


def test_pause_hands_requests_back_and_the_quarantine_restart_runs_a_canary(make_host):
    """Given a paused host, then in-flight requests are aborted with HandedBack and new ones are
    refused; the quarantine restart kills the old engine, starts a fresh one and passes a canary;
    after resume() the host serves again."""
    w = World()
    host = make_host(w)
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(host.generate, req(), A, f"r{i}", 30) for i in range(2)]
        wait_until(lambda: w.engines and w.engines[0].in_flight == 2)
        host.pause()
        assert not host.accepting and host.abort_in_flight() == 2
        for f in futs:
            with pytest.raises(HandedBack):
                f.result(timeout=5)
    with pytest.raises(HandedBack):
        host.generate(req(), A, "while-paused", 5)
    w.release.set()  # the fresh engine answers
    ok, why = host.restart_with_canary(A, timeout=10)
    assert ok and why == "" and w.engines[0].killed and len(w.engines) == 2
    assert host.stats.restarts == 1
    host.resume()
    assert host.generate(req(), A, "after", 5).text == "done"


def test_named_requests_are_aborted_wherever_they_are(make_host):
    """Given requests in the engine, when some are aborted by request id (their job was
    deleted), then exactly those callers get Aborted, the engine drops them, and the others
    finish."""
    from workers.engine.host import Aborted

    w = World()
    host = make_host(w)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(host.generate, req(), A, f"job-req-{i}-1", 30) for i in range(4)]
        wait_until(lambda: w.engines and w.engines[0].in_flight == 4)
        assert host.abort_requests({"job-req-0", "job-req-2", "not-here"}) == 2
        for i in (0, 2):
            with pytest.raises(Aborted):
                futs[i].result(timeout=5)
        wait_until(lambda: w.engines[0].in_flight == 2)
        w.release.set()
        assert [futs[i].result(timeout=5).text for i in (1, 3)] == ["done", "done"]


# -- the real VllmEngine's resume, under a vLLM that never steps ---------------------------------
class SilentLLM:
    """Stands in for vLLM's AsyncLLM where VllmEngine reads it, as a SIGSTOPped EngineCore
    leaves it: every engine request it is given waits for ever (no step, no error), and is
    aborted when its task is cancelled, as AsyncLLM.generate aborts on CancelledError. Records
    each engine request (id, prompt, SamplingParams) and each abort."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.errored = False
        self.output_processor = SimpleNamespace(external_req_ids={}, request_states={})
        self.started: list[tuple[str, dict, object]] = []
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id, lora_request=None, priority=0):
        self.started.append((request_id, prompt, params))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        yield None  # an async generator, as AsyncLLM.generate is


class StoppedVllm(VllmEngine):
    """Vigil's real VllmEngine (its run, resume and seams) over a SilentLLM: no vLLM built."""

    def __init__(self, llm: SilentLLM):
        self._llm, self._watch, self.witness, self.spec = llm, None, None, A
        self.max_model_len, self.max_num_seqs = 2048, 8
        self.steps = SimpleNamespace(steps=0, outputs=0)  # `progress`: never moves
        self._render = PromptRenderer(llm)  # no renderer here: raw prompts, as vLLM's older
        self._waves = Waves(0.0)  # every run at once

    def kill(self):
        pass

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        self._llm = None


def byte_tokenizer():
    """A byte-level BPE tokenizer trained here (`tokenizers`' own; no model hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    return tok


def resumable_tap(tok, rid: str, samples: list[list[int]], prompt: list[int]):
    """A tap (workers/streaming.py, no sink) whose prior attempt streamed `samples[i]` for
    sample i, with their text as vLLM decodes it."""
    from workers.engine.resume import fast_decoder

    def text(ids):
        step = fast_decoder(tok)(prompt)
        return "".join(step(t) or "" for t in ids)

    cps = [Checkpoint(prompt, ids, text(ids), "", []) for ids in samples]
    prior = Checkpoint(prompt, cps[0].token_ids, cps[0].text, "", [], None, cps)
    return StreamTap(None, rid, "claim", 2, "model-a", prior, samples=len(samples))


def test_a_resumed_request_of_two_samples_is_aborted_whole_by_the_stall_watchdog(make_host):
    """Given a request of n=2 whose earlier attempt streamed tokens of both samples, resumed
    by the real VllmEngine as one engine request per sample (`<id>~0`, `<id>~1`), each from
    its own tokens, when its engine makes no step for stall_timeout, then the watchdog aborts
    it: both sample runs are aborted in the engine, the caller gets TransientError(wedged)
    (retried at once, elsewhere: app/retry_policy.py) and the failure is reported once, and
    the tap still holds every token, for the next attempt to resume from."""
    tok = byte_tokenizer()
    llm = SilentLLM(tok)
    prompt = tok.encode("the quick ").ids
    samples = [tok.encode("brown fox").ids, tok.encode("lazy dog jumps").ids]
    tap = resumable_tap(tok, "rs", samples, prompt)
    failures = []
    host = make_host(lambda spec, plan=None: StoppedVllm(llm), stall_timeout=0.3,
                     on_failure=failures.append)
    r = GenerateRequest(model="model-a", prompt="the quick ", max_tokens=40, n=2,
                        temperature=1.0, seed=3)
    with pytest.raises(TransientError, match="^wedged: the engine made no progress") as ei:
        host.generate(r, A, "rs-2", 30, tap=tap)
    assert rule_for(ei.value).retried and rule_for(ei.value).at_once
    started = {rid: (prompt_of["prompt_token_ids"], p) for rid, prompt_of, p in llm.started}
    assert sorted(started) == ["rs-2~0", "rs-2~1"]
    for i, ids in enumerate(samples):
        given, params = started[f"rs-2~{i}"]
        assert given == prompt + ids  # its own tokens, not the other sample's
        assert (params.n, params.max_tokens, params.seed) == (1, 40 - len(ids), 3 + i)
    wait_until(lambda: sorted(llm.aborted) == ["rs-2~0", "rs-2~1"])
    assert len(failures) == 1 and failures[0].startswith("stall: ") and host.stalls == 1
    cp = tap.resume_point()
    assert [cp.sample(i).token_ids for i in (0, 1)] == samples
    assert [tap.resumed_at_of(i) for i in (0, 1)] == [[len(samples[0])], [len(samples[1])]]


def test_a_structured_request_of_two_samples_refuses_resume_counts_it_and_is_aborted_whole(
        make_host):
    """Given a structured request of n=2 whose earlier attempt streamed 5 tokens, when the real
    VllmEngine of an engine whose model runs outside EngineCore (so its grammar cannot be
    advanced over the tokens: workers/engine/resume.py `grammar_resumes`) runs it, then its
    resume is refused: the 5 tokens are counted in vigil_tokens_discarded_total and it runs
    from its prompt as one engine request of 2 samples; when that engine makes no step, the
    watchdog aborts it and the caller gets TransientError(wedged)."""
    from app import metrics

    tok = byte_tokenizer()
    llm = SilentLLM(tok)
    prompt = tok.encode("the ").ids
    tap = resumable_tap(tok, "st", [tok.encode("fox").ids, tok.encode("dog").ids], prompt)
    held = sum(len(tap.resume_point().sample(i).token_ids) for i in (0, 1))
    engine = StoppedVllm(llm)
    engine.grammar_resumes = False
    host = make_host(lambda spec, plan=None: engine, stall_timeout=0.3)
    r = GenerateRequest(model="model-a", prompt="the ", max_tokens=40, n=2, temperature=1.0,
                        structured={"regex": "[a-z]+"})

    def discarded() -> float:
        return metrics.REGISTRY.get_sample_value("vigil_tokens_discarded_total",
                                                 {"pool": "model-a"}) or 0.0

    before = discarded()
    with pytest.raises(TransientError, match="^wedged: "):
        host.generate(r, A, "st-2", 30, tap=tap)
    assert discarded() == before + held and held >= 2
    assert [(rid, p.n) for rid, _, p in llm.started] == [("st-2", 2)]
    assert llm.started[0][1] == {"prompt": "the "} and tap.resume_point() is None
    wait_until(lambda: llm.aborted == ["st-2"])


def test_only_short_runs_wait_for_the_engines_next_wave():
    """Given the real VllmEngine with a wave window far longer than the test and a one-token
    run inside vLLM, when a run of more than SHORT_RUN_TOKENS tokens and another one-token run
    arrive, then the long run enters vLLM at once (a slot it waited a window for would make
    nothing: workers/engine/waves.py) and the short one waits for the next wave."""
    from workers.engine.ticket import SHORT_RUN_TOKENS

    async def started(llm, rid: str) -> bool:
        for _ in range(500):  # up to ~5 s
            if any(s[0] == rid for s in llm.started):
                return True
            await asyncio.sleep(0.01)
        return False

    async def go():
        llm = SilentLLM(byte_tokenizer())
        engine = StoppedVllm(llm)
        engine._waves = Waves(30.0)

        def run(rid: str, max_tokens: int):
            req = GenerateRequest(model="model-a", prompt="hi", max_tokens=max_tokens)
            return asyncio.ensure_future(engine.run(req, rid))

        runs = [run("first", 1)]
        assert await started(llm, "first")
        runs += [run("long", SHORT_RUN_TOKENS + 1), run("short", 1)]
        assert await started(llm, "long")
        for _ in range(20):
            await asyncio.sleep(0)
        assert [s[0] for s in llm.started] == ["first", "long"]
        assert engine._waves.inside == 2
        for r in runs:
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)

    asyncio.run(go())
