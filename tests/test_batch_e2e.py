"""Worker tier: `vigil batch FILE.jsonl` end to end against the warm worker (real Redis, real
Celery worker, real vLLM CPU engine on tiny-llama) and a real beat ticking the batch objects the
command submits: the output and error files, chat lines rendered with the model's template by
the fleet, and a command killed midway then rerun: it follows the same batch, nothing runs
twice."""
from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from app.local.embedded import start_process, stop_process, vigil_env, wait_for
from app.ops.cli import main
from app.requests import batch_file as batch
from app.requests.models import TINY_MAX_POSITIONS, get_registry
from app.state import broker
from app.state.queues import job_queue_name
from app.state.store import RequestStore
from tests.conftest import UNSERVED_MODEL
from tests.worker_procs import assert_each_ran_to_a_result_once, start_batch_beat

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module", autouse=True)
def batch_beat(warm_worker, redis_server, tmp_path_factory):
    beat = start_batch_beat(redis_server, tmp_path_factory.mktemp("batch-beat"))
    try:
        yield beat
    finally:
        stop_process(beat)


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def completion(cid, prompt, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": prompt, **body}}


def chat(cid, messages, model="tiny-llama", **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": messages, **body}}


def write_jsonl(path: Path, lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_registry().get("tiny-llama").path,
                                         local_files_only=True)


def test_a_batch_writes_openai_shaped_outputs_and_errors(warm_worker, store, tmp_path):
    """Given a file of completion and chat lines with bad lines among them, when `vigil batch`
    runs it, then each good line has one output line in the OpenAI Batch shape (chat rendered
    with tiny-llama's template), each bad line one error line with its Vigil code, and the exit
    status is 1."""
    job = f"e2e-batch-{uuid.uuid4().hex[:8]}"
    hello = [{"role": "user", "content": "hello world"}]
    src = write_jsonl(tmp_path / "mixed.jsonl", [
        completion("c1", "the cat finds", max_tokens=8, temperature=0, ignore_eos=True),
        completion("c2", [5, 6, 7], max_tokens=4, stop=None),
        chat("chat1", hello, max_tokens=6, temperature=0, ignore_eos=True),
        chat("chat2", [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "Alice reads"}]}],
             max_completion_tokens=3),
        chat("chat3", hello, temperature=0, ignore_eos=True),  # no max_tokens: rest of context
        "{this is not json",                                               # line 6
        completion("c1", "a duplicate custom_id"),                         # line 7
        {**completion("emb", "x"), "url": "/v1/embeddings"},
        completion("nomodel", "x", model="gpt-9"),
        completion("badtype", "x", max_tokens="5"),
        completion("toolong", "word " * 700, max_tokens=4),
        chat("notemplate", hello, model=UNSERVED_MODEL),
    ])
    rc = main(["batch", str(src), "--job", job, "--quiet"])
    assert rc == 1
    outs = read_jsonl(tmp_path / "mixed.output.jsonl")
    errs = read_jsonl(tmp_path / "mixed.errors.jsonl")

    assert sorted(o["custom_id"] for o in outs) == ["c1", "c2", "chat1", "chat2", "chat3"]
    by_id = {o["custom_id"]: o for o in outs}
    for cid, o in by_id.items():
        rid = batch.request_id_for(job, cid)
        assert o["id"] == f"batch_req_{rid}" and o["error"] is None
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"] == rid
        assert store.get(rid)["job"] == job
        usage = o["response"]["body"]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    c1 = by_id["c1"]["response"]["body"]
    assert c1["object"] == "text_completion" and c1["model"] == "tiny-llama"
    assert c1["choices"][0]["finish_reason"] == "length" and c1["usage"]["completion_tokens"] == 8
    assert isinstance(c1["choices"][0]["text"], str)
    assert by_id["c2"]["response"]["body"]["usage"]["prompt_tokens"] == 3

    rendered = tiny_tokenizer().apply_chat_template(hello, add_generation_prompt=True,
                                                    tokenize=False)
    assert rendered == "<|user|>hello world\n<|assistant|>"
    ids = tiny_tokenizer().encode(rendered, add_special_tokens=False)
    chat1 = by_id["chat1"]["response"]["body"]
    assert chat1["object"] == "chat.completion"
    assert chat1["choices"][0]["message"]["role"] == "assistant"
    assert chat1["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6,
                              "total_tokens": len(ids) + 6}
    stored = json.loads(store.get(batch.request_id_for(job, "chat1"))["request"])
    assert stored["prompt_token_ids"] == ids
    assert by_id["chat2"]["response"]["body"]["usage"]["completion_tokens"] <= 3
    # A chat line without max_tokens runs to the end of tiny-llama's 512-token context.
    chat3 = by_id["chat3"]["response"]["body"]
    assert chat3["usage"]["completion_tokens"] == TINY_MAX_POSITIONS - len(ids)
    assert chat3["choices"][0]["finish_reason"] == "length"

    codes = {(e["custom_id"], e["error"]["code"]) for e in errs}
    assert codes == {(None, "invalid_request"), ("c1", "invalid_request"),
                     ("emb", "invalid_request"), ("nomodel", "model_not_found"),
                     ("badtype", "invalid_request"), ("toolong", "prompt_too_long"),
                     ("notemplate", "invalid_request")}
    assert len(errs) == 7 and all(e["response"] is None for e in errs)
    msg = {e["custom_id"]: e["error"]["message"] for e in errs}
    assert msg[None].startswith("line 6: not valid JSON")
    assert msg["c1"] == "line 7: duplicate custom_id 'c1'"
    assert "max_tokens" in msg["badtype"] and "chat" in msg["notemplate"]
    assert store.get(batch.request_id_for(job, "badtype")) is None  # refused before Redis


