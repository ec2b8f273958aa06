"""Batch objects: OpenAI's Batch API, served by the fleet (docs/batch.md). This module holds
what a batch *is* (its files, creating, cancelling, its OpenAI shapes); how the fleet moves it
is app/fleet/batch_tick.py.

    file = upload_file(bs, data, "eval.jsonl", "batch", now, settings)
    b = create_batch(bs, file["id"], "/v1/completions", "24h", {"team": "eval"}, now, settings)
    ...beat's batch tick (BatchDriver.advance_all) every VIGIL_BATCH_TICK_INTERVAL...
    get_batch(bs, b["id"])["status"]    # validating -> in_progress -> finalizing -> completed

Statuses: validating, failed, in_progress, finalizing, completed, expired, cancelling,
cancelled (OpenAI's). Everything lives in Redis (app/state/batches.py): a batch survives its
submitter exiting, a worker dying and a Redis restart with AOF.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterator

from app.errors import INVALID_REQUEST, RequestError
from app.fleet.housekeeping_runs import batch_tick_state
from app.housekeeping_schedule import schedule
from app.requests import batch_file as fmt
from app.settings import VigilSettings
from app.state.batches import BatchStore

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


class BatchNotFound(LookupError):
    """No batch or file with that id (or it expired). Its message is OpenAI's wording."""


def no_batch(batch_id: str) -> BatchNotFound:
    """The miss of an unknown batch id."""
    return BatchNotFound(f"No batch found with id {batch_id!r}.")


def no_file(file_id: str) -> BatchNotFound:
    """The miss of an unknown file id."""
    return BatchNotFound(f"No file found with id {file_id!r}.")


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


def get_file_meta(bs: BatchStore, file_id: str) -> dict:
    """A file's metadata; BatchNotFound for an unknown (or expired) id."""
    meta = bs.file(file_id)
    if meta is None:
        raise no_file(file_id)
    return meta


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
    meta = get_file_meta(bs, file_id)
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
    batch_id = "batch_" + uuid.uuid4().hex  # also the job it runs as, unless `job` is given
    fields = {"id": batch_id, "status": VALIDATING, "endpoint": endpoint,
              "input_file_id": input_file_id, "completion_window": completion_window,
              "created_at": int(now), "expires_at": int(now + window_s),
              "metadata": json.dumps(metadata), "job": job or batch_id, "cursor": 0,
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
        raise no_batch(batch_id)
    if b["status"] not in (CANCELLING, CANCELLED):
        raise RequestError.of(INVALID_REQUEST, f"batch {batch_id} is {b['status']}: only a "
                              "validating or in-progress batch can be cancelled")
    return batch_object(b)


def get_batch(bs: BatchStore, batch_id: str) -> dict:
    """A batch's Batch object; BatchNotFound for an unknown (or expired) id."""
    b = bs.get(batch_id)
    if b is None:
        raise no_batch(batch_id)
    return batch_object(b)


def tick_status(bs: BatchStore, settings: VigilSettings, now: float) -> dict:
    """When the batch tick, which advances every batch, last ran, and whether it is overdue
    (app/fleet/housekeeping_runs.py): without beat no batch moves, and nothing else says so."""
    return batch_tick_state(bs.housekeeping.runs(), schedule(settings), now)


def with_tick(obj: dict, tick: dict) -> dict:
    """A Batch object with the batch tick's state (`vigil_batch_tick`: last_run_at, age_s,
    every_s, state ok | overdue | never, warning) for a batch that has not ended; an ended one
    no longer needs the tick."""
    if obj["status"] in ENDED:
        return obj
    keep = ("last_run_at", "age_s", "every_s", "state", "warning")
    return {**obj, "vigil_batch_tick": {k: tick[k] for k in keep}}


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
