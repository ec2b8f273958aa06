"""Unit tier: the one classifier at the engine boundary, fed the real vLLM exception types."""
from __future__ import annotations

import concurrent.futures

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from app.errors import RequestError, TransientError, WorkerFatalError
from workers.engine.classify import classify, is_engine_dead


@pytest.mark.parametrize("exc, cls, code", [
    (VLLMValidationError("This model's maximum context length is 512 tokens. However, your "
                         "prompt contains at least 513 input tokens"), RequestError, "prompt_too_long"),
    (VLLMValidationError("Token id 5000 is out of vocabulary"), RequestError, "token_out_of_vocab"),
    (VLLMValidationError("The decoder prompt cannot be empty"), RequestError, "invalid_request"),
    (EngineDeadError(), TransientError, "engine_restarting"),
    (concurrent.futures.TimeoutError(), TransientError, "wedged"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), WorkerFatalError,
     "cuda_context_lost"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), TransientError, "allocation_failed"),
    (KeyError("surprise"), TransientError, "engine_error"),
])
def test_engine_exceptions_map_to_one_taxonomy(exc, cls, code):
    err = classify(exc)
    assert type(err) is cls and err.code == code


def test_engine_generate_error_reports_its_cause():
    try:
        try:
            raise ValueError("bad tensor")
        except ValueError as inner:
            raise EngineGenerateError() from inner
    except EngineGenerateError as e:
        err = classify(e)
    assert isinstance(err, TransientError) and "bad tensor" in str(err)


def test_vigil_errors_pass_through_unchanged():
    e = RequestError("invalid_request: x")
    assert classify(e) is e


def test_engine_dead_is_recognised():
    assert is_engine_dead(EngineDeadError()) and not is_engine_dead(RuntimeError())
