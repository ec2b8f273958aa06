"""Run an OpenAI Batch input file through `vigil.generate`: the engine of `vigil batch`.

The input is streamed; at most `window` requests are in flight; each result is appended to the
output file (or the error file) as it arrives, in order of completion. Request ids are
deterministic per (job, custom_id) (app/requests/batch_file.py), so rerunning the same command after an
interruption re-attaches to the requests already submitted (`apply_async` with the same task id
and the same request returns the existing one) and skips the custom_ids already in the output
file. The error file is rewritten by every run: failures are cheap to find again (a failed
request's stored outcome is returned on resubmit), and a line fixed since is tried again.
Formats, resumability and exit codes: docs/batch.md.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeRemainingColumn)
from rich.text import Text

from app.errors import (INVALID_REQUEST, REQUEST_LOST, RequestError, TransientError,
                        error_from_record)
from app.local.tiny_model import build_if_local
from app.requests import batch_file as batch
from app.requests.chat import ChatTemplates, rest_of_context
from app.requests.models import get_registry
from app.requests.submit import submit_request
from app.settings import get_settings
from app.state.store import RequestStore, shared_store

DEFAULT_WINDOW = 512
POLL_INTERVAL_S = 0.2

Submit = Callable[[str, dict], None]
# poll(ids) -> {id: (result dict, None) or (None, (code, message))} for the ids that have ended
Poll = Callable[[list[str]], dict[str, tuple[dict | None, tuple[str, str] | None]]]


class BatchUsageError(Exception):
    """The command cannot run as given (files, options); nothing was submitted. Exit status 2."""


@dataclass
class Tally:
    """Counts of one run: lines in the file, already done before it, succeeded and failed now."""

    total: int = 0
    skipped: int = 0
    ok: int = 0
    failed: int = 0

    @property
    def finished(self) -> int:
        return self.skipped + self.ok + self.failed


def default_paths(src: str | Path) -> tuple[Path, Path]:
    """The output and error files next to the input: `x.jsonl` -> `x.output.jsonl`,
    `x.errors.jsonl`."""
    src = Path(src)
    stem = src.name[:-len(".jsonl")] if src.name.endswith(".jsonl") else src.name
    return src.with_name(stem + ".output.jsonl"), src.with_name(stem + ".errors.jsonl")


def load_done(f: BinaryIO) -> set[str]:
    """The custom_ids in an output file opened "a+b" (a previous run's successes). A torn last
    line (the writer was killed mid-line) is cut off; any other line that is not an output line
    raises BatchUsageError rather than be appended to."""
    done: set[str] = set()
    f.seek(0)
    good = 0
    for n, raw in enumerate(f, 1):
        if not raw.endswith(b"\n"):
            break
        try:
            cid = json.loads(raw)["custom_id"]
        except (ValueError, KeyError, TypeError):
            raise BatchUsageError(f"{f.name} line {n} is not a batch output line; move the file "
                                  "away or choose another --output") from None
        done.add(cid)
        good += len(raw)
    f.truncate(good)
    f.seek(0, os.SEEK_END)
    return done


def _lines(f: BinaryIO) -> Iterator[tuple[int, str | None]]:
    """(line number, text) for each non-blank line; text None for a line that is not UTF-8."""
    for n, raw in enumerate(f, 1):
        try:
            text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError:
            yield n, None
            continue
        if text.strip():
            yield n, text


def count(src: Path, done: set[str]) -> tuple[int, int]:
    """(lines to process, how many of them are already in the output) for the progress bar."""
    total = 0
    found: set[str] = set()
    with open(src, "rb") as f:
        for n, text in _lines(f):
            total += 1
            if done and text is not None:
                try:
                    cid = batch.read_custom_id(text, n)[0]
                except RequestError:
                    continue
                if cid in done:
                    found.add(cid)
    return total, len(found)


class _Files:
    """The output and error files of one run: the output locked against a second writer."""

    def __init__(self, out: Path, err: Path):
        self.out = open(out, "a+b")
        try:
            fcntl.flock(self.out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.out.close()
            raise BatchUsageError(f"another vigil batch is writing {out}") from None
        try:
            self.done = load_done(self.out)
            self.err = open(err, "wb")
        except BaseException:
            self.out.close()
            raise

    def write(self, f: BinaryIO, lines: list[dict]) -> None:
        if lines:
            f.write("".join(batch.dumps(x) for x in lines).encode("utf-8"))
            f.flush()

    def close(self) -> None:
        self.err.close()
        self.out.close()


def run_batch(src: Path, out: Path, err: Path, job: str, window: int, *, submit: Submit,
              poll: Poll, render_chat: batch.RenderChat, chat_budget: batch.ChatBudget,
              on_progress: Callable[[Tally], None] = lambda t: None,
              poll_interval: float = POLL_INTERVAL_S, sleep=time.sleep, clock=time.time) -> Tally:
    """Process every line of `src`; returns the tally once every submitted request has ended and
    been written. `submit(request_id, kwargs)` publishes (RequestError fails the line; anything
    else, e.g. TransientError, stops the run with the outputs written so far intact);
    `poll(ids)` reports the ended ones. Never more than `window` requests in flight."""
    if window < 1:
        raise BatchUsageError("--window must be at least 1")
    if len({src.resolve(), out.resolve(), err.resolve()}) < 3:
        raise BatchUsageError("the input, output and error files must be three different files")
    if not src.is_file():
        raise BatchUsageError(f"no such file: {src}")
    files = _Files(out, err)
    try:
        tally = Tally()
        tally.total, tally.skipped = count(src, files.done)
        on_progress(tally)
        inflight: dict[str, tuple[str, str]] = {}  # request id -> (custom_id, kind)

        def collect(wait: bool) -> None:
            ended = poll(list(inflight)) if inflight else {}
            oks, fails = [], []
            for rid, (result, error) in ended.items():
                cid, kind = inflight.pop(rid)
                if result is not None:
                    oks.append(batch.success_line(rid, cid, kind, result, int(clock())))
                else:
                    fails.append(batch.error_line(batch.batch_id(rid), cid, *error))
            files.write(files.out, oks)
            files.write(files.err, fails)
            tally.ok += len(oks)
            tally.failed += len(fails)
            if ended:
                on_progress(tally)
            elif wait:
                sleep(poll_interval)

        def fail(id_: str, cid: str | None, e: RequestError) -> None:
            files.write(files.err, [batch.error_line(id_, cid, e.code, e.detail)])
            tally.failed += 1
            on_progress(tally)

        seen: set[str] = set()
        last_poll = clock()
        with open(src, "rb") as f:
            for n, text in _lines(f):
                try:
                    if text is None:
                        raise RequestError.of(INVALID_REQUEST, f"line {n}: not UTF-8 text")
                    cid, obj = batch.read_custom_id(text, n)
                except RequestError as e:
                    fail(batch.line_id(n), None, e)
                    continue
                if cid in seen:
                    fail(batch.line_id(n), cid, RequestError.of(
                        INVALID_REQUEST, f"line {n}: duplicate custom_id {cid!r}"))
                    continue
                seen.add(cid)
                if cid in files.done:
                    continue
                rid = batch.request_id_for(job, cid)
                while len(inflight) >= window:
                    collect(wait=True)
                try:
                    kind, kwargs = batch.to_request(obj, n, job, render_chat, chat_budget)
                    submit(rid, kwargs)
                except RequestError as e:
                    fail(batch.batch_id(rid), cid, e)
                    continue
                inflight[rid] = (cid, kind)
                if clock() - last_poll >= poll_interval:
                    collect(wait=False)
                    last_poll = clock()
        while inflight:
            collect(wait=True)
        return tally
    finally:
        files.close()


def celery_submit(request_id: str, kwargs: dict) -> None:
    """Submit `vigil.generate` under `request_id`, as `generate.apply_async` does
    (app/requests/submit.py): an existing identical request is re-attached; a different one
    under that id raises RequestError(invalid_request)."""
    submit_request(kwargs, request_id, settings=get_settings(), registry=get_registry(),
                   store=shared_store())


def record_poll(store: RequestStore) -> Poll:
    """A `poll` reading the request records (the source of truth the task itself returns) in one
    Redis round trip per call. A record that is gone (deleted, or expired a day after it ended)
    is reported as an error with code `request_lost` (as `r.get()` does): rerun to submit it
    again. Raises TransientError(redis_unavailable) when Redis cannot be reached."""
    def poll(ids: list[str]):
        ended = {}
        for rid, outcome in store.ended(ids).items():
            if outcome is None:
                ended[rid] = (None, (REQUEST_LOST, "the request's record is gone from Redis "
                                     "(lost in a Redis crash, deleted or expired); rerun to "
                                     "submit it again"))
            elif outcome.result is not None:
                ended[rid] = (outcome.result, None)
            else:
                e = error_from_record(outcome.error_kind, outcome.error)
                ended[rid] = (None, (e.code, e.detail))
        return ended

    return poll


def run_command(src: str | Path, job: str | None = None, output: str | Path | None = None,
                errors: str | Path | None = None, window: int = DEFAULT_WINDOW,
                quiet: bool = False) -> int:
    """`vigil batch`: run `src` with a progress bar on stderr. Returns the exit status: 0 when
    every line succeeded (now or in an earlier run), 1 when some line failed or the run stopped
    early (Redis unreachable, interrupted: rerun the same command to resume), 2 when it could not
    start (bad options or files; nothing was submitted)."""
    src = Path(src)
    job = job or batch.default_job(src)
    if not batch.valid_job(job):
        print(f"vigil batch: --job {job!r} must match {batch.JOB_PATTERN}", file=sys.stderr)
        return 2
    out_default, err_default = default_paths(src)
    out, err = Path(output or out_default), Path(errors or err_default)
    try:
        with _progress(job, quiet) as on_progress:
            tally = run_batch(src, out, err, job, window, submit=celery_submit,
                              poll=_store_poll(), render_chat=_chat_templates(),
                              chat_budget=rest_of_context, on_progress=on_progress)
    except BatchUsageError as e:
        print(f"vigil batch: {e}", file=sys.stderr)
        return 2
    except (TransientError, KeyboardInterrupt) as e:
        why = str(e) or "interrupted"
        print(f"vigil batch: stopped ({why}); what finished is in {out} and {err}; rerun the "
              "same command to resume", file=sys.stderr)
        return 1
    print(f"vigil batch: job {job}: {tally.ok} succeeded, {tally.failed} failed, "
          f"{tally.skipped} already done; output {out}, errors {err}", file=sys.stderr)
    return 0 if tally.failed == 0 else 1


def _store_poll() -> Poll:
    return record_poll(shared_store())


def _chat_templates() -> batch.RenderChat:
    return ChatTemplates(get_registry(), build_if_local)


class _progress:
    """A rich progress bar (done of total, ok/failed, rate, ETA) fed by run_batch's tallies."""

    def __init__(self, job: str, quiet: bool):
        self.job, self.quiet, self.bar, self.task = job, quiet, None, None

    def __enter__(self) -> Callable[[Tally], None]:
        if self.quiet:
            return lambda t: None

        class Rate(ProgressColumn):
            def render(self, task):
                return Text(f"{task.speed:.1f}/s" if task.speed else "-/s")

        self.bar = Progress(
            TextColumn("batch {task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("[green]{task.fields[ok]} ok[/] [red]{task.fields[failed]} failed[/]"),
            Rate(), TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True))
        self.bar.start()
        return self.update

    def update(self, t: Tally) -> None:
        if self.task is None:  # the first call: what earlier runs did is not this run's rate
            self.task = self.bar.add_task(self.job, total=t.total, completed=t.finished,
                                          ok=t.ok + t.skipped, failed=t.failed)
        else:
            self.bar.update(self.task, completed=t.finished, ok=t.ok + t.skipped,
                            failed=t.failed)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
