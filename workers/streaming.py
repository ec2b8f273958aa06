"""The worker's side of token streams (app/state/streams.py): one tap per running attempt, one
flusher thread per worker.

The engine feeds a request's tap on its loop thread as tokens come out (`add`: token ids and the
text released with them; workers/engine/stream_watch.py reads them out of vLLM every 100 ms at
most). The flusher thread (workers/stream_sink.py) writes every tap's unwritten tokens as one
chunk per request, all of them in one pipelined round trip, every `flush_ms`, or as soon as a
request has `chunk_tokens` unwritten; never one write per request per token. The last tokens
of a request that ends are not written: its result carries them (a reader takes the rest from
the result). A tap is also the request's checkpoint within its attempt: an engine that re-runs it (after an
engine death) continues from everything the tap holds.

A tap has at most one chunk in flight (a hand-back's flush and the flusher never send the same
tokens twice), and a reply that comes back after the tap restarted its stream (a refused resume:
a new generation) is ignored.

A `live` request's tap (its reader shows tokens as they come: the online API's streams) is fed
after every engine step (workers/engine/stream_watch.py) and wakes the flusher for every new
token: each step's tokens are one chunk, written and published to live readers at once
(app/state/streams.py), stamped with the step's time.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from app import metrics
from app.state.streams import APPENDED, FENCED, Checkpoint, Chunk, Part

log = logging.getLogger("vigil.streams")


class Flusher(Protocol):
    """What a tap needs of the worker's flusher (workers/stream_sink.py `StreamSink`)."""

    flush_s: float
    chunk_tokens: int

    def wake(self) -> None:
        """A tap has a chunk due: flush now rather than at the next interval."""


class _Seq:
    """One sample's tokens in a tap: all of them, and those not written yet."""

    def __init__(self, prior: Checkpoint | None = None):
        self.token_ids: list[int] = list(prior.token_ids) if prior else []
        self.text: str = prior.text if prior else ""
        self.logprobs: list[dict] | None = list(prior.logprobs) if prior and \
            prior.logprobs is not None else None
        self.resumed_at: list[int] = list(prior.resumed_at) if prior else []
        self.written = len(self.token_ids)  # tokens of this sample in Redis' stream
        self.pending_text: list[str] = []
        self.pending_chars: list[int] = []

    def unwritten(self) -> int:
        return len(self.token_ids) - self.written

    def part(self, index: int) -> Part:
        """The unwritten tokens as a chunk's part."""
        return Part(index, self.written, self.token_ids[self.written:],
                    "".join(self.pending_text), list(self.pending_chars),
                    self.logprobs[self.written:] if self.logprobs is not None else None)

    def written_up_to(self, part: Part) -> None:
        """`part` is in Redis: what came in while it was in flight stays pending."""
        self.written = part.start + len(part.token_ids)
        joined = "".join(self.pending_text)[len(part.text):]
        self.pending_text = [joined] if joined else []
        self.pending_chars = self.pending_chars[len(part.token_ids):]


