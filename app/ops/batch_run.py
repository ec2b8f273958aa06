"""`vigil batch FILE.jsonl`: submit a file as a batch object, then follow it until it ends.

The batch is a batch object the fleet runs (app/fleet/batches.py), created with the command's
own rules: `--job` names the requests' job (with each `custom_id` it fixes the request ids), a
bad line becomes an error line instead of failing the batch, the lines may mix
/v1/completions and /v1/chat/completions, and `--window` bounds its requests in flight. This
command only follows: it writes the output and error files from the batch's results as they
come and shows a progress bar. Stopping it (Ctrl-C, a kill, Redis unreachable) stops nothing
in the fleet; rerunning the same command finds the job's batch again and follows it. A rerun
after the batch ended with a changed file creates a new batch under the same job: lines whose
request already ran are answered from their records, nothing runs twice. Formats and exit
codes: docs/batch.md.
"""
from __future__ import annotations

import fcntl
import hashlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeRemainingColumn)
from rich.text import Text

from app.errors import RequestError, TransientError
from app.fleet import batches
from app.fleet.housekeeping_runs import NEVER, OVERDUE_INTERVALS, OVERDUE_SLACK_S
from app.ops.batch_cli import first_url
from app.requests import batch_file as batch
from app.settings import VigilSettings, get_settings
from app.state.batches import BatchStore
from app.state.store import open_store

DEFAULT_WINDOW = 512
POLL_INTERVAL_S = 1.0


class BatchUsageError(Exception):
    """The command cannot run as given (files, options); nothing was submitted. Exit status 2."""


@dataclass
class Tally:
    """A batch's progress as this command shows it: lines, and how many succeeded and failed."""

    total: int = 0
    ok: int = 0
    failed: int = 0

    @property
    def finished(self) -> int:
        return self.ok + self.failed


def default_paths(src: str | Path) -> tuple[Path, Path]:
    """The output and error files next to the input: `x.jsonl` -> `x.output.jsonl`,
    `x.errors.jsonl`."""
    src = Path(src)
    stem = src.name[:-len(".jsonl")] if src.name.endswith(".jsonl") else src.name
    return src.with_name(stem + ".output.jsonl"), src.with_name(stem + ".errors.jsonl")


