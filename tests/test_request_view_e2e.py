"""Worker tier: `vigil request ID` on a request the shared warm worker finished, through the real
command line, and `AsyncResult.info` once it is done."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.local.embedded import vigil_env
from tasks.inference import generate

pytestmark = pytest.mark.worker


def vigil_request(redis_server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.ops.cli", "request", *args],
                          env=vigil_env(redis_server.url, COLUMNS="200"), capture_output=True,
                          text=True, timeout=60)


def test_vigil_request_shows_a_finished_request_its_attempt_and_no_text_unless_asked(
        warm_worker, redis_server):
    """Given a request the warm worker served, then `vigil request ID --json` shows it
    SUCCEEDED on its first attempt on warm@testhost with a result summary and no text,
    `--show-text` adds the text, the table names the worker, and `info` is the result."""
    r = generate.delay(model="tiny-llama", prompt="a request to look at", max_tokens=4,
                       ignore_eos=True)
    result = r.get(timeout=120)
    out = vigil_request(redis_server, r.id, "--json")
    assert out.returncode == 0, out.stderr
    v = json.loads(out.stdout)
    assert v["found"] and v["status"] == "SUCCEEDED" and v["waiting"] is None
    assert (v["model"], v["pool"], v["job"], v["attempts"]) == ("tiny-llama", "tiny-llama",
                                                                "default", 1)
    assert [(h["attempt"], h["worker"], h["outcome"], h["error"]) for h in v["history"]] == [
        (1, "warm@testhost", "succeeded", None)]
    assert v["history"][0]["started_at"] <= v["history"][0]["ended_at"]
    assert v["result"]["completion_tokens"] == 4 and v["result"]["worker"] == "warm@testhost"
    assert v["result"]["text_chars"] == len(result["text"])
    assert "text" not in v["result"] and "a request to look at" not in out.stdout
    shown = json.loads(vigil_request(redis_server, r.id, "--json", "--show-text").stdout)
    assert shown["result"]["text"] == result["text"]
    assert shown["result"]["token_ids"] == result["token_ids"]
    table = vigil_request(redis_server, r.id)
    assert table.returncode == 0 and "SUCCEEDED" in table.stdout
    assert "warm@testhost" in table.stdout and "succeeded" in table.stdout
    assert r.info == result
