"""Batch objects: OpenAI's Batch API, served by the fleet (docs/batch.md).

    file = upload_file(bs, data, "eval.jsonl", "batch", now, settings)
    b = create_batch(bs, file["id"], "/v1/completions", "24h", {"team": "eval"}, now, settings)
    ...beat's batch tick runs `advance_batches` every VIGIL_BATCH_TICK_INTERVAL...
    batch_object(bs.get(b["id"]))["status"]    # validating -> in_progress -> completed

**The lifecycle.** `create_batch` stores the batch `validating` and returns at once. The tick
(a beat task, lock-guarded, so one process advances batches at a time) then:
- validates the file with the format rules of app/requests/batch_file.py: a bad line, a
  duplicate `custom_id`, a line for another endpoint, or more lines than VIGIL_BATCH_MAX_REQUESTS
  fail the batch (`failed`, with per-line `errors`); otherwise it is `in_progress`;
- submits its lines through `submit_request` as the job `batch_<hex>` (its own queue per pool, so
  the pool serves it in turn with other jobs), at most VIGIL_BATCH_WINDOW in flight; a line's
  request id is fixed by (job, custom_id), so a tick that stopped halfway and runs again
  re-attaches to what it already submitted instead of submitting it twice;
- records each ended request's output line once (a Lua HSETNX on the line number), in order of
  completion, and counts it (`request_counts`);
- ends the batch: `completed` when every line is recorded (through `finalizing`); `expired` when
  its completion window ran out; `cancelled` after `cancel_batch` asked (`cancelling`). Ending
  early ends the batch's job: open requests fail `batch_cancelled` / `batch_expired` (running
  ones are aborted in their engines), lines never submitted get the same error line, and every
  result already finished is kept.
Everything lives in Redis: a batch survives its submitter exiting, a worker dying (its requests
are the fleet's ordinary requests) and a Redis restart with AOF. A request whose record vanished
(lost in a Redis crash) is submitted again under its id.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator

from app.errors import (BATCH_CANCELLED, BATCH_EXPIRED, INVALID_REQUEST, RequestError,
                        TerminalError, TransientError, error_from_record)
from app.requests import batch_file as fmt
from app.settings import VigilSettings
from app.state import jobs as job_state
from app.state.batches import BatchStore
from app.state.store import RequestStore

log = logging.getLogger("vigil.batches")

VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
ENDED = (FAILED, COMPLETED, EXPIRED, CANCELLED)
ENDPOINTS = (fmt.COMPLETIONS_URL, fmt.CHAT_URL)
PURPOSE = "batch"
# The most per-line errors a failed validation lists (the count of the rest is said).
MAX_LISTED_ERRORS = 100
# A completion window: "24h" (OpenAI's only value), or any whole number of s, m, h or d from a
# minute to a week.
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MIN_WINDOW_S, MAX_WINDOW_S = 60, 7 * 86400
# OpenAI's metadata rules: at most 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# Lines read per round trip while submitting or validating.
READ_CHUNK = 500

# submit(request_id, kwargs): app/requests/submit.py's submit_request with this process's
# settings, registry and store (raises RequestError / TerminalError / TransientError).
Submit = Callable[[str, dict], None]
# end_job(job, reason, code): app/fleet/jobs.py's delete_job; -1 when someone else is ending it.
EndJob = Callable[[str, str, str], int]
# end_requests(request_ids, code, reason): fail these open requests TerminalError(code) once
# each, aborting those that run (app/fleet/outcomes.py end_requests_failed, app/control.py).
EndRequests = Callable[[list[str], str, str], int]


class BatchNotFound(LookupError):
    """No batch or file with that id (or it expired)."""


# -- files ---------------------------------------------------------------------------------
def upload_file(bs: BatchStore, data: bytes, filename: str, purpose: str, now: float,
                settings: VigilSettings) -> dict:
    """Store an uploaded batch input file; returns its OpenAI FileObject. RequestError
    (invalid_request) for another purpose than "batch" or a file over VIGIL_BATCH_MAX_BYTES."""
    if purpose != PURPOSE:
        raise RequestError.of(INVALID_REQUEST, f"purpose {purpose!r} is not served: Vigil keeps "
                              "files for batches only (purpose \"batch\")")
    if len(data) > settings.batch_max_bytes:
        raise RequestError.of(INVALID_REQUEST, f"the file has {len(data):,} bytes; a batch file "
                              f"may have at most {settings.batch_max_bytes:,} "
                              "(VIGIL_BATCH_MAX_BYTES)")
    if not data.strip():
        raise RequestError.of(INVALID_REQUEST, "the file is empty")
    file_id = "file-" + uuid.uuid4().hex
    meta = {"id": file_id, "bytes": len(data), "created_at": int(now),
            "filename": filename or "upload.jsonl", "purpose": PURPOSE,
            "expires_at": int(now + settings.batch_retention)}
    bs.put_file(file_id, meta, data.splitlines(keepends=True), settings.batch_retention)
    return file_object(meta)


def file_object(meta: dict) -> dict:
    """A file's metadata as OpenAI's FileObject."""
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]),
            "created_at": int(meta["created_at"]), "filename": meta["filename"],
            "purpose": meta["purpose"], "status": "processed",
            "expires_at": int(meta["expires_at"]) if meta.get("expires_at") else None,
            "status_details": None}


def file_content(bs: BatchStore, file_id: str) -> Iterator[bytes]:
    """A file's bytes, in chunks of a few thousand lines (read from Redis as they are sent, so a
    large file is never whole in memory): an uploaded file as it was sent, an output or error
    file as its batch's lines. BatchNotFound at once when there is no such file."""
    meta = bs.file(file_id)
    if meta is None:
        raise BatchNotFound(f"no file {file_id!r}")
    if meta.get("batch"):
        errors = meta.get("kind") == "error"
        return (b"".join(x + b"\n" for x in chunk) for chunk in _chunks(
            lambda s, n: bs.results(meta["batch"], errors, s, n)))
    return (b"".join(chunk) for chunk in _chunks(lambda s, n: bs.file_lines(file_id, s, n)))


