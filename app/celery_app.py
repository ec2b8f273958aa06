"""The Celery application, configured from VigilSettings. Every setting says why it is set.

It composes the app from the floors below it (settings, Redis connections, the registry's
queues, the explanation of a wait) and hands what they need of it back down as its ports
(app/celery_ports.py): nothing below it looks the app up. The entry points above it (the
operator tools, the local harness, the worker, the tasks) get this process's app from
`shared_app()`, which `from app import app` also returns (app/__init__.py).
"""
from __future__ import annotations

import logging
import threading

from billiard.common import TERM_SIGNAME
from celery import Celery
from celery.app.control import Control

from kombu import Queue
from kombu.utils.objects import cached_property

from app.celery_ports import CeleryPorts
from app.control import ControlBus
from app.fleet import waiting
from app.fleet.cancel import ENDED_NOW, cancel_requests
from app.housekeeping_schedule import schedule
from app.requests.models import ModelRegistry, get_registry
from app.result_backend import backend_url
from app.retry_policy import SUBMIT_PUBLISH_RETRY
from app.settings import VigilSettings, get_settings
from app.state import conn as redis_conn
from app.state.queues import HOUSEKEEPING_QUEUE, declared_queues
from app.state.store import RequestStore, open_store
from app.state.streams import TokenStreams
from app.state.transport import transport_for

log = logging.getLogger("vigil.cancel")

# The Celery app's name (its `main`): the worker hooks act only for a worker of this app.
APP_NAME = "vigil"


class VigilControl(Control):
    """Celery's control bus, except that a revoke cancels Vigil's requests first
    (app/fleet/cancel.py): each open one ends `cancelled`, once, and is aborted in its engine,
    also when no worker is there to hear Celery's own revoke. `terminate=True` is taken as a
    plain revoke: the abort already stops the generation, and the threads pool cannot kill one
    task (Celery's terminate would fail in the worker); no signal is sent, the worker and its
    other requests carry on."""

    def revoke(self, task_id, destination=None, terminate=False, signal=TERM_SIGNAME, **kwargs):
        """Cancel the Vigil requests among `task_id` (one id or a list), then revoke the ones
        this cancel ended as Celery does (without terminate): an unknown id, or one that had
        ended, changes nothing, not even the workers' revoked sets (app/fleet/cancel.py).
        Returns what happened to each, {id: "cancelled" | "already ended (STATUS)" |
        "unknown"} (an id that changed nothing is also logged), or with `reply=True` Celery's
        own answer, the workers' replies ([] when no id was cancelled: nothing was sent)."""
        ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
        answer: dict[str, str] = {}
        if ids and isinstance(self.app, VigilCelery):
            answer = cancel_requests(self.app.vigil_store, ids, backend=self.app.backend,
                                     bus=ControlBus(self))
            for rid, what in answer.items():
                if what != ENDED_NOW:
                    log.info("revoke %s: %s; nothing changed", rid, what)
            task_id = [rid for rid, what in answer.items() if what == ENDED_NOW]
        replies = super().revoke(task_id, destination=destination, terminate=False,
                                 signal=signal, **kwargs) if task_id else []
        return replies if kwargs.get("reply") else answer


class VigilCelery(Celery):
    """Celery, except that the results it hands out (`generate.delay(...)`, `app.AsyncResult(id)`)
    are VigilAsyncResult: `info` of an unfinished request says where it waits and why
    (`vigil_why_waiting`, app/fleet/waiting.py)."""

    control_cls = "app.celery_app:VigilControl"
    # What create_app built this app from (results read Vigil's state through them).
    vigil_settings: VigilSettings | None = None
    vigil_registry: ModelRegistry | None = None

    @cached_property
    def AsyncResult(self):
        """The result class bound to this app."""
        return self.subclass_with_self("app.requests.async_result:VigilAsyncResult",
                                       reverse="AsyncResult")

    @cached_property
    def vigil_ports(self) -> CeleryPorts:
        """What the code below the app needs of it (app/celery_ports.py), built once."""
        return CeleryPorts(self)

    @cached_property
    def vigil_store(self) -> RequestStore:
        """Vigil's request records in this app's Redis, opened on first use (results look at
        them while waiting)."""
        return open_store(self.vigil_settings or get_settings())

    @cached_property
    def vigil_streams(self) -> TokenStreams:
        """The token streams in this app's Redis, from its store (results read them in
        `stream()`)."""
        return self.vigil_store.streams()

    def vigil_why_waiting(self, request_id: str) -> dict | None:
        """Why an open request waits (app/fleet/waiting.py), read with this app's settings,
        registry and store; None once it has ended or without a record."""
        return waiting.why_waiting(request_id, store=self.vigil_store,
                                   settings=self.vigil_settings, registry=self.vigil_registry)


def _beat_schedule(s: VigilSettings) -> dict:
    """Beat's schedule (app/housekeeping_schedule.py), each run sent to vigil.housekeeping and
    expiring before the next one so a backlog of them never piles up."""
    return {t.task: {"task": t.task, "schedule": t.every, "kwargs": t.kwargs,
                     "options": {"queue": HOUSEKEEPING_QUEUE, "expires": t.every}}
            for t in schedule(s)}


