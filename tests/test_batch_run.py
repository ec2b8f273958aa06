"""Redis tier: `vigil batch FILE.jsonl` (app/ops/batch_run.py) on top of batch objects. The
command runs against a real Redis; each time it would wait for the next look at its batch, the
test's fleet (tests/test_batch_objects.py's Fleet: the real submit, `end_request` as the
workers) finishes what is open and runs one batch tick. Witnesses: the files the command
writes, and the messages the fleet captured (none sent twice)."""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
import redis

from app.errors import PROMPT_TOO_LONG, RequestError
from app.fleet import batches
from app.ops import batch_cli
from app.ops.batch_run import run_file
from app.requests import batch_file as fmt
from app.state import keys
from tests.test_batch_objects import Fleet

pytestmark = pytest.mark.redis


def line(cid, prompt="p", url="/v1/completions", **body) -> dict:
    b = {"model": "tiny-llama", **body}
    if url == "/v1/completions":
        b["prompt"] = prompt
    return {"custom_id": cid, "method": "POST", "url": url, "body": b}


def write(path: Path, objs) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


class Runner:
    """Runs the command on the fleet's Redis; `between` is what happens at each wait (by
    default: the open requests end, a prompt "fail" with prompt_too_long, and a tick runs)."""

    def __init__(self, fleet: Fleet, tmp: Path):
        self.fleet, self.tmp = fleet, tmp
        self.between = self.work

    def work(self) -> None:
        for rid in self.fleet.open_ids():
            prompt = json.loads(self.fleet.store.get(rid)["request"]).get("prompt")
            if prompt == "fail":
                self.fleet.fail(rid, RequestError.of(PROMPT_TOO_LONG, "too long"))
            else:
                self.fleet.finish(rid)
        self.fleet.tick()

    def run(self, src="in.jsonl", **kw) -> int:
        kw.setdefault("quiet", True)
        return run_file(lambda: self.fleet.bs, self.fleet.settings, self.tmp / src,
                        sleep=lambda s: self.between(), clock=lambda: self.fleet.now, **kw)

    def out(self) -> list[dict]:
        return read(self.tmp / "in.output.jsonl")

    def err(self) -> list[dict]:
        return read(self.tmp / "in.errors.jsonl")


@pytest.fixture()
def runner(redis_db1_url, tmp_path) -> Runner:
    return Runner(Fleet(redis.Redis.from_url(redis_db1_url)), tmp_path)


