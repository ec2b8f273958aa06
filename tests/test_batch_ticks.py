"""Redis tier: batch objects (app/fleet/batches.py) through a tick that dies midway (Redis gone,
the housekeeper killed between two writes), a cancel or a delete at an awkward moment, and a
step that raises: no line lost, none submitted twice, every count kept. The same harness as
tests/test_batch_objects.py (tests/batch_fleet.py)."""
from __future__ import annotations

import pytest
import redis

from app.errors import BATCH_CANCELLED, REDIS_UNAVAILABLE, TransientError
from app.fleet import batches
from app.state import keys
from tests.batch_fleet import Fleet, jsonl, line

pytestmark = pytest.mark.redis


@pytest.fixture()
def fleet(redis_db1_url) -> Fleet:
    return Fleet(redis.Redis.from_url(redis_db1_url))


class FailOnce:
    """Wraps a BatchStore method: its first call raises TransientError (a tick dying between
    two writes: Redis gone, the housekeeper killed), later calls go through."""

    def __init__(self, fn):
        self.fn, self.failed = fn, False

    def __call__(self, *a, **kw):
        if not self.failed:
            self.failed = True
            raise TransientError.of(REDIS_UNAVAILABLE, "the tick died here")
        return self.fn(*a, **kw)


def test_a_tick_that_dies_after_submitting_loses_no_line_and_submits_none_twice(fleet):
    """Given a tick that submitted a chunk (one line refused at submit) and died before noting
    what it submitted, the next tick goes over the same lines: the submitted ones re-attach
    (not published again), the refused one is recorded once, and the batch completes with
    every line accounted for."""
    bid = fleet.create(jsonl(line("a"), line("b", model="gpt-9"), line("c")))
    fleet.bs.add_inflight = FailOnce(fleet.bs.add_inflight)
    assert fleet.tick() == {bid: "stalled"}
    assert len(fleet.sent) == 2
    assert fleet.until_ended(bid, work=True) == "completed"
    b = fleet.obj(bid)
    assert b["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert len(fleet.sent) == 2 == len(set(fleet.sent))
    assert len(fleet.content(b["error_file_id"])) == 1


def test_a_line_the_books_lost_is_looked_at_again_not_dropped(fleet):
    """Given every line submitted and nothing noted in flight, yet fewer lines recorded than
    the batch has (its in-flight note lost), the batch is not completed: the lines are looked
    at again, the lost one re-attaches to its request, and its result is recorded once."""
    bid = fleet.create(jsonl(line("a"), line("b")))
    fleet.tick()
    fleet.client.delete(keys.batch_inflight(bid))  # the note of both requests, lost
    for rid in fleet.open_ids():
        fleet.finish(rid)
    assert fleet.tick() == {bid: "in_progress"}  # 0 of 2 recorded: not completed
    assert fleet.until_ended(bid) == "completed"
    assert fleet.obj(bid)["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert len(fleet.sent) == 2


def test_a_cancel_after_a_tick_died_fails_the_requests_it_had_submitted(fleet):
    """Given a tick that submitted lines and died before noting them, when the batch is
    cancelled, then those requests (found by their fixed ids) fail batch_cancelled rather
    than run on unseen, and each line is recorded once."""
    bid = fleet.create(jsonl(line("a"), line("b")))
    fleet.bs.add_inflight = FailOnce(fleet.bs.add_inflight)
    fleet.tick()
    batches.cancel_batch(fleet.bs, bid, fleet.now)
    assert fleet.tick() == {bid: "cancelled"}
    for rid in fleet.sent:
        assert fleet.store.get(rid)["error"].startswith(BATCH_CANCELLED + ":")
    assert fleet.obj(bid)["request_counts"] == {"total": 2, "completed": 0, "failed": 2}


def test_a_batch_cancelled_while_validating_counts_every_line(fleet):
    bid = fleet.create(jsonl(line("a"), "not json", line("c")))
    batches.cancel_batch(fleet.bs, bid, fleet.now)
    assert fleet.tick() == {bid: "cancelled"}
    assert fleet.obj(bid)["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert fleet.sent == []


def test_cancelling_a_lenient_batch_under_a_shared_job_ends_only_its_own_requests(fleet):
    """Given a `vigil batch FILE` batch (lenient, job "shared") and another producer's request
    in the same job, cancelling the batch fails its own requests only: the job lives on."""
    other = "other-producer-request"
    fleet.submit(other, {"model": "tiny-llama", "prompt": "mine", "job": "shared"})
    f = batches.upload_file(fleet.bs, jsonl(line("a"), line("b")), "f.jsonl", "batch",
                            fleet.now, fleet.settings)
    bid = batches.create_batch(fleet.bs, f["id"], "/v1/completions", "24h", None, fleet.now,
                               fleet.settings, job="shared", lenient=True)["id"]
    fleet.tick()
    batches.cancel_batch(fleet.bs, bid, fleet.now)
    assert fleet.tick() == {bid: "cancelled"}
    assert fleet.store.get(other)["status"] == "PENDING"
    assert fleet.client.hget(keys.job("shared"), "state") != b"deleted"
    assert fleet.obj(bid)["request_counts"]["failed"] == 2


def test_a_lenient_batch_still_fails_on_the_line_limit(redis_db1_url):
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), batch_max_requests=2)
    f = batches.upload_file(fleet.bs, jsonl(line("a"), "bad", line("c")), "f.jsonl", "batch",
                            fleet.now, fleet.settings)
    bid = batches.create_batch(fleet.bs, f["id"], "/v1/completions", "24h", None, fleet.now,
                               fleet.settings, job="j", lenient=True)["id"]
    assert fleet.tick() == {bid: "failed"}
    b = fleet.obj(bid)
    assert "VIGIL_BATCH_MAX_REQUESTS" in b["errors"]["data"][0]["message"]
    assert fleet.sent == [] and b["error_file_id"] is None  # no line recorded: nothing ran


def test_a_step_that_raises_does_not_stop_the_batches_after_it(fleet, caplog):
    """Given two batches and a chat template that raises something unexpected for the first,
    the tick logs it and still advances the second."""
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}}
    first = fleet.create(jsonl(chat), endpoint="/v1/chat/completions")
    fleet.now += 1
    second = fleet.create(jsonl(line("a")))

    def broken(model, messages):
        raise KeyError("a tokenizer bug")

    fleet.driver.render_chat = broken
    assert fleet.tick() == {first: "stalled", second: "in_progress"}
    assert "a tokenizer bug" in caplog.text