def _chunks(read) -> Iterator[list[bytes]]:
    start, size = 0, 10 * READ_CHUNK
    while True:
        chunk = read(start, size)
        if chunk:
            yield chunk
        if len(chunk) < size:
            return
        start += len(chunk)


def delete_file(bs: BatchStore, file_id: str) -> dict:
    """Delete an uploaded file; returns OpenAI's deletion object. BatchNotFound for no such
    uploaded file; RequestError(invalid_request) while a live batch reads it."""
    meta = bs.file(file_id)
    if meta is None or meta.get("batch"):
        raise BatchNotFound(f"No uploaded file found with id {file_id!r}.")
    for batch_id in bs.active_ids():
        if (bs.get(batch_id) or {}).get("input_file_id") == file_id:
            raise RequestError.of(INVALID_REQUEST, f"file {file_id} is the input of batch "
                                  f"{batch_id}, which has not ended; cancel it first")
    bs.delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def result_lines(bs: BatchStore, batch_id: str, errors: bool) -> list[bytes]:
    """Every output line (error line with `errors`) a batch has recorded so far, in order of
    completion, without line ends."""
    return [x for chunk in _chunks(lambda s, n: bs.results(batch_id, errors, s, n))
            for x in chunk]


# -- creating and cancelling ---------------------------------------------------------------
def parse_window(window: str) -> int:
    """A completion window ("24h", "90m", "2d") in seconds; RequestError(invalid_request) for
    anything else or outside a minute .. a week."""
    m = re.fullmatch(r"([1-9][0-9]{0,6})([smhd])", window or "")
    seconds = int(m.group(1)) * WINDOW_UNITS[m.group(2)] if m else 0
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise RequestError.of(INVALID_REQUEST, f"completion_window {window!r} must be a whole "
                              "number of s, m, h or d (OpenAI's is \"24h\") between 1m and 7d")
    return seconds


