"""Token streams: each request's generated tokens in Redis as they are made (docs/api.md,
"Token streams"), the checkpoint a later attempt resumes from.

One Redis stream per request (`vigil:stream:{id}`, app/state/keys.py). Its entries, oldest first:

- a **chunk**: `o` (the offset, in tokens, of its first token), `n` (how many tokens), `ids`
  (JSON list of the token ids), `t` (the text released with them: whole characters, never a
  broken UTF-8 sequence), `tc` (JSON list: how many of those characters came with each token),
  `a` (the attempt that generated it), and `lp` (JSON list of the tokens' logprob entries,
  workers/engine/logprobs.py) when the request asked for logprobs; the stream's first chunk
  also carries `p` (JSON list of the prompt's token ids, which a resume continues after) and,
  for a LoRA request, `lf` (the adapter's files' fingerprint when the tokens were made);
- a **chunk of several samples** (a request with `n` > 1): `o` and `n` count the tokens of every
  sample together (the fence's offset), `ids`, `t` and `tc` are empty, and `s` is a JSON list of
  parts, one per sample with new tokens: {"i": the sample's index, "o": its offset in that
  sample, "ids", "t", "tc", and "lp" with logprobs};
- `r` = 1 on a chunk: the stream restarts from token 0 here (a resume was refused, so an
  attempt started again from the prompt);
- `w` on a chunk of a `live` request: the wall-clock time (Unix seconds) of the engine step that
  made its last token, as EngineCore stamped it (what a live reader's delay is measured from);
- an **end** entry (`end` = the final status), written by the finish script (app/state/lua_records.py),
  which also gives the stream the result's TTL.

Only the claim that runs the request appends (STREAM_APPEND is fenced by the record's begin
token), so the stream is exactly what was generated, once, in order. Every append of a worker's flush is one
pipelined EVALSHA: one round trip for all the requests it has in flight.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis

from app.state import keys
from app.state.calls import Calls
from app.state.lua_outputs import STREAM_APPEND

APPENDED, FENCED, OFF_SEQUENCE = 1, 0, -1


@dataclass
class Part:
    """One sample's tokens in a chunk of several samples: from token `start` of sample `index`."""

    index: int
    start: int
    token_ids: list[int]
    text: str
    char_counts: list[int]
    logprobs: list[dict] | None = None

    def wire(self) -> dict:
        """The part as the chunk's `s` list holds it."""
        out = {"i": self.index, "o": self.start, "ids": self.token_ids, "t": self.text,
               "tc": self.char_counts}
        if self.logprobs is not None:
            out["lp"] = self.logprobs
        return out

    @classmethod
    def of(cls, raw: dict) -> "Part":
        return cls(int(raw["i"]), int(raw["o"]), list(raw["ids"]), raw["t"], list(raw["tc"]),
                   raw.get("lp"))


@dataclass
class Chunk:
    """One chunk to append: `token_ids` from token `start`, their text and per-token char counts,
    written under the claim `token` (the record's begin token) by attempt `attempt`."""

    request_id: str
    token: str
    attempt: int
    start: int
    token_ids: list[int]
    text: str
    char_counts: list[int]
    reset: bool = False
    prompt_ids: list[int] | None = None
    adapter_fingerprint: str = ""
    generation: int = 0  # the writer's run generation (a refused resume starts a new one)
    logprobs: list[dict] | None = None  # one entry per token, when the request asked for them
    parts: list[Part] | None = None  # a chunk of several samples (then token_ids is empty)
    live: bool = False  # also published on the request's live channel
    made_at: float | None = None  # `w`: the wall time of the step that made its last token

    @property
    def tokens(self) -> int:
        """Tokens in the chunk, every sample's."""
        if self.parts is None:
            return len(self.token_ids)
        return sum(len(p.token_ids) for p in self.parts)

    @property
    def signature(self) -> str:
        """What identifies this append (a retried pipeline finds it already done)."""
        return (f"{self.token}:{self.generation}:{self.start}:{self.tokens}:"
                f"{int(self.reset)}")

    def fields(self) -> list:
        """The stream entry's field/value pairs."""
        f = ["o", self.start, "n", self.tokens, "ids", json.dumps(self.token_ids),
             "t", self.text, "tc", json.dumps(self.char_counts), "a", self.attempt]
        if self.logprobs is not None:
            f += ["lp", json.dumps(self.logprobs)]
        if self.parts is not None:
            f += ["s", json.dumps([p.wire() for p in self.parts])]
        if self.reset:
            f += ["r", 1]
        if self.prompt_ids is not None:
            f += ["p", json.dumps(self.prompt_ids)]
        if self.adapter_fingerprint:
            f += ["lf", self.adapter_fingerprint]
        if self.made_at is not None:
            f += ["w", f"{self.made_at:.4f}"]
        return f