class _Files:
    """The output and error files of one run, both rewritten from the batch's results; the
    output locked against a second `vigil batch` writing it. Nothing is truncated before
    `start` (a refused run leaves the files of an earlier one as they were)."""

    def __init__(self, out: Path, err: Path):
        self.out = open(out, "ab")
        try:
            fcntl.flock(self.out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.out.close()
            raise BatchUsageError(f"another vigil batch is writing {out}") from None
        self.err_path, self.err = err, None
        self.written = {False: 0, True: 0}  # errors? -> lines written

    def start(self) -> None:
        """Empty both files: the batch's results are written again from the first."""
        self.out.truncate(0)
        self.err = open(self.err_path, "wb")

    def catch_up(self, bs: BatchStore, batch_id: str) -> None:
        """Append the batch's result lines recorded since the last call."""
        for errors, f in ((False, self.out), (True, self.err)):
            lines = bs.results(batch_id, errors, self.written[errors], 10_000)
            while lines:
                f.write(b"".join(x + b"\n" for x in lines))
                self.written[errors] += len(lines)
                lines = bs.results(batch_id, errors, self.written[errors], 10_000)
            f.flush()

    def close(self) -> None:
        if self.err is not None:
            self.err.close()
        self.out.close()


def check_usage(src: Path, out: Path, err: Path, job: str, window: int) -> None:
    """BatchUsageError for options or files the command cannot run with."""
    if window < 1:
        raise BatchUsageError("--window must be at least 1")
    if not batch.valid_job(job):
        raise BatchUsageError(f"--job {job!r} must match {batch.JOB_PATTERN}")
    if len({src.resolve(), out.resolve(), err.resolve()}) < 3:
        raise BatchUsageError("the input, output and error files must be three different files")
    if not src.is_file():
        raise BatchUsageError(f"no such file: {src}")


def find_or_submit(bs: BatchStore, data: bytes, name: str, job: str, window: int, now: float,
                   settings: VigilSettings) -> tuple[str, bool]:
    """(batch id, whether it is new): the job's batch when it is the same file (or still live:
    then it must be), else a new lenient batch of `data` under `job`. BatchUsageError for a
    different file while the job's batch still runs, or a job that a cancel or an expiry
    ended (its requests were failed: their ids cannot run again)."""
    digest = hashlib.sha256(data).hexdigest()
    known = bs.for_job(job)
    b = bs.get(known) if known else None
    if b is not None:
        same = b.get("sha256") == digest
        if same and b["status"] not in (batches.FAILED, batches.CANCELLED, batches.EXPIRED):
            return b["id"], False
        if b["status"] not in batches.ENDED:
            raise BatchUsageError(f"job {job} has a batch still running ({b['id']}) from a "
                                  "different file: wait for it, cancel it (vigil batch cancel "
                                  f"{b['id']}), or use another --job")
        if b["status"] in (batches.CANCELLED, batches.EXPIRED):
            raise BatchUsageError(f"job {job}'s batch {b['id']} was {b['status']}: its open "
                                  "requests were failed; use another --job to run the file again")
    if len(data) > settings.batch_max_bytes:
        raise BatchUsageError(f"the file has {len(data):,} bytes; a batch file may have at most "
                              f"{settings.batch_max_bytes:,} (VIGIL_BATCH_MAX_BYTES)")
    try:
        f = batches.upload_file(bs, data, name, batches.PURPOSE, now, settings)
    except RequestError as e:  # an empty file
        raise BatchUsageError(e.detail) from None
    endpoint = first_url(data)  # lenient: a line of another url is that line's error
    if endpoint not in batches.ENDPOINTS:
        endpoint = batches.ENDPOINTS[0]
    b = batches.create_batch(bs, f["id"], endpoint, "24h", {"vigil_batch": name[:500]}, now,
                             settings, job=job, lenient=True, window=window, digest=digest)
    return b["id"], True


def follow(bs: BatchStore, batch_id: str, files: _Files,
           on_progress: Callable[[Tally], None] = lambda t: None,
           poll_interval: float = POLL_INTERVAL_S, sleep=time.sleep, clock=time.monotonic,
           say: Callable[[str], None] = lambda m: None,
           tick: Callable[[], dict] | None = None) -> dict:
    """Write the batch's results to `files` as they are recorded until it ends; returns its
    final Batch object. With `tick` (the batch tick's state, app/fleet/batches.py
    `tick_status`), say when the batch tick that advances the batch has never run or is
    overdue (a tick that never ran, once it had time to: a fleet may have just started), and
    when it runs again. Raises TransientError when Redis cannot be reached."""
    started, warned = clock(), ""
    while True:
        b = batches.get_batch(bs, batch_id)
        files.catch_up(bs, batch_id)
        c = b["request_counts"]
        on_progress(Tally(c["total"], c["completed"], c["failed"]))
        if b["status"] in batches.ENDED:
            files.catch_up(bs, batch_id)
            return b
        state = tick() if tick is not None else None
        if state is not None and state["state"] == NEVER and clock() - started < \
                OVERDUE_INTERVALS * state["every_s"] + OVERDUE_SLACK_S:
            state = None  # not yet: the first tick may still come
        if state is not None and state["state"] != warned:
            if state["warning"]:
                say(f"batch {batch_id} does not move: {state['warning']}")
            elif warned:
                say("the batch tick runs again")
            warned = state["state"] if state["warning"] else ""
        sleep(poll_interval)


def run_command(src: str | Path, job: str | None = None, output: str | Path | None = None,
                errors: str | Path | None = None, window: int = DEFAULT_WINDOW,
                quiet: bool = False) -> int:
    """`vigil batch`: submit `src` as a batch (or find the job's batch again), follow it with a
    progress bar on stderr and write its output and error files. Returns the exit status: 0
    when it completed and every line succeeded, 1 when some line failed, the batch did not
    complete, or the command stopped early (interrupted, Redis unreachable: the batch goes on;
    rerun the same command to follow it), 2 when it could not start (bad options or files)."""
    settings = get_settings()
    return run_file(lambda: open_store(settings).batches(), settings, src, job, output, errors,
                    window, quiet)


def run_file(store: Callable[[], BatchStore], settings: VigilSettings, src: str | Path,
             job: str | None = None, output: str | Path | None = None,
             errors: str | Path | None = None, window: int = DEFAULT_WINDOW,
             quiet: bool = False, sleep=time.sleep, clock=time.time) -> int:
    """`run_command` on the batch store `store()` returns (made once the options passed), with
    `settings`, `sleep` (between two looks at the batch) and `clock` (the batch's creation
    time) given."""
    src = Path(src)
    job = job or batch.default_job(src)
    out_default, err_default = default_paths(src)
    out, err = Path(output or out_default), Path(errors or err_default)

    def say(msg: str) -> None:
        print(f"vigil batch: {msg}", file=sys.stderr)

    try:
        check_usage(src, out, err, job, window)
        files = _Files(out, err)
    except BatchUsageError as e:
        say(str(e))
        return 2
    batch_id = None
    try:
        bs = store()
        batch_id, new = find_or_submit(bs, src.read_bytes(), src.name, job, window, clock(),
                                       settings)
        say(f"{'submitted' if new else 'following'} batch {batch_id} (job {job})")
        files.start()
        with _progress(job, quiet) as on_progress:
            b = follow(bs, batch_id, files, on_progress, sleep=sleep, say=say,
                       tick=lambda: batches.tick_status(bs, settings, time.time()))
    except BatchUsageError as e:
        say(str(e))
        return 2
    except batches.BatchNotFound as e:  # deleted by hand, or past its retention, meanwhile
        say(f"{e}; rerun to submit the file again")
        return 1
    except (TransientError, KeyboardInterrupt) as e:
        why = str(e) or "interrupted"
        goes_on = f"; batch {batch_id} goes on in the fleet" if batch_id else ""
        say(f"stopped ({why}){goes_on}; what finished is in {out} and {err}; rerun the same "
            "command to follow it")
        return 1
    finally:
        files.close()
    c = b["request_counts"]
    say(f"job {job}: batch {batch_id} {b['status']}: {c['completed']} succeeded, "
        f"{c['failed']} failed; output {out}, errors {err}")
    for e in (b["errors"] or {}).get("data", []):
        say(f"error: {e['message']}")
    return 0 if b["status"] == batches.COMPLETED and c["failed"] == 0 else 1


class _progress:
    """A rich progress bar (done of total, ok/failed, rate, ETA) fed by the batch's counts."""

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
        if self.task is None:  # the first call: what ran before this command is not its rate
            self.task = self.bar.add_task(self.job, total=t.total or None,
                                          completed=t.finished, ok=t.ok, failed=t.failed)
        else:
            self.bar.update(self.task, total=t.total or None, completed=t.finished, ok=t.ok,
                            failed=t.failed)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

