"""`vigil batch submit | status | list | cancel | results`: batch objects from the terminal.

    vigil batch submit eval.jsonl --completion-window 24h --metadata team=eval   # prints the id
    vigil batch status batch_... [--json] [--watch]
    vigil batch list [--json]
    vigil batch cancel batch_...
    vigil batch results batch_... [--output F] [--errors F]

The batch lives in Redis and the fleet runs it (app/fleet/batches.py): the terminal that
submitted it can exit at once. Exit status: 0 done as asked, 1 a batch or file that does not
exist or cannot be cancelled, or Redis unreachable, 2 bad options or a file refused before
anything was stored (too large, unreadable).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from app.errors import INVALID_REQUEST, RequestError, TransientError
from app.fleet import batches
from app.settings import get_settings
from app.state.batches import BatchStore
from app.state.store import open_store

SUBCOMMANDS = ("submit", "status", "list", "cancel", "results")
# How often `status --watch` reads the batch.
WATCH_INTERVAL_S = 1.0


def add_parsers(sub) -> None:
    """Add the batch-object subcommands to `vigil batch`'s subparsers."""
    s = sub.add_parser("submit", help="store a batch file in the fleet and print its id; the "
                       "fleet runs it (this terminal may exit)")
    s.add_argument("file", help="input JSONL: one {custom_id, method, url, body} per line")
    s.add_argument("--completion-window", default="24h",
                   help="end it (expired) after this long: 24h (default), 90m, 2d ...")
    s.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="a metadata pair (repeatable, at most 16)")
    s.add_argument("--endpoint", help="/v1/completions or /v1/chat/completions (default: the "
                   "first line's url)")
    st = sub.add_parser("status", help="a batch's status and counts")
    st.add_argument("id")
    st.add_argument("--json", action="store_true", help="the Batch object (OpenAI's shape)")
    st.add_argument("--watch", action="store_true", help="a progress bar until it ends")
    ls = sub.add_parser("list", help="batches, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--json", action="store_true")
    c = sub.add_parser("cancel", help="cancel a batch: waiting lines end batch_cancelled, "
                       "running ones are aborted; finished results are kept")
    c.add_argument("id")
    r = sub.add_parser("results", help="write a batch's output and error files (partial while "
                       "it runs)")
    r.add_argument("id")
    r.add_argument("--output", help="successes (default ID.output.jsonl)")
    r.add_argument("--errors", help="failures (default ID.errors.jsonl)")


def run(args: argparse.Namespace) -> int:
    """Run one batch-object subcommand; returns the exit status (module docstring)."""
    bs = open_store(get_settings()).batches()
    try:
        return _COMMANDS[args.batch_cmd](bs, args)
    except (RequestError, batches.BatchNotFound, TransientError) as e:
        print(f"vigil batch {args.batch_cmd}: {e}", file=sys.stderr)
        return 1


def _submit(bs: BatchStore, args: argparse.Namespace) -> int:
    s = get_settings()
    path = Path(args.file)
    try:
        if path.stat().st_size > s.batch_max_bytes:
            print(f"vigil batch submit: {path} has {path.stat().st_size:,} bytes; a batch file "
                  f"may have at most {s.batch_max_bytes:,} (VIGIL_BATCH_MAX_BYTES)",
                  file=sys.stderr)
            return 2
        data = path.read_bytes()
    except OSError as e:
        print(f"vigil batch submit: {e}", file=sys.stderr)
        return 2
    metadata = {}
    for pair in args.metadata:
        key, eq, value = pair.partition("=")
        if not eq:
            print(f"vigil batch submit: --metadata {pair!r} must be KEY=VALUE", file=sys.stderr)
            return 2
        metadata[key] = value
    endpoint = args.endpoint or first_url(data)
    now = time.time()
    try:  # everything checkable before storing anything
        if endpoint not in batches.ENDPOINTS:
            raise RequestError.of(INVALID_REQUEST, f"endpoint {endpoint!r} is not served (use "
                                  f"{' or '.join(batches.ENDPOINTS)}; the first line's url is "
                                  "the batch's unless --endpoint says otherwise)")
        batches.parse_window(args.completion_window)
        batches.check_metadata(metadata)
        f = batches.upload_file(bs, data, path.name, batches.PURPOSE, now, s)
    except RequestError as e:
        print(f"vigil batch submit: {e}", file=sys.stderr)
        return 2
    b = batches.create_batch(bs, f["id"], endpoint, args.completion_window, metadata, now, s)
    print(b["id"])
    print(f"vigil batch: {path} stored as {f['id']}; batch {b['id']} is {b['status']} "
          f"(follow it: vigil batch status {b['id']} --watch)", file=sys.stderr)
    return 0


