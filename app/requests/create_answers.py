"""What the record's create answered at submit (app/requests/submit.py), beyond "created": a
refusal's error (`overloaded` for a cap, `job_deleted` for a deleted job), and an id that
already has a record: the same request again (published again only if no message carries it),
or the id reused for a different request (`invalid_request`).
"""
from __future__ import annotations

import logging

from app.errors import (INVALID_REQUEST, JOB_DELETED, OVERLOADED, REDIS_UNAVAILABLE,
                        RequestError, TerminalError, TransientError)
from app.requests.schemas import GenerateRequest
from app.settings import VigilSettings
from app.state.keys import PENDING
from app.state.queues import job_queue_name
from app.state.store import JOB_DELETED as JOB_REFUSED
from app.state.store import OVERLOADED_JOB, OVERLOADED_POOL, RequestStore

log = logging.getLogger("vigil.submit")


def refusal(created: int, req: GenerateRequest, settings: VigilSettings, *, sent: int = 0
            ) -> Exception:
    """The error of a create the store refused (RequestStore.create's answer): `overloaded` for
    a job's or a pool's cap, `job_deleted` for a deleted job. `sent`: how many requests of the
    same call were published before it (a later part of a call written in parts)."""
    if created in (OVERLOADED_JOB, OVERLOADED_POOL):
        return overloaded(req, settings, pool_full=created == OVERLOADED_POOL, sent=sent)
    if created == JOB_REFUSED:
        return TerminalError.of(JOB_DELETED, f"job {req.job!r} was deleted; its requests are "
                                "refused (use a new job name)")
    return TransientError.of(REDIS_UNAVAILABLE, f"unexpected answer {created!r} from the "
                             "record's create")


def same_request_again(store: RequestStore, request_id: str, fields: dict, pool: str,
                       job: str) -> float | None:
    """An id whose record already exists: the same request again is one request with one
    result; reusing the id for a different request raises RequestError(invalid_request).
    Returns the deadline to publish it again at when no message carries it (its first
    producer stopped between the record and the message: a SIGKILLed `vigil batch`, say; were
    it only slow, the copy costs one duplicate delivery, never a second run), else None."""
    existing = store.get(request_id) or {}
    if existing.get("request") not in (None, fields["request"]):
        raise RequestError.of(INVALID_REQUEST, f"request id {request_id!r} is already used by "
                              "a different request; use a new task_id")
    if _never_published(store, request_id, existing, pool, job):
        log.warning("request %s had a record but no message anywhere; publishing it",
                    request_id)
        return float(existing["deadline_at"])
    return None


def _never_published(store: RequestStore, request_id: str, record: dict, pool: str,
                     job: str) -> bool:
    """True for a record no attempt ever began and no message carries: PENDING at dispatch 0,
    held by no worker, not in its queue nor fetched (RequestStore.message_missing)."""
    if (record.get("status"), record.get("dispatch"), record.get("attempts")) != (
            PENDING, "0", "0"):
        return False
    return store.message_missing(request_id, job_queue_name(pool, job))


def overloaded(req: GenerateRequest, settings: VigilSettings, *, pool_full: bool,
               sent: int = 0) -> TransientError:
    """The `overloaded` error for a submit refused by backpressure (the job's cap, or with
    `pool_full` the pool's): says which cap, what was sent (`sent` requests of the call before
    it, its `.submitted`; else nothing), and when to try again. The advice is the longest
    backoff Vigil itself uses (`retry_backoff_max`): a backlog at a cap of thousands of requests
    does not clear faster than that."""
    if pool_full:
        what, cap, var = f"pool {req.pool!r}", settings.max_pending_per_pool, "POOL"
    else:
        what, cap, var = f"job {req.job!r}", settings.max_pending_per_job, "JOB"
    done = (f"the call's first {sent} requests were sent (the error's .submitted), the rest "
            "not" if sent else "nothing was sent")
    return TransientError.of(OVERLOADED, f"{what} has {cap} open requests, its cap "
                             f"(VIGIL_MAX_PENDING_PER_{var}); {done}: retry in "
                             f"~{settings.retry_backoff_max:g} s")
