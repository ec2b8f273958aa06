"""Submitting requests: the one road from a producer's call to its messages (admit, record,
announce, publish), for one request and for many.

`submit` takes a list of requests; one request is a list of one. What runs it:
`generate.apply_async` / `.delay` (`submit_request`, tasks/base.py), `generate_many` and the
gateway's and the batch tick's many (`submit_many`), the demo and `vigil batch`. A worker that
received a message on a queue no pool owns sends it on with `resubmit`, and a worker given a
message sent around the producer records it with `record_new`, the one create of a record:

1. Every request is admitted first (app/requests/admit.py); one that is wrong raises
   RequestError (naming its index among many) and nothing reaches Redis. A request that uses a
   schema version 2 field is refused (TransientError workers_too_old) while a live worker of its
   pool predates version 2 and would fail it (app/requests/version_gate.py). A text prompt's
   token count needs the tokenizer, so `prompt_too_long` for text is found by the engine, at
   once, on the first attempt.
2. The request id is the caller's `task_id` or a new uuid4, and stays the Celery task id for
   every retry and redelivery.
3. The records are created only if new (`record_new`: app/state/store.py `create`, one round
   trip per CREATE_CHUNK), under the backpressure caps (`overloaded`, nothing written) and
   refused for a deleted job (`job_deleted`). A refusal deletes what this call created and
   raises: all or nothing. The same id and the same request again returns the existing request
   (published again only if no message carries it); a different request under that id is
   `invalid_request`. A job's first request in a pool announces the job's queue to the pool's
   workers.
4. The messages are published (app/requests/publish.py): one request as one `vigil.generate`
   message with the caller's Celery options; many grouped by queue (pool and job) and tier, up
   to `VIGIL_REQUESTS_PER_MESSAGE` a `vigil.generate_many` message. If a publish fails, the
   records of what was not published are deleted again (no record without a message) and a
   broker error becomes TransientError(redis_unavailable), carrying `.submitted`, the handles
   of what was.

Many requests of one job and pool are recorded and published in parts (FIRST_PART, then
CREATE_CHUNK at a time), each part's messages out before the next part is written, so the
workers start while the rest is written (docs/performance.md, "The twelfth pass"). The caps
count the parts still to come, so a call that would pass one is refused in its first part,
nothing written; what only a later part can meet (a cap another producer filled meanwhile,
the job deleted meanwhile, Redis lost) is raised with `.submitted`, the handles of what was
published before it. A call of several jobs or pools, one naming ids of which any has a
record already, and the online gateway's calls (answered as one) are written whole before
anything is published, as in 3.

Why not Celery's `chunks`: a chunk is one task over many argument tuples, with one result and
one retry for all; here each request keeps its own id, record, result and retry, and a request
that must go back goes back alone (docs/api.md, "Many requests at once").
"""
from __future__ import annotations

import gc
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kombu.exceptions import OperationalError

from app.celery_ports import CeleryPorts
from app.errors import INVALID_REQUEST, REDIS_UNAVAILABLE, RequestError, TransientError
from app.requests.admit import Admitted, admit, with_celery_priority
from app.requests.async_result import Siblings
from app.requests.create_answers import refusal, same_request_again
from app.requests.models import ModelRegistry
from app.requests.publish import Send, announce_queue, publish, publish_many
from app.requests.record_fields import provisional_fields, record_fields, wire_kwargs
from app.requests.schemas import newer_version
from app.requests.version_gate import check_served
from app.settings import VigilSettings
from app.state.store import CREATED, CREATED_NEW_JOB_QUEUE, EXISTS, RequestStore
from app.state.store_many import ahead_of, job_and_pool

log = logging.getLogger("vigil.submit")

# Records written per round trip.
CREATE_CHUNK = 1024
# A many submit is written and published in parts: the first FIRST_PART requests, then
# CREATE_CHUNK at a time (a round trip each; both multiples of the messages' size), so the
# workers start on the first messages while the rest is written.
FIRST_PART = 256
MAX_REQUESTS = 100_000
# A many submit of this many requests or more holds the cyclic garbage collector off
# (`_hold_collector`).
GC_DEFERRED_FROM = 256


@dataclass
class _Item:
    """One request on its way through `submit`."""

    request_id: str
    admitted: Admitted
    wire: dict  # its message kwargs (wire_kwargs), made once for its record and its message
    fields: dict
    deadline_at: float = 0.0  # where its message is published, when it is (0: not)


