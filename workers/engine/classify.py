"""The one classifier at the engine boundary: any exception out of an engine -> a VigilError.

Ordered like vLLM's own front end: our own errors pass through; client errors the engine refused
are the request's fault (never retried); a dead engine or an allocation failure is the fleet's
(retried, bounded); a lost device context is the worker's. Anything unrecognised is treated as
transient: retrying an unknown failure a bounded number of times is cheaper than failing a good
request forever (a retryable signal is never turned permanent by a broad except).

vLLM's own failure types are read by name, each on its own (`vllm_failure_types`): whichever a
vLLM version lacks is left out, never the others; the worker logs which it recognises at its
first engine start (`log_recognised`, workers/engine/kinds.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import logging
import sys
from dataclasses import dataclass

from app.errors import (ALLOCATION_FAILED, CUDA_CONTEXT_LOST, ENGINE_ERROR, ENGINE_RESTARTING,
                        GENERATION_FAILED, INVALID_MODEL_CONFIG, INVALID_REQUEST,
                        MEMORY_PRESSURE, MODEL_NOT_FOUND, PROMPT_TOO_LONG, RETRY_REQUESTED,
                        TOKEN_OUT_OF_VOCAB, WEDGED, RequestError, TransientError, VigilError,
                        WorkerFatalError)

# Texts of a CUDA fault that leaves the device context unusable (torch's "CUDA error: ..."
# messages, raised as torch.AcceleratorError since torch 2.8; Triton's and the driver API's; NCCL
# wrapping one). Checked after the out-of-memory texts: "CUDA error: out of memory" is an
# allocation failure, after which the context still works.
_CUDA_FATAL = ("cuda error", "illegal memory access", "device-side assert", "cudaerror",
               "cuda_error_", "unspecified launch failure", "ecc error", "cuda driver error",
               "triton error [cuda]", "unhandled cuda error", "gpu is lost")
# Texts of a CUDA allocation failure: torch's OutOfMemoryError ("CUDA out of memory. Tried to
# allocate ..."), the runtime's cudaErrorMemoryAllocation ("CUDA error: out of memory"), cuBLAS'.
_CUDA_OOM = ("cuda out of memory", "outofmemoryerror", "cuda error: out of memory",
             "cudaerrormemoryallocation", "cublas_status_alloc_failed")
# vLLM's own start-up check (vllm/v1/worker/utils.py `request_memory`, 0.32 and 0.33): the budget
# was not free once EngineCore had its context (a co-tenant grew since the worker measured).
_START_MEMORY = ("on startup is less than",)
# vLLM's memory profiling assertion (vllm/v1/worker/gpu_worker.py, 0.32): free memory grew while
# it profiled, "when other processes sharing the same container release GPU memory": a co-tenant
# that went away during the start, which a later start does not meet.
_PROFILING = ("error in memory profiling",)


# Every vLLM failure type Vigil reads, by its role: (module, name). Each is imported on its own
# (`vllm_failure_types`), so a name that one vLLM version lacks never loses the others: vLLM
# 0.26 has no VLLMClientError, and one import statement for all four lost every one of them
# there (docs/field-notes.md, "vLLM versions"). GenerationError and RetryableRequestError: a
# request that vLLM ended with an error of its own (vllm/outputs.py `RequestError`), raised by
# AsyncLLM.generate from vLLM 0.33 (0.32 defines both but raises neither there).
VLLM_FAILURES: dict[str, tuple[str, str]] = {
    "validation": ("vllm.exceptions", "VLLMValidationError"),
    "refused": ("vllm.exceptions", "VLLMClientError"),
    "dead": ("vllm.v1.engine.exceptions", "EngineDeadError"),
    "generate": ("vllm.v1.engine.exceptions", "EngineGenerateError"),
    "retryable": ("vllm.exceptions", "RetryableRequestError"),
    "generation": ("vllm.exceptions", "GenerationError"),
}

log = logging.getLogger("vigil.engine")


@dataclass(frozen=True)
class VllmFailures:
    """The vLLM failure types this process's vLLM has, by role (VLLM_FAILURES); an empty tuple
    for a role whose type it lacks (an older vLLM, or none installed: a producer)."""

    validation: tuple = ()
    refused: tuple = ()
    dead: tuple = ()
    generate: tuple = ()
    retryable: tuple = ()
    generation: tuple = ()

    def names(self) -> tuple[list[str], list[str]]:
        """(the names recognised, the names this vLLM lacks), in VLLM_FAILURES' order."""
        have = [n for role, (_, n) in VLLM_FAILURES.items() if getattr(self, role)]
        lack = [n for role, (_, n) in VLLM_FAILURES.items() if not getattr(self, role)]
        return have, lack


def _vllm_type(module: str, name: str) -> tuple:
    """(the exception class `module.name`,), or () when the module or the name is missing."""
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:  # a producer-only install: no engine errors can occur there
        return ()
    return (found,) if isinstance(found, type) and issubclass(found, BaseException) else ()


