"""Unit tier: a request vLLM asked to be retried (vLLM 0.33's RetryableRequestError, read by the
classifier as `retry_requested`) runs again on the worker's own engine, a bounded number of
times (app/retry_policy.py `retry_here`), before the error leaves the worker; vLLM's
GenerationError (`generation_failed`) leaves at once. Fake engines (no model); the exception
types are a stand-in vLLM 0.33's (tests/vllm_standin.py)."""
from __future__ import annotations

import asyncio

import pytest

from app.errors import TransientError
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from app.retry_policy import RETRY_HERE
from tests.vllm_standin import V0_33, GenerationError, RetryableRequestError, forget, install
from workers.engine.output import EngineOutput

SPEC = ModelSpec(name="model-a")


class Refusing:
    """Raises `errors` in turn, one per run, then answers; counts its runs."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.runs = 0
        self.dead = False

    async def run(self, r, rid):
        self.runs += 1
        await asyncio.sleep(0)
        if self.errors:
            raise self.errors.pop(0)
        return EngineOutput(SPEC.name, [1, 2], "length", 1)

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        pass


@pytest.fixture
def vllm_0_33(monkeypatch):
    install(monkeypatch, V0_33)
    yield
    forget()


def _host(make_host, engine):
    built = []

    def factory(spec, plan=None):
        built.append(spec.name)
        return engine

    return make_host(factory), built


def test_a_retry_vllm_asked_for_runs_again_on_the_same_engine(make_host, vllm_0_33):
    engine = Refusing([RetryableRequestError("Generation is paused. Please retry after it "
                                             "resumes.")] * 2)
    host, built = _host(make_host, engine)
    out = host.generate(GenerateRequest(model="model-a", prompt="hi", max_tokens=2), SPEC,
                        "r-1", 10)
    assert out.token_ids == [1, 2]
    assert engine.runs == 3 and built == ["model-a"]  # one engine, no restart
    assert host.stats.restarts == 0 and host.snapshot()["in_flight"] == 0


def test_past_its_re_runs_here_the_retry_leaves_the_worker(make_host, vllm_0_33):
    engine = Refusing([RetryableRequestError()] * (RETRY_HERE + 1))
    host, _ = _host(make_host, engine)
    with pytest.raises(TransientError) as e:
        host.generate(GenerateRequest(model="model-a", prompt="hi", max_tokens=2), SPEC,
                      "r-2", 10)
    assert e.value.code == "retry_requested"
    assert engine.runs == RETRY_HERE + 1 and host.snapshot()["in_flight"] == 0


def test_a_generation_error_leaves_at_once(make_host, vllm_0_33):
    engine = Refusing([GenerationError("KV cache load failed")])
    host, _ = _host(make_host, engine)
    with pytest.raises(TransientError) as e:
        host.generate(GenerateRequest(model="model-a", prompt="hi", max_tokens=2), SPEC,
                      "r-3", 10)
    assert e.value.code == "generation_failed" and engine.runs == 1