def submit(items: list, task_ids: list[str] | None = None, *, settings: VigilSettings,
           registry: ModelRegistry, store: RequestStore, ports: CeleryPorts,
           priority: int | None = None, single: bool = False, send: Send | None = None,
           in_parts: bool = True, **options) -> list[Any]:
    """Admit, record and publish `items` (request kwargs; module docstring); one AsyncResult
    per item, in order. `task_ids` names their ids (default: new uuid4s); `priority` is
    Celery's priority= for the requests that name no tier. `single`: one request published as
    one vigil.generate message through `send` (default `ports.send`) with `options`
    (app/requests/publish.py `publish`); else as vigil.generate_many messages, in parts
    where it may be (`_in_parts`) unless `in_parts` is False. Raises
    RequestError (naming the item's index among many), TerminalError(job_deleted),
    TransientError(overloaded), TransientError(workers_too_old) (nothing written) or
    TransientError(redis_unavailable)."""
    ids = _ids(items, task_ids, single)
    todo = []
    for i, kw in enumerate(items):
        try:
            todo.append(admit(with_celery_priority(kw, priority), settings, registry))
        except RequestError as e:
            if single:
                raise
            raise type(e).of(e.code, f"request {i}: {e.detail}") from None
    for req, spec, _ in todo:  # a rolling upgrade's old workers (read once per pool)
        check_served(req, spec.name, store.workers, settings)
    now = time.time()
    entries = []
    for rid, a in zip(ids, todo):
        wire = wire_kwargs(a.req)
        entries.append(_Item(rid, a, wire, record_fields(a.req, now, settings.request_deadline,
                                                         wire)))
    if single:
        created = _record(entries, store, ports, settings, now)
        return [_publish_one(entries[0], created, store, ports, send or ports.send, options)]
    parts = _parts(entries)
    if len(parts) > 1 and not (in_parts and _in_parts(entries, task_ids, store)):
        parts = [entries]
    _record_and_publish(parts, store, ports, settings, now)
    return Siblings.link([ports.result(rid) for rid in ids])


def submit_request(kwargs: object, task_id: str | None = None, *, settings: VigilSettings,
                   registry: ModelRegistry, store: RequestStore, ports: CeleryPorts,
                   send: Send | None = None, **options) -> Any:
    """`submit` of one request (what `.delay` runs): its AsyncResult. `options` are Celery's
    publish options; `priority` among them picks the tier the request does not name."""
    return submit([kwargs], [task_id] if task_id else None, settings=settings,
                  registry=registry, store=store, ports=ports,
                  priority=options.pop("priority", None), single=True, send=send, **options)[0]


def submit_many(items: list, task_ids: list[str] | None = None, *, settings: VigilSettings,
                registry: ModelRegistry, store: RequestStore, ports: CeleryPorts,
                priority: int | None = None, in_parts: bool = True) -> list[Any]:
    """`submit` of many requests as few messages (what `generate_many` runs); `in_parts`
    False writes a call of many parts whole before publishing any (module docstring). In a
    call of GC_DEFERRED_FROM requests or more, Python's cyclic garbage collector waits until
    the call returns (`_hold_collector`)."""
    held = _hold_collector(items)
    try:
        return submit(items, task_ids, settings=settings, registry=registry, store=store,
                      ports=ports, priority=priority, in_parts=in_parts)
    finally:
        if held:
            gc.enable()


def _hold_collector(items: object) -> bool:
    """Turn Python's cyclic garbage collector off for a submit of `items` when they are
    GC_DEFERRED_FROM requests or more and the process has it on; True when it did (the caller
    turns it on again when the submit returns). Such a call makes tens of thousands of
    objects, and a full collection it triggered ran inside it, before its first message was
    published (35-90 ms in a bare producer, more in the bench's, while the workers waited;
    docs/performance.md, "The eighth pass"). The collection runs at the first allocation after
    the call, while the workers serve. A process that turned the collector off keeps it off."""
    if not isinstance(items, (list, tuple)) or len(items) < GC_DEFERRED_FROM \
            or not gc.isenabled():
        return False
    gc.disable()
    return True


def _ids(items: object, task_ids: list[str] | None, single: bool) -> list[str]:
    """The request ids of `items`: `task_ids`, else new uuid4s; RequestError for no items, too
    many, or ids that are not one distinct id per item."""
    if not isinstance(items, (list, tuple)) or not items:
        raise RequestError.of(INVALID_REQUEST, "generate_many takes a non-empty list of "
                              "request kwargs")
    if len(items) > MAX_REQUESTS:
        raise RequestError.of(INVALID_REQUEST, f"{len(items)} requests in one call; at most "
                              f"{MAX_REQUESTS}")
    ids = list(task_ids) if task_ids is not None else [str(uuid.uuid4()) for _ in items]
    if len(ids) != len(items) or len(set(ids)) != len(ids):
        raise RequestError.of(INVALID_REQUEST, "task_ids must name one distinct id per request")
    return ids


