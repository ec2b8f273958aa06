"""Celery start-up and shutdown hooks of a Vigil worker process.

worker_init  -> logging for vLLM, the WorkerRuntime (vLLM's modules imported on this thread
                first: app/first_imports.py; heartbeat, engine loop, orphan guard);
                in a housekeeper, the deadline watch instead (app/fleet/deadlines.py)
worker_ready -> preload the engines of VIGIL_POOLS in the background; the worker is ready
                (has_pinged=1 in its registry entry) once that preload ended, or at once
worker_shutdown -> the engine is shut down cleanly (no leaked processes or shared memory)
"""
from __future__ import annotations

import logging
import threading

from celery.app import trace as celery_trace
from celery.signals import (task_revoked, worker_init, worker_ready, worker_shutdown,
                            worker_shutting_down)
from celery.worker import control as celery_control
from celery.worker.control import control_command

from app import metrics
from app.celery_app import APP_NAME
from app.celery_ports import ports_of
from app.errors import CANCELLED, DEADLINE_EXCEEDED, TerminalError
from app.fleet.cancel import cancel_requests, revocable
from app.fleet.deadlines import DeadlineWatch
from app.fleet.outcomes import end_request
from app.logging_setup import configure_vllm_logging, quiet_per_request_lines
from app.requests.tiers import intake_limits_for
from app.settings import get_settings
from app.state.intake import limit_intake
from app.state.queues import HOUSEKEEPING_QUEUE
from app.state.store import shared_store
from app.state.transport import hold_deliveries
from app.task_names import GENERATE, GENERATE_MANY
from workers import metrics_server, runtime
from workers.held import carried

log = logging.getLogger("vigil.worker")
_hand_back_thread: threading.Thread | None = None
_deadline_watch: DeadlineWatch | None = None  # a housekeeper's


def housekeeper() -> bool:
    """True in a `vigil housekeeper` process: beat's tasks only, no engine, no registry entry."""
    return get_settings().role == "housekeeper"


def vigil_worker(sender) -> bool:
    """True when a worker signal comes from a worker of Vigil's own app. Another Celery app's
    worker in the same process (a test's in-process `celery_worker`) gets no runtime, engine or
    registry entry from these hooks."""
    app = getattr(sender, "app", None)
    return app is None or getattr(app, "main", None) == APP_NAME


@worker_init.connect
def _on_worker_init(sender=None, **_):
    if not vigil_worker(sender):
        return
    s = get_settings()
    configure_vllm_logging(s.cache_dir, s.log_level)
    if not s.log_payloads:
        # Celery logs a task's return value on success; ours holds the generated text (user
        # data). Keep the line, drop the payload, unless VIGIL_LOG_PAYLOADS=1.
        celery_trace.LOG_SUCCESS = "Task %(name)s[%(id)s] succeeded in %(runtime)ss"
    if not s.log_requests:  # a request's life is in `vigil request ID`, not two lines each
        quiet_per_request_lines()
    if housekeeper():
        log.info("housekeeper %s: runs beat's tasks on %s, never an engine",
                 getattr(sender, "hostname", ""), HOUSEKEEPING_QUEUE)
        # Requests end at their deadline, not at beat's next sweep (app/fleet/deadlines.py).
        global _deadline_watch
        _deadline_watch = DeadlineWatch(shared_store(), ports_of(sender.app).backend).start()
        return
    rt = runtime.install(runtime.WorkerRuntime(s, getattr(sender, "hostname", "") or "worker",
                                               ports=ports_of(sender.app)).start())
    # Interactive work first, within the slots kept for it, bulk work above its floor
    # (app/state/intake.py), over this worker's real number of task threads.
    threads = getattr(sender, "concurrency", None) or s.worker_concurrency
    limit_intake(intake_limits_for(threads, s.interactive_slots, s.bulk_floor))
    # Each generate message this worker's consumer takes is recorded as held by this instance in
    # the same write as kombu's note of the delivery (app/state/transport.py), so if the worker
    # dies before a thread begins it, the reaper still finds it (otherwise only Redis'
    # visibility timeout would bring it back).
    hold_deliveries(rt.store.delivery_holder(rt.instance_id, GENERATE, GENERATE_MANY))
    if s.metrics_port:  # each worker process serves its own /metrics (docs/operations.md)
        metrics_server.serve(rt, s.metrics_port, s.metrics_address)


@worker_ready.connect
def _on_worker_ready(sender=None, **_):
    if housekeeper() or not vigil_worker(sender):
        return
    rt = runtime.get_runtime()
    _consume_job_queues(sender, rt)
    # One engine per process: loading every pool in turn would only evict the previous one.
    pools = [p for p in rt.settings.pools if p][:1]
    if not pools or not rt.settings.preload:
        rt.ready()
        return

    def _preload():
        try:
            rt.preload(pools)
        except Exception as e:  # requests will retry the load and report the error themselves
            log.error("preloading %s failed: %s", pools, e)
        finally:  # warm-up is over either way: the reap timeout applies from here
            rt.ready()

    threading.Thread(target=_preload, name="vigil-preload", daemon=True).start()