@functools.lru_cache(maxsize=1)
def vllm_failure_types() -> VllmFailures:
    """The vLLM failure types this process recognises, each imported on its own; read once (a
    test that installs a stand-in vLLM calls `vllm_failure_types.cache_clear()`)."""
    return VllmFailures(**{role: _vllm_type(*where) for role, where in VLLM_FAILURES.items()})


def describe_recognised() -> str:
    """One line naming vLLM's version and the failure types recognised and lacking."""
    have, lack = vllm_failure_types().names()
    ver = getattr(sys.modules.get("vllm"), "__version__", None) or "unknown"
    return (f"vLLM {ver}: recognised failure types {', '.join(have) or 'none'}"
            + (f"; not in this vLLM: {', '.join(lack)}" if lack else ""))


@functools.lru_cache(maxsize=1)
def log_recognised() -> str:
    """Log `describe_recognised()` once per process (at its first engine start: vLLM is
    imported then anyway); returns the line."""
    line = describe_recognised()
    log.info("%s", line)
    return line


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:limit]


def classify(exc: BaseException) -> VigilError:
    """Map an engine-side exception to Vigil's taxonomy. Pure: no side effects."""
    if isinstance(exc, VigilError):
        return exc
    vt = vllm_failure_types()
    msg = _short(exc)
    low = msg.lower()
    if vt.validation and isinstance(exc, vt.validation):
        if ("maximum context length" in low or "maximum model length" in low
                or "max_model_len" in low):
            return RequestError.of(PROMPT_TOO_LONG, msg)
        if "out of vocabulary" in low:
            return RequestError.of(TOKEN_OUT_OF_VOCAB, msg)
        return RequestError.of(INVALID_REQUEST, msg)
    if vt.refused and isinstance(exc, vt.refused):
        return RequestError.of(INVALID_REQUEST, msg)
    if any(s in low for s in _CUDA_OOM):
        return TransientError.of(ALLOCATION_FAILED, msg)
    if any(s in low for s in _CUDA_FATAL):
        return WorkerFatalError.of(CUDA_CONTEXT_LOST, msg)
    if vt.dead and isinstance(exc, vt.dead):
        return TransientError.of(ENGINE_RESTARTING, "the engine died while serving this request; "
                                 "it is being restarted")
    # vLLM 0.33: a request vLLM ended with an error of its own, its engine healthy. Retryable
    # (a paused engine, a cache miss): this engine takes it again shortly (app/retry_policy.py
    # `retry_here`); any other: another worker may serve it (at once, through the queue).
    if vt.retryable and isinstance(exc, vt.retryable):
        return TransientError.of(RETRY_REQUESTED, f"vLLM asked for a retry: {msg}")
    if vt.generation and isinstance(exc, vt.generation):
        return TransientError.of(GENERATION_FAILED, f"vLLM ended the request with an error: "
                                 f"{msg}")
    if isinstance(exc, (asyncio.TimeoutError, concurrent.futures.TimeoutError, TimeoutError)):
        return TransientError.of(WEDGED, "no answer from the engine within the request timeout")
    if isinstance(exc, MemoryError) or "out of memory" in low:
        return TransientError.of(ALLOCATION_FAILED, msg)
    if vt.generate and isinstance(exc, vt.generate):
        cause = exc.__cause__ or exc
        return TransientError.of(ENGINE_ERROR, _short(cause))
    return TransientError.of(ENGINE_ERROR, f"{type(exc).__name__}: {msg}")


def classify_core_failure(logged: str, exitcodes: dict | None = None) -> VigilError | None:
    """What an engine's death was, from EngineCore's own failure (app/core_log.py: the error it
    logged on the way down, and its processes' exit codes): a CUDA allocation failure is
    `allocation_failed` (retried: memory, not the requests, ran out), any other CUDA fault
    `cuda_context_lost` (the worker leaves: its device is suspect). None when the failure says
    nothing of CUDA (a Python error, a SIGKILL that logged nothing): the requests that were in
    the engine are then suspects, and the recovery finds a guilty one (workers/engine/suspects.py).
    """
    low = logged.lower()
    if not low:
        return None
    why = _last_error_line(logged)
    exits = f"; exit codes {exitcodes}" if exitcodes else ""
    if any(s in low for s in _CUDA_OOM):
        return TransientError.of(ALLOCATION_FAILED, f"the engine ran out of GPU memory and "
                                 f"died (EngineCore logged: {why}{exits})")
    if any(s in low for s in _CUDA_FATAL):
        return WorkerFatalError.of(CUDA_CONTEXT_LOST, f"the engine died of a CUDA fault "
                                   f"(EngineCore logged: {why}{exits})")
    return None


