"""Worker tier: the generation contract's constraints on a real worker and the real vLLM CPU
engine (issue 31): structured outputs checked by an independent validator, an output the engine
broke ending in a typed error (never a result), an uncompilable schema refused before publish,
hostile version 2 fields sent around the producer ending typed, and a message of a newer
schema version handed back, never failed. The rest of the contract:
tests/test_generation_contract_e2e.py."""
from __future__ import annotations

import json
import re
import uuid

import jsonschema
import pytest

from app import app
from app.errors import RequestError, TerminalError
from app.local.embedded import wait_for
from app.state import broker
from tasks.inference import generate
from tests.conftest import WITNESS_DIR
from tests.contract_witness import store
from workers.engine.witness import read_witness

pytestmark = pytest.mark.worker


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_structured_json_and_choice_hold_to_their_constraint(warm_worker):
    """Given tiny-llama (random weights), a JSON-schema request's text parses and validates
    against the schema by jsonschema, independently of the engine, and a choice request's text
    is one of its choices."""
    r = generate.delay(model="tiny-llama", prompt="Give me a person:", max_tokens=80,
                       temperature=0.0, structured={"json": SCHEMA})
    choice = generate.delay(model="tiny-llama", prompt="Pick one:", max_tokens=10,
                            temperature=0.0, structured={"choice": ["red fox", "blue whale"]})
    regex = generate.delay(model="tiny-llama", prompt="Code:", max_tokens=20, temperature=0.7,
                           seed=1, structured={"regex": "[a-c]{3}-[0-9]{2}"})
    text = r.get(timeout=180)["text"]
    print(f"\nstructured json on tiny-llama: {text!r}")
    jsonschema.validate(json.loads(text), SCHEMA)
    assert choice.get(timeout=180)["text"] in ("red fox", "blue whale")
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", regex.get(timeout=180)["text"])


# tiny-llama's token for the control character U+001A (its byte-level BPE keeps every byte).
CONTROL_TOKEN = 221
# A string with maxLength: xgrammar 0.2.8 compiles it to [^"\\\r\n]{0,4}, so a raw control
# character passes there, which every strict JSON parser refuses (its plain string rule
# excludes U+0000-U+001F: a string without maxLength cannot carry one).
SHORT = {"type": "object", "additionalProperties": False, "required": ["s"],
         "properties": {"s": {"type": "string", "maxLength": 4}}}


def test_an_output_the_engine_broke_is_a_typed_error_never_a_result(warm_worker):
    """Given a JSON schema whose string has maxLength and a logit_bias that makes tiny-llama
    pick U+001A wherever the grammar lets it (the issue's repro, made certain), when a greedy
    and a sampled request ask for it, then neither returns the invalid text: the greedy one
    ends at once (`attempts_exhausted` after 1 attempt: another would make the same output),
    the sampled one after VIGIL_MAX_ATTEMPTS (3) attempts (each could have differed), both
    naming `structured_output_invalid` and the strict parser's reason. The engine did finish
    each attempt's generation (the witness), so only the check stood between it and the
    caller."""
    kw = dict(model="tiny-llama", prompt="Give me a code:", max_tokens=40,
              structured={"json": SHORT}, logit_bias={str(CONTROL_TOKEN): 100})
    greedy = generate.delay(temperature=0.0, **kw)
    sampled = generate.delay(temperature=1.0, **kw)
    for r, attempts in ((greedy, 1), (sampled, 3)):
        with pytest.raises(TerminalError) as e:
            r.get(timeout=180)
        assert str(e.value).startswith(f"attempts_exhausted: {attempts} attempt"), e.value
        assert "structured_output_invalid: " in str(e.value)
        assert "not strict JSON: Invalid control character" in str(e.value)
        ran = sorted(g["attempt"] for g in read_witness(WITNESS_DIR)[r.id])
        assert ran == list(range(1, attempts + 1)), ran


def test_an_uncompilable_schema_is_refused_before_anything_is_published(warm_worker):
    """A schema valid by its metaschema but not compilable by tiny-llama's backend (a $ref to
    nothing) fails invalid_request in the producer: no record, no message."""
    rid = f"uncompilable-{uuid.uuid4()}"
    with pytest.raises(RequestError, match=r"^invalid_request: structured \(json\) cannot be "
                                           r"compiled by tiny-llama's structured-output"):
        generate.apply_async(kwargs=dict(model="tiny-llama", prompt="x", structured={
            "json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}),
            task_id=rid)
    # Its own keys only: the pool's queue is shared with the other tests of the session.
    assert store().get(rid) is None
    assert rid not in broker.queued_ids(app.vigil_store.raw, ["vigil.pool.tiny-llama"],
                                        unacked=True)


def test_hostile_version_2_fields_sent_around_the_producer_end_typed(warm_worker):
    """n = 10^9, NaN penalties, 100,000 logit_bias entries, a 200-deep schema, wrong types,
    sent with send_task (no producer checks): each ends invalid_request in the worker, nothing
    reaches the engine (no restart), and the worker serves a request after them."""
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    base = {"model": "tiny-llama", "prompt": "hi", "schema_version": 2}
    hostile = [{"n": 10**9, "temperature": 1.0}, {"presence_penalty": float("nan")},
               {"logit_bias": {str(i): 1.0 for i in range(100_000)}},
               {"structured": {"json": deep}}, {"logprobs": "5"}, {"n": 4, "temperature": 0},
               {"allowed_token_ids": [9999]}, {"structured": {"grammar": "root ::= nope"}}]
    before = warm_worker.entry()
    sent = [app.send_task("vigil.generate", kwargs={**base, **h}, queue="vigil.pool.tiny-llama")
            for h in hostile]
    fine = generate.delay(model="tiny-llama", prompt="still serving", max_tokens=3, n=2,
                          temperature=1.0)
    for h, res in zip(hostile, sent):
        with pytest.raises(RequestError) as ei:
            res.get(timeout=120)
        assert ei.value.code in ("invalid_request", "token_out_of_vocab"), (h, ei.value)
    assert len(fine.get(timeout=120)["choices"]) == 2
    after = warm_worker.entry()
    assert (after["engine_loads"], after["engine_restarts"]) == (before["engine_loads"],
                                                                 before["engine_restarts"])


def test_a_message_of_a_newer_version_is_handed_back_by_a_real_worker(warm_worker):
    """Given a message of schema_version 4 with a field no worker here knows, sent around the
    producer, when the real worker takes it, then it is never failed invalid_request: it is
    recorded, handed back again and again (schema_too_new, no attempt used) for a worker that
    reads version 4, and ends only by its deadline (deadline_exceeded)."""
    assert warm_worker.entry()["schema_versions"] == "1,2,3"  # what the producer's gate reads
    r = app.send_task("vigil.generate", queue="vigil.pool.tiny-llama", kwargs={
        "model": "tiny-llama", "prompt": "from the future", "schema_version": 4,
        "speculative_mode": {"depth": 4}, "deadline_s": 8})
    wait_for(lambda: int((store().get(r.id) or {}).get("dispatch") or 0) >= 2, 60, 0.2,
             "two hand-backs")
    rec = store().get(r.id)
    assert rec["status"] in ("PENDING", "RUNNING") and rec["attempts"] == "0"
    assert rec["last_error"].startswith("schema_too_new: schema_version 4 ")
    with pytest.raises(TerminalError, match="^deadline_exceeded: "):
        r.get(timeout=120)