def _in_parts(entries: list[_Item], task_ids: list[str] | None, store: RequestStore) -> bool:
    """Whether a call of more than one part may be written and published in parts: its
    requests are of one job and one pool (the first part's write then sees every cap and the
    job's state the call meets) and none of the ids it names has a record already (else every
    id is answered before anything is published: one reused for a different request refuses
    the whole call)."""
    first = job_and_pool(entries[0].fields)
    if any(job_and_pool(e.fields) != first for e in entries):
        return False
    return task_ids is None or not store.any_recorded([e.request_id for e in entries])


def _parts(entries: list[_Item]) -> list[list[_Item]]:
    """`entries` cut into the parts a many submit writes and publishes in turn: FIRST_PART,
    then CREATE_CHUNK each."""
    parts, start, size = [], 0, FIRST_PART
    while start < len(entries):
        parts.append(entries[start:start + size])
        start, size = start + size, CREATE_CHUNK
    return parts


def _record_and_publish(parts: list[list[_Item]], store: RequestStore, ports: CeleryPorts,
                        settings: VigilSettings, now: float) -> None:
    """Write each part's records, then publish its messages, part after part. The caps count
    the parts still to come as open (RequestStore.create_many's `ahead`), so a call that would
    take a job or a pool past its cap is refused in its first part, nothing written. An error
    in a later part (a cap another producer filled meanwhile, the job deleted meanwhile, Redis
    lost) deletes the records of that part and is raised with `.submitted`, the handles of
    what was published before it."""
    rest = ahead_of([(None, e.fields) for part in parts for e in part])
    published: list[str] = []
    for part in parts:
        rest -= ahead_of([(None, e.fields) for e in part])
        try:
            created = _record(part, store, ports, settings, now, rest, sent=len(published))
        except Exception as err:
            raise _with_submitted(err, published, ports)
        _publish_grouped([e for e in part if e.deadline_at], store, ports,
                         settings.requests_per_message, set(created), published)


def _with_submitted(err: Exception, published: list[str], ports: CeleryPorts) -> Exception:
    """`err`, carrying `.submitted` (the handles of `published`) when anything was."""
    if published:
        err.submitted = Siblings.link([ports.result(rid) for rid in published])
    return err


def _record(entries: list[_Item], store: RequestStore, ports: CeleryPorts,
            settings: VigilSettings, now: float, ahead: Counter | None = None, *,
            sent: int = 0) -> list[str]:
    """Create the records of `entries` under the caps (`ahead`: RequestStore.create_many's);
    returns the ids created. Each entry to publish gets its deadline (a new record's, or an
    existing one's that no message carries). A refusal deletes every record the call's writes
    created (those after the refused one in the same round trip too) and raises its error
    (`sent`: how many of the call's requests were published before, for its text)."""
    created: list[str] = []
    try:
        for start in range(0, len(entries), CREATE_CHUNK):
            part = entries[start:start + CREATE_CHUNK]
            answers = record_new(store, ports, [
                (e.request_id, e.fields, e.admitted.spec.name, e.admitted.req.job)
                for e in part], now, max_per_job=settings.max_pending_per_job,
                max_per_pool=settings.max_pending_per_pool, ahead=ahead)
            for e, answer in zip(part, answers):
                if answer in (CREATED, CREATED_NEW_JOB_QUEUE):
                    created.append(e.request_id)
                    e.deadline_at = e.fields["deadline_at"]
            for e, answer in zip(part, answers):
                if answer == EXISTS:
                    e.deadline_at = same_request_again(store, e.request_id, e.fields,
                                                       e.admitted.spec.name,
                                                       e.admitted.req.job) or 0.0
                elif answer not in (CREATED, CREATED_NEW_JOB_QUEUE):
                    raise refusal(answer, e.admitted.req, settings, sent=sent)
    except BaseException:
        _forget(store, created)
        raise
    return created


def record_new(store: RequestStore, ports: CeleryPorts,
               entries: list[tuple[str, dict, str, str]], now: float | None = None, *,
               max_per_job: int = 0, max_per_pool: int = 0,
               ahead: Counter | None = None) -> list[int]:
    """The one create of request records: each (request id, record fields, pool, job) written
    if new, in one round trip (RequestStore.create_many: the answers in order, under the caps,
    0 for none, with `ahead` counted as open), and each job's queue new in its pool announced
    to the pool's workers (best effort: beat's reconcile repairs a lost announcement)."""
    now = time.time() if now is None else now
    answers = store.create_many([(rid, fields) for rid, fields, _, _ in entries], now,
                                max_per_job=max_per_job, max_per_pool=max_per_pool,
                                ahead=ahead)
    announced = set()
    for (_, _, pool, job), answer in zip(entries, answers):
        if answer == CREATED_NEW_JOB_QUEUE and (pool, job) not in announced:
            announced.add((pool, job))
            try:
                announce_queue(ports.bus, store.workers, pool, job)
            except Exception as e:  # beat's reconcile repairs it
                log.warning("could not announce job %s's queue: %s", job, e)
    return answers


