"""Vigil's one error taxonomy, split by who must act: the request, the fleet, or the worker.

Every error's message starts with its code (`"prompt_too_long: ..."`), so a user who only sees the
string still knows what happened. The classes live here, importable by producers and workers
alike: Celery rebuilds a worker's exception in the producer only if the class imports there
(docs/field-notes.md), so `r.get()` raises these very types.

| class            | whose fault                                | codes                                   |
| ---------------- | ------------------------------------------ | --------------------------------------- |
| RequestError     | the request's: it is wrong as sent         | invalid_request, model_not_found,       |
|                  |                                            | invalid_model_config,                   |
|                  |                                            | lora_adapter_invalid,                   |
|                  |                                            | prompt_too_long, token_out_of_vocab,    |
|                  |                                            | poison_request, unsupported_version     |
| TransientError   | the fleet's, for now: a passing condition  | memory_pressure, allocation_failed,     |
|                  |                                            | engine_restarting, worker_lost, wedged, |
|                  |                                            | redis_unavailable, engine_error,        |
|                  |                                            | lora_adapter_pending, schema_too_new,   |
|                  |                                            | preempted, drained, generation_failed,  |
|                  |                                            | retry_requested,                        |
|                  |                                            | structured_output_invalid;              |
|                  |                                            | overloaded, workers_too_old (raised by  |
|                  |                                            | `.delay` only: the caller retries;      |
|                  |                                            | nothing was sent)                       |
| WorkerFatalError | the worker's: it leaves                    | cuda_context_lost, repeated_engine_death|
|                  |                                            | canary_failed, engine_start_failed      |
| TerminalError    | none: Vigil ended the request itself       | deadline_exceeded, job_deleted,         |
|                  |                                            | attempts_exhausted, cancelled,          |
|                  |                                            | batch_cancelled,                        |
|                  |                                            | batch_expired, request_lost             |
|                  |                                            | (raised by `r.get()`: Redis has no      |
|                  |                                            | record of the request)                  |

What happens to a request after each code (retried or not, how soon, whether it uses an
attempt) is not said here: one table decides it, app/retry_policy.py (`decide`).
tests/test_retry_policy.py checks that this table lists each code under its class.
"""
from __future__ import annotations

