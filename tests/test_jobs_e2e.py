"""Worker tier: jobs on a real worker: a pool serves its jobs round-robin (a small job is not
stuck behind a big one), and deleting a job ends its waiting requests with job_deleted."""
from __future__ import annotations

import uuid

import pytest

from app.errors import TerminalError
from app.local.embedded import wait_for
from app.ops.cli import main
from app.state import keys
from app.state.queues import job_queue_name as queue_name
from app.state.store import RequestStore
from tasks.inference import generate
from tests.conftest import UNSERVED_MODEL, WITNESS_DIR
from tests.worker_procs import queued
from workers.engine.witness import finished_generations, read_witness

pytestmark = pytest.mark.worker


@pytest.fixture()
def store(redis_server):
    return RequestStore(redis_server.client(), 3600)


def test_a_small_job_is_served_before_a_big_one_it_came_after(warm_worker, store):
    """Given one worker, when job A enqueues 2,000 long requests and then job B enqueues 20, then
    all of B's requests finish before A's 200th: the worker takes its job queues in turn, not
    first come first served. (A is then deleted: its remaining requests end job_deleted.)"""
    # Jobs of their own on every run: a deleted job refuses new submits, and database 0 is
    # shared with the other tests of the session.
    job_a, job_b = (f"fair-{x}-{uuid.uuid4().hex[:8]}" for x in "ab")
    a = [generate.delay(model="tiny-llama", prompt=f"a{i}", max_tokens=256, ignore_eos=True,
                        job=job_a) for i in range(2000)]
    b = [generate.delay(model="tiny-llama", prompt=f"b{i}", max_tokens=16, ignore_eos=True,
                        job=job_b) for i in range(20)]
    for r in b:
        r.get(timeout=600)
    b_done = max(float(store.get(r.id)["finished_at"]) for r in b)
    a_before = 0
    for r in a:
        rec = store.get(r.id)
        a_before += rec["status"] == "SUCCEEDED" and float(rec["finished_at"]) < b_done
    print(f"\njob B's 20 requests were all done when job A had {a_before} of its 2,000 done")
    assert a_before < 200
    inst = warm_worker.entry()["instance_id"]
    a_ids = {r.id for r in a}
    running = [rid for rid in a_ids if (store.get(rid) or {}).get("status") == "RUNNING"]
    assert main(["job", "delete", job_a]) == 0
    ends = [r.get(timeout=300, propagate=False) for r in a]
    assert all(isinstance(e, dict) or str(e).startswith("job_deleted: ") for e in ends)
    # The deleted job's running requests were aborted in the engine, not run to the end: the
    # engines' witness (outside Vigil's records) says how many of A's deleted requests still
    # ran to completion, once the worker holds none of A's requests any more.
    wait_for(lambda: not a_ids & {x.decode() for x in store.raw.smembers(keys.inflight(inst))},
             120, what="the worker to drop the deleted job's requests")
    seen = read_witness(WITNESS_DIR)
    deleted = [r.id for r, e in zip(a, ends) if not isinstance(e, dict)]
    finished_anyway = sum(finished_generations(seen.get(rid, [])) > 0 for rid in deleted)
    print(f"{len(running)} of job A's requests were running at the delete; {finished_anyway} "
          "finished anyway, the rest were aborted")
    assert running and finished_anyway < max(8, len(running) // 4)


def test_deleting_a_job_ends_its_waiting_requests_with_job_deleted(warm_worker, store):
    """Given a job's requests waiting for a pool no worker serves, when the job is deleted
    (`vigil job delete`), then every waiting `r.get()` raises job_deleted at once, and a new
    submit to the job is refused with job_deleted."""
    job = f"doomed-{uuid.uuid4().hex[:8]}"  # a deleted job refuses submits: one per run
    rs = [generate.delay(model=UNSERVED_MODEL, prompt=f"x{i}", job=job) for i in range(5)]
    wait_for(lambda: queued(store.raw, queue_name(UNSERVED_MODEL, job)) == 5, 30,
             what="the job's requests to be queued")
    assert main(["job", "delete", job]) == 0
    for r in rs:
        with pytest.raises(TerminalError, match="^job_deleted: "):
            r.get(timeout=30)
    with pytest.raises(TerminalError, match="^job_deleted: "):
        generate.delay(model=UNSERVED_MODEL, prompt="late", job=job)