class StreamTap:
    """One attempt's view of its request's stream: what is already in it (from earlier
    attempts: `prior`), what this attempt added, and what is not written yet; one sequence per
    sample (`samples` > 1: a request with n samples), each with its logprob entries when the
    request asked for them."""

    def __init__(self, sink: Flusher | None, request_id: str, token: str, attempt: int,
                 pool: str, prior: Checkpoint | None = None, adapter_fingerprint: str = "",
                 samples: int = 1, live: bool = False):
        self._sink = sink
        self.live = live  # every step's tokens written (and published) at once
        self._made_at: float | None = None  # the step time of the newest token (live taps)
        self.request_id, self.token, self.attempt, self.pool = request_id, token, attempt, pool
        self.adapter_fingerprint = adapter_fingerprint
        self.samples = samples
        # The adapter the tokens so far were made with (a resume compares it with today's).
        self._made_with = prior.adapter_fingerprint if prior else adapter_fingerprint
        self._lock = threading.Lock()
        self.prompt_ids: list[int] | None = prior.prompt_ids if prior else None
        self._seqs = [_Seq(prior.sample(i) if prior else None) for i in range(samples)]
        self._reset = False  # the stream must restart at token 0 (a refused resume)
        self._generation = 0
        self._in_flight = False
        self._pending_since: float | None = None
        self.dead = False  # fenced: this claim no longer runs the request

    @property
    def token_ids(self) -> list[int]:
        """Sample 0's tokens so far."""
        return self._seqs[0].token_ids

    @property
    def text(self) -> str:
        """Sample 0's text so far."""
        return self._seqs[0].text

    @property
    def resumed_at(self) -> list[int]:
        """Sample 0's takeover offsets."""
        return self._seqs[0].resumed_at

    def resumed_at_of(self, index: int) -> list[int]:
        """Sample `index`'s takeover offsets."""
        return list(self._seqs[index].resumed_at)

    @property
    def written(self) -> int:
        """Tokens in Redis' stream, every sample's."""
        return sum(q.written for q in self._seqs)

    # -- the engine's side (its loop thread) ---------------------------------------------------
    @property
    def watch_period(self) -> float:
        """How often the engine reads this request's progress (workers/engine/stream_watch.py):
        a quarter of the flush interval, between 20 and 100 ms (a full chunk is noticed, and
        written, within that)."""
        flush_s = self._sink.flush_s if self._sink is not None else 0.2
        return max(0.02, min(flush_s / 4, 0.1))

    def resume_point(self) -> Checkpoint | None:
        """Where a run of this request continues: every token made so far (by earlier attempts
        and by this one), None when there is none."""
        with self._lock:
            if not any(q.token_ids for q in self._seqs):
                return None
            cps = [Checkpoint(self.prompt_ids, list(q.token_ids), q.text, self._made_with,
                              list(q.resumed_at),
                              list(q.logprobs) if q.logprobs is not None else None)
                   for q in self._seqs]
            if self.samples == 1:
                return cps[0]
            first = cps[0]
            return Checkpoint(first.prompt_ids, first.token_ids, first.text, self._made_with,
                              first.resumed_at, first.logprobs, cps)

    def refuse_resume(self, why: str) -> None:
        """The tokens so far cannot be continued: they are thrown away and the stream restarts
        from token 0 (its next chunk says so) with this attempt's run from the prompt."""
        with self._lock:
            lost = sum(len(q.token_ids) for q in self._seqs)
            log.warning("request %s: not resuming from its %d generated tokens: %s",
                        self.request_id, lost, why)
            metrics.tokens_discarded(self.pool, lost)
            self._seqs = [_Seq() for _ in range(self.samples)]
            for q in self._seqs:
                q.written = 0
            self.prompt_ids = None
            self._pending_since = time.monotonic()  # the restart itself is due: readers wait
            self._reset = True
            self._generation += 1  # a reply to an older chunk no longer applies
            self._made_with = self.adapter_fingerprint

    def took_over(self) -> None:
        """This run continues the tokens so far (counted; each sample's offset goes in its
        `resumed_at`)."""
        with self._lock:
            metrics.tokens_resumed(self.pool, sum(len(q.token_ids) for q in self._seqs))
            for q in self._seqs:
                if q.token_ids:
                    q.resumed_at.append(len(q.token_ids))

    def set_prompt(self, prompt_ids: list[int]) -> None:
        """The prompt's token ids, as the engine read them (the stream's first chunk keeps
        them: a resume continues after them)."""
        with self._lock:
            if self.prompt_ids is None:
                self.prompt_ids = list(prompt_ids)

    def add(self, token_ids: list[int], text: str, char_counts: list[int] | None = None, *,
            index: int = 0, logprobs: list[dict] | None = None,
            made_at: float | None = None) -> None:
        """Tokens sample `index` generated and the text released with them (whole
        characters); `char_counts[i]` is how many of the characters came with token i
        (default: all with the last); `logprobs` their entries, when the request asked;
        `made_at` the wall time of the engine step that made them (a live tap's chunks carry
        it)."""
        if not token_ids:
            return
        counts = char_counts or [0] * (len(token_ids) - 1) + [len(text)]
        with self._lock:
            q = self._seqs[index]
            q.token_ids += token_ids
            q.text += text
            if logprobs is not None:
                q.logprobs = (q.logprobs or []) + list(logprobs)
            q.pending_text.append(text)
            q.pending_chars += counts
            if self._pending_since is None:
                self._pending_since = time.monotonic()
            if made_at is not None:
                self._made_at = made_at
            due = sum(x.unwritten() for x in self._seqs) >= (
                self._threshold(self._sink.chunk_tokens) if self._sink else 1 << 30)
        if due and self._sink is not None:
            self._sink.wake()

    def _threshold(self, chunk_tokens: int) -> int:
        """Unwritten tokens that make a chunk due at once: one for a live tap."""
        return 1 if self.live else chunk_tokens

    # -- the flusher's side ---------------------------------------------------------------------
    def take_chunk(self, now: float, flush_s: float, chunk_tokens: int,
                   force: bool = False) -> Chunk | None:
        """The unwritten tokens as a chunk, if they are due (or `force`) and no other chunk of
        this tap is in flight; None otherwise. The caller must answer with `chunk_written`."""
        with self._lock:
            n = sum(q.unwritten() for q in self._seqs)
            if self.dead or self._in_flight or (n <= 0 and not self._reset) \
                    or self._pending_since is None:
                return None
            if not force and n < self._threshold(chunk_tokens) and \
                    now - self._pending_since < flush_s:
                return None
            written = sum(q.written for q in self._seqs)
            first = written == 0
            self._in_flight = True
            meta = dict(reset=self._reset and first,
                        prompt_ids=self.prompt_ids if first else None,
                        adapter_fingerprint=self._made_with if first else "",
                        generation=self._generation, live=self.live,
                        made_at=self._made_at if self.live else None)
            if self.samples == 1:
                p = self._seqs[0].part(0)
                return Chunk(self.request_id, self.token, self.attempt, written, p.token_ids,
                             p.text, p.char_counts, logprobs=p.logprobs, **meta)
            parts = [q.part(i) for i, q in enumerate(self._seqs) if q.unwritten()]
            return Chunk(self.request_id, self.token, self.attempt, written, [], "", [],
                         parts=parts, **meta)

    def chunk_written(self, chunk: Chunk, reply: int | None) -> None:
        """The answer for `chunk`: written, fenced, off sequence, or None (not written: sent
        again with the next flush)."""
        with self._lock:
            self._in_flight = False
            if chunk.generation != self._generation:  # the stream restarted meanwhile
                return
            if reply is None:
                return
            if reply == APPENDED:
                self._reset = False
                for p in chunk.parts if chunk.parts is not None else [Part(
                        0, chunk.start, chunk.token_ids, chunk.text, chunk.char_counts)]:
                    self._seqs[p.index].written_up_to(p)
                pending = any(q.pending_chars for q in self._seqs)
                self._pending_since = time.monotonic() if pending else None
                return
            self.dead = True
            if reply != FENCED:
                log.warning("request %s: its stream does not end at token %d; no more chunks "
                            "from this attempt", self.request_id, chunk.start)

    def restart_unwritten(self) -> bool:
        """A restart of the stream (a refused resume) is not in Redis yet."""
        with self._lock:
            return self._reset and not self.dead

    def unwritten(self) -> int:
        """Tokens this tap holds that are not in Redis' stream."""
        with self._lock:
            return sum(q.unwritten() for q in self._seqs)
