"""Worker tier: the whole generation contract on a real worker and the real vLLM CPU engine
(issue 31): logprobs and logprob_token_ids against a witness outside Vigil (an AsyncLLM built
directly from the worker's engine_args), detokenize=False, n samples as one engine request,
structured outputs checked by an independent validator, an uncompilable schema refused before
publish, resumes on the shared warm worker provoked without a kill (tests/ghost_attempt.py: a
repetition_penalty request equal to its uninterrupted twin, two samples each stopping across
its own seam), a SIGKILL mid-generation resumed with its logprobs (a structured request
resumed too, its grammar where the cut left it), hostile version 2 fields, and a message of a
newer schema version handed back, never failed (the structured outputs, hostile fields and
newer versions: tests/test_generation_structured_e2e.py; the witness's answers and the
comparisons with them: tests/contract_witness.py)."""
from __future__ import annotations

import os
import re
import signal
import sys
import uuid
from pathlib import Path

import pytest

from app.local.embedded import start_process, stop_process, vigil_env, wait_for
from app.state import keys
from app.state.streams import TokenStreams
from tasks.inference import generate
from tests.conftest import DRILL_MODEL, WITNESS_DIR
from tests.contract_witness import (NAMED, PROMPT, TOLERANCE, direct, entries_gap, named_gap,
                                    store, worst_gap)
from tests.worker_procs import (RunningWorker, assert_witnessed, engine_processes,
                                wait_processes_gone)
from tests.ghost_attempt import pieces, resubmit_after_a_ghost_attempt
from workers.engine.witness import read_witness

pytestmark = pytest.mark.worker
REPO = Path(__file__).resolve().parents[1]
REAP_TIMEOUT_S = 8


def test_greedy_logprobs_and_prompt_logprobs_equal_a_direct_async_llms(warm_worker):
    """Given a greedy request with logprobs=5 and prompt_logprobs=1, when a real worker serves
    it through generate.delay, then its tokens, every position's chosen logprob, rank, top-5
    alternatives and their strings, its cumulative logprob and its prompt's logprobs equal what
    an AsyncLLM built directly from engine_args answers for the same request (SamplingParams
    written by hand, not by Vigil's mapping). So does a greedy request with logprob_token_ids
    (5 named ids, scoring fixed choices): the logprobs of exactly those ids, in their order, at
    every position, on the real CPU engine."""
    kw = dict(model="tiny-llama", prompt_token_ids=PROMPT, max_tokens=24, temperature=0.0,
              ignore_eos=True, logprobs=5, prompt_logprobs=1)
    r = generate.delay(**kw)
    scored = generate.delay(model="tiny-llama", prompt_token_ids=PROMPT, max_tokens=16,
                            temperature=0.0, ignore_eos=True, logprob_token_ids=NAMED)
    out = r.get(timeout=180)
    raw, raw_named = direct("tiny-llama", [
        {"prompt_token_ids": PROMPT, "sampling": dict(
            max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=1)},
        {"prompt_token_ids": PROMPT, "sampling": dict(
            max_tokens=16, temperature=0.0, ignore_eos=True, logprob_token_ids=NAMED)}])
    named = scored.get(timeout=180)
    ncomp = raw_named["outputs"][0]
    assert named["token_ids"] == ncomp["token_ids"] and len(named["logprobs"]) == 16
    ngap = named_gap(named["logprobs"], ncomp["logprobs"], NAMED)
    print(f"\nlogprob_token_ids vs a direct AsyncLLM: worst |delta| {ngap:.2e}")
    assert ngap <= TOLERANCE
    comp = raw["outputs"][0]
    assert out["token_ids"] == comp["token_ids"] and out["text"] == comp["text"]
    gap = worst_gap(out["logprobs"], comp["logprobs"])
    pgap = worst_gap(out["prompt_logprobs"], raw["prompt_logprobs"])
    assert abs(out["cumulative_logprob"] - comp["cumulative_logprob"]) <= TOLERANCE
    print(f"\nlogprobs vs a direct AsyncLLM: worst |delta| {gap:.2e} (generated), "
          f"{pgap:.2e} (prompt)")
    assert gap <= TOLERANCE and pgap <= TOLERANCE
    assert len(out["prompt_logprobs"]) == len(PROMPT) and out["prompt_logprobs"][0] is None