def check_metadata(metadata: dict | None) -> dict:
    """The metadata as given, or RequestError(invalid_request) when it breaks OpenAI's rules
    (at most 16 string pairs; keys up to 64 characters, values up to 512)."""
    metadata = metadata or {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= MAX_METADATA_KEY
            and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items()):
        raise RequestError.of(INVALID_REQUEST, f"metadata must be at most {MAX_METADATA} "
                              f"string pairs, keys of 1-{MAX_METADATA_KEY} characters, values "
                              f"of at most {MAX_METADATA_VALUE}")
    return metadata


def create_batch(bs: BatchStore, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict | None, now: float, settings: VigilSettings, *,
                 job: str | None = None, lenient: bool = False, window: int | None = None,
                 digest: str | None = None) -> dict:
    """Create a batch over an uploaded file; returns its Batch object (status `validating`:
    the tick validates the file). RequestError(invalid_request) for an unknown file, an endpoint
    not served, a bad window or bad metadata; nothing is stored then.

    `vigil batch FILE` (app/ops/batch_run.py) also gives: `job`, the requests' job (it fixes
    their ids with each custom_id; the batch is then found again by it), `lenient` (a bad line
    becomes an error line instead of failing the batch, and lines may mix the two endpoints,
    as that command always allowed), `window` (its most requests in flight, instead of
    VIGIL_BATCH_WINDOW) and `digest` (the file's sha256, to tell a rerun from another file)."""
    if job is not None and not fmt.valid_job(job):
        raise RequestError.of(INVALID_REQUEST, f"job {job!r} must match {fmt.JOB_PATTERN}")
    if endpoint not in ENDPOINTS:
        raise RequestError.of(INVALID_REQUEST, f"endpoint {endpoint!r} is not served (use "
                              f"{' or '.join(ENDPOINTS)})")
    window_s = parse_window(completion_window)
    metadata = check_metadata(metadata)
    meta = bs.file(input_file_id)
    if meta is None or meta.get("batch"):
        raise RequestError.of(INVALID_REQUEST, f"input_file_id {input_file_id!r}: no such "
                              "uploaded file (purpose \"batch\")")
    hex_id = uuid.uuid4().hex
    batch_id = "batch_" + hex_id
    fields = {"id": batch_id, "status": VALIDATING, "endpoint": endpoint,
              "input_file_id": input_file_id, "completion_window": completion_window,
              "created_at": int(now), "expires_at": int(now + window_s),
              "metadata": json.dumps(metadata), "job": job or "batch_" + hex_id, "cursor": 0,
              "total": 0, "completed": 0, "failed": 0}
    if lenient:
        fields["lenient"] = 1
    if window is not None:
        fields["window"] = max(1, int(window))
    if digest is not None:
        fields["sha256"] = digest
    bs.keep_file(input_file_id, window_s + settings.batch_retention)
    bs.create(batch_id, fields, active=True, job=job)
    return batch_object(fields)


def cancel_batch(bs: BatchStore, batch_id: str, now: float) -> dict:
    """Ask a batch to cancel (`cancelling`; the tick ends it `cancelled`); returns its Batch
    object. A batch already cancelling or cancelled is returned as it is. BatchNotFound for an
    unknown id; RequestError(invalid_request) for a batch that has already ended otherwise."""
    if bs.set_status_if(batch_id, (VALIDATING, IN_PROGRESS),
                        {"status": CANCELLING, "cancelling_at": int(now)}):
        return batch_object(bs.get(batch_id))
    b = bs.get(batch_id)
    if b is None:
        raise BatchNotFound(f"no batch {batch_id!r}")
    if b["status"] not in (CANCELLING, CANCELLED):
        raise RequestError.of(INVALID_REQUEST, f"batch {batch_id} is {b['status']}: only a "
                              "validating or in-progress batch can be cancelled")
    return batch_object(b)


def get_batch(bs: BatchStore, batch_id: str) -> dict:
    """A batch's Batch object; BatchNotFound for an unknown (or expired) id."""
    b = bs.get(batch_id)
    if b is None:
        raise BatchNotFound(f"no batch {batch_id!r}")
    return batch_object(b)


