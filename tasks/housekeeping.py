"""Beat tasks (thin): each calls a `(store, now)` function in app/fleet/ with the Celery app's
ports (app/celery_ports.py: result backend, control bus, publish) as its collaborators."""
from __future__ import annotations

import functools
import logging
import time

from app import app
from app.celery_ports import ports_of
from app.errors import TerminalError
from app.fleet.batch_tick import BatchDriver
from app.fleet.consumers import enforce_quarantines, ensure_job_consumers
from app.fleet.deadlines import sweep_deadlines
from app.fleet.foreign_queues import move_foreign_messages
from app.fleet.jobs import delete_job, expire_jobs
from app.fleet.message_audit import audit_after_restart, audit_orphans
from app.fleet.outcomes import end_requests_failed
from app.fleet.reaper import reap_workers
from app.fleet.reconcile import reconcile_pools
from app.requests.model_files import build_if_local
from app.requests.chat import ChatTemplates, rest_of_context
from app.requests.models import get_registry
from app.requests.publish import republisher
from app.requests.submit import submit_many, submit_request
from app.settings import get_settings
from app.state.queues import HOUSEKEEPING_QUEUE
from app.state.store import shared_store
from app.task_names import (BATCH_TICK, DEADLINE_SWEEP, FOREIGN_QUEUES, HEALTH_TICK, JOB_LEASES,
                             MESSAGE_AUDIT, REAP_WORKERS, RECONCILE)

log = logging.getLogger("vigil.housekeeping")