# RequestError codes
INVALID_REQUEST = "invalid_request"
MODEL_NOT_FOUND = "model_not_found"
PROMPT_TOO_LONG = "prompt_too_long"
TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
POISON_REQUEST = "poison_request"
INVALID_MODEL_CONFIG = "invalid_model_config"
LORA_ADAPTER_INVALID = "lora_adapter_invalid"
# The message names a schema_version this code does not know: refused, never guessed at.
UNSUPPORTED_VERSION = "unsupported_version"
# TransientError codes
MEMORY_PRESSURE = "memory_pressure"
ALLOCATION_FAILED = "allocation_failed"
ENGINE_RESTARTING = "engine_restarting"
WORKER_LOST = "worker_lost"
WEDGED = "wedged"
REDIS_UNAVAILABLE = "redis_unavailable"
# Backpressure: the job or the pool has as many open requests as its cap allows. Raised by
# `.delay` at once, nothing written or published; the message says when to try again.
OVERLOADED = "overloaded"
# A rolling upgrade: the request needs a schema version that a live worker of its pool, from
# before workers said which versions they read, would fail (`unsupported_version`). Raised by
# `.delay` at once, nothing written or published (app/requests/version_gate.py).
WORKERS_TOO_OLD = "workers_too_old"
# The request's LoRA adapter is still being written: retried without using up an attempt.
LORA_ADAPTER_PENDING = "lora_adapter_pending"
# A bulk request that yielded its batch seat to an interactive request at a token boundary:
# back on its queue at once, resuming from its stream, no attempt used (workers/engine/
# admission.py). Not a failure.
PREEMPTED = "preempted"
# A request whose worker stopped (SIGTERM: a scale-in, a deploy) and handed it back with every
# token it had made: back on its queue at once, resuming from its stream, no attempt used, at
# most VIGIL_MAX_DRAINS times (workers/held.py). Not a failure.
DRAINED = "drained"
# The message names a schema_version newer than this worker reads (a newer producer sent it during
# a rolling upgrade): handed back for a worker that reads it, without using up an attempt.
SCHEMA_TOO_NEW = "schema_too_new"
# An engine failure nobody recognised: retried (bounded) rather than failed for good.
ENGINE_ERROR = "engine_error"
# vLLM (0.33 on) ended the request with an error of its own and stays healthy (its
# GenerationError: e.g. a KV transfer that failed): back on its queue at once, for any worker.
GENERATION_FAILED = "generation_failed"
# vLLM (0.33 on) asked for the request to be tried again (its RetryableRequestError: generation
# paused, a cache miss): re-run on the same engine a few times first (app/retry_policy.py).
RETRY_REQUESTED = "retry_requested"
# The engine's output broke the request's structured constraint (the worker checks every
# complete structured output before it is returned: workers/result.py). Retried only when
# another attempt can make another output (sampled without a seed); a greedy or seeded request
# would make the same one again, so it ends at once.
STRUCTURED_OUTPUT_INVALID = "structured_output_invalid"
# WorkerFatalError codes
CUDA_CONTEXT_LOST = "cuda_context_lost"
REPEATED_ENGINE_DEATH = "repeated_engine_death"
CANARY_FAILED = "canary_failed"
# This worker cannot start an engine for a model that another worker serves: its own copy of the
# weights, its configuration or its device is at fault, not the model or the request.
ENGINE_START_FAILED = "engine_start_failed"
# Terminal outcomes
DEADLINE_EXCEEDED = "deadline_exceeded"
JOB_DELETED = "job_deleted"
ATTEMPTS_EXHAUSTED = "attempts_exhausted"
# A batch's line that had not ended when its batch was cancelled, or when its completion window
# ran out (app/fleet/batch_tick.py).
BATCH_CANCELLED = "batch_cancelled"
# Its submitter (or an operator) cancelled it: `revoke()`, `vigil request cancel` (app/fleet/
# cancel.py).
CANCELLED = "cancelled"
BATCH_EXPIRED = "batch_expired"
# Raised by `r.get()` only: Redis has no record of the request any more (lost by a Redis crash
# inside the AOF fsync window, or expired after VIGIL_RESULT_TTL). Submitting it again is safe.
REQUEST_LOST = "request_lost"


class VigilError(Exception):
    """Root of Vigil's errors. `str(e)` is `"<code>: <detail>"`; `e.code` is the code.

    Constructed from the one message string so Celery's JSON exception transport (which calls
    `cls(*args)`) rebuilds it intact in the producer.

    What happens to a request after an error is decided in one place, app/retry_policy.py;
    `decision` is that decision once the worker made it (the task's retry path reads its delay).
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.decision = None

    @classmethod
    def of(cls, code: str, detail: str) -> "VigilError":
        """Build an error of this class with `code` and a human detail."""
        return cls(f"{code}: {detail}")

    @property
    def code(self) -> str:
        msg = str(self.args[0]) if self.args else ""
        return msg.split(":", 1)[0].strip() if ":" in msg else "unknown"

    @property
    def detail(self) -> str:
        msg = str(self.args[0]) if self.args else ""
        return msg.split(":", 1)[1].strip() if ":" in msg else msg


class RequestError(VigilError):
    """The request itself is wrong (bad input, unknown model, too long...). Never retried."""


class TransientError(VigilError):
    """The fleet was briefly unable to serve (memory squeeze, engine restart...). Retried with
    jittered backoff until `max_attempts`; then the request fails with `attempts_exhausted`.
    A wedged engine or a lost worker is retried at once; a pending adapter and a start refused
    for memory pressure give their attempt back (bounded by time, not attempts)
    (app/retry_policy.py)."""


class WorkerFatalError(VigilError):
    """This worker or its device is broken. Its in-flight requests are requeued elsewhere and the
    worker exits for its supervisor to restart. Not a verdict on the request: retried at once,
    on another worker (app/retry_policy.py)."""


class TerminalError(VigilError):
    """Vigil ended the request itself: deadline passed, job deleted, attempts used up. Final."""


ERROR_CLASSES: dict[str, type[VigilError]] = {
    c.__name__: c for c in (RequestError, TransientError, WorkerFatalError, TerminalError)
}


def error_from_record(kind: str, message: str) -> VigilError:
    """Rebuild the stored error of a finished request (used for duplicate deliveries)."""
    return ERROR_CLASSES.get(kind, TerminalError)(message)