def _consume_job_queues(consumer, rt) -> None:
    """Consume the job queues that already exist in this worker's pools (app/fleet/jobs.py); new ones
    are announced by the producer, and beat's reconcile repairs what was missed."""
    if consumer is None or not hasattr(consumer, "add_task_queue"):
        return
    rt.consumer = consumer
    try:
        for pool in rt.pools:
            for queue in rt.store.pool_queues(pool)[1:]:
                consumer.add_task_queue(queue)
    except Exception as e:  # the reconcile adds them within one pass
        log.warning("could not consume the job queues of %s: %s", rt.pools, e)


@control_command(name="revoke", variadic="task_id", signature="[id1 [id2 [... [idN]]]]")
def revoke(state, task_id, terminate=False, signal=None, **kwargs):
    """Celery's revoke (whoever sent it: Vigil's app, a plain Celery app, Flower), with Vigil's
    requests among the ids cancelled first (app/fleet/cancel.py): ended `cancelled` once and
    aborted in this worker's engine now. `terminate` is taken as a plain revoke: the threads
    pool cannot kill one task (Celery's terminate raises there), and the abort already stopped
    the generation; the worker and its other requests carry on. Only the ids whose record ended
    `cancelled` go to Celery's revoked set (`revocable`): an unknown id, one that ended another
    way, or any id while Redis cannot be read changes nothing here, so a later request under it
    runs."""
    ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
    rt = runtime.installed()
    revoked: list[str] = []
    try:
        if ids:
            store = rt.store if rt is not None else shared_store()
            cancel_requests(store, ids, backend=state.app.backend, bus=None)
            revoked = revocable(store, ids)
    except Exception as e:  # the record stays open: the sender's own cancel may have ended it
        log.warning("revoke: could not end %s cancelled: %s", ids, e)
    if rt is not None and revoked:
        rt.host.abort_requests(set(revoked))
    if not revoked:  # unknown or ended otherwise: nothing changes, Celery's revoked set neither
        return {"ok": f"nothing revoked: no request among {sorted(ids)} ended cancelled"}
    return celery_control.revoke(state, revoked, terminate=False, signal=signal, **kwargs)


@control_command(args=[("request_ids", list)], signature="<request_id> ...")
def vigil_abort(state, request_ids=None, **_):
    """Abort these requests if this worker is running them: they ended elsewhere (their job was
    deleted), and the engine should not spend another step on them."""
    rt = runtime.installed()
    n = rt.host.abort_requests(set(request_ids or ())) if rt is not None else 0
    return {"ok": f"aborted {n}"}


@task_revoked.connect
def _on_task_revoked(sender=None, request=None, expired=False, **_):
    """Celery dropped a message without running it: expired (past deadline + grace), or
    revoked (cancelled). Give the request its typed end: record FAILED (deadline_exceeded, or
    cancelled when the cancel did not end it already) and the backend's REVOKED replaced by the
    stored outcome, so `r.get()` raises a Vigil error, not TaskRevokedError."""
    name = getattr(sender, "name", "")
    if name not in (GENERATE, GENERATE_MANY) or request is None:
        return
    err = (TerminalError.of(DEADLINE_EXCEEDED, "the request's deadline passed before a worker "
                            "could run it (message expired)") if expired else
           TerminalError.of(CANCELLED, "revoked before a worker ran it"))
    if name == GENERATE_MANY:  # each request it carries ends so (those still open)
        store = shared_store() if housekeeper() else runtime.get_runtime().store
        for rid in carried(request):
            end_request(store, rid, error=err, backend=sender.backend, tell_always=True)
        return
    # Celery stored REVOKED: the backend gets the stored outcome whoever wrote it.
    if housekeeper():  # a misrouted message: no runtime here, the sweeper's identity
        end_request(shared_store(), request.id, error=err, backend=sender.backend,
                    tell_always=True)
        return
    rt = runtime.get_runtime()
    end_request(rt.store, request.id, error=err, instance=rt.instance_id,
                backend=sender.backend, tell_always=True)


@worker_shutting_down.connect
def _on_worker_shutting_down(sender=None, **_):
    """SIGTERM/SIGINT: hand in-flight requests back to the queue at once, instead of making
    them wait for this worker's warm shutdown or the reaper. Runs on its own thread: this
    signal is sent from inside Celery's signal handler, where Redis I/O must not happen."""
    if housekeeper() or runtime.installed() is None:
        return

    def _run():
        try:
            runtime.get_runtime().hand_back()
        except Exception as e:  # the reaper remains the backstop
            log.error("handing back in-flight requests failed: %s", e)

    global _hand_back_thread
    _hand_back_thread = threading.Thread(target=_run, name="vigil-hand-back", daemon=True)
    _hand_back_thread.start()


@worker_shutdown.connect
def _on_worker_shutdown(sender=None, **_):
    if not vigil_worker(sender):
        return
    if _deadline_watch is not None:
        _deadline_watch.stop()
    if _hand_back_thread is not None:
        _hand_back_thread.join(timeout=30)
    if runtime.installed() is not None:  # its tasks have ended: their taps are closed
        resumed, discarded = metrics.token_totals()
        log.info("worker stopping: in this process %d generated token(s) were resumed from and "
                 "%d discarded (vigil_tokens_discarded_total)", resumed, discarded)
    metrics_server.stop()
    hold_deliveries(None)
    runtime.uninstall()
