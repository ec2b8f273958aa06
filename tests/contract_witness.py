"""What the generation-contract tests share (tests/test_generation_contract_e2e.py,
tests/test_generation_structured_e2e.py, tests/test_resume_kinds_e2e.py, and the witness for
tests/test_online_api_e2e.py): their prompt, the logprob tolerance, the app's request store,
vLLM's own answers as the witness outside Vigil (tests/direct_asyncllm.py: an AsyncLLM of its
own), and the comparisons of Vigil's logprob entries with them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from app import app
from app.settings import get_settings
from app.state.store import RequestStore

REPO = Path(__file__).resolve().parents[1]
PROMPT = [1, 300, 301, 302, 303, 304, 305]
# Measured on the CPU engine (docs/field-notes.md, "The generation contract on vLLM CPU 0.32"):
# Vigil's logprobs equal the direct engine's exactly; a resumed run's, computed with the prefix
# as prompt (prefill instead of decode), differ by at most a few 1e-7 here (9.5e-7 measured).
TOLERANCE = 1e-5


def store() -> RequestStore:
    """The app's request store (its Redis, the settings' result TTL)."""
    return RequestStore(app.vigil_store.raw, get_settings().result_ttl)


def direct(model: str, requests: list[dict]) -> list[dict]:
    """vLLM's raw answers to `requests` from tests/direct_asyncllm.py (an AsyncLLM of its
    own, started for them), one dict per request in order."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "direct_asyncllm.py"), model,
                          json.dumps(requests)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=str(REPO))
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def worst_gap(entries: list, raw: list) -> float:
    """The largest |logprob difference| between Vigil's entries and vLLM's raw positions,
    asserting the same chosen token, rank, alternatives and strings at every position."""
    worst = 0.0
    assert len(entries) == len(raw)
    for e, pos in zip(entries, raw):
        if pos is None:
            assert e is None
            continue
        by_id = {i: (x, rank, tok) for i, x, rank, tok in pos}
        mine = {e["token_id"]: (e["logprob"], e["rank"], e["token"]),
                **{t["token_id"]: (t["logprob"], t["rank"], t["token"]) for t in e["top"]}}
        assert set(mine) == set(by_id), (e, pos)
        assert e["token_id"] == pos[0][0]  # vLLM puts the chosen token first
        for i, (x, rank, tok) in mine.items():
            assert (rank, tok) == by_id[i][1:], (i, mine[i], by_id[i])
            worst = max(worst, abs(x - by_id[i][0]))
    return worst


def entries_gap(a: list, b: list) -> float:
    """The largest |logprob difference| between two results' entries, asserting the same
    tokens, ranks, strings and alternatives."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert (x["token_id"], x["rank"], x["token"]) == (y["token_id"], y["rank"], y["token"])
        assert [(t["token_id"], t["rank"], t["token"]) for t in x["top"]] == \
            [(t["token_id"], t["rank"], t["token"]) for t in y["top"]]
        worst = max([worst, abs(x["logprob"] - y["logprob"])]
                    + [abs(s["logprob"] - t["logprob"]) for s, t in zip(x["top"], y["top"])])
    return worst


NAMED = [5, 17, 300, 301, 1999]  # logprob_token_ids: in the vocabulary, some in the prompt


def named_gap(entries: list, raw: list, named: list[int]) -> float:
    """The largest |logprob difference| between Vigil's entries of a logprob_token_ids request
    and vLLM's raw positions, asserting the chosen token, the named ids in their order (rank
    left out) and their strings at every position."""
    worst = 0.0
    assert len(entries) == len(raw)
    for e, pos in zip(entries, raw):
        by_id = {i: (x, rank, tok) for i, x, rank, tok in pos}
        assert e["token_id"] == pos[0][0] and e["token"] == by_id[e["token_id"]][2]
        assert e["rank"] == (None if e["token_id"] in named else by_id[e["token_id"]][1])
        assert [t["token_id"] for t in e["top"]] == named and all(t["rank"] is None
                                                                  for t in e["top"])
        for t in e["top"] + [e]:
            assert t["token"] == by_id[t["token_id"]][2]
            worst = max(worst, abs(t["logprob"] - by_id[t["token_id"]][0]))
    return worst