def housekeeping(name: str):
    """Declare a beat task: on vigil.housekeeping, acked late, no result kept, and no task
    events (a tick every 2 s would bury the requests in Flower's task list; the runs are in
    `vigil status` instead). Each run, failed or not, is recorded (vigil:housekeeping) so that
    `vigil status` and a batch's status can tell when beat's promises stopped being kept
    (app/fleet/housekeeping_runs.py)."""
    def declare(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            started, error = time.time(), ""
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                raise
            finally:
                try:
                    shared_store().housekeeping.note_run(name, time.time(),
                                                         time.time() - started, error)
                except Exception as e:  # Redis away: the run itself said so already
                    log.warning("could not record the run of %s: %s", name, e)

        return app.task(name=name, queue=HOUSEKEEPING_QUEUE, ignore_result=True,
                        acks_late=True, send_events=False)(run)

    return declare

# Beat's own lock around a whole reconcile pass (the job-queue repair has its own).
POOL_RECONCILE_LOCK = "pool_reconcile"
# One batch tick at a time: two would submit the same lines (harmless: the ids are fixed) and
# race to end the same batch.
BATCH_TICK_LOCK = "batch_tick"
BATCH_TICK_LOCK_S = 300.0


@housekeeping(DEADLINE_SWEEP)
def deadline_sweep() -> int:
    """Fail every request past its deadline (deadline_exceeded); returns how many. First, if
    Redis restarted since the last look, publish again the open requests whose message the
    restart lost (app/fleet/message_audit.py)."""
    store, ports = shared_store(), ports_of(app)
    audit_after_restart(store, time.time(), republisher(ports.send))
    return sweep_deadlines(store, time.time(), ports.backend)


@housekeeping(REAP_WORKERS)
def reap(reap_timeout: float | None = None, registration_grace: float | None = None) -> int:
    """Requeue the in-flight requests of workers silent for `reap_timeout`, or for
    `registration_grace` if they never became ready (beat's settings; this worker's
    VIGIL_WORKER_REAP_TIMEOUT / VIGIL_WORKER_REGISTRATION_GRACE if not given); returns how many
    were reaped."""
    s = get_settings()
    timeout = s.worker_reap_timeout if reap_timeout is None else float(reap_timeout)
    grace = (s.worker_registration_grace if registration_grace is None
             else float(registration_grace))
    store, ports = shared_store(), ports_of(app)
    return len(reap_workers(store, time.time(), republisher(ports.send), ports.backend,
                            reap_timeout=timeout, max_attempts=s.max_attempts,
                            registration_grace=grace, redis_started_at=store.redis_run()[1]))


def _cancel(name: str, queue: str) -> None:
    ports_of(app).bus.cancel_consumer(queue, [name])


def _add(name: str, queue: str) -> None:
    ports_of(app).bus.add_consumer(queue, [name])


@housekeeping(HEALTH_TICK)
def health_tick() -> int:
    """Stop quarantined workers that still consume (app/fleet/consumers.py)."""
    s = get_settings()
    store = shared_store()
    ledger = store.health_ledger(window=s.failure_window, threshold=s.failure_threshold)
    return enforce_quarantines(ledger, store, time.time(), ports_of(app).bus.active_queues,
                               _cancel)


@housekeeping(RECONCILE)
def reconcile() -> dict:
    """Give unserved pools a worker (app/fleet/reconcile.py) and make every worker of a pool
    consume all of its job queues; returns what it did."""
    s = get_settings()
    store = shared_store()
    reg = get_registry()
    with store.locked(POOL_RECONCILE_LOCK, 60) as held:
        if not held:
            return {}
        done = reconcile_pools(store, reg, time.time(), ports_of(app).bus.set_consuming,
                               live_window=s.live_window, concurrency=s.reconcile_concurrency)
    done["job_consumers_added"] = ensure_job_consumers(store, reg.names(),
                                                       ports_of(app).bus.active_queues, _add)
    return done


@housekeeping(JOB_LEASES)
def job_leases() -> int:
    """End jobs whose lease lapsed (abandoned): their open requests fail job_deleted."""
    now = time.time()
    store = shared_store()
    return expire_jobs(store, now, get_settings().job_lease_s,
                       lambda name, reason: delete_job(store, ports_of(app), name, reason, now))


@housekeeping(FOREIGN_QUEUES)
def foreign_queues() -> int:
    """Move vigil.generate messages sent to other Celery apps' queues (VIGIL_FOREIGN_QUEUES:
    Celery's default, `celery`) to vigil.housekeeping, to be validated and forwarded to their
    pools (app/fleet/foreign_queues.py); returns how many moved."""
    return move_foreign_messages(shared_store(), get_settings().foreign_queue_names)


@housekeeping(MESSAGE_AUDIT)
def message_audit() -> int | None:
    """Publish again the open requests no queue, worker or unacked entry holds (a producer
    that stopped between record and message; app/fleet/message_audit.py); returns how many."""
    return audit_orphans(shared_store(), time.time(), republisher(ports_of(app).send))


_chat = None


def _render_chat(model: str, messages: list) -> list[int]:
    global _chat
    if _chat is None:  # tokenizers are loaded once per process, on the first chat line
        _chat = ChatTemplates(get_registry(), build_if_local)
    return _chat(model, messages)


@housekeeping(BATCH_TICK)
def batch_tick() -> dict:
    """Advance every live batch one step (app/fleet/batch_tick.py): validate, submit the next
    lines, record what ended, end it; returns {batch id: status}."""
    s = get_settings()
    store, ports = shared_store(), ports_of(app)

    def submit(request_id: str, kwargs: dict) -> None:
        submit_request(kwargs, request_id, settings=s, registry=get_registry(), store=store,
                       ports=ports)

    def submit_many_lines(lines: list[tuple[str, dict]]) -> None:
        submit_many([kw for _, kw in lines], [rid for rid, _ in lines], settings=s,
                    registry=get_registry(), store=store, ports=ports)

    def end_job(name: str, reason: str, code: str) -> int:
        return delete_job(store, ports, name, reason, code=code)

    def end_requests(ids: list[str], code: str, reason: str) -> int:
        try:  # first: a worker running one frees its batch seat (as ending a job does)
            ports.bus.abort_requests(ids)
        except Exception as e:
            log.warning("batch: abort broadcast failed: %s", e)
        return end_requests_failed(store, ids, TerminalError.of(code, reason), now=time.time(),
                                   backend=ports.backend)

    with store.locked(BATCH_TICK_LOCK, BATCH_TICK_LOCK_S) as held:
        if not held:
            return {}
        driver = BatchDriver(store.batches(), store, s, submit=submit,
                             end_requests=end_requests, end_job=end_job,
                             render_chat=_render_chat, chat_budget=rest_of_context,
                             submit_many=submit_many_lines)
        return driver.advance_all(time.time())