@dataclass
class Entry:
    """One entry as read back: a chunk (`end` empty) or the end marker (`end` = final status)."""

    entry_id: str
    start: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    char_counts: list[int] = field(default_factory=list)
    attempt: int = 0
    reset: bool = False
    prompt_ids: list[int] | None = None
    adapter_fingerprint: str = ""
    end: str = ""
    logprobs: list[dict] | None = None
    parts: list[Part] | None = None  # a chunk of several samples
    made_at: float | None = None  # `w` (live requests' chunks)

    def sample_parts(self) -> list[Part]:
        """The entry's tokens as parts (a chunk of one sample: one part, sample 0)."""
        if self.parts is not None:
            return self.parts
        return [Part(0, self.start, self.token_ids, self.text, self.char_counts, self.logprobs)]


def parse_entry(entry_id, raw: dict) -> Entry:
    """A stream entry from Redis' reply (bytes keys and values)."""
    f = {k.decode(): v.decode() for k, v in raw.items()}
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return entry_of(eid, f)


def parse_published(message: bytes | str) -> Entry:
    """An entry as a live channel carries it (STREAM_APPEND: JSON [entry id, field, value,
    ...]); ValueError for anything else."""
    raw = json.loads(message)
    if not isinstance(raw, list) or len(raw) % 2 != 1 or not all(
            isinstance(x, str) for x in raw):
        raise ValueError("not a published stream entry")
    return entry_of(raw[0], dict(zip(raw[1::2], raw[2::2])))


def entry_of(eid: str, f: dict[str, str]) -> Entry:
    """An entry from its id and its fields (str keys and values)."""
    if "end" in f:
        return Entry(eid, end=f["end"])
    return Entry(eid, start=int(f["o"]), token_ids=json.loads(f["ids"]), text=f["t"],
                 char_counts=json.loads(f["tc"]), attempt=int(f.get("a", 0)),
                 reset=f.get("r") == "1",
                 prompt_ids=json.loads(f["p"]) if "p" in f else None,
                 adapter_fingerprint=f.get("lf", ""),
                 logprobs=json.loads(f["lp"]) if "lp" in f else None,
                 parts=[Part.of(p) for p in json.loads(f["s"])] if "s" in f else None,
                 made_at=float(f["w"]) if "w" in f else None)


@dataclass
class Checkpoint:
    """What a request's stream holds since its last restart: where a later attempt resumes.
    The fields are sample 0's; a stream of several samples also lists every sample's own
    checkpoint in `samples` (index order; the prompt and fingerprint are shared)."""

    prompt_ids: list[int] | None
    token_ids: list[int]
    text: str
    adapter_fingerprint: str
    resumed_at: list[int]  # token offsets where an attempt took over and continued the stream
    logprobs: list[dict] | None = None  # one entry per token, when the request asked for them
    samples: list["Checkpoint"] | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def sample(self, index: int) -> "Checkpoint":
        """Sample `index`'s checkpoint (empty when it streamed nothing)."""
        if self.samples is None:
            return self if index == 0 else Checkpoint(self.prompt_ids, [], "",
                                                      self.adapter_fingerprint, [])
        if index < len(self.samples):
            return self.samples[index]
        return Checkpoint(self.prompt_ids, [], "", self.adapter_fingerprint, [])

    @property
    def total(self) -> int:
        """Tokens of every sample."""
        return sum(c.tokens for c in self.samples) if self.samples is not None else self.tokens


class _Seq:
    """One sample's tokens while a checkpoint is read."""

    def __init__(self):
        self.ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[dict] | None = None
        self.resumed: list[int] = []

    def add(self, p: Part) -> None:
        self.ids += p.token_ids
        self.text.append(p.text)
        if p.logprobs is not None:
            self.logprobs = (self.logprobs or []) + p.logprobs


