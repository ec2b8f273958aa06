"""Unit tier: the exactly-once check on the engines' witness (tests/conftest.py
`assert_witnessed`, workers/engine/witness.py) over witness files written by the real `Witness`
into a directory of the test's own, against stored records a fake store returns. It must go red
on a request that ran to completion twice, and only a request named with its allowance may."""
from __future__ import annotations

import json

import pytest

from app.request_ids import attempt_id, canary_id, run_id
from tests.worker_procs import assert_witnessed
from workers.engine.witness import (Witness, finished_generations, read_canaries,
                                    read_witness)


class Records:
    """A store's `get` over records the test writes: a SUCCEEDED record per request, its
    result's attempt and token count as given."""

    def __init__(self, **results):
        self.results = results

    def get(self, rid):
        attempts, tokens = self.results[rid]
        return {"status": "SUCCEEDED",
                "result": json.dumps({"attempts": attempts, "completion_tokens": tokens})}


@pytest.fixture()
def witness(tmp_path):
    w = Witness(tmp_path)
    yield w
    w._file.close()


def test_one_finished_generation_per_request_passes_and_canaries_belong_to_none(
        witness, tmp_path):
    witness.finished(canary_id(0), 1)
    witness.finished(attempt_id("a", 1), 8)
    witness.finished(canary_id(1), 1)  # a restarted engine's canary
    witness.finished(run_id(attempt_id("b", 1), 2), 8)  # re-run after an engine death
    # Resumed on attempt 2 from 3 streamed tokens: a killed first attempt wrote nothing.
    witness.finished(attempt_id("c", 2), 5, 3)
    store = Records(a=(1, 8), b=(1, 8), c=(2, 8))
    assert assert_witnessed(store, ["a", "b", "c"], witness_dir=tmp_path) == {
        "a": 1, "b": 1, "c": 1}
    seen = read_witness(tmp_path)
    assert set(seen) == {"a", "b", "c"}  # no "vigil-canary" request
    assert [c["engine_request_id"] for c in read_canaries(tmp_path)] == [canary_id(0),
                                                                          canary_id(1)]


def test_a_request_run_to_completion_twice_fails_the_check(witness, tmp_path):
    # Its first attempt finished in the engine, and it ran again as attempt 2: the stored
    # result (attempt 2) is backed, yet the engine ran it to completion twice.
    witness.finished(attempt_id("twice", 1), 8)
    witness.finished(attempt_id("twice", 2), 8)
    witness.finished(attempt_id("once", 1), 8)
    store = Records(twice=(2, 8), once=(1, 8))
    with pytest.raises(AssertionError, match=r"twice.*ran to completion 2 times \(allowed 1\)"):
        assert_witnessed(store, ["once", "twice"], witness_dir=tmp_path)
    # The same attempt finishing twice (a duplicated generation) fails the same way.
    witness.finished(attempt_id("once", 1), 8)
    with pytest.raises(AssertionError, match=r"once.*ran to completion 2 times"):
        assert_witnessed(store, ["once"], witness_dir=tmp_path)


def test_only_the_requests_named_with_an_allowance_may_have_more(witness, tmp_path):
    for rid in ("held", "other"):
        witness.finished(attempt_id(rid, 1), 8)
        witness.finished(attempt_id(rid, 2), 8)
    store = Records(held=(2, 8), other=(2, 8))
    assert assert_witnessed(store, ["held"], at_most={"held": 2},
                            witness_dir=tmp_path) == {"held": 2}
    with pytest.raises(AssertionError, match="other.*ran to completion 2 times"):
        assert_witnessed(store, ["held", "other"], at_most={"held": 2}, witness_dir=tmp_path)
    witness.finished(attempt_id("held", 3), 8)
    with pytest.raises(AssertionError, match=r"held.*3 times \(allowed 2\)"):
        assert_witnessed(Records(held=(3, 8)), ["held"], at_most={"held": 2},
                         witness_dir=tmp_path)


def test_a_run_that_continued_n_samples_is_one_generation(witness, tmp_path):
    # Attempt 2 continued both samples of an n=2 request: one line per sample, one run.
    witness.finished(attempt_id("n2", 2), 6, 2)
    witness.finished(attempt_id("n2", 2), 8, 0, sample=1)
    # A run from the prompt made all samples at once: one line.
    witness.finished(attempt_id("whole", 1), 8, samples=[8, 8])
    assert finished_generations(read_witness(tmp_path)["n2"]) == 1
    assert assert_witnessed(Records(n2=(2, 8), whole=(1, 8)), ["n2", "whole"],
                            witness_dir=tmp_path) == {"n2": 1, "whole": 1}


def test_a_stored_result_no_generation_backs_fails_the_check(witness, tmp_path):
    witness.finished(attempt_id("short", 1), 5)
    witness.finished(attempt_id("elsewhere", 1), 8)
    with pytest.raises(AssertionError, match="short.*stored attempt 1, 8 tokens"):
        assert_witnessed(Records(short=(1, 8)), ["short"], witness_dir=tmp_path)
    with pytest.raises(AssertionError, match="elsewhere.*stored attempt 2"):
        assert_witnessed(Records(elsewhere=(2, 8)), ["elsewhere"], witness_dir=tmp_path)
    with pytest.raises(AssertionError, match="never.*the witness saw \\[\\]"):
        assert_witnessed(Records(never=(1, 8)), ["never"], witness_dir=tmp_path)


def test_the_soak_counts_runs_to_completion_and_allows_two_only_where_a_worker_was_killed(
        witness, tmp_path):
    """bench/soak_findings.py: a request run to completion twice is a problem of the soak's
    report unless the killed worker held it at its kill; canaries are counted apart."""
    from bench.soak_findings import tally_witness
    from bench.soak_report import Kill, SoakReport

    rec = {"status": "SUCCEEDED", "result": json.dumps({"attempts": 2, "completion_tokens": 8})}
    for rid in ("held", "stray"):
        witness.finished(attempt_id(rid, 1), 8)
        witness.finished(attempt_id(rid, 2), 8)
    witness.finished(canary_id(0), 1)
    rep = SoakReport(requests=2, kills=[Kill("worker", "victim", 0.0, ["held"]),
                                        Kill("engine", "steady", 0.0, ["stray"])])
    tally_witness(rep, {"held": rec, "stray": rec}, tmp_path)
    assert (rep.ran_too_often, rep.ran_too_often_ids) == (1, ["stray"])
    assert rep.generations_per_request == {2: 2} and rep.witness_canaries == 1
    assert rep.witness_generations == 5 and rep.witness_mismatches == 0
    assert "ran_too_often 1" in rep.problems()
