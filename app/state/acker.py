"""A kombu channel's acks sent to Redis from a thread of its own, many per script call (used by
Vigil's transport, app/state/transport.py)."""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("vigil.transport")

# Most delivery tags acked in one script call (Lua's unpack takes a few thousand at most).
ACK_BATCH = 500


class Acker:
    """A channel's acks, sent to Redis from a thread of its own, up to ACK_BATCH per script call.

    Celery runs every ack on the consumer's event loop thread, the thread that also takes every
    message in: one blocking round trip per ack there was a third of that thread's time on a busy
    instant-engine worker (docs/performance.md). Here the loop only queues the tag. An ack still
    queued when the worker dies is not lost work: its message stays in kombu's `unacked` hash,
    comes back after the visibility timeout, and Vigil answers that second delivery from the
    request's record without running it again."""

    def __init__(self, send: Callable[[list], object], name: str = "vigil-acker"):
        self._send = send
        self._name = name
        self._pending: list = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._busy = False

    def ack(self, tag) -> None:
        """Queue one delivery tag for the acker thread (started on the first), which sends it
        with whatever else is queued; once stopped, send it here and now."""
        with self._cond:
            if not self._stopping:
                self._pending.append(tag)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name,
                                                    daemon=True)
                    self._thread.start()
                self._cond.notify()
                return
        self._send([tag])  # the channel is closing: no thread to hand it to

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s until every queued ack was sent (or failed); True if so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def stop(self, timeout: float) -> None:
        """Send what is queued (waiting up to `timeout` s), then end the thread."""
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._stopping)
                if not self._pending:
                    return
                tags, self._pending = self._pending[:ACK_BATCH], self._pending[ACK_BATCH:]
                self._busy = True
            try:
                self._send(tags)
            except Exception as e:  # their messages come back after the visibility timeout
                log.warning("could not ack %d message(s) in Redis: %s; they are delivered "
                            "again after the visibility timeout and answered from their "
                            "records", len(tags), e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
