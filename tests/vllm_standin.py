"""A stand-in vLLM for the classifier's tests: `vllm.exceptions` and `vllm.v1.engine.exceptions`
put in sys.modules with only the names a given vLLM version has, so a test sees what the
worker's classifier (workers/engine/classify.py) reads under that version. Built from the real
vLLM 0.32 classes where the version has them, plus 0.33's two new ones, shaped as in 0.33's
vllm/exceptions.py (GenerationError a server error, RetryableRequestError a GenerationError)."""
from __future__ import annotations

import sys
import types

from vllm import exceptions as real
from vllm.v1.engine import exceptions as real_engine


class GenerationError(real.VLLMServerError):
    """vLLM 0.33's: a request vLLM ended with an internal error (HTTP 500)."""

    def __init__(self, message: str = "Internal server error"):
        super().__init__(message)


class RetryableRequestError(GenerationError):
    """vLLM 0.33's: a transient request-level failure that is safe to retry (HTTP 503)."""

    def __init__(self, message: str = "Request failed; please retry"):
        super().__init__(message)


# What each version's two modules hold, of the names Vigil reads.
V0_26 = {"vllm.exceptions": {"VLLMValidationError": real.VLLMValidationError},
         "vllm.v1.engine.exceptions": {"EngineDeadError": real_engine.EngineDeadError,
                                       "EngineGenerateError": real_engine.EngineGenerateError}}
V0_33 = {"vllm.exceptions": {"VLLMValidationError": real.VLLMValidationError,
                             "VLLMClientError": real.VLLMClientError,
                             "GenerationError": GenerationError,
                             "RetryableRequestError": RetryableRequestError},
         "vllm.v1.engine.exceptions": {"EngineDeadError": real_engine.EngineDeadError,
                                       "EngineGenerateError": real_engine.EngineGenerateError}}


def install(monkeypatch, version: dict) -> None:
    """Put `version`'s two modules in sys.modules for this test (monkeypatch restores them) and
    make the classifier read them afresh; call `forget()` after the test."""
    for name, names in version.items():
        mod = types.ModuleType(name)
        for attr, cls in names.items():
            setattr(mod, attr, cls)
        monkeypatch.setitem(sys.modules, name, mod)
    forget()


def forget() -> None:
    """Make the classifier read vLLM's modules afresh (the real ones once monkeypatch restored
    them). Works on a classifier that reads them every time too (nothing to clear)."""
    from workers.engine import classify

    clear = getattr(getattr(classify, "vllm_failure_types", None), "cache_clear", None)
    if clear is not None:
        clear()