def test_n_samples_are_one_engine_request_streamed_with_their_index(warm_worker):
    """Given n=4 (sampled, seeded), when served, then the result holds 4 choices, the top level
    is choice 0, the witness shows one generation that made all 4 samples, and the stream's
    chunks, put together by index, are each sample's tokens and text exactly."""
    r = generate.delay(model="tiny-llama", prompt_token_ids=PROMPT, max_tokens=200,
                       temperature=1.0, seed=7, n=4, ignore_eos=True, logprobs=1)
    chunks = list(r.stream(timeout=180))
    out = chunks[-1]["result"]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["completion_tokens"] == 200 for c in out["choices"])
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1  # seeds seed + i differ
    first = out["choices"][0]
    assert (out["text"], out["token_ids"], out["logprobs"]) == (first["text"], first["token_ids"],
                                                                 first["logprobs"])
    runs = read_witness(WITNESS_DIR)[r.id]
    assert len(runs) == 1 and runs[0]["samples"] == [200] * 4, runs
    by_index: dict[int, dict] = {}
    for c in chunks:
        s = by_index.setdefault(c["index"], {"ids": [], "text": "", "lps": []})
        assert c["offset"] == len(s["ids"])
        s["ids"] += c["token_ids"]
        s["text"] += c["text"]
        s["lps"] += c["logprobs"]
    assert len(chunks) > 5  # streamed while it ran, not one chunk per sample at the end
    for c in out["choices"]:
        s = by_index[c["index"]]
        assert (s["ids"], s["text"], s["lps"]) == (c["token_ids"], c["text"], c["logprobs"])


def test_detokenize_false_returns_token_ids_only(warm_worker):
    """Given a greedy request with detokenize=False (and logprobs, prompt logprobs), when a real
    worker serves it, then vLLM was asked not to detokenize: its text is "", in the result and
    in every streamed chunk, and no logprob entry (generated or prompt, chosen or alternative)
    carries a token string, while its token ids and logprobs are its detokenized twin's.
    (Left to vLLM's default, the same request would come back with the twin's text.) The two,
    sent together, both ask prompt_logprobs on tiny-llama, whose engine serves LoRA adapters:
    each runs alone (workers/engine/lora.py), and the engine is not restarted (together, they
    killed it: docs/field-notes.md)."""
    kw = dict(model="tiny-llama", prompt_token_ids=PROMPT, max_tokens=64, temperature=0.0,
              ignore_eos=True, logprobs=2, prompt_logprobs=1)
    before = warm_worker.entry()
    r = generate.delay(**kw, detokenize=False)
    twin = generate.delay(**kw).get(timeout=180)
    chunks = list(r.stream(timeout=180))
    off = chunks[-1]["result"]
    assert twin["text"] and any(e["token"] for e in twin["logprobs"])  # there was text to skip
    assert off["text"] == "" and off["token_ids"] == twin["token_ids"]
    assert all(c["text"] == "" for c in chunks), [c for c in chunks if c["text"] != ""][:3]
    assert [t for c in chunks for t in c["token_ids"]] == off["token_ids"]
    for e in off["logprobs"] + [p for p in off["prompt_logprobs"] if p is not None]:
        assert e["token"] is None and all(t["token"] is None for t in e["top"]), e
    assert [e["logprob"] for e in off["logprobs"]] == [e["logprob"] for e in twin["logprobs"]]
    assert warm_worker.entry()["engine_restarts"] == before["engine_restarts"]


def greedy_text_parts(prompt: list[int], max_tokens: int) -> tuple[dict, list[int], str, list[int]]:
    """An uninterrupted greedy run of `prompt`: (its result, token ids, text, and where each
    token's text ends in it, decoded as vLLM decodes)."""
    whole = generate.delay(model="tiny-llama", prompt_token_ids=prompt, max_tokens=max_tokens,
                           temperature=0.0, ignore_eos=True).get(timeout=180)
    ids, text = whole["token_ids"], whole["text"]
    parts = pieces(prompt, ids)
    assert "".join(parts) == text  # the test decodes as the engine does
    ends = [sum(len(p) for p in parts[:i + 1]) for i in range(len(parts))]
    return whole, ids, text, ends


