"""Unit tier: the worker's memory probe and the sizing of engine starts, and how a failed start
is classified from that measurement (memory_pressure vs the model's fault)."""
from __future__ import annotations

import pytest

from app.errors import RequestError, TransientError
from app.requests.models import ModelSpec
from workers.engine.classify import classify_load_failure
from workers.engine.host import EngineHost
from workers.engine.memory import GiB, MemoryProbe, plan_memory, probe_memory, worker_device
from tests.unit_helpers import callback_events

SPEC = ModelSpec(name="m", memory_gib=2.0, kv_cache_gib=1.0, kv_cache_floor_gib=0.25)


def cpu(free_gib: float, total_gib: float = 16.0) -> MemoryProbe:
    return MemoryProbe("cpu", int(free_gib * GiB), int(total_gib * GiB), "node-meminfo")


def gpu(free_gib: float, total_gib: float = 80.0) -> MemoryProbe:
    return MemoryProbe("cuda", int(free_gib * GiB), int(total_gib * GiB), "nvml")


@pytest.fixture(autouse=True)
def _no_operator_kv_size(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def test_with_room_the_cpu_kv_cache_gets_the_full_request():
    plan = plan_memory(SPEC, cpu(10))
    assert plan.granted == plan.requested == GiB and not plan.sized_down
    assert plan.engine_args == {"kv_cache_memory_bytes": GiB}


def test_short_of_room_the_cpu_kv_cache_is_sized_down_to_what_is_free():
    plan = plan_memory(SPEC, cpu(2.5))  # 0.5 GiB left after the model's other needs
    assert plan.sized_down and plan.granted == GiB // 2
    assert plan.engine_args == {"kv_cache_memory_bytes": GiB // 2}


def test_below_the_floor_no_start_is_attempted_and_it_is_memory_pressure():
    with pytest.raises(TransientError, match="^memory_pressure: not enough free memory"):
        plan_memory(SPEC, cpu(2.1))


def test_an_operators_fixed_cpu_kv_size_is_granted_in_full_or_refused(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    plan = plan_memory(SPEC, cpu(10))
    assert plan.granted == 4 * GiB and plan.engine_args == {}
    with pytest.raises(TransientError, match="^memory_pressure: "):
        plan_memory(SPEC, cpu(5))


def test_on_a_gpu_the_budget_shrinks_to_what_is_free():
    full = plan_memory(SPEC, gpu(79))
    assert not full.sized_down and full.engine_args == {}
    squeezed = plan_memory(SPEC, gpu(40))  # another process holds half the card
    assert squeezed.sized_down
    util = squeezed.engine_args["gpu_memory_utilization"]
    assert 0.45 < util < 0.5
    with pytest.raises(TransientError, match="^memory_pressure: "):
        plan_memory(SPEC, gpu(2))  # less than the weights plus the smallest KV cache


def test_the_cpu_probe_reads_the_node_meminfo_vllm_reads():
    device, node = worker_device()
    assert device == "cpu"
    p = probe_memory(device, node)
    assert p.source in ("node-meminfo", "psutil") and 0 < p.free <= p.total


def test_a_failed_start_after_sizing_down_is_memory_pressure():
    plan = plan_memory(SPEC, cpu(2.5))
    err = classify_load_failure(RuntimeError("Engine core initialization failed."), plan)
    assert isinstance(err, TransientError) and err.code == "memory_pressure"


def test_a_failed_start_with_the_full_request_granted_is_the_models_fault():
    plan = plan_memory(SPEC, cpu(10))
    err = classify_load_failure(RuntimeError("Engine core initialization failed."), plan,
                                lambda s: plan_memory(s, cpu(10)), SPEC)
    assert isinstance(err, RequestError) and err.code == "invalid_model_config"
    missing = classify_load_failure(FileNotFoundError("/models/x/config.json"), plan)
    assert isinstance(missing, RequestError) and missing.code == "model_not_found"


def test_a_start_that_could_not_import_the_engines_code_is_retried_not_the_models_fault():
    """An ImportError at start (a broken install, or transformers' lazy names raced by two
    threads: app/first_imports.py) with the memory all there is `engine_error`, retried; before,
    it was `invalid_model_config` and ended every request waiting for the start."""
    plan = plan_memory(SPEC, cpu(10))
    raced = ImportError("cannot import name 'PreTrainedConfig' from 'transformers'")
    for exc in (raced, ModuleNotFoundError("No module named 'flash_attn'")):
        err = classify_load_failure(exc, plan, lambda s: plan_memory(s, cpu(10)), SPEC)
        assert isinstance(err, TransientError) and err.code == "engine_error", err
        assert type(exc).__name__ in str(err)


def test_memory_that_vanished_during_the_start_makes_it_memory_pressure():
    """The probe said there was room, but a fresh measurement after the failure says the memory
    went while the engine was starting: not the model's fault."""
    plan = plan_memory(SPEC, cpu(10))
    err = classify_load_failure(RuntimeError("Engine core initialization failed."), plan,
                                lambda s: plan_memory(s, cpu(2.5)), SPEC)
    assert isinstance(err, TransientError) and err.code == "memory_pressure"


def test_the_host_sizes_each_start_and_shares_a_memory_pressure_refusal():
    """Given a planner that measures no room, then the engine is never built and the request
    gets memory_pressure (retryable); once room appears the next request builds it with the
    planned engine args."""
    free = [2.0]
    built = []

    class Engine:
        dead = False

        def __init__(self, spec, plan):
            built.append(plan.engine_args)

        async def run(self, r, rid):
            from workers.engine.output import EngineOutput

            return EngineOutput("ok", [1], "length", 1)

        def child_pids(self):
            return []

        def shutdown(self, timeout):
            pass

    from app.requests.schemas import GenerateRequest

    host = EngineHost(Engine, idle_cleanup=0, events=callback_events(
        planner=lambda s: plan_memory(s, cpu(free[0])))).start()
    try:
        r = GenerateRequest(model="m", prompt="hi")
        with pytest.raises(TransientError, match="^memory_pressure: "):
            host.generate(r, SPEC, "a", 5)
        assert built == []
        free[0] = 12.0
        assert host.generate(r, SPEC, "b", 5).text == "ok"
        assert built == [{"kv_cache_memory_bytes": GiB}]
    finally:
        host.shutdown(1)
