"""The batch tick: how the fleet moves a batch object (app/fleet/batches.py), one step per
live batch every VIGIL_BATCH_TICK_INTERVAL (beat's `vigil.batch_tick`, lock-guarded, so one
process advances batches at a time). Each step:

- validates a `validating` batch's file with the format rules of app/requests/batch_file.py:
  a bad line, a duplicate `custom_id`, a line for another endpoint fail a strict batch
  (`failed`, with per-line `errors`); a lenient one (`vigil batch FILE`) records each as an
  error line and goes on; more lines than VIGIL_BATCH_MAX_REQUESTS fail either;
- records each ended request's output line once (a Lua HSETNX on the line number), in order of
  completion, and counts it (`request_counts`); a request whose record vanished (lost in a
  Redis crash) is submitted again under its id;
- submits lines as the batch's job (`batch_<hex>`, or the one `vigil batch FILE` named), a
  chunk at a time through `submit_many` (many requests per message; a chunk the fleet refuses
  whole, for one bad line or a pending cap, goes line by line through `submit_request`), at
  most its window in flight; a line's request id is fixed by (job,
  custom_id), so a step that stopped halfway and runs again re-attaches to what it already
  submitted instead of submitting it twice;
- ends the batch: `completed` when every line is recorded (through `finalizing`); `expired`
  when its completion window ran out; `cancelled` after `cancel_batch` asked (`cancelling`).
  Ending early fails the batch's own open requests with `batch_cancelled` / `batch_expired`
  (running ones are aborted in their engines), gives every line not recorded the same error
  line, and keeps every result already finished.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

from app.errors import (BATCH_CANCELLED, BATCH_EXPIRED, REDIS_UNAVAILABLE, RequestError,
                        TerminalError, TransientError, error_from_record)
from app.fleet.batches import (CANCELLED, CANCELLING, COMPLETED, EXPIRED, FAILED, FINALIZING,
                               IN_PROGRESS, MAX_LISTED_ERRORS, READ_CHUNK, VALIDATING)
from app.requests import batch_file as fmt
from app.settings import VigilSettings
from app.state.batches import BatchStore
from app.state.store import RequestStore

log = logging.getLogger("vigil.batches")

# submit(request_id, kwargs): app/requests/submit.py's submit_request with this process's
# settings, registry and store (raises RequestError / TerminalError / TransientError).
Submit = Callable[[str, dict], None]
# submit_many([(request_id, kwargs)]): app/requests/submit.py's submit_many, all or
# nothing (raises as `submit` does), except that an error met after some requests were
# published (a TransientError(redis_unavailable); in a call written in parts, any error of a
# later part: a cap another producer filled meanwhile, the job deleted, an id taken
# meanwhile) carries `.submitted`, the handles (an `.id` each) of those. The lines of such a
# call submitted again one by one re-attach to what went out (their ids are fixed).
SubmitMany = Callable[[list[tuple[str, dict]]], None]
# end_job(job, reason, code): app/fleet/jobs.py's delete_job; -1 when someone else is ending it.
EndJob = Callable[[str, str, str], int]
# end_requests(request_ids, code, reason): fail these open requests TerminalError(code) once
# each, aborting those that run (app/fleet/outcomes.py end_requests_failed, app/control.py).
EndRequests = Callable[[list[str], str, str], int]


class BatchDriver:
    """Advances every live batch one step (module docstring); what beat's batch tick runs.

    Collaborators: the batch store, the request store (records are the outcomes' source of
    truth), `submit`, `end_requests`, `end_job`, `render_chat` / `chat_budget` for chat lines
    (app/requests/chat.py), and the settings (window, limits, retention)."""

    def __init__(self, bs: BatchStore, store: RequestStore, settings: VigilSettings, *,
                 submit: Submit, end_requests: EndRequests, end_job: EndJob,
                 render_chat: fmt.RenderChat, chat_budget: fmt.ChatBudget,
                 submit_many: SubmitMany | None = None):
        self.bs, self.store, self.s = bs, store, settings
        self.submit, self.end_requests, self.end_job = submit, end_requests, end_job
        self.submit_many = submit_many
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
            self.store.jobs.touch(b["job"], now)  # its lease: beat is polling it
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

    def _unrecorded(self, b: dict, start: int, stop: int) -> list[tuple[int, str | None]]:
        """The non-blank lines start..stop-1 (as `_lines`) whose result is not recorded yet
        (a lenient validation records the bad ones)."""
        chunk = list(self._lines(b["input_file_id"], start, stop))
        done = self.bs.recorded(b["id"], [n for n, _ in chunk])
        return [(n, text) for n, text in chunk if n not in done]

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
            lines, failures = [], []  # lines: (n, request id, custom_id, kind, kwargs)
            for n, text in self._unrecorded(b, cursor, stop):
                cid, obj = fmt.read_custom_id(text or "", n)  # validated: cannot fail
                rid = fmt.request_id_for(b["job"], cid)
                try:
                    kind, kwargs = fmt.to_request(obj, n, b["job"], self.render_chat,
                                                  self.chat_budget)
                except (RequestError, TerminalError) as err:
                    failures.append(self._error(n, rid, cid, err.code, err.detail))
                    continue
                lines.append((n, rid, cid, kind, kwargs))
            done, more_failures, paused_at = self._submit_lines(b, lines)
            failures += more_failures
            entries = {rid: {"n": n, "c": cid, "k": kind}
                       for n, rid, cid, kind, _ in lines if rid in done}
            next_cursor = stop if paused_at is None else paused_at - 1
            failures = [f for f in failures if f[0] <= next_cursor]  # the rest: next tick
            self.bs.record(b["id"], failures)  # before the cursor passes them
            self.bs.add_inflight(b["id"], entries, next_cursor)
            submitted += len(entries)
            room -= len(entries) + len(failures)
            if next_cursor < stop:
                break
            cursor = next_cursor
        return submitted

    def _submit_lines(self, b: dict, lines: list) -> tuple[set[str], list, int | None]:
        """Submit `lines` ((n, id, custom_id, kind, kwargs)): through `submit_many` when the
        driver has it, else (or when the chunk is refused whole) one by one. Returns (the ids
        submitted, error lines for those refused, the line submitting paused at on an overload
        or an unreachable Redis, or None). A line after the pause that went out anyway is
        re-attached when the cursor reaches it again (its id is fixed)."""
        if not lines:
            return set(), [], None
        if self.submit_many is not None and len(lines) > 1:
            try:
                self.submit_many([(rid, kwargs) for _, rid, _, _, kwargs in lines])
                return {rid for _, rid, *_ in lines}, [], None
            except TransientError as err:
                if err.code == REDIS_UNAVAILABLE:
                    sent = {getattr(h, "id", h) for h in getattr(err, "submitted", ())}
                    first = next((n for n, rid, *_ in lines if rid not in sent), lines[-1][0])
                    log.info("batch %s: submitting paused at line %d: %s", b["id"], first, err)
                    return sent, [], first
                # overloaded: as many as fit go line by line, below
            except (RequestError, TerminalError):
                pass  # one line is wrong (or the job ended): each line answers for itself
        done, failures = set(), []
        for n, rid, cid, _, kwargs in lines:
            try:
                self.submit(rid, kwargs)
            except (RequestError, TerminalError) as err:
                failures.append(self._error(n, rid, cid, err.code, err.detail))
                continue
            except TransientError as err:  # overloaded, Redis: this line on the next tick
                log.info("batch %s: submitting paused at line %d: %s", b["id"], n, err)
                return done, failures, n
            done.add(rid)
        return done, failures, None

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
            for n, text in self._unrecorded(b, first, min(nlines, first + READ_CHUNK)):
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
        if b["job"] == b["id"] and self.end_job(b["job"], reason, code) < 0:  # its own job
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
