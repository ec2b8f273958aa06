"""Redis tier: cancelling requests (app/fleet/cancel.py) through every door: Celery's own
`AsyncResult(id).revoke()` on Vigil's app, `app.control.revoke(id, terminate=True)`, and
`vigil request cancel ID`, on a real redis-server (database 1, flushed per test) with no
worker (a queued request; the running case is tests/test_cancel_e2e.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from app.celery_app import create_app
from app.errors import TerminalError
from app.fleet.cancel import ALREADY_ENDED, ENDED_NOW, UNKNOWN, cancel_requests
from app.local.embedded import vigil_env
from app.requests.models import get_registry
from app.requests.submit import submit_request
from app.state.store import RequestStore
from tests.unit_helpers import RecordingPorts

pytestmark = pytest.mark.redis
KW = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}


@pytest.fixture()
def app(settings):
    return create_app(settings)


def submit(app, settings, **kw):
    return submit_request({**KW, **kw}, settings=settings, registry=get_registry(),
                          store=app.vigil_store, ports=app.vigil_ports)


def test_a_revoked_queued_request_ends_cancelled_once_and_its_message_is_dropped(app, settings):
    """Given a queued request no worker has taken, when its submitter calls `r.revoke()`, then
    the request ends `cancelled` (record FAILED, Celery's result FAILURE with the typed error,
    so `r.get()` raises TerminalError at once); a second cancel changes nothing; the message,
    when a worker takes it, meets the ended record and runs nothing (a duplicate)."""
    r = submit(app, settings)
    r.revoke()
    rec = app.vigil_store.get(r.id)
    assert (rec["status"], rec["error_kind"]) == ("FAILED", "TerminalError")
    assert rec["error"].startswith("cancelled: ")
    with pytest.raises(TerminalError, match="^cancelled: "):
        r.get(timeout=5)
    assert app.backend.get_task_meta(r.id)["status"] == "FAILURE"
    assert cancel_requests(app.vigil_store, [r.id], backend=None, bus=None) == {
        r.id: f"{ALREADY_ENDED} (FAILED)"}
    begin = app.vigil_store.begin(r.id, 0, "w@h", 7, time.time(), 3)
    assert begin.action == "done" and begin.outcome.error.startswith("cancelled: ")


def test_terminate_is_a_plain_revoke_and_a_finished_request_keeps_its_result(app, settings):
    """`revoke(terminate=True)` cancels the same way (the threads pool cannot kill one task:
    no signal is sent); a request that already succeeded keeps its result."""
    r = submit(app, settings)
    app.control.revoke(r.id, terminate=True)
    with pytest.raises(TerminalError, match="^cancelled: "):
        r.get(timeout=5)
    done = submit(app, settings, prompt="finished first")
    store: RequestStore = app.vigil_store
    store.begin(done.id, 0, "w@h", 7, time.time(), 3)
    store.finish(done.id, 7, time.time(), result={"text": "kept"})
    app.control.revoke(done.id)
    assert store.get(done.id)["status"] == "SUCCEEDED"
    assert json.loads(store.get(done.id)["result"]) == {"text": "kept"}


def test_cancel_answers_per_id_and_tells_the_workers_to_abort_only_what_it_ended(app, settings):
    ports = RecordingPorts()
    open_one = submit(app, settings)
    done = submit(app, settings, prompt="finished")
    app.vigil_store.begin(done.id, 0, "w@h", 7, time.time(), 3)
    app.vigil_store.finish(done.id, 7, time.time(), result={"text": "x"})
    out = cancel_requests(app.vigil_store, [open_one.id, done.id, "no-such-id", open_one.id],
                          backend=app.backend, bus=ports.bus)
    assert out == {open_one.id: ENDED_NOW, done.id: f"{ALREADY_ENDED} (SUCCEEDED)",
                   "no-such-id": UNKNOWN}
    assert ports.broadcasts == [("vigil_abort", {"request_ids": [open_one.id]})]
    assert app.vigil_store.get("no-such-id") is None  # an unknown id is not created


def test_vigil_request_cancel_says_what_happened_to_each(app, settings):
    r = submit(app, settings)
    cmd = [sys.executable, "-m", "app.ops.cli", "request", "cancel", r.id, "unknown-id"]
    out = subprocess.run(cmd, env=vigil_env(settings.redis_url), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1, out.stderr  # one of them was unknown
    assert out.stdout.splitlines() == [f"{r.id}: cancelled", "unknown-id: unknown"]
    assert app.vigil_store.get(r.id)["error"].startswith("cancelled: cancelled by an operator")


def test_revoke_answers_what_it_did_for_an_open_a_finished_and_an_unknown_request(app, settings):
    """Celery's own doors answer too: `r.revoke()` returns "cancelled" for an open request,
    "already ended (SUCCEEDED)" for a finished one (its result stays) and "unknown" for an id
    with no record (none is created); `app.control.revoke(ids)` returns the answer per id."""
    r = submit(app, settings)
    done = submit(app, settings, prompt="finished")
    app.vigil_store.begin(done.id, 0, "w@h", 7, time.time(), 3)
    app.vigil_store.finish(done.id, 7, time.time(), result={"text": "x"})
    assert r.revoke() == ENDED_NOW
    assert app.AsyncResult(done.id).revoke() == f"{ALREADY_ENDED} (SUCCEEDED)"
    assert app.AsyncResult("no-such-request").revoke(terminate=True) == UNKNOWN
    assert app.vigil_store.get("no-such-request") is None
    assert app.control.revoke([r.id, "no-such-request"]) == {
        r.id: f"{ALREADY_ENDED} (FAILED)", "no-such-request": UNKNOWN}
