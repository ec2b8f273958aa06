"""The result handle Vigil's app gives producers: `generate.delay(...)`, `app.AsyncResult(id)`.

Celery's AsyncResult, with two things added from Vigil's own record of the request:

- `info` of an unfinished request says where it waits and why (app/ops/request_view.py);
- `get()` never waits on something that cannot come, and keeps its job alive. Celery's `get` waits for the result
  backend's key; Vigil's record is written first, in the same step that decides the outcome.
  While `get` waits, it looks at the record every `RECORD_CHECK_S`: an ended record whose result
  never reached the backend (a Redis restart between the two writes) answers from the record,
  and a request Redis has no record of at all raises `request_lost` (TerminalError) instead of
  waiting for ever. A record can vanish only when Redis loses writes (a crash inside the AOF
  fsync window: docs/reliability.md) or after VIGIL_RESULT_TTL, when the result is gone too.
  The same look renews the request's job lease (at most once a minute per job and process), so a
  caller that only waits in `get()` is not taken for one that abandoned its job.
- a result of a `generate_many` call waits by reading the result keys (`Siblings`), never by
  Celery's subscription to each result's channel. A collector of thousands subscribed to
  nearly every one it waited for, and one reply connection carried all their messages, read
  one per turn: a backlog of 180-530 KB built up on it under the short-request bench, and a
  result stored long before was found only by the record check, 5 s later (docs/performance.md,
  "The third pass: short runs queue, a collector reads").
"""
from __future__ import annotations

import json
import threading
import time

from celery import states
from celery.exceptions import TaskRevokedError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from app import metrics
from app.errors import REQUEST_LOST, TerminalError, TransientError, error_from_record
from app.state.queues import DEFAULT_JOB
from app.state.store import RequestStore
from app.state.store_reads import Outcome
from app.requests.stream_cursor import StreamCursor

# How often a waiting `get()` looks at the request's record (one HMGET).
RECORD_CHECK_S = 5.0
# How long `stream()` blocks on the token stream before it looks at the record (a request that
# ends without ever writing a stream has no end entry to wake it).
STREAM_BLOCK_S = 0.5
# A waiting `get()` renews its request's job lease (app/fleet/jobs.py) at most this often per process
# and job: a caller that only waits is not abandoning its job.
LEASE_TOUCH_S = 60.0
_touched: dict[str, float] = {}
_touched_lock = threading.Lock()
# Result keys one `get()` of a `generate_many` result reads at once (`Siblings`).
SIBLINGS_READ = 64
# While a `generate_many` result is not stored, its `get()` reads again after a pause that grows
# with its wait (a twentieth of it), from POLL_MIN_S up to POLL_MAX_S: a result is seen at most
# 5% of its wait late (and POLL_MAX_S at most), and a long wait costs 4 reads a second.
POLL_MIN_S = 0.002
POLL_MAX_S = 0.25


