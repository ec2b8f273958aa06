"""Worker tier: a real Flower, started with `vigil flower`, watching the shared warm worker.

Flower sits behind basic auth from VIGIL_FLOWER_USER / VIGIL_FLOWER_PASSWORD; it turns task
events on in the workers itself (Vigil leaves them off: VIGIL_TASK_EVENTS), and Vigil's task shows
its name and the request's model and job, never the prompt, in /api/tasks and in the worker view.
"""
from __future__ import annotations

import json
import secrets
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import requests

from app import app
from app.local.embedded import free_port, start_process, stop_process, vigil_env, wait_for
from app.state.queues import HOUSEKEEPING_QUEUE
from app.state.store import shared_store
from app.task_names import DEADLINE_SWEEP, MESSAGE_AUDIT
from tasks.inference import generate

pytestmark = pytest.mark.worker

USER = "vigil-test"
WORKER = "warm@testhost"


class RunningFlower:
    """A `vigil flower` process on a free loopback port, with a random password."""

    def __init__(self, redis_url: str, log: Path):
        self.port = free_port()
        self.password = secrets.token_urlsafe(16)
        self.log = log
        self.base = f"http://127.0.0.1:{self.port}"
        vigil = Path(sys.executable).with_name("vigil")  # the console script `make setup` installs
        assert vigil.exists(), f"{vigil} is missing: run make setup"
        self.proc = start_process(
            [str(vigil), "flower", "--port", str(self.port), "--address", "127.0.0.1"],
            vigil_env(redis_url, VIGIL_FLOWER_USER=USER, VIGIL_FLOWER_PASSWORD=self.password),
            log)

    def get(self, path: str, auth=None) -> requests.Response:
        """GET a Flower URL, with the right credentials unless `auth` says otherwise."""
        auth = (USER, self.password) if auth is None else auth or None
        return requests.get(self.base + path, auth=auth, timeout=10)

    def answering(self) -> bool:
        """True once Flower's HTTP server answers at all (401 included)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"flower exited ({self.proc.returncode}):\n"
                               + self.log.read_text()[-3000:])
        try:
            self.get("/healthcheck", auth=False)
            return True
        except requests.RequestException:
            return False

    def workers(self, name: str | None = None) -> dict:
        """/api/workers after asking the workers again (refresh=1). Flower asks for task lists
        (scheduled, reserved, active) only when one worker is named, as its worker page does."""
        r = self.get("/api/workers?refresh=1" + (f"&workername={name}" if name else ""))
        return r.json() if r.status_code == 200 else {}

    def task(self, task_id: str) -> dict | None:
        """The task as /api/tasks lists it once it SUCCEEDED, else None."""
        r = self.get("/api/tasks?limit=1000")
        t = r.json().get(task_id) if r.status_code == 200 else None
        return t if t and t.get("state") == "SUCCESS" else None


@pytest.fixture(scope="module")
def flower(redis_server, warm_worker, tmp_path_factory):
    f = RunningFlower(redis_server.url, tmp_path_factory.mktemp("flower") / "flower.log")
    try:
        wait_for(f.answering, 120, 0.2, "Flower to answer")
        yield f
    finally:
        stop_process(f.proc, timeout=30)


def _events_enabled(worker) -> bool:
    # Flower broadcasts enable_events every 5 s; the worker logs the first one it obeys (the
    # flag stays on until the worker restarts, so an earlier Flower's counts as well).
    return "Events of group {task} enabled by remote" in worker.log.read_text()


def test_flower_refuses_every_request_without_the_right_credentials(flower):
    """Given Flower started by `vigil flower` with a user and password, when a client asks without
    credentials or with a wrong password, then every page and API answers 401."""
    for path in ("/", "/workers", "/api/workers", "/api/tasks"):
        assert flower.get(path, auth=False).status_code == 401, path
        assert flower.get(path, auth=(USER, "wrong")).status_code == 401, path
    assert flower.get("/api/tasks").status_code == 200


def test_the_password_is_on_no_command_line_and_in_no_log(flower):
    """Given a running `vigil flower`, then its password is in no process's command line (readable
    by every user of the host) and in nothing Flower logged."""
    cmdline = " ".join(psutil.Process(flower.proc.pid).cmdline())
    assert "flower" in cmdline and flower.password not in cmdline
    assert flower.password not in flower.log.read_text()


def test_the_worker_is_listed_with_credentials(flower, warm_worker):
    """Given the warm worker and Flower, when /api/workers is asked with credentials, then the
    worker is listed with its queues."""
    workers = wait_for(lambda: (w := flower.workers()) and WORKER in w and w, 60, 0.5,
                       "Flower to list the worker")
    queues = {q["name"] for q in workers[WORKER]["active_queues"]}
    assert {"vigil.housekeeping", "vigil.pool.tiny-llama"} <= queues


def test_a_finished_request_shows_its_name_model_and_job_but_not_its_prompt(flower, warm_worker):
    """Given Flower has turned task events on in the worker, when a request is served, then
    /api/tasks shows it as SUCCESS under the name vigil.generate with its model and job, and the
    prompt appears nowhere in what Flower knows about it."""
    wait_for(lambda: _events_enabled(warm_worker), 60, 0.5, "Flower to enable task events")
    prompt = f"flower-secret-prompt-{uuid.uuid4().hex}"
    job = f"flower-job-{uuid.uuid4().hex[:8]}"
    r = generate.delay(model="tiny-llama", prompt=prompt, max_tokens=4, job=job)
    assert r.get(timeout=120)["worker"] == WORKER
    task = wait_for(lambda: flower.task(r.id), 60, 0.5, "Flower to see the finished request")
    assert task["name"] == "vigil.generate" and task["worker"] == WORKER
    assert "tiny-llama" in task["kwargs"] and job in task["kwargs"] and task["args"] == "()"
    info = flower.get(f"/api/task/info/{r.id}")
    assert info.status_code == 200
    assert prompt not in json.dumps(task) and prompt not in info.text
    assert prompt not in flower.get("/api/tasks?limit=1000").text


def test_a_request_waiting_in_the_worker_shows_its_model_and_job_but_not_its_prompt(
        flower, warm_worker):
    """Given a request the worker holds until its countdown (as a retry in backoff is held), when
    Flower's worker view asks the worker what it has scheduled, then the request is listed with its
    model and job and without its prompt (Celery lists raw kwargs there unless the request class
    says otherwise: tasks/base.py, VigilRequest)."""
    prompt = f"flower-waiting-prompt-{uuid.uuid4().hex}"
    r = generate.apply_async(kwargs={"model": "tiny-llama", "prompt": prompt, "max_tokens": 4,
                                     "job": "flower-wait"}, countdown=15)

    def scheduled():
        w = flower.workers(WORKER).get(WORKER, {})
        mine = [s for s in w.get("scheduled") or [] if s["request"]["id"] == r.id]
        return (w, mine[0]) if mine else None

    # Listed while its countdown runs (Flower asks the worker over the broker: a second or two).
    view, entry = wait_for(scheduled, 13, 0.5, "the worker view to list the waiting request")
    assert entry["request"]["name"] == "vigil.generate"
    assert "flower-wait" in entry["request"]["kwargs"] and "tiny-llama" in entry["request"]["kwargs"]
    assert prompt not in json.dumps(view)
    assert r.get(timeout=120)["worker"] == WORKER  # it still runs when its countdown ends


def test_housekeeping_ticks_stay_out_of_flowers_task_list(flower, warm_worker):
    """Given Flower watching the warm worker, which also runs vigil.housekeeping, when beat's
    tasks run there beside a request, then Flower lists the request and none of the ticks (a
    tick every 2 s would bury the requests in its task list and counts), while each tick's run
    is recorded where `vigil status` reads it."""
    wait_for(lambda: _events_enabled(warm_worker), 60, 0.5, "Flower to enable task events")
    t0 = time.time()
    ticks = [app.send_task(name, queue=HOUSEKEEPING_QUEUE) for name in
             (DEADLINE_SWEEP, MESSAGE_AUDIT)]
    r = generate.delay(model="tiny-llama", prompt="after the ticks", max_tokens=4,
                       job="flower-ticks")
    assert r.get(timeout=120)["worker"] == WORKER
    wait_for(lambda: flower.task(r.id), 60, 0.5, "Flower to see the request")
    runs = wait_for(lambda: (x := shared_store().housekeeping.runs()) and all(
        x.get(n, {}).get("at", 0) >= t0 for n in (DEADLINE_SWEEP, MESSAGE_AUDIT)) and x, 60,
        0.5, "the ticks to run")
    assert runs[DEADLINE_SWEEP]["error"] == ""
    listed = flower.get("/api/tasks?limit=1000").json()
    assert r.id in listed
    assert not any(t.id in listed for t in ticks)
    assert not any(v.get("name", "").startswith("vigil.") and v.get("name") != "vigil.generate"
                   for v in listed.values())
