"""The loop bridge: the engine host's asyncio loop on its own thread, and the task threads' way
onto it.

A Celery task thread hands its request to the loop and blocks on the answer (`call`); vLLM's
AsyncLLM lives on that loop and sees every request in flight at once. The bridge keeps each
request's future, so the host can abort one by request id (its job was deleted), every one (the
worker stops or quarantines) or every one for a stall, and the blocked thread learns which of
those happened:

- `Aborted`: the request ended elsewhere while it ran; answer with the stored outcome;
- `HandedBack`: the worker stopped taking requests (stopping or quarantined) and handed this one
  back to the queue; drop this delivery;
- `TransientError(wedged)`: it got no answer within its timeout inside the running engine, or
  the stall watchdog aborted it; both are reported through `on_failure` (the health ledger), and
  so is a fast failure of a live engine (`allocation_failed`, `engine_error`); a completed
  request is reported through `on_success`;
- `TransientError(engine_restarting)`: it waited for an engine (a drain, a load, a recovery)
  past the bound it was given; not wedge evidence, nothing is reported.

Once the bridge is closed to new requests (`refuse_new`, `pause`), a new `call` raises
HandedBack at once, before anything reaches the loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Callable, Coroutine

from app.errors import (ALLOCATION_FAILED, ENGINE_ERROR, ENGINE_RESTARTING, WEDGED, TransientError,
                        VigilError)
from app.request_ids import request_id_of

log = logging.getLogger("vigil.engine")

# Failures of a live engine that count as evidence against the worker, like a wedge: an engine
# that answers every request at once with one of these would otherwise keep taking requests.
FAST_FAILURES = frozenset({ALLOCATION_FAILED, ENGINE_ERROR})
ABORTED = "aborted"
PREEMPTED = "preempted"
STALLED = "stalled"


class HandedBack(Exception):
    """The worker is stopping and handed this request back to the queue: drop this delivery."""


class Preempted(Exception):
    """This bulk request yielded its batch seat to an interactive one at a token boundary (its
    tokens are in its tap): the caller hands it back to resume from them (workers/service.py)."""


class Aborted(Exception):
    """The request ended elsewhere while it ran (its job was deleted): it was aborted in the
    engine; the caller answers with the stored outcome."""


class LoopBridge:
    """Owns the loop thread and the futures of the requests on it. Thread-safe."""

    def __init__(self, *, on_failure: Callable[[str], None] | None = None,
                 on_success: Callable[[], None] | None = None):
        self.loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._on_failure = on_failure or (lambda reason: None)
        self._on_success = on_success or (lambda: None)
        self._lock = threading.Lock()
        self._futures: dict[concurrent.futures.Future, str] = {}  # -> engine request id
        self._why: dict[concurrent.futures.Future, tuple[str, str]] = {}  # -> (kind, reason)
        self.draining = False
        self.paused = False

    # -- the thread ----------------------------------------------------------------------------
    def start(self, init: Callable[[], Coroutine]) -> None:
        """Start the loop thread and run `init()` on it (creating what must live on the loop)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="vigil-engine-loop", daemon=True)
        self._thread.start()
        self.run(init(), 10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        """True between `start` and `stop`."""
        return self._thread is not None

    def run(self, coro: Coroutine, timeout: float) -> Any:
        """Run `coro` on the loop and wait for it (up to `timeout`: concurrent.futures'
        TimeoutError after that)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine) -> None:
        """Start a background task on the loop (ended by `stop`)."""
        self.loop.call_soon_threadsafe(self.loop.create_task, coro)

    def stop(self) -> None:
        """Cancel the loop's background tasks, stop the loop and join its thread. Idempotent."""
        if self._thread is None:
            return

        async def _cancel_background():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_cancel_background(), 5)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            log.warning("engine loop tasks did not end cleanly: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self._thread = None

    # -- task threads --------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """False while paused (quarantined) or stopping: deliveries go back to the queue."""
        return not (self.paused or self.draining)

    def call(self, make: Callable[[], Coroutine], engine_request_id: str, timeout: float) -> Any:
        """Run `make()` (one request's coroutine) on the loop and return its result; raises a
        classified VigilError (a fresh copy: vLLM shares one error object between requests),
        `HandedBack`, `Aborted`, TransientError(wedged) when the loop says so or the watchdog
        stalled it, or TransientError(engine_restarting) when the whole call took over
        `timeout` (module docstring)."""
        return self.wait(self.submit(make, engine_request_id), engine_request_id, timeout)

    def submit(self, make: Callable[[], Coroutine], engine_request_id: str
               ) -> concurrent.futures.Future:
        """Start `make()` on the loop and return its future, for `wait` (many requests of one
        thread run together this way: workers/service.py). Raises HandedBack when the
        bridge takes nothing new."""
        if not self.accepting:
            raise HandedBack(engine_request_id)
        # Scheduled and registered under one lock: an abort that snapshots the futures while
        # this request is already running in the engine must see it.
        with self._lock:
            fut = asyncio.run_coroutine_threadsafe(make(), self.loop)
            self._futures[fut] = engine_request_id
        return fut

    def submit_many(self, calls: list[tuple[Callable[[], Coroutine], str]]
                    ) -> list[concurrent.futures.Future]:
        """`submit` for each (make, engine request id), in one hop onto the loop (one wake-up
        of the loop thread instead of one per request); the futures in order. Raises HandedBack
        (for the first) when the bridge takes nothing new: none is started then."""
        if not calls:
            return []
        if not self.accepting:
            raise HandedBack(calls[0][1])
        futures = [concurrent.futures.Future() for _ in calls]
        coros = [make() for make, _ in calls]

        def start() -> None:  # on the loop: as run_coroutine_threadsafe's callback, for each
            for coro, fut in zip(coros, futures):
                try:
                    asyncio.futures._chain_future(asyncio.ensure_future(coro, loop=self.loop),
                                                  fut)
                except BaseException as exc:  # noqa: BLE001 - its caller learns it
                    coro.close()
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(exc)

        with self._lock:  # registered with their scheduling (see `submit`)
            self.loop.call_soon_threadsafe(start)
            for fut, (_, engine_request_id) in zip(futures, calls):
                self._futures[fut] = engine_request_id
        return futures

    def wait(self, fut: concurrent.futures.Future, engine_request_id: str, timeout: float,
             bound: float | None = None) -> Any:
        """The result of a `submit`ted request, as `call` returns or raises it; `timeout`
        counts from now (`bound`, the whole wait's, is what an error names)."""
        try:
            out = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            # Still waiting for an engine (a drain, a load, a recovery): the loop bounds the run
            # itself, so this is no evidence of a wedge.
            fut.cancel()
            raise TransientError.of(ENGINE_RESTARTING, (
                f"request {engine_request_id} waited over {bound or timeout:g} s for an engine "
                "(loading, switching models or recovering)")) from None
        except concurrent.futures.CancelledError:
            kind, reason = self._why.pop(fut, ("", ""))
            if kind == ABORTED:
                raise Aborted(engine_request_id) from None
            if kind == PREEMPTED:
                raise Preempted(engine_request_id) from None
            if kind == STALLED:
                self._on_failure(f"stall: {reason}")
                raise TransientError.of(WEDGED, reason) from None
            if not self.accepting:
                raise HandedBack(engine_request_id) from None
            raise
        except VigilError as e:
            if e.code == WEDGED:  # no answer from the running engine within its timeout
                self._on_failure(f"timeout: {e.detail}")
            elif e.code in FAST_FAILURES:  # a live engine failing at once: a black hole
                self._on_failure(f"fast failure: {e}")
            raise type(e)(str(e)) from None
        finally:
            with self._lock:
                self._futures.pop(fut, None)
                self._why.pop(fut, None)
        self._on_success()
        return out

    # -- aborting ------------------------------------------------------------------------------
    def cancel_all(self, kind: str = "", reason: str = "") -> int:
        """Cancel every request on the loop (in the engine or waiting for it); their callers
        learn `kind` (STALLED: wedged; "" : handed back). Returns how many."""
        with self._lock:
            futures = list(self._futures)
            if kind:
                for f in futures:
                    self._why[f] = (kind, reason)
        for f in futures:
            f.cancel()  # the engine aborts the request (CancelledError inside generate)
        return len(futures)

    def request_ids(self) -> set[str]:
        """The Vigil request ids of every request on the loop now (in the engine or waiting)."""
        with self._lock:
            return {request_id_of(rid) for rid in self._futures.values()}

    def cancel_requests(self, request_ids: set[str], kind: str = ABORTED) -> int:
        """Cancel the requests of these Vigil request ids (engine ids are `<id>-<attempt>`);
        their callers get `Aborted` (or `Preempted`, with that `kind`). Returns how many it
        found."""
        with self._lock:
            hits = [f for f, rid in self._futures.items() if request_id_of(rid) in request_ids]
            for f in hits:
                self._why[f] = (kind, kind)
        for f in hits:
            f.cancel()
        return len(hits)