class VigilAsyncResult(AsyncResult):
    """Celery's AsyncResult whose `info`, while the request has no outcome, is why_waiting's dict
    (where it waits and why) instead of Celery's None (PENDING) or the retry's exception (RETRY),
    and whose `get()` also watches Vigil's record (module docstring). `state`, `ready()` and
    `result` are Celery's own and cost nothing more."""

    def revoke(self, connection=None, terminate=False, signal=None, wait=False, timeout=None):
        """Celery's revoke (app/celery_app.py VigilControl: the request ends `cancelled`, once,
        and is aborted in its engine), answering what happened: "cancelled", "already ended
        (STATUS)" (a result or error written first stays) or "unknown" (no record: never
        submitted, or past VIGIL_RESULT_TTL); None with `wait=True` (Celery's own)."""
        answer = self.app.control.revoke(self.id, connection=connection, terminate=terminate,
                                         signal=signal, reply=wait, timeout=timeout)
        return answer.get(self.id) if isinstance(answer, dict) else None

    @property
    def info(self):
        """The result or exception once ready; before that, why_waiting(id) (falling back to
        Celery's own value when Vigil has no record of the id)."""
        meta = self._get_task_meta()
        if meta["status"] in states.READY_STATES:
            return meta["result"]
        why_waiting = getattr(self.app, "vigil_why_waiting", None)
        waiting = why_waiting(self.id) if why_waiting is not None else None
        return waiting if waiting is not None else meta["result"]

    def get(self, timeout=None, propagate=True, interval=0.5, **kwargs):
        """Celery's `get` (same arguments), which also ends when Vigil's record ends: returns
        the result, or raises (propagate) / returns the request's VigilError; raises
        TerminalError `request_lost` when Redis has no record of the request, and Celery's
        TimeoutError after `timeout` seconds, its message saying where the request waits and
        why (`info`'s summary: no worker serves its pool, its position in the queue, ...)."""
        if self._cache is None:  # stored already: read it without subscribing to its channel
            self.read_if_ready()
        # Celery's on_interval hook fires only once (a vine promise), so wait in slices and
        # look at the record between them.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            piece = RECORD_CHECK_S if left is None else max(0.0, min(RECORD_CHECK_S, left))
            try:
                siblings = self.__dict__.get("_vigil_siblings")
                if siblings is not None and self._cache is None:
                    siblings.wait(self, piece)  # read, not subscribed (module docstring)
                    if self._cache is None:
                        raise CeleryTimeoutError(f"not stored within {piece} s")
                return super().get(timeout=piece, propagate=propagate, interval=interval,
                                   **kwargs)
            except TaskRevokedError:
                # Celery stores REVOKED for a message it dropped (a cancel, an expired message)
                # before Vigil's hook replaces it with the stored outcome: answer with that.
                ended = self._ended_record()
                if ended is None or ended.status == "SUCCEEDED":
                    raise
                err = error_from_record(ended.error_kind, ended.error)
                if propagate:
                    raise err from None
                return err
            except CeleryTimeoutError:
                if left is not None and left <= RECORD_CHECK_S:
                    raise self._timed_out(timeout) from None
            ended = self._ended_record()
            if ended is None:
                continue
            if ended.status == "SUCCEEDED":
                return ended.result
            err = error_from_record(ended.error_kind, ended.error)
            if propagate:
                raise err
            return err

    def read_if_ready(self) -> None:
        """Cache this request's outcome if Celery's result key holds it already: one GET, or,
        for a result of one `generate_many` call, one MGET that also caches the siblings after
        it that have ended (`Siblings`). Celery's own `get` subscribes to the key's channel,
        reads the key and unsubscribes, three round trips per result even when it is there."""
        siblings = self.__dict__.get("_vigil_siblings")
        if siblings is not None:
            siblings.read_from(self)
        else:
            self._get_task_meta()

    def _timed_out(self, timeout: float) -> CeleryTimeoutError:
        """Celery's TimeoutError for a `get` that waited `timeout` s, saying why it waits."""
        why = None
        why_waiting = getattr(self.app, "vigil_why_waiting", None)
        if why_waiting is not None:
            try:
                why = why_waiting(self.id)
            except Exception:  # Redis away too: the plain timeout is all there is to say
                why = None
        detail = f": {why['summary']}" if why and why.get("summary") else ""
        return CeleryTimeoutError(f"request {self.id} did not end within {timeout:g} s{detail}")

    def stream(self, after: int = 0, timeout: float | None = None):
        """The request's tokens as they are generated (docs/api.md, "Token streams"): yields
        chunks `{"offset", "text", "token_ids"}` in order (with `"logprobs"`, their entries,
        when the request asked for them; with `"index"`, the sample, when it asked for n > 1),
        blocking for the next one, from token `after` on (a caller that stopped reading resumes
        with the offset it reached; with n > 1, `after` counts every sample's tokens).
        The last chunk has `"final": True` and the request's `"result"` (also the generator's
        return value); a request that ends failed raises its VigilError after the chunks made
        before. A chunk with `"restart": True` (offset 0) says the tokens before were thrown
        away (a resume was refused and the request started again from its prompt). Works from
        any process that knows the request id. Raises TerminalError `request_lost` for an id
        Redis has no record of (unknown, or expired after VIGIL_RESULT_TTL), and Celery's
        TimeoutError after `timeout` seconds without the end."""
        metrics.stream_read()
        streams = self.app.vigil_streams
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor = StreamCursor(after)
        last_id = "0-0"
        block_ms = max(10, int(1000 * min(STREAM_BLOCK_S, _socket_timeout(streams) / 2)))
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError(f"request {self.id} did not end within {timeout:g} s")
            try:
                entries = streams.wait(self.id, last_id, block_ms)
            except TransientError:  # Redis away: wait for it, as get() does
                time.sleep(STREAM_BLOCK_S)
                continue
            ended = False
            for e in entries:
                last_id = e.entry_id
                ended = ended or bool(e.end)
                yield from cursor.take_all(e)
            if entries and not ended:
                continue
            outcome = self._outcome_now()
            if outcome is None:
                continue
            for e in streams.entries(self.id, last_id):  # written before the end
                yield from cursor.take_all(e)
            if outcome.status != "SUCCEEDED":
                raise error_from_record(outcome.error_kind, outcome.error)
            finals = cursor.finals(outcome.result or {})
            yield from finals
            return finals[-1]["result"]

    def _outcome_now(self) -> Outcome | None:
        """The request's outcome if it has ended (from the record, else the result backend);
        None while it runs. Raises request_lost for an id without record or result."""
        ended = self._ended_record()
        if ended is not None or not self.ready():
            return ended
        value = super().get(timeout=1.0, propagate=False)
        if isinstance(value, BaseException):
            raise value
        return Outcome("SUCCEEDED", value, "", "")

    def _ended_record(self) -> Outcome | None:
        """The record's outcome once it ended (the backend may never get it); None while it runs
        or Redis cannot be asked. Raises TerminalError request_lost when there is neither a
        record nor a result."""
        store = getattr(self.app, "vigil_store", None)
        if store is None:
            return None
        try:
            status, job, outcome = store.look(self.id)
            if job and outcome is None and status is not None:
                _renew_lease(store, job)
        except TransientError:
            return None  # Redis is away: keep waiting, Celery reconnects and so does this check
        if status is None:
            # Read the backend after the record: a result stored just before its record expired
            # must not be called lost.
            if self.backend.get_task_meta(self.id).get("status") in states.READY_STATES:
                return None
            self.backend.remove_pending_result(self)  # nothing will come: stop listening
            raise TerminalError.of(REQUEST_LOST, f"Redis has no record of request {self.id} "
                                   "(lost by a Redis crash inside the AOF fsync window, or "
                                   "expired after VIGIL_RESULT_TTL); submitting it again is safe")
        if outcome is None:
            return None
        self.backend.remove_pending_result(self)
        return outcome


