"""Publishing `vigil.generate`: the one way a request's message reaches a queue.

Every message of a request goes through `publish`: the first one (app/requests/submit.py), a
Celery retry (tasks/base.py), and the republish of a request handed back by a dead or stopping
worker or found without a message (app/fleet/handback.py, app/fleet/message_audit.py:
`republisher`). Each message carries:

- the request id as its task id, on every dispatch;
- `retries` = the dispatch number, which the worker reads to tell a current copy from a stale
  one;
- the queue of its pool and job (app/state/queues.py), at its tier's broker priority
  (app/requests/tiers.py);
- Celery `expires` at the request's deadline + EXPIRES_GRACE_S: a backstop behind the deadline
  sweep (the worker that receives it later drops it unexecuted and ends the request
  `deadline_exceeded`);
- an `argsrepr`/`kwargsrepr` that shows only model and job, never the prompt (Flower, events
  and logs show these);
- for a republish, kombu's outage retry policy (app/retry_policy.py): the record already moved to this dispatch, so
  the publish keeps trying through a Redis restart instead of leaving the request without a
  message.
"""
from __future__ import annotations

import datetime as dt
import json
from typing import Any, Callable

from app.control import ControlBus
from app.requests.tiers import broker_priority
from app.retry_policy import OutagePolicy
from app.settings import get_settings
from app.state.queues import DEFAULT_JOB, job_queue, job_queue_name
from app.state.registry import WorkerRegistry
# A worker refuses a message this long past the request's deadline without running it; the
# deadline itself is enforced by Vigil (a typed deadline_exceeded), this is the backstop.
EXPIRES_GRACE_S = 300.0

# send(args, kwargs, task_id=..., **options): Celery's publish of vigil.generate (the app's,
# app/celery_ports.py `CeleryPorts.send`, or the task's own for its retries, tasks/base.py).
Send = Callable[..., Any]


def kwargs_repr(model: object, job: object) -> str:
    """What Flower, events and logs show of a request's kwargs: its model and job, never the
    prompt (user data)."""
    return f"{{model: {model!r}, job: {job!r}}}"


def expires_at(deadline_at: float) -> dt.datetime:
    """When a message of a request with this deadline expires (deadline + EXPIRES_GRACE_S)."""
    return dt.datetime.fromtimestamp(deadline_at + EXPIRES_GRACE_S, tz=dt.timezone.utc)


def publish(request_id: str, kwargs: dict, *, model: object, job: object,
            pool: str | None = None, deadline_at: float | None = None, dispatch: int = 0,
            send: Send, **options) -> Any:
    """Publish one message of request `request_id` through `send` (module docstring); returns
    what `send` returns (Celery's AsyncResult). `pool` picks the queue and `deadline_at` the
    expiry unless `options` say otherwise; a `dispatch` above 0 is a republish. Raises what
    Celery raises when the broker cannot be reached."""
    options.setdefault("argsrepr", "()")
    options.setdefault("kwargsrepr", kwargs_repr(model, job))
    if pool is not None:
        options.setdefault("queue", job_queue(pool, str(job)))
    if deadline_at is not None:
        options.setdefault("expires", expires_at(deadline_at))
    # Its tier's broker priority: a worker pops interactive messages first (app/state/intake.py).
    options.setdefault("priority", broker_priority(kwargs.get("priority")))
    if dispatch:
        options["retries"] = dispatch
        options.setdefault("retry_policy", OutagePolicy.of(get_settings()).kombu())
    return send((), kwargs, task_id=request_id, **options)


def publish_many(items: list[tuple[str, dict]], *, model: object, job: object, pool: str,
                 tier: str, deadline_at: float, send_many: Callable[..., Any],
                 message_id: str) -> Any:
    """Publish one vigil.generate_many message carrying `items` ((request id, wire kwargs),
    every one of `pool`'s queue for `job` and of one `tier`): its task id `message_id`, each
    request's id in its `vigil_ids` header (the worker that takes it holds them all), at the
    tier's broker priority, expiring at the latest deadline + EXPIRES_GRACE_S, showing only
    model, job and how many requests. Each request's first dispatch (0); a retry of one goes
    back alone, as a vigil.generate (workers/service.py). The message's own result is ignored
    (no one reads it: each request has its own): Celery neither subscribes to its channel here
    nor stores it there. Raises what Celery raises."""
    return send_many({"requests": [{"id": rid, "kwargs": kw} for rid, kw in items]},
                     message_id, ignore_result=True, queue=job_queue(pool, str(job)),
                     expires=expires_at(deadline_at), priority=broker_priority(tier),
                     headers={"vigil_ids": [rid for rid, _ in items]}, argsrepr="()",
                     kwargsrepr=f"{{model: {model!r}, job: {job!r}, requests: {len(items)}}}")


def republisher(send: Send) -> Callable[[str, dict, int], None]:
    """`republish(request_id, record, dispatch)` through `send`: publish a request again from
    its stored record, under `dispatch` (the record has already moved to it): same id, its
    pool's and job's queue, its deadline's expiry (the reaper's, the hand-back's and the
    audit's `Republish`)."""
    def republish(request_id: str, record: dict, dispatch: int) -> None:
        job = record.get("job", DEFAULT_JOB)
        publish(request_id, json.loads(record["request"]), model=record["model"], job=job,
                pool=record["pool"], deadline_at=float(record["deadline_at"]),
                dispatch=dispatch, send=send)

    return republish


def announce_queue(bus: ControlBus, registry: WorkerRegistry, pool: str, job: str) -> None:
    """Tell the pool's registered workers to consume a job's new queue (best effort: beat's
    reconcile repairs a lost broadcast)."""
    bus.add_consumer(job_queue_name(pool, job), registry.serving(pool))
