"""A resume provoked without a kill, for the worker-tier tests (a kill at an exact token cannot be
had on demand): a "ghost" instance claims the request, the tokens of its first attempt go into
the request's stream through the same fenced append a worker uses, and the request is requeued
and republished as the reaper does, so the live worker runs it as attempt 2, resuming from the
stream. The real SIGKILLs are tests/test_reaper_e2e.py's and
tests/test_generation_contract_e2e.py's."""
from __future__ import annotations

import time
from pathlib import Path

from app import app
from app.requests.models import get_registry
from app.requests.publish import republisher
from app.requests.schemas import parse_request
from app.requests.record_fields import record_fields
from app.settings import get_settings
from app.state.store import RequestStore
from app.state.streams import Chunk, Part, TokenStreams

GHOST = 4242  # the instance id of the made-up first attempt


def pieces(prompt: list[int], token_ids: list[int], model: str = "tiny-llama") -> list[str]:
    """The text each generated token adds, decoded as vLLM decodes it (primed with `prompt`),
    with the model's own tokenizer."""
    from tokenizers import Tokenizer

    from workers.engine.resume import fast_decoder

    tok = Tokenizer.from_file(str(Path(get_registry().get(model).path) / "tokenizer.json"))
    step = fast_decoder(tok)(prompt)
    return [step(t) or "" for t in token_ids]


def resubmit_after_a_ghost_attempt(rid: str, kw: dict, prompt: list[int],
                                   samples: list[tuple[list[int], str]], fingerprint: str = "",
                                   logprobs: list[dict] | None = None):
    """Record `rid` as if a worker ran attempt 1 of request `kw`, streamed `samples[i]`'s token
    ids for sample i (one sample, or one per sample of an n > 1 request), releasing its text
    (and, for one sample, the `logprobs` entries of its tokens), and was reaped: the reaper's
    requeue and republish send it to the live worker as attempt 2. Returns its AsyncResult."""
    store = RequestStore(app.vigil_store.raw, get_settings().result_ttl)
    assert store.create(rid, record_fields(parse_request(kw), time.time(), 600))
    b = store.begin(rid, 0, "ghost@nowhere", GHOST, time.time(), 3)
    assert b.action == "run"

    def counts(ids: list[int], text: str) -> list[int]:
        return [0] * (len(ids) - 1) + [len(text)]

    if len(samples) == 1:
        (ids, text), = samples
        chunk = Chunk(rid, b.token, 1, 0, ids, text, counts(ids, text), prompt_ids=prompt,
                      adapter_fingerprint=fingerprint, logprobs=logprobs)
    else:
        chunk = Chunk(rid, b.token, 1, 0, [], "", [], prompt_ids=prompt,
                      adapter_fingerprint=fingerprint,
                      parts=[Part(i, 0, ids, text, counts(ids, text))
                             for i, (ids, text) in enumerate(samples)])
    assert TokenStreams(app.vigil_store.raw).append_many([chunk]) == [1]
    assert store.requeue(rid, GHOST, 1)
    republisher(app.vigil_ports.send)(rid, store.get(rid), 1)
    return app.AsyncResult(rid)
