"""Redis tier: `vigil api` (app/ops/api.py) served by a real uvicorn on a free port, driven by the
official `openai` client; the batch tick is run by the test (tests/test_batch_objects.py's
Fleet) so each step is seen. Every response parses as the package's own types (the client
does that itself), and errors come back in OpenAI's shape with their HTTP statuses."""
from __future__ import annotations

import argparse
import json
import threading

import openai
import pytest
import redis
import requests
import uvicorn

from app.local.embedded import free_port, wait_for
from app.ops.api import ApiAuthMissing, create_api, listen_address
from app.settings import load_settings
from tests.conftest import CACHE_DIR
from tests.test_batch_objects import Fleet, jsonl, line

pytestmark = pytest.mark.redis
TOKEN = "s3cret-token"


@pytest.fixture()
def served(redis_db1_url):
    """(fleet, base url): the API over the fleet's Redis, in a thread of this process."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), api_token=TOKEN, batch_max_bytes=4096)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_api(fleet.bs, fleet.settings,
                                                      clock=lambda: fleet.now),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, what="uvicorn to start")
    try:
        yield fleet, f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def client(base: str, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=token, max_retries=0)


def test_the_openai_client_uploads_creates_follows_and_downloads_a_batch(served):
    """Given the API, when the official client uploads a file, creates a batch on it and polls
    while the fleet runs it, then it sees validating -> in_progress -> completed with counts,
    downloads the output (one line per request, OpenAI's output shape) and lists both."""
    fleet, base = served
    c = client(base)
    data = jsonl(line("q0"), line("q1"))
    f = c.files.create(file=("eval.jsonl", data), purpose="batch")
    assert isinstance(f, openai.types.FileObject) and f.bytes == len(data)
    assert f.purpose == "batch" and f.filename == "eval.jsonl"
    assert c.files.content(f.id).content == data  # the bytes as sent
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                         completion_window="24h", metadata={"team": "eval"})
    assert isinstance(b, openai.types.Batch) and b.status == "validating"
    fleet.tick()
    assert c.batches.retrieve(b.id).status == "in_progress"
    for rid in fleet.open_ids():
        fleet.finish(rid, text="ok")
    fleet.tick()
    done = c.batches.retrieve(b.id)
    assert done.status == "completed" and done.metadata == {"team": "eval"}
    assert (done.request_counts.total, done.request_counts.completed) == (2, 2)
    assert done.error_file_id is None
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["q0", "q1"]
    assert {x["response"]["body"]["choices"][0]["text"] for x in out} == {"ok"}
    assert c.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert [x.id for x in c.batches.list()] == [b.id]
    assert {x.id for x in c.files.list()} == {f.id, done.output_file_id}


def test_cancel_through_the_client_and_a_deleted_file(served):
    fleet, base = served
    c = client(base)
    f = c.files.create(file=("a.jsonl", jsonl(line("a"))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                         completion_window="24h")
    assert c.batches.cancel(b.id).status == "cancelling"
    with pytest.raises(openai.BadRequestError, match="has not ended"):
        c.files.delete(f.id)  # a live batch reads it
    fleet.tick()
    assert c.batches.retrieve(b.id).status == "cancelled"
    assert c.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


def test_a_wrong_or_missing_token_gets_401_in_openais_error_shape(served):
    _, base = served
    with pytest.raises(openai.AuthenticationError) as e:
        client(base, "wrong").batches.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = requests.get(f"{base}/batches", timeout=10)
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param",
                                                                "code"}


def test_unknown_ids_get_404_and_bad_requests_400_naming_what_is_wrong(served):
    fleet, base = served
    c = client(base)
    with pytest.raises(openai.NotFoundError) as e:
        c.batches.retrieve("batch_nope")
    assert e.value.code == "not_found" and "batch_nope" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.files.content("file-nope")
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                         completion_window="24h")
    f = c.files.create(file=("a.jsonl", jsonl(line("a"))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="not served") as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.code == "invalid_request"
    with pytest.raises(openai.BadRequestError, match="VIGIL_BATCH_MAX_BYTES"):
        c.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        c.files.create(file=("a.jsonl", jsonl(line("a"))), purpose="fine-tune")
    r = requests.post(f"{base}/batches", json={"input_file_id": f.id, "surprise": 1},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert fleet.bs.batch_ids(10) == []


def test_vigil_api_refuses_to_start_without_a_token_unless_disabled_for_loopback():
    args = argparse.Namespace(address=None)
    with pytest.raises(ApiAuthMissing, match="VIGIL_API_TOKEN"):
        listen_address(args, load_settings(cache_dir=CACHE_DIR))
    off = load_settings(cache_dir=CACHE_DIR, api_auth_disabled=True)
    assert listen_address(args, off) == "127.0.0.1"
    assert listen_address(args, load_settings(cache_dir=CACHE_DIR, api_token="t")) == "0.0.0.0"
    assert "tok3n" not in repr(load_settings(cache_dir=CACHE_DIR, api_token="tok3n"))


def test_the_gate_answers_before_reading_a_body_and_unknown_paths_get_openais_shape(served):
    """An upload without the token is refused 401 however large, one with it but larger than
    the limit is refused 400 from its Content-Length; an unknown path is a 404 in OpenAI's
    error shape, not FastAPI's."""
    fleet, base = served
    big = b"x" * (fleet.settings.batch_max_bytes + 70 * 1024)
    r = requests.post(f"{base}/files", files={"file": ("big.jsonl", big)},
                      data={"purpose": "batch"}, timeout=10)
    assert r.status_code == 401
    r = requests.post(f"{base}/files", files={"file": ("big.jsonl", big)},
                      data={"purpose": "batch"}, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=10)
    assert r.status_code == 400 and "VIGIL_BATCH_MAX_BYTES" in r.json()["error"]["message"]
    r = requests.get(f"{base}/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        client(base).models.list()