class Siblings:
    """The results one `generate_many` call handed out, in order (`link`): reading one that is
    not cached reads the Celery result keys of it and of up to SIBLINGS_READ - 1 uncached
    siblings after it in one MGET, and caches every one that holds an outcome. So a caller
    that collects in order (`[r.get() for r in rs]`) pays a round trip per SIBLINGS_READ
    finished results, where Celery's `get` pays three per result. A result that such a read
    found not stored is read again alone while its `get()` waits: its siblings after it,
    mostly sent later, are read once it has ended (every poll of 64 keys read 9 of every 10 of
    them in vain in the short-request bench: docs/performance.md, "The eighth pass")."""

    def __init__(self, results: list):
        self._results = results
        self._at = {r.id: i for i, r in enumerate(results)}
        self._keys: list = [None] * len(results)  # each result key, built once, when first read
        self._missed: set[int] = set()  # results a read found not stored

    @classmethod
    def link(cls, results: list) -> list:
        """Make `results` (VigilAsyncResults; others are left alone) siblings; returns them."""
        mine = [r for r in results if isinstance(r, VigilAsyncResult)]
        if len(mine) > 1:
            siblings = cls(mine)
            for r in mine:
                r.__dict__["_vigil_siblings"] = siblings
        return results

    def wait(self, result: "VigilAsyncResult", seconds: float) -> None:
        """Read `result` (and its siblings, `read_from`) until it is cached or `seconds` have
        passed, pausing between reads as POLL_MIN_S / POLL_MAX_S say; a read Redis does not
        answer is a read that found nothing."""
        start = time.monotonic()
        while True:
            try:
                self.read_from(result)
            except result.backend.connection_errors:
                pass  # Redis is away: keep waiting, as Celery's own wait does
            waited = time.monotonic() - start
            if result._cache is not None or waited >= seconds:
                return
            time.sleep(min(max(POLL_MIN_S, waited / 20), POLL_MAX_S, seconds - waited))

    def read_from(self, result: "VigilAsyncResult") -> None:
        """Cache the outcome of `result` and, unless a read found `result` not stored before,
        of the uncached siblings after it, where stored (class docstring)."""
        start = self._at.get(result.id)
        if start is None:
            result._get_task_meta()
            return
        batch, results = [start], self._results
        if start not in self._missed:
            for i in range(start + 1, len(results)):
                if len(batch) >= SIBLINGS_READ:
                    break
                if results[i]._cache is None:
                    batch.append(i)
        backend = result.backend
        values = backend.mget([self._key(i) for i in batch])
        for i, value in zip(batch, values):
            if value:
                results[i]._maybe_set_cache(decode_stored(backend, value))
        if result._cache is None:
            self._missed.add(start)

    def _key(self, i: int):
        """The Celery result key of result `i`."""
        key = self._keys[i]
        if key is None:
            r = self._results[i]
            key = self._keys[i] = r.backend.get_key_for_task(r.id)
        return key


