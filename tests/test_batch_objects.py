"""Redis tier: batch objects (app/fleet/batches.py) driven tick by tick on a real Redis, with an
injected clock. Requests go through the real `submit_request` (records, backpressure, ids) with
their messages captured instead of published; the fleet's side is played by `end_request`, the
one function every worker and sweeper ends a request with. Witnesses: the request records (each
line's request ran once, failed with the batch's code when cut short) and the captured
messages (none sent twice); every object validates as the `openai` package's own types."""
from __future__ import annotations

from collections import Counter

import pytest
import redis

from app.errors import BATCH_CANCELLED, BATCH_EXPIRED, PROMPT_TOO_LONG, RequestError
from app.fleet import batches
from app.local.embedded import stop_process
from app.requests.batch_file import request_id_for
from app.state import keys
from tests.batch_fleet import CHAT_LINE, T0, Fleet, jsonl, line
from tests.redis_servers import LocalRedis

pytestmark = pytest.mark.redis


@pytest.fixture()
def fleet(redis_db1_url) -> Fleet:
    return Fleet(redis.Redis.from_url(redis_db1_url))


def test_a_batch_runs_to_completed_and_records_each_line_once(fleet):
    """Given a file of five lines (a blank line among them), when the batch is created, it is
    validating; the first tick validates and submits every line; results recorded by later
    ticks are counted once however often a tick runs; a failed request becomes an error line
    with its code; once all have ended the batch is completed with an output and an error
    file in OpenAI's shapes, and no request was ever published twice."""
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(4)), "", line("q4")),
                       metadata={"team": "eval"})
    assert fleet.obj(bid)["status"] == "validating"
    assert fleet.tick() == {bid: "in_progress"}
    b = fleet.obj(bid)
    assert b["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert b["in_progress_at"] == int(fleet.now) and b["metadata"] == {"team": "eval"}
    assert len(fleet.sent) == 5
    ids = fleet.open_ids()
    for rid in ids[:3]:
        fleet.finish(rid)
    fleet.tick()
    fleet.tick()
    assert fleet.obj(bid)["request_counts"] == {"total": 5, "completed": 3, "failed": 0}
    fleet.finish(ids[3])
    fleet.fail(ids[4], RequestError.of(PROMPT_TOO_LONG, "prompt has 900 tokens"))
    assert fleet.tick() == {bid: "completed"}
    b = fleet.obj(bid)
    assert b["status"] == "completed" and b["request_counts"] == {
        "total": 5, "completed": 4, "failed": 1}
    assert b["finalizing_at"] and b["completed_at"] == int(fleet.now)
    out, errs = fleet.content(b["output_file_id"]), fleet.content(b["error_file_id"])
    assert sorted(x["custom_id"] for x in out) == ["q0", "q1", "q2", "q3"]
    assert out[0]["response"]["body"]["object"] == "text_completion"
    assert out[0]["response"]["body"]["choices"][0]["text"] == "out"
    [e] = errs
    assert e["custom_id"] == "q4" and e["error"]["code"] == PROMPT_TOO_LONG
    assert all(n == 1 for n in Counter(fleet.sent).values())
    assert fleet.bs.active_ids() == [] and fleet.tick() == {}
    assert fleet.client.ttl(keys.batch(bid)) > 0  # kept for the retention, then gone


def test_a_bad_file_fails_in_validating_with_per_line_errors_and_submits_nothing(fleet):
    """Given a file with a line that is not JSON, a duplicate custom_id, a line for another
    endpoint and a body field that is not served, when the tick validates it, then the batch is
    failed with one error per bad line (its line number), and no request was submitted."""
    bid = fleet.create(jsonl(line("a"), "{not json", line("a"),
                             CHAT_LINE, line("d", best_of=2)))
    assert fleet.tick() == {bid: "failed"}
    b = fleet.obj(bid)
    assert b["failed_at"] == int(fleet.now) and b["in_progress_at"] is None
    errors = b["errors"]["data"]
    assert [(e["line"], e["param"]) for e in errors] == [(2, None), (3, "custom_id"),
                                                         (4, "url"), (5, None)]
    assert "not valid JSON" in errors[0]["message"] and "best_of" in errors[3]["message"]
    assert fleet.sent == [] and b["output_file_id"] is None


def test_limits_refuse_a_file_too_large_and_fail_one_with_too_many_lines(redis_db1_url):
    """Given limits of 2 KiB and 3 requests, a larger upload is refused before anything is
    stored, and a file of 4 lines fails validation naming the limit."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), batch_max_bytes=2048,
                  batch_max_requests=3)
    with pytest.raises(RequestError, match="VIGIL_BATCH_MAX_BYTES"):
        fleet.create(jsonl(*(line(f"q{i}", "x" * 100) for i in range(20))))
    assert fleet.bs.file_ids() == []
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(4))))
    fleet.tick()
    b = fleet.obj(bid)
    assert b["status"] == "failed" and "VIGIL_BATCH_MAX_REQUESTS" in b["errors"]["data"][0][
        "message"]


@pytest.mark.parametrize("window, endpoint, metadata, match", [
    ("25x", "/v1/completions", None, "completion_window"),
    ("30s", "/v1/completions", None, "completion_window"),
    ("24h", "/v1/embeddings", None, "endpoint"),
    ("24h", "/v1/completions", {"k": 1}, "metadata"),
])
def test_create_refuses_bad_parameters_before_storing_a_batch(fleet, window, endpoint,
                                                              metadata, match):
    with pytest.raises(RequestError, match=match):
        fleet.create(jsonl(line("a")), window=window, endpoint=endpoint, metadata=metadata)
    assert fleet.bs.batch_ids(10) == []


def test_no_more_than_the_window_is_in_flight(redis_db1_url):
    """Given a window of 2 and five lines, each tick keeps at most two requests open, and the
    batch completes once all five ran, each submitted once."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), batch_window=2)
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(5))))
    rounds = 0
    while fleet.tick().get(bid) != "completed":
        assert len(fleet.open_ids()) <= 2
        for rid in fleet.open_ids():
            fleet.finish(rid)
        rounds += 1
        assert rounds < 10
    assert rounds == 3 and len(fleet.sent) == 5 == len(set(fleet.sent))
    assert fleet.obj(bid)["request_counts"]["completed"] == 5


