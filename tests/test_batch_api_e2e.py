"""Worker tier: batch objects on the real fleet. The warm worker (real Celery worker, vLLM CPU
engine on tiny-llama) generates, a real `celery beat` runs the batch tick every half second, a
real `vigil api` process serves the OpenAI endpoints and the official `openai` client drives
it; `vigil batch submit` runs in a process of its own that exits at once. Witnesses: the
engines' own record of what they finished (each line's request ran once), and the request
records (cancelled lines failed batch_cancelled)."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys

import openai
import pytest

from app.local.embedded import REPO, free_port, start_process, stop_process, vigil_env, wait_for
from app.ops.cli import main
from app.requests import batch_file as fmt
from app.state import keys
from app.state.store import RequestStore
from tests.worker_procs import assert_each_ran_to_a_result_once, start_batch_beat

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def services(warm_worker, redis_server, tmp_path_factory):
    """(base url, token): beat ticking batches every half second and `vigil api` on a free
    port, both real processes on the suite's Redis."""
    tmp = tmp_path_factory.mktemp("batch-api")
    token, port = secrets.token_urlsafe(16), free_port()
    beat = start_batch_beat(redis_server, tmp)
    api = start_process([sys.executable, "-m", "app.ops.cli", "api", "--port", str(port),
                         "--address", "127.0.0.1"], vigil_env(redis_server.url,
                                                              VIGIL_API_TOKEN=token),
                        tmp / "api.log")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        c = openai.OpenAI(base_url=base, api_key=token, max_retries=0)

        def up():
            if api.poll() is not None:
                raise RuntimeError("vigil api exited:\n" + (tmp / "api.log").read_text()[-3000:])
            try:
                return c.batches.list() is not None
            except openai.APIConnectionError:
                return False

        wait_for(up, 60, 0.2, "vigil api")
        yield base, token
        assert token not in (tmp / "api.log").read_text()
    finally:
        stop_process(api)
        stop_process(beat)


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def request_ids(store, batch_id: str, custom_ids) -> list[str]:
    job = store.raw.hget(keys.batch(batch_id), "job").decode()
    return [fmt.request_id_for(job, cid) for cid in custom_ids]


def completion(cid, prompt, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": prompt, **body}}


def chat(cid, text, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": text}],
                     **body}}


