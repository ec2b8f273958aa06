"""Worker tier: token streams and resume on a real worker and the real vLLM CPU engine.

- A request's tokens reach a reader while it runs, and the chunks add up to the result exactly
  (text and token ids), from token 0 or after token N, in this process or another (`vigil
  request ID --follow`).
- A resume continues the tokens a previous attempt streamed. The previous attempt here is
  written by the test (a kill at an exact token cannot be had on demand): a "ghost" instance
  claims the request, its tokens go into the stream through the same fenced append a worker
  uses, and the request is requeued and republished as the reaper does (tests/ghost_attempt.py).
  The real kill is tests/test_reaper_e2e.py's (its greedy requests come out token-identical).
"""
from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from app import app
from app.local.embedded import vigil_env
from app.ops.request_view import describe
from app.requests.models import get_registry
from app.settings import get_settings
from app.state.store import RequestStore
from tasks.inference import generate
from tests import ghost_attempt
from tests.ghost_attempt import pieces

pytestmark = pytest.mark.worker
PROMPT = [1, 300, 301, 302, 303, 304]


def greedy(**kw) -> dict:
    return dict(model="tiny-llama", prompt_token_ids=PROMPT, temperature=0.0, ignore_eos=True,
                **kw)


_whole: dict = {}


def whole_run() -> dict:
    """PROMPT's 200-token greedy generation, uninterrupted (run once per session)."""
    if not _whole:
        _whole.update(generate.delay(**greedy(max_tokens=200)).get(timeout=120))
    return _whole


def resubmit_after_a_ghost_attempt(rid: str, kw: dict, token_ids: list[int], text: str,
                                   fingerprint: str = ""):
    """Record `rid` as if a worker ran attempt 1 from PROMPT, streamed `token_ids` (releasing
    `text`) and was reaped (tests/ghost_attempt.py): it runs here as attempt 2."""
    return ghost_attempt.resubmit_after_a_ghost_attempt(rid, kw, PROMPT, [(token_ids, text)],
                                                        fingerprint)


def test_a_request_streams_its_tokens_and_the_chunks_add_up_to_its_result(warm_worker):
    """Given a 256-token greedy request, when a reader follows its stream, then chunks arrive
    before the request ends, in order and without gaps, and their text and token ids add up
    to the result exactly; a reader after token N, here and in another process (`vigil
    request ID --follow --after N`), gets exactly what follows token N."""
    r = generate.delay(**greedy(max_tokens=256))
    chunks, arrived = [], []
    for c in r.stream(timeout=120):
        chunks.append(c)
        arrived.append(time.time())
    res = chunks[-1]["result"]
    assert chunks[-1]["final"] and res == r.get(timeout=10)
    assert "".join(c["text"] for c in chunks) == res["text"]
    assert [t for c in chunks for t in c["token_ids"]] == res["token_ids"]
    offsets = [c["offset"] for c in chunks]
    assert offsets == [sum(len(c["token_ids"]) for c in chunks[:i]) for i in range(len(chunks))]
    finished_at = float(RequestStore(app.vigil_store.raw, 3600).get(r.id)["finished_at"])
    streamed = [c for c, t in zip(chunks, arrived) if not c.get("final") and t < finished_at]
    print(f"\n{len(chunks) - 1} chunks streamed before the end, then the final one")
    assert streamed, "no chunk reached the reader before the request ended"

    n = chunks[1]["offset"] + 3 if len(chunks) > 2 else 3
    tail = list(app.AsyncResult(r.id).stream(after=n, timeout=60))
    assert [t for c in tail for t in c["token_ids"]] == res["token_ids"][n:]
    assert res["text"].endswith("".join(c["text"] for c in tail))
    out = subprocess.run([sys.executable, "-m", "app.ops.cli", "request", r.id, "--follow",
                          "--after", str(n), "--timeout", "60"], capture_output=True,
                         text=True, timeout=120, env=vigil_env(app.conf.broker_url))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "".join(c["text"] for c in tail)
    assert "256 tokens" in out.stderr


def test_a_resumed_request_with_a_stop_string_across_the_seam_ends_as_an_unbroken_run(
        warm_worker):
    """Given a stop string that begins in the text the first attempt's engine still held back
    and ends in tokens only the second attempt makes, when the second attempt resumes from the
    stream, then it stops at the same token with the same text as an uninterrupted run, and
    reports where it took over."""
    whole = whole_run()
    text, ids = whole["text"], whole["token_ids"]
    parts = pieces(PROMPT, ids)
    assert "".join(parts) == text  # the test decodes as the engine does
    ends = [sum(len(p) for p in parts[:i + 1]) for i in range(len(parts))]
    pick = None
    for k in range(60, 160):
        c = ends[k - 1]
        stop = text[c - 3:c + 3]
        if len(stop) == 6 and text.find(stop) == c - 3 and ends[k] > c:
            pick = (k, c, stop)
            break
    assert pick is not None, "no stop string to split in this generation"
    k, c, stop = pick
    unbroken = generate.delay(**greedy(max_tokens=200, stop=[stop])).get(timeout=120)
    assert unbroken["finish_reason"] == "stop" and unbroken["text"] == text[:c - 3]
    # The first attempt made k tokens; its engine released all but the last len(stop) - 1
    # characters (they might have begun the stop string).
    rid = f"seam-{uuid.uuid4()}"  # database 0 is shared: an id of this run's own
    r = resubmit_after_a_ghost_attempt(rid, greedy(max_tokens=200, stop=[stop]), ids[:k],
                                       text[:c - 5])
    chunks = list(r.stream(timeout=120))
    res = chunks[-1]["result"]
    assert res["token_ids"] == unbroken["token_ids"]
    assert res["text"] == unbroken["text"] and res["finish_reason"] == "stop"
    assert res["resumed_at"] == [k] and res["attempts"] == 2
    assert "".join(ch["text"] for ch in chunks) == res["text"]
    view = describe(rid, store=app.vigil_store, settings=get_settings(),
                    registry=get_registry())  # what `vigil request <id>` shows
    assert view["resumed_at"] == [k] and view["tokens_so_far"] == len(res["token_ids"])


def test_a_resume_that_would_be_unsound_restarts_from_the_prompt_and_says_so(warm_worker):
    """Given a stream made with another LoRA adapter's files than the request has now, when the
    next attempt begins, then it does not continue those tokens: the stream restarts at token 0
    (a reader is told), and the result is the uninterrupted run's."""
    whole = whole_run()
    r = resubmit_after_a_ghost_attempt(f"refused-{uuid.uuid4()}", greedy(max_tokens=200),
                                       [7] * 40,
                                       "made with other files", fingerprint="not-these-files")
    chunks = list(r.stream(timeout=120))
    res = chunks[-1]["result"]
    assert res["token_ids"] == whole["token_ids"] and res["text"] == whole["text"]
    assert "resumed_at" not in res
    restart = [i for i, ch in enumerate(chunks) if ch.get("restart")]
    assert restart, chunks[:3]
    assert "".join(ch["text"] for ch in chunks[restart[0]:]) == res["text"]
    assert "not resuming from its 40 generated tokens" in warm_worker.log.read_text()