def test_cancel_keeps_finished_results_and_ends_the_rest_batch_cancelled(redis_db1_url):
    """Given a batch with one result in, one request open and two lines not yet submitted,
    when it is cancelled, then it is cancelling until the next tick, which fails the open
    request batch_cancelled (its record says so), writes an error line for it and for each
    line never submitted, keeps the finished result and ends cancelled."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), batch_window=2)
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(4))))
    fleet.tick()
    first, second = fleet.open_ids()
    fleet.finish(first)
    b = batches.cancel_batch(fleet.bs, bid, fleet.now)
    assert b["status"] == "cancelling" and b["cancelling_at"] == int(fleet.now)
    assert fleet.tick() == {bid: "cancelled"}
    assert fleet.store.get(second)["status"] == "FAILED"
    assert fleet.store.get(second)["error"].startswith(BATCH_CANCELLED + ":")
    b = fleet.obj(bid)
    assert b["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert b["cancelled_at"] == int(fleet.now)
    assert [x["custom_id"] for x in fleet.content(b["output_file_id"])] == ["q0"]
    errs = fleet.content(b["error_file_id"])
    assert sorted(x["custom_id"] for x in errs) == ["q1", "q2", "q3"]
    assert {x["error"]["code"] for x in errs} == {BATCH_CANCELLED}
    assert len(fleet.sent) == 2
    assert batches.cancel_batch(fleet.bs, bid, fleet.now)["status"] == "cancelled"
    with pytest.raises(batches.BatchNotFound):
        batches.cancel_batch(fleet.bs, "batch_nope", fleet.now)


def test_a_completed_batch_cannot_be_cancelled(fleet):
    bid = fleet.create(jsonl(line("a")))
    fleet.tick()
    fleet.finish(fleet.open_ids()[0])
    fleet.tick()
    with pytest.raises(RequestError, match="completed"):
        batches.cancel_batch(fleet.bs, bid, fleet.now)


def test_at_the_end_of_its_window_a_batch_expires_with_its_results_kept(redis_db1_url):
    """Given a batch with a one-minute window, a result in and a request open, when the tick
    runs after the minute, then the open request fails batch_expired, the lines not submitted
    get batch_expired error lines, and the batch is expired with its result kept."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), batch_window=2)
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(3))), window="1m")
    fleet.tick()
    first, second = fleet.open_ids()
    fleet.finish(first)
    assert fleet.tick(dt=30).get(bid) == "in_progress"
    assert fleet.tick(dt=30) == {bid: "expired"}
    b = fleet.obj(bid)
    assert b["expired_at"] == int(fleet.now) and b["expires_at"] == int(T0 + 60)
    assert b["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert {x["error"]["code"] for x in fleet.content(b["error_file_id"])} == {BATCH_EXPIRED}
    assert fleet.store.get(second)["error"].startswith(BATCH_EXPIRED + ":")


def test_a_request_whose_record_vanished_is_submitted_again_under_its_id(fleet):
    """Given a batch whose request record was lost (a Redis crash inside the fsync window),
    the next tick submits that line again under the same id, and its result is recorded once."""
    bid = fleet.create(jsonl(line("a"), line("b")))
    fleet.tick()
    lost, kept = fleet.open_ids()
    fleet.store.delete(lost)
    fleet.finish(kept)
    fleet.tick()
    assert fleet.sent.count(lost) == 2 and fleet.store.get(lost)["status"] == "PENDING"
    fleet.finish(lost)
    assert fleet.tick() == {bid: "completed"}
    assert fleet.obj(bid)["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_a_line_refused_at_submit_becomes_an_error_line_and_the_batch_goes_on(fleet):
    """Given lines naming an unknown model and asking more tokens than the model has, they are
    refused at submit (never published) and become error lines with their codes."""
    bid = fleet.create(jsonl(line("ok"), line("nomodel", model="gpt-9"),
                             line("toomany", max_tokens=10**6)))
    fleet.tick()
    assert len(fleet.sent) == 1
    fleet.finish(fleet.sent[0])
    assert fleet.tick() == {bid: "completed"}
    b = fleet.obj(bid)
    codes = {x["custom_id"]: x["error"]["code"] for x in fleet.content(b["error_file_id"])}
    assert codes == {"nomodel": "model_not_found", "toomany": "invalid_request"}


def test_a_window_goes_out_many_requests_to_a_message(redis_db1_url):
    """Given ten lines and four requests a message, one tick submits the window through
    submit_many: three messages (4, 4, 2), one record per line, none published twice."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), requests_per_message=4)
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(10))))
    assert fleet.tick() == {bid: "in_progress"}
    assert [len(m) for m in fleet.messages] == [4, 4, 2] and fleet.many_calls == 1
    assert len(set(fleet.sent)) == 10 == len(fleet.sent)
    assert fleet.until_ended(bid, work=True) == "completed"
    assert fleet.obj(bid)["request_counts"] == {"total": 10, "completed": 10, "failed": 0}


def test_a_chunk_with_a_line_refused_at_submit_goes_line_by_line(redis_db1_url):
    """Given a chunk whose one line submit refuses (all or nothing for submit_many), the
    chunk is submitted line by line: the good lines go out once each, the bad one becomes an
    error line."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), requests_per_message=4)
    bid = fleet.create(jsonl(line("a"), line("b", model="gpt-9"), line("c"), line("d")))
    fleet.tick()
    assert fleet.many_calls == 1 and [len(m) for m in fleet.messages] == [1, 1, 1]
    assert fleet.until_ended(bid, work=True) == "completed"
    b = fleet.obj(bid)
    assert b["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert len(fleet.sent) == 3 == len(set(fleet.sent))


def test_a_publish_that_fails_midway_pauses_and_no_line_goes_twice(redis_db1_url):
    """Given Redis failing after submit_many's first message, the tick keeps what went out
    (in flight), deletes the records of what did not, and pauses at the first line that did
    not; the next tick submits the rest, and every line is published exactly once."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), requests_per_message=2)
    fleet.publish_fails_after = 1
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(5))))
    assert fleet.tick() == {bid: "in_progress"}
    assert len(fleet.messages) == 1 and len(fleet.sent) == 2
    assert set(fleet.bs.inflight(bid)) == set(fleet.sent)
    job = fleet.bs.get(bid)["job"]
    rest = {request_id_for(job, f"q{i}") for i in range(5)} - set(fleet.sent)
    assert len(rest) == 3 and all(fleet.store.get(rid) is None for rid in rest)
    fleet.publish_fails_after = None
    assert fleet.until_ended(bid, work=True) == "completed"
    assert len(fleet.sent) == 5 == len(set(fleet.sent))
    assert fleet.obj(bid)["request_counts"] == {"total": 5, "completed": 5, "failed": 0}


def test_a_deleted_job_fails_the_batchs_remaining_lines_job_deleted(redis_db1_url):
    """Given a batch whose job an operator deleted (`vigil job delete`), the lines still to
    submit are refused job_deleted and the batch still completes, every line accounted for."""
    fleet = Fleet(redis.Redis.from_url(redis_db1_url), batch_window=1)
    bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(3))))
    fleet.tick()
    job = fleet.bs.get(bid)["job"]
    fleet.end_job(job, "deleted by hand", "job_deleted")
    assert fleet.until_ended(bid) == "completed"
    b = fleet.obj(bid)
    assert b["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert {x["error"]["code"] for x in fleet.content(b["error_file_id"])} == {"job_deleted"}


def test_lists_are_newest_first_and_forget_expired_batches(fleet):
    a = fleet.create(jsonl(line("a")))
    fleet.now += 1
    b = fleet.create(jsonl(line("a")))
    assert fleet.bs.batch_ids(10) == [b, a]
    assert fleet.bs.batch_ids(1, after=b) == [a]
    fleet.client.delete(keys.batch(a))
    assert fleet.bs.batch_ids(10) == [b]
    assert fleet.client.zscore(keys.BATCHES, a) is None


def test_a_batch_survives_a_redis_restart_with_aof(tmp_path):
    """Given a batch in progress on a Redis with AOF, when Redis restarts, then the next ticks
    carry on from where it was: nothing submitted twice, every line recorded once."""
    rds = LocalRedis(appendonly=True).start()
    try:
        fleet = Fleet(rds.client(), batch_window=2)
        bid = fleet.create(jsonl(*(line(f"q{i}") for i in range(4))))
        fleet.tick()
        for rid in fleet.open_ids():
            fleet.finish(rid)
        stop_process(rds.proc)  # SIGTERM: Redis writes its AOF and exits
        rds.start()
        assert fleet.until_ended(bid, work=True) == "completed"
        assert len(fleet.sent) == 4 == len(set(fleet.sent))
        assert fleet.obj(bid)["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    finally:
        rds.stop()


def test_a_batch_deleted_by_hand_leaves_the_active_set(fleet):
    bid = fleet.create(jsonl(line("a")))
    fleet.client.delete(keys.batch(bid))
    assert fleet.tick() == {bid: "gone"}
    assert fleet.bs.active_ids() == [] and fleet.tick() == {}
