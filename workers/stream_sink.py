"""The worker's token-stream flusher: one thread per worker that writes every open tap's due
chunk (workers/streaming.py) in one pipelined round trip, every `flush_ms`, or as soon as a tap
has `chunk_tokens` unwritten or a `live` tap has a new step; and the last writes of a request
that yields or is handed back (`write_now`, `write_all`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from app import metrics
from app.state.streams import APPENDED, Checkpoint, Chunk, TokenStreams
from workers.streaming import StreamTap

log = logging.getLogger("vigil.streams")

# How long a yielding request's last write waits for a chunk the flusher has in flight (its
# round trip is bounded by the Redis calls' own timeout and outage grace; this bounds the wait
# of the task thread that hands the request back).
LAST_WRITE_TIMEOUT_S = 10.0


class StreamSink:
    """The worker's flusher: writes every open tap's due chunk in one round trip per flush."""

    def __init__(self, streams: TokenStreams, flush_ms: int, chunk_tokens: int, *,
                 clock: Callable[[], float] = time.monotonic):
        self.streams = streams
        self.flush_s = flush_ms / 1000.0
        self.chunk_tokens = chunk_tokens
        self._clock = clock
        self._taps: dict[str, StreamTap] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.flushes = 0
        self.chunks = 0

    def start(self) -> "StreamSink":
        """Start the flusher thread."""
        self._thread = threading.Thread(target=self._run, name="vigil-streams", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the flusher (what is unwritten stays unwritten: the results carry it)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def open(self, request_id: str, token: str, attempt: int, pool: str,
             prior: Checkpoint | None, adapter_fingerprint: str = "",
             samples: int = 1, live: bool = False) -> StreamTap:
        """A tap for one attempt (claim `token`) of a request of `samples` samples; `live`:
        every step's tokens written and published at once (workers/streaming.py)."""
        tap = StreamTap(self, request_id, token, attempt, pool, prior, adapter_fingerprint,
                        samples, live)
        with self._lock:
            self._taps[request_id] = tap
        return tap

    def close(self, tap: StreamTap, ok: bool = True) -> None:
        """The attempt ended: its unwritten tokens are not written. With a result (`ok`) the
        result carries them; without one they are lost to the next attempt (counted)."""
        with self._lock:
            if self._taps.get(tap.request_id) is tap:
                del self._taps[tap.request_id]
        if not ok:
            metrics.tokens_discarded(tap.pool, tap.unwritten())
        if tap.restart_unwritten():
            # A refused resume restarted the stream: readers should learn it before the result
            # (which does not begin with the old tokens) is stored. (A reader also checks the
            # result against what it read: docs/api.md, "Token streams".)
            c = tap.take_chunk(self._clock(), 0.0, 1, force=True)
            if c is None:  # the flusher has one in flight: its answer decides
                return
            self._send(tap, c, "restart its token stream")

    def write_now(self, tap: StreamTap, timeout: float = LAST_WRITE_TIMEOUT_S) -> bool:
        """Write `tap`'s pending tokens now (a request that yields its slot: its next attempt
        goes on from them); True when nothing is left unwritten. A chunk the flusher thread has
        in flight is waited out (for at most `timeout` seconds), then the rest is written: its
        answer decides where the rest begins. A Redis that cannot be reached, a tap fenced
        meanwhile or the bound leave them pending (they count as discarded at the close)."""
        deadline = time.monotonic() + timeout
        while True:
            c = tap.take_chunk(self._clock(), 0.0, 1, force=True)
            if c is not None and not self._send(tap, c, "write its tokens before it yielded"):
                return False
            if tap.unwritten() == 0 or tap.dead or time.monotonic() >= deadline:
                return tap.unwritten() == 0
            time.sleep(0.005)  # the flusher's chunk in flight (its answer first), or refused

    def _send(self, tap: StreamTap, c: Chunk, doing: str) -> bool:
        """Append `c` now, in one round trip, and answer `tap`; False (logged) when Redis
        could not take it (it stays pending)."""
        try:
            tap.chunk_written(c, self.streams.append_many([c])[0])
            return True
        except Exception as e:
            tap.chunk_written(c, None)
            log.warning("request %s: could not %s: %s", tap.request_id, doing, e)
            return False

    def write_all(self, timeout: float) -> int:
        """Write every open tap's pending tokens now, waiting out a chunk the flusher thread has
        in flight, for at most `timeout` seconds: a hand-back (workers/held.py), after which
        the next attempts go on from what is in Redis. Returns the tokens still unwritten on
        taps that may write (0: every token the taps hold is in Redis); a fenced tap's are not
        this attempt's to write."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.flush(force=True)
            except Exception as e:  # Redis away: tried again until the deadline
                log.warning("could not write token streams before the hand-back: %s", e)
            with self._lock:
                taps = list(self._taps.values())
            left = sum(t.unwritten() for t in taps if not t.dead)
            if left == 0 or time.monotonic() >= deadline:
                return left
            time.sleep(0.01)

    def wake(self) -> None:
        """A tap has a full chunk: flush now."""
        self._wake.set()

    def flush(self, force: bool = False) -> int:
        """Write every due chunk (every pending one with `force`) in one round trip; returns
        how many were written."""
        now = self._clock()
        with self._lock:
            taps = list(self._taps.values())
        due = [(t, c) for t in taps
               if (c := t.take_chunk(now, self.flush_s, self.chunk_tokens, force)) is not None]
        if not due:
            return 0
        try:
            replies = self.streams.append_many([c for _, c in due])
        except BaseException:
            for t, c in due:
                t.chunk_written(c, None)  # still pending: the next flush sends them again
            raise
        for (t, c), r in zip(due, replies):
            t.chunk_written(c, r)
        self.flushes += 1
        self.chunks += len(due)
        return sum(1 for r in replies if r == APPENDED)

    def tick(self, early: bool) -> int:
        """One wake of the flusher: at the flush interval everything pending goes (tokens that
        came just after the last write too); woken `early` by a full chunk, what is due."""
        try:
            return self.flush(force=not early)
        except Exception as e:  # Redis away: the tokens stay pending for the next flush
            log.warning("could not write token streams: %s", e)
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            early = self._wake.wait(self.flush_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.tick(early)
