"""The worker's guard against messages that bypass the producer (docs/architecture.md,
"Serve").

Celery builds a task request from a message's headers and body before any task code runs, and
an exception there is not one it expects: it escapes the consumer's event loop and the worker
exits ("Unrecoverable error"). Worse, kombu's Redis channel puts the unacked message back on the
queue as the worker stops, so the next worker to take it dies too: one raw `LPUSH` of
`[[], 1]`-shaped JSON crash-loops a whole pool (measured here before this guard). So:

- `VigilConsumer` (Celery's `worker_consumer`) checks every task message's shape before Celery
  sees it, and drops (rejects, not requeued) one it cannot serve, with an ERROR log line naming
  the message id and why, never its body (user data). A `vigil.generate` message with a usable
  id also gets its typed end: the record and the Celery result say
  `invalid_request: malformed message: ...`, so a waiting `r.get()` raises it. Anything
  Celery's own handling still raises for one message is treated the same way; connection errors
  are not (Celery reconnects).
- Vigil's kombu channel (app/state/transport.py, the one place kombu's channel is changed) drops
  a queue entry that is not a kombu message envelope at all (not JSON, not a mapping) instead of
  raising out of the event loop.

Content types other than JSON never reach the task: Celery refuses them (accept_content) and
drops the message unexecuted (`Received invalid task message: Refusing to deserialize untrusted
content of type pickle`).
"""
from __future__ import annotations

import logging

from celery.worker.consumer import Consumer
from vine import promise

from app.errors import INVALID_REQUEST, RequestError
from app.fleet.outcomes import end_request
from app.task_names import GENERATE, GENERATE_MANY
from workers import runtime

log = logging.getLogger("vigil.consumer")

_EMBED_KEYS = ("callbacks", "errbacks", "chain", "chord")


def malformed(message) -> str | None:
    """Why a task message cannot become a Celery request, or None when Celery may take it.

    Protocol 2 only (Vigil never sends protocol 1): headers a mapping with non-empty string `id`
    and `task`; `retries` absent or an int >= 0; `timelimit` absent or two numbers-or-None; a JSON
    body `[args (list), kwargs (mapping), embed (mapping or null)]`, no args for vigil.generate,
    no callbacks, errbacks, chain or chord (Vigil uses none: a message carrying them would chain
    other tasks). A body in another content type is left to Celery, which refuses it
    (accept_content)."""
    headers = message.headers
    if not isinstance(headers, dict):
        return "headers are not a mapping"
    for name in ("id", "task"):
        v = headers.get(name)
        if not isinstance(v, str) or not v:
            return f"header {name!r} is not a non-empty string"
    retries = headers.get("retries")
    if retries is not None and (type(retries) is not int or retries < 0):
        return "header 'retries' is not an int >= 0"
    limits = headers.get("timelimit")
    if limits is not None and not (
            isinstance(limits, list) and len(limits) == 2
            and all(x is None or (type(x) in (int, float)) for x in limits)):
        return "header 'timelimit' is not [hard, soft]"
    if message.content_type != "application/json":
        return None  # Celery refuses it (accept_content) or decodes it itself
    try:
        body = message.payload  # decoded once: Celery reads the same cached value
    except Exception:  # undecodable: Celery's own decode-error path logs and drops it
        return None
    if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], list)
            and isinstance(body[1], dict) and (body[2] is None or isinstance(body[2], dict))):
        return "the body is not [args, kwargs, embed]"
    if headers["task"] == GENERATE and body[0]:
        return "vigil.generate takes keyword arguments only"
    if body[2] and any(body[2].get(k) for k in _EMBED_KEYS):
        return "callbacks, errbacks, chains and chords are not accepted"
    return None


def _end_request(request_id: str, why: str) -> None:
    """Give a dropped vigil.generate message's request its typed end (record + Celery result)."""
    rt = runtime.get_runtime()
    err = RequestError.of(INVALID_REQUEST, f"malformed message: {why}")
    # Celery never ran it, so it stores nothing: the backend gets the stored outcome.
    end_request(rt.store, request_id, error=err, instance=rt.instance_id,
                backend=rt.ports.backend, tell_always=True)


class VigilConsumer(Consumer):
    """Celery's consumer with the message guard in front of its task handler (module doc)."""


    def create_task_handler(self, promise=promise):
        """Celery's handler, behind `malformed` and a drop of what it still cannot handle."""
        handle = super().create_task_handler(promise)
        recoverable = tuple(self.connection_errors) + tuple(self.channel_errors)

        def on_task_received(message):
            why = malformed(message)
            if why is None:
                try:
                    return handle(message)
                except recoverable:
                    raise
                except Exception as exc:  # one message must not stop the worker: drop it
                    why = f"{type(exc).__name__}: {exc}"[:300]
            self._drop(message, why)

        return on_task_received

    def _drop(self, message, why: str) -> None:
        headers = message.headers if isinstance(message.headers, dict) else {}
        rid, task = headers.get("id"), headers.get("task")
        log.error("dropped a malformed task message (id %.80r, task %.80r, %d bytes): %s",
                  rid, task, len(message.body or b""), why)
        if not message.acknowledged:
            message.reject_log_error(log, self.connection_errors)
        ids: list = []
        if task == GENERATE:
            ids = [rid]
        elif task == GENERATE_MANY and isinstance(headers.get("vigil_ids"), list):
            ids = headers["vigil_ids"]  # each request the message carries
        for rid in [i for i in ids if isinstance(i, str) and i and len(i) <= 200]:
            try:
                _end_request(rid, why)
            except Exception as e:  # Redis gone: nothing waits on a raw push but its sender
                log.warning("could not record the end of %.80r: %s", rid, e)
