"""Worker tier: many requests in few messages (`generate_many`) on the shared warm worker (the
real vLLM CPU engine): every request gets its own result through `AsyncResult(id).get()`, also
from another process, its engine ran each exactly once (the witness), and a request mixed in
that is bad at the worker fails alone."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from app.local.embedded import vigil_env
from app.state.store import shared_store
from tasks.inference import generate_many
from tests.conftest import assert_witnessed

pytestmark = pytest.mark.worker


def test_sixty_four_requests_in_two_messages_each_end_once_with_its_own_result(
        warm_worker, redis_server):
    job = f"many-{uuid.uuid4().hex[:8]}"
    items = [{"model": "tiny-llama", "prompt": f"count {i}", "max_tokens": 4, "job": job,
              "temperature": 0.0, "ignore_eos": True} for i in range(64)]
    results = generate_many(items)
    outs = [r.get(timeout=240) for r in results]
    assert [o["request_id"] for o in outs] == [r.id for r in results]
    assert all(o["completion_tokens"] == 4 and o["worker"] == warm_worker.name for o in outs)
    assert_witnessed(shared_store(), [r.id for r in results])
    # Another process reads one request's result by its id alone.
    code = ("import json, sys; from app import app\n"
            "print(json.dumps(app.AsyncResult(sys.argv[1]).get(timeout=60)))\n")
    out = subprocess.run([sys.executable, "-c", code, results[17].id], capture_output=True,
                         text=True, env=vigil_env(redis_server.url), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == outs[17]