def batch_object(b: dict) -> dict:
    """A batch hash as OpenAI's Batch object (every field the `openai` package's
    `openai.types.Batch` has; timestamps not reached are null)."""
    def ts(name: str) -> int | None:
        return int(float(b[name])) if b.get(name) not in (None, "") else None

    errors = json.loads(b["errors"]) if b.get("errors") else None
    return {
        "id": b["id"], "object": "batch", "endpoint": b["endpoint"], "model": None,
        "errors": {"object": "list", "data": errors} if errors is not None else None,
        "input_file_id": b["input_file_id"], "completion_window": b["completion_window"],
        "status": b["status"], "output_file_id": b.get("output_file_id") or None,
        "error_file_id": b.get("error_file_id") or None,
        **{f"{name}_at": ts(f"{name}_at") for name in (
            "created", "in_progress", "expires", "finalizing", "completed", "failed", "expired",
            "cancelling", "cancelled")},
        "request_counts": {"total": int(b.get("total") or 0),
                           "completed": int(b.get("completed") or 0),
                           "failed": int(b.get("failed") or 0)},
        "metadata": json.loads(b.get("metadata") or "{}") or None, "usage": None,
    }


# -- the tick --------------------------------------------------------------------------------
class BatchDriver:
    """Advances every live batch one step (module docstring); what beat's batch tick runs.

    Collaborators: the batch store, the request store (records are the outcomes' source of
    truth), `submit`, `end_requests`, `end_job`, `render_chat` / `chat_budget` for chat lines
    (app/requests/chat.py), and the settings (window, limits, retention)."""

    def __init__(self, bs: BatchStore, store: RequestStore, settings: VigilSettings, *,
                 submit: Submit, end_requests: EndRequests, end_job: EndJob,
                 render_chat: fmt.RenderChat, chat_budget: fmt.ChatBudget):
        self.bs, self.store, self.s = bs, store, settings
        self.submit, self.end_requests, self.end_job = submit, end_requests, end_job
        self.render_chat, self.chat_budget = render_chat, chat_budget

    def advance_all(self, now: float) -> dict[str, str]:
        """One step of every live batch; returns {batch id: status after}. A batch whose step
        fails (Redis unreachable, or anything else: a tokenizer that cannot load, a bug) is
        logged and tried again on the next tick; the batches after it still get their step."""
        out = {}
        for batch_id in self.bs.active_ids():
            try:
                out[batch_id] = self.advance(batch_id, now)
            except TransientError as e:
                log.warning("batch %s: stopped this tick: %s", batch_id, e)
                out[batch_id] = "stalled"
            except Exception:
                log.exception("batch %s: its step failed; tried again next tick", batch_id)
                out[batch_id] = "stalled"
        return out

    def advance(self, batch_id: str, now: float) -> str:
        """One step of one batch; returns its status after the step."""
        b = self.bs.get(batch_id)
        if b is None:  # deleted by hand: nothing left to advance
            self.bs.forget_active(batch_id)
            return "gone"
        if b["status"] == VALIDATING:
            b = self._validate(b, now)
        if b["status"] == CANCELLING:
            return self._end_early(b, now, CANCELLED, BATCH_CANCELLED,
                                   f"batch {batch_id} was cancelled")
        if b["status"] in (IN_PROGRESS, FINALIZING):
            if now >= float(b["expires_at"]) and b["status"] == IN_PROGRESS:
                return self._end_early(b, now, EXPIRED, BATCH_EXPIRED,
                                       f"batch {batch_id} expired: its completion window "
                                       f"({b['completion_window']}) ran out")
            job_state.touch(self.store.r, b["job"], now)  # its lease: beat is polling it
            self._collect(b, now)
            self._submit_more(b, now)
            b = self.bs.get(batch_id) or b
            if int(b["cursor"]) >= self.bs.file_line_count(b["input_file_id"]) \
                    and not self.bs.inflight(batch_id):
                return self._finish(b, now)
        return (self.bs.get(batch_id) or b)["status"]

    def _finish(self, b: dict, now: float) -> str:
        """Every line submitted and nothing in flight: `completed` once every line is recorded.
        A line the count misses (its record lost in a crash) sends the cursor back to the
        start: the lines not recorded are submitted again (re-attached), none twice."""
        recorded = int(b.get("completed") or 0) + int(b.get("failed") or 0)
        if recorded < int(b.get("total") or 0):
            log.warning("batch %s: %d of %d lines recorded with nothing left to submit; "
                        "looking at the others again", b["id"], recorded, int(b["total"]))
            self.bs.add_inflight(b["id"], {}, 0)
            return b["status"]
        if b["status"] == IN_PROGRESS and not self.bs.set_status_if(
                b["id"], (IN_PROGRESS,), {"status": FINALIZING, "finalizing_at": int(now)}):
            return (self.bs.get(b["id"]) or b)["status"]  # cancelled meanwhile: next tick
        self._close(b, now, COMPLETED)
        return COMPLETED

    # validating --------------------------------------------------------------------------
    def _validate(self, b: dict, now: float) -> dict:
        """Check every line; a strict batch fails on any bad line, a lenient one records each
        bad line as an error line (as `vigil batch FILE` always did) and goes on."""
        errors, total, seen, lenient = [], 0, set(), bool(b.get("lenient"))
        nlines = self.bs.file_line_count(b["input_file_id"])
        refused: list = []  # a lenient batch's error lines

        def bad(n: int, message: str, param: str | None = None, cid: str | None = None,
                rid: str | None = None) -> None:
            if lenient:
                refused.append(self._error(n, rid, cid, "invalid_request", message))
            else:
                errors.append({"code": "invalid_request", "message": message, "param": param,
                               "line": n})

        for n, text in self._lines(b["input_file_id"], 0, nlines):
            total += 1
            if text is None:
                bad(n, f"line {n}: not UTF-8 text")
                continue
            cid = None
            try:
                cid, obj = fmt.read_custom_id(text, n)
                if cid in seen:
                    bad(n, f"line {n}: duplicate custom_id {cid!r}", "custom_id", cid)
                    continue
                seen.add(cid)
                fmt.check_line(obj, n)
                if obj.get("url") != b["endpoint"] and not lenient:
                    bad(n, f"line {n}: url {obj.get('url')!r} differs from the batch's endpoint "
                        f"{b['endpoint']}", "url")
            except RequestError as e:
                rid = fmt.request_id_for(b["job"], cid) if cid is not None else None
                bad(n, e.detail, None, cid, rid)
        # The limits fail any batch, lenient or not.
        if total == 0:
            errors.append({"code": "invalid_request", "line": 0, "param": None,
                           "message": "the file has no request lines"})
        if total > self.s.batch_max_requests:
            errors.append({"code": "invalid_request", "line": 0, "param": None,
                           "message": f"the file has {total:,} request lines; a batch may have "
                           f"at most {self.s.batch_max_requests:,} (VIGIL_BATCH_MAX_REQUESTS)"})
        if errors:
            refused = []  # nothing runs: the limits' errors say why
        for i in range(0, len(refused), READ_CHUNK):
            self.bs.record(b["id"], refused[i:i + READ_CHUNK])
        if errors:
            shown = errors[:MAX_LISTED_ERRORS]
            if len(errors) > len(shown):
                shown.append({"code": "invalid_request", "line": None, "param": None,
                              "message": f"... and {len(errors) - len(shown)} more"})
            if self.bs.set_status_if(b["id"], (VALIDATING,), {"status": FAILED}):
                self._close(b | {"total": total}, now, FAILED, {"errors": json.dumps(shown)})
            return self.bs.get(b["id"]) or b
        fields = {"total": total, "in_progress_at": int(now)}
        if self.bs.set_status_if(b["id"], (VALIDATING,), {"status": IN_PROGRESS, **fields}):
            log.info("batch %s: %d lines, in progress as job %s", b["id"], total, b["job"])
        return self.bs.get(b["id"]) or b

    def _lines(self, file_id: str, start: int, stop: int):
        """(line number, text or None when not UTF-8) of the non-blank lines start..stop-1."""
        for first in range(start, stop, READ_CHUNK):
            for i, raw in enumerate(self.bs.file_lines(file_id, first, min(READ_CHUNK,
                                                                              stop - first))):
                n = first + i + 1
                try:
                    text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError:
                    yield n, None
                    continue
                if text.strip():
                    yield n, text

    # running ---------------------------------------------------------------------------
    def _collect(self, b: dict, now: float) -> int:
        """Record the output line of every request of the batch that has ended; submit again
        those whose record is gone. Returns how many were recorded."""
        inflight = self.bs.inflight(b["id"])
        ids = list(inflight)
        recorded = 0
        for i in range(0, len(ids), READ_CHUNK):
            chunk = ids[i:i + READ_CHUNK]
            outcomes, lost = [], []
            for rid, outcome in self.store.ended(chunk).items():
                e = inflight[rid]
                if outcome is None:
                    lost.append((rid, e))
                elif outcome.result is not None:
                    line = fmt.success_line(rid, e["c"], e["k"], outcome.result, int(now))
                    outcomes.append((e["n"], True, fmt.dumps(line).rstrip("\n"), rid))
                else:
                    err = error_from_record(outcome.error_kind, outcome.error)
                    outcomes.append(self._error(e["n"], rid, e["c"], err.code, err.detail))
            recorded += self.bs.record(b["id"], outcomes)
            for rid, e in lost:
                self._resubmit(b, rid, e)
        return recorded

    def _error(self, n: int, rid: str | None, cid: str | None, code: str,
               message: str) -> tuple[int, bool, str, str]:
        id_ = fmt.batch_id(rid) if rid else fmt.line_id(n)
        line = fmt.error_line(id_, cid, code, message)
        return n, False, fmt.dumps(line).rstrip("\n"), rid or ""

    def _resubmit(self, b: dict, rid: str, e: dict) -> None:
        log.warning("batch %s: request %s (line %d) has no record any more; submitting it "
                    "again", b["id"], rid, e["n"])
        for n, text in self._lines(b["input_file_id"], e["n"] - 1, e["n"]):
            try:
                cid, obj = fmt.read_custom_id(text or "", n)
                _, kwargs = fmt.to_request(obj, n, b["job"], self.render_chat, self.chat_budget)
                self.submit(rid, kwargs)
            except (RequestError, TerminalError) as err:
                self.bs.record(b["id"], [self._error(n, rid, e["c"], err.code, err.detail)])

    def _submit_more(self, b: dict, now: float) -> int:
        """Submit lines from the cursor while fewer than the window are in flight; returns how
        many were submitted. Stops early (the next tick goes on) when the fleet is overloaded or
        Redis is unreachable."""
        room = int(b.get("window") or self.s.batch_window) - len(self.bs.inflight(b["id"]))
        nlines = self.bs.file_line_count(b["input_file_id"])
        cursor, submitted = int(b["cursor"]), 0
        while room > 0 and cursor < nlines:
            stop = min(nlines, cursor + min(room, READ_CHUNK))
            entries, failures, next_cursor = {}, [], stop
            chunk = list(self._lines(b["input_file_id"], cursor, stop))
            done = self.bs.recorded(b["id"], [n for n, _ in chunk])  # refused in validation
            for n, text in chunk:
                if n in done:
                    continue
                cid, obj = fmt.read_custom_id(text or "", n)  # validated: cannot fail
                rid = fmt.request_id_for(b["job"], cid)
                try:
                    kind, kwargs = fmt.to_request(obj, n, b["job"], self.render_chat,
                                                  self.chat_budget)
                    self.submit(rid, kwargs)
                except (RequestError, TerminalError) as err:
                    failures.append(self._error(n, rid, cid, err.code, err.detail))
                    continue
                except TransientError as err:  # overloaded, Redis: this line on the next tick
                    log.info("batch %s: submitting paused at line %d: %s", b["id"], n, err)
                    next_cursor = n - 1
                    break
                entries[rid] = {"n": n, "c": cid, "k": kind}
            self.bs.record(b["id"], failures)  # before the cursor passes them
            self.bs.add_inflight(b["id"], entries, next_cursor)
            submitted += len(entries)
            room -= len(entries) + len(failures)
            if next_cursor < stop:
                break
            cursor = next_cursor
        return submitted

    # ending ----------------------------------------------------------------------------
    def _end_early(self, b: dict, now: float, status: str, code: str, reason: str) -> str:
        """Cancel or expire: fail the batch's own open requests with `code` (in flight, and any
        a tick submitted just before it stopped), record them and every line not recorded yet
        as errors, keep every finished result, then close the batch. Only the batch's requests
        are ended: a `vigil batch FILE` job may be shared with other producers. A job the batch
        owns (`batch_<hex>`) is ended too, which drops its queues."""
        self._collect(b, now)
        nlines = self.bs.file_line_count(b["input_file_id"])
        lines = []  # (n, request id or None, custom_id or None) not recorded yet past the cursor
        for first in range(int(b.get("cursor") or 0), nlines, READ_CHUNK):
            chunk = list(self._lines(b["input_file_id"], first, min(nlines, first + READ_CHUNK)))
            done = self.bs.recorded(b["id"], [n for n, _ in chunk])
            for n, text in chunk:
                if n in done:
                    continue
                try:
                    cid = fmt.read_custom_id(text or "", n)[0]
                except RequestError:  # cancelled while validating: lines never checked
                    cid = None
                lines.append((n, fmt.request_id_for(b["job"], cid) if cid else None, cid))
        ids = list(self.bs.inflight(b["id"])) + [rid for _, rid, _ in lines if rid]
        for k in range(0, len(ids), READ_CHUNK):
            chunk = ids[k:k + READ_CHUNK]
            ended = self.store.ended(chunk)  # ended or gone: nothing to fail
            still_open = [rid for rid in chunk if rid not in ended]
            if still_open:
                self.end_requests(still_open, code, reason)
        self._collect(b, now)
        if self.bs.inflight(b["id"]):  # a record not ended yet (Redis hiccup): next tick
            return b["status"]
        for k in range(0, len(lines), READ_CHUNK):
            self.bs.record(b["id"], [self._error(n, rid, cid, code, reason)
                                     for n, rid, cid in lines[k:k + READ_CHUNK]])
        if int(b.get("total") or 0) == 0:  # cancelled before its validation counted them
            b = b | {"total": sum(1 for _ in self._lines(b["input_file_id"], 0, nlines))}
        if b["job"] == "batch_" + b["id"].removeprefix("batch_") and \
                self.end_job(b["job"], reason, code) < 0:
            return b["status"]  # someone else is ending the job right now: next tick
        self._close(b, now, status)
        log.warning("batch %s %s", b["id"], status)
        return status

    def _close(self, b: dict, now: float, status: str, extra: dict | None = None) -> None:
        """Write the batch's end: its status and time, its output and error files (when it has
        lines there), and the retention of everything it keeps."""
        fresh = self.bs.get(b["id"]) or b
        fields = {"status": status, f"{status}_at": int(now), "total": b.get("total", 0),
                  **(extra or {})}
        hex_id = b["id"].removeprefix("batch_")
        keep = self.s.batch_retention
        for kind, count, size in (("output", "completed", "output_bytes"),
                                  ("error", "failed", "error_bytes")):
            if int(fresh.get(count) or 0) > 0:
                file_id = f"file-{hex_id}-{kind}"
                lines = int(fresh.get(count) or 0)
                self.bs.put_file_meta(file_id, {
                    "id": file_id, "bytes": int(fresh.get(size) or 0) + lines,
                    "created_at": int(now), "filename": f"{b['id']}_{kind}.jsonl",
                    "purpose": "batch_output", "expires_at": int(now + keep),
                    "batch": b["id"], "kind": kind}, keep)
                fields[f"{kind}_file_id"] = file_id
        self.bs.keep_file(b["input_file_id"], keep)
        self.bs.close(b["id"], fields, keep, job=b.get("job"))
