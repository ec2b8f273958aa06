"""A request's record and message fields, made from a validated request: what the producer
writes at submit and the worker writes for a message sent around the producer
(app/requests/submit.py `record_new`), and the kwargs its messages carry."""
from __future__ import annotations

import json
import re

from app.requests.schemas import JOB_PATTERN, MAX_DEADLINE_S, GenerateRequest
from app.state.keys import PENDING
from app.state.queues import DEFAULT_JOB


def effective_deadline(req: GenerateRequest, default: float) -> float:
    """Seconds from submission until the request must have ended."""
    return req.deadline_s if req.deadline_s is not None else default


def record_fields(req: GenerateRequest, now: float, default_deadline: float,
                  wire: dict | None = None) -> dict:
    """The fields of a new PENDING request record (app/state/keys.py lists them); `wire` is
    `wire_kwargs(req)` when the caller made it already."""
    return {
        "status": PENDING, "model": req.model, "pool": req.pool, "job": req.job,
        "priority": req.priority,
        **({"lora": req.lora} if req.lora is not None else {}),
        "request": json.dumps(wire_kwargs(req) if wire is None else wire), "created_at": now,
        "deadline_at": now + effective_deadline(req, default_deadline),
        "attempts": 0, "dispatch": 0,
    }


def provisional_fields(kwargs: dict, now: float, default_deadline: float) -> dict | None:
    """The record of a message this code cannot read (a newer schema version, sent around the
    producer), from the fields every version keeps: model, job, deadline_s; the request kept as
    sent. None when its job or deadline cannot be read (the message is refused instead)."""
    job = kwargs.get("job", DEFAULT_JOB)
    deadline = kwargs.get("deadline_s", default_deadline)
    if not isinstance(job, str) or re.match(JOB_PATTERN, job) is None:
        return None
    if type(deadline) not in (int, float) or not 0 < deadline <= MAX_DEADLINE_S:
        return None
    try:
        request = json.dumps(kwargs)
    except (TypeError, ValueError, RecursionError):
        return None
    model = kwargs["model"]
    return {"status": PENDING, "model": model, "pool": model, "job": job, "request": request,
            "created_at": now, "deadline_at": now + deadline, "attempts": 0, "dispatch": 0}


def wire_kwargs(req: GenerateRequest) -> dict:
    """The message kwargs for a validated request (JSON-safe, defaults omitted)."""
    return req.model_dump(mode="json", by_alias=True, exclude_none=True,
                          exclude_defaults=True) | {
        "model": req.model, "schema_version": req.schema_version}