def checkpoint_of(entries: list[Entry]) -> Checkpoint | None:
    """The checkpoint the entries (oldest first) make; None when they hold no token."""
    seqs: dict[int, _Seq] = {}
    total = 0
    prompt, fp, last_attempt, multi = None, "", None, False
    for e in entries:
        if e.end:
            continue
        if e.reset or e.start == 0:
            seqs, total, last_attempt = {}, 0, None
            prompt, fp = e.prompt_ids, e.adapter_fingerprint
        if e.start != total:  # never written so (the append is fenced); stop trusting it
            break
        parts = e.sample_parts()
        if any(p.start != len(seqs.get(p.index, _Seq()).ids) for p in parts):
            break
        multi = multi or e.parts is not None
        if last_attempt is not None and e.attempt != last_attempt:
            for seq in seqs.values():
                if seq.ids:
                    seq.resumed.append(len(seq.ids))
        last_attempt = e.attempt
        for p in parts:
            seqs.setdefault(p.index, _Seq()).add(p)
            total += len(p.token_ids)
    if not total:
        return None
    cps = [Checkpoint(prompt, s.ids, "".join(s.text), fp, s.resumed, s.logprobs)
           for s in (seqs.get(i, _Seq()) for i in range(max(seqs) + 1))]
    if not multi:
        return cps[0]
    first = cps[0]
    return Checkpoint(first.prompt_ids, first.token_ids, first.text, fp, first.resumed_at,
                      first.logprobs, cps)


class TokenStreams:
    """Appends to and reads the token streams. Raises TransientError(redis_unavailable) when
    Redis cannot be reached (through `Calls`)."""

    def __init__(self, client: redis.Redis, calls: Calls | None = None):
        self.r = client
        self._call = calls or Calls(client)
        self._sha: str | None = None

    def append_many(self, chunks: list[Chunk]) -> list[int | None]:
        """Append every chunk in one round trip (a pipeline of fenced appends); returns per chunk
        APPENDED, FENCED (its claim no longer runs the request), OFF_SEQUENCE, or None when that
        one append failed (Redis refused it: the chunk stays to be sent again). Raises
        TransientError(redis_unavailable) when Redis cannot be reached at all."""
        if not chunks:
            return []
        replies = self._append(chunks)
        if any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            self._sha = None  # Redis restarted and lost its script cache
            replies = self._append(chunks)
        return [int(r) if not isinstance(r, Exception) else None for r in replies]

    def _append(self, chunks: list[Chunk]) -> list:
        if self._sha is None:
            self._sha = self._call(self.r.script_load, STREAM_APPEND)
        pipe = self.r.pipeline(transaction=False)
        for c in chunks:
            ks = [keys.request(c.request_id), keys.stream(c.request_id)]
            if c.live:
                ks.append(keys.live(c.request_id))
            pipe.evalsha(self._sha, len(ks), *ks, c.token, c.start, "1" if c.reset else "0",
                         c.signature, *c.fields())
        return self._call(pipe.execute, raise_on_error=False)

    def entries(self, request_id: str, after: str = "-", count: int | None = None) -> list[Entry]:
        """The stream's entries after entry id `after` (exclusive; "-" from the start)."""
        start = after if after == "-" else "(" + after
        raw = self._call(self.r.xrange, keys.stream(request_id), start, "+", count)
        return [parse_entry(i, f) for i, f in raw]

    def socket_timeout(self, default: float) -> float:
        """The read timeout of this client's connections (`default` when it has none): a
        blocking read of the stream must end before it."""
        kwargs = getattr(self.r.connection_pool, "connection_kwargs", {})
        return float(kwargs.get("socket_timeout") or default)

    def wait(self, request_id: str, after: str, block_ms: int) -> list[Entry]:
        """Entries after `after` ("0-0": from the start), blocking up to `block_ms` for the next
        ones; [] when none came."""
        # BLOCK 0 would wait for ever: a non-positive wait is a plain read.
        raw = self._call(self.r.xread, {keys.stream(request_id): after},
                         block=block_ms if block_ms > 0 else None)
        return [parse_entry(i, f) for _, items in raw or () for i, f in items]

    def exists(self, request_id: str) -> bool:
        """Whether the request has a stream at all."""
        return bool(self._call(self.r.exists, keys.stream(request_id)))

    def checkpoint(self, request_id: str) -> Checkpoint | None:
        """Where a new attempt of the request resumes (None: nothing was generated)."""
        return checkpoint_of(self.entries(request_id))