def test_a_resumed_repetition_penalty_request_equals_its_uninterrupted_twin(warm_worker):
    """Given a greedy request with repetition_penalty=1.3 whose first attempt streamed 70
    tokens (a ghost attempt, tests/ghost_attempt.py), when the worker resumes it (the 70 tokens
    given to the engine as prompt), then its result equals an uninterrupted run's token for token:
    vLLM penalizes tokens of the prompt and of the output alike, so the resumed prefix is
    penalized as the uninterrupted run penalized it (docs/api.md, "Resume": exactly). If vLLM
    ever counted the output alone, the continuation would differ here."""
    kw = dict(model="tiny-llama", prompt_token_ids=PROMPT, max_tokens=160, temperature=0.0,
              ignore_eos=True, repetition_penalty=1.3)
    whole = generate.delay(**kw).get(timeout=180)
    plain, _, _, _ = greedy_text_parts(PROMPT, 160)
    assert whole["token_ids"] != plain["token_ids"]  # the penalty acts on this generation
    k = 70
    ids = whole["token_ids"]
    text = "".join(pieces(PROMPT, ids[:k]))
    r = resubmit_after_a_ghost_attempt(f"rp-{uuid.uuid4()}", kw, PROMPT, [(ids[:k], text)])
    out = r.get(timeout=180)
    assert (out["attempts"], out["resumed_at"]) == (2, [k])
    assert out["token_ids"] == ids and out["text"] == whole["text"]
    assert_witnessed(store(), [r.id])


def test_two_samples_resumed_with_a_stop_string_across_each_seam_end_as_unbroken_runs(
        warm_worker):
    """Given a request of n=2 samples (top_k=1: each sample is the greedy run, so the end is
    known) with a stop string, whose first attempt streamed k tokens of sample 0 and k+1 of
    sample 1, each cut inside the stop string (it begins in text the engine still held back
    and ends in tokens only the next attempt makes), when the worker resumes it, then each
    sample continues from its own tokens and stops at the same token, with the same text, as
    the uninterrupted request's samples, and reports where it took over; the stream, put
    together by sample, is each sample's text."""
    whole, ids, text, ends = greedy_text_parts(PROMPT, 200)
    pick = None
    for k in range(60, 160):
        c0, c1 = ends[k - 1], ends[k]
        if c1 <= c0 or c0 < 3:
            continue
        s = c0 - 3
        stop = text[s:c1 + 3]
        if len(stop) == c1 + 3 - s and text.find(stop) == s and ends[k + 1] > c1:
            pick = (k, s, stop)
            break
    assert pick is not None, "no stop string to split in this generation"
    k, s, stop = pick
    kw = dict(model="tiny-llama", prompt_token_ids=PROMPT, max_tokens=200, temperature=1.0,
              top_k=1, n=2, ignore_eos=True, stop=[stop])
    twin = generate.delay(**kw).get(timeout=180)
    assert [(c["text"], c["finish_reason"]) for c in twin["choices"]] == [(text[:s], "stop")] * 2
    held = len(stop) - 1  # the engine releases all but what might begin a stop string
    samples = [(ids[:k], text[:ends[k - 1] - held]), (ids[:k + 1], text[:ends[k] - held])]
    r = resubmit_after_a_ghost_attempt(f"seam-n2-{uuid.uuid4()}", kw, PROMPT, samples)
    chunks = list(r.stream(timeout=180))
    out = chunks[-1]["result"]
    assert out["attempts"] == 2
    by_index: dict[int, dict] = {}
    for ch in chunks:
        got = by_index.setdefault(ch["index"], {"ids": [], "text": ""})
        assert ch["offset"] == len(got["ids"])
        got["ids"] += ch["token_ids"]
        got["text"] += ch["text"]
    for c, t in zip(out["choices"], twin["choices"], strict=True):
        assert (c["token_ids"], c["text"], c["finish_reason"]) == (
            t["token_ids"], t["text"], "stop"), c["index"]
        assert c["resumed_at"] == [len(samples[c["index"]][0])]
        assert by_index[c["index"]] == {"ids": c["token_ids"], "text": c["text"]}
    runs = [g for g in read_witness(WITNESS_DIR)[r.id] if g["attempt"] == 2]
    assert sorted(g["sample"] for g in runs) == [0, 1], runs