def celery_config(s: VigilSettings, reg: ModelRegistry) -> dict:
    """Every Celery setting of Vigil's app, broker and backend included, as one dict (create_app
    applies it; the tests hand it to pytest-celery's `celery_app` fixture). Connects to nothing."""
    redis_opts = {
        # Above the longest request + backoff: a healthy long generation is never redelivered.
        "visibility_timeout": s.visibility_timeout,
        # Restore a dead worker's unacked messages on every sweep, not every 10th (kombu's
        # default throttle makes recovery ~100 s even with a short visibility timeout).
        "unacked_restore_throttle": 1,
        "socket_timeout": max(s.redis_timeout, 10.0),
        "socket_connect_timeout": s.redis_timeout,
        "retry_on_timeout": True,
        # Sentinel: the master's name and the sentinels' own options; nothing otherwise
        # (app/state/conn.py gives the state client the same).
        **redis_conn.transport_options(s),
    }
    tls = redis_conn.tls_options(s)
    return dict(
        # Celery's Redis backend without its read before a final write (app/result_backend.py).
        broker_url=s.redis_url, result_backend=backend_url(s.redis_url),
        # kombu's Redis transport sharing one client per connection pool instead of building one
        # per command (app/state/transport.py).
        broker_transport=transport_for(s.redis_url),
        # JSON only, both ways: no pickle anywhere on the wire.
        task_serializer="json", result_serializer="json",
        accept_content=["json"], result_accept_content=["json"],
        # A malformed message (sent around the producer) is dropped with a typed end instead of
        # killing the worker's consumer, and every worker after it (workers/consumer.py).
        worker_consumer="workers.consumer:VigilConsumer",
        # Ack after the task ran, so a worker that dies mid-request leaves the message to be
        # delivered again (Vigil's record makes the second delivery exactly-once).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # One message per thread at a time: the threads pool itself is the batch feeding the
        # engine; prefetching more would strand messages on a worker that might die.
        worker_prefetch_multiplier=1,
        broker_transport_options=redis_opts,
        # rediss://: the broker and the backend verify Redis' certificate against one CA and
        # present one client certificate (None: plain connections).
        broker_use_ssl=tls, redis_backend_use_ssl=tls,
        result_backend_transport_options=redis_opts,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=s.redis_timeout,
        # Fail a submit within seconds when Redis is down instead of hanging.
        task_publish_retry_policy=SUBMIT_PUBLISH_RETRY,
        result_expires=s.result_ttl,
        # A result written while Redis restarts is retried (about VIGIL_REDIS_OUTAGE_GRACE), not
        # lost: the producer's get() waits on it (it would also answer from the record).
        result_backend_always_retry=True,
        result_backend_max_retries=max(3, int(s.redis_outage_grace) + 5),
        result_backend_base_sleep_between_retries_ms=100,
        result_backend_max_sleep_between_retries_ms=2000,
        # Explicit names and queues; a typo'd queue is an error, not a silently created queue
        # that nothing consumes.
        task_create_missing_queues=False,
        task_queues=[Queue(q) for q in declared_queues(reg.names())],
        task_default_queue=HOUSEKEEPING_QUEUE,
        # Task events cost ~1 ms of worker CPU per request (bench/README.md), taken from the
        # engine on a saturated host. Flower turns them on in the workers while it runs (its
        # enable_events), so its views show the lifecycle; VIGIL_TASK_EVENTS=1 keeps them on.
        worker_send_task_events=s.task_events, task_send_sent_event=s.task_events,
        # No STARTED state in the backend: Vigil's record already says RUNNING (and by whom),
        # and the extra GET+SET+PUBLISH per task was the largest single overhead measured.
        task_track_started=False,
        # Every task thread may store a result at once (a whole batch ends in one engine step):
        # redis-py's default cap of 100 connections would fail finished requests.
        redis_max_connections=s.worker_concurrency + 64,
        # vLLM and Celery log through one setup (app/logging_setup.py); stdout is not a logger.
        worker_redirect_stdouts=False,
        worker_hijack_root_logger=True,
        # The threads pool ignores time limits; Vigil enforces request_timeout itself.
        task_time_limit=None, task_soft_time_limit=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry=True,
        # Housekeeping. Every beat task is idempotent and lock-guarded, so a second beat is
        # harmless; each expires before its next run so a backlog of them never piles up.
        beat_schedule=_beat_schedule(s),
    )


def create_app(settings: VigilSettings | None = None,
               registry: ModelRegistry | None = None) -> Celery:
    """Build Vigil's Celery app. Connects to nothing: safe at import."""
    s = settings or get_settings()
    reg = registry or get_registry()
    app = VigilCelery(APP_NAME, broker=s.redis_url, backend=backend_url(s.redis_url),
                      include=["tasks.inference", "tasks.housekeeping"])
    app.vigil_settings, app.vigil_registry = s, reg
    app.conf.update(celery_config(s, reg))
    return app


_shared_lock = threading.Lock()
_shared: Celery | None = None


def shared_app() -> Celery:
    """This process's Celery app, built by `create_app` from the settings on the first call
    (under a lock, once per process); `from app import app` is the same object. Raises
    SettingsError for a bad setting or registry file."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = create_app()
        return _shared
