"""Worker tier: every request kind resumed at several cut points equals its uninterrupted twin
(issue 38; docs/api.md, "Resume"), on the shared warm worker and the real vLLM CPU engine.

Each resume is provoked without a kill (tests/ghost_attempt.py): a made-up first attempt streams
the twin's first k tokens (their text, their logprob entries) and is reaped; the worker then
runs the request as attempt 2, continuing those k tokens. Greedy, so the twin is the one right
answer: tokens, text, finish reason and every logprob entry (within the tolerance of a prefill
against decode steps, docs/field-notes.md) must come out the same, and the witness must show one
finished generation per request. Kinds: presence and frequency penalties (with repetition
penalty), structured outputs (a JSON schema, a regex, a choice), a bad word whose first token
ends the prefix, stop strings inside `min_tokens`, and a stop token's text."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import jsonschema
import pytest

from app.requests.models import get_registry
from tasks.inference import generate
from tests.worker_procs import assert_witnessed
from tests.ghost_attempt import pieces, resubmit_after_a_ghost_attempt
from tests.contract_witness import PROMPT, TOLERANCE, entries_gap, store

pytestmark = pytest.mark.worker
MAX = 64


def twin_of(**kw) -> tuple[dict, dict]:
    """A greedy request (logprobs=2) and its uninterrupted result."""
    kw = {"model": "tiny-llama", "prompt_token_ids": PROMPT, "max_tokens": MAX,
          "temperature": 0.0, "logprobs": 2, **kw}
    return kw, generate.delay(**kw).get(timeout=180)


def resumed(kw: dict, twin: dict, cuts: list[int], hold: int = 0) -> list[tuple[int, dict]]:
    """`kw` resumed from the twin's first k tokens for each k of `cuts`, all at once: each
    ghost attempt streamed those tokens, their logprob entries, and their text less the last
    `hold` characters (what vLLM holds back for stop strings). Returns (k, result) pairs."""
    ids = twin["token_ids"]
    runs = []
    for k in cuts:
        assert 0 < k < len(ids), k
        text = "".join(pieces(PROMPT, ids[:k]))
        text = text[:max(0, len(text) - hold)]
        runs.append((k, resubmit_after_a_ghost_attempt(
            f"kind-{uuid.uuid4()}", kw, PROMPT, [(ids[:k], text)],
            logprobs=twin["logprobs"][:k])))
    out = [(k, r.get(timeout=180)) for k, r in runs]
    assert_witnessed(store(), [r.id for _, r in runs])
    return out


def assert_twins(results: list[tuple[int, dict]], twin: dict) -> float:
    """Each resumed result took over at its cut and equals the twin; returns the worst
    logprob gap."""
    worst = 0.0
    for k, res in results:
        assert (res["attempts"], res.get("resumed_at")) == (2, [k]), k
        assert res["token_ids"] == twin["token_ids"], (k, res["token_ids"], twin["token_ids"])
        assert (res["text"], res["finish_reason"]) == (twin["text"], twin["finish_reason"]), k
        worst = max(worst, entries_gap(res["logprobs"], twin["logprobs"]))
    assert worst <= TOLERANCE
    return worst


def cuts_of(twin: dict) -> list[int]:
    n = len(twin["token_ids"])
    return sorted({1, n // 3, (2 * n) // 3, n - 1} - {0})


def test_penalized_requests_resumed_at_several_cuts_equal_their_twins(warm_worker):
    """Given greedy requests with a presence penalty, a frequency penalty, and all three
    penalties together (repetition too), each acting on its generation (the twin differs from
    the unpenalized run), when each is resumed from its twin's first k tokens at four cut
    points, then every result equals its twin: EngineCore counted the prefix's tokens as
    generated (workers/engine/resume_steps.py). vLLM alone would count only the tokens made
    after the cut and the continuation would differ."""
    _, plain = twin_of(ignore_eos=True)
    for pen in ({"presence_penalty": 1.5}, {"frequency_penalty": 0.9},
                {"presence_penalty": 0.7, "frequency_penalty": -0.4, "repetition_penalty": 1.3}):
        kw, twin = twin_of(ignore_eos=True, **pen)
        assert twin["token_ids"] != plain["token_ids"], pen  # the penalty acts
        gap = assert_twins(resumed(kw, twin, cuts_of(twin)), twin)
        print(f"\n{pen}: resumed at {cuts_of(twin)} equal the twin, worst |delta| {gap:.1e}")


# Strings held to a pattern: xgrammar lets raw control characters into a bare maxLength string,
# which Vigil's check refuses (structured_output_invalid, docs/failure-modes.md); the structure
# across the seam is what this test is about.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,24}$"},
                         "tags": {"type": "array", "items": {"type": "string",
                                                             "pattern": "^[a-z]{1,6}$"},
                                  "maxItems": 3}}}


def test_structured_requests_resumed_at_several_cuts_equal_their_twins(warm_worker):
    """Given greedy requests held to a JSON schema, a regex and a choice, when each is resumed
    from its twin's first k tokens at several cut points (inside a string, between keys, inside
    the choice), then every result equals its twin, logprobs included (the grammar's mask is
    vLLM's own, before the sampler), and the JSON parses and validates: the continuing run's
    grammar started where its prefix left it (workers/engine/resume_grammar.py). From the
    grammar's start state the continuation would be held to a fresh object or pattern."""
    for structured in ({"json": SCHEMA}, {"regex": "[a-z]{4}( [a-z]{2,7}){0,40}"},
                       {"choice": ["silver snow window", "thunder road"]}):
        kw, twin = twin_of(structured=structured)
        if "json" in structured:
            jsonschema.validate(json.loads(twin["text"]), SCHEMA)
        cuts = cuts_of(twin)
        assert len(cuts) >= 2, (structured, twin["token_ids"])
        gap = assert_twins(resumed(kw, twin, cuts), twin)
        print(f"\n{list(structured)[0]}: {twin['text'][:50]!r} resumed at {cuts} equal the "
              f"twin, worst |delta| {gap:.1e}")


def seam_word(ids: list[int]) -> tuple[int, str] | None:
    """A position j and a word whose tokens, as vLLM tokenizes a bad word, are ids[j-1:j+1]
    (two tokens, the first not seen before): banning it changes the greedy run at j."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(get_registry().get("tiny-llama").path) /
                                  "tokenizer.json"))
    for j in range(6, len(ids) - 4):
        word = tok.decode(ids[j - 1:j + 1])
        if (word.strip() == word and len(word) >= 3 and ids[j - 1] not in ids[:j - 1]
                and tok.encode(word, add_special_tokens=False).ids == ids[j - 1:j + 1]):
            return j, word
    return None


def test_a_bad_word_split_across_the_seam_is_still_banned(warm_worker):
    """Given a greedy request whose bad word is two tokens, and a cut right after the word's
    first token (the second would have come next), when it is resumed there and at two other
    cuts, then each result equals the uninterrupted twin, which never says the word: the ban
    looked back across the seam (workers/engine/resume_steps.py). vLLM alone looks back at the
    continuing run's own tokens only, and would let the word through."""
    _, plain = twin_of(ignore_eos=True)
    found = seam_word(plain["token_ids"])
    assert found is not None, "no two-token word to ban in this generation"
    j, word = found
    kw, twin = twin_of(ignore_eos=True, bad_words=[word])
    assert twin["token_ids"][:j] == plain["token_ids"][:j]
    assert twin["token_ids"][j] != plain["token_ids"][j]  # banned right there
    cuts = [j, max(1, j - 3), j + 2]
    assert_twins(resumed(kw, twin, cuts), twin)


def test_stop_strings_of_a_resumed_run_wait_for_min_tokens(warm_worker):
    """Given a greedy request with a stop string that first ends inside its min_tokens (which
    vLLM does not stop for) and again later, when it is resumed from 3 tokens and at other
    cuts inside min_tokens, then each stops where the twin stopped, with its text: the seam
    checks stop strings only past min_tokens, counting the checkpoint's tokens (issue 38,
    item 2; before, the resume stopped at the first occurrence)."""
    _, plain = twin_of(ignore_eos=True, max_tokens=120)
    ids, text = plain["token_ids"], plain["text"]
    parts = pieces(PROMPT, ids)
    ends = [sum(len(p) for p in parts[:i + 1]) for i in range(len(parts))]
    pick = None
    for c1 in range(4, 40):  # a stop string that token c1 (1-based) ends, seen again later
        stop = parts[c1 - 1]
        later = text.find(stop, ends[c1 - 1])
        if len(stop.strip()) >= 2 and 0 < later and later + len(stop) <= ends[80]:
            pick = (c1, stop)
            break
    assert pick is not None, ("no stop string that repeats in this generation", repr(parts[:24]))
    c1, stop = pick
    kw, twin = twin_of(ignore_eos=True, max_tokens=120, stop=[stop], min_tokens=c1)
    assert twin["finish_reason"] == "stop" and len(twin["token_ids"]) > c1
    assert_twins(resumed(kw, twin, sorted({3, c1 - 1, c1}), hold=len(stop) - 1), twin)


def test_a_resumed_run_leaves_out_the_text_of_its_stop_token(warm_worker):
    """Given a greedy request with a stop token (a token of its own generation, with text),
    when it is resumed at several cuts before that token, the last right before it, then each
    ends as the twin ends: the stop token among its ids, its text left out, as vLLM leaves it
    out (issue 38, item 3; before, the resumed text ended with the token's text)."""
    _, plain = twin_of(ignore_eos=True)
    ids = plain["token_ids"]
    parts = pieces(PROMPT, ids)
    j = next(i for i in range(8, len(ids)) if ids[i] not in ids[:i] and parts[i].strip())
    kw, twin = twin_of(ignore_eos=True, stop_token_ids=[ids[j]])
    assert twin["token_ids"] == ids[:j + 1] and twin["finish_reason"] == "stop"
    assert twin["text"] == "".join(parts[:j])  # vLLM leaves the stop token's text out
    assert_twins(resumed(kw, twin, [2, j // 2, j]), twin)