def test_the_command_writes_successes_and_every_kind_of_failure_and_goes_on(runner, tmp_path):
    """Given a file mixing completion and chat lines with bad lines among them (not JSON, a
    failure in the engine, a duplicate custom_id, a request refused at submit, an endpoint not
    served, not UTF-8), when `vigil batch FILE` runs it, then every good line has one output
    line, every bad line one error line with its code and line, exit status 1, and nothing
    was published twice."""
    write(tmp_path / "in.jsonl", [
        line("a", "one"), "not json", line("b", "fail"), "", line("a", "x"),
        line("c", "big", max_tokens=10**6), {**line("d"), "url": "/v1/embeddings"},
        line("e", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
        *[line(f"n{i}", f"p{i}") for i in range(6)]])
    with (tmp_path / "in.jsonl").open("ab") as f:
        f.write(b"\xff\xfe\n")  # line 15: not UTF-8
    assert runner.run(job="j", window=2) == 1
    outs, errs = runner.out(), runner.err()
    assert sorted(o["custom_id"] for o in outs) == ["a", "e"] + [f"n{i}" for i in range(6)]
    assert all(o["id"] == "batch_req_" + fmt.request_id_for("j", o["custom_id"]) for o in outs)
    chat = next(o for o in outs if o["custom_id"] == "e")["response"]["body"]
    assert chat["object"] == "chat.completion"
    by_line = {(e["custom_id"], e["error"]["code"], e["error"]["message"].split(":")[0])
               for e in errs}
    assert by_line == {(None, "invalid_request", "line 2"), ("b", "prompt_too_long", "too long"),
                       ("a", "invalid_request", "line 5"), ("d", "invalid_request", "line 7"),
                       ("c", "invalid_request", f"max_tokens={10**6} is above 512, the most "
                                                "tiny-llama can generate"),
                       (None, "invalid_request", "line 15")}
    assert {e["id"] for e in errs if e["custom_id"] in (None, "a")} == {
        "batch_req_line_2", "batch_req_line_5", "batch_req_line_15"}
    assert all(n == 1 for n in Counter(runner.fleet.sent).values())
    b = batches.get_batch(runner.fleet.bs, runner.fleet.bs.for_job("j"))
    assert b["status"] == "completed" and b["request_counts"] == {
        "total": 14, "completed": 8, "failed": 6}


def test_an_interrupted_run_leaves_the_batch_running_and_a_rerun_follows_it(runner, tmp_path):
    """Given a run interrupted (Ctrl-C) after its first tick, the batch goes on; the same command
    again follows the same batch (nothing submitted twice) and ends with exit status 0; once it
    ended, a third run with a changed file creates a new batch under the job whose unchanged
    lines are answered from their records and only the new line runs."""
    write(tmp_path / "in.jsonl", [line(f"n{i}", f"p{i}") for i in range(5)])
    calls = []

    def interrupt():
        calls.append(1)
        runner.fleet.tick()
        raise KeyboardInterrupt

    runner.between = interrupt
    assert runner.run(job="j") == 1 and calls == [1]
    first = runner.fleet.bs.for_job("j")
    assert batches.get_batch(runner.fleet.bs, first)["status"] == "in_progress"
    runner.between = runner.work
    assert runner.run(job="j") == 0
    assert runner.fleet.bs.for_job("j") == first
    assert sorted(o["custom_id"] for o in runner.out()) == [f"n{i}" for i in range(5)]
    assert len(runner.fleet.sent) == 5 == len(set(runner.fleet.sent))
    assert runner.run(job="j") == 0  # ended, same file: the results written again
    assert len(runner.out()) == 5 and len(runner.fleet.sent) == 5
    write(tmp_path / "in.jsonl", [line(f"n{i}", f"p{i}") for i in range(6)])
    assert runner.run(job="j") == 0
    assert runner.fleet.bs.for_job("j") != first
    assert len(runner.out()) == 6
    sent = Counter(runner.fleet.sent)
    assert len(sent) == 6 and set(sent.values()) == {1}  # the five re-attached, one new


def test_a_different_file_under_a_live_jobs_batch_or_a_cancelled_one_is_refused(runner,
                                                                                tmp_path):
    write(tmp_path / "in.jsonl", [line("a")])
    runner.between = lambda: (runner.fleet.tick(), (_ for _ in ()).throw(KeyboardInterrupt))
    assert runner.run(job="j") == 1
    write(tmp_path / "in.jsonl", [line("a"), line("b")])
    (tmp_path / "in.output.jsonl").write_text("kept\n")
    assert runner.run(job="j") == 2  # a different file while the job's batch runs
    assert (tmp_path / "in.output.jsonl").read_text() == "kept\n"  # not truncated
    batches.cancel_batch(runner.fleet.bs, runner.fleet.bs.for_job("j"), runner.fleet.now)
    runner.fleet.tick()
    assert runner.run(job="j") == 2  # its requests were failed: a new --job is needed
    runner.between = runner.work
    assert runner.run(job="j2") == 0 and len(runner.out()) == 2


def test_usage_errors_are_refused_before_anything_is_submitted(runner, tmp_path):
    assert runner.run() == 2  # no such file
    write(tmp_path / "in.jsonl", [line("a")])
    assert runner.run(window=0) == 2
    assert runner.run(output=tmp_path / "in.jsonl") == 2
    assert runner.run(job="-bad job") == 2
    assert runner.fleet.bs.batch_ids(10) == [] and not (tmp_path / "in.errors.jsonl").exists()


def test_a_second_run_on_the_same_output_is_refused_while_the_first_holds_it(runner, tmp_path):
    write(tmp_path / "in.jsonl", [line("a")])
    inner = []

    def second_run():
        inner.append(runner.run(job="other"))
        runner.work()

    runner.between = second_run
    assert runner.run(job="j") == 0
    assert inner and set(inner) == {2} and len(runner.out()) == 1


def test_a_batch_deleted_while_followed_ends_the_command_with_status_1(runner, tmp_path):
    write(tmp_path / "in.jsonl", [line("a")])
    runner.between = lambda: runner.fleet.client.delete(
        keys.batch(runner.fleet.bs.for_job("j")))
    assert runner.run(job="j") == 1


def test_submit_refuses_an_endpoint_not_served_before_storing_anything(runner, tmp_path):
    """`vigil batch submit` of a file whose first line names /v1/embeddings (and no
    --endpoint) exits 2 with nothing stored, as its other refusals do."""
    write(tmp_path / "in.jsonl", [{**line("a"), "url": "/v1/embeddings"}])
    args = argparse.Namespace(file=str(tmp_path / "in.jsonl"), completion_window="24h",
                              metadata=[], endpoint=None)
    assert batch_cli._submit(runner.fleet.bs, args) == 2
    assert runner.fleet.bs.file_ids() == [] and runner.fleet.bs.batch_ids(10) == []
    # `vigil batch FILE` (lenient) runs such a file: that line is its error line.
    assert runner.run(job="j") == 1
    [e] = runner.err()
    assert e["custom_id"] == "a" and "not supported" in e["error"]["message"]


def test_the_command_says_when_the_batch_tick_is_overdue_and_when_it_runs_again(
        runner, tmp_path, monkeypatch, capsys):
    """Given a batch whose tick (beat's) stopped running, when `vigil batch FILE` follows it,
    then it says once that the batch does not move and why, and says so again when the tick
    runs again; the batch then completes as usual."""
    write(tmp_path / "in.jsonl", [line("a"), line("b")])
    overdue = {"state": "overdue", "every_s": 2.0, "warning": "vigil.batch_tick last ran 60 s "
               "ago but should run every 2 s: beat is down or stuck"}
    ok = {"state": "ok", "every_s": 2.0, "warning": ""}
    states = iter([overdue, overdue, overdue])
    monkeypatch.setattr(batches, "tick_status", lambda bs, s, now: next(states, ok))
    waits = []

    def between():  # the fleet is idle while the tick is overdue, then works
        waits.append(1)
        if len(waits) > 3:
            runner.work()

    runner.between = between
    assert runner.run() == 0
    err = capsys.readouterr().err
    assert err.count("does not move: vigil.batch_tick last ran 60 s ago") == 1
    assert "the batch tick runs again" in err
    assert [o["custom_id"] for o in runner.out()] == ["a", "b"]
