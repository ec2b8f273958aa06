"""The one classifier at the engine boundary: any exception out of an engine -> a VigilError.

Ordered like vLLM's own front end: our own errors pass through; client errors the engine refused
are the request's fault (never retried); a dead engine or an allocation failure is the fleet's
(retried, bounded); a lost device context is the worker's. Anything unrecognised is treated as
transient: retrying an unknown failure a bounded number of times is cheaper than failing a good
request forever (a retryable signal is never turned permanent by a broad except).
"""
from __future__ import annotations

import asyncio
import concurrent.futures

from app.errors import (ALLOCATION_FAILED, CUDA_CONTEXT_LOST, ENGINE_ERROR, ENGINE_RESTARTING,
                        INVALID_MODEL_CONFIG, INVALID_REQUEST, MEMORY_PRESSURE, MODEL_NOT_FOUND,
                        PROMPT_TOO_LONG, TOKEN_OUT_OF_VOCAB, WEDGED, RequestError, TransientError,
                        VigilError, WorkerFatalError)

_CUDA_FATAL = ("cuda error", "illegal memory access", "device-side assert", "cudaerror",
               "cuda_error_illegal_address")


def _vllm_types():
    try:
        from vllm.exceptions import VLLMClientError, VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
    except ImportError:  # a producer-only install: no engine errors can occur there
        return (), (), (), ()
    return (VLLMValidationError,), (VLLMClientError,), (EngineDeadError,), (EngineGenerateError,)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:limit]


def classify(exc: BaseException) -> VigilError:
    """Map an engine-side exception to Vigil's taxonomy. Pure: no side effects."""
    if isinstance(exc, VigilError):
        return exc
    validation, client, dead, generate = _vllm_types()
    msg = _short(exc)
    low = msg.lower()
    if validation and isinstance(exc, validation):
        if ("maximum context length" in low or "maximum model length" in low
                or "max_model_len" in low):
            return RequestError.of(PROMPT_TOO_LONG, msg)
        if "out of vocabulary" in low:
            return RequestError.of(TOKEN_OUT_OF_VOCAB, msg)
        return RequestError.of(INVALID_REQUEST, msg)
    if client and isinstance(exc, client):
        return RequestError.of(INVALID_REQUEST, msg)
    if any(s in low for s in _CUDA_FATAL):
        return WorkerFatalError.of(CUDA_CONTEXT_LOST, msg)
    if dead and isinstance(exc, dead):
        return TransientError.of(ENGINE_RESTARTING, "the engine died while serving this request; "
                                 "it is being restarted")
    if isinstance(exc, (asyncio.TimeoutError, concurrent.futures.TimeoutError, TimeoutError)):
        return TransientError.of(WEDGED, "no answer from the engine within the request timeout")
    if isinstance(exc, MemoryError) or "out of memory" in low:
        return TransientError.of(ALLOCATION_FAILED, msg)
    if generate and isinstance(exc, generate):
        cause = exc.__cause__ or exc
        return TransientError.of(ENGINE_ERROR, _short(cause))
    return TransientError.of(ENGINE_ERROR, f"{type(exc).__name__}: {msg}")


def is_engine_dead(exc: BaseException) -> bool:
    """True when `exc` means the engine can serve nothing more and must be rebuilt."""
    _, _, dead, _ = _vllm_types()
    return bool(dead) and isinstance(exc, dead)


_MISSING_MODEL = ("does not exist", "no such file", "not a local folder", "repo id must",
                  "repository not found", "cannot find the requested files")


def classify_load_failure(exc: BaseException, plan=None, planner=None, spec=None) -> VigilError:
    """Map an engine start failure to the taxonomy, using the worker's own memory measurement
    as the discriminator (vLLM reports a squeeze and a broken model alike, docs/field-notes.md).

    - the start was sized below the registry's request (`plan.sized_down`), or a fresh
      measurement after the failure shows the memory gone -> TransientError(memory_pressure);
    - otherwise the failure is deterministic: missing weights -> RequestError(model_not_found),
      anything else -> RequestError(invalid_model_config). Neither is retried.
    """
    if isinstance(exc, VigilError):
        return exc
    cause = _short(exc)
    if plan is not None and plan.sized_down:
        return TransientError.of(MEMORY_PRESSURE, f"engine start failed after sizing below the "
                                 f"request ({plan.describe()}): {cause}")
    if planner is not None and spec is not None:
        try:
            again = planner(spec)
        except TransientError as e:  # the memory went while the engine was starting
            return TransientError.of(MEMORY_PRESSURE, f"{e.detail}; the start failed: {cause}")
        except Exception:  # a probe failure says nothing about the model
            again = None
        if again is not None and again.sized_down:
            return TransientError.of(MEMORY_PRESSURE, f"free memory fell during the start "
                                     f"({again.describe()}): {cause}")
    low = cause.lower()
    if isinstance(exc, FileNotFoundError) or any(s in low for s in _MISSING_MODEL) or \
            type(exc).__name__ in ("HFValidationError", "LocalEntryNotFoundError",
                                   "RepositoryNotFoundError"):
        return RequestError.of(MODEL_NOT_FOUND, f"the model's files could not be loaded: {cause}")
    why = ("the engine failed to start although the memory it asked for was free, so the model "
           "or its configuration is at fault" if plan is not None else "the engine failed to start")
    return RequestError.of(INVALID_MODEL_CONFIG, f"{why}: {type(exc).__name__}: {cause}")