def jsonl(lines) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def test_the_official_openai_client_runs_a_batch_on_the_fleet(services, store):
    """Given the fleet, beat and `vigil api`, when the official client uploads a file of six
    completion lines, creates a batch and polls it, then the batch completes with six results
    in the output file (OpenAI's shape, the requested token counts), each line's request run
    once by the engine; a wrong token gets 401 and an unknown batch 404."""
    base, token = services
    c = openai.OpenAI(base_url=base, api_key=token, max_retries=0)
    cids = [f"q{i}" for i in range(6)]
    f = c.files.create(file=("eval.jsonl", jsonl(
        completion(cid, f"the cat number {i} finds", max_tokens=6 + i, temperature=0,
                   ignore_eos=True) for i, cid in enumerate(cids))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                         completion_window="24h", metadata={"suite": "e2e"})
    assert b.status == "validating"
    seen = set()

    def ended():
        got = c.batches.retrieve(b.id)
        seen.add(got.status)
        return got if got.status in ("completed", "failed", "expired", "cancelled") else None

    done = wait_for(ended, 180, 0.3, "the batch to end")
    assert done.status == "completed", done
    assert "in_progress" in seen and done.request_counts.completed == 6
    assert done.request_counts.failed == 0 and done.error_file_id is None
    out = {x["custom_id"]: x for x in map(json.loads,
                                         c.files.content(done.output_file_id).text.splitlines())}
    assert sorted(out) == cids
    for i, cid in enumerate(cids):
        body = out[cid]["response"]["body"]
        assert out[cid]["response"]["status_code"] == 200
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 6 + i
    assert_each_ran_to_a_result_once(store, request_ids(store, b.id, cids))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_" + "0" * 32)


def _vigil(*args: str, **env) -> subprocess.CompletedProcess:
    """`vigil ARGS` in a process of its own, on the suite's Redis (env: VIGIL_REDIS_URL)."""
    return subprocess.run([sys.executable, "-m", "app.ops.cli", *args], env=vigil_env(**env),
                          cwd=str(REPO), capture_output=True, text=True, timeout=120)


def _status(batch_id: str, capsys) -> dict:
    assert main(["batch", "status", batch_id, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_batch_submitted_from_a_terminal_that_exits_runs_and_a_cancel_ends_the_rest(
        services, store, redis_server, tmp_path, capsys):
    """Given `vigil batch submit` in a process that exits as soon as it printed the id, the
    fleet runs the batch to completed (chat lines, rendered with tiny-llama's template) and
    `vigil batch results` writes its files; and given a batch of long generations, `vigil batch
    cancel` while they run ends it cancelled: every unfinished line is an error line
    batch_cancelled, its request failed so, and nothing finished is lost."""
    src = tmp_path / "short.jsonl"
    src.write_bytes(jsonl([chat("a", "hello there", max_tokens=5),
                           chat("b", "hello world", max_tokens=4, temperature=0,
                                ignore_eos=True),
                           chat("c", "Alice reads", max_tokens=3)]))
    run = _vigil("batch", "submit", str(src), "--metadata", "who=cli",
                 redis_url=redis_server.url)
    assert run.returncode == 0, run.stderr  # it has exited: the fleet runs the batch alone
    bid = run.stdout.strip()
    assert bid.startswith("batch_")
    done = wait_for(lambda: (s := _status(bid, capsys))["status"] in ("completed", "failed")
                    and s, 180, 0.3, "the submitted batch to end")
    assert done["status"] == "completed" and done["metadata"] == {"who": "cli"}
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    assert main(["batch", "results", bid, "--output", str(out), "--errors", str(err)]) == 0
    rows = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert rows["b"]["response"]["body"]["object"] == "chat.completion"
    assert rows["b"]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert err.read_text() == ""
    capsys.readouterr()

    # Long generations, cancelled while they run.
    long = tmp_path / "long.jsonl"
    # Sixteen, so that the engine is still busy with some when the tick (every 0.5 s, but it can
    # be late on a loaded machine) ends the batch: four all finished first once in CI.
    cids = [f"l{i}" for i in range(16)]
    long.write_bytes(jsonl(completion(cid, "a long story", max_tokens=480, ignore_eos=True)
                           for cid in cids))
    assert main(["batch", "submit", str(long)]) == 0
    bid = capsys.readouterr().out.strip()
    ids = request_ids(store, bid, cids)
    wait_for(lambda: any((store.get(r) or {}).get("status") == "RUNNING" for r in ids), 120,
             0.2, "a long line to run")
    assert main(["batch", "cancel", bid]) == 0
    assert "cancelling" in capsys.readouterr().out
    done = wait_for(lambda: (s := _status(bid, capsys))["status"] == "cancelled" and s, 60, 0.3,
                    "the cancel to end the batch")
    counts = done["request_counts"]
    assert counts["total"] == 16 and counts["completed"] + counts["failed"] == 16
    assert counts["failed"] >= 1
    assert main(["batch", "results", bid, "--output", str(out), "--errors", str(err)]) == 0
    errs = [json.loads(x) for x in err.read_text().splitlines()]
    assert len(errs) == counts["failed"] and {e["error"]["code"] for e in errs} == {
        "batch_cancelled"}
    for e in errs:
        rec = store.get(fmt.request_id_for(
            store.raw.hget(keys.batch(bid), "job").decode(), e["custom_id"]))
        assert rec is None or rec["error"].startswith("batch_cancelled:")
    assert len(out.read_text().splitlines()) == counts["completed"]
