"""The worker's registry entry and heartbeat in Redis (`vigil:worker:{instance}`, `vigil:workers`).

A background thread writes the entry every `heartbeat_interval`, and sooner when poked (engine
loaded, a new in-flight peak) so operators and tests see engine changes within ~0.2 s. The entry
is removed on a clean stop; a dead worker's entry stays for the reaper (app/fleet/reaper.py).

`has_pinged` is 0 from registration until the worker says it is ready (`mark_ready`: Celery's
worker_ready fired and its preload, if any, ended), then 1. The reaper gives an entry that never
pinged the registration grace instead of the reap timeout.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from app.errors import TransientError, WorkerFatalError
from app.state.calls import REDIS_ERRORS
from app.state.registry import WorkerRegistry

log = logging.getLogger("vigil.heartbeat")
MIN_GAP_S = 0.2


class Heartbeat:
    """Publishes `fields()` for one worker instance until stopped."""

    def __init__(self, registry: WorkerRegistry, instance_id: int, name: str, interval: float,
                 fields: Callable[[], dict], clock: Callable[[], float] = time.time,
                 on_redis_back: Callable[[], None] | None = None,
                 after_beat: Callable[[], None] | None = None):
        """`on_redis_back` runs (in its own thread) after a write succeeds following a failed
        one, or when Redis' run_id changed since the last write: Redis was away or restarted.
        `after_beat` runs on the heartbeat thread after every write (its errors are logged)."""
        self.registry = registry
        self.instance_id = instance_id
        self.name = name
        self.interval = interval
        self._fields = fields
        self._clock = clock
        self._wake = threading.Event()
        self._beat_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = clock()
        self.has_pinged = False
        self.on_redis_back = on_redis_back
        self.after_beat = after_beat
        self._run_id: str | None = None
        self._failed = False

    def start(self) -> "Heartbeat":
        """Write the entry once (synchronously: the worker is registered before it consumes)."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="vigil-heartbeat", daemon=True)
        self._thread.start()
        return self

    def poke(self) -> None:
        """Ask for an early write (coalesced)."""
        self._wake.set()

    def mark_ready(self) -> None:
        """The worker is ready: its entry says has_pinged=1 from this call on, written here
        before it returns, so a worker killed a moment after becoming ready is judged by the reap
        timeout, not the registration grace (a write that fails is left to the heartbeat thread,
        which writes the flag from then on)."""
        self.has_pinged = True
        try:
            self.beat()
        except REDIS_ERRORS as e:
            log.warning("could not write the worker's readiness now (%s): the next heartbeat "
                        "will", e)
            self.poke()

    def beat(self) -> None:
        """Write the entry now (one writer at a time: the heartbeat thread, a readiness mark)."""
        with self._beat_lock:
            now = self._clock()
            entry = {
                "name": self.name, "instance_id": self.instance_id, "host": socket.gethostname(),
                "pid": os.getpid(), "started_at": self.started_at, "last_seen": now,
                "has_pinged": int(self.has_pinged), **self._fields(),
            }
            self.registry.write(self.instance_id, entry, now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.beat()
                self._watch_redis()
            except REDIS_ERRORS as e:  # blips must not kill the heartbeat
                log.warning("heartbeat failed: %s", e)
                self._failed = True
            else:
                self._after_beat()
            self._stop.wait(MIN_GAP_S)

    def _after_beat(self) -> None:
        if self.after_beat is None:
            return
        try:
            self.after_beat()
        except Exception as e:  # nor must what rides on it
            log.warning("after the heartbeat: %s", e)

    def _watch_redis(self) -> None:
        run_id = self.registry.server_run_id()
        restarted = self._run_id is not None and run_id != self._run_id
        back = self._failed or restarted
        self._run_id, self._failed = run_id, False
        if back and self.on_redis_back is not None:
            log.warning("Redis is back%s", " (restarted)" if restarted else "")
            threading.Thread(target=self.on_redis_back, name="vigil-redis-back",
                             daemon=True).start()

    def stop(self, unregister: bool = True) -> None:
        """Stop beating; on a clean stop remove the entry (in-flight set included)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if unregister:
            try:
                self.registry.drop(self.instance_id)
            except TransientError as e:
                log.warning("could not unregister worker %s: %s", self.name, e)


def device_fields(probe: Callable[[], object], on_lost: Callable[[WorkerFatalError], None]) -> dict:
    """The entry's device fields from `probe()` (a MemoryProbe: `device`, `device_free_bytes`,
    `device_total_bytes` and, on a GPU, each card in `device_cards`). A probe failure leaves
    them empty and never stops the heartbeat; a card lost under the worker
    (WorkerFatalError from NVML) is also handed to `on_lost`, which makes the worker leave."""
    empty = {"device": None, "device_free_bytes": None, "device_total_bytes": None}
    try:
        return probe().heartbeat_fields()
    except WorkerFatalError as e:
        log.critical("a card of this worker is lost: %s", e)
        on_lost(e)
        return empty
    except Exception as e:  # a probe failure must not stop the heartbeat
        log.warning("memory probe failed: %s", e)
        return empty
