"""Worker tier: jobs on a real worker: a pool serves its jobs round-robin (a small job is not
stuck behind a big one), and deleting a job ends its waiting requests with job_deleted."""
from __future__ import annotations

import pytest

from app.errors import TerminalError
from app.local.embedded import wait_for
from app.ops.cli import main
from app.state.queues import job_queue_name as queue_name
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import UNSERVED_MODEL, queued

pytestmark = pytest.mark.worker


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def test_a_small_job_is_served_before_a_big_one_it_came_after(warm_worker, store):
    """Given one worker, when job A enqueues 2,000 long requests and then job B enqueues 20, then
    all of B's requests finish before A's 200th: the worker takes its job queues in turn, not
    first come first served. (A is then deleted: its remaining requests end job_deleted.)"""
    a = [generate.delay(model="tiny-llama", prompt=f"a{i}", max_tokens=256, ignore_eos=True,
                        job="fair-a") for i in range(2000)]
    b = [generate.delay(model="tiny-llama", prompt=f"b{i}", max_tokens=16, ignore_eos=True,
                        job="fair-b") for i in range(20)]
    for r in b:
        r.get(timeout=600)
    b_done = max(float(store.get(r.id)["finished_at"]) for r in b)
    a_before = 0
    for r in a:
        rec = store.get(r.id)
        a_before += rec["status"] == "SUCCEEDED" and float(rec["finished_at"]) < b_done
    print(f"\njob B's 20 requests were all done when job A had {a_before} of its 2,000 done")
    assert a_before < 200
    running = int(warm_worker.entry()["in_flight"])
    dups = store.stats().get("duplicate_results", 0)
    assert main(["job", "delete", "fair-a"]) == 0
    ends = [r.get(timeout=300, propagate=False) for r in a]
    assert all(isinstance(e, dict) or str(e).startswith("job_deleted: ") for e in ends)
    # The deleted job's running requests were aborted in the engine, not run to the end: a run
    # that finished after its request was failed would lose its finish (a duplicate result).
    wait_for(lambda: warm_worker.entry()["in_flight"] == "0", 120,
             what="the worker to drop the deleted job's requests")
    finished_anyway = store.stats().get("duplicate_results", 0) - dups
    print(f"{running} of job A's requests were running at the delete; {finished_anyway} "
          "finished anyway, the rest were aborted")
    assert finished_anyway < max(8, running // 4)


def test_deleting_a_job_ends_its_waiting_requests_with_job_deleted(warm_worker, store):
    """Given a job's requests waiting for a pool no worker serves, when the job is deleted
    (`vigil job delete`), then every waiting `r.get()` raises job_deleted at once, and a new
    submit to the job is refused with job_deleted."""
    rs = [generate.delay(model=UNSERVED_MODEL, prompt=f"x{i}", job="doomed-e2e")
          for i in range(5)]
    wait_for(lambda: queued(store.raw, queue_name(UNSERVED_MODEL, "doomed-e2e")) == 5, 30,
             what="the job's requests to be queued")
    assert main(["job", "delete", "doomed-e2e"]) == 0
    for r in rs:
        with pytest.raises(TerminalError, match="^job_deleted: "):
            r.get(timeout=30)
    with pytest.raises(TerminalError, match="^job_deleted: "):
        generate.delay(model=UNSERVED_MODEL, prompt="late", job="doomed-e2e")