def _last_error_line(logged: str) -> str:
    """The line naming the exception (a traceback's last "Name: message" line), else the last
    line, with the log line's prefix cut: short enough for an error message."""
    lines = [ln.strip() for ln in logged.splitlines() if ln.strip()]
    for ln in reversed(lines):
        body = ln.split("] ", 1)[-1] if ln.startswith("[") else ln
        head = body.split(":", 1)[0]
        if head.replace(".", "").replace("_", "").isalnum() and head[:1].isalpha() and \
                ("Error" in head or "Exception" in head):
            return " ".join(body.split())[:300]
    return " ".join((lines[-1] if lines else "").split())[:300]


def _line_with(logged: str, needles: tuple[str, ...]) -> str:
    """The first line of `logged` holding one of `needles` (lowercase), with the log line's
    prefix cut; the failure's last error line when none does. Where a tensor-parallel rank's
    failure is followed by EngineCore's, the rank's line names the cause."""
    for ln in logged.splitlines():
        if any(n in ln.lower() for n in needles):
            body = ln.strip()
            body = body.split("] ", 1)[-1] if body.startswith("[") else body
            return " ".join(body.split())[:300]
    return _last_error_line(logged)


def death_cause(engine) -> VigilError | None:
    """A dead engine's cause, when the engine can tell one (`death_cause()`: a CUDA fault its
    EngineCore logged), else None."""
    read = getattr(engine, "death_cause", None)
    try:
        cause = read() if read is not None else None
    except Exception:  # reading the log must never hide the death itself
        return None
    return type(cause)(str(cause)) if cause is not None else None


def is_engine_dead(exc: BaseException) -> bool:
    """True when `exc` means the engine can serve nothing more and must be rebuilt."""
    dead = vllm_failure_types().dead
    return bool(dead) and isinstance(exc, dead)


_MISSING_MODEL = ("does not exist", "no such file", "not a local folder", "repo id must",
                  "repository not found", "cannot find the requested files")


def classify_load_failure(exc: BaseException, plan=None, planner=None, spec=None) -> VigilError:
    """Map an engine start failure to the taxonomy, using the worker's own memory measurement
    as the discriminator (vLLM reports a squeeze and a broken model alike, docs/field-notes.md).

    - the start was sized below the registry's request (`plan.sized_down`), or a fresh
      measurement after the failure shows the memory gone -> TransientError(memory_pressure);
    - vLLM's processes logged a CUDA out of memory, vLLM's own free-memory check failing, or
      its memory profiling finding free memory grown (`StartFailure.logged`: EngineCore's
      account, or a tensor-parallel WorkerProc's before it) -> TransientError(memory_pressure),
      even with the full request granted: a co-tenant may have come and gone during the start;
    - an ImportError -> TransientError(engine_error): the worker's install or an import race
      in it, not the model; retried, bounded by the attempts;
    - otherwise the failure is deterministic: missing weights -> RequestError(model_not_found),
      anything else -> RequestError(invalid_model_config). Neither is retried.
    """
    if isinstance(exc, VigilError):
        return exc
    logged = getattr(exc, "logged", "")  # EngineCore's own account (StartFailure, kinds.py)
    exc = getattr(exc, "cause", exc)
    if isinstance(exc, VigilError):
        return exc
    cause = _short(exc)
    low_logged = logged.lower()
    if logged and any(s in low_logged for s in _CUDA_OOM + _START_MEMORY):
        # Out of memory while starting, or vLLM's own check found its budget taken: memory,
        # whoever held it (a co-tenant that came and went), retried in the pressure window.
        return TransientError.of(MEMORY_PRESSURE, (
            f"the engine start ran out of GPU memory (vLLM logged: "
            f"{_line_with(logged, _CUDA_OOM + _START_MEMORY)}); if the card was idle, the model "
            f"does not fit its budget (lower max_model_len or max_num_seqs, or raise "
            f"gpu_memory_utilization)"))
    if logged and any(s in low_logged for s in _PROFILING):
        return TransientError.of(MEMORY_PRESSURE, (
            f"another process's GPU memory changed while vLLM measured its own at start (vLLM "
            f"logged: {_line_with(logged, _PROFILING)}); retried once the card is steady"))
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
    if isinstance(exc, ImportError):
        # This process could not import the engine's code: its install, or two of its threads
        # importing vLLM/transformers at once (app/first_imports.py). Not the model's fault:
        # retried, bounded; a package truly missing ends `attempts_exhausted` naming it.
        return TransientError.of(ENGINE_ERROR, f"the engine's code could not be imported in "
                                 f"this worker: {type(exc).__name__}: {cause}")
    low = cause.lower()
    if isinstance(exc, FileNotFoundError) or any(s in low for s in _MISSING_MODEL) or \
            type(exc).__name__ in ("HFValidationError", "LocalEntryNotFoundError",
                                   "RepositoryNotFoundError"):
        return RequestError.of(MODEL_NOT_FOUND, f"the model's files could not be loaded: {cause}")
    why = ("the engine failed to start although the memory it asked for was free, so the model "
           "or its configuration is at fault" if plan is not None else "the engine failed to start")
    return RequestError.of(INVALID_MODEL_CONFIG, f"{why}: {type(exc).__name__}: {cause}")