def test_a_sigkill_mid_generation_resumes_with_its_logprobs_and_structured_outputs(
        warm_worker, redis_server, tmp_path):
    """Given a worker of its own pool running a greedy logprobs=5 request and a structured
    (regex) request, both past their first stream write, when its main process is SIGKILLed
    and beat's reaper requeues them to a second worker, then the greedy one resumes from the
    streamed tokens and its result (tokens, every logprob entry, cumulative logprob, prompt
    logprobs) equals an uninterrupted run's within the tolerance; a request of 2 samples resumes
    each sample from its own streamed tokens and logprobs, as an engine run of its own; the
    structured one resumes too (its grammar advanced over the streamed tokens in EngineCore)
    and equals its uninterrupted twin; each ran to its result once by the witness. Then the
    second worker's EngineCore is SIGKILLed under the same kinds of request: both are re-run
    in the same attempt, each continued from the tokens the worker had read."""
    st = store()
    greedy = dict(model=DRILL_MODEL, prompt_token_ids=PROMPT, max_tokens=480, temperature=0.0,
                  ignore_eos=True, logprobs=5, prompt_logprobs=1)
    # Held to letters for longer than max_tokens allows: it runs to its length, streaming.
    shaped = dict(model=DRILL_MODEL, prompt="letters:", max_tokens=480, temperature=0.0,
                  structured={"regex": "[a-z]{4000}"})
    samples = dict(model=DRILL_MODEL, prompt_token_ids=PROMPT, max_tokens=480, temperature=1.0,
                   seed=5, n=2, ignore_eos=True, logprobs=1)
    beat = rescuer = None
    # Both workers' engine steps are slowed (the drill's slow_step, inside EngineCore: logits
    # untouched), so their requests are still generating when each kill comes, however late a
    # loaded machine lets this test see their first chunks.
    victim = RunningWorker(redis_server, "victim31@testhost", tmp_path, pools=DRILL_MODEL,
                           VIGIL_ENGINE="drill", VIGIL_DRILL="slow_step=0.01")
    try:
        inst = victim.wait_engine()["instance_id"]

        def first_chunk(*rs):
            recs = [st.get(r.id) or {} for r in rs]
            assert not any(x.get("status") in keys.TERMINAL for x in recs), [
                (x.get("status"), x.get("error"), x.get("streamed")) for x in recs]
            return all(int(x.get("streamed") or 0) >= 2 for x in recs)

        # The structured one first (its grammar's first step is the slower), then the greedy
        # one: both have streamed, neither has ended, when the kill comes.
        r2 = generate.delay(**shaped)
        wait_for(lambda: first_chunk(r2), 120, 0.02, "the structured request's first chunk")
        r1 = generate.delay(**greedy)
        r3 = generate.delay(**samples)
        wait_for(lambda: first_chunk(r1, r2, r3), 120, 0.02, "the greedy request's first chunk")
        beat = start_process([sys.executable, "-m", "celery", "-A", "app", "beat", "-l", "INFO",
                              "-s", str(tmp_path / "schedule")],
                             vigil_env(redis_server.url,
                                       VIGIL_WORKER_REAP_TIMEOUT=str(REAP_TIMEOUT_S),
                                       VIGIL_ALLOW_SHORT_REAP_TIMEOUT="1"),
                             tmp_path / "beat.log")
        children = engine_processes(victim.proc.pid)
        os.kill(victim.proc.pid, signal.SIGKILL)
        wait_processes_gone(children)
        streamed = {r.id: int(st.get(r.id)["streamed"]) for r in (r1, r2)}
        at_kill = TokenStreams(st.raw).checkpoint(r3.id)
        rescuer = RunningWorker(redis_server, "rescuer31@testhost", tmp_path, pools=DRILL_MODEL,
                                VIGIL_ENGINE="drill", VIGIL_DRILL="slow_step=0.01")
        out1, out2 = r1.get(timeout=300), r2.get(timeout=300)
        assert (out1["attempts"], out2["attempts"]) == (2, 2)
        assert out1["resumed_at"] == [streamed[r1.id]] and streamed[r1.id] < 480
        whole = generate.delay(**greedy).get(timeout=300)  # uninterrupted, same worker
        assert whole.get("resumed_at") is None
        assert out1["token_ids"] == whole["token_ids"] and out1["text"] == whole["text"]
        gap = entries_gap(out1["logprobs"], whole["logprobs"])
        pgap = entries_gap(out1["prompt_logprobs"], whole["prompt_logprobs"])
        cgap = abs(out1["cumulative_logprob"] - whole["cumulative_logprob"])
        print(f"\nresumed at token {streamed[r1.id]} of 480 after a SIGKILL: tokens identical, "
              f"worst |delta| logprob {gap:.2e}, prompt {pgap:.2e}, cumulative {cgap:.2e}")
        assert max(gap, pgap) <= TOLERANCE and cgap <= TOLERANCE * 480
        # The structured request continued its streamed tokens under its grammar, as unbroken.
        assert out2["resumed_at"] == [streamed[r2.id]] and streamed[r2.id] < 480
        shaped_twin = generate.delay(**shaped).get(timeout=300)
        assert (out2["token_ids"], out2["text"]) == (shaped_twin["token_ids"],
                                                     shaped_twin["text"])
        assert re.fullmatch("[a-z]+", out2["text"]) and out2["finish_reason"] == "length"
        assert "not resuming" not in rescuer.log.read_text()
        assert not any(e.reset for e in TokenStreams(st.raw).entries(r2.id))
        # Each of the n samples continued its own tokens, logprobs kept, as runs of their own.
        out3 = r3.get(timeout=300)
        for c in out3["choices"]:
            cp = at_kill.sample(c["index"])
            assert c["token_ids"][:cp.tokens] == cp.token_ids and c["completion_tokens"] == 480
            assert c["logprobs"][:cp.tokens] == cp.logprobs and len(c["logprobs"]) == 480
            assert c.get("resumed_at") == ([cp.tokens] if cp.tokens else None)
        assert sum(at_kill.sample(i).tokens > 0 for i in (0, 1)) >= 1
        runs = [g for g in read_witness(WITNESS_DIR)[r3.id] if g["attempt"] == 2]
        assert sorted(g["sample"] for g in runs) == [0, 1], runs
        assert_witnessed(st, [r1.id, r2.id, r3.id])
        assert st.raw.zscore(keys.WORKERS, inst) is None  # reaped

        # An engine death inside one attempt: the worker re-runs both on a fresh engine, each
        # continued from what the worker read (its attempt stays 1), the structured one under
        # its grammar.
        log_before = len(rescuer.log.read_text())
        r4, r5 = generate.delay(**samples), generate.delay(**{**shaped, "prompt": "again:"})
        wait_for(lambda: first_chunk(r4, r5), 120, 0.02, "both requests' first chunks")
        restarts = int(rescuer.entry()["engine_restarts"])
        for pid in rescuer.engine_core_pids():
            os.kill(pid, signal.SIGKILL)
        out4, out5 = r4.get(timeout=300), r5.get(timeout=300)
        assert int(rescuer.entry()["engine_restarts"]) > restarts
        assert (out4["attempts"], out5["attempts"]) == (1, 1)
        assert all(c["completion_tokens"] == 480 and len(c["logprobs"]) == 480
                   for c in out4["choices"])
        assert any(c.get("resumed_at") for c in out4["choices"])
        assert re.fullmatch("[a-z]+", out5["text"]) and out5.get("resumed_at")
        assert out5["completion_tokens"] == 480
        assert "not resuming" not in rescuer.log.read_text()[log_before:]
        assert_witnessed(st, [r4.id, r5.id])
    finally:
        victim.stop()
        if rescuer is not None:
            rescuer.stop()
        stop_process(beat)
