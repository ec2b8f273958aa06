"""An online API call: its id, the Vigil requests it made (one per prompt), and a stream's
position in it, which every SSE event carries as its `id:` (docs/api.md, "How a stream
continues").

A position says, for each prompt of the call, how far its client has read: -1 nothing, 0 its
opening (chat's role delta, a completion's echoed prompt), N the stream's first N tokens (every
sample's, in stream order: the offset `VigilAsyncResult.stream(after=N)` takes), `d` its end
(every choice's finish_reason); and `u` once the usage chunk went out. An event id is
`<call id>/<positions>`, e.g. `cmpl-5f0c.../17` or `cmpl-5f0c.../d,42;u`: a client that
reconnects with it as `Last-Event-ID` (to any gateway) gets exactly the events after it.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from app.errors import INVALID_REQUEST, RequestError
from app.online.fields import CHAT

DONE = "d"
MAX_ID = 256


def call_prefix(kind: str) -> str:
    """The response id's prefix, as vLLM's: chatcmpl- or cmpl-."""
    return "chatcmpl-" if kind == CHAT else "cmpl-"


def new_base(client_id: str | None) -> str:
    """The base of a call's ids: the client's request id (X-Request-Id, or the body's
    `request_id`: the same id again is the same call) or a new one."""
    if client_id is None:
        return uuid.uuid4().hex
    if not client_id or len(client_id) > 128 or not all(
            c.isalnum() or c in "-_.:" for c in client_id):
        raise RequestError.of(INVALID_REQUEST, "a request id is 1-128 letters, digits, '-', "
                              "'_', '.' or ':'")
    return client_id


def request_ids(base: str, prompts: int) -> list[str]:
    """The Vigil request id of each prompt: the base itself for one prompt, `<base>-<i>` for
    several."""
    return [base] if prompts == 1 else [f"{base}-{i}" for i in range(prompts)]


@dataclass
class Position:
    """How far a client has read a call (module docstring)."""

    prompts: list[int | str]
    usage_sent: bool = False

    @classmethod
    def start(cls, prompts: int) -> "Position":
        return cls([-1] * prompts)

    def encode(self, call_id: str) -> str:
        """The event id for this position."""
        body = ",".join(str(p) for p in self.prompts) + (";u" if self.usage_sent else "")
        return f"{call_id}/{body}"

    def done(self, p: int) -> bool:
        return self.prompts[p] == DONE

    def tokens(self, p: int) -> int:
        """Tokens of prompt `p` the client has (its cursor's `after`)."""
        at = self.prompts[p]
        return 0 if at == DONE or at < 0 else at


@dataclass
class Resume:
    """A reconnect: the call it names and where its client stopped."""

    call_id: str
    position: Position | None = field(default=None)


def parse_event_id(value: str) -> Resume:
    """A `Last-Event-ID` (or `after` query) as (call id, position); RequestError
    (invalid_request) when it is not one this API wrote."""
    if not value or len(value) > MAX_ID + 4096:
        raise RequestError.of(INVALID_REQUEST, "Last-Event-ID is not an event id of this API")
    call_id, sep, body = value.partition("/")
    if not sep:
        return Resume(call_id)  # a call id alone: from its start
    body, _, flags = body.partition(";")
    try:
        prompts = [p if p == DONE else int(p) for p in body.split(",")]
    except ValueError:
        raise RequestError.of(INVALID_REQUEST, "Last-Event-ID is not an event id of this API"
                              ) from None
    if any(p != DONE and p < -1 for p in prompts):
        raise RequestError.of(INVALID_REQUEST, "Last-Event-ID is not an event id of this API")
    return Resume(call_id, Position(prompts, usage_sent=flags == "u"))
