"""Worker tier: `generate.delay` end to end through a real `celery worker` process running the
real vLLM CPU engine on tiny-llama. One warm worker is shared (its engine load is what
test_200_concurrent_requests checks, so the load count is read before and after)."""
from __future__ import annotations

import uuid

import pytest

from app import app
from app.errors import RequestError
from app.local.embedded import wait_for
from app.state import broker, keys
from app.state.store import RequestStore
from tasks.inference import generate
from tests.worker_procs import assert_witnessed

pytestmark = pytest.mark.worker


def fresh_entry(worker) -> dict:
    """The worker's registry entry from a heartbeat written after this call."""
    seen = float(worker.entry()["last_seen"])
    return wait_for(lambda: (e := worker.entry()) and float(e["last_seen"]) > seen and e, 30,
                    what="a fresh heartbeat")


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def test_200_concurrent_requests_all_succeed_on_one_engine_load_and_are_batched(warm_worker):
    """Given a warm worker, when 200 requests are submitted at once, then all succeed on the first
    attempt, the engine was loaded exactly once, and the engine held many requests at once."""
    loads_before = int(warm_worker.entry()["engine_loads"])
    rs = [generate.delay(model="tiny-llama", prompt=f"the cat number {i} finds", max_tokens=16,
                         ignore_eos=True, temperature=0.0, job="e2e") for i in range(200)]
    outs = [r.get(timeout=300) for r in rs]
    assert [o["request_id"] for o in outs] == [r.id for r in rs]
    assert all(o["completion_tokens"] == 16 and len(o["token_ids"]) == 16 for o in outs)
    assert all(o["attempts"] == 1 and o["worker"] == "warm@testhost" for o in outs)
    assert all(o["model"] == "tiny-llama" and o["finish_reason"] == "length" for o in outs)
    assert int(warm_worker.entry()["engine_loads"]) == loads_before  # no reload for the 200
    # Many of these 200 ran at once (from their own attempts' times, not the shared worker's
    # peak, which an earlier test may have set).
    store = RequestStore(warm_worker.client, 3600)
    spans = [(e["started_at"], e["ended_at"]) for r in rs for e in store.history(r.id)]
    peak = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    print(f"\n200 requests: at most {peak} ran at once")
    assert peak > 1


def test_greedy_generation_is_deterministic_across_requests(warm_worker):
    a, b = (generate.delay(model="tiny-llama", prompt="Alice reads a book", max_tokens=8,
                           temperature=0.0) for _ in range(2))
    assert a.get(timeout=120)["token_ids"] == b.get(timeout=120)["token_ids"]


def test_a_duplicate_delivery_returns_the_stored_result_without_touching_the_engine(
        warm_worker, store):
    """Given a finished request, when its message is delivered again (same id), then the worker
    answers with the stored result and the engine serves nothing new."""
    q = "vigil.pool.tiny-llama"
    r = generate.delay(model="tiny-llama", prompt="the river sings", max_tokens=8)
    first = r.get(timeout=120)
    dups = store.stats().get("duplicate_deliveries", 0)
    again = app.send_task("vigil.generate", kwargs={"model": "tiny-llama",
                                                    "prompt": "the river sings", "max_tokens": 8},
                          task_id=r.id, queue=q)
    # Answered: a duplicate delivery counted since the copy was sent, and the copy gone from
    # the queue, kombu's unacked hash and the worker's hands (this request's own keys).
    inst = warm_worker.entry()["instance_id"]
    wait_for(lambda: store.stats().get("duplicate_deliveries", 0) > dups
             and r.id not in broker.queued_ids(store.raw, [q], unacked=True)
             and not store.raw.sismember(keys.inflight(inst), r.id), 60, 0.1,
             "the duplicate delivery to be answered")
    assert again.get(timeout=60) == first
    assert [h["outcome"] for h in store.history(r.id)] == ["succeeded"]
    assert_witnessed(store, [r.id])  # the engine ran it once: nothing new for the copy


def test_resubmitting_the_same_request_id_is_one_request(warm_worker):
    rid = f"fixed-id-{uuid.uuid4()}"  # chosen by the caller, unique to this run
    r1 = generate.apply_async(kwargs={"model": "tiny-llama", "prompt": "one", "max_tokens": 4},
                              task_id=rid)
    out = r1.get(timeout=120)
    r2 = generate.apply_async(kwargs={"model": "tiny-llama", "prompt": "one", "max_tokens": 4},
                              task_id=rid)
    assert r2.id == rid and r2.get(timeout=30) == out


