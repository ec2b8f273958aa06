"""Shared by the platform tests (tests/test_engine_platforms.py, tests/test_pool_card_counts.py):
a memory plan over faked NVML cards (an H200 by default) and tiny-llama's registry entry."""
from __future__ import annotations



from app.requests.models import ModelSpec, load_registry
from app.settings import load_settings
from tests.fake_nvml import FakeCard, FakeNvml
from workers.engine.memory import GiB, plan_memory, probe_memory

H200 = dict(total=141 * GiB, name="NVIDIA H200")


def cuda_plan(spec: ModelSpec, n: int = 1, free: int = 139 * GiB, **card):
    card = card or H200
    return plan_memory(spec, probe_memory("cuda", tuple(str(i) for i in range(n)),
                                          FakeNvml([FakeCard(free, **card) for _ in range(n)])))


def tiny(settings=None):
    return load_registry(settings or load_settings()).get("tiny-llama")