# What marks a value kombu's JSON encoder wrapped (a datetime, bytes, a UUID, ...): a dict whose
# keys are "__type__" and "__value__", undone by kombu's decoding hook.
KOMBU_ENVELOPE = b'"__type__"'


def decode_stored(backend, value: bytes) -> dict:
    """Celery's `decode_result` of a stored result key's value, read faster: a JSON object that
    holds no kombu envelope (KOMBU_ENVELOPE appears nowhere in it) is parsed by the json
    module's C decoder alone, which gives what kombu's decoding gives it (that builds a decoder
    and calls a Python hook for every dict: 37% of a collector's CPU in the short-request
    bench, docs/performance.md "The twelfth pass"); anything else (an envelope, a compressed
    value, a backend not on JSON) goes through Celery's own decoding. Celery's meta handling
    (an exception's rebuild) is applied either way; its accept check is not, and need not be:
    the fast path takes JSON only, which Vigil's app accepts (`result_accept_content`)."""
    if (value[:1] == b"{" and KOMBU_ENVELOPE not in value
            and backend.content_type == "application/json"):
        return backend.meta_from_decoded(json.loads(value))
    return backend.decode_result(value)


def _socket_timeout(streams) -> float:
    """The read timeout of the streams' Redis client (a blocking read must end before it)."""
    return streams.socket_timeout(2 * STREAM_BLOCK_S)


def _renew_lease(store: RequestStore, job: str) -> None:
    """Renew `job`'s lease if this process has not done so for LEASE_TOUCH_S."""
    if job == DEFAULT_JOB:
        return
    now = time.monotonic()
    with _touched_lock:
        if now - _touched.get(job, -LEASE_TOUCH_S) < LEASE_TOUCH_S:
            return
        _touched[job] = now
    store.jobs.touch(job)