def test_a_text_prompt_longer_than_the_context_fails_at_once_with_prompt_too_long(
        warm_worker, store):
    r = generate.delay(model="tiny-llama", prompt="word " * 700, max_tokens=4)
    with pytest.raises(RequestError) as ei:
        r.get(timeout=120)
    assert ei.value.code == "prompt_too_long"
    rec = store.get(r.id)
    assert rec["status"] == "FAILED" and rec["attempts"] == "1"


def test_client_errors_the_engine_refuses_fail_at_once_and_keep_the_engine_warm(
        warm_worker, store):
    """Given a warm engine, when a request only the engine can refuse reaches it (a text prompt
    past max_model_len: its token count needs the tokenizer), then it fails on its first attempt
    with its precise code, `r.get()` raises a RequestError whose message starts with the code,
    and the engine is neither restarted nor reloaded. Token ids past the vocabulary, sent around
    the producer's own check, meet the same admit in the worker (app/requests/admit.py): they
    fail with their code before any attempt begins, never reaching the engine."""
    before = fresh_entry(warm_worker)
    too_long = generate.delay(model="tiny-llama", prompt="word " * 700, max_tokens=4)
    oov = app.send_task("vigil.generate", kwargs={"model": "tiny-llama",
                                                  "prompt_token_ids": [5, 999_999]},
                        queue="vigil.pool.tiny-llama")
    fine = generate.delay(model="tiny-llama", prompt="still serving", max_tokens=4,
                          ignore_eos=True)
    for r, code, attempts in ((too_long, "prompt_too_long", [("failed", "prompt_too_long")]),
                              (oov, "token_out_of_vocab", [])):
        with pytest.raises(RequestError, match=f"^{code}: ") as ei:
            r.get(timeout=120)
        assert ei.value.code == code
        assert [(h["outcome"], h["error"]) for h in store.history(r.id)] == attempts
    assert fine.get(timeout=120)["completion_tokens"] == 4
    after = fresh_entry(warm_worker)
    assert after["engine_loads"] == before["engine_loads"]
    assert after["engine_restarts"] == before["engine_restarts"]


def test_a_message_sent_around_the_producer_is_validated_in_the_worker(warm_worker):
    bad = app.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": 7},
                        queue="vigil.pool.tiny-llama")
    with pytest.raises(RequestError, match="^invalid_request: prompt"):
        bad.get(timeout=60)
    unknown = app.send_task("vigil.generate", kwargs={"model": "ghost", "prompt": "x"},
                            queue="vigil.pool.tiny-llama")
    with pytest.raises(RequestError, match="^model_not_found: "):
        unknown.get(timeout=60)


def test_an_expired_message_ends_with_deadline_exceeded_not_a_celery_revoke(warm_worker):
    """Given a message whose Celery `expires` has passed, when the worker meets it, then it is not
    run and `r.get()` raises Vigil's deadline_exceeded (not TaskRevokedError)."""
    import datetime as dt

    from app.errors import TerminalError

    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)
    r = app.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": "late"},
                      queue="vigil.pool.tiny-llama", expires=past)
    # Celery stores REVOKED first and Vigil's handler replaces it an instant later (a caller
    # already blocked in r.get() can see the REVOKED: docs/api.md, Waiting); poll fresh results.
    wait_for(lambda: app.AsyncResult(r.id).state == "FAILURE", 60,
             what="the expired message to end as a failure")
    with pytest.raises(TerminalError, match="^deadline_exceeded: "):
        app.AsyncResult(r.id).get(timeout=5)


