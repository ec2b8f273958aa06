"""The one classifier at the engine boundary: any exception out of an engine -> a VigilError.

Ordered like vLLM's own front end: our own errors pass through; client errors the engine refused
are the request's fault (never retried); a dead engine or an allocation failure is the fleet's
(retried, bounded); a lost device context is the worker's. Anything unrecognised is treated as
transient: retrying an unknown failure a bounded number of times is cheaper than failing a good
request forever (STYLE.md: a retryable signal is never turned permanent by a broad except).
"""
from __future__ import annotations

import asyncio
import concurrent.futures

from app.errors import (
    ALLOCATION_FAILED, CUDA_CONTEXT_LOST, ENGINE_ERROR, ENGINE_RESTARTING, INVALID_REQUEST,
    PROMPT_TOO_LONG,
    TOKEN_OUT_OF_VOCAB, WEDGED, RequestError, TransientError, VigilError, WorkerFatalError,
)

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
        if "maximum context length" in low or "max_model_len" in low:
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