def first_url(data: bytes) -> str:
    """The `url` of the file's first request line ("/v1/completions" when it has none): the
    batch's endpoint unless --endpoint says otherwise."""
    for raw in data.split(b"\n", 50)[:50]:  # the head only: the file may be 200 MiB
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                break
            if isinstance(url, str):
                return url
            break
    return batches.ENDPOINTS[0]


def _status(bs: BatchStore, args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(bs, args.id)
    b = batches.with_tick(batches.get_batch(bs, args.id),
                          batches.tick_status(bs, get_settings(), time.time()))
    print(json.dumps(b, indent=2) if args.json else summary(b))
    return 0


def summary(b: dict) -> str:
    """A batch in a few human lines: status, counts, times, files, errors."""
    c = b["request_counts"]
    lines = [f"{b['id']}  {b['status']}  {c['completed']} completed, {c['failed']} failed of "
             f"{c['total']}  ({b['endpoint']}, window {b['completion_window']})"]
    for name in ("created", "in_progress", "finalizing", "completed", "failed", "expired",
                 "cancelling", "cancelled", "expires"):
        if b[f"{name}_at"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b[f"{name}_at"]))
            lines.append(f"  {name + '_at':<15} {when}")
    for name in ("input_file_id", "output_file_id", "error_file_id"):
        if b[name]:
            lines.append(f"  {name:<15} {b[name]}")
    if b["metadata"]:
        lines.append(f"  metadata        {json.dumps(b['metadata'])}")
    for e in (b["errors"] or {}).get("data", []):
        lines.append(f"  error: {e['message']}")
    tick = b.get("vigil_batch_tick")
    if tick:
        last = "never" if tick["age_s"] is None else f"{tick['age_s']:.0f} s ago"
        lines.append(f"  batch tick      last ran {last} (every {tick['every_s']:g} s)")
        if tick["warning"]:
            lines.append(f"  warning: {tick['warning']}; this batch does not move until it "
                         "runs")
    return "\n".join(lines)


def _watch(bs: BatchStore, batch_id: str) -> int:
    b = batches.get_batch(bs, batch_id)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[state]}"), console=Console(stderr=True))
    with bar:
        task = bar.add_task(batch_id, total=None, state=b["status"])
        while True:
            c = b["request_counts"]
            bar.update(task, total=c["total"] or None, completed=c["completed"] + c["failed"],
                       state=f"{b['status']}: {c['completed']} ok, {c['failed']} failed")
            if b["status"] in batches.ENDED:
                break
            time.sleep(WATCH_INTERVAL_S)
            b = batches.get_batch(bs, batch_id)
    print(summary(b))
    return 0


def _list(bs: BatchStore, args: argparse.Namespace) -> int:
    rows = [batches.batch_object(b) for b in map(bs.get, bs.batch_ids(args.limit)) if b]
    if args.json:
        print(json.dumps(rows))
    for b in rows if not args.json else ():
        c = b["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"]))
        print(f"{b['id']:<40} {b['status']:<11} {c['completed']:>7} ok {c['failed']:>7} failed "
              f"of {c['total']:<7} {created}")
    return 0


def _cancel(bs: BatchStore, args: argparse.Namespace) -> int:
    b = batches.cancel_batch(bs, args.id, time.time())
    print(f"batch {b['id']} is {b['status']}")
    return 0


def _results(bs: BatchStore, args: argparse.Namespace) -> int:
    b = batches.get_batch(bs, args.id)
    out = Path(args.output or f"{args.id}.output.jsonl")
    err = Path(args.errors or f"{args.id}.errors.jsonl")
    counts = []
    for path, errors in ((out, False), (err, True)):
        lines = batches.result_lines(bs, args.id, errors)
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        counts.append(len(lines))
    state = "complete" if b["status"] in batches.ENDED else f"partial: the batch is {b['status']}"
    print(f"batch {args.id}: {counts[0]} output line(s) in {out}, {counts[1]} error line(s) in "
          f"{err} ({state})", file=sys.stderr)
    return 0


_COMMANDS = {"submit": _submit, "status": _status, "list": _list, "cancel": _cancel,
             "results": _results}