def _raw_envelope(body: bytes, request_id: str, queue: str) -> str:
    """A message as kombu's Redis transport stores it in a queue list (the JSON envelope of a
    real `send_task` publish, read back with LRANGE), carrying `body` as its body."""
    import base64
    import json

    return json.dumps({
        "body": base64.b64encode(body).decode(), "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": "vigil.generate", "id": request_id, "retries": 0,
                    "root_id": request_id, "argsrepr": "()", "kwargsrepr": "{}",
                    "timelimit": [None, None], "eta": None, "expires": None},
        "properties": {"correlation_id": request_id, "reply_to": "raw", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": request_id + "-tag"}})


def test_hostile_raw_and_pickled_messages_end_typed_and_the_worker_keeps_serving(
        warm_worker, store, redis_server):
    """Given the warm worker, when messages bypass the producer (hostile kwargs by send_task, a
    malformed body and a non-JSON entry pushed raw onto the pool's queue, a pickled message),
    then each request with an id ends in a typed error, the pickle is refused unexecuted, and
    the worker, still alive on the same engine, serves a normal request after them."""
    import uuid

    from kombu import Connection, Producer

    q = "vigil.pool.tiny-llama"
    before = fresh_entry(warm_worker)
    r = redis_server.client()
    # The envelope shape is kombu's own: publish to a scratch queue and read it back.
    from kombu import Queue
    scratch = f"vigil.scratch.{uuid.uuid4().hex[:8]}"
    app.send_task("vigil.generate", kwargs={"model": "tiny-llama", "prompt": "x"},
                  queue=Queue(scratch), task_id=f"scratch-envelope-{uuid.uuid4()}")
    real = r.lrange(scratch, 0, -1)
    r.delete(scratch)
    assert set(json_keys(real[0])) == set(json_keys(_raw_envelope(b"[]", "x", q)))

    hostile = [
        ("unsupported_version", {"model": "tiny-llama", "prompt": "hi", "schema_version": "2"}),
        ("invalid_request", {"model": "tiny-llama", "prompt": "x" * 400_000}),
        ("invalid_request", {"model": {"nested": ["tiny-llama"] * 1000}, "prompt": "hi"}),
        ("invalid_request", {"model": "tiny-llama", "prompt": "hi", "stop": [[[[]]]] * 100}),
        ("model_not_found", {"model": "ghost-" + "é" * 100, "prompt": "hi"}),
    ]
    sent = [(code, app.send_task("vigil.generate", kwargs=kw, queue=q)) for code, kw in hostile]
    surrogate = app.send_task("vigil.generate", kwargs={"model": "tiny-llama",
                                                        "prompt": "lone \ud800 surrogate"},
                              queue=q)
    positional = app.send_task("vigil.generate", args=["tiny-llama", "hi"], queue=q)
    raw_id = f"raw-{uuid.uuid4()}"
    r.lpush(q, _raw_envelope(b'"not [args, kwargs, embed]"', raw_id, q))
    junk = b"{this is not a kombu envelope " + uuid.uuid4().hex.encode()
    r.lpush(q, junk)
    pickled_id = f"pickled-{uuid.uuid4()}"
    with Connection(redis_server.url) as conn:
        Producer(conn.default_channel).publish(
            ((), {"model": "tiny-llama", "prompt": "pickled"}, {}), serializer="pickle",
            exchange="", routing_key=q,
            headers={"task": "vigil.generate", "id": pickled_id, "retries": 0})
    fine = generate.delay(model="tiny-llama", prompt="still serving", max_tokens=4,
                          ignore_eos=True)

    for code, res in sent:
        with pytest.raises(RequestError, match=f"^{code}: "):
            res.get(timeout=60)
    for res in (surrogate, positional, app.AsyncResult(raw_id)):
        with pytest.raises(RequestError, match="^invalid_request: "):
            res.get(timeout=60)
    assert fine.get(timeout=120)["completion_tokens"] == 4
    wait_for(lambda: "Refusing to deserialize untrusted content of type pickle"
             in warm_worker.log.read_text(), 30, what="the pickle's refusal in the worker log")
    assert "not a kombu message" in warm_worker.log.read_text()
    assert store.get(pickled_id) is None and app.AsyncResult(pickled_id).state == "PENDING"
    # None of this test's entries is left in the queue (others' may be: it is shared).
    ours = {raw_id, pickled_id, surrogate.id, positional.id} | {res.id for _, res in sent}
    left = [raw for key in broker.queue_lists(q) for raw in r.lrange(key, 0, -1)
            if raw == junk or broker.message_id(raw) in ours]
    assert not left and warm_worker.proc.poll() is None
    after = fresh_entry(warm_worker)
    assert (after["engine_loads"], after["engine_restarts"]) == (before["engine_loads"],
                                                                 before["engine_restarts"])


def json_keys(envelope) -> list[str]:
    """The top-level and `properties` keys of a queue entry (the envelope's shape)."""
    import json

    e = json.loads(envelope)
    return sorted(e) + sorted("properties." + k for k in e["properties"])