def test_a_killed_batch_rerun_finishes_each_line_once_without_submitting_twice(
        warm_worker, store, redis_server, tmp_path):
    """Given a `vigil batch` process killed (SIGKILL) once some outputs are written and more
    requests are in flight, when the same command runs again, then it follows the same batch
    (the fleet went on without the command), every custom_id is in the output exactly once,
    the bad line is in the error file once, each request ran one attempt (no delivery was a
    duplicate or stale) and the rerun exits 1 (the bad line)."""
    job = f"e2e-resume-{uuid.uuid4().hex[:8]}"
    good = [completion(f"q{i:02d}", f"the river number {i} sings", max_tokens=48,
                       temperature=0, ignore_eos=True) for i in range(40)]
    good[20:20] = [chat("chat-a", [{"role": "user", "content": "hello"}], max_tokens=8),
                   chat("chat-b", [{"role": "user", "content": "world"}], max_tokens=8)]
    src = write_jsonl(tmp_path / "resume.jsonl", good[:10] + ["not json"] + good[10:])
    out, err = tmp_path / "resume.output.jsonl", tmp_path / "resume.errors.jsonl"
    cids = [g["custom_id"] for g in good]
    rids = {cid: batch.request_id_for(job, cid) for cid in cids}
    stats_before = store.stats()
    argv = [sys.executable, "-m", "app.ops.cli", "batch", str(src), "--job", job, "--window", "4",
            "--quiet"]
    env = vigil_env(redis_server.url)

    def written() -> set[str]:
        lines = out.read_text().splitlines() if out.exists() else []
        return {json.loads(x)["custom_id"] for x in lines if x.endswith("}")}

    def in_flight_unwritten() -> list[str]:
        w = written()
        return [c for c in cids if c not in w and store.raw.exists(f"vigil:req:{rids[c]}")]

    first = start_process(argv, env, tmp_path / "first.log")
    try:
        wait_for(lambda: len(written()) >= 8 and in_flight_unwritten(), 600, 0.05,
                 "8 outputs written and more requests in flight")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        stop_process(first)
    before = written()
    reattach = in_flight_unwritten()
    assert len(before) < len(cids) and reattach, "the first run must stop midway"

    second = start_process(argv, env, tmp_path / "second.log")
    try:
        wait_for(lambda: second.poll() is not None, 600, 0.2, "the rerun to finish")
    finally:
        stop_process(second)
    log = (tmp_path / "second.log").read_text()
    assert second.returncode == 1, log
    assert "following batch" in log and "submitted batch" not in log

    outs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in outs) == sorted(cids)  # each exactly once
    assert all(o["response"]["request_id"] == rids[o["custom_id"]] for o in outs)
    errs = read_jsonl(err)
    assert [(e["custom_id"], e["error"]["code"]) for e in errs] == [(None, "invalid_request")]
    for cid in cids:
        rec = store.get(rids[cid])
        assert rec["status"] == "SUCCEEDED" and rec["attempts"] == "1" and rec["dispatch"] == "0"
        assert len(store.history(rids[cid])) == 1, cid
    # Each ran to completion once by the engines' witness (its own requests); no delivery was
    # a duplicate or stale (the fleet's counters, a delta over this test).
    assert_each_ran_to_a_result_once(store, list(rids.values()))
    after = store.stats()
    for counter in ("duplicate_deliveries", "stale_deliveries", "duplicate_results"):
        assert after.get(counter, 0) == stats_before.get(counter, 0), counter
    # No copy of its requests is left queued (the queues are shared: its own ids only).
    queues = ["vigil.pool.tiny-llama", job_queue_name("tiny-llama", job)]
    assert not broker.queued_ids(store.raw, queues) & set(rids.values())
