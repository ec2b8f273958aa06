"""Unit tier: a fresh engine that serves adapters on CUDA runs its LoRA lane once, through a
zero warm-up adapter, before any request enters it (workers/engine/warm_up.py, the engine slot's
`warm_up`): no user's first adapter request compiles vLLM's LoRA kernels (issue 39: ~25 s on
the H200). Fake engines record what runs in them; the memory plans are faked CUDA cards; the
adapter is built for tiny-llama's real config and read back with safetensors."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from safetensors import safe_open

from app.requests.model_files import ensure_model_files
from app.requests.models import ModelSpec
from app.requests.schemas import GenerateRequest
from tests.fake_nvml import GiB, FakeCard, FakeNvml
from workers.engine.memory import plan_memory, probe_memory
from workers.engine.output import EngineOutput
from workers.engine.warm_up import WARM_ADAPTER, warm_adapter_dir, warms_lora


class Recording:
    """Answers everything at once; records each run (its id, its adapter) and adapter change."""

    def __init__(self, spec, log):
        self.spec, self.log, self.dead = spec, log, False

    async def run(self, r, rid, adapter=None):
        await asyncio.sleep(0)
        self.log.append(("run", rid, adapter.name if adapter else None))
        return EngineOutput(self.spec.name, [1], "length", 1)

    async def add_adapter(self, ref):
        self.log.append(("add", ref.name))

    async def remove_adapter(self, ref):
        self.log.append(("remove", ref.name))

    def child_pids(self):
        return []

    def shutdown(self, timeout):
        pass


def cuda(spec):
    return plan_memory(spec, probe_memory("cuda", ("0",), FakeNvml([FakeCard(70 * GiB)])))


def _host(make_host, spec, planner):
    log: list = []
    return make_host(lambda s, plan=None: Recording(s, log), planner=planner), log


def test_a_lora_engine_on_cuda_warms_its_lane_before_the_first_request(make_host, tmp_path):
    spec = ModelSpec(name="tiny-llama", path=str(tmp_path / "models" / "tiny-llama-v1"),
                     builder="tiny-llama", max_loras=2, max_lora_rank=8, memory_gib=2)
    host, log = _host(make_host, spec, cuda)
    host.generate(GenerateRequest(model="tiny-llama", prompt="hi", max_tokens=1), spec, "r-1", 10)
    assert log == [("run", "vigil-canary-warm-base", None), ("add", WARM_ADAPTER),
                   ("run", "vigil-canary-warm-lora", WARM_ADAPTER), ("remove", WARM_ADAPTER),
                   ("run", "r-1", None)]


def test_no_warm_up_without_adapters_or_on_the_cpu(make_host):
    for spec, planner in ((ModelSpec(name="m", max_loras=0, memory_gib=2), cuda),
                          (ModelSpec(name="m", max_loras=2, memory_gib=2), None)):
        host, log = _host(make_host, spec, planner)
        host.generate(GenerateRequest(model="m", prompt="hi", max_tokens=1), spec, "r-1", 10)
        assert log == [("run", "r-1", None)]
    assert warms_lora(ModelSpec(name="m", max_loras=1), "cuda")
    assert not warms_lora(ModelSpec(name="m", max_loras=1), "cpu")


def test_a_warm_up_that_fails_never_keeps_the_engine_from_serving(make_host):
    spec = ModelSpec(name="m", path="/nonexistent/model", max_loras=2, memory_gib=2)
    host, log = _host(make_host, spec, cuda)
    out = host.generate(GenerateRequest(model="m", prompt="hi", max_tokens=1), spec, "r-1", 10)
    assert out.token_ids == [1] and log[-1] == ("run", "r-1", None)
    assert ("add", WARM_ADAPTER) not in log  # the adapter could not be built: served cold


def test_the_warm_up_adapter_is_zeros_on_every_projection_at_the_engines_rank(tmp_path):
    spec = ModelSpec(name="tiny-llama", path=str(tmp_path / "models" / "tiny-llama-v1"),
                     builder="tiny-llama")
    model = Path(ensure_model_files(spec))
    cfg = json.loads((model / "config.json").read_text())
    dest = warm_adapter_dir(model, 8, tmp_path / "warm")
    assert warm_adapter_dir(model, 8, tmp_path / "warm") == dest  # built once
    conf = json.loads((dest / "adapter_config.json").read_text())
    assert conf["r"] == 8 and set(conf["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with safe_open(str(dest / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert len(keys) == cfg["num_hidden_layers"] * 7 * 2
        down_a = f.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
        q_b = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
        assert tuple(down_a.shape) == (8, cfg["intermediate_size"])
        assert tuple(q_b.shape) == (cfg["hidden_size"], 8)
        assert all(not f.get_tensor(k).any() for k in keys)
