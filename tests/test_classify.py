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


# -- vLLM versions: each name read on its own (tests/vllm_standin.py) ---------------------------
@pytest.fixture
def vllm_version(monkeypatch):
    """Use a stand-in vLLM's exception modules in this test; the real ones again after."""
    from tests.vllm_standin import forget, install

    yield lambda version: install(monkeypatch, version)
    forget()


def test_a_vllm_without_client_error_still_maps_death_and_validation(vllm_version):
    # vLLM 0.26 has no VLLMClientError: the classifier imported all four names in one
    # statement and, at its ImportError, lost every one (issue 39, seen on the H200 host).
    from tests.vllm_standin import V0_26

    vllm_version(V0_26)
    dead = classify(EngineDeadError())
    assert (type(dead), dead.code) == (TransientError, "engine_restarting")
    assert is_engine_dead(EngineDeadError())
    long = classify(VLLMValidationError("This model's maximum context length is 512 tokens"))
    assert (type(long), long.code) == (RequestError, "prompt_too_long")
    oov = classify(VLLMValidationError("Token id 5000 is out of vocabulary"))
    assert (type(oov), oov.code) == (RequestError, "token_out_of_vocab")
    bad = classify(VLLMValidationError("The decoder prompt cannot be empty"))
    assert (type(bad), bad.code) == (RequestError, "invalid_request")


def test_vllm_0_33s_generation_errors_map_to_their_codes(vllm_version):
    from tests.vllm_standin import V0_33, GenerationError, RetryableRequestError

    vllm_version(V0_33)
    again = classify(RetryableRequestError("Generation is paused. Please retry after it resumes."))
    assert (type(again), again.code) == (TransientError, "retry_requested")
    assert "paused" in again.detail
    failed = classify(GenerationError("KV cache load failed"))
    assert (type(failed), failed.code) == (TransientError, "generation_failed")
    assert "KV cache load failed" in failed.detail
    # the older names are still read beside them
    assert classify(EngineDeadError()).code == "engine_restarting"
    assert classify(VLLMValidationError("Token id 5000 is out of vocabulary")).code == \
        "token_out_of_vocab"


def test_the_startup_line_names_what_this_vllm_has_and_lacks(vllm_version):
    from tests.vllm_standin import V0_26
    from workers.engine.classify import describe_recognised

    vllm_version(V0_26)
    line = describe_recognised()
    have, lack = line.split("; not in this vLLM: ")
    assert "VLLMValidationError" in have and "EngineDeadError" in have
    assert "EngineGenerateError" in have and "VLLMClientError" not in have
    assert set(lack.split(", ")) == {"VLLMClientError", "GenerationError",
                                     "RetryableRequestError"}


def test_the_installed_vllm_is_read_whole():
    # vLLM 0.32 (this machine's) defines all six (GenerationError and RetryableRequestError
    # already, though its AsyncLLM raises neither: 0.33's does): none lost.
    from workers.engine.classify import VLLM_FAILURES, vllm_failure_types

    have, lack = vllm_failure_types().names()
    assert have == [name for _, name in VLLM_FAILURES.values()] and lack == []