def _publish_one(e: _Item, created: list[str], store: RequestStore, ports: CeleryPorts,
                 send: Send, options: dict) -> Any:
    """Publish one request's message (Celery's `options`); its AsyncResult."""
    req, spec, _ = e.admitted
    if not e.deadline_at:  # the same request again, and a message carries it
        return ports.result(e.request_id)
    try:
        sent = publish(e.request_id, e.wire, model=req.model, job=req.job,
                       pool=spec.name, deadline_at=e.deadline_at, send=send, **options)
    except BaseException as err:
        _failed_publish(err, store, created, [], ports, "request")
    return sent if created else ports.result(e.request_id)


def _publish_grouped(todo: list[_Item], store: RequestStore, ports: CeleryPorts,
                     per_message: int, created: set[str], done: list[str]) -> None:
    """Publish `todo` grouped by queue and tier, `per_message` requests a message; each id
    published is appended to `done` (the call's, from its earlier parts on)."""
    groups: dict[tuple[str, str, str], list[_Item]] = {}
    for e in todo:
        req, spec, _ = e.admitted
        groups.setdefault((spec.name, req.job, req.priority), []).append(e)
    sent: set[str] = set()
    for (pool, job, tier), members in groups.items():
        for start in range(0, len(members), per_message):
            part = members[start:start + per_message]
            try:
                publish_many([(e.request_id, e.wire) for e in part],
                             model=part[0].admitted.req.model, job=job, pool=pool, tier=tier,
                             deadline_at=max(e.deadline_at for e in part),
                             send_many=ports.send_many, message_id=str(uuid.uuid4()))
            except BaseException as err:
                _failed_publish(err, store, [e.request_id for e in todo
                                             if e.request_id not in sent
                                             and e.request_id in created], done, ports,
                                "requests")
            done.extend(e.request_id for e in part)
            sent.update(e.request_id for e in part)


def _failed_publish(err: BaseException, store: RequestStore, unpublished: list[str],
                    done: list[str], ports: CeleryPorts, what: str) -> None:
    """A publish raised `err`: the records created and not published are deleted (no record
    without a message); a broker error is raised as TransientError(redis_unavailable) with
    `.submitted`, the handles of `done`; anything else as it is (with `.submitted` when
    anything was published)."""
    _forget(store, unpublished)
    if isinstance(err, (OperationalError, OSError)):
        raised = TransientError.of(REDIS_UNAVAILABLE, f"could not publish the {what}: {err}")
        raised.submitted = Siblings.link([ports.result(rid) for rid in done])
        raise raised from None
    if isinstance(err, Exception):
        raise _with_submitted(err, done, ports)
    raise err


def resubmit(request_id: str, dispatch: int, kwargs: object, *, settings: VigilSettings,
             registry: ModelRegistry, store: RequestStore, ports: CeleryPorts) -> None:
    """Send on a known request's message that reached a queue no pool owns (vigil.housekeeping,
    where a producer without `queue=` lands): admitted again, recorded if it has no record yet
    (sent around the producer: `record_new`, no caps), and published to its pool's queue under
    the same id and `dispatch`; nothing when its record has ended (a duplicate). A message of a
    newer schema version is sent on as it is, for a worker of its pool that reads it. Raises
    the RequestError of a request that cannot be served (its caller ends it)."""
    try:
        req, spec, _ = admit(kwargs, settings, registry)
        model, job, wire = req.model, req.job, wire_kwargs(req)
        fields = record_fields(req, time.time(), settings.request_deadline)
    except RequestError:
        model = kwargs.get("model") if isinstance(kwargs, dict) else None
        fields = provisional_fields(kwargs, time.time(), settings.request_deadline) \
            if newer_version(kwargs) is not None and model in registry else None
        if fields is None:
            raise
        spec, job, wire = registry.get(model), fields["job"], kwargs
    rec = store.get(request_id)
    if rec is None:
        record_new(store, ports, [(request_id, fields, spec.name, job)])
        rec = store.get(request_id) or {}
    if rec.get("status") in ("SUCCEEDED", "FAILED"):
        return  # a duplicate of a request that has ended: nothing to run
    publish(request_id, wire, model=model, job=job, pool=spec.name,
            deadline_at=float(rec.get("deadline_at") or time.time() + settings.request_deadline),
            dispatch=dispatch, send=ports.send)
    log.info("forwarded %s from a queue no pool owns to pool %s", request_id, spec.name)


def _forget(store: RequestStore, request_ids: list[str]) -> None:
    """Delete records this call created and did not publish (no record without a message)."""
    for rid in request_ids:
        try:
            store.delete(rid)
        except TransientError:
            pass  # Redis is gone too: the deadline sweep ends the orphaned record
